"""Ditto (Li, Hu, Beirami and Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, Algorithm 1): a global model by FedAvg, and on every client a
personal model v_k that minimizes its loss plus lambda/2 ||v_k - w^t||^2 towards the round's
global model w^t (eq. 2).

FedAvg's distributor, aggregator and finalizer; the client work keeps v_k as the client's
state (`stateful_client_work`): each sampled client trains the global model as FedAvg's
clients do and uploads its update, and takes SGD steps on its personal model with the
proximal gradient lambda (v_k - w^t) (Algorithm 1, lines 7-8), which never leaves it.

Lambda per device (`--ditto_lambda_choice=per_device`, the paper's experiments: each device
selects lambda from {0.1, 1, 2} on its own validation data, and one with under 4 validation
examples keeps lambda = 1): a client holds out a seeded validation part of its training
examples (`validation_split`: a random 10%, the paper's split at the authors' code's size;
neither model trains on it) and,
each round it is sampled, trains its personal model once per candidate on the same batches
and keeps the one of lowest validation loss (the authors' `--dynamic_lam`'s criterion) with
its lambda. The authors' code chooses at every personal step instead (one step per
candidate); a round's choice is this library's. `fixed`: one lambda for every client.

A personal model starts (Algorithm 1's v_k^0, which the paper leaves open) from the round's
global model the first time its client is sampled (`first_round`: the centre of its eq. 2
sub-problem), or from the initial global model w^0 (`w0`, the authors' code,
`fedbase.py`); a client never sampled has none and uses the global model.

The authors' code takes the personal and the global steps on the same minibatches, one of
each in turn; the two chains do not interact within a round, so here the personal steps run
after the global ones, on a second pass over the client's dataset (`ditto_personal_steps` 0)
or on that many of its batches: the same examples and epochs, in the dataset's next seeded
shuffle, while the global pass is FedAvg's exactly (with a per-device lambda, FedAvg's on
the examples the client does not hold out).
"""

import collections
import dataclasses

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.algorithms import fedavg
from tff_ens.algorithms import own_models
from tff_ens.settings import setting
from tff_ens.templates import built as built_lib
from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import composition
from tff_ens.templates import server_optimizer
from tff_ens.templates import stateful_client_work
from tff_ens.templates import transport as transport_lib

ModelWeights = tff.learning.models.ModelWeights


@settings.group
class Settings:
  """Ditto's personal models."""

  ditto_lambda_choice: str = setting(
    "per_device",
    "Ditto: per_device (each client picks lambda from --ditto_lambda_candidates on its own "
    "validation data, as the paper's experiments) or fixed (--ditto_lambda for every client, "
    "the authors' scripts).",
    choices=("per_device", "fixed"),
    before="fixed",
  )
  ditto_lambda: float = setting(
    1.0,
    "Ditto's lambda, the pull of each personal model towards the global one (eq. 2): every "
    "client's with --ditto_lambda_choice=fixed, else that of a client with fewer than "
    "--ditto_min_validation validation examples (1: the paper's and the authors' scripts').",
    at_least=0,
  )
  ditto_lambda_candidates: str = setting(
    "0.1,1,2",
    "Ditto per_device: the lambdas a client tries, comma-separated (the paper's 0.1,1,2).",
  )
  ditto_lambda_metric: str = setting(
    "loss",
    "Ditto per_device: a client keeps the lambda of the lowest validation loss (the authors' "
    "code; the paper says only 'based on its local validation data') or highest accuracy.",
    choices=("loss", "accuracy"),
  )
  ditto_validation_fraction: float = setting(
    0.1,
    "Ditto per_device: the part of a client's training examples it holds out, seeded, for "
    "choosing lambda (0.1: the authors' code's; at least 1 example and 1 left to train).",
    above=0,
    below=1,
  )
  ditto_validation_examples: str = setting(
    "random",
    "Ditto per_device: which examples a client holds out: a seeded random part (random, the "
    "paper's) or its last ones (last, the authors' code's).",
    choices=("random", "last"),
  )
  ditto_min_validation: int = setting(
    4,
    "Ditto per_device: a client with fewer validation examples takes --ditto_lambda (the "
    "paper's 4).",
    above=0,
  )
  ditto_personal_start: str = setting(
    "first_round",
    "Ditto: a personal model starts from the global model of its client's first sampled "
    "round (first_round: the centre of its eq. 2 sub-problem; the paper leaves v_k^0 open) "
    "or from the initial one (w0: the authors' code).",
    choices=("first_round", "w0"),
    before="w0",
  )
  ditto_personal_steps: int = setting(
    0,
    "Ditto: SGD steps of a personal model per round (0: the global model's local steps, on the"
    " same minibatches, as the authors' code).",
    at_least=0,
  )

  def __post_init__(self):
    candidates = self.lambda_candidates()
    if not candidates or not all(np.isfinite(c) and c > 0 for c in candidates):
      raise settings.SettingError(
        "ditto_lambda_candidates",
        self.ditto_lambda_candidates,
        "list positive numbers, e.g. --ditto_lambda_candidates=0.1,1,2",
      )
    if len(set(candidates)) < len(candidates):
      raise settings.SettingError(
        "ditto_lambda_candidates", self.ditto_lambda_candidates, "list each lambda once"
      )

  def lambda_candidates(self) -> tuple[float, ...]:
    """The numbers of `ditto_lambda_candidates` (none if one is not a number)."""
    try:
      return tuple(float(c) for c in self.ditto_lambda_candidates.split(","))
    except ValueError:
      return ()

  @property
  def per_device(self) -> bool:
    return self.ditto_lambda_choice == "per_device"

  @property
  def keeps_lambda(self) -> bool:
    """A client's state holds, after its weights, its lambda and whether it has trained (a
    fixed lambda from w^0 keeps the weights alone, as runs did before these settings)."""
    return self.per_device or self.ditto_personal_start == "first_round"

  def trained_lambdas(self) -> tuple[float, ...]:
    """The lambdas a per-device client trains with: the candidates, then `ditto_lambda` if
    it is none of them (a client with too few validation examples takes it)."""
    candidates = self.lambda_candidates()
    return candidates + (() if self.ditto_lambda in candidates else (self.ditto_lambda,))


