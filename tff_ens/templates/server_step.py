"""Learning processes whose server step runs in the driver's TensorFlow.

TFF 0.87's C++ worker places no op on a GPU (google-parfait/tensorflow-federated#4600), and
a SERVER computation's data are constants of its graph. So the server distillation of FedBE,
FedDF and FedPPD+Distill runs where a `tff.program` program runs its server-side logic: in
the program, between computations. A `DriverProcess` is TFF's four stages with the last one
moved out of TFF:

* `collect`, a TFF computation: the distributor, the client work and the aggregator, which
  returns every client's update (`build_collect_aggregator`: a `tff.federated_aggregate`
  places the i-th client's update into slot i of `capacity` slots). TFF's C++ worker keeps
  about ten copies of an update per client in that aggregation (benchmarks/RESULTS.md,
  "FedPPD+Distill's worker memory"), so with `upload_files` each client writes its update to
  a file instead (`write_update`) and the slots collect the files' paths, which the driver
  reads (`read_updates`);
* `step`, the finalizer: Python over `tf.function`s in this process, on `/GPU:0` when
  TensorFlow sees one (`distillation.choose_device`), its data streamed by `tf.data`.

`initialize` and `next(state, *client_args) -> (state, metrics, teachers)` keep the shape of
a TFF process; the state is a structure of arrays (`model`, the TFF stages' states, `round`),
so a checkpoint of it is complete: the step carries nothing else across rounds, and its
randomness is a function of (seed, round). The round's teachers (`RoundTeachers`) are an
output of the round, which the loop keeps for evaluation until the next one.
"""

import collections
import dataclasses
import functools
import os
import statistics
import tempfile
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2
import tensorflow_federated as tff

from tff_ens.math import evaluation
from tff_ens.templates import keyed_stages

# `step(model, collected, round) -> (model, measurements)`, run in the driver; the
# measurements' `server_device` is where its ops ran.
ServerStep = Callable[[Any, Any, int], tuple[Any, dict]]


@dataclasses.dataclass(frozen=True)
class RoundTeachers:
  """The teachers a round's server step distilled from, kept by the loop after the round
  (`ensemble_test_accuracy`, the teachers' uncertainty) without training a client again.

  Attributes:
    predict: `images -> OrderedDict(probabilities, mean_entropy, ...)`, what they predict.
    device: where the server step's ops ran ("/CPU:0", "/GPU:0"), read from TensorFlow's
      placement.
  """

  predict: Callable[[np.ndarray], dict] | None
  device: str | None


def summary(finished) -> dict:
  """A server step's keys of a run's summary (a `FederatedAlgorithm.summary` hook of an
  `algorithms.algorithm.FinishedRun`): the distilled model's and the last round's teachers'
  test accuracy, the server's seconds per round and distillation throughput, and the device
  the step's ops ran on (read from TensorFlow's placement; None if no round ran in this
  process)."""
  rows, teachers = finished.rows, finished.teachers
  server_seconds = [float(r["server_seconds"]) for r in rows if r.get("server_seconds")]
  # Throughput over the rounds that distilled (others skip the student).
  distilling = [r for r in rows if float(r.get("distill_examples") or 0)]
  examples = sum(float(r["distill_examples"]) for r in distilling)
  distill_seconds = sum(float(r["server_seconds"]) for r in distilling)
  teacher_test = finished.teacher_test
  return {
    "distilled_test_accuracy": finished.summary["test_accuracy"],
    "ensemble_test_accuracy": None
    if teacher_test is None
    else evaluation.test_accuracy(finished.data, teacher_test["probabilities"]),
    "server_seconds_per_round": statistics.median(server_seconds) if server_seconds else None,
    "distill_examples_per_second": examples / distill_seconds if distill_seconds else None,
    "server_device": teachers.device if teachers is not None else None,
  }


