"""A run's settings (`ExperimentConfig`: the command line's flags, `config.json`), their checks,
and the run they resolve to (`resolve` -> `Run`).

`ExperimentConfig` is composed (`settings.compose`) of the settings groups every run has (the
run's own `RunSettings`, the split's `PartitionConfig`, the clients' `LocalTrainingConfig`,
`DPConfig` and `ActiveLearningConfig`) and those of every registered algorithm: one field per
flag, each declared once, by the code that reads it. `resolve` checks a config for its
algorithm and builds, once, what the program hands on: the task, the library configs and the
algorithm's settings groups. A check's error names the flag and the fix (`UsageError`).

Also the errors a run ends with (`UsageError`, `Stopped`) and `saved_config`, which reads
the config of a run saved by an older version.
"""

import dataclasses
from typing import Any

import tasks
from tff_ens import algorithms
from tff_ens import settings
from tff_ens.algorithms import algorithm as algorithm_lib
from tff_ens.execution import tls
from tff_ens.program import active_learning
from tff_ens.program import browser_clients
from tff_ens.program import run_settings
from tff_ens.templates import client_work
from tff_ens.templates import privacy
from tff_ens.templates import transport as transport_lib

# The settings groups of every run, whatever its algorithm.
COMMON_GROUPS = (
  run_settings.RunSettings,
  tasks.partition.PartitionConfig,
  client_work.LocalTrainingConfig,
  privacy.DPConfig,
  active_learning.ActiveLearningConfig,
)


def saved_config(saved: dict) -> dict:
  """A run's saved config.json as this version's flags.

  A flag the run predates takes the value that reproduces what it did where its declaration
  says one (`setting(before=...)`; of the flags its algorithm and task read, or of every flag
  for an algorithm this version does not know, whose comparison refuses it), else the
  default; then the upgrades each settings group makes (`upgrade_saved`, whatever the
  algorithm: a flag it does not read must be at its default). A config
  without any of those flags predates them all: FEMNIST's writers were then written as the
  iid partition with CIFAR's server sizes, which now mean a pooled split: they become unset.
  Before `--train_positions` Shakespeare's clients trained on the last position: "last".
  """
  task = saved.get("task", tasks.DEFAULT_TASK)
  algorithm = saved.get("algorithm")
  groups = groups_read(algorithm, task) if algorithm in algorithms.REGISTRY else ALL_GROUPS
  upgraded = {
    **saved,
    **settings.predated_values(groups, saved),
    **settings.upgraded_values(ALL_GROUPS, saved),
  }
  if task == "femnist" and not settings.flags_with_before(ALL_GROUPS) & saved.keys():
    for name in ("partition", "server_unlabeled_examples", "server_validation_examples"):
      upgraded[name] = None
  if "train_positions" not in saved and task == "shakespeare":
    upgraded["train_positions"] = "last"
  return upgraded


# Keys that may differ between an interrupted run and its `--resume`: how
# the run executes and what it only measures, not what it computes.
RESUME_FREE_KEYS = (
  "output_dir",  # A run's directory moved elsewhere resumes there.
  "resume",
  "max_concurrent_clients",
  "clients_per_chunk",
  "worker_growth_mib",
  "workers",
  "worker_credentials",
  "local_worker",
  "device_processes",
  "browser_clients",
  "distill_curve_every",
  "stop_grace_seconds",
)


class UsageError(ValueError):
  """A bad flag value or output directory; the message names the fix."""


class Stopped(Exception):
  """The run stopped on a signal (`signum`); its last round is checkpointed."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum


class _Run:
  """What `ExperimentConfig` adds to its fields."""

  def __post_init__(self):
    if self.model is None:  # Not chosen: the task's first (Shakespeare's lstm).
      try:
        task = tasks.get_task(self.task, self.classes)
      except ValueError:  # `resolve` names the bad flag.
        return
      object.__setattr__(self, "model", task.MODEL_NAMES[0])

  @property
  def on_devices(self) -> bool:
    """`--client_runtime` trains the clients on devices (`device_clients`)."""
    return run_settings.on_devices(self.client_runtime)

  @property
  def in_browsers(self) -> bool:
    """`--client_runtime`'s devices are browser pages (`browser_clients`)."""
    return run_settings.in_browsers(self.client_runtime)

  @property
  def transport(self) -> transport_lib.Transport:
    """What moves the clients' states and collected updates (`--client_transport`)."""
    return (
      transport_lib.FILES if self.client_transport == run_settings.FILES else transport_lib.VALUES
    )

  def validate(self) -> None:
    """Raises UsageError, naming the flag and the fix, for a setting the run cannot take."""
    resolve(self)

  def worker_addresses(self) -> list[str]:
    """The "host:port" (or "unix:PATH") addresses of --workers (empty: a local worker)."""
    if not self.workers:
      return []
    addresses = [a.strip() for a in self.workers.split(",")]
    for address in addresses:
      host, _, port = address.rpartition(":")
      if address.startswith("unix:/"):
        continue  # A local worker's socket (`worker_process.LocalWorker.address`).
      if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(
          f"--workers={self.workers}: {address!r} is not host:port: pass "
          "e.g. --workers=10.0.0.2:8000,10.0.0.3:8000"
        )
    for address in set(addresses):
      if addresses.count(address) > 1:
        raise UsageError(
          f"--workers={self.workers}: {address} is named twice: list each worker once"
        )
    return addresses