# The flags `--ditto_lambda_choice=fixed` does not read.
PER_DEVICE_FLAGS = (
  "ditto_lambda_candidates",
  "ditto_lambda_metric",
  "ditto_validation_fraction",
  "ditto_validation_examples",
  "ditto_min_validation",
)


def validate(groups, facts: algorithm.RunFacts) -> None:
  """The per-device flags only with `--ditto_lambda_choice=per_device`."""
  own = groups[Settings]
  if own.per_device:
    return
  defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
  for flag in PER_DEVICE_FLAGS:
    if getattr(own, flag) != defaults[flag]:
      raise settings.SettingError(
        flag,
        getattr(own, flag),
        "read only with --ditto_lambda_choice=per_device: drop it, or choose per_device",
      )


def validation_split(num_examples: int, fraction: float, seed: int, client: int, which="random"):
  """`(training indices, validation indices)` of a client's examples: `fraction` of them held
  out, as many as the authors' code's `n - int((1 - fraction) n)` (`client.py`), at least 1
  and at most n - 1; `which` "random": seeded by (seed, client) (the paper splits each
  device's data randomly), "last": the last ones (the authors' code)."""
  size = min(max(1, num_examples - int((1 - fraction) * num_examples)), num_examples - 1)
  order = np.arange(num_examples)
  if which == "random":
    order = np.random.default_rng([seed, client]).permutation(num_examples)
  held = np.zeros(num_examples, bool)
  held[order[num_examples - max(size, 0) :]] = True
  return np.flatnonzero(~held), np.flatnonzero(held)


def client_data(options: Settings, seed: int):
  """The `FederatedAlgorithm.client_data` hook of a per-device lambda: a client's
  validation examples (`validation_split`) as one first batch, then the program's batches of
  the others."""

  def data(client, x, y, batches):
    train, held = validation_split(
      len(y), options.ditto_validation_fraction, seed, client, options.ditto_validation_examples
    )
    validation = tf.data.Dataset.from_tensors((x[held], y[held]))
    return validation.concatenate(batches(x[train], y[train]))

  return data


@tf.function
def train_personal(
  model: tf.keras.Model,
  optimizer,
  personal: ModelWeights,
  global_weights: ModelWeights,
  dataset: tf.data.Dataset,
  learning_rate,
  config: client_work_lib.LocalTrainingConfig,
):
  """Ditto's personal update (Algorithm 1, line 8): local SGD from `personal` on the client's
  loss plus the proximal term `config.proximal_mu`/2 ||v - w^t||^2 towards `global_weights`;
  returns `(new personal weights, metric sums)`."""

  def objective_gradient(grads, weights):
    # The proximal term's centre is the round's global model, not the personal start.
    return [
      client_work_lib.local_objective_gradient(g, w, center, config)
      for g, w, center in zip(grads, weights, global_weights.trainable)
    ]

  result, metrics = client_work_lib.train_locally(
    model,
    optimizer,
    personal,
    dataset,
    learning_rate,
    config,
    objective_gradient=objective_gradient,
  )
  # A rejected update (not finite) is zeros: the personal model stays.
  return tf.nest.map_structure(tf.subtract, personal, result.update), metrics


