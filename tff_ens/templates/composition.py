"""Four TFF stages as one process, with what `tff.learning.templates.compose_learning_process`
cannot pass: the cohort's client indices (keyed distributors) and the states clients keep
between their rounds.

`compose` gives the process the state `OrderedDict(model, distributor, client_work,
aggregator, finalizer)` and one metrics entry per stage, as `tff.learning` composes FedAvg's.
"""

import collections
import dataclasses

import numpy as np
import tensorflow_federated as tff


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
  """The stages as one `tff.templates.IterativeProcess`.

  `next(state, client_data[, client_indices][, client_states]) -> (state, metrics[, new
  client states])`.

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
    keyed: `next` takes the cohort's client indices (int32 at CLIENTS) after its data.
    client_state_type: what `next` takes for each client's state (the state, or the paths of
      its files: `StatefulClientWork.next_state_type`), or None.
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
  data_type = client_work.next.type_signature.parameter[2]
  stages = _Stages(distributor, client_work, aggregator, finalizer, keyed)

  indices_type = tff.FederatedType(np.int32, tff.CLIENTS)
  if client_state_type is not None:
    states_type = tff.FederatedType(client_state_type, tff.CLIENTS)
  # TFF's computations take no varargs: one signature for each kind of `next`.
  if keyed and client_state_type is not None:

    @tff.federated_computation(state_type, data_type, indices_type, states_type)
    def next_fn(state, client_data, client_indices, client_states):
      return stages.round(state, client_data, client_indices, client_states)
  elif keyed:

    @tff.federated_computation(state_type, data_type, indices_type)
    def next_fn(state, client_data, client_indices):
      return stages.round(state, client_data, client_indices)
  elif client_state_type is not None:

    @tff.federated_computation(state_type, data_type, states_type)
    def next_fn(state, client_data, client_states):
      return stages.round(state, client_data, client_states=client_states)
  else:

    @tff.federated_computation(state_type, data_type)
    def next_fn(state, client_data):
      return stages.round(state, client_data)

  return tff.templates.IterativeProcess(init_fn, next_fn)


@dataclasses.dataclass(frozen=True)
class _Stages:
  """`compose`'s stages, whose `round` is the body of the process' `next`."""

  distributor: tff.templates.MeasuredProcess
  client_work: object
  aggregator: tff.templates.AggregationProcess
  finalizer: tff.templates.MeasuredProcess
  keyed: bool

  def round(self, state, client_data, client_indices=None, client_states=None):
    """One round inside a federated computation: `(state, metrics[, new client states])`."""
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
    if client_states is None:
      return new_state, metrics
    return new_state, metrics, new_client_states
