"""The algorithms the CLI can run: a registry of builders (`REGISTRY`, `build_algorithm`).

Each algorithm is a TFF process built by its own module's `build_*` function, registered
here with what it takes (`AlgorithmSpec`); its builder wraps the process in the interface
the training loop drives (`federated_algorithm.FederatedAlgorithm`).
"""

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tff_ens import settings
from tff_ens.algorithms import fed_ensemble
from tff_ens.algorithms import fedadam
from tff_ens.algorithms import fedavg
from tff_ens.algorithms import fedppd
from tff_ens.algorithms import fedppd_distill
from tff_ens.algorithms import model_prototypes
from tff_ens.algorithms import server_distillation
from tff_ens.program import client_states
from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import federated_algorithm
from tff_ens.templates import privacy

LOCAL_OBJECTIVES = ("sgd", "fedprox", "feddyn")


@dataclasses.dataclass(frozen=True)
class BuildOptions:
  """The run's settings that some builders read, besides the model and client training.

  Attributes:
    proximal_mu: FedProx's mu, used by `fedprox` and by `local_objective="fedprox"`.
    local_objective: one of `LOCAL_OBJECTIVES`, the clients' objective for `fedensemble`
      ("feddyn" only there).
    server_learning_rate: the server optimizer's step size on the averaged update (the
      FedAvg family); None: the algorithm's `AlgorithmSpec.server_learning_rate`.
    server_momentum: server momentum of `fedavgm`.
    server_epsilon: `fedadam`'s epsilon (the paper's adaptivity tau).
    ensemble_size: K of `fedensemble`.
    assignment: "permutation" or "random" (`fedensemble`).
    member_average: `fedensemble`'s average of a model over its clients
      (`fed_ensemble.MEMBER_AVERAGES`).
    seed: seed of `fedensemble`'s permutations.
    server_data: the server's `server_data.ServerData` (`SERVER_DATA_ALGORITHMS`).
    server_config: their `ServerDistillationConfig` (its method is the algorithm's name;
      FedBE's for fedppd_distill).
    clients_per_round: the largest cohort (the same algorithms).
    student_fn: builds FedPPD's student (`model_fn(0)` is its teacher).
    posterior_config: FedPPD's client update.
    distill_fedppd_teachers: `fedppd_distill` distills the clients' teachers as well as
      their students (the authors' code); False averages them.
    dp: DP-FedAvg's clipped, noised mean of the updates (`DP_ALGORITHMS`); None for the
      plain mean.
    prototypes: `feddf` over model prototypes: `(name, model_fn)` of each architecture the
      clients run (`model_prototypes`); the first is the run's main model. Empty: every
      client runs `model_fn(0)`.
    feddyn_alpha: FedDyn's alpha (`local_objective="feddyn"`).
    num_clients: the population, FedDyn's m.
    on_device: the clients train on their devices (`ON_DEVICE_ALGORITHMS`): their data are
      the devices' results (`client_work.build_device_client_work`).
    recalibration_images: server images on which `FEDAVG_ALGORITHMS` measure the new
      model's batch-norm statistics each round (`fedavg.build_finalizer`).
  """

  proximal_mu: float = 0.01
  local_objective: str = "sgd"
  server_learning_rate: float | None = None
  server_momentum: float = 0.9
  server_epsilon: float = fedadam.EPSILON
  ensemble_size: int = 5
  assignment: str = "permutation"
  member_average: str = "clients"
  seed: int = 0
  server_data: Any = None
  server_config: server_distillation.ServerDistillationConfig | None = None
  clients_per_round: int = 10
  student_fn: Callable[[], tf.keras.Model] | None = None
  posterior_config: fedppd.PosteriorConfig | None = None
  distill_fedppd_teachers: bool = True
  dp: privacy.DPConfig | None = None
  prototypes: Sequence[tuple[str, Callable[[], tf.keras.Model]]] = ()
  feddyn_alpha: float = 0.01
  num_clients: int = 0
  on_device: bool = False
  recalibration_images: np.ndarray | None = None


