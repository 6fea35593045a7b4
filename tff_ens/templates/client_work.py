"""Local training shared by every algorithm whose clients train one model.

FedAvg, FedProx, FedAvgM, Fed-ensemble, FedBE and FedDF all run the same client work: SGD
with momentum and weight decay on the client's data, starting from the model the client
received, returning the change of its weights. FedProx is the same client work with a
proximal term (a parameter here, not a second copy), and FedDyn's client the same again
with a linear term from its own state (`train_feddyn`).

TFF 0.87 ships this client work in two near copies (`model_delta_client_work` with a
learning rate in its state, `proximal_client_work` without one); neither combines weight
decay, a proximal term and a round-dependent learning rate, and both leave batch-norm
statistics out of the update. So the math is written here once, as plain TensorFlow
(`train_locally`), wrapped in a thin TFF process.
"""

import collections
import dataclasses
from typing import Callable

import tensorflow as tf
import tensorflow_federated as tff

import tasks
from tff_ens import settings
from tff_ens.settings import setting

ModelWeights = tff.learning.models.ModelWeights

LR_SCHEDULES = ("constant", "step")
OPTIMIZERS = ("sgd", "adam")
TRAIN_POSITIONS = ("every", "last")


@dataclasses.dataclass(frozen=True)
class LocalTrainingConfig:
  """Hyperparameters of local training.

  Attributes:
    learning_rate: base client learning rate.
    optimizer: "sgd" (with `momentum`), or "adam": Adam (Kingma and Ba, ICLR 2015) with
      Keras' betas and epsilon, its moments restarted at every round (larq's optimizer for
      binarized networks).
    momentum: heavy-ball momentum of client SGD (0 is plain SGD).
    weight_decay: coupled L2 weight decay, added to the gradient as
      `weight_decay * w` (PyTorch's `SGD(weight_decay=...)`, used by FedBE).
    proximal_mu: FedProx's mu; 0 gives FedAvg's local objective.
    lr_schedule: "constant", or "step": the rate times 0.1 at 30% and again at
      60% of `total_rounds` (FedBE's schedule).
    total_rounds: number of rounds the schedule spans (a "step" schedule needs it).
    max_update_norm: an update whose trainable part has a larger L2 norm is
      rejected (`reject_bad_update`); 0 accepts every finite update.
    train_positions: for a sequence model (one with the layer `tasks.PER_POSITION_LOGITS`,
      Shakespeare's LSTM), "every": the loss of a window is the mean over its positions of
      predicting the next element (`per_position_targets`); "last": of its label only. Other
      models train on their labels either way.
  """

  learning_rate: float = setting(0.05, "Client learning rate.", flag="client_lr", above=0)
  optimizer: str = setting(
    "sgd",
    "Client optimizer: SGD (with --client_momentum) or Adam (moments restarted every round; "
    "the recipe of binarized models).",
    flag="client_optimizer",
    choices=OPTIMIZERS,
  )
  momentum: float = setting(0.0, "Client SGD momentum.", flag="client_momentum", at_least=0)
  weight_decay: float = setting(0.0, "Client (coupled L2) weight decay.", at_least=0)
  proximal_mu: float = setting(0.0, flag=None, at_least=0)
  lr_schedule: str = setting(
    "constant",
    "Client learning rate: constant, or x0.1 at 30% and 60% of the rounds (step).",
    choices=LR_SCHEDULES,
  )
  total_rounds: int | None = setting(None, uses="rounds", above=0)
  max_update_norm: float = setting(
    0.0,
    "Reject a client update whose trainable weights moved by a larger L2 norm (counted in "
    "rejected_updates); 0: no limit. NaN/Inf updates are always rejected.",
    at_least=0,
  )
  train_positions: str = setting(
    "every",
    "A sequence model (Shakespeare's LSTM) learns the next character after every prefix of "
    "a window (every; McMahan et al. 2017's unrolled LSTM) or after the whole window only "
    "(last; LEAF's). Evaluation reads the last position either way.",
    choices=TRAIN_POSITIONS,
  )

  def __post_init__(self):
    settings.check(self)
    if self.optimizer == "adam" and self.momentum:
      raise settings.SettingError(
        "momentum", self.momentum, "must be 0 with the adam optimizer, which keeps its own moments"
      )
    if self.lr_schedule != "constant" and self.total_rounds is None:
      raise settings.SettingError("total_rounds", None, "a step schedule spans them: give them")


