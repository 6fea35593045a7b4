"""What an algorithm module registers (`Algorithm`) and what its builder returns
(`FederatedAlgorithm`, the interface the round loop drives).

An algorithm is one module of `tff_ens.algorithms`: its settings (a settings group,
`settings.setting`, or groups declared next to the library code that reads them), its
builder `build(context: BuildContext) -> FederatedAlgorithm`, which composes the TFF stages
its paper changes, its rules (`validate`) and one `Algorithm`, `ALGORITHM`, listed in one
line of `algorithms.REGISTRY`. Everything the program asks an algorithm is a hook of
`FederatedAlgorithm` that every algorithm answers, the program's own behaviour by default
(Flower's strategy methods): its cohort (`cohort`), the int32 its clients pass (`client_keys`),
the model each client trains (`assigned_models`), the dataset a client trains on
(`client_data`), what clients keep between their rounds (`ClientStates`, with each client's
own model), and its keys of the run's summary (`summary`,
from a `FinishedRun`); `Algorithm` holds its saved-config upgrades (its settings' `before=`
values and `upgrade_saved`) and its recipe for binarized models (`binary_recipe`).
"""

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.execution import client_values
from tff_ens.execution import resident_state
from tff_ens.templates import built as built_lib
from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import composition
from tff_ens.templates import server_step
from tff_ens.templates import transport as transport_lib

ModelWeights = tff.learning.models.ModelWeights


@dataclasses.dataclass(frozen=True)
class BuildContext:
  """What a builder builds from: the run's model, its clients' data and training, and its
  settings, resolved once by the program (or given by a library user).

  Attributes:
    model_fn: `k -> Keras model`, the run's model initialized for ensemble member k (0 for
      single-model algorithms).
    element_spec: `tf.TensorSpec`s of one client batch `(x, y)`.
    local: the clients' training.
    groups: the settings groups the algorithm reads (`Algorithm.settings`), instances given
      as a sequence or a mapping by type; a group not given takes its defaults (`group`).
    seed: the run's seed.
    num_clients: the population (FedDyn's m, the state of stateful clients).
    clients_per_round: the largest cohort.
    server_data: the server's data (`server.server_data.ServerData`) of algorithms that
      take it (`Algorithm.server_data`), else None.
    dp: DP-FedAvg's aggregation (`templates.privacy.DPConfig`) of algorithms that take it
      (`Algorithm.dp`), else None.
    on_device: the clients train on devices (`Algorithm.on_device`): their data are the
      devices' results (`device_client_work.build_device_client_work`).
    recalibration_images: server images on which the FedAvg family measures the new model's
      batch-norm statistics each round (`Algorithm.recalibrates`), else None.
    build_model: `(name, seed) -> Keras model`, the task's model called `name` (FedDF's
      prototypes, FedPPD's student); None where no algorithm needs another model.
    task: the run's task (a `tasks` module: its models, its constants), else None.
    model: the name of the run's model (`model_fn`'s).
    transport: the program's `templates.transport.Transport`, which builds the stages that
      move the states clients keep between their rounds and the updates a server step
      collects (values through TFF's executor by default).
  """

  model_fn: Callable[..., tf.keras.Model]
  element_spec: Any
  local: client_work_lib.LocalTrainingConfig
  groups: Sequence[Any] | Mapping[type, Any] = ()
  seed: int = 0
  num_clients: int = 1
  clients_per_round: int = 10
  server_data: Any = None
  dp: Any = None
  on_device: bool = False
  recalibration_images: np.ndarray | None = None
  build_model: Callable[[str, int], tf.keras.Model] | None = None
  task: Any = None
  model: str = ""
  transport: transport_lib.Transport = transport_lib.VALUES

  def __post_init__(self):
    if not isinstance(self.groups, Mapping):
      object.__setattr__(self, "groups", {type(g): g for g in self.groups})

  def group(self, group_type: type):
    """The run's settings of `group_type`; its defaults if none were given."""
    return self.groups.get(group_type) or group_type()