# Each task's own settings group, if it has one (tasks/__init__.py).
TASK_GROUPS = {name: tasks.task_settings(name) for name in tasks.TASK_SETTINGS}
ExperimentConfig = settings.compose(
  "ExperimentConfig",
  COMMON_GROUPS + tuple(TASK_GROUPS.values()) + algorithms.SETTINGS_GROUPS,
  module=__name__,
  bases=(_Run,),
)
# Every settings group of a run's config, each once.
ALL_GROUPS = tuple(
  dict.fromkeys(COMMON_GROUPS + tuple(TASK_GROUPS.values()) + algorithms.SETTINGS_GROUPS)
)

ExperimentConfig.__doc__ = """Everything that defines a run (written to `config.json`): one
field per flag of every settings group (`COMMON_GROUPS` and the algorithms')."""
# Every flag's default, in `ExperimentConfig`'s order.
FLAG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ExperimentConfig)}


def flag_defaults(task, classes) -> dict:
  """Every flag's default for a run of `task` with `classes` (its model the task's first);
  `FLAG_DEFAULTS` for a task or classes this version does not know."""
  try:
    return dataclasses.asdict(ExperimentConfig(task=task, classes=classes))
  except (TypeError, ValueError):
    return FLAG_DEFAULTS


def config_of(saved: dict) -> ExperimentConfig:
  """A saved run's flags (`saved_config`) as a config; a flag unknown to this version is left
  out."""
  return ExperimentConfig(**{k: v for k, v in saved.items() if k in FLAG_DEFAULTS})


@dataclasses.dataclass(frozen=True)
class Run:
  """A run's settings resolved once, after validation: what the program hands on.

  Each program module reads its part, never the flags (`ExperimentConfig`) themselves.

  Attributes:
    algorithm: the registered algorithm of `--algorithm`.
    task: the task of `--task` and `--classes` (a `tasks` module).
    partition: the split of a pooled task, None for its own clients.
    local: the clients' training.
    dp: DP-FedAvg's aggregation, None without `--dp_*`.
    active: active learning (`enabled` or not).
    groups: the algorithm's settings groups, by type.
    task_config: the task's own settings (`tasks.task_settings`), or None.
    data_dir: `--data_dir`.
    model: the run's model.
    schedule: the loop's rounds, cohort and saves.
    clients: how a round's clients train and fail.
    execution: where the clients' computations run (`workers`: the `--workers` addresses,
      empty for a local worker).
    devices: the clients' devices with `--client_runtime=litert`, else None.
    transport: what moves the clients' states and collected updates.
    server_data: `--server_data`.
    recalibrate_batch_norm: `--recalibrate_batch_norm`.
    evaluation: the summary's settings.
    outputs: the output directory's.
  """

  algorithm: algorithm_lib.Algorithm
  task: Any
  partition: tasks.partition.PartitionConfig | None
  local: client_work.LocalTrainingConfig
  dp: privacy.DPConfig | None
  active: active_learning.ActiveLearningConfig
  groups: dict[type, Any]
  task_config: Any
  data_dir: str | None
  model: run_settings.Model
  schedule: run_settings.Schedule
  clients: run_settings.ClientRounds
  execution: run_settings.Execution
  devices: run_settings.Devices | None
  transport: transport_lib.Transport
  server_data: str | None
  recalibrate_batch_norm: int
  evaluation: run_settings.Evaluation
  outputs: run_settings.Outputs

  @property
  def seed(self) -> int:
    return self.schedule.seed

  def load_data(self, data_dir: str | None = None):
    """The task's data as the run splits it, from `data_dir` or else its `--data_dir`."""
    own = {"config": self.task_config} if self.task_config is not None else {}
    return self.task.load_data(
      data_dir or self.data_dir, partition=self.partition, seed=self.seed, **own
    )


