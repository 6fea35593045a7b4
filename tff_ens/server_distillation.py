"""FedBE, FedDF and v-Distillation: weight averaging replaced by server-side
ensemble distillation, as TFF learning processes.

Chen and Chao, "FedBE: Making Bayesian Model Ensemble Applicable to Federated
Learning", ICLR 2021, Algorithm 1; Lin, Kong, Stich and Jaggi, "Ensemble
Distillation for Robust Model Fusion in Federated Learning", NeurIPS 2020,
Algorithm 1.

FedAvg's four stages with two swapped (`compose_learning_process`):

* distributor and client work: FedAvg's (`client_work.build_client_work`);
* aggregator (`build_collect_aggregator`): the server needs every client's
  model, not only their mean. A `tff.federated_aggregate` places the i-th
  client's update into slot i of `capacity` slots (a counter in the
  accumulator), so the result is the cohort's updates and weights;
* finalizer (`build_distillation_finalizer`): a SERVER
  `tff.tensorflow.computation` rebuilds the client models (global - update),
  forms the teachers, labels the server's unlabeled data with them and
  distills into the student, which starts from the weight average:
  - "fedbe": teachers {average, clients, M samples of a Gaussian (eq. 5) or
    Dirichlet (eq. 7) over the client models} (`weight_posterior`), targets
    the ensemble's mean probabilities (optionally sharpened), SGD with SWA
    (`distillation.distill`);
  - "feddf": teachers the clients drop-worst keeps on the server's
    validation data, targets softmax(mean logits) (AVGLOGITS), Adam with
    cosine decay and early stopping on validation accuracy;
  - "vdistill": FedBE's v-Distillation baseline, teachers the clients,
    sharpened mean probabilities, plain SGD.

The server's data (`server_data.ServerData`) is part of the finalizer's
computation (constants of its graph), never of the clients'.
"""

import collections
import dataclasses
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import client_work as client_work_lib
from tff_ens import distillation
from tff_ens import fedavg
from tff_ens import server_data as server_data_lib
from tff_ens import weight_posterior

ModelWeights = tff.learning.models.ModelWeights

METHODS = ("fedbe", "feddf", "vdistill")
DISTRIBUTIONS = ("gaussian", "dirichlet")
# The temperature of each method's targets when `sharpen_temperature` is None.
DEFAULT_SHARPEN_TEMPERATURE = {"fedbe": 1.0, "vdistill": 0.5}