@dataclasses.dataclass(frozen=True)
class RunFacts:
  """What an algorithm's rules (`Algorithm.validate`) check of the run beyond its groups.

  Attributes:
    task: the run's task (a `tasks` module), named `task_name`.
    model: the name of the run's model.
    dp: DP-FedAvg's aggregation (`templates.privacy.DPConfig`), None without `--dp_*`.
    client_runtime: `--client_runtime`, and whether it trains the clients on devices.
    recalibrate_batch_norm: `--recalibrate_batch_norm`.
  """

  task: Any
  task_name: str
  model: str
  dp: Any
  client_runtime: str
  on_devices: bool
  recalibrate_batch_norm: int


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """A registered algorithm: what its module declares.

  Attributes:
    name: its `--algorithm` value.
    summary: one line for `--help` and the docs' tables.
    build: `BuildContext -> FederatedAlgorithm`.
    settings: the settings groups it reads besides the run's common ones (the program
      refuses a flag of a group no chosen algorithm reads).
    validate: `(groups, RunFacts) -> None`, its rules across its settings groups (by type,
      as `settings` lists them) and the run's facts; raises `settings.SettingError` naming
      the flag. None: no rule.
    server_data: its server step uses the server's data.
    dp: its server needs only the mean of the clients' updates, so DP-FedAvg's clipped and
      noised mean can replace it.
    recalibrates: it can measure its models' batch-norm statistics on server images
      (`BuildContext.recalibration_images`): FedAvg's finalizer the new model's, the server
      distillation step each teacher's and the weight average's.
    on_device: its clients run plain local SGD(M), which devices can.
    variant_flags: flags that name its variant, shown by `compare` even at their defaults.
    binary_recipe: `flag values -> {flag: value}`, what a run of a binarized model with those
      flags takes by default besides the model's own recipe (`tasks.resnet.BINARY_RECIPE`);
      None drops a flag of that recipe.
  """

  name: str
  summary: str
  build: Callable[[BuildContext], "FederatedAlgorithm"]
  settings: tuple[type, ...] = ()
  validate: Callable[[Mapping[type, Any], "RunFacts"], None] | None = None
  server_data: bool = False
  dp: bool = False
  recalibrates: bool = False
  on_device: bool = False
  variant_flags: tuple[str, ...] = ()
  binary_recipe: Callable[[Mapping[str, Any]], Mapping[str, Any]] = lambda values: {}


@dataclasses.dataclass(frozen=True)
class ClientStates:
  """What each client keeps between its rounds (FedDyn's g, a personal model, a client's own
  layers): one array per (client, key), which the program stores and passes to `next` for
  the cohort.

  Attributes:
    shape, dtype: one client's state.
    keys: `(cohort, key state) -> [key]`, which of its states each client of the cohort
      uses in the round whose distributor state is the key state (Fed-ensemble with FedDyn:
      the member it trains); None: one state per client (key 0).
    initial: a client's state before its first round; None: zeros.
    model: `(state, global models) -> ModelWeights`, the client's own model for evaluation on
      its own examples and export (`own_models`); None: the clients have none.
    in_files: `next` takes each client's paths to read and write its state
      (`BuildContext.transport` with files), not the state.
  """

  shape: tuple[int, ...]
  dtype: np.dtype
  keys: Callable[[Sequence[int], Any], list[int]] | None = None
  initial: Callable[[], np.ndarray] | None = None
  model: Callable[[np.ndarray, list[ModelWeights]], ModelWeights] | None = None
  in_files: bool = False

  @classmethod
  def of(cls, state_type: tff.Type, **fields) -> "ClientStates":
    """The states of a client state's TFF type (one tensor)."""
    return cls(tuple(state_type.shape), np.dtype(state_type.dtype), **fields)

  def initial_value(self) -> np.ndarray:
    return self.initial() if self.initial is not None else np.zeros(self.shape, self.dtype)

  def keys_of(self, cohort: Sequence[int], key_state) -> list[int]:
    return self.keys(cohort, key_state) if self.keys is not None else [0] * len(cohort)


