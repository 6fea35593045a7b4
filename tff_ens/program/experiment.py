"""A run's settings (`ExperimentConfig`: the command line's flags, `config.json`) and checks.

Each setting is declared once, as a field of `run_settings.RunSettings` (`settings.setting`:
its default, help, choices and bounds), which `ExperimentConfig` extends; `main` makes its
flags from them. The library configs the builders take (`LocalTrainingConfig`,
`DistillationConfig`, `PosteriorConfig`, ...) are built from these settings by
`settings.build`, which names a library check's error by its flag, and the rules across
settings are `ExperimentConfig.validate`'s.

Also the errors a run ends with (`UsageError`, `Stopped`) and `saved_config`, which reads
the config of a run saved by an older version.
"""

import dataclasses

import tasks
from tff_ens import algorithms
from tff_ens import settings
from tff_ens.algorithms import fedppd
from tff_ens.algorithms import server_distillation
from tff_ens.program import active_learning
from tff_ens.program import run_settings
from tff_ens.server import distillation
from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import privacy

# FedBE's SWA collects a model every this many distillation steps.
SWA_CYCLE_STEPS = 25

# The settings of a pooled split (`ExperimentConfig.partition_config`).
_PARTITION_FLAGS = (
  "num_clients",
  "partition_alpha",
  "classes_per_client",
  "step_minor_examples",
  "server_unlabeled_examples",
  "server_validation_examples",
)


def _given(value, default):
  return default if value is None else value


# Flags added on 2026-11-25 (issue 24) whose defaults changed what a run does:
# a run saved without them did this.
_BEFORE_ISSUE_24 = {
  "member_average": "examples",
  "fedbe_dirichlet": "proportional",
  "swa_warmup_fraction": 0.0,
  "distill_keep_initial": True,
  "distill_clip_norm": 0.0,
  "drop_worst_rule": "majority",
  "student_minibatch": "same",
  "teacher_weight_decay": 0.0,
  "teacher_step_decay": 1.0,
  "teacher_round_decay": 1.0,
  "student_round_decay": 1.0,
  "distill_fedppd_teachers": False,
}


def saved_config(saved: dict) -> dict:
  """A run's saved config.json as this version's flags.

  A flag the run predates takes the value that reproduces what it did: the
  older behaviour for the flags of `_BEFORE_ISSUE_24`, else the default.
  Before them FEMNIST's writers were written as the iid partition with
  CIFAR's server sizes, which now mean a pooled split: they become unset.
  Before FedAdam every run wrote `server_lr`, 1 by default: where that is its
  algorithm's default or its algorithm has no server optimizer, it becomes unset.
  """
  upgraded = dict(saved)
  if "member_average" not in saved:
    upgraded = {**_BEFORE_ISSUE_24, **saved}
    if upgraded.get("task", "femnist") == "femnist":
      for name in ("partition", "server_unlabeled_examples", "server_validation_examples"):
        upgraded[name] = None
  spec = algorithms.REGISTRY.get(upgraded.get("algorithm", "fedavg"))
  if "server_epsilon" not in saved and spec is not None:
    if spec.server_learning_rate in (None, upgraded.get("server_lr")):
      upgraded["server_lr"] = None
  return upgraded


# Keys that may differ between an interrupted run and its `--resume`: how
# the run executes and what it only measures, not what it computes.
RESUME_FREE_KEYS = (
  "resume",
  "max_concurrent_clients",
  "workers",
  "device_processes",
  "distill_curve_every",
)


# Algorithms distilling with SWA unless --noswa.
_SWA_ALGORITHMS = ("fedbe", "fedppd_distill")


class UsageError(ValueError):
  """A bad flag value or output directory; the message names the fix."""


class Stopped(Exception):
  """The run stopped on SIGTERM after checkpointing its last round."""