@dataclasses.dataclass(frozen=True)
class ServerDistillationConfig:
  """What the server does with the round's client models.

  Attributes:
    method: one of METHODS.
    distill: the student's training (`distillation.DistillationConfig`).
    distribution: FedBE's distribution over global models, "gaussian" or
      "dirichlet".
    num_samples: M, models sampled from it (FedBE).
    targets: FedBE's teachers, one of `weight_posterior.TARGETS`.
    dirichlet_alpha: the Dirichlet's alpha (FedBE, eq. 7).
    gaussian: FedBE's Gaussian fit, one of `weight_posterior.GAUSSIANS`
      ("paper": eq. 5; "code": the authors' normalized, scaled one with
      `gaussian_var_scale` and `gaussian_var_clamp`).
    dirichlet: FedBE's Dirichlet, one of `weight_posterior.DIRICHLETS`.
    sharpen_temperature: T > 0 of the targets of fedbe and vdistill, the
      ensemble's mean probabilities sharpened to p^(1/T) / sum p^(1/T)
      (`distillation.sharpen`; 1 keeps them; unused by feddf). None: the
      papers' (DEFAULT_SHARPEN_TEMPERATURE), 1 for fedbe (Chen and Chao,
      Sec. 4: the mean probabilities) and 0.5 for vdistill (Sec. 5); the
      authors' code sharpens both with 0.5.
    drop_worst: leave the worst clients out (FedDF).
    drop_worst_rule: which are the worst, one of
      `distillation.DROP_WORST_RULES` (`distillation.drop_worst_mask`):
      "guess_or_outliers" (the authors' code; the paper names no
      threshold) or "majority" (at most the majority-class rate).
    device: where the server computation runs (`distillation.choose_device`).
    seed: seeds the samples and the distillation's shuffles (with the round).
  """

  method: str
  distill: distillation.DistillationConfig
  distribution: str = "gaussian"
  num_samples: int = 10
  targets: str = "S+A+C"
  dirichlet_alpha: float = 1.0
  gaussian: str = "paper"
  gaussian_var_scale: float = 0.1
  gaussian_var_clamp: float = 1e-5
  dirichlet: str = "paper"
  sharpen_temperature: Optional[float] = None
  drop_worst: bool = False
  drop_worst_rule: str = "guess_or_outliers"
  device: str = "/CPU:0"
  seed: int = 0

  def __post_init__(self):
    for name, allowed in (
      ("method", METHODS),
      ("distribution", DISTRIBUTIONS),
      ("targets", weight_posterior.TARGETS),
      ("gaussian", weight_posterior.GAUSSIANS),
      ("dirichlet", weight_posterior.DIRICHLETS),
      ("drop_worst_rule", distillation.DROP_WORST_RULES),
    ):
      if getattr(self, name) not in allowed:
        raise ValueError(
          f"unknown {name} {getattr(self, name)!r}: choose one of {', '.join(allowed)}"
        )
    if self.num_samples < 1 and "S" in self.targets:
      raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
    if self.dirichlet_alpha <= 0:
      raise ValueError(f"dirichlet_alpha must be > 0, got {self.dirichlet_alpha}")
    if self.gaussian_var_scale <= 0 or self.gaussian_var_clamp < 0:
      raise ValueError(
        "need gaussian_var_scale > 0 and gaussian_var_clamp "
        f">= 0, got {self.gaussian_var_scale} and "
        f"{self.gaussian_var_clamp}"
      )
    if self.sharpen_temperature is not None and self.sharpen_temperature <= 0:
      raise ValueError(f"sharpen_temperature must be > 0, got {self.sharpen_temperature}")
    if self.method == "feddf" and not self.distill.eval_every:
      raise ValueError(
        "feddf stops early on validation data: its distill config needs eval_every > 0"
      )


def collect_update(accumulator, update, weight):
  """Places one client's (update, weight) into the next free slot.

  The accumulator is `(slots, weights, count)`: a tuple of `capacity`
  structures, their weights and the number filled. Only slot `count` is
  computed; the others pass through (see `fed_ensemble.scatter_add_update`).
  """
  slots, weights, count = accumulator
  capacity = len(slots)
  with tf.control_dependencies(
    [tf.debugging.assert_less(count, capacity, message="more clients than collect slots")]
  ):
    count = tf.identity(count)
  slots = tuple(
    tf.cond(tf.equal(count, i), lambda: update, lambda slot=slot: slot)
    for i, slot in enumerate(slots)
  )
  weights = weights + tf.cast(weight, tf.float32) * tf.one_hot(count, capacity)
  return slots, weights, count + 1


def merge_collected(a, b):
  """Appends b's filled slots after a's (for runtimes that merge partials)."""
  slots_a, weights_a, count_a = a
  slots_b, weights_b, count_b = b
  capacity = len(slots_a)
  stacked = tf.nest.map_structure(lambda *t: tf.stack(t), *(slots_a + slots_b))
  index = tf.range(capacity)
  source = tf.where(index < count_a, index, capacity + index - count_a)
  merged = tf.nest.map_structure(lambda t: tf.gather(t, source), stacked)
  weights = tf.gather(tf.concat([weights_a, weights_b], 0), source)
  weights = tf.where(index < count_a + count_b, weights, 0.0)
  return (
    tuple(tf.nest.map_structure(lambda t, i=i: t[i], merged) for i in range(capacity)),
    weights,
    count_a + count_b,
  )