@dataclasses.dataclass(frozen=True)
class RoundResult:
  """What one round gives the loop.

  Attributes:
    metrics: the process's round metrics, one entry per stage.
    client_states: the cohort's new states (`ClientStates`), else None.
    output: what the round leaves for evaluation: a `DriverProcess`'s round teachers
      (`templates.server_step.RoundTeachers`), else None.
  """

  metrics: Any
  client_states: list | None = None
  output: Any = None


@dataclasses.dataclass(frozen=True)
class FinishedRun:
  """What a finished run gives an algorithm's `FederatedAlgorithm.summary` hook: its final
  state and what the program measured, and the program's evaluation and files (FedJAX's
  evaluation passed in).

  Attributes:
    state: the final process state.
    models: its model(s) (`FederatedAlgorithm.models_fn`).
    data: the task's data (`tasks.data.FederatedData`).
    summary: the summary's keys so far (the models' test metrics).
    rows: metrics.csv's rows, one per round.
    teachers: the last round's teachers (`RoundResult.output`), or None.
    teacher_test: their predictions on every evaluation split, or None.
    evaluator: `model_fn -> evaluator` of that Keras model (`summary(models, split)`,
      `member_probabilities`, its `model`); `evaluator(None)` is the run's own.
    save_model: `(path in the run's directory, Keras model, weights) -> None`.
    client_state: `client index -> its newest stored state (key 0)`, None if it never trained.
  """

  state: Any
  models: list
  data: Any
  summary: Mapping[str, Any]
  rows: Sequence[Mapping[str, Any]]
  teachers: Any
  teacher_test: Any
  evaluator: Callable[[Callable[[], tf.keras.Model] | None], Any]
  save_model: Callable[[str, tf.keras.Model, ModelWeights], None]
  client_state: Callable[[int], np.ndarray | None]


def sampled_cohort(num_clients: int, seed: int, round_num: int, sample) -> np.ndarray:
  """The cohort the program samples (`sample()`: `--clients_per_round` clients drawn
  uniformly by (seed, round))."""
  del num_clients, seed, round_num
  return sample()


def program_client_data(client: int, x: np.ndarray, y: np.ndarray, batches) -> tf.data.Dataset:
  """The dataset the program trains a client on: its examples' `batches(x, y)` (shuffled,
  repeated, batched: `simulation.client_dataset`)."""
  del client
  return batches(x, y)