@dataclasses.dataclass(frozen=True)
class DriverProcess:
  """TFF's distributor, client work and aggregator, then a server step in the driver.

  Attributes:
    initialize_fn: TFF computation `() -> OrderedDict(model, <stage states>)` at SERVER.
    collect: TFF computation `(stages state, client data, *more client args) -> (stage
      states without the model, collected, measurements)`.
    step: the finalizer (`ServerStep`).
    teachers: `(model, collected, round, images) -> OrderedDict(probabilities,
      mean_entropy)`, the teacher ensemble `step` distills from; None if there is none.
    update_specs: with `collect` built with `upload_files` (it then takes each client's
      path to write its update to, last), the update's `tf.TensorSpec`s (`build_collect`'s);
      else None.
  """

  initialize_fn: tff.Computation
  collect: tff.Computation
  step: ServerStep
  teachers: Callable[..., dict] | None = None
  update_specs: Any = None

  def initialize(self) -> collections.OrderedDict:
    state = collections.OrderedDict(self.initialize_fn())
    state["round"] = np.int32(0)
    return state

  def next(self, state, *client_args) -> tuple[collections.OrderedDict, dict, RoundTeachers]:
    """One round: `collect` through the TFF context, then `step` here; returns the new
    state, the metrics and the round's teachers."""
    round_num = int(state["round"])
    stages = collections.OrderedDict((k, v) for k, v in state.items() if k != "round")
    if self.update_specs is None:
      stage_states, collected, measurements = self.collect(stages, *client_args)
    else:
      with tempfile.TemporaryDirectory(prefix="tff_ens_updates_") as directory:
        paths = [os.path.join(directory, f"client{i}.pb") for i in range(len(client_args[0]))]
        stage_states, (written, weights), measurements = self.collect(stages, *client_args, paths)
        collected = (read_updates(written, self.update_specs), weights)
    model, step_measurements = self.step(state["model"], collected, round_num)
    step_measurements = collections.OrderedDict(step_measurements)
    device = step_measurements.pop("server_device", None)
    teachers = None
    if self.teachers is not None:
      teachers = functools.partial(self.teachers, state["model"], collected, round_num)
    # The step's model in the state's own containers, so checkpoints and the
    # next round see one structure.
    model = tf.nest.pack_sequence_as(state["model"], tf.nest.flatten(model))
    new_state = collections.OrderedDict(model=to_numpy(model))
    new_state.update(stage_states)
    new_state["round"] = np.int32(round_num + 1)
    metrics = collections.OrderedDict(measurements)
    metrics["finalizer"] = collections.OrderedDict(
      (k, np.asarray(v)) for k, v in step_measurements.items()
    )
    return new_state, metrics, RoundTeachers(teachers, device)

  def get_model_weights(self, state):
    return state["model"]


def to_numpy(structure):
  """`structure` with every tensor as a NumPy array (checkpoints, TFF arguments)."""
  return tf.nest.map_structure(np.asarray, structure)


def build_collect(
  initial_model_fn: tff.Computation,
  distributor: tff.templates.MeasuredProcess,
  client_work: tff.templates.MeasuredProcess,
  capacity: int,
  *,
  keyed: bool = False,
  upload_files: bool = False,
) -> tuple[tff.Computation, tff.Computation, Any]:
  """`(initialize_fn, collect, update_specs)` of a `DriverProcess` from TFF stages.

  As `tff.learning.templates.compose_learning_process` composes them, the
  finalizer left out: the distributor sends the state's model, the clients
  train, and every client's update is collected into `capacity` slots
  (`build_collect_aggregator`) and returned. With `keyed`, the distributor is
  `keyed_stages.build_keyed_distributor`'s: `collect` takes the cohort's client indices
  after its data and passes them to it. With `upload_files`, `collect` takes each client's
  path last, the client writes its update there (`write_update`), the slots hold the
  paths, and `update_specs` are the update's `tf.TensorSpec`s to read them with (else None).
  """
  update_type = client_work.next.type_signature.result.result.member.update
  write = write_update(update_type) if upload_files else None
  aggregator = build_collect_aggregator(
    tff.TensorType(np.str_) if upload_files else update_type, capacity
  )

  @tff.federated_computation
  def initialize_fn():
    return tff.federated_zip(
      collections.OrderedDict(
        model=tff.federated_eval(initial_model_fn, tff.SERVER),
        distributor=distributor.initialize(),
        client_work=client_work.initialize(),
        aggregator=aggregator.initialize(),
      )
    )

  state_type = initialize_fn.type_signature.result
  data_type = client_work.next.type_signature.parameter[2]

  collect_round = functools.partial(_collect_round, client_work, aggregator, write)

  indices_type = tff.FederatedType(np.int32, tff.CLIENTS)
  paths_type = tff.FederatedType(np.str_, tff.CLIENTS)
  if keyed and upload_files:

    @tff.federated_computation(state_type, data_type, indices_type, paths_type)
    def collect(state, client_data, client_indices, paths):
      sent = distributor.next(state.distributor, state.model, client_indices)
      return collect_round(state, sent, sent.result[0], client_data, paths)
  elif keyed:

    @tff.federated_computation(state_type, data_type, indices_type)
    def collect(state, client_data, client_indices):
      sent = distributor.next(state.distributor, state.model, client_indices)
      return collect_round(state, sent, sent.result[0], client_data)
  elif upload_files:

    @tff.federated_computation(state_type, data_type, paths_type)
    def collect(state, client_data, paths):
      sent = distributor.next(state.distributor, state.model)
      return collect_round(state, sent, sent.result, client_data, paths)
  else:

    @tff.federated_computation(state_type, data_type)
    def collect(state, client_data):
      sent = distributor.next(state.distributor, state.model)
      return collect_round(state, sent, sent.result, client_data)

  update_specs = tff.types.type_to_tf_tensor_specs(update_type) if upload_files else None
  return initialize_fn, collect, update_specs