def build_collect_aggregator(
  update_type: tff.Type, capacity: int
) -> tff.templates.AggregationProcess:
  """A weighted aggregation whose result is every client's update.

  Result at SERVER: `(updates, weights)` with `updates` stacked
  [capacity, ...] in the order the clients were aggregated and `weights`
  [capacity] (0 for a slot no client filled, e.g. a smaller cohort or a
  rejected update). The upload is one update and its weight per client, as
  FedAvg's.
  """
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}")
  specs = tff.types.type_to_tf_tensor_specs(update_type)

  @tff.tensorflow.computation
  def zero():
    return (
      tuple(
        tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), specs) for _ in range(capacity)
      ),
      tf.zeros([capacity], tf.float32),
      tf.constant(0, tf.int32),
    )

  accumulator_type = zero.type_signature.result

  @tff.tensorflow.computation(accumulator_type, (update_type, np.float32))
  def accumulate(accumulator, value):
    return collect_update(accumulator, *value)

  @tff.tensorflow.computation(accumulator_type, accumulator_type)
  def merge(a, b):
    return merge_collected(a, b)

  @tff.tensorflow.computation(accumulator_type)
  def report(accumulator):
    slots, weights, _ = accumulator
    return (tf.nest.map_structure(lambda *t: tf.stack(t), *slots), weights)

  @tff.tensorflow.computation(report.type_signature.result)
  def num_collected(collected):
    return tf.reduce_sum(tf.cast(collected[1] > 0, tf.int32))

  @tff.federated_computation
  def init_fn():
    return tff.federated_value((), tff.SERVER)

  @tff.federated_computation(
    init_fn.type_signature.result,
    tff.FederatedType(update_type, tff.CLIENTS),
    tff.FederatedType(np.float32, tff.CLIENTS),
  )
  def next_fn(state, updates, weights):
    collected = tff.federated_aggregate(
      tff.federated_zip((updates, weights)), zero(), accumulate, merge, report
    )
    return tff.templates.MeasuredProcessOutput(
      state,
      collected,
      tff.federated_zip(
        collections.OrderedDict(clients_collected=tff.federated_map(num_collected, collected))
      ),
    )

  return tff.templates.AggregationProcess(init_fn, next_fn)


def client_models(global_weights, updates):
  """The clients' models w_i = w - update_i, stacked like `updates`."""
  return tf.nest.map_structure(lambda w, u: w[None] - u, global_weights, updates)


def weighted_average(stacked, weights):
  """sum_i p_i w_i with p_i = weights_i / sum(weights) (FedAvg's average)."""
  weights = tf.cast(weights, tf.float32)
  p = tf.math.divide_no_nan(weights, tf.reduce_sum(weights))
  return tf.nest.map_structure(lambda t: tf.tensordot(p, t, axes=1), stacked)


