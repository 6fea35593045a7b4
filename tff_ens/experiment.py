"""A run's flags (`ExperimentConfig`, written to `config.json`) and their checks.

Also the errors a run ends with (`UsageError`, `Stopped`) and `saved_config`, which reads
the config of a run saved by an older version.
"""

import dataclasses

import tasks
from tff_ens import active_learning
from tff_ens import algorithms
from tff_ens import client_work as client_work_lib
from tff_ens import device_clients
from tff_ens import distillation
from tff_ens import fed_ensemble
from tff_ens import fedadam
from tff_ens import fedppd
from tff_ens import privacy
from tff_ens import server_distillation
from tff_ens import weight_posterior

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


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything that defines a run (written to `config.json`)."""

  task: str = "femnist"
  classes: str = "all"
  data_dir: str | None = None
  num_clients: int = 10
  partition: str | None = None
  partition_alpha: float = 1.0
  classes_per_client: int = 2
  step_minor_examples: int = 10
  server_unlabeled_examples: int | None = None
  server_validation_examples: int | None = None
  algorithm: str = "fedavg"
  model: str = "cnn"
  norm: str = "batch"
  rounds: int = 100
  clients_per_round: int = 10
  client_epochs: int = 1
  batch_size: int = 20
  client_lr: float = 0.05
  client_optimizer: str = "sgd"
  client_momentum: float = 0.0
  weight_decay: float = 0.0
  lr_schedule: str = "constant"
  proximal_mu: float = 0.01
  server_lr: float | None = None  # None: the algorithm's (`AlgorithmSpec.server_learning_rate`).
  server_momentum: float = 0.9
  server_epsilon: float = fedadam.EPSILON
  recalibrate_batch_norm: int = 0
  ensemble_size: int = 5
  assignment: str = "permutation"
  member_average: str = "clients"
  local_objective: str = "sgd"
  feddyn_alpha: float = 0.01
  personalization_temperature: float = 0.0
  server_data: str | None = None
  distill_steps: int = 200
  distill_batch_size: int = 64
  swa: bool = True
  fedbe_distribution: str = "gaussian"
  fedbe_samples: int = 10
  fedbe_targets: str = "S+A+C"
  dirichlet_alpha: float = 1.0
  fedbe_gaussian: str = "paper"
  fedbe_var_scale: float = 0.1
  fedbe_var_clamp: float = 1e-5
  fedbe_dirichlet: str = "paper"
  sharpen_temperature: float | None = None
  swa_warmup_fraction: float = distillation.FEDBE_SWA_WARMUP_FRACTION
  distill_keep_initial: bool = False
  distill_clip_norm: float = distillation.FEDDF_CLIP_NORM
  drop_worst_rule: str = "guess_or_outliers"
  drop_worst: bool = True
  prototypes: str = ""
  distill_patience: int = 100
  distill_eval_every: int = 20
  distill_curve_every: int = 25
  distill_min_improvement: float = 0.0
  server_device: str = "auto"
  student_model: str = ""
  teacher_lr: float = 4e-4
  sgld_temperature: float = 1.0
  prior_precision: float = 0.0
  student_lr: float = 0.05
  student_momentum: float = 0.0
  student_weight_decay: float = 1e-4
  sgld_scaling: str = "posterior"
  teacher_weight_decay: float = 1e-4
  teacher_step_decay: float = 0.85
  teacher_step_decay_epochs: int = 3
  teacher_round_decay: float = 0.99
  student_round_decay: float = 0.99
  student_minibatch: str = "fresh"
  distill_fedppd_teachers: bool = True
  active_learning_rounds: int = 0
  active_budget: int = 10
  active_initial_fraction: float = 0.1
  active_selection: str = "entropy"
  max_update_norm: float = 0.0
  aggregate_first: int = 0
  nan_clients_per_round: int = 0
  dropout_rate: float = 0.0
  straggler_rate: float = 0.0
  dp_noise_multiplier: float = 0.0
  dp_clip_norm: float = 0.0
  dp_target_delta: float = 0.0
  seed: int = 0
  output_dir: str = "runs/femnist"
  eval_every: int = 10
  checkpoint_every: int = 10
  max_concurrent_clients: int = 0
  workers: str = ""
  client_runtime: str = "tff"
  device_processes: int = 2
  resume: bool = False

  def _validate_litert_clients(self, task):
    """What `--client_runtime=litert` runs: FedAvg's local SGD as `export.trainable` has it."""
    if self.algorithm not in algorithms.ON_DEVICE_ALGORITHMS:
      raise UsageError(
        f"--client_runtime=litert runs {', '.join(algorithms.ON_DEVICE_ALGORITHMS)}, not "
        f"--algorithm={self.algorithm}: use --client_runtime=tff"
      )
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
    if self.device_processes <= 0:
      raise UsageError(
        f"--device_processes must be a positive integer, got {self.device_processes}"
      )

  def validate(self):
    for name in (
      "rounds",
      "clients_per_round",
      "client_epochs",
      "batch_size",
      "eval_every",
      "checkpoint_every",
      "ensemble_size",
    ):
      if getattr(self, name) <= 0:
        raise UsageError(f"--{name} must be a positive integer, got {getattr(self, name)}")
    if self.algorithm not in algorithms.ALGORITHMS:
      raise UsageError(
        f"unknown --algorithm={self.algorithm}: choose one of {', '.join(algorithms.ALGORITHMS)}"
      )
    try:
      task = self.task_module()
    except ValueError as e:
      raise UsageError(f"--task={self.task} --classes={self.classes}: {e}") from None
    if self.model not in task.MODEL_NAMES:
      raise UsageError(
        f"unknown --model={self.model} for task {self.task}: "
        f"choose one of {', '.join(task.MODEL_NAMES)}"
      )
    for name, value, choices in (
      ("assignment", self.assignment, fed_ensemble.ASSIGNMENTS),
      ("member_average", self.member_average, fed_ensemble.MEMBER_AVERAGES),
      ("local_objective", self.local_objective, algorithms.LOCAL_OBJECTIVES),
      ("client_runtime", self.client_runtime, device_clients.CLIENT_RUNTIMES),
    ):
      if value not in choices:
        raise UsageError(f"unknown --{name}={value}: choose one of {', '.join(choices)}")
    if self.recalibrate_batch_norm < 0:
      raise UsageError(
        f"--recalibrate_batch_norm must be >= 0 (server images), got {self.recalibrate_batch_norm}"
      )
    if self.recalibrate_batch_norm and self.algorithm not in algorithms.FEDAVG_ALGORITHMS:
      raise UsageError(
        f"--recalibrate_batch_norm is the server step of "
        f"{', '.join(algorithms.FEDAVG_ALGORITHMS)}, not of --algorithm={self.algorithm}: "
        "drop it"
      )
    if self.server_lr is not None and not self.server_lr > 0:
      raise UsageError(f"--server_lr must be > 0, got {self.server_lr}")
    if self.server_epsilon < 0:
      raise UsageError(f"--server_epsilon must be >= 0, got {self.server_epsilon}")
    if self.client_runtime == "litert":
      self._validate_litert_clients(task)
    if self.local_objective == "feddyn":
      if self.algorithm != "fedensemble":
        raise UsageError(
          f"--local_objective=feddyn is built for --algorithm=fedensemble, "
          f"not {self.algorithm}: for FedDyn on one model use "
          "--algorithm=fedensemble --ensemble_size=1"
        )
      if self.feddyn_alpha <= 0:
        raise UsageError(f"--feddyn_alpha must be > 0, got {self.feddyn_alpha}")
      if self.dp_noise_multiplier or self.dp_clip_norm:
        raise UsageError(
          "--local_objective=feddyn keeps each client's "
          "unclipped updates: it does not combine with DP "
          "(--dp_*); use --local_objective=sgd or fedprox"
        )
    for name in (
      "distill_steps",
      "distill_batch_size",
      "fedbe_samples",
      "distill_patience",
      "distill_eval_every",
    ):
      if getattr(self, name) <= 0:
        raise UsageError(f"--{name} must be a positive integer, got {getattr(self, name)}")
    if self.distill_curve_every < 0:
      raise UsageError(f"--distill_curve_every must be >= 0, got {self.distill_curve_every}")
    for name, value, choices in (
      ("fedbe_distribution", self.fedbe_distribution, server_distillation.DISTRIBUTIONS),
      ("fedbe_targets", self.fedbe_targets, weight_posterior.TARGETS),
    ):
      if value not in choices:
        raise UsageError(f"unknown --{name}={value}: choose one of {', '.join(choices)}")
    if self.distill_min_improvement < 0:
      raise UsageError(
        f"--distill_min_improvement must be >= 0, got {self.distill_min_improvement}"
      )
    if self.dirichlet_alpha <= 0:
      raise UsageError(f"--dirichlet_alpha must be > 0, got {self.dirichlet_alpha}")
    if self.algorithm in _SWA_ALGORITHMS and self.swa and self.distill_steps < SWA_CYCLE_STEPS:
      raise UsageError(
        f"--distill_steps={self.distill_steps} is shorter than one SWA "
        f"cycle ({SWA_CYCLE_STEPS} steps): use --distill_steps >= "
        f"{SWA_CYCLE_STEPS}, or --noswa"
      )
    if self.algorithm in algorithms.SERVER_DATA_ALGORITHMS:
      try:
        self.server_distillation_config()
      except ValueError as e:
        raise UsageError(str(e)) from None
    self._validate_prototypes(task)
    if self.algorithm in algorithms.FEDPPD_METHODS:
      if self.resolved_student_model() not in task.MODEL_NAMES:
        raise UsageError(
          f"unknown --student_model={self.student_model} for task "
          f"{self.task}: choose one of {', '.join(task.MODEL_NAMES)}"
        )
      try:
        self.posterior_config()
      except ValueError as e:
        raise UsageError(f"fedppd: {e}") from None
    for name in ("dropout_rate", "straggler_rate"):
      if not 0 <= getattr(self, name) <= 1:
        raise UsageError(f"--{name} must be in [0, 1], got {getattr(self, name)}")
    for name in ("aggregate_first", "nan_clients_per_round"):
      if not 0 <= getattr(self, name) <= self.clients_per_round:
        raise UsageError(
          f"--{name}={getattr(self, name)} must be between 0 and "
          f"--clients_per_round={self.clients_per_round}"
        )
    self._validate_privacy()
    try:
      self.active_learning_config()
    except ValueError as e:
      raise UsageError(str(e)) from None
    if self.personalization_temperature < 0:
      raise UsageError(
        "--personalization_temperature must be > 0, or 0 to choose it from training data"
      )
    try:
      self.local_training_config()
      self.partition_config()
    except ValueError as e:
      raise UsageError(str(e)) from None
    workers = self.worker_addresses()
    if workers and self.max_concurrent_clients > 0:
      raise UsageError(
        "--max_concurrent_clients is a flag of the worker process when "
        "--workers is given: start each worker with `python -m "
        "tff_ens.worker --max_concurrent_clients=N` instead"
      )

  def prototype_names(self) -> list[str]:
    """The architectures of --prototypes (empty: every client runs --model)."""
    return [n.strip() for n in self.prototypes.split(",")] if (self.prototypes) else []

  def _validate_prototypes(self, task):
    names = self.prototype_names()
    if not names:
      return
    if self.algorithm != "feddf":
      raise UsageError(
        f"--prototypes is FedDF's (clients running different models): "
        f"use it with --algorithm=feddf, not --algorithm={self.algorithm}"
      )
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

  def server_distillation_config(self) -> server_distillation.ServerDistillationConfig:
    """The server step of fedbe, feddf, vdistill, fedppd_distill."""
    if self.algorithm == "feddf":
      distill = distillation.feddf_config(
        self.distill_steps,
        batch_size=self.distill_batch_size,
        patience=self.distill_patience,
        eval_every=self.distill_eval_every,
        min_improvement=self.distill_min_improvement,
        keep_initial_student=self.distill_keep_initial,
        clip_norm=self.distill_clip_norm,
      )
    else:  # FedBE (SWA or not); v-Distillation is FedBE's plain SGD.
      distill = distillation.fedbe_config(
        self.distill_steps,
        swa=self.swa and self.algorithm in _SWA_ALGORITHMS,
        batch_size=self.distill_batch_size,
        swa_warmup_fraction=self.swa_warmup_fraction,
        cycle_steps=SWA_CYCLE_STEPS,
        curve_every=self.distill_curve_every,
      )
    return server_distillation.ServerDistillationConfig(
      # FedPPD+Distill distills the students with FedBE's server step.
      method=("fedbe" if self.algorithm == "fedppd_distill" else self.algorithm),
      distill=distill,
      distribution=self.fedbe_distribution,
      num_samples=self.fedbe_samples,
      targets=self.fedbe_targets,
      dirichlet_alpha=self.dirichlet_alpha,
      gaussian=self.fedbe_gaussian,
      gaussian_var_scale=self.fedbe_var_scale,
      gaussian_var_clamp=self.fedbe_var_clamp,
      dirichlet=self.fedbe_dirichlet,
      sharpen_temperature=self.sharpen_temperature,
      drop_worst=self.drop_worst and self.algorithm == "feddf",
      drop_worst_rule=self.drop_worst_rule,
      device=distillation.choose_device(self.server_device),
      seed=self.seed,
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
    return tasks.partition.PartitionConfig(
      partition=partition,
      num_clients=self.num_clients,
      alpha=self.partition_alpha,
      classes_per_client=self.classes_per_client,
      step_minor_examples=self.step_minor_examples,
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
    """FedPPD's client update from the flags."""
    return fedppd.PosteriorConfig(
      teacher_step_size=self.teacher_lr,
      temperature=self.sgld_temperature,
      prior_precision=self.prior_precision,
      student_lr=self.student_lr,
      student_momentum=self.student_momentum,
      student_weight_decay=self.student_weight_decay,
      sgld_scaling=self.sgld_scaling,
      teacher_weight_decay=self.teacher_weight_decay,
      teacher_step_decay=self.teacher_step_decay,
      teacher_step_decay_epochs=self.teacher_step_decay_epochs,
      teacher_round_decay=self.teacher_round_decay,
      student_round_decay=self.student_round_decay,
      student_minibatch=self.student_minibatch,
      epochs=self.client_epochs,
      seed=self.seed,
      max_update_norm=self.max_update_norm,
    )

  def active_learning_config(self) -> active_learning.ActiveLearningConfig:
    return active_learning.ActiveLearningConfig(
      phases=self.active_learning_rounds,
      budget=self.active_budget,
      initial_fraction=self.active_initial_fraction,
      selection=self.active_selection,
      rounds=self.rounds,
    )

  def local_training_config(self) -> client_work_lib.LocalTrainingConfig:
    return client_work_lib.LocalTrainingConfig(
      learning_rate=self.client_lr,
      optimizer=self.client_optimizer,
      momentum=self.client_momentum,
      weight_decay=self.weight_decay,
      lr_schedule=self.lr_schedule,
      total_rounds=self.rounds,
      max_update_norm=self.max_update_norm,
    )

  def _validate_privacy(self):
    """The --dp_* flags: values, and an algorithm DP aggregation applies to."""
    for name in ("dp_noise_multiplier", "dp_clip_norm"):
      if getattr(self, name) < 0:
        raise UsageError(f"--{name} must be >= 0 (0: off), got {getattr(self, name)}")
    if not 0 <= self.dp_target_delta < 1:
      raise UsageError(
        f"--dp_target_delta must be in (0, 1), or 0 for "
        f"1/N^1.1 of N clients, got {self.dp_target_delta}"
      )
    if self.dp_target_delta and not self.dp_noise_multiplier:
      raise UsageError(
        "--dp_target_delta needs --dp_noise_multiplier > 0: "
        "without noise there is no epsilon to report"
      )
    if not (self.dp_noise_multiplier or self.dp_clip_norm):
      return
    if self.algorithm not in algorithms.DP_ALGORITHMS:
      raise UsageError(
        f"--dp_noise_multiplier/--dp_clip_norm do not apply to "
        f"--algorithm={self.algorithm}: its server distills from every "
        "client's own model, which central DP on the aggregate cannot "
        f"protect; use one of {', '.join(algorithms.DP_ALGORITHMS)}"
      )
    if self.algorithm == "fedensemble" and not self.dp_clip_norm:
      raise UsageError(
        "--algorithm=fedensemble clips with a fixed norm only: set --dp_clip_norm > 0"
      )
    try:
      self.dp_config()
    except ValueError as e:
      raise UsageError(f"--dp_noise_multiplier: {e}") from None

  def dp_config(self) -> privacy.DPConfig | None:
    """DP-FedAvg aggregation from the --dp_* flags; None when they are 0."""
    if not (self.dp_noise_multiplier or self.dp_clip_norm):
      return None
    # The noised sum is divided by the updates a round aggregates: the
    # first M with --aggregate_first (the accounting still charges the whole
    # sampled cohort).
    return privacy.DPConfig(
      noise_multiplier=self.dp_noise_multiplier,
      clip_norm=self.dp_clip_norm,
      clients_per_round=(self.aggregate_first or self.clients_per_round),
    )

  def dp_delta(self, num_clients: int) -> float:
    """--dp_target_delta, or `privacy.default_target_delta` of N clients."""
    return self.dp_target_delta or privacy.default_target_delta(num_clients)