# `(name, model_fn, element_spec, local_config, options) -> FederatedAlgorithm`.
Builder = Callable[..., federated_algorithm.FederatedAlgorithm]


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
  """A registered algorithm: its builder and the run options it takes.

  Attributes:
    name: its `--algorithm` value.
    summary: one line for `--help` and docs/algorithms.md.
    build: its `Builder`.
    server_data: its server step uses the server's data.
    dp: its server needs only the mean of the clients' updates, so DP-FedAvg's clipped
      and noised mean (`privacy`) can replace it.
    recalibrates: its finalizer is `fedavg.build_finalizer`, which can recalibrate
      batch norm on server images.
    on_device: its clients run plain local SGD(M), which devices can (`device_clients`).
    student: the model it evaluates is FedPPD's student, of its own architecture.
    server_learning_rate: the default step size of its server optimizer; None if it has
      none.
  """

  name: str
  summary: str
  build: Builder
  server_data: bool = False
  dp: bool = False
  recalibrates: bool = False
  on_device: bool = False
  student: bool = False
  server_learning_rate: float | None = None


def build_algorithm(
  name: str,
  model_fn: Callable[[int], tf.keras.Model],
  element_spec,
  local_config: client_work_lib.LocalTrainingConfig,
  **options,
) -> federated_algorithm.FederatedAlgorithm:
  """Builds the registered algorithm `name` (`REGISTRY`).

  Args:
    name: one of `ALGORITHMS`.
    model_fn: `k -> Keras model` initialized for (ensemble member) k; single
      model algorithms use k = 0.
    element_spec: `tf.TensorSpec`s of one client batch `(x, y)`.
    local_config: client training.
    **options: `BuildOptions`' fields.

  Raises:
    ValueError: an unknown algorithm, or an option the algorithm does not take.
  """
  opts = BuildOptions(**options)
  check_options(
    name,
    local_objective=opts.local_objective,
    on_device=opts.on_device,
    recalibrates=opts.recalibration_images is not None,
    prototypes=bool(opts.prototypes),
    dp=opts.dp is not None,
  )
  spec = REGISTRY[name]
  if spec.server_data and (opts.server_data is None or opts.server_config is None):
    raise ValueError(f"{name} needs server_data and server_config")
  if spec.student and (opts.student_fn is None or opts.posterior_config is None):
    raise ValueError(f"{name} needs student_fn and posterior_config")
  if name == "fedprox" or opts.local_objective == "fedprox":
    local_config = dataclasses.replace(local_config, proximal_mu=opts.proximal_mu)
  if opts.server_learning_rate is None:
    opts = dataclasses.replace(opts, server_learning_rate=spec.server_learning_rate)
  return spec.build(name, model_fn, element_spec, local_config, opts)


def check_options(
  name: str,
  *,
  local_objective: str = "sgd",
  on_device: bool = False,
  recalibrates: bool = False,
  prototypes: bool = False,
  dp: bool = False,
) -> None:
  """The rules between algorithm `name` and the options it is built with: raises
  `settings.SettingError` naming the first option it does not take (`build_algorithm`
  and `experiment.ExperimentConfig.validate` both check with it)."""
  if name not in REGISTRY:
    raise settings.SettingError("algorithm", name, f"choose one of {', '.join(ALGORITHMS)}")
  spec = REGISTRY[name]
  if local_objective not in LOCAL_OBJECTIVES:
    raise settings.SettingError(
      "local_objective", local_objective, f"choose one of {', '.join(LOCAL_OBJECTIVES)}"
    )
  rules = (
    (
      "local_objective",
      local_objective == "feddyn" and name != "fedensemble",
      f"FedDyn's objective is built for fedensemble, not {name}: for FedDyn on one model "
      "use fedensemble with an ensemble of 1",
    ),
    (
      "on_device",
      on_device and not spec.on_device,
      f"{name}'s clients cannot train on devices: use one of {', '.join(ON_DEVICE_ALGORITHMS)}",
    ),
    (
      "recalibrates",
      recalibrates and not spec.recalibrates,
      f"batch-norm recalibration is the server step of {', '.join(FEDAVG_ALGORITHMS)}, not "
      f"of {name}",
    ),
    ("prototypes", prototypes and name != "feddf", f"model prototypes are FedDF's, not {name}'s"),
    (
      "dp",
      dp and not spec.dp,
      f"{name}'s server distills from every client's own model, which DP on the mean of "
      f"their updates cannot protect: use one of {', '.join(DP_ALGORITHMS)}",
    ),
  )
  given = dict(
    local_objective=local_objective,
    on_device=on_device,
    recalibrates=recalibrates,
    prototypes=prototypes,
    dp=dp,
  )
  for option, broken, problem in rules:
    if broken:
      raise settings.SettingError(option, given[option], problem)