def learning_rate_at(round_num: tf.Tensor, config: LocalTrainingConfig):
  """Client learning rate of round `round_num` (0-based): FedBE's step schedule (Chen & Chao,
  ICLR 2021, Sec. 5 "Implementation") multiplies it by 0.1 at 30% and 60% of the rounds."""
  base = tf.constant(config.learning_rate, tf.float32)
  if config.lr_schedule == "constant":
    return base
  progress = tf.cast(round_num, tf.float32) / float(config.total_rounds)
  decays = tf.cast(progress >= 0.3, tf.float32) + tf.cast(progress >= 0.6, tf.float32)
  return base * tf.pow(0.1, decays)


def local_objective_gradient(
  gradient, weight, initial_weight, config: LocalTrainingConfig, negated_linear_term=None
):
  """Gradient of the local objective for one weight tensor.

  h(w) = F(w) + weight_decay/2 ||w||^2 + mu/2 ||w - w0||^2 - <g, w>: with
  g = 0 the FedProx local objective (Li et al., MLSys 2020, eq. 2) with
  coupled weight decay; FedDyn's (Acar et al., ICLR 2021, Algorithm 1, line 7)
  in the form of `feddyn.train_feddyn`. Its gradient is grad F + weight_decay * w
  + mu * (w - w0) - g, summed left to right by one `tf.add_n` (one pass over the weights for
  the sum, not one per term); `negated_linear_term` is -g, negated once per client, not once
  a step.
  """
  terms = [gradient]
  if config.weight_decay:
    terms.append(config.weight_decay * weight)
  if config.proximal_mu:
    terms.append(config.proximal_mu * (weight - initial_weight))
  if negated_linear_term is not None:
    terms.append(negated_linear_term)
  return tf.add_n(terms)


def weights_delta(initial: ModelWeights, final: ModelWeights) -> ModelWeights:
  """`initial - final` for trainable and non-trainable (e.g. BN) weights."""
  return tf.nest.map_structure(tf.subtract, initial, final)


def reject_bad_update(update: ModelWeights, weight, max_norm: float = 0.0):
  """Drops a broken or suspicious update: zeros it and its weight.

  An update is rejected if any tensor has a NaN or Inf, or if `max_norm` > 0
  and the global L2 norm of its trainable part exceeds `max_norm` (batch-norm
  statistics move by data scale, not by learning, so they are left out of
  the norm). Returns the update, its weight and 1.0 if it was rejected (0.0
  otherwise).
  """
  good = tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tf.nest.flatten(update)])
  if max_norm:
    good = tf.logical_and(good, tf.linalg.global_norm(list(update.trainable)) <= max_norm)
  update = tf.nest.map_structure(lambda t: tf.where(good, t, tf.zeros_like(t)), update)
  weight = tf.where(good, weight, 0.0)
  return update, weight, 1.0 - tf.cast(good, tf.float32)


def per_position_logits(model: tf.keras.Model) -> tf.keras.Model | None:
  """The model to the logits of every position (`tasks.PER_POSITION_LOGITS`), or None."""
  names = [layer.name for layer in model.layers]
  if tasks.PER_POSITION_LOGITS not in names:
    return None
  return tf.keras.Model(model.input, model.get_layer(tasks.PER_POSITION_LOGITS).output)


def per_position_targets(x, y):
  """The next element after each position of windows `x` [batch, length]: x shifted left by
  one, then the label `y` [batch] (McMahan et al. 2017's next-character targets)."""
  return tf.concat([x[:, 1:], tf.cast(y, x.dtype)[:, tf.newaxis]], axis=1)