# Library configs' fields and the settings they are built from (`settings.build`).
_LOCAL_TRAINING = dict(
  learning_rate="client_lr",
  optimizer="client_optimizer",
  momentum="client_momentum",
  weight_decay="weight_decay",
  lr_schedule="lr_schedule",
  total_rounds="rounds",
  max_update_norm="max_update_norm",
)
_PARTITION = dict(
  num_clients="num_clients",
  alpha="partition_alpha",
  classes_per_client="classes_per_client",
  step_minor_examples="step_minor_examples",
)
_DISTILL = dict(num_steps="distill_steps", batch_size="distill_batch_size")
_FEDDF_DISTILL = dict(
  _DISTILL,
  patience="distill_patience",
  eval_every="distill_eval_every",
  min_improvement="distill_min_improvement",
  keep_initial_student="distill_keep_initial",
  clip_norm="distill_clip_norm",
)
_FEDBE_DISTILL = dict(
  _DISTILL, swa_warmup_fraction="swa_warmup_fraction", curve_every="distill_curve_every"
)
_SERVER_DISTILLATION = dict(
  distribution="fedbe_distribution",
  num_samples="fedbe_samples",
  targets="fedbe_targets",
  dirichlet_alpha="dirichlet_alpha",
  gaussian="fedbe_gaussian",
  gaussian_var_scale="fedbe_var_scale",
  gaussian_var_clamp="fedbe_var_clamp",
  dirichlet="fedbe_dirichlet",
  sharpen_temperature="sharpen_temperature",
  drop_worst_rule="drop_worst_rule",
  seed="seed",
)
_POSTERIOR = dict(
  teacher_step_size="teacher_lr",
  temperature="sgld_temperature",
  prior_precision="prior_precision",
  student_lr="student_lr",
  student_momentum="student_momentum",
  student_weight_decay="student_weight_decay",
  sgld_scaling="sgld_scaling",
  teacher_weight_decay="teacher_weight_decay",
  teacher_step_decay="teacher_step_decay",
  teacher_step_decay_epochs="teacher_step_decay_epochs",
  teacher_round_decay="teacher_round_decay",
  student_round_decay="student_round_decay",
  student_minibatch="student_minibatch",
  epochs="client_epochs",
  seed="seed",
  max_update_norm="max_update_norm",
)
_ACTIVE_LEARNING = dict(
  phases="active_learning_rounds",
  budget="active_budget",
  initial_fraction="active_initial_fraction",
  selection="active_selection",
  rounds="rounds",
)
_DP = dict(noise_multiplier="dp_noise_multiplier", clip_norm="dp_clip_norm")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(run_settings.RunSettings):
  """Everything that defines a run (written to `config.json`): `RunSettings`, their checks
  and the library configs built from them."""

  def validate(self):
    """Raises UsageError, naming the flag and the fix, for a setting the run cannot take:
    a value its declaration or its library config refuses, or a combination."""
    try:
      settings.check(self)
      task = self.task_module()
      self.local_training_config()
      self.partition_config()
      self.active_learning_config()
      if self.algorithm in algorithms.SERVER_DATA_ALGORITHMS:
        self.server_distillation_config()
      if self.algorithm in algorithms.FEDPPD_METHODS:
        self.posterior_config()
      self.dp_config()
    except settings.SettingError as e:
      raise UsageError(e.named(f"--{e.name}")) from None
    except ValueError as e:
      raise UsageError(str(e)) from None
    if self.model not in task.MODEL_NAMES:
      raise UsageError(
        f"unknown --model={self.model} for task {self.task}: "
        f"choose one of {', '.join(task.MODEL_NAMES)}"
      )
    self._validate_algorithm_options()
    if self.client_runtime == "litert":
      self._validate_litert_clients(task)
    if self.local_objective == "feddyn" and (self.dp_noise_multiplier or self.dp_clip_norm):
      raise UsageError(
        "--local_objective=feddyn keeps each client's "
        "unclipped updates: it does not combine with DP "
        "(--dp_*); use --local_objective=sgd or fedprox"
      )
    self._validate_prototypes(task)
    if (
      self.algorithm in algorithms.FEDPPD_METHODS
      and self.resolved_student_model() not in task.MODEL_NAMES
    ):
      raise UsageError(
        f"unknown --student_model={self.student_model} for task "
        f"{self.task}: choose one of {', '.join(task.MODEL_NAMES)}"
      )
    for name in ("aggregate_first", "nan_clients_per_round"):
      if getattr(self, name) > self.clients_per_round:
        raise UsageError(
          f"--{name}={getattr(self, name)} must be between 0 and "
          f"--clients_per_round={self.clients_per_round}"
        )
    self._validate_privacy()
    workers = self.worker_addresses()
    if workers and self.max_concurrent_clients > 0:
      raise UsageError(
        "--max_concurrent_clients is a flag of the worker process when "
        "--workers is given: start each worker with `python -m "
        "tff_ens.worker --max_concurrent_clients=N` instead"
      )

  def _validate_algorithm_options(self):
    """`algorithms.check_options`: the options the algorithm takes, named by their flags."""
    flag_of = dict(
      local_objective="local_objective",
      on_device="client_runtime",
      recalibrates="recalibrate_batch_norm",
      prototypes="prototypes",
      dp="dp_clip_norm" if self.dp_clip_norm else "dp_noise_multiplier",
    )
    try:
      algorithms.check_options(
        self.algorithm,
        local_objective=self.local_objective,
        on_device=self.client_runtime != "tff",
        recalibrates=self.recalibrate_batch_norm > 0,
        prototypes=bool(self.prototypes),
        dp=bool(self.dp_noise_multiplier or self.dp_clip_norm),
      )
    except settings.SettingError as e:
      flag = flag_of[e.name]
      raise UsageError(f"--{flag}={getattr(self, flag)}: {e.problem}") from None

  def _validate_litert_clients(self, task):
    """What `--client_runtime=litert` runs: FedAvg's local SGD as `export.trainable` has it."""
    for name, value, plain in (
      ("lr_schedule", self.lr_schedule, "constant"),
      ("client_optimizer", self.client_optimizer, "sgd"),
      ("local_objective", self.local_objective, "sgd"),
      ("weight_decay", self.weight_decay, 0.0),
      ("active_learning_rounds", self.active_learning_rounds, 0),
    ):
      if value != plain:
        raise UsageError(
          f"--client_runtime=litert: the device file trains with plain SGD(M) on all its "
          f"examples, so --{name}={value} is not supported there: use --{name}={plain} or "
          "--client_runtime=tff"
        )
    if task.TRAIN_AUGMENTATION is not None:
      raise UsageError(
        f"--client_runtime=litert: task {self.task} augments its training images, which the "
        "device file does not: use --client_runtime=tff"
      )

  def prototype_names(self) -> list[str]:
    """The architectures of --prototypes (empty: every client runs --model)."""
    return [n.strip() for n in self.prototypes.split(",")] if (self.prototypes) else []

  def _validate_prototypes(self, task):
    names = self.prototype_names()
    if not names:
      return
    if len(names) < 2 or len(set(names)) < len(names):
      raise UsageError(
        f"--prototypes={self.prototypes}: list two or more "
        "different models, e.g. --prototypes=cnn,resnet8"
      )
    for name in names:
      if name not in task.MODEL_NAMES:
        raise UsageError(
          f"--prototypes={self.prototypes}: unknown model {name} for task "
          f"{self.task}: choose from {', '.join(task.MODEL_NAMES)}"
        )
    if names[0] != self.model:
      raise UsageError(
        f"--prototypes={self.prototypes} starts with {names[0]} but "
        f"--model={self.model}: the first prototype is the run's model "
        f"(test_accuracy, model.keras); pass --model={names[0]} or list "
        f"{self.model} first"
      )

  def worker_addresses(self) -> list[str]:
    """The "host:port" addresses of --workers (empty: a local worker)."""
    if not self.workers:
      return []
    addresses = [a.strip() for a in self.workers.split(",")]
    for address in addresses:
      host, _, port = address.rpartition(":")
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

  def _validate_privacy(self):
    """The --dp_* flags against the algorithm DP aggregation applies to."""
    if self.dp_target_delta and not self.dp_noise_multiplier:
      raise UsageError(
        "--dp_target_delta needs --dp_noise_multiplier > 0: "
        "without noise there is no epsilon to report"
      )
    if not (self.dp_noise_multiplier or self.dp_clip_norm):
      return
    if self.algorithm == "fedensemble" and not self.dp_clip_norm:
      raise UsageError(
        "--algorithm=fedensemble clips with a fixed norm only: set --dp_clip_norm > 0"
      )

  # The library configs of the run, from its settings (`settings.build`).

  def server_distillation_config(self) -> server_distillation.ServerDistillationConfig:
    """The server step of fedbe, feddf, vdistill, fedppd_distill."""
    if self.algorithm == "feddf":
      distill = settings.build(distillation.feddf_config, self, _FEDDF_DISTILL)
    else:  # FedBE (SWA or not); v-Distillation is FedBE's plain SGD.
      distill = settings.build(
        distillation.fedbe_config,
        self,
        _FEDBE_DISTILL,
        swa=self.swa and self.algorithm in _SWA_ALGORITHMS,
        cycle_steps=SWA_CYCLE_STEPS,
      )
    return settings.build(
      server_distillation.ServerDistillationConfig,
      self,
      _SERVER_DISTILLATION,
      # FedPPD+Distill distills the students with FedBE's server step.
      method=("fedbe" if self.algorithm == "fedppd_distill" else self.algorithm),
      distill=distill,
      drop_worst=self.drop_worst and self.algorithm == "feddf",
      device=distillation.choose_device(self.server_device),
    )

  def partition_config(self) -> tasks.partition.PartitionConfig | None:
    """The --partition split, or None for the task's own clients.

    Unset, it is the task's DEFAULT_PARTITION (None: FEMNIST's writers). The
    server's examples default to the task's SERVER_EXAMPLES. Raises
    ValueError for a split flag given without a split to apply it to.
    """
    task = self.task_module()
    partition = self.partition or task.DEFAULT_PARTITION
    if partition is None:
      defaults = {f.name: f.default for f in dataclasses.fields(self)}
      given = [name for name in _PARTITION_FLAGS if getattr(self, name) != defaults[name]]
      if given:
        raise ValueError(
          f"--{given[0]} applies to a pooled split, and "
          f"{self.task}'s clients are its writers: pass "
          "--partition too, or leave it unset"
        )
      return None
    unlabeled, validation = task.SERVER_EXAMPLES
    return settings.build(
      tasks.partition.PartitionConfig,
      self,
      _PARTITION,
      partition=partition,
      server_unlabeled_examples=_given(self.server_unlabeled_examples, unlabeled),
      server_validation_examples=_given(self.server_validation_examples, validation),
    )

  def task_module(self):
    """The task of --task with --classes (see `tasks.get_task`)."""
    return tasks.get_task(self.task, self.classes)

  def resolved_student_model(self) -> str:
    """FedPPD's student: --student_model, else the task's for --model."""
    task = self.task_module()
    return self.student_model or getattr(task, "STUDENT_MODELS", {}).get(self.model, self.model)

  def posterior_config(self) -> fedppd.PosteriorConfig:
    """FedPPD's client update."""
    return settings.build(fedppd.PosteriorConfig, self, _POSTERIOR)

  def active_learning_config(self) -> active_learning.ActiveLearningConfig:
    return settings.build(active_learning.ActiveLearningConfig, self, _ACTIVE_LEARNING)

  def local_training_config(self) -> client_work_lib.LocalTrainingConfig:
    return settings.build(client_work_lib.LocalTrainingConfig, self, _LOCAL_TRAINING)

  def dp_config(self) -> privacy.DPConfig | None:
    """DP-FedAvg aggregation from the --dp_* flags; None when they are 0."""
    if not (self.dp_noise_multiplier or self.dp_clip_norm):
      return None
    # The noised sum is divided by the updates a round aggregates: the
    # first M with --aggregate_first (the accounting still charges the whole
    # sampled cohort).
    return settings.build(
      privacy.DPConfig,
      self,
      _DP,
      clients_per_round=(self.aggregate_first or self.clients_per_round),
    )

  def dp_delta(self, num_clients: int) -> float:
    """--dp_target_delta, or `privacy.default_target_delta` of N clients."""
    return self.dp_target_delta or privacy.default_target_delta(num_clients)