def _collect_round(client_work, aggregator, write, state, sent, downloads, client_data, paths=None):
  """`build_collect`'s round after the distributor, inside a federated computation: the
  clients train on their `downloads` (and write their updates to `paths` with `write`), the
  aggregator collects them; `(stage states, collected, measurements)`."""
  work = client_work.next(state.client_work, downloads, client_data)
  update = work.result.update
  if paths is not None:
    update = tff.federated_map(write, (update, paths))
  collected = aggregator.next(state.aggregator, update, work.result.update_weight)
  stage_states = tff.federated_zip(
    collections.OrderedDict(
      distributor=sent.state, client_work=work.state, aggregator=collected.state
    )
  )
  measurements = tff.federated_zip(
    collections.OrderedDict(
      distributor=sent.measurements,
      client_work=work.measurements,
      aggregator=collected.measurements,
    )
  )
  return stage_states, collected.result, measurements


def write_update(update_type: tff.Type) -> tff.Computation:
  """`(update, path) -> path`, which writes the update to the file `path`: a serialized string
  tensor (`tf.io.serialize_tensor`) of each of its tensors serialized, in `tf.nest` order."""

  @tff.tensorflow.computation(update_type, np.str_)
  def write(update, path):
    tensors = tf.stack([tf.io.serialize_tensor(t) for t in tf.nest.flatten(update)])
    written = tf.io.write_file(path, tf.io.serialize_tensor(tensors))
    with tf.control_dependencies([written]):
      return tf.identity(path)

  return write


def read_updates(paths, specs):
  """The updates `write_update` wrote to `paths` (empty: a slot no client filled, zeros) as
  `build_collect_aggregator`'s result: a structure of `specs` whose tensors are stacked
  [len(paths), ...]."""
  flat_specs = tf.nest.flatten(specs)
  stacked = [np.zeros([len(paths), *s.shape], s.dtype.as_numpy_dtype) for s in flat_specs]
  for i, path in enumerate(paths):
    if not path:
      continue
    with open(path, "rb") as f:
      tensors = tf.make_ndarray(tensor_pb2.TensorProto.FromString(f.read()))
    for leaf, tensor in zip(stacked, tensors, strict=True):
      leaf[i] = tf.make_ndarray(tensor_pb2.TensorProto.FromString(tensor))
  return tf.nest.pack_sequence_as(specs, stacked)


def placed_device(tensor) -> str:
  """Where TensorFlow placed the op that produced `tensor`, as "/CPU:0" or "/GPU:0"."""
  spec = tf.DeviceSpec.from_string(tensor.device)
  return f"/{spec.device_type}:{spec.device_index}"


def collect_update(accumulator, update, weight):
  """Places one client's (update, weight) into the next free slot.

  The accumulator is `(slots, weights, count)`: a tuple of `capacity`
  structures, their weights and the number filled. Only slot `count` is
  computed; the others pass through (`keyed_stages.add_to_slot`).
  """
  slots, weights, count = accumulator
  capacity = len(slots)
  with tf.control_dependencies(
    [tf.debugging.assert_less(count, capacity, message="more clients than collect slots")]
  ):
    count = tf.identity(count)
  slots = keyed_stages.add_to_slot(slots, update, count)  # Into zeros: the update itself.
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

  @tff.tensorflow.computation
  def zero():
    return (*keyed_stages.empty_slots(update_type, capacity), tf.constant(0, tf.int32))

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