@tf.function
def train_locally(
  model: tf.keras.Model,
  optimizer,
  initial_weights,
  dataset: tf.data.Dataset,
  learning_rate,
  config: LocalTrainingConfig,
  linear_term=None,
  objective_gradient=None,
):
  """Runs local SGD on `dataset` from `initial_weights` (FedAvg's ClientUpdate).

  McMahan et al., AISTATS 2017, Algorithm 1, ClientUpdate; with the FedProx objective of
  `local_objective_gradient`.

  Args:
    model: a Keras model producing logits; its weights are overwritten.
    optimizer: a `tff.learning.optimizers.Optimizer` (`local_optimizer`).
    initial_weights: `ModelWeights` of tensors to start from.
    dataset: batches of `(x, y)`.
    learning_rate: scalar learning rate for this round.
    config: the `LocalTrainingConfig`.
    linear_term: g of the local objective's linear term (`local_objective_gradient`), one
      tensor per trainable weight (FedDyn's, `feddyn.train_feddyn`); None: no linear term.
    objective_gradient: `(gradients of the loss, trainable weights) -> gradients of the
      local objective`, one tensor per trainable weight, for an objective of another form;
      None: `local_objective_gradient`'s, centred at `initial_weights`.

  With `config.train_positions` "every" and a sequence model (`per_position_logits`), an
  example's loss and accuracy are its means over its positions (`per_position_targets`).

  Returns:
    `(ClientResult(update=initial - final ModelWeights, update_weight=number of examples),
    metrics)`, metrics sums over examples: `loss`, `correct`, `num_examples`, and `rejected`
    (1 if the update was not finite or too large, `reject_bad_update`, and so was zeroed with
    weight 0, its other metrics then 0).
  """
  model_weights = ModelWeights.from_model(model)
  tf.nest.map_structure(lambda v, t: v.assign(t), model_weights, initial_weights)
  trainable = model_weights.trainable
  specs = tuple(tf.TensorSpec(v.shape, v.dtype) for v in trainable)
  opt_state = optimizer.set_hparams(optimizer.initialize(specs), {"learning_rate": learning_rate})
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction=tf.keras.losses.Reduction.SUM
  )

  per_position = per_position_logits(model) if config.train_positions == "every" else None
  forward = model if per_position is None else per_position
  negated_linear = [-t for t in linear_term] if linear_term is not None else [None] * len(trainable)
  if objective_gradient is None:

    def objective_gradient(grads, weights):
      return [
        local_objective_gradient(g, w, w0, config, negated)
        for g, w, w0, negated in zip(grads, weights, initial_weights.trainable, negated_linear)
      ]

  def step(carry, batch):
    opt_state, loss_sum, correct, count = carry
    x, y = batch
    n = tf.cast(tf.shape(y)[0], tf.float32)
    y, positions = _targets(x, y, per_position is not None)
    with tf.GradientTape() as tape:
      logits = forward(x, training=True)
      batch_loss = loss_fn(y, logits) / positions
      mean_loss = batch_loss / n
    grads = objective_gradient(tape.gradient(mean_loss, trainable), trainable)
    opt_state, new_weights = optimizer.next(opt_state, tuple(trainable), tuple(grads))
    _assign_constrained(trainable, new_weights)
    hits = count_correct(logits, y) / positions
    return opt_state, loss_sum + batch_loss, correct + hits, count + n

  zero = tf.constant(0.0)
  _, loss_sum, correct, count = dataset.reduce((opt_state, zero, zero, zero), step)
  final = tf.nest.map_structure(tf.identity, model_weights)
  return client_result(initial_weights, final, loss_sum, correct, count, config.max_update_norm)


def _targets(x, y, per_position: bool):
  """An example's targets (its label, or each position's next element) and their number."""
  if not per_position:
    return y, 1.0
  y = per_position_targets(x, y)
  return y, float(y.shape[1])


def _assign_constrained(variables, values):
  """Assigns a step's `values` through each variable's constraint, as Keras does (larq's)."""
  for v, t in zip(variables, values):
    v.assign(v.constraint(t) if v.constraint is not None else t)


def count_correct(logits, y):
  """The number of targets `y` whose logit is the largest."""
  return tf.reduce_sum(
    tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), tf.cast(y, tf.int32)), tf.float32)
  )


def client_result(initial_weights, final_weights, loss_sum, correct, count, max_update_norm):
  """FedAvg's `ClientResult` of a client that trained from `initial_weights` to
  `final_weights` on `count` examples, and its metric sums (`train_locally`'s Returns).

  The update is checked by `reject_bad_update`; a rejected client's training metrics are
  dropped with its update (its loss may be NaN, so it is selected away rather than
  multiplied by 0).
  """
  update, weight, rejected = reject_bad_update(
    weights_delta(initial_weights, final_weights), count, max_update_norm
  )
  accepted = 1.0 - rejected
  metrics = collections.OrderedDict(
    loss=tf.where(accepted > 0, loss_sum, 0.0),
    correct=correct * accepted,
    num_examples=count * accepted,
    rejected=rejected,
  )
  return tff.learning.templates.ClientResult(update, weight), metrics