def groups_read(algorithm: str, task: str) -> tuple[type, ...]:
  """The settings groups a run of `algorithm` on `task` reads: every run's, the task's own
  and the algorithm's."""
  groups = COMMON_GROUPS + algorithms.REGISTRY[algorithm].settings
  return groups + ((TASK_GROUPS[task],) if task in TASK_GROUPS else ())


def flags_read(algorithm: str, task: str) -> set[str]:
  """The flags a run of `algorithm` on `task` reads."""
  return {flag for group in groups_read(algorithm, task) for flag in settings.flags_of(group)}


def resolve(config) -> Run:
  """The `Run` of `config`; UsageError, naming the flag and the fix, for a setting the run
  cannot take: a value its declaration or its library config refuses, a flag its
  algorithm does not read, or a combination."""
  try:
    settings.check(config)
    spec = algorithms.REGISTRY[config.algorithm]
    task = tasks.get_task(config.task, config.classes)
    with settings.named_by(settings.field_flags(tasks.partition.PartitionConfig)):
      partition = settings.resolve(tasks.partition.PartitionConfig, config).for_task(
        task.DEFAULT_PARTITION, task.SERVER_EXAMPLES
      )
    dp = None
    if config.dp_noise_multiplier or config.dp_clip_norm:
      # The noised sum is divided by the updates a round aggregates: the first M with
      # --aggregate_first (the accounting still charges the whole sampled cohort).
      dp = settings.resolve(
        privacy.DPConfig,
        config,
        clients_per_round=config.aggregate_first or config.clients_per_round,
      )
    run = Run(
      algorithm=spec,
      task=task,
      partition=partition,
      local=settings.resolve(client_work.LocalTrainingConfig, config),
      dp=dp,
      active=settings.resolve(active_learning.ActiveLearningConfig, config),
      groups={group: settings.resolve(group, config) for group in spec.settings},
      task_config=(
        settings.resolve(TASK_GROUPS[config.task], config) if config.task in TASK_GROUPS else None
      ),
      **run_settings.parts_of(config),
    )
    _check_capabilities(config, spec)
    if spec.validate is not None:
      spec.validate(run.groups, _facts(config, run))
  except settings.SettingError as e:
    raise UsageError(e.named(f"--{e.name}")) from None
  except ValueError as e:
    if isinstance(e, UsageError):
      raise
    raise UsageError(str(e)) from None
  _check_run(config, run)
  return run


def _facts(config, run: Run) -> algorithm_lib.RunFacts:
  """What the algorithm's rules check of the run (`Algorithm.validate`)."""
  return algorithm_lib.RunFacts(
    task=run.task,
    task_name=config.task,
    model=config.model,
    dp=run.dp,
    client_runtime=config.client_runtime,
    on_devices=config.on_devices,
    recalibrate_batch_norm=config.recalibrate_batch_norm,
  )


def _check_capabilities(config, spec: algorithm_lib.Algorithm) -> None:
  """The flags the algorithm does not read, and the common options it cannot take (DP,
  devices, batch-norm recalibration), as a `SettingError` naming the flag."""
  read = (
    COMMON_GROUPS
    + spec.settings
    + ((TASK_GROUPS[config.task],) if config.task in TASK_GROUPS else ())
  )
  unread = {
    field.name: settings.group_of(field)
    for field in dataclasses.fields(config)
    if settings.group_of(field) not in read and getattr(config, field.name) != field.default
  }
  for name, group in unread.items():
    if group in TASK_GROUPS.values():
      task = next(n for n, g in TASK_GROUPS.items() if g is group)
      raise settings.SettingError(
        name, getattr(config, name), f"it is task {task}'s setting, not {config.task}'s: drop it"
      )
    readers = [n for n, s in algorithms.REGISTRY.items() if group in s.settings]
    raise settings.SettingError(
      name,
      getattr(config, name),
      f"--algorithm={spec.name} does not read it (it is {', '.join(readers)}'s): drop it, or "
      f"choose {'that algorithm' if len(readers) == 1 else 'one of them'}",
    )
  dp_flag = "dp_clip_norm" if config.dp_clip_norm else "dp_noise_multiplier"
  for flag, given, capability, problem in (
    (
      dp_flag,
      bool(config.dp_noise_multiplier or config.dp_clip_norm),
      "dp",
      f"{spec.name}'s server needs more than the mean of the clients' updates (which DP-FedAvg "
      "protects)",
    ),
    (
      "client_runtime",
      config.on_devices,
      "on_device",
      f"{spec.name}'s clients cannot train on devices",
    ),
    (
      "recalibrate_batch_norm",
      config.recalibrate_batch_norm > 0,
      "recalibrates",
      f"{spec.name} does not measure batch-norm statistics on server images",
    ),
  ):
    if given and not getattr(spec, capability):
      raise settings.SettingError(
        flag,
        getattr(config, flag),
        f"{problem}: use one of {', '.join(algorithms.having(capability))}",
      )


