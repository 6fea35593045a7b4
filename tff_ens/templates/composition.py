"""Four TFF stages as one `tff.learning.templates.LearningProcess`, with what
`tff.learning.templates.compose_learning_process` cannot pass: the cohort's client indices
(keyed distributors) and the states clients keep between their rounds.

`compose` gives the process the state `OrderedDict(model, distributor, client_work,
aggregator, finalizer)` and one metrics entry per stage, as `tff.learning` composes FedAvg's.
A client's index and state travel with its data, as one value at CLIENTS (`client_inputs`),
so `next` takes `(state, client inputs)` as every `LearningProcess` does.
"""

import collections
import dataclasses

import numpy as np
import tensorflow_federated as tff

from tff_ens.execution import client_values

LearningProcess = tff.learning.templates.LearningProcess
LearningProcessOutput = tff.learning.templates.LearningProcessOutput
# The fields of a client's input beyond its data (`client_inputs`).
DATA, INDEX, STATE = "data", "index", "state"


def compose(
  initial_model: tff.Computation,
  distributor: tff.templates.MeasuredProcess,
  client_work,
  aggregator: tff.templates.AggregationProcess,
  finalizer: tff.templates.MeasuredProcess,
  *,
  keyed: bool = False,
  client_state_type: tff.Type | None = None,
) -> tff.templates.IterativeProcess:
  """The stages as one process: `next(state, client inputs) -> LearningProcessOutput(state,
  metrics)`, a `LearningProcess` (`get_model_weights`: the state's model), or with client
  states that come back as values `(state, metrics, new client states)`, an
  `IterativeProcess`.

  A client's input is its data alone, or with `keyed` or `client_state_type` the struct
  `client_inputs` makes: its data, its index and its state.

  Args:
    initial_model: TFF computation `() -> the server's model(s)`.
    distributor: `next(state, model) -> (state, downloads at CLIENTS, measurements)`; with
      `keyed`, `next(state, models, client_indices) -> (state, (downloads, keys),
      measurements)` (`keyed_stages.build_keyed_distributor`).
    client_work: `initialize` and `next(state, downloads, client data) ->
      MeasuredProcessOutput` whose result's `update` and `update_weight` are the clients';
      with `client_state_type`, `next(state, downloads, client data, client states) ->
      (state, result, new client states, measurements)` (`stateful_client_work`).
    aggregator: `next(state, updates, weights[, keys])` (the keys with `keyed`, e.g.
      `keyed_stages.build_slot_aggregator`).
    finalizer: `next(state, model, aggregate) -> MeasuredProcessOutput(state, new model, ...)`.
    keyed: a client's input holds its index in the population (int32).
    client_state_type: what a client's input holds as its state (the state, or the paths of
      its files: `StatefulClientWork.next_state_type`), or None. States in files
      (`client_work.state_files`) stay where the client work wrote them; `next` returns
      the others.
  """

  @tff.federated_computation
  def init_fn():
    return tff.federated_zip(
      collections.OrderedDict(
        model=tff.federated_eval(initial_model, tff.SERVER),
        distributor=distributor.initialize(),
        client_work=client_work.initialize(),
        aggregator=aggregator.initialize(),
        finalizer=finalizer.initialize(),
      )
    )

  state_type = init_fn.type_signature.result
  data_type = client_work.next.type_signature.parameter[2].member
  input_type = _client_input_type(data_type, keyed, client_state_type)
  returns = client_state_type is not None and not client_work.state_files
  stages = _Stages(distributor, client_work, aggregator, finalizer, keyed, returns)

  @tff.federated_computation(state_type, tff.FederatedType(input_type, tff.CLIENTS))
  def next_fn(state, client_inputs):
    if input_type is data_type:
      return stages.round(state, client_inputs)
    indices = client_inputs[INDEX] if keyed else None
    states = client_inputs[STATE] if client_state_type is not None else None
    return stages.round(state, client_inputs[DATA], indices, states)

  if returns:
    return tff.templates.IterativeProcess(init_fn, next_fn)
  return _learning_process(init_fn, next_fn)