def finalize_train_metrics(sums):
  """Turns summed client metrics into the round's training metrics."""
  n = tf.maximum(sums["num_examples"], 1.0)
  return collections.OrderedDict(
    train_loss=sums["loss"] / n,
    train_accuracy=sums["correct"] / n,
    num_examples=sums["num_examples"],
    rejected_updates=sums["rejected"],
  )


@dataclasses.dataclass(frozen=True)
class ClientWork:
  """The TFF client-work stage and the per-client computation inside it.

  `client_update` is what one client runs: its parameter (less the local
  dataset) is what the client downloads, its result what it uploads.
  """

  process: tff.learning.templates.ClientWorkProcess
  client_update: tff.Computation


class TypeMismatchError(TypeError):
  """Client data, model and stages whose types do not fit together."""


def weights_type_of(model_fn: Callable[[], tf.keras.Model]) -> tff.Type:
  """TFF type of `ModelWeights` of the model built by `model_fn`."""
  with tf.Graph().as_default():
    model = model_fn()
    return tff.types.tensorflow_to_type(
      tf.nest.map_structure(
        lambda v: tf.TensorSpec(v.shape, v.dtype), ModelWeights.from_model(model)
      )
    )


def model_to_overwrite(model_fn: Callable[[], tf.keras.Model]) -> tf.keras.Model:
  """`model_fn()` with its variables created as zeros instead of their initializers' values,
  for a client's computation that assigns every weight before reading it (`train_locally`,
  FedPPD's `train_teacher_student`): TFF runs a computation's variable initializers at every
  call, and drawing the LEAF CNN's random initialization, discarded at once, was 7% of a
  FedAvg round's CPU (benchmarks/RESULTS.md, "Clients' models created as zeros"). The zeros
  are a stateful `Empty` op, which TensorFlow's graph optimizer does not fold: with
  `tf.zeros` (a `Fill`) the worker peaked 0.3-0.5 GiB higher. A model with variables that
  are not its weights (which `ModelWeights` would not assign) keeps its initializers."""
  created = []

  def zeros(next_creator, **kwargs):
    shape, dtype = tf.TensorShape(kwargs.get("shape")), kwargs.get("dtype")
    if shape.is_fully_defined() and dtype is not None:
      kwargs["initial_value"] = lambda: tf.raw_ops.Empty(
        shape=shape.as_list(), dtype=dtype, init=True
      )
    variable = next_creator(**kwargs)
    created.append(variable)
    return variable

  with tf.variable_creator_scope(zeros):
    model = model_fn()
  weights = {v.ref() for v in model.weights}
  if all(v.ref() in weights for v in created):
    return model
  return model_fn()


def check_data_fits_model(model_fn: Callable[[], tf.keras.Model], element_spec) -> None:
  """Raises `TypeMismatchError` unless batches `(x, y)` fit the model."""
  with tf.Graph().as_default():
    model = model_fn()
  try:
    x_spec, y_spec = element_spec
  except (TypeError, ValueError):
    raise TypeMismatchError(f"client batches must be (x, y) pairs, got {element_spec}") from None
  expected = tf.TensorShape(model.input_shape[1:])
  if not expected.is_compatible_with(x_spec.shape[1:]):
    raise TypeMismatchError(
      f"client inputs {x_spec} do not fit the model input "
      f"{tuple(model.input_shape)}: the task and model disagree"
    )
  if not y_spec.dtype.is_integer:
    raise TypeMismatchError(f"client labels {y_spec} must be integer class ids")


def build_client_work(
  model_fn: Callable[[], tf.keras.Model], element_spec, config: LocalTrainingConfig
) -> ClientWork:
  """Builds the client-work stage: `train_locally` at every client.

  The stage's state is the 0-based round number (server-placed), from which
  the round's learning rate is computed and broadcast.

  Args:
    model_fn: no-arg function building a fresh Keras model (logits output).
    element_spec: `tf.TensorSpec`s of one batch `(x, y)` of client data.
    config: the `LocalTrainingConfig`.
  """
  check_data_fits_model(model_fn, element_spec)

  def local_update(initial_weights, dataset, learning_rate, optimizer):
    return train_locally(
      model_to_overwrite(model_fn), optimizer, initial_weights, dataset, learning_rate, config
    )

  return build_sgd_client_work(local_update, weights_type_of(model_fn), element_spec, config)