def _fedavg_family(server_optimizer: Callable[[BuildOptions], Any]) -> Builder:
  """The builder of FedAvg with the server optimizer `server_optimizer(options)`."""

  def build(name, model_fn, element_spec, local_config, opts: BuildOptions):
    built = fedavg.build_fedavg(
      lambda: model_fn(0),
      element_spec,
      local_config,
      server_optimizer=server_optimizer(opts),
      aggregator_factory=opts.dp.aggregator_factory() if opts.dp else None,
      on_device=opts.on_device,
      recalibration_images=opts.recalibration_images,
    )
    return federated_algorithm.FederatedAlgorithm.of(name, built)

  return build


def _build_fed_ensemble(name, model_fn, element_spec, local_config, opts: BuildOptions):
  feddyn_alpha = opts.feddyn_alpha if opts.local_objective == "feddyn" else 0.0
  built = fed_ensemble.build_fed_ensemble(
    model_fn,
    element_spec,
    local_config,
    ensemble_size=opts.ensemble_size,
    seed=opts.seed,
    assignment=opts.assignment,
    dp=opts.dp,
    feddyn_alpha=feddyn_alpha,
    num_clients=opts.num_clients,
    member_average=opts.member_average,
    on_device=opts.on_device,
  )

  def client_models(clients, key_state):
    return [
      int(
        fed_ensemble.assigned_model(
          key_state["seed"], c, key_state["round"], opts.ensemble_size, opts.assignment
        )
      )
      for c in clients
    ]

  spec = None
  if feddyn_alpha:
    state_type = built.process.next.type_signature.parameter[3].member
    spec = client_states.ClientStateSpec(
      shape=tuple(state_type.shape), dtype=np.dtype(state_type.dtype)
    )

  return federated_algorithm.FederatedAlgorithm.of(
    name, built, indexed_clients=True, client_state=spec, client_models=client_models
  )


def _build_server_distillation(name, model_fn, element_spec, local_config, opts: BuildOptions):
  if opts.prototypes:
    return _build_heterogeneous_feddf(name, element_spec, local_config, opts)
  built = server_distillation.build_server_distillation(
    lambda: model_fn(0),
    element_spec,
    local_config,
    opts.server_data,
    dataclasses.replace(opts.server_config, method=name),
    clients_per_round=opts.clients_per_round,
  )
  return federated_algorithm.FederatedAlgorithm.of(
    name,
    built,
    teacher_fn=built.process.last_round_teachers,
    server_device=lambda: built.process.step.device,
  )


def _build_heterogeneous_feddf(name, element_spec, local_config, opts: BuildOptions):
  names = [prototype for prototype, _ in opts.prototypes]
  model_fns = [model_fn for _, model_fn in opts.prototypes]
  built = model_prototypes.build_heterogeneous_feddf(
    model_fns,
    names,
    element_spec,
    local_config,
    opts.server_data,
    dataclasses.replace(opts.server_config, method=name),
    clients_per_round=opts.clients_per_round,
  )
  return federated_algorithm.FederatedAlgorithm.of(
    name,
    built,
    indexed_clients=True,
    teacher_fn=built.process.last_round_teachers,
    server_device=lambda: built.process.step.device,
    prototypes_fn=lambda state: list(zip(names, model_fns, state["model"])),
  )


