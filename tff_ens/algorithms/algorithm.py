"""What the training loop drives: a built algorithm (`FederatedAlgorithm`).

`FederatedAlgorithm` adds to an algorithm's TFF process what the loop needs around it: how
to call `next` for a cohort, which models the state holds (one, or K for ensembles), and
the types of what one client downloads and uploads in a round (`type_size_bytes`).
`algorithms.build_algorithm` builds one.
"""

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.execution import runtime
from tff_ens.program import client_states
from tff_ens.templates import server_step

ModelWeights = tff.learning.models.ModelWeights


@dataclasses.dataclass(frozen=True)
class BuiltProcess:
  """What every algorithm's builder returns.

  Attributes:
    process: the TFF process (`initialize`, `next`): a `tff.learning` process, a
      `tff.templates.IterativeProcess` or a `server_step.DriverProcess`.
    download_type: what one client receives in a round (a TFF type).
    upload_type: what one client sends in a round.
    models_fn: `state -> list[ModelWeights]`, the model(s) to evaluate (one, or an
      ensemble's K).
  """

  process: Any
  download_type: tff.Type
  upload_type: tff.Type
  models_fn: Callable[[Any], list[ModelWeights]]


def built_from_client_work(process, client_work, models_fn=None) -> BuiltProcess:
  """The `BuiltProcess` of a process whose clients all train one model with `client_work`
  (a `client_work.ClientWork`): a client receives its computation's parameters but for
  its own data (a sequence, sized 0) and sends back its result; `models_fn` defaults to
  the process's model (`get_model_weights`)."""
  client_update = client_work.client_update.type_signature
  return BuiltProcess(
    process,
    client_update.parameter,
    client_update.result,
    models_fn or (lambda state: [process.get_model_weights(state)]),
  )


@dataclasses.dataclass(frozen=True)
class FederatedAlgorithm:
  """A built algorithm: its TFF process and how the training loop drives it.

  Attributes:
    name: the algorithm's flag value.
    process: the TFF process (`initialize`, `next`).
    download_type: what one client receives in a round (a TFF type).
    upload_type: what one client sends in a round.
    indexed_clients: whether `process.next` takes the cohort's client
      indices (int32 at CLIENTS) after its data (Fed-ensemble's permutation
      rows, FedDF's prototypes); `tff.learning` processes do not.
    models_fn: `state -> list[ModelWeights]`, the model(s) to evaluate.
    teacher_fn: for server-distillation algorithms, `images ->
      OrderedDict(probabilities, mean_entropy)` of the teachers the last
      round distilled from (`server_step.DriverProcess.last_round_teachers`);
      None otherwise.
    server_device: for algorithms whose server step runs in the driver, `() ->`
      the device its ops last ran on (None before the first round); None otherwise.
    evaluation_model_fn: builds the Keras model `models_fn`'s weights fit
      when it is not the task's `--model` (FedPPD's student); None otherwise.
    prototypes_fn: for FedDF over model prototypes, `state -> [(name,
      model_fn, weights)]`, every prototype's model (`models_fn` gives the
      first); None otherwise.
    client_state: for algorithms whose clients keep a state between rounds
      (FedDyn), what it is; `process.next` then takes the cohort's states
      last and returns their new values after the metrics. None otherwise.
    client_models: `(client indices, key state) -> [k]`, the model of `models_fn` each
      client trains in the round whose distributor state is the key state (the state's
      `distributor`, which the distributor also reports as its measurements for the next
      round; Fed-ensemble's `assigned_model`, as its distributor computes it); None: every
      client trains the first.
  """

  name: str
  process: tff.templates.IterativeProcess | server_step.DriverProcess
  download_type: tff.Type
  upload_type: tff.Type
  indexed_clients: bool
  models_fn: Callable[[Any], list[ModelWeights]]
  teacher_fn: Callable[[np.ndarray], dict] | None = None
  server_device: Callable[[], str | None] | None = None
  evaluation_model_fn: Callable[[], tf.keras.Model] | None = None
  prototypes_fn: (
    Callable[[Any], list[tuple[str, Callable[[], tf.keras.Model], ModelWeights]]] | None
  ) = None
  client_state: client_states.ClientStateSpec | None = None
  client_models: Callable[[Sequence[int], Any], list[int]] | None = None

  @classmethod
  def of(cls, name: str, built: BuiltProcess, **hooks) -> "FederatedAlgorithm":
    """The algorithm `name` of a builder's result; `hooks` are the other fields."""
    return cls(
      name=name,
      process=built.process,
      download_type=built.download_type,
      upload_type=built.upload_type,
      models_fn=hooks.pop("models_fn", built.models_fn),
      **{"indexed_clients": False, **hooks},
    )

  def next_args(self, datasets: Sequence[tf.data.Dataset], client_indices, states=None) -> tuple:
    """`process.next`'s arguments after the state, for one cohort.

    `client_indices` are the cohort's positions in the task's client list;
    `states` their stored states (`client_state`), zeros if None.
    """
    args = (list(datasets),)
    if self.indexed_clients:
      args += ([np.int32(i) for i in client_indices],)
    if self.client_state is not None:
      args += (
        list(states) if states is not None else [self.client_state.zeros() for _ in client_indices],
      )
    return args

  def next_fn(self, state, datasets: Sequence[tf.data.Dataset], client_indices) -> tuple[Any, dict]:
    """`(state, metrics)` of one round through the execution context."""
    return runtime.state_and_metrics(
      self.process.next(state, *self.next_args(datasets, client_indices))
    )

  def bytes_per_client_round(self) -> tuple[int, int]:
    """(bytes down, bytes up) for one client in one round, from the types."""
    return (type_size_bytes(self.download_type), type_size_bytes(self.upload_type))


def type_size_bytes(type_spec: tff.Type) -> int:
  """Bytes of the tensors in a TFF type; sequences (local data) count 0."""
  if isinstance(type_spec, tff.TensorType):
    if None in type_spec.shape:
      raise ValueError(f"cannot size a tensor of unknown shape: {type_spec}")
    return int(np.prod(type_spec.shape, dtype=np.int64) * np.dtype(type_spec.dtype).itemsize)
  if isinstance(type_spec, tff.StructType):
    return sum(type_size_bytes(t) for t in type_spec)
  if isinstance(type_spec, tff.FederatedType):
    return type_size_bytes(type_spec.member)
  if isinstance(type_spec, tff.SequenceType):
    return 0
  raise TypeError(f"unexpected type in a client computation: {type_spec}")