def _client_input_type(data_type, keyed: bool, client_state_type):
  """A client's input: its data, or the struct of its data, index and state."""
  if not keyed and client_state_type is None:
    return data_type
  fields = [(DATA, data_type)]
  if keyed:
    fields.append((INDEX, tff.TensorType(np.int32)))
  if client_state_type is not None:
    fields.append((STATE, client_state_type))
  return tff.StructWithPythonType(fields, collections.OrderedDict)


def client_inputs(datasets, indices=None, states=None) -> list:
  """`next`'s client inputs: the datasets alone, or per client its data, its index in the
  population (int32) and its state, those given."""
  if not isinstance(datasets, client_values.ClientValues):
    datasets = client_values.ClientValues(list(datasets))
  if indices is None and states is None:
    return datasets

  def packed(i: int, data):
    value = collections.OrderedDict([(DATA, data)])
    if indices is not None:
      value[INDEX] = np.int32(indices[i])
    if states is not None:
      value[STATE] = states[i]
    return value

  # Made when read, as the datasets are (`client_values`).
  return datasets.mapped(packed)


def takes_client_inputs(process) -> bool:
  """Whether `process.next` takes `client_inputs`' structs (a composed process whose
  clients pass an index or a state)."""
  next_fn = getattr(process, "next", None)
  if not isinstance(next_fn, tff.Computation):
    return False
  member = next_fn.type_signature.parameter[1].member
  return isinstance(member, tff.StructType) and tff.structure.name_list(member)[:1] == [DATA]


def _learning_process(init_fn, next_fn) -> LearningProcess:
  """`next_fn`'s process as a `LearningProcess` whose model weights are the state's model."""
  state_type = init_fn.type_signature.result.member
  model_type = state_type.model

  @tff.tensorflow.computation(state_type)
  def get_model_weights(state):
    return state["model"]

  @tff.tensorflow.computation(state_type, model_type)
  def set_model_weights(state, weights):
    return collections.OrderedDict(
      (name, weights if name == "model" else state[name])
      for name, _ in tff.structure.iter_elements(state_type)
    )

  return LearningProcess(init_fn, next_fn, get_model_weights, set_model_weights)


@dataclasses.dataclass(frozen=True)
class _Stages:
  """`compose`'s stages, whose `round` is the body of the process' `next`."""

  distributor: tff.templates.MeasuredProcess
  client_work: object
  aggregator: tff.templates.AggregationProcess
  finalizer: tff.templates.MeasuredProcess
  keyed: bool
  returns_client_states: bool

  def round(self, state, client_data, client_indices=None, client_states=None):
    """One round inside a federated computation: `LearningProcessOutput(state, metrics)`, or
    `(state, metrics, new client states)` with `returns_client_states`."""
    keys = ()
    if self.keyed:
      sent = self.distributor.next(state.distributor, state.model, client_indices)
      downloads, keys = sent.result
      keys = (keys,)
    else:
      sent = self.distributor.next(state.distributor, state.model)
      downloads = sent.result
    if client_states is None:
      work = self.client_work.next(state.client_work, downloads, client_data)
      work_state, result, work_metrics = work.state, work.result, work.measurements
    else:
      work_state, result, new_client_states, work_metrics = self.client_work.next(
        state.client_work, downloads, client_data, client_states
      )
    aggregate = self.aggregator.next(state.aggregator, result.update, result.update_weight, *keys)
    finalized = self.finalizer.next(state.finalizer, state.model, aggregate.result)
    new_state = tff.federated_zip(
      collections.OrderedDict(
        model=finalized.result,
        distributor=sent.state,
        client_work=work_state,
        aggregator=aggregate.state,
        finalizer=finalized.state,
      )
    )
    metrics = tff.federated_zip(
      collections.OrderedDict(
        distributor=sent.measurements,
        client_work=work_metrics,
        aggregator=aggregate.measurements,
        finalizer=finalized.measurements,
      )
    )
    if self.returns_client_states:
      return new_state, metrics, new_client_states
    return LearningProcessOutput(new_state, metrics)