@tf.function
def validation_score(model: tf.keras.Model, weights: ModelWeights, x, y, metric: str):
  """A personal model's score on a client's validation examples, lower better: its mean
  cross-entropy (`metric` "loss") or its accuracy negated; +inf where not finite."""
  tf.nest.map_structure(lambda v, t: v.assign(t), ModelWeights.from_model(model), weights)
  logits = model(x, training=False)
  if metric == "loss":
    score = tf.reduce_mean(
      tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    )
  else:
    score = -client_work_lib.count_correct(logits, y) / tf.cast(tf.shape(y)[0], tf.float32)
  return tf.where(tf.math.is_finite(score), score, np.inf)


def replayable(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """One pass over `dataset` (batches `(x, y)`), read once and held: a dataset of the same
  batches that every lambda reads again (the client's dataset reshuffles at each pass, and a
  `Dataset.cache` in a TFF computation's graph did not replay: each pass reshuffled)."""
  tagged = dataset.enumerate().map(lambda i, b: (b[0], b[1], tf.fill(tf.shape(b[1])[:1], i)))
  x, y, batch = tagged.unbatch().batch(tf.int64.max).get_single_element()
  ends = tf.cumsum(tf.math.bincount(tf.cast(batch, tf.int32)))
  starts = tf.concat([[0], ends[:-1]], 0)
  return tf.data.Dataset.from_tensor_slices((starts, ends)).map(lambda s, e: (x[s:e], y[s:e]))


def train_per_device(
  model, optimizer, personal, global_weights, dataset, validation, rate, config, options
):
  """Ditto with each device's own lambda (the paper's experiments): the personal update
  (`train_personal`) from `personal` with each of `options.trained_lambdas()`, on the same
  batches (`replayable`), the one of the best `validation_score` on the client's
  `validation` batch kept (ties: the first listed); a client with fewer than
  `ditto_min_validation` validation examples keeps `ditto_lambda`'s. Returns
  `(personal weights, its lambda, its metric sums)`."""
  lambdas = options.trained_lambdas()
  x, y = validation.get_single_element()
  dataset = replayable(dataset)
  weights, sums, scores, done = [], [], [], []
  for lam in lambdas:  # One after another: they share the model.
    with tf.control_dependencies(done):
      trained, metrics = train_personal(
        model,
        optimizer,
        personal,
        global_weights,
        dataset,
        rate,
        dataclasses.replace(config, proximal_mu=lam),
      )
      with tf.control_dependencies(tf.nest.flatten((trained, metrics))):
        score = validation_score(model, trained, x, y, options.ditto_lambda_metric)
    weights.append(trained)
    sums.append(metrics)
    scores.append(score)
    done = [score]
  scores = tf.stack(scores[: len(options.lambda_candidates())])
  best = tf.cast(tf.where(tf.equal(scores, tf.reduce_min(scores)))[0, 0], tf.int32)
  enough = tf.shape(y)[0] >= options.ditto_min_validation
  chosen = tf.where(enough, best, lambdas.index(options.ditto_lambda))
  pick = lambda *values: tf.gather(tf.stack(values), chosen)
  return (
    tf.nest.map_structure(pick, *weights),
    tf.gather(tf.constant(lambdas, tf.float32), chosen),
    tf.nest.map_structure(pick, *sums),
  )


def personal_start(stored: ModelWeights, download: ModelWeights, trained, options: Settings):
  """A personal model before its round's steps: the stored one, or with `first_round` before
  its client's first round (`trained` 0) the round's global model w^t (Algorithm 1's v_k^0)."""
  if options.ditto_personal_start == "w0":
    return stored
  return tf.nest.map_structure(lambda v, w: tf.where(trained > 0, v, w), stored, download)


def build_client_work(
  model_fn, element_spec, config, options: Settings, transport=transport_lib.VALUES
):
  """Ditto's client work: FedAvg's local training of the global model, then the personal
  model's (`train_personal`, or `train_per_device` on the validation batch the client's
  dataset starts with), whose weights, then (`Settings.keeps_lambda`) its lambda and 1 once
  it has trained, are the client's state (one float32 vector, moved by `transport`)."""
  client_work_lib.check_data_fits_model(model_fn, element_spec)
  weights_type = client_work_lib.weights_type_of(model_fn)
  data_type = tff.SequenceType(tff.types.tensorflow_to_type(element_spec))
  specs = tff.types.type_to_tf_tensor_specs(weights_type)
  size = stateful_client_work.flat_size(specs)
  state_type = tff.TensorType(np.float32, [size + 2 * options.keeps_lambda])
  optimizer = client_work_lib.local_optimizer(config)
  personal_config = dataclasses.replace(config, proximal_mu=options.ditto_lambda)

  @tff.tensorflow.computation(weights_type, data_type, tf.float32, state_type)
  def client_update(download, dataset, learning_rate, personal_state):
    if options.per_device:
      validation, dataset = dataset.take(1), dataset.skip(1)
    global_model = client_work_lib.model_to_overwrite(model_fn)
    result, metrics = client_work_lib.train_locally(
      global_model, optimizer, download, dataset, learning_rate, config
    )
    personal = stateful_client_work.unflatten(personal_state[:size], specs)
    if options.keeps_lambda:
      personal = personal_start(personal, download, personal_state[-1], options)
    if options.ditto_personal_steps:
      dataset = dataset.repeat().take(options.ditto_personal_steps)
    # After the global pass: the first pass over a reshuffling dataset gets FedAvg's order.
    with tf.control_dependencies(tf.nest.flatten((result, metrics))):
      personal_model = client_work_lib.model_to_overwrite(model_fn)
      args = (personal_model, optimizer, personal, download, dataset)
      if options.per_device:
        personal, lam, personal_metrics = train_per_device(
          *args, validation, learning_rate, config, options
        )
      else:
        personal, personal_metrics = train_personal(*args, learning_rate, personal_config)
        lam = tf.constant(options.ditto_lambda, tf.float32)
    metrics = collections.OrderedDict(
      metrics,
      personal_loss=personal_metrics["loss"],
      personal_correct=personal_metrics["correct"],
      personal_examples=personal_metrics["num_examples"],
    )
    new_state = stateful_client_work.flatten(personal)
    if options.keeps_lambda:
      new_state = tf.concat([new_state, [lam, 1.0]], 0)
    return result, metrics, new_state

  @tff.tensorflow.computation(client_update.type_signature.result[1])
  def finalize(sums):
    measured = client_work_lib.finalize_train_metrics(sums)
    n = tf.maximum(sums["personal_examples"], 1.0)
    measured["personal_train_loss"] = sums["personal_loss"] / n
    measured["personal_train_accuracy"] = sums["personal_correct"] / n
    return measured

  return transport.stateful_client_work(client_update, config, finalize)


def initial_state(initial: ModelWeights, options: Settings) -> np.ndarray:
  """A client's state before its first round: w^0, then (`Settings.keeps_lambda`) lambda
  `ditto_lambda` and 0, not trained yet."""
  weights = stateful_client_work.flatten(initial).numpy()
  if not options.keeps_lambda:
    return weights
  return np.concatenate([weights, np.float32([options.ditto_lambda, 0.0])])


def lambda_summary(size: int):
  """The summary's `ditto_lambda_clients`: how many clients that trained hold each lambda
  (`{"0.1": n, ...}`, ascending), from their stored states (after their `size` weights)."""

  def lambdas(finished: algorithm.FinishedRun) -> dict:
    counts = collections.Counter()
    for client in range(len(finished.data.train.client_ids)):
      state = finished.client_state(client)
      if state is not None:
        counts[float(state[size])] += 1
    return {"ditto_lambda_clients": {f"{lam:g}": counts[lam] for lam in sorted(counts)}}

  return lambdas


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  model_fn = lambda: context.model_fn(0)
  weights_type = client_work_lib.weights_type_of(model_fn)
  options = context.group(Settings)
  client_work = build_client_work(
    model_fn, context.element_spec, context.local, options, context.transport
  )
  rate = fedavg.server_learning_rate(context, fedavg.LEARNING_RATE)
  distributor, aggregator, finalizer = server_optimizer.fedavg_stages(
    weights_type, server_optimizer.build_server_optimizer(rate)
  )
  process = composition.compose(
    server_optimizer.build_initial_weights_fn(model_fn),
    distributor,
    client_work,
    aggregator,
    finalizer,
    client_state_type=client_work.next_state_type,
  )
  update = client_work.client_update.type_signature
  built = built_lib.BuiltProcess(
    process,
    tff.StructType(list(update.parameter)[:1] + list(update.parameter)[2:3]),
    tff.StructType(list(update.result)[:2]),
    lambda state: [state["model"]],
  )
  initial = ModelWeights.from_model(model_fn())
  states = algorithm.ClientStates.of(
    client_work.client_state_type,
    initial=lambda: initial_state(initial, options),
    model=lambda state, models: stateful_client_work.unflatten_numpy(state, models[0]),
  )
  fields = {"summary": own_models.summary(states)}
  if options.per_device:
    own, lambdas = fields["summary"], lambda_summary(stateful_client_work.flat_size(initial))
    fields = {
      "summary": lambda finished: {**own(finished), **lambdas(finished)},
      "client_data": client_data(options, context.seed),
    }
  return algorithm.FederatedAlgorithm.of("ditto", built, context, client_states=states, **fields)


ALGORITHM = algorithm.Algorithm(
  "ditto",
  "Ditto (Li et al. 2021): FedAvg's global model and a personal model per client pulled towards it",
  build,
  settings=(fedavg.ServerSettings, Settings),
  validate=validate,
  variant_flags=("ditto_lambda_choice", "ditto_personal_start"),
)
