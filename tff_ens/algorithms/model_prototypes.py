"""FedDF across model prototypes: clients that run different architectures.

Lin, Kong, Stich and Jaggi, "Ensemble Distillation for Robust Model Fusion in
Federated Learning", NeurIPS 2020, Sec. 3, its extension to heterogeneous
systems: each client runs one of P architectures, the "prototypes". The
server averages each prototype's models over the clients that ran it, then
distills every prototype's average towards the AVGLOGITS of all the round's
client models, whatever their architecture.

One TFF round has one cohort, so FedDF's four stages serve all prototypes at
once:

* distributor (`keyed_stages.build_keyed_distributor`, Fed-ensemble's): client
  i runs prototype i mod P and downloads only that prototype's model, with
  `tff.federated_select`. A selected value has one
  type, so a model travels as one float32 vector the length of the largest
  prototype (`pack`); a smaller prototype's vector is padded, and the bytes
  reported per client are the largest prototype's (an upper bound);
* client work: `client_work.train_locally` on the client's architecture
  (`tf.switch_case` over the P of them), its update packed again with the
  prototype's index;
* aggregator: `server_step.build_collect_aggregator` on the
  (packed update, prototype) pairs, FedDF's;
* finalizer (`PrototypeStep`, in the driver's TensorFlow as
  `server_step.DriverProcess` runs it): per prototype, the clients' models (global
  minus update) and their weighted average; drop-worst on each client with
  its own architecture; AVGLOGITS over every kept client on the unlabeled
  images some prototype's student will read this round (the union of their
  seeded draws, `server_distillation.rows_read`; all of them with
  `teacher_labels="all"`), labelled once; each prototype's student distilled
  from its average with FedDF's config (`student_lib.distill`).
"""

import collections
import os
import time
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import run_files
from tff_ens.server import distillation
from tff_ens.server import server_data as server_data_lib
from tff_ens.server import student as student_lib
from tff_ens.templates import built as built_lib
from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import keyed_stages
from tff_ens.templates import server_distillation
from tff_ens.templates import server_step
from tff_ens.templates import transport as transport_lib

ModelWeights = tff.learning.models.ModelWeights


def packed_size(weights) -> int:
  """Number of values in a structure of tensors or `tf.TensorSpec`s."""
  return sum(int(np.prod(t.shape)) for t in tf.nest.flatten(weights))


def pack(weights, size: int):
  """The tensors of `weights` flattened into one float32 vector [size].

  Zero-padded past the model's own values; `unpack` inverts it.
  """
  flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tf.nest.flatten(weights)], 0)
  return tf.pad(flat, [[0, size - packed_size(weights)]])


def unpack(vector, like):
  """The structure of `like` (tensors or specs) from `pack`ed `vector`.

  `vector` is [size] or stacked [M, size]; leading dimensions carry over.
  """
  flat = tf.nest.flatten(like)
  sizes = [int(np.prod(t.shape)) for t in flat]
  parts = tf.split(vector[..., : sum(sizes)], sizes, axis=-1)
  lead = tf.shape(vector)[:-1]
  return tf.nest.pack_sequence_as(
    like,
    [
      tf.reshape(part, tf.concat([lead, tf.constant(t.shape.as_list(), tf.int32)], 0))
      for part, t in zip(parts, flat)
    ],
  )


def mean_logits_across(predictions: Sequence[dict], counts):
  """AVGLOGITS over the teachers of all prototypes.

  `predictions[p]["mean_logits"]` is the mean over prototype p's `counts[p]`
  teachers (`distillation.ensemble_predictions`); the result is the mean over
  all sum(counts) teachers (Lin et al., Algorithm 1, line 8, with the
  ensemble of every received model).
  """
  counts = tf.cast(tf.stack(counts), tf.float32)
  stacked = tf.cast(tf.stack([p["mean_logits"] for p in predictions]), tf.float32)
  return tf.math.divide_no_nan(tf.tensordot(counts, stacked, 1), tf.reduce_sum(counts))


