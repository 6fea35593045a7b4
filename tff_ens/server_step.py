"""Learning processes whose server step runs in the driver's TensorFlow.

TFF 0.87's C++ worker places no op on a GPU (google-parfait/tensorflow-federated#4600), and
a SERVER computation's data are constants of its graph. So the server distillation of FedBE,
FedDF and FedPPD+Distill runs where a `tff.program` program runs its server-side logic: in
the program, between computations. A `DriverProcess` is TFF's four stages with the last one
moved out of TFF:

* `collect`, a TFF computation: the distributor, the client work and the aggregator, which
  returns every client's update (`server_distillation.build_collect_aggregator`);
* `step`, the finalizer: Python over `tf.function`s in this process, on `/GPU:0` when
  TensorFlow sees one (`distillation.choose_device`), its data streamed by `tf.data`.

`initialize` and `next(state, *client_args) -> (state, metrics)` keep the shape of a TFF
process; the state is a structure of arrays (`model`, the TFF stages' states, `round`), so a
checkpoint of it is complete: the step carries nothing else across rounds, and its randomness
is a function of (seed, round).
"""

import collections
import dataclasses
from typing import Any, Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

# `step(model, collected, round) -> (model, measurements)`, run in the driver.
ServerStep = Callable[[Any, Any, int], tuple[Any, dict]]


@dataclasses.dataclass
class DriverProcess:
  """TFF's distributor, client work and aggregator, then a server step in the driver.

  Attributes:
    initialize_fn: TFF computation `() -> OrderedDict(model, <stage states>)` at SERVER.
    collect: TFF computation `(stages state, client data, *more client args) -> (stage
      states without the model, collected, measurements)`.
    step: the finalizer (`ServerStep`).
    teachers: `(model, collected, round, images) -> OrderedDict(probabilities,
      mean_entropy)`, the teacher ensemble `step` distills from; None if there is none.
  """

  initialize_fn: tff.Computation
  collect: tff.Computation
  step: ServerStep
  teachers: Callable[..., dict] | None = None

  def __post_init__(self):
    self._last_round = None  # (model, collected, round) of the last `next`.

  def initialize(self) -> collections.OrderedDict:
    state = collections.OrderedDict(self.initialize_fn())
    state["round"] = np.int32(0)
    return state

  def next(self, state, *client_args) -> tuple[collections.OrderedDict, dict]:
    """One round: `collect` through the TFF context, then `step` here."""
    round_num = int(state["round"])
    stages = collections.OrderedDict((k, v) for k, v in state.items() if k != "round")
    stage_states, collected, measurements = self.collect(stages, *client_args)
    model, step_measurements = self.step(state["model"], collected, round_num)
    self._last_round = (state["model"], collected, round_num)
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
    return new_state, metrics

  def get_model_weights(self, state):
    return state["model"]

  def last_round_teachers(self, images: np.ndarray) -> dict:
    """What the teachers of the last `next` predict on `images` (no client trains again)."""
    if self.teachers is None or self._last_round is None:
      raise ValueError("no round with teachers has run")
    return self.teachers(*self._last_round, images)


def to_numpy(structure):
  """`structure` with every tensor as a NumPy array (checkpoints, TFF arguments)."""
  return tf.nest.map_structure(np.asarray, structure)


def build_collect(
  initial_model_fn: tff.Computation,
  distributor: tff.templates.MeasuredProcess,
  client_work: tff.templates.MeasuredProcess,
  aggregator: tff.templates.AggregationProcess,
) -> tuple[tff.Computation, tff.Computation]:
  """`(initialize_fn, collect)` of a `DriverProcess` from TFF stages.

  As `tff.learning.templates.compose_learning_process` composes them, the
  finalizer left out: the distributor sends the state's model, the clients
  train, and the aggregator's result (every client's update) is returned.
  """

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

  @tff.federated_computation(state_type, data_type)
  def collect(state, client_data):
    sent = distributor.next(state.distributor, state.model)
    work = client_work.next(state.client_work, sent.result, client_data)
    collected = aggregator.next(state.aggregator, work.result.update, work.result.update_weight)
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

  return initialize_fn, collect


def placed_device(tensor) -> str:
  """Where TensorFlow placed the op that produced `tensor`, as "/CPU:0" or "/GPU:0"."""
  spec = tf.DeviceSpec.from_string(tensor.device)
  return f"/{spec.device_type}:{spec.device_index}"