def teachers(
  model: tf.keras.Model,
  global_weights,
  collected,
  seed,
  config: ServerDistillationConfig,
  validation,
):
  """The round's teachers, their weights and the student's start.

  Returns `(teacher_stack, teacher_weights, average, num_dropped,
  informative)`; the teacher weights are 0 for teachers to leave out
  (rejected or dropped clients). The average is over the clients kept.
  `informative` is False when drop-worst drops every client: there is then
  nothing to distill from, and the round's model is the average of
  all received clients (a FedAvg step), as in the first rounds of training.
  """
  updates, weights = collected
  clients = client_models(global_weights, updates)
  weights = tf.cast(weights, tf.float32)
  received = weights > 0
  keep = received
  informative = tf.constant(True)
  if config.drop_worst:
    val_x, val_y = validation
    accuracies = distillation.member_accuracies(model, clients, val_x, val_y)
    keep, informative = distillation.drop_worst_mask(
      config.drop_worst_rule, accuracies, val_y, model.output_shape[-1], members=received
    )
  weights = weights * tf.cast(keep, tf.float32)
  num_dropped = tf.reduce_sum(tf.cast(received, tf.int32)) - tf.reduce_sum(tf.cast(keep, tf.int32))
  average = weighted_average(clients, weights)
  if config.method != "fedbe":  # FedDF, v-Distillation: the clients.
    return (clients, tf.cast(weights > 0, tf.float32), average, num_dropped, informative)
  samples = None
  if "S" in config.targets:
    if config.distribution == "gaussian":
      # Fitted to the updates (better conditioned than the models, and the
      # variance is the same); the mean model is then w - mean update.
      mean_update, variance = weight_posterior.fit_gaussian_to_updates(
        updates, weights, config.gaussian, config.gaussian_var_scale, config.gaussian_var_clamp
      )
      mean = tf.nest.map_structure(tf.subtract, global_weights, mean_update)
      samples = weight_posterior.sample_gaussian(mean, variance, config.num_samples, seed)
    else:
      coefficients = weight_posterior.sample_dirichlet_coefficients(
        weights, config.dirichlet_alpha, config.num_samples, seed, config.dirichlet
      )
      samples = weight_posterior.combine_models(clients, coefficients)
  stack = weight_posterior.teacher_stack(
    config.targets, average, clients if "C" in config.targets else None, samples
  )
  return (
    stack,
    weight_posterior.teacher_weights(config.targets, weights, config.num_samples),
    average,
    num_dropped,
    informative,
  )


def distillation_targets(config: ServerDistillationConfig, predictions):
  """The student's targets from the teachers' `ensemble_predictions`.

  FedDF: AVGLOGITS (`distillation.avg_logits_targets`); FedBE and
  v-Distillation: the mean probabilities, `distillation.sharpen`ed with
  `config.sharpen_temperature` (or the method's default).
  """
  if config.method == "feddf":
    return distillation.avg_logits_targets(predictions["mean_logits"])
  temperature = config.sharpen_temperature
  if temperature is None:
    temperature = DEFAULT_SHARPEN_TEMPERATURE[config.method]
  return distillation.sharpen(predictions["mean_probabilities"], temperature)


def distill_if(
  informative,
  model: tf.keras.Model,
  start,
  unlabeled,
  targets,
  distill_config: distillation.DistillationConfig,
  seed,
  validation,
):
  """`distillation.distill` from `start` if `informative`, else `start`.

  A round whose clients drop-worst all drops keeps their average, so the
  server skips the distillation whose student it would discard; its stats
  then count 0 steps.
  """

  def skip():
    zero = tf.constant(0)
    return (
      tf.nest.pack_sequence_as(ModelWeights.from_model(model), tf.nest.flatten(start)),
      collections.OrderedDict(
        steps=zero, examples=zero, swa_models=zero, validation_accuracy=tf.constant(-1.0)
      ),
    )

  return tf.cond(
    informative,
    lambda: distillation.distill(
      model, start, unlabeled, targets, distill_config, seed, validation=validation
    ),
    skip,
  )


def round_seed(config: ServerDistillationConfig, round_num):
  """The server step's stateless seed for 0-based `round_num`."""
  return tf.random.experimental.stateless_fold_in(
    tf.constant([config.seed, 3], tf.int64), tf.cast(round_num, tf.int64)
  )