@dataclasses.dataclass(frozen=True)
class FederatedAlgorithm:
  """A built algorithm: its TFF process and the hooks the round loop and the summary call.

  Attributes:
    name: the algorithm's flag value.
    process: the TFF process (`initialize`, `next`).
    download_type: what one client receives in a round (a TFF type).
    upload_type: what one client sends in a round.
    models_fn: `state -> list[ModelWeights]`, the global model(s) to evaluate.
    evaluation_model_fn: builds the Keras model `models_fn`'s weights fit.
    client_keys: `(cohort, slots) -> [int]`, the int32 each client passes to `next` with its
      data (the index of `composition.client_inputs`): its index in the population
      (Fed-ensemble's permutation rows, FedDF's prototypes) or its slot in the sampled
      cohort (a random walk's walker); None: `next` takes none.
    assigned_models: `(cohort, key state) -> [k]`, the model of `models_fn` each client trains
      in the round whose distributor state is the key state (which the distributor reports
      as its measurements for the next round; Fed-ensemble's `assigned_model`); None: every
      client trains the first.
    client_states: what each client keeps between its rounds, else None.
    cohort: `(num_clients, seed, round, sample) -> client indices`, the clients of a round
      (`sampled_cohort`: the program's uniform `sample()`; a random walk's walkers).
    client_data: `(client index, x, y, batches) -> tf.data.Dataset`, the dataset a client
      passes to `next` from its training examples and the program's `batches(x, y)`
      (`program_client_data`; Ditto's holds out a validation batch first).
    summary: `FinishedRun -> {key: value}`, the algorithm's own keys of `summary.json`.
  """

  name: str
  process: Any
  download_type: tff.Type
  upload_type: tff.Type
  models_fn: Callable[[Any], list[ModelWeights]]
  evaluation_model_fn: Callable[[], tf.keras.Model]
  client_keys: Callable[[np.ndarray, np.ndarray], Sequence[int]] | None = None
  assigned_models: Callable[[Sequence[int], Any], list[int]] | None = None
  client_states: ClientStates | None = None
  cohort: Callable[..., np.ndarray] = sampled_cohort
  client_data: Callable[..., tf.data.Dataset] = program_client_data
  summary: Callable[[FinishedRun], Mapping[str, Any]] = lambda finished: {}

  @property
  def packs_client_inputs(self) -> bool:
    """`next` takes each client's data, index and state as one value (`composition`)."""
    return composition.takes_client_inputs(self.process)

  @property
  def keyed(self) -> bool:
    """Which model a client trains depends on the distributor's state (`key_state`)."""
    states = self.client_states
    return self.assigned_models is not None or (states is not None and states.keys is not None)

  def models_assigned(self, cohort: Sequence[int], key_state) -> list[int]:
    """The model of `models_fn` each client of `cohort` trains (`assigned_models`)."""
    if self.assigned_models is None:
      return [0] * len(cohort)
    return self.assigned_models(cohort, key_state)

  @classmethod
  def of(cls, name: str, built: built_lib.BuiltProcess, context: BuildContext, **fields):
    """The algorithm `name` of a process builder's result; `fields` are the others. A
    `DriverProcess`'s summary has its server step's keys (`server_step.summary`) by default."""
    states = fields.pop("client_states", None)
    if states is not None:
      states = dataclasses.replace(states, in_files=context.transport.files)
    if isinstance(built.process, server_step.DriverProcess):
      fields.setdefault("summary", server_step.summary)
    return cls(
      client_states=states,
      name=name,
      process=built.process,
      download_type=built.download_type,
      upload_type=built.upload_type,
      models_fn=fields.pop("models_fn", built.models_fn),
      evaluation_model_fn=fields.pop("evaluation_model_fn", lambda: context.model_fn(0)),
      **fields,
    )

  def next_args(
    self,
    datasets: Sequence[tf.data.Dataset],
    cohort: Sequence[int],
    slots: Sequence[int] | None = None,
    states: Sequence[np.ndarray] | None = None,
  ) -> tuple:
    """`process.next`'s arguments after the state, for one cohort: its client inputs
    (`composition.client_inputs`: the datasets, with the `client_keys` from the clients'
    indices in the population `cohort` and their `slots` in the sampled cohort, by default
    their order, and their stored `states`)."""
    keys = None
    if self.client_keys is not None:
      slots = np.arange(len(cohort)) if slots is None else slots
      keys = self.client_keys(np.asarray(cohort), np.asarray(slots))
    if self.client_states is not None and states is None:
      states = [self.client_states.initial_value() for _ in cohort]
    if self.packs_client_inputs:
      return (composition.client_inputs(datasets, keys, states),)
    # A `ClientValues` stays one: its datasets are made when their chunk is sent.
    args = (datasets if isinstance(datasets, client_values.ClientValues) else list(datasets),)
    if keys is not None:
      args += ([np.int32(k) for k in keys],)
    return args + ((list(states),) if states is not None else ())

  def result(self, outputs) -> RoundResult:
    """The `RoundResult` of `next`'s results after the state: the metrics, then the
    clients' new states (`client_states`, unless they stay in files) or the round's
    teachers (a `DriverProcess`)."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    metrics, *rest = outputs
    if self.client_states is not None:
      return RoundResult(metrics, client_states=list(rest[0]) if rest else None)
    return RoundResult(metrics, output=rest[0] if rest else None)

  def next_fn(self, state, datasets, cohort) -> tuple[Any, RoundResult]:
    """`(state, RoundResult)` of one round through the execution context."""
    outputs = self.process.next(state, *self.next_args(datasets, cohort))
    state, *outputs = resident_state.state_first(outputs)
    return state, self.result(tuple(outputs))

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