def _prototype_teachers(models, global_prototypes, collected, validation, config):
  """The round's client models per prototype, and which drop-worst keeps.

  Returns `(clients, client_weights, keep, informative, received)`:
  per prototype p, `clients[p]` its clients' models (stacked `ModelWeights`),
  their example counts and 0/1 `keep` weights (the config's `keep_clients`
  over the whole cohort); whether any client is kept (if none is, all are
  and the round is a FedAvg step per prototype, as
  `server_distillation.teachers`); and which of the collected slots hold a
  client.
  """
  (packed, keys), weights = collected
  weights = tf.cast(weights, tf.float32)
  received = weights > 0
  val_x, val_y = validation
  dropping = config.keep_clients is not None
  clients, client_weights, accuracies = [], [], []
  for p, (model, global_p) in enumerate(zip(models, global_prototypes)):
    mine = tf.where(tf.logical_and(received, tf.equal(keys, p)))[:, 0]
    clients.append(
      server_distillation.models_of_clients(global_p, unpack(tf.gather(packed, mine), global_p))
    )
    client_weights.append(tf.gather(weights, mine))
    if dropping:
      accuracies.append(distillation.member_accuracies(model, clients[p], val_x, val_y))
  if dropping:  # Over the whole cohort.
    kept, informative = config.keep_clients(
      tf.concat(accuracies, 0), val_y, models[0].output_shape[-1]
    )
    sizes = tf.stack([tf.shape(w)[0] for w in client_weights])
    keep = [tf.cast(k, tf.float32) for k in tf.split(kept, sizes)]
  else:
    informative = tf.reduce_any(tf.concat(client_weights, 0) > 0)
    keep = [tf.ones_like(w) for w in client_weights]
  return clients, client_weights, keep, informative, received


def _teacher_batches(models, clients, keep, images):
  """Every prototype's `distillation.ensemble_predictions` of its kept clients on
  `images`, batch by batch: yields `(start, predictions per prototype, kept per
  prototype)`."""
  counts = [tf.reduce_sum(k) for k in keep]
  for start, batch in server_data_lib.ordered_batches(images, distillation.EVAL_BATCH_SIZE):
    yield (
      int(start),
      [
        distillation.ensemble_predictions(model, stack, batch, k)
        for model, stack, k in zip(models, clients, keep)
      ],
      counts,
    )


class PrototypeStep:
  """FedDF's server step over the prototypes, in the driver's TensorFlow.

  `step(global prototypes, collected, round) -> (new prototypes,
  measurements)` (`server_step.ServerStep`; see the module docstring), on
  `config.device`, each prototype's student a `student_lib.Student`.
  """

  def __init__(
    self,
    model_fns: Sequence[Callable[[], tf.keras.Model]],
    names: Sequence[str],
    data: server_data_lib.ServerData,
    config: server_distillation.ServerDistillationConfig,
  ):
    self.names = tuple(names)
    self.data = data
    self.config = config
    with tf.device(config.device):
      self._models = [fn() for fn in model_fns]
      self._students = [student_lib.Student(m, config.distill) for m in self._models]
      self._validation = (tf.constant(data.validation_x), tf.constant(data.validation_y))

  @tf.function
  def _teachers(self, global_prototypes, collected):
    return _prototype_teachers(
      self._models, global_prototypes, collected, self._validation, self.config
    )

  def __call__(self, global_prototypes, collected, round_num: int):
    start = time.perf_counter()
    config = self.config
    student_lib.restore_eager_classes(*self._models)
    with tf.device(config.device):
      seed = server_distillation.round_seed(config, round_num)
      clients, client_weights, keep, informative, received = self._teachers(
        global_prototypes, collected
      )
      any_received = bool(tf.reduce_any(received))
      distilled = any_received and bool(informative)
      seeds = [
        tf.random.experimental.stateless_fold_in(seed, p) for p in range(len(global_prototypes))
      ]
      read = targets = None
      if distilled:  # The rows some prototype's student reads, labelled once.
        read = server_distillation.rows_read(config, self.data.unlabeled, seeds)
        targets = self._targets(clients, keep, read.images)
      new_prototypes, steps, examples, curves = [], 0, 0, {}
      average_accuracy = teachers_accuracy = tf.constant(-1.0)
      for p, global_p in enumerate(global_prototypes):
        kept = client_weights[p] * keep[p]
        start_p = global_p
        if any_received and float(tf.reduce_sum(kept)) > 0:
          start_p = server_distillation.weighted_average(clients[p], kept)
        if p == 0 and any_received:
          average_accuracy, teachers_accuracy = self._validation_baselines(start_p, clients, keep)
        if distilled:
          start_p, stats = self._students[p].distill(
            start_p, read.images, targets, seeds[p], self._validation, read.batches[p]
          )
          steps += int(stats["steps"])
          examples += int(stats["examples"])
          curves[f"validation_curve_{self.names[p]}"] = stats["validation_curve"]
        distillation.assign_variables(self._models[p], start_p)
        new_prototypes.append(start_p)
      accuracies = [s.validation_accuracy(*self._validation) for s in self._students]
    measurements = collections.OrderedDict(
      (f"student_validation_accuracy_{name}", a) for name, a in zip(self.names, accuracies)
    )
    measurements["server_device"] = server_step.placed_device(accuracies[0])
    measurements.update(
      student_validation_accuracy=accuracies[0],
      average_validation_accuracy=average_accuracy,
      teachers_validation_accuracy=teachers_accuracy,
      dropped_clients=(
        int(tf.reduce_sum(tf.cast(received, tf.int32)))
        - int(tf.add_n([tf.reduce_sum(k) for k in keep]))
      ),
      distilled=int(distilled),
      distill_steps=steps,
      distill_examples=examples,
      server_seconds=time.perf_counter() - start,
    )
    measurements.update(curves)
    return tuple(new_prototypes), measurements

  def _validation_baselines(self, average, clients, keep):
    """What the first prototype's student competes with, on the server's validation data
    (as `DistillationStep.validation_baselines`): the accuracy of its clients' weight average
    (its start) and of the teachers' AVGLOGITS over every prototype's kept clients."""
    x, y = self._validation
    distillation.assign_variables(self._models[0], average)
    average_accuracy = self._students[0].validation_accuracy(x, y)
    logits = [
      mean_logits_across(predictions, counts)
      for _, predictions, counts in _teacher_batches(
        self._models, clients, keep, self.data.validation_x
      )
    ]
    return average_accuracy, distillation.accuracy(tf.concat(logits, 0), y)

  def _targets(self, clients, keep, images):
    """AVGLOGITS of every kept client model on `images` (the unlabeled rows read)."""
    targets = server_data_lib.rows_like(images, self._models[0].output_shape[-1:])
    for start, predictions, counts in _teacher_batches(self._models, clients, keep, images):
      batch = distillation.avg_logits_targets(mean_logits_across(predictions, counts)).numpy()
      targets[start : start + len(batch)] = batch
    return targets

  def teacher_probabilities(self, global_prototypes, collected, round_num: int, images):
    """The round's teacher ensemble on `images`: `OrderedDict(probabilities,
    mean_entropy)`, the softmax of its AVGLOGITS and the kept clients' mean
    entropy (the same kept clients as the step distills from)."""
    del round_num  # FedDF's teachers are the clients; nothing is sampled.
    student_lib.restore_eager_classes(*self._models)
    with tf.device(self.config.device):
      clients, _, keep, _, _ = self._teachers(global_prototypes, collected)
      probabilities, entropies = [], []
      for _, predictions, counts in _teacher_batches(self._models, clients, keep, images):
        kept = tf.stack(counts)
        probabilities.append(tf.nn.softmax(mean_logits_across(predictions, counts)))
        entropies.append(
          tf.math.divide_no_nan(
            tf.tensordot(kept, tf.stack([p["mean_entropy"] for p in predictions]), 1),
            tf.reduce_sum(kept),
          )
        )
    return collections.OrderedDict(
      probabilities=np.concatenate(probabilities), mean_entropy=np.concatenate(entropies)
    )