# One tf.function per server step: the steps share one Keras model, and only
# a tf.function orders its variable assignments and reads (a TFF computation's
# graph does not: a read after an assignment may see the old value).
@tf.function
def _server_step(
  model, global_weights, collected, seed, unlabeled, validation, config: ServerDistillationConfig
):
  start = tf.timestamp()
  # tf.timestamp is not ordered with the other ops unless told.
  with tf.control_dependencies([start]):
    stack, teacher_weights, average, num_dropped, informative = teachers(
      model, global_weights, collected, seed, config, validation
    )
    predictions = distillation.ensemble_predictions(model, stack, unlabeled, teacher_weights)
    student, stats = distill_if(
      informative,
      model,
      average,
      unlabeled,
      distillation_targets(config, predictions),
      config.distill,
      seed,
      validation,
    )
    distillation.assign_weights(model, student)
    student_accuracy = distillation.accuracy(
      distillation.predict_logits(model, validation[0], distillation.EVAL_BATCH_SIZE), validation[1]
    )
  # With no client this round, the model stays as it was; if drop-worst
  # drops every client, it is their average.
  received = tf.reduce_any(collected[1] > 0)
  new_weights = tf.nest.map_structure(
    lambda s, a, w: tf.where(received, tf.where(informative, s, a), w),
    student,
    average,
    global_weights,
  )
  with tf.control_dependencies(tf.nest.flatten(new_weights) + [student_accuracy]):
    seconds = tf.timestamp() - start
  measurements = collections.OrderedDict(
    student_validation_accuracy=student_accuracy,
    dropped_clients=num_dropped,
    distilled=tf.cast(informative, tf.int32),
    distill_steps=stats["steps"],
    distill_examples=stats["examples"],
    server_seconds=tf.cast(seconds, tf.float32),
  )
  return new_weights, measurements


def server_update(
  model_fn: Callable[[], tf.keras.Model],
  global_weights,
  collected,
  round_num,
  data: server_data_lib.ServerData,
  config: ServerDistillationConfig,
):
  """One round's server step: teachers, pseudo-labels, distillation.

  FedBE Algorithm 1 lines 7-10 / FedDF Algorithm 1 lines 6-9 (see the module
  docstring). Returns `(student weights, measurements)`.
  """
  model = model_fn()
  validation = (tf.constant(data.validation_x), tf.constant(data.validation_y))
  with tf.device(config.device):
    return _server_step(
      model,
      global_weights,
      collected,
      round_seed(config, round_num),
      tf.constant(data.unlabeled),
      validation,
      config,
    )


@tf.function
def _teacher_step(
  model, global_weights, collected, seed, validation, images, config: ServerDistillationConfig
):
  stack, teacher_weights, _, _, _ = teachers(
    model, global_weights, collected, seed, config, validation
  )
  predictions = distillation.ensemble_predictions(model, stack, images, teacher_weights)
  return collections.OrderedDict(
    probabilities=(
      tf.nn.softmax(predictions["mean_logits"])
      if config.method == "feddf"
      else predictions["mean_probabilities"]
    ),
    mean_entropy=predictions["mean_entropy"],
  )


def teacher_probabilities(
  model_fn,
  global_weights,
  collected,
  round_num,
  data: server_data_lib.ServerData,
  config: ServerDistillationConfig,
  images,
):
  """The round's teacher ensemble on `images`: `OrderedDict(probabilities,
  mean_entropy)`, its predictive distribution (FedDF: the softmax of
  AVGLOGITS) and its members' mean entropy.

  For reporting the teachers' accuracy (`ensemble_test_accuracy`) and
  uncertainty; the same teachers as `server_update` builds from the same
  inputs.
  """
  validation = (tf.constant(data.validation_x), tf.constant(data.validation_y))
  with tf.device(config.device):
    return _teacher_step(
      model_fn(),
      global_weights,
      collected,
      round_seed(config, round_num),
      validation,
      images,
      config,
    )