def _check_run(config, run: Run) -> None:
  """The rules across the common settings."""
  if config.model not in run.task.MODEL_NAMES:
    raise UsageError(
      f"unknown --model={config.model} for task {config.task}: "
      f"choose one of {', '.join(run.task.MODEL_NAMES)}"
    )
  if config.on_devices:
    _check_litert_clients(config, run)
  _check_browser_clients(config)
  for name in ("aggregate_first", "nan_clients_per_round"):
    if getattr(config, name) > config.clients_per_round:
      raise UsageError(
        f"--{name}={getattr(config, name)} must be between 0 and "
        f"--clients_per_round={config.clients_per_round}"
      )
  if config.dp_target_delta and not config.dp_noise_multiplier:
    raise UsageError(
      "--dp_target_delta needs --dp_noise_multiplier > 0: "
      "without noise there is no epsilon to report"
    )
  if run.execution.workers and config.max_concurrent_clients > 0:
    raise UsageError(
      "--max_concurrent_clients is a flag of the worker process when "
      "--workers is given: start each worker with `python -m "
      "tff_ens.worker --max_concurrent_clients=N` instead"
    )
  _check_workers(config, run)


def _check_workers(config, run: Run) -> None:
  """--workers on other hosts need --worker_credentials, and the credentials must load."""
  if config.worker_credentials:
    if not run.execution.workers:
      raise UsageError(
        "--worker_credentials is for --workers: a local worker needs none (drop the flag)"
      )
    try:
      tls.load(config.worker_credentials, "driver")
    except tls.CredentialsError as e:
      raise UsageError(f"--worker_credentials={config.worker_credentials}: {e}") from None
    return
  remote = [a for a in run.execution.workers if not tls.is_local(a)]
  if remote:
    raise UsageError(
      f"--workers={config.workers}: {remote[0]} is reached over the network: pass "
      "--worker_credentials=DIR, the driver's part of the credentials its workers serve with "
      f"(`{tls.MAKE_COMMAND}`)"
    )
  if run.execution.workers and config.local_worker != "isolated":
    raise UsageError("--local_worker is for runs without --workers (drop the flag)")


def _check_browser_clients(config) -> None:
  """--browser_clients is headless or HOST:PORT, for browser clients, which this machine runs."""
  if config.browser_clients != browser_clients.HEADLESS and not config.in_browsers:
    raise UsageError("--browser_clients is for --client_runtime=browser (drop the flag)")
  try:
    browser_clients.address(config.browser_clients)
  except ValueError as e:
    raise UsageError(str(e)) from None
  problem = config.in_browsers and browser_clients.missing(config.browser_clients)
  if problem:
    raise UsageError(problem)


def _check_litert_clients(config, run: Run) -> None:
  """What `--client_runtime=litert` runs: FedAvg's local SGD as `export.trainable` has it."""
  for name, value, plain in (
    ("lr_schedule", config.lr_schedule, "constant"),
    ("client_optimizer", config.client_optimizer, "sgd"),
    ("weight_decay", config.weight_decay, 0.0),
    ("active_learning_rounds", config.active_learning_rounds, 0),
  ):
    if value != plain:
      raise UsageError(
        f"--client_runtime={config.client_runtime}: the device file trains with plain SGD(M) "
        f"on all its examples, so --{name}={value} is not supported there: use --{name}={plain} or "
        "--client_runtime=tff"
      )
  if run.task.TRAIN_AUGMENTATION is not None:
    raise UsageError(
      f"--client_runtime={config.client_runtime}: task {config.task} augments its training "
      "images, which the device file does not: use --client_runtime=tff"
    )