def build_prototype_client_work(
  model_fns: Sequence[Callable[[], tf.keras.Model]],
  element_spec,
  config: client_work_lib.LocalTrainingConfig,
  size: int,
) -> client_work_lib.ClientWork:
  """Client work training the architecture of the client's prototype.

  A client downloads `(packed model [size], prototype)` and uploads
  `(packed update, prototype)` with its number of examples.
  """
  for model_fn in model_fns:
    client_work_lib.check_data_fits_model(model_fn, element_spec)
  download_type = tff.StructType([tff.TensorType(np.float32, [size]), tff.TensorType(np.int32)])

  def local_update(download, dataset, learning_rate, optimizer):
    packed, prototype = download
    models = [client_work_lib.model_to_overwrite(fn) for fn in model_fns]

    def train(model):
      def branch():
        result, metrics = client_work_lib.train_locally(
          model,
          optimizer,
          unpack(packed, ModelWeights.from_model(model)),
          dataset,
          learning_rate,
          config,
        )
        return pack(result.update, size), result.update_weight, metrics

      return branch

    update, weight, metrics = tf.switch_case(prototype, [train(model) for model in models])
    return tff.learning.templates.ClientResult((update, prototype), weight), metrics

  return client_work_lib.build_sgd_client_work(local_update, download_type, element_spec, config)