def build_step_finalizer(server_step: tff.Computation) -> tff.learning.templates.FinalizerProcess:
  """The finalizer running `server_step` at SERVER once a round.

  `server_step(global_weights, collected, round_num) -> (new weights,
  measurements)` is a `tff.tensorflow.computation`; the finalizer's state is
  the 0-based round number, which seeds the step.
  """
  weights_type, collected_type, _ = server_step.type_signature.parameter

  finalizer_init, increment = client_work_lib.round_counter()

  @tff.federated_computation(
    finalizer_init.type_signature.result,
    tff.FederatedType(weights_type, tff.SERVER),
    tff.FederatedType(collected_type, tff.SERVER),
  )
  def finalizer_next(round_num, global_weights, collected):
    new_weights, measurements = tff.federated_map(
      server_step, (global_weights, collected, round_num)
    )
    return tff.templates.MeasuredProcessOutput(
      tff.federated_map(increment, round_num), new_weights, measurements
    )

  return tff.learning.templates.FinalizerProcess(finalizer_init, finalizer_next)


@dataclasses.dataclass(frozen=True)
class ServerDistillationProcess:
  """The built process and its companion computations.

  Attributes:
    process: the `tff.learning.templates.LearningProcess`.
    client_work: the shared client work (its `client_update` gives the
      per-client download and upload types).
    teacher_probabilities: `(state, client_data, images) ->
      OrderedDict(probabilities, mean_entropy)`:
      what the teachers of the round `process.next(state, client_data)`
      would predict on `images` (float32 [n, ...] at SERVER).
  """

  process: tff.learning.templates.LearningProcess
  client_work: client_work_lib.ClientWork
  teacher_probabilities: tff.Computation


def build_server_distillation(
  model_fn: Callable[[], tf.keras.Model],
  element_spec,
  local_config: client_work_lib.LocalTrainingConfig,
  data: server_data_lib.ServerData,
  config: ServerDistillationConfig,
  *,
  clients_per_round: int,
) -> ServerDistillationProcess:
  """Builds FedBE, FedDF or v-Distillation (`config.method`).

  Args:
    model_fn: no-arg function building the (global and client) model.
    element_spec: `tf.TensorSpec`s of one client batch `(x, y)`.
    local_config: the clients' training (FedAvg's).
    data: the server's unlabeled and validation data.
    config: the server step.
    clients_per_round: the largest cohort (slots of the collect aggregator).
  """
  weights_type = client_work_lib.weights_type_of(model_fn)
  client_work = client_work_lib.build_client_work(model_fn, element_spec, local_config)
  distributor = tff.learning.templates.build_broadcast_process(weights_type)
  aggregator = build_collect_aggregator(weights_type, clients_per_round)
  collected_type = aggregator.next.type_signature.result.result.member

  @tff.tensorflow.computation(weights_type, collected_type, np.int32)
  def server_step(global_weights, collected, round_num):
    return server_update(model_fn, global_weights, collected, round_num, data, config)

  process = tff.learning.templates.compose_learning_process(
    fedavg.build_initial_weights_fn(model_fn),
    distributor,
    client_work.process,
    aggregator,
    build_step_finalizer(server_step),
  )

  images_type = tff.TensorType(np.float32, [None, *input_shape(model_fn)])

  @tff.tensorflow.computation(weights_type, collected_type, np.int32, images_type)
  def teacher_step(global_weights, collected, round_num, images):
    return teacher_probabilities(
      model_fn, global_weights, collected, round_num, data, config, images
    )

  state_type = process.next.type_signature.parameter[0]
  data_type = process.next.type_signature.parameter[1]

  @tff.federated_computation(state_type, data_type, tff.FederatedType(images_type, tff.SERVER))
  def teachers_of_round(state, client_data, images):
    global_weights = state.global_model_weights
    work = client_work.process.next(
      state.client_work, tff.federated_broadcast(global_weights), client_data
    )
    collected = aggregator.next(
      state.aggregator, work.result.update, work.result.update_weight
    ).result
    return tff.federated_map(teacher_step, (global_weights, collected, state.finalizer, images))

  return ServerDistillationProcess(process, client_work, teachers_of_round)


def input_shape(model_fn) -> tuple[int, ...]:
  """The input shape (without batch) of the model `model_fn` builds."""
  with tf.Graph().as_default():
    return tuple(model_fn().input_shape[1:])