def build_sgd_client_work(
  local_update, download_type: tff.Type, element_spec, config: LocalTrainingConfig
) -> ClientWork:
  """The client-work stage around one client's local SGD.

  `local_update(download, dataset, learning_rate, optimizer) ->
  (ClientResult, metric sums)` runs at every client on what it downloaded
  (`download_type`), with `local_optimizer` and the round's learning rate
  of `config`; `train_locally` is its body for one architecture.
  """
  data_type = tff.SequenceType(tff.types.tensorflow_to_type(element_spec))
  optimizer = local_optimizer(config)

  @tff.tensorflow.computation(download_type, data_type, tf.float32)
  def client_update(download, dataset, learning_rate):
    return local_update(download, dataset, learning_rate, optimizer)

  return build_round_client_work(client_update, *sgd_round_fns(client_update, config))


def local_optimizer(config: LocalTrainingConfig):
  """The clients' `tff.learning.optimizers.Optimizer`: SGD(M) or Adam (`config.optimizer`)."""
  if config.optimizer == "adam":
    return tff.learning.optimizers.build_adam(learning_rate=config.learning_rate)
  return tff.learning.optimizers.build_sgdm(
    learning_rate=config.learning_rate, momentum=config.momentum or None
  )


def sgd_round_fns(client_update: tff.Computation, config: LocalTrainingConfig):
  """(round's learning rate, metrics finalizer) of local SGD's client work."""

  @tff.tensorflow.computation(tf.int32)
  def round_learning_rate(round_num):
    return learning_rate_at(round_num, config)

  @tff.tensorflow.computation(client_update.type_signature.result[1])
  def finalize(sums):
    return finalize_train_metrics(sums)

  return round_learning_rate, finalize


def round_counter() -> tuple[tff.Computation, tff.Computation]:
  """A stage state that counts rounds: `(init_fn -> 0 at SERVER, n -> n + 1)`."""

  @tff.tensorflow.computation(tf.int32)
  def increment(round_num):
    return round_num + 1

  @tff.federated_computation
  def init_fn():
    return tff.federated_value(0, tff.SERVER)

  return init_fn, increment


def round_stage(
  client_update: tff.Computation, round_input: tff.Computation, finalize: tff.Computation
):
  """`init_fn` and the body of a client-work stage whose state is the round.

  Returns `(init_fn, run)`; `run(state, weights, client_data, *client_state)`,
  called inside a federated computation, broadcasts `round_input(state)`, runs
  `client_update(weights, data, that value, *client_state)` at every client
  and returns `(state + 1, the clients' outputs, measurements)`, the
  measurements being `finalize` of the clients' summed metrics (output 1).
  """
  init_fn, increment = round_counter()

  def run(state, weights, client_data, *client_state):
    value = tff.federated_broadcast(tff.federated_map(round_input, state))
    outputs = tff.federated_map(client_update, (weights, client_data, value) + client_state)
    measurements = tff.federated_map(finalize, tff.federated_sum(outputs[1]))
    return tff.federated_map(increment, state), outputs, measurements

  return init_fn, run


def build_round_client_work(
  client_update: tff.Computation, round_input: tff.Computation, finalize: tff.Computation
) -> ClientWork:
  """A client-work stage whose state is the 0-based round number.

  Each round the server computes `round_input(round)` (the learning rate,
  the round itself), broadcasts it, every client runs `client_update(weights,
  data, that value) -> (ClientResult, metrics)`, and the clients' summed
  metrics become the round's measurements through `finalize`.
  """
  weights_type, data_type, _ = client_update.type_signature.parameter
  init_fn, run = round_stage(client_update, round_input, finalize)

  @tff.federated_computation(
    init_fn.type_signature.result,
    tff.FederatedType(weights_type, tff.CLIENTS),
    tff.FederatedType(data_type, tff.CLIENTS),
  )
  def next_fn(state, weights, client_data):
    state, outputs, measurements = run(state, weights, client_data)
    return tff.templates.MeasuredProcessOutput(state, outputs[0], measurements)

  return ClientWork(tff.learning.templates.ClientWorkProcess(init_fn, next_fn), client_update)
