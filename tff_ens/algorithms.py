"""The algorithms the CLI can run, behind one small interface.

Each algorithm is a TFF process built by its own module's `build_*` function;
`FederatedAlgorithm` adds what the training loop needs around it: how to call
`next` for a cohort, which models the state holds (one, or K for ensembles),
and the types of what one client downloads and uploads in a round.
"""

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import client_states
from tff_ens import client_work as client_work_lib
from tff_ens import fed_ensemble
from tff_ens import fedavg
from tff_ens import fedppd
from tff_ens import model_prototypes
from tff_ens import privacy
from tff_ens import runtime
from tff_ens import server_distillation
from tff_ens import server_step

ModelWeights = tff.learning.models.ModelWeights

FEDPPD_METHODS = ("fedppd", "fedppd_distill")
ALGORITHMS = (
  ("fedavg", "fedprox", "fedavgm", "fedensemble") + (server_distillation.METHODS) + FEDPPD_METHODS
)
LOCAL_OBJECTIVES = ("sgd", "fedprox", "feddyn")
# Algorithms whose server step uses the server's data.
SERVER_DATA_ALGORITHMS = server_distillation.METHODS + ("fedppd_distill",)
# Algorithms whose server only needs the mean of the clients' updates, so
# DP-FedAvg's clipped and noised mean (`privacy`) can replace it.
DP_ALGORITHMS = ("fedavg", "fedprox", "fedavgm", "fedensemble", "fedppd")
# Those whose server step is `fedavg.build_finalizer`'s, which can recalibrate batch norm.
FEDAVG_ALGORITHMS = ("fedavg", "fedprox", "fedavgm")
# Those whose clients can train on their devices (`device_clients`): plain local SGD(M).
ON_DEVICE_ALGORITHMS = ("fedavg", "fedavgm", "fedensemble")


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
    client_models: `(client indices, 0-based round) -> [k]`, the model of `models_fn`
      each client trains in that round (Fed-ensemble's `assigned_model`, which the
      process's distributor computes too); None: every client trains the first.
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
  client_models: Callable[[Sequence[int], int], list[int]] | None = None

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


def build_algorithm(
  name: str,
  model_fn: Callable[[int], tf.keras.Model],
  element_spec,
  local_config: client_work_lib.LocalTrainingConfig,
  *,
  proximal_mu: float = 0.01,
  local_objective: str = "sgd",
  server_learning_rate: float = 1.0,
  server_momentum: float = 0.9,
  ensemble_size: int = 5,
  assignment: str = "permutation",
  member_average: str = "clients",
  seed: int = 0,
  server_data=None,
  server_config: (server_distillation.ServerDistillationConfig | None) = None,
  clients_per_round: int = 10,
  student_fn: Callable[[], tf.keras.Model] | None = None,
  posterior_config: fedppd.PosteriorConfig | None = None,
  distill_fedppd_teachers: bool = True,
  dp: privacy.DPConfig | None = None,
  prototypes: Sequence[tuple[str, Callable[[], tf.keras.Model]]] = (),
  feddyn_alpha: float = 0.01,
  num_clients: int = 0,
  on_device: bool = False,
  recalibration_images: np.ndarray | None = None,
) -> FederatedAlgorithm:
  """Builds algorithm `name`.

  Args:
    name: one of `ALGORITHMS`.
    model_fn: `k -> Keras model` initialized for (ensemble member) k; single
      model algorithms use k = 0.
    element_spec: `tf.TensorSpec`s of one client batch `(x, y)`.
    local_config: client training.
    proximal_mu: FedProx's mu, used by `fedprox` and by
      `local_objective="fedprox"`.
    local_objective: "sgd", "fedprox" or "feddyn": the clients' objective
      for `fedensemble` ("feddyn" only there).
    server_learning_rate: server step on the averaged update (FedAvg family).
    server_momentum: server momentum of `fedavgm`.
    ensemble_size: K of `fedensemble`.
    assignment: "permutation" or "random" (`fedensemble`).
    member_average: `fedensemble`'s average of a model over its clients
      (`fed_ensemble.MEMBER_AVERAGES`).
    seed: seed of `fedensemble`'s permutations.
    server_data: the server's `server_data.ServerData` (fedbe, feddf,
      vdistill, fedppd_distill).
    server_config: their `ServerDistillationConfig` (its method is `name`;
      FedBE's for fedppd_distill).
    clients_per_round: the largest cohort (the same four).
    student_fn: builds FedPPD's student (`model_fn(0)` is its teacher).
    posterior_config: FedPPD's client update.
    distill_fedppd_teachers: `fedppd_distill` distills the clients' teachers
      as well as their students (the authors' code); False averages them.
    dp: DP-FedAvg's clipped, noised mean of the updates (`DP_ALGORITHMS`);
      None for the plain mean.
    prototypes: `feddf` over model prototypes: `(name, model_fn)` of each
      architecture the clients run (`model_prototypes`); the first is the
      run's main model. Empty: every client runs `model_fn(0)`.
    feddyn_alpha: FedDyn's alpha (`local_objective="feddyn"`).
    num_clients: the population, FedDyn's m.
    on_device: the clients train on their devices (`ON_DEVICE_ALGORITHMS`): their data are
      the devices' results (`client_work.build_device_client_work`).
    recalibration_images: server images on which `FEDAVG_ALGORITHMS` measure the new
      model's batch-norm statistics each round (`fedavg.build_finalizer`).
  """
  if name not in ALGORITHMS:
    raise ValueError(f"unknown algorithm {name!r}: choose one of {', '.join(ALGORITHMS)}")
  if local_objective not in LOCAL_OBJECTIVES:
    raise ValueError(
      f"unknown local objective {local_objective!r}: choose one of {', '.join(LOCAL_OBJECTIVES)}"
    )
  if local_objective == "feddyn" and name != "fedensemble":
    raise ValueError(
      f"the FedDyn local objective is built for fedensemble, not {name}: "
      "for FedDyn on one model use fedensemble with ensemble_size=1"
    )
  if on_device and name not in ON_DEVICE_ALGORITHMS:
    raise ValueError(
      f"{name}'s clients cannot train on devices: use one of {', '.join(ON_DEVICE_ALGORITHMS)}"
    )
  if recalibration_images is not None and name not in FEDAVG_ALGORITHMS:
    raise ValueError(
      f"{name} does not recalibrate batch norm: use one of {', '.join(FEDAVG_ALGORITHMS)}"
    )
  if prototypes and name != "feddf":
    raise ValueError(f"model prototypes are FedDF's, not {name}'s")
  if name == "fedprox" or local_objective == "fedprox":
    local_config = dataclasses.replace(local_config, proximal_mu=proximal_mu)
  if dp is not None and name not in DP_ALGORITHMS:
    raise ValueError(
      f"{name} distills from each client's model: DP on the "
      f"mean does not apply; use one of "
      f"{', '.join(DP_ALGORITHMS)}"
    )
  if name == "fedensemble":
    return _build_fed_ensemble(
      model_fn,
      element_spec,
      local_config,
      ensemble_size,
      assignment,
      seed,
      dp,
      feddyn_alpha if local_objective == "feddyn" else 0.0,
      num_clients,
      member_average,
      on_device,
    )
  if name in SERVER_DATA_ALGORITHMS and (server_data is None or server_config is None):
    raise ValueError(f"{name} needs server_data and server_config")
  if name in FEDPPD_METHODS:
    if student_fn is None or posterior_config is None:
      raise ValueError(f"{name} needs student_fn and posterior_config")
    if name == "fedppd":
      built = fedppd.build_fedppd(
        lambda: model_fn(0),
        student_fn,
        element_spec,
        posterior_config,
        aggregator_factory=dp.aggregator_factory() if dp else None,
      )
    else:
      server_config = dataclasses.replace(server_config, method="fedbe")
      built = fedppd.build_fedppd_distill(
        lambda: model_fn(0),
        student_fn,
        element_spec,
        posterior_config,
        server_data,
        server_config,
        clients_per_round=clients_per_round,
        teacher_server_config=(
          dataclasses.replace(server_config, seed=server_config.seed + 1)
          if distill_fedppd_teachers
          else None
        ),
      )
    return _fedppd_algorithm(name, built, student_fn)
  if prototypes:
    return _build_heterogeneous_feddf(
      prototypes,
      element_spec,
      local_config,
      server_data,
      dataclasses.replace(server_config, method=name),
      clients_per_round,
    )
  if name in server_distillation.METHODS:
    return _build_server_distillation(
      name,
      model_fn,
      element_spec,
      local_config,
      server_data,
      dataclasses.replace(server_config, method=name),
      clients_per_round,
    )
  process, client_work = fedavg.build_fedavg(
    lambda: model_fn(0),
    element_spec,
    local_config,
    server_learning_rate=server_learning_rate,
    server_momentum=server_momentum if name == "fedavgm" else 0.0,
    aggregator_factory=dp.aggregator_factory() if dp else None,
    on_device=on_device,
    recalibration_images=recalibration_images,
  )

  # A client receives the client computation's parameters but for its own
  # data (a sequence, sized 0) and sends back the computation's result.
  client_update = client_work.client_update.type_signature
  return FederatedAlgorithm(
    name=name,
    process=process,
    download_type=client_update.parameter,
    upload_type=client_update.result,
    indexed_clients=False,
    models_fn=lambda state: [process.get_model_weights(state)],
  )


def _build_fed_ensemble(
  model_fn,
  element_spec,
  local_config,
  ensemble_size,
  assignment,
  seed,
  dp,
  feddyn_alpha,
  num_clients,
  member_average,
  on_device,
) -> FederatedAlgorithm:
  built = fed_ensemble.build_fed_ensemble(
    model_fn,
    element_spec,
    local_config,
    ensemble_size=ensemble_size,
    seed=seed,
    assignment=assignment,
    dp=dp,
    feddyn_alpha=feddyn_alpha,
    num_clients=num_clients,
    member_average=member_average,
    on_device=on_device,
  )

  def client_models(clients, round_num):
    return [
      int(fed_ensemble.assigned_model(seed, c, round_num, ensemble_size, assignment))
      for c in clients
    ]

  spec = None
  if feddyn_alpha:
    state_type = built.process.next.type_signature.parameter[3].member
    spec = client_states.ClientStateSpec(
      shape=tuple(state_type.shape), dtype=np.dtype(state_type.dtype)
    )

  return FederatedAlgorithm(
    name="fedensemble",
    process=built.process,
    download_type=built.download_type,
    upload_type=built.upload_type,
    indexed_clients=True,
    models_fn=lambda state: list(state["members"]),
    client_state=spec,
    client_models=client_models,
  )


def _build_server_distillation(
  name, model_fn, element_spec, local_config, server_data, server_config, clients_per_round
) -> FederatedAlgorithm:
  built = server_distillation.build_server_distillation(
    lambda: model_fn(0),
    element_spec,
    local_config,
    server_data,
    server_config,
    clients_per_round=clients_per_round,
  )
  process = built.process

  client_update = built.client_work.client_update.type_signature
  return FederatedAlgorithm(
    name=name,
    process=process,
    download_type=client_update.parameter,
    upload_type=client_update.result,
    indexed_clients=False,
    models_fn=lambda state: [process.get_model_weights(state)],
    teacher_fn=process.last_round_teachers,
    server_device=lambda: process.step.device,
  )


def _build_heterogeneous_feddf(
  prototypes, element_spec, local_config, server_data, server_config, clients_per_round
) -> FederatedAlgorithm:
  names = [name for name, _ in prototypes]
  model_fns = [model_fn for _, model_fn in prototypes]
  built = model_prototypes.build_heterogeneous_feddf(
    model_fns,
    names,
    element_spec,
    local_config,
    server_data,
    server_config,
    clients_per_round=clients_per_round,
  )

  return FederatedAlgorithm(
    name="feddf",
    process=built.process,
    download_type=built.download_type,
    upload_type=built.upload_type,
    indexed_clients=True,
    models_fn=lambda state: [state["model"][0]],
    teacher_fn=built.process.last_round_teachers,
    server_device=lambda: built.process.step.device,
    prototypes_fn=lambda state: list(zip(names, model_fns, state["model"])),
  )


def _fedppd_algorithm(name, built: fedppd.FedPPD, student_fn) -> FederatedAlgorithm:
  client_update = built.client_work.client_update.type_signature
  return FederatedAlgorithm(
    name=name,
    process=built.process,
    download_type=client_update.parameter,
    upload_type=client_update.result,
    indexed_clients=False,
    models_fn=lambda state: [built.student_weights(state)],
    server_device=(lambda: built.process.step.device) if name == "fedppd_distill" else None,
    evaluation_model_fn=student_fn,
  )