def build_heterogeneous_feddf(
  model_fns: Sequence[Callable[[], tf.keras.Model]],
  names: Sequence[str],
  element_spec,
  local_config: client_work_lib.LocalTrainingConfig,
  data: server_data_lib.ServerData,
  config: server_distillation.ServerDistillationConfig,
  *,
  clients_per_round: int,
  transport: transport_lib.Transport = transport_lib.VALUES,
) -> built_lib.BuiltProcess:
  """Builds FedDF over P prototypes as a `server_step.DriverProcess`.

  `next(state, client_data, client_indices)`: client i (its fixed index in
  the population) runs prototype `i mod P`. The state's `model` is the
  tuple of the P global models; the one evaluated is the first. What a client
  downloads and uploads is the largest prototype's size (see the module docstring).

  Args:
    model_fns: builds prototype p's Keras model (logits), its initial
      weights included; the models share input and classes.
    names: the prototypes' names.
    element_spec: `tf.TensorSpec`s of one client batch `(x, y)`.
    local_config: the clients' training (FedAvg's).
    data: the server's unlabeled and validation data.
    config: FedDF's server step (`targets="avg_logits"`, teachers="clients").
    clients_per_round: the largest cohort.
    transport: what moves the clients' updates to the driver (`transport.Transport.collect`).
  """
  weights_types = _checked_weights_types(model_fns, names, config)
  size = max(packed_size(tff.types.type_to_tf_tensor_specs(t)) for t in weights_types)
  client_work = build_prototype_client_work(model_fns, element_spec, local_config, size)
  client_update = client_work.client_update
  download_type = client_update.type_signature.parameter[0]

  @tff.tensorflow.computation
  def initial_prototypes():
    return tuple(ModelWeights.from_model(fn()) for fn in model_fns)

  distributor = _build_distributor(tff.StructWithPythonType(weights_types, tuple), size)
  initialize_fn, collect, update_specs = transport.collect(
    initial_prototypes,
    distributor,
    client_work.process,
    clients_per_round,
    keyed=True,
  )
  step = PrototypeStep(model_fns, names, data, config)
  client_type = client_update.type_signature
  download = tff.StructType(
    [("model", download_type), ("learning_rate", client_type.parameter.learning_rate)]
  )
  return built_lib.BuiltProcess(
    server_step.DriverProcess(
      initialize_fn,
      collect,
      step,
      step.teacher_probabilities,
      update_specs,
    ),
    download,
    client_type.result,
    lambda state: [state["model"][0]],
  )


def _checked_weights_types(model_fns, names, config) -> list[tff.Type]:
  """The prototypes' `ModelWeights` types; ValueError unless there are two or more, one name
  each, of float32 weights (packed into one vector), for FedDF's server step."""
  if len(model_fns) < 2 or len(names) != len(model_fns):
    raise ValueError(
      "heterogeneous FedDF needs two or more prototypes, one "
      f"name each; got {len(model_fns)} and names {names}"
    )
  if config.teachers != "clients":
    raise ValueError(
      f"prototypes teach with their clients' models; got teachers={config.teachers!r}: there "
      "is no posterior over models of different architectures"
    )
  weights_types = [client_work_lib.weights_type_of(fn) for fn in model_fns]
  for name, weights_type in zip(names, weights_types):
    spec = tff.types.type_to_tf_tensor_specs(weights_type)
    if any(s.dtype != tf.float32 for s in tf.nest.flatten(spec)):
      raise ValueError(
        f"prototype {name} has weights that are not float32: "
        "they cannot be packed into one float32 vector"
      )
  return weights_types


def _build_distributor(prototypes_type, size: int):
  """The keyed distributor sending client i prototype `i mod P`, packed into `size` floats
  (`keyed_stages.build_keyed_distributor`)."""
  num_prototypes = len(prototypes_type)

  @tff.tensorflow.computation((), np.int32)
  def prototype_of(state, client_index):
    del state  # A client's prototype depends on its index only.
    return tf.reshape(client_index % num_prototypes, [1])

  @tff.tensorflow.computation(prototypes_type, np.int32)
  def select_packed(prototypes, key):
    return (tf.switch_case(key, [lambda m=m: pack(m, size) for m in prototypes]),)

  @tff.tensorflow.computation(
    tff.SequenceType(select_packed.type_signature.result), tff.TensorType(np.int32, [1])
  )
  def to_download(selected, key):
    (packed,) = selected.reduce((tf.zeros([size], tf.float32),), lambda _, x: x)
    return packed, key[0]

  return keyed_stages.build_keyed_distributor(
    prototypes_type, (), prototype_of, select_packed, to_download
  )


def summary(names: Sequence[str], model_fns: Sequence[Callable[[], tf.keras.Model]]):
  """The `FederatedAlgorithm.summary` hook of FedDF over the prototypes `names`: the server
  step's keys and each prototype's test accuracy (`prototype_test_accuracy`), each saved as
  `prototypes/<name>.keras`."""

  def prototypes(finished) -> dict:
    accuracies = {}
    for name, model_fn, weights in zip(names, model_fns, finished.state["model"]):
      evaluator = finished.evaluator(model_fn)
      accuracies[name] = evaluator.summary([weights], finished.data.test)["test_accuracy"]
      path = os.path.join(run_files.PROTOTYPES_DIR, f"{name}.keras")
      finished.save_model(path, evaluator.model, weights)
    return {**server_step.summary(finished), "prototype_test_accuracy": accuracies}

  return prototypes