def _build_fedppd(name, model_fn, element_spec, local_config, opts: BuildOptions):
  if name == "fedppd":
    built = fedppd.build_fedppd(
      lambda: model_fn(0),
      opts.student_fn,
      element_spec,
      opts.posterior_config,
      aggregator_factory=opts.dp.aggregator_factory() if opts.dp else None,
    )
  else:
    server_config = dataclasses.replace(opts.server_config, method="fedbe")
    built = fedppd_distill.build_fedppd_distill(
      lambda: model_fn(0),
      opts.student_fn,
      element_spec,
      opts.posterior_config,
      opts.server_data,
      server_config,
      clients_per_round=opts.clients_per_round,
      teacher_server_config=(
        dataclasses.replace(server_config, seed=server_config.seed + 1)
        if opts.distill_fedppd_teachers
        else None
      ),
    )
  return federated_algorithm.FederatedAlgorithm.of(
    name,
    built,
    server_device=(lambda: built.process.step.device) if name == "fedppd_distill" else None,
    evaluation_model_fn=opts.student_fn,
  )


def _server_sgd(opts: BuildOptions):
  return fedavg.build_server_optimizer(opts.server_learning_rate)


def _server_sgdm(opts: BuildOptions):
  return fedavg.build_server_optimizer(opts.server_learning_rate, opts.server_momentum)


def _server_adam(opts: BuildOptions):
  return fedadam.server_optimizer(opts.server_learning_rate, opts.server_epsilon)


_FEDAVG = dict(dp=True, recalibrates=True, on_device=True)
REGISTRY = {
  spec.name: spec
  for spec in (
    AlgorithmSpec(
      "fedavg",
      "FedAvg (McMahan et al. 2017)",
      _fedavg_family(_server_sgd),
      server_learning_rate=1.0,
      **_FEDAVG,
    ),
    AlgorithmSpec(
      "fedprox",
      "FedAvg with the proximal local objective (Li et al. 2020)",
      _fedavg_family(_server_sgd),
      server_learning_rate=1.0,
      **{**_FEDAVG, "on_device": False},
    ),
    AlgorithmSpec(
      "fedavgm",
      "FedAvg with server momentum (Hsu et al. 2019)",
      _fedavg_family(_server_sgdm),
      server_learning_rate=1.0,
      **_FEDAVG,
    ),
    AlgorithmSpec(
      "fedadam",
      "FedAvg with Adam on the server (Reddi et al. 2021)",
      _fedavg_family(_server_adam),
      server_learning_rate=fedadam.LEARNING_RATE,
      **_FEDAVG,
    ),
    AlgorithmSpec(
      "fedensemble",
      "Fed-ensemble (Shi et al. 2021): K models, one per client per round",
      _build_fed_ensemble,
      dp=True,
      on_device=True,
    ),
    AlgorithmSpec(
      "fedbe", "FedBE (Chen & Chao 2021)", _build_server_distillation, server_data=True
    ),
    AlgorithmSpec("feddf", "FedDF (Lin et al. 2020)", _build_server_distillation, server_data=True),
    AlgorithmSpec(
      "vdistill",
      "FedBE's v-Distillation baseline: the clients' sharpened mean probabilities, plain SGD",
      _build_server_distillation,
      server_data=True,
    ),
    AlgorithmSpec("fedppd", "FedPPD (Bhatt et al. 2023)", _build_fedppd, dp=True, student=True),
    AlgorithmSpec(
      "fedppd_distill",
      "FedPPD+Distill: FedPPD with FedBE's server distillation",
      _build_fedppd,
      server_data=True,
      student=True,
    ),
  )
}


def _having(attribute: str) -> tuple[str, ...]:
  return tuple(name for name, spec in REGISTRY.items() if getattr(spec, attribute))


ALGORITHMS = tuple(REGISTRY)
# Algorithms whose server step uses the server's data.
SERVER_DATA_ALGORITHMS = _having("server_data")
# Algorithms whose server only needs the mean of the clients' updates (`AlgorithmSpec.dp`).
DP_ALGORITHMS = _having("dp")
# Those whose server step is `fedavg.build_finalizer`'s, which can recalibrate batch norm.
FEDAVG_ALGORITHMS = _having("recalibrates")
# Those whose clients can train on their devices (`device_clients`): plain local SGD(M).
ON_DEVICE_ALGORITHMS = _having("on_device")
# FedPPD's: the model evaluated is the student.
FEDPPD_METHODS = _having("student")
