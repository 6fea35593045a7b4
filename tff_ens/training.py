"""The training loop shared by every algorithm: sample, train, evaluate, save.

Everything a run needs to continue lives in the checkpointed process state;
client sampling and data shuffling are pure functions of `(seed, round)`, so a
resumed run samples the same clients and ends in the same state as an
uninterrupted one.

Outputs in `output_dir`: `config.json`, `metrics.csv` (one row per round),
TensorBoard events under `tensorboard/`, checkpoints under `checkpoints/`
(`tff.program.FileProgramStateManager`, written atomically), FedDyn's client
states under `client_states/` (`client_states.ClientStateStore`, rewound to
the checkpoint on resume), the final model(s) in Keras format and
`summary.json`.
"""

import asyncio
import contextlib
import csv
import dataclasses
import functools
import json
import logging
import math
import os
import signal
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from export import trainable
import tasks
from tff_ens import active_learning
from tff_ens import algorithms
from tff_ens import client_states
from tff_ens import client_work as client_work_lib
from tff_ens import device_clients
from tff_ens import distillation
from tff_ens import evaluation
from tff_ens import fed_ensemble
from tff_ens import fedppd
from tff_ens import metrics
from tff_ens import personalization
from tff_ens import plots
from tff_ens import privacy
from tff_ens import runtime
from tff_ens import server_data as server_data_lib
from tff_ens import server_distillation
from tff_ens import weight_posterior

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.csv"
SUMMARY_FILE = "summary.json"
# Each test writer's accuracy of the final model(s) (`per_client_accuracy` is
# their mean), for `tff_ens.compare`.
PER_CLIENT_ACCURACY_FILE = "per_client_accuracy.json"
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_PREFIX = "round_"

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
  """
  if "member_average" in saved:
    return dict(saved)
  upgraded = {**_BEFORE_ISSUE_24, **saved}
  if upgraded.get("task", "femnist") == "femnist":
    for name in ("partition", "server_unlabeled_examples", "server_validation_examples"):
      upgraded[name] = None
  return upgraded


# Keys that may differ between an interrupted run and its `--resume`: how
# the run executes, not what it computes.
_RESUME_FREE_KEYS = ("resume", "max_concurrent_clients", "workers", "device_processes")


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
  server_lr: float = 1.0
  server_momentum: float = 0.9
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
      ("client_optimizer", self.client_optimizer, client_work_lib.OPTIMIZERS),
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
    if self.client_optimizer == "adam" and self.client_momentum:
      raise UsageError(
        f"--client_momentum={self.client_momentum} is SGD's: Adam keeps its own moments; "
        "drop it or use --client_optimizer=sgd"
      )
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


def sample_clients(num_clients: int, cohort_size: int, seed: int, round_num: int) -> np.ndarray:
  """Indices of the clients of round `round_num`: a function of the seed only."""
  rng = np.random.default_rng([seed, round_num])
  return rng.choice(num_clients, size=cohort_size, replace=False)


def simulate_faults(
  cohort_size: int, seed: int, round_num: int, dropout_rate: float, straggler_rate: float
) -> tuple[np.ndarray, np.ndarray]:
  """Which sampled clients report this round, and how much work each does.

  Each client independently drops out (returns nothing) with probability
  `dropout_rate`, and is a straggler with probability `straggler_rate`: as in
  FedBE's systems-heterogeneity experiment (Chen & Chao, ICLR 2021, Sec. 5),
  its local epochs are drawn uniformly from (0, E], i.e. it completes a
  fraction u ~ U(0, 1] of its E epochs. Seeded by (seed, round).

  Returns:
    (reports: bool [cohort_size], work: float [cohort_size] in (0, 1]).
  """
  rng = np.random.default_rng([seed, round_num, 2])
  reports = rng.random(cohort_size) >= dropout_rate
  straggles = rng.random(cohort_size) < straggler_rate
  work = np.where(straggles, 1.0 - rng.random(cohort_size), 1.0)
  return reports, work


def client_speeds(num_clients: int, seed: int) -> np.ndarray:
  """Each client's device speed (local batches per unit of time).

  FedScale (Lai et al., ICML 2022) replays measured device traces; without
  them we assume speeds spread log-normally (sigma 0.5, so the 10% slowest
  are about 2x slower than the median), fixed per client for the run.
  """
  return np.random.default_rng([seed, 3]).lognormal(0.0, 0.5, num_clients)


def first_to_finish(durations: np.ndarray, reports: np.ndarray, m: int) -> np.ndarray:
  """FedScale's over-commitment: the first `m` reporting clients to finish.

  The server selects more clients than it needs (FedScale: 1.3 m) and
  aggregates the `m` whose updates arrive first; the rest are discarded.
  Ties go to the earlier client of the cohort.

  Args:
    durations: each cohort client's simulated training time.
    reports: which cohort clients report at all (not dropped out).
    m: updates to aggregate; 0 keeps every reporting client.

  Returns:
    bool [cohort]: the clients whose updates are aggregated.
  """
  if m <= 0:
    return reports.copy()
  order = np.argsort(np.where(reports, durations, np.inf), kind="stable")
  kept = np.zeros_like(reports)
  kept[order[:m]] = True
  return kept & reports


@dataclasses.dataclass(frozen=True)
class RoundPlan:
  """Who is sampled in a round, who reports and how much each one trains.

  Attributes:
    cohort: indices of the sampled training clients.
    seeds: each sampled client's data-shuffling seed.
    reports: the clients whose updates the server aggregates.
    work: each client's completed share of its local epochs, in (0, 1].
    late: reporting clients left out by --aggregate_first.
    poisoned: reporting clients injected with NaN data
      (--nan_clients_per_round), whose updates must be rejected.
  """

  cohort: np.ndarray
  seeds: np.ndarray
  reports: np.ndarray
  work: np.ndarray
  late: np.ndarray
  poisoned: np.ndarray


def plan_round(
  config: "ExperimentConfig", sizes: np.ndarray, speeds: np.ndarray, round_num: int
) -> RoundPlan:
  """The round's cohort and faults: a function of (seed, round) only.

  Args:
    config: the run's flags.
    sizes: labeled training examples of every client.
    speeds: `client_speeds` of every client.
    round_num: the round, from 1.
  """
  cohort = sample_clients(len(sizes), config.clients_per_round, config.seed, round_num)
  seeds = np.random.default_rng([config.seed, round_num, 1]).integers(2**31, size=len(cohort))
  reports, work = simulate_faults(
    len(cohort), config.seed, round_num, config.dropout_rate, config.straggler_rate
  )
  batches = np.ceil(sizes[cohort] * config.client_epochs / config.batch_size)
  kept = first_to_finish(work * batches / speeds[cohort], reports, config.aggregate_first)
  poisoned = np.zeros_like(kept)
  poisoned[np.flatnonzero(kept)[: config.nan_clients_per_round]] = True
  return RoundPlan(
    cohort=cohort, seeds=seeds, reports=kept, work=work, late=reports & ~kept, poisoned=poisoned
  )


def client_dataset(
  x: np.ndarray,
  y: np.ndarray,
  *,
  epochs: int,
  batch_size: int,
  seed: int,
  augmentation=None,
  work: float = 1.0,
  poisoned: bool = False,
) -> tf.data.Dataset:
  """One client's local training data: shuffled (seeded), repeated, batched.

  `augmentation` is the task's TRAIN_AUGMENTATION, `(x, y, seed) -> (x, y)`;
  the i-th example of the stream gets the stateless seed (seed, i). A
  straggler (`work` < 1) stops after that fraction of its batches (at least
  one). A `poisoned` client (fault injection) has NaN inputs, so its local
  training ends in NaN weights, as a broken device's would.
  """
  if poisoned:
    x = np.full_like(x, np.nan)
  dataset = (
    tf.data.Dataset.from_tensor_slices((x, y))
    .shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    .repeat(epochs)
  )
  if augmentation is not None:
    dataset = dataset.enumerate().map(
      lambda i, example: augmentation(*example, tf.stack([tf.constant(seed, tf.int64), i]))
    )
  dataset = dataset.batch(batch_size)
  if work < 1.0:
    batches = math.ceil(len(x) * epochs / batch_size)
    dataset = dataset.take(max(1, math.ceil(work * batches)))
  return dataset


def client_order(
  num_examples: int, *, epochs: int, batch_size: int, seed: int, work: float = 1.0
) -> np.ndarray:
  """The indices of a client's examples in the order `client_dataset` trains on them."""
  indices = np.arange(num_examples, dtype=np.int32)
  batches = client_dataset(
    indices, indices, epochs=epochs, batch_size=batch_size, seed=seed, work=work
  )
  return np.concatenate([y for _, y in batches.as_numpy_iterator()] or [indices[:0]])


def batch_element_spec(task) -> tuple[tf.TensorSpec, tf.TensorSpec]:
  return (
    tf.TensorSpec((None,) + tuple(task.INPUT_SHAPE), tf.float32),
    tf.TensorSpec((None,), tf.int32),
  )


class _Outputs:
  """The run's files: config, metrics (CSV and TensorBoard), checkpoints."""

  def __init__(self, config: ExperimentConfig, initial_state):
    self._config = config
    self.dir = config.output_dir
    self._loop = asyncio.new_event_loop()
    self._structure = {"round": 0, "state": initial_state}
    self._resumed = None
    self._prepare_dir(config)
    self._checkpoints = tff.program.FileProgramStateManager(
      os.path.join(self.dir, CHECKPOINT_DIR),
      prefix=CHECKPOINT_PREFIX,
      keep_total=2,
      keep_first=False,
    )
    self._csv = tff.program.CSVFileReleaseManager(
      os.path.join(self.dir, METRICS_FILE),
      save_mode=tff.program.CSVSaveMode.WRITE,
      key_fieldname="round",
    )
    self._tensorboard = tff.program.TensorBoardReleaseManager(os.path.join(self.dir, "tensorboard"))

  def _prepare_dir(self, config: ExperimentConfig):
    if os.path.exists(self.dir) and not os.path.isdir(self.dir):
      raise UsageError(f"--output_dir={self.dir} is a file: choose a directory")
    config_path = os.path.join(self.dir, CONFIG_FILE)
    wanted = {k: v for k, v in dataclasses.asdict(config).items() if k not in _RESUME_FREE_KEYS}
    if os.path.exists(config_path):
      try:
        with open(config_path, "rb") as f:
          saved = json.load(f)
      except (OSError, ValueError):  # Unreadable, not UTF-8 or not JSON.
        saved = None
      if not isinstance(saved, dict):
        raise UsageError(
          f"{config_path} is not a run's config (a JSON object of its "
          "flags): restore it, or choose a new --output_dir"
        )
      saved = {k: v for k, v in saved_config(saved).items() if k not in _RESUME_FREE_KEYS}
      if saved:
        # A flag added after the run started takes its default there.
        defaults = {f.name: f.default for f in dataclasses.fields(ExperimentConfig)}
        saved = {**{k: defaults[k] for k in wanted}, **saved}
      if saved != wanted:
        changed = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
        raise UsageError(
          f"--output_dir={self.dir} holds a different run (it has "
          f"{' '.join(f'--{k}={saved.get(k)}' for k in changed)}): pass "
          "those flags to continue it, or choose a new --output_dir"
        )
    checkpoints = os.path.join(self.dir, CHECKPOINT_DIR)
    started = os.path.isdir(checkpoints) and any(
      name.startswith(CHECKPOINT_PREFIX) for name in os.listdir(checkpoints)
    )
    if started and not config.resume:
      raise UsageError(
        f"--output_dir={self.dir} already holds this run: pass --resume "
        "to continue it, or choose a new --output_dir"
      )
    if started:
      # Read before anything is written: a checkpoint that does not fit
      # leaves the directory as it was.
      self._resumed = self._read_checkpoint(checkpoints, config)
    try:
      os.makedirs(self.dir, exist_ok=True)
      _write_json_atomically(config_path, dataclasses.asdict(config))
    except OSError as e:
      raise UsageError(
        f"cannot write to --output_dir={self.dir} ({e.strerror}): choose a writable directory"
      ) from None

  def _read_checkpoint(self, directory: str, config: ExperimentConfig) -> tuple[int, Any] | None:
    """(round, state) of the last checkpoint in `directory`, or None.

    Raises UsageError, naming the checkpoint, if it cannot be read or its
    state does not have this run's structure, shapes and dtypes (e.g.
    checkpoints copied from another run, or a config.json edited by hand).
    """
    manager = tff.program.FileProgramStateManager(directory, prefix=CHECKPOINT_PREFIX)
    versions = self._loop.run_until_complete(manager.get_versions())
    if not versions:
      return None
    path = os.path.join(directory, f"{CHECKPOINT_PREFIX}{versions[-1]}")
    try:
      saved = self._loop.run_until_complete(manager.load(versions[-1], self._structure))
    except (ValueError, TypeError):  # The nesting differs.
      mismatch = "its nesting differs"
    except (tf.errors.OpError, OSError) as e:
      raise UsageError(
        f"cannot read checkpoint {path} ({' '.join(str(e).split())[:200]})"
        ": delete it to resume from the one before it, or choose a new "
        "--output_dir"
      ) from None
    else:
      mismatch = _state_mismatch(self._structure["state"], saved["state"])
      if mismatch is None:
        return int(saved["round"]), saved["state"]
    raise UsageError(
      f"checkpoint {path} does not fit the state of --algorithm="
      f"{config.algorithm} --model={config.model} ({mismatch}): another "
      "run wrote it; restore this run's own checkpoints, or choose a new "
      "--output_dir"
    )

  def latest_checkpoint(self) -> tuple[int, Any] | None:
    """(round, state) of the checkpoint a `--resume` continues from, or None.

    Read and checked when the outputs were opened, before anything was
    written.
    """
    return self._resumed

  def resume_hint(self) -> str:
    """Where a stopped run continues from: its last checkpoint, if any."""
    versions = self._loop.run_until_complete(self._checkpoints.get_versions())
    if not versions:
      return f"No round of --output_dir={self.dir} was checkpointed: run it again"
    return (
      f"The run's last checkpoint is round {versions[-1]}: rerun with "
      "--resume (on the same or other --workers) to continue from it"
    )

  def save_checkpoint(self, round_num: int, state):
    self._loop.run_until_complete(
      self._checkpoints.save({"round": round_num, "state": state}, round_num)
    )

  def release_metrics(self, round_num: int, row: dict):
    async def release():
      await asyncio.gather(
        self._csv.release(row, key=round_num), self._tensorboard.release(row, key=round_num)
      )

    self._loop.run_until_complete(release())

  def metrics_rows(self) -> list[dict]:
    with open(os.path.join(self.dir, METRICS_FILE)) as f:
      return list(csv.DictReader(f))

  def write_trainable_file(self) -> str:
    """The run's model as a `--format=trainable` file (`export.trainable`) with its client
    learning rate and momentum, for `--client_runtime=litert`; its path."""
    config = self._config
    model = config.task_module().build_model(config.model, seed=config.seed, norm=config.norm)
    try:
      flatbuffer = trainable.convert_trainable(
        model, learning_rate=config.client_lr, momentum=config.client_momentum
      )
    except ValueError as e:
      raise UsageError(f"--client_runtime=litert: {e}") from None
    path = os.path.join(self.dir, device_clients.TRAINABLE_FILE)
    with open(f"{path}.tmp", "wb") as f:
      f.write(flatbuffer)
    os.replace(f"{path}.tmp", path)
    return path

  def close(self):
    self._loop.close()


def _state_mismatch(expected, loaded) -> str | None:
  """The first tensor of `loaded` whose shape or dtype is not `expected`'s.

  Both are process states of one nesting; None if every tensor matches.
  """
  for i, (want, got) in enumerate(zip(tf.nest.flatten(expected), tf.nest.flatten(loaded))):
    want, got = np.asarray(want), np.asarray(got)
    if (want.shape, want.dtype) != (got.shape, got.dtype):
      return (
        f"tensor {i} is {got.dtype} {list(got.shape)} where this run "
        f"has {want.dtype} {list(want.shape)}"
      )
  return None


def _write_json_atomically(path: str, value):
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


class _Evaluator:
  """Evaluates the process' model(s) on a task split with one Keras model."""

  def __init__(self, model_fn):
    self.model = model_fn()

  def member_probabilities(self, models: list, split) -> dict[str, np.ndarray]:
    """{client: [K, n, classes]} for the K models on each client's examples."""
    x, _ = split.concatenated()
    counts = [split.num_examples(c) for c in split.client_ids]
    member_probs = []
    for weights in models:
      evaluation.assign_weights(self.model, weights)
      member_probs.append(evaluation.predict_probabilities(self.model, x))
    stacked = np.stack(member_probs, axis=1)  # [n, K, classes]
    return {
      c: np.moveaxis(p, 1, 0)
      for c, p in zip(split.client_ids, metrics.split_by_client(stacked, counts))
    }

  def summary(
    self, models: list, split, prefix: str = "test", member_probs: dict | None = None
  ) -> dict:
    """Metrics of the uniform average of `models` on `split`."""
    member_probs = member_probs or self.member_probabilities(models, split)
    probs = {c: p.mean(0) for c, p in member_probs.items()}
    return metrics.classification_summary(probs, split.y, prefix)

  def ensemble_summary(
    self, models: list, data, member_test: dict, temperature: float, seed: int
  ) -> dict:
    """Fed-ensemble's metrics: members, personalized weights, uncertainty."""
    clients = [c for c in data.test.client_ids if c in data.train.x]
    member_train = self.member_probabilities(models, data.train)
    if not temperature:
      temperature = personalization.choose_temperature(member_train, data.train.y, seed=seed)
    all_members = np.concatenate([member_test[c] for c in clients], axis=1)
    y = np.concatenate([data.test.y[c] for c in clients])
    personalized, personalized_nll = [], []
    for c in clients:
      alpha = personalization.personalization_weights(
        personalization.member_losses(member_train[c], data.train.y[c]), temperature
      )
      probs = personalization.weighted_probabilities(member_test[c], alpha)
      personalized.append(metrics.accuracy(probs, data.test.y[c]))
      personalized_nll.append(metrics.negative_log_likelihood(probs, data.test.y[c]))
    uncertainty = metrics.ensemble_uncertainty(all_members)
    wrong = uncertainty["probabilities"].argmax(-1) != y
    return {
      "ensemble_size": len(models),
      "member_test_accuracy": [metrics.accuracy(p, y) for p in all_members],
      "personalized_accuracy": float(np.mean(personalized)),
      "personalized_test_loss": float(np.mean(personalized_nll)),
      "personalization_temperature": temperature,
      "entropy_error_auroc": metrics.auroc(uncertainty["entropy"], wrong),
      "mean_mutual_information": float(uncertainty["mutual_information"].mean()),
    }


# The metrics a terminal's evaluation line shows.
_EVALUATION_KEYS = ("test_accuracy", "test_loss", "ece", "per_client_accuracy")


@contextlib.contextmanager
def _progress(config: ExperimentConfig, start_round: int):
  """A tqdm bar on a terminal; plain log lines otherwise."""
  if sys.stderr.isatty():
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top

    bar = tqdm(total=config.rounds, initial=start_round, unit="round", dynamic_ncols=True)
    last = {}  # The latest value of each shown metric.

    def report(round_num, row):
      last.update({k: f"{row[k]:.4f}" for k in ("train_loss", "test_accuracy") if k in row})
      if "test_accuracy" in row:  # One line per evaluation, above the bar.
        bar.write(
          f"round {round_num}: "
          + " ".join(f"{k}={row[k]:.4f}" for k in _EVALUATION_KEYS if k in row)
        )
      bar.set_postfix(last, refresh=False)
      bar.update(1)

    try:
      yield report
    finally:
      bar.close()
  else:
    yield lambda r, row: logging.info(
      "round %d/%d %s",
      r,
      config.rounds,
      " ".join(f"{k}={v:.4f}" for k, v in row.items() if isinstance(v, float)),
    )


@contextlib.contextmanager
def _stop_on_sigterm():
  """Yields an event that SIGTERM sets instead of killing the process.

  The loop finishes the round in flight, checkpoints it and raises `Stopped`
  (a scheduler's SIGTERM, e.g. on preemption, ends the run resumable). Only
  the main thread can handle signals; elsewhere SIGTERM keeps its default.
  """
  requested = threading.Event()
  if threading.current_thread() is not threading.main_thread():
    yield requested
    return
  previous = signal.signal(signal.SIGTERM, lambda *_: requested.set())
  try:
    yield requested
  finally:
    signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _execution_context(config: ExperimentConfig):
  """The run's TFF context: a local worker, or the workers of --workers."""
  workers = config.worker_addresses()
  with contextlib.ExitStack() as stack:
    try:
      stack.enter_context(
        runtime.execution_context(
          workers=workers, max_concurrent_computation_calls=config.max_concurrent_clients
        )
      )
    except runtime.WorkerError as e:
      if not workers:
        raise
      raise UsageError(
        f"--workers={config.workers}: {e} Start it there with `python -m "
        "tff_ens.worker --port=PORT`, or fix the address"
      ) from None
    yield


def run_experiment(config: ExperimentConfig) -> dict:
  """Runs (or resumes) one experiment and returns its summary.

  Raises:
    UsageError: for a bad flag or output directory.
    runtime.WorkerError: if a TFF worker dies or stops answering during the
      run; the message says from which round `--resume` continues.
  """
  config.validate()
  task = config.task_module()
  data = task.load_data(config.data_dir, partition=config.partition_config(), seed=config.seed)
  train_ids = data.train.client_ids
  if config.clients_per_round > len(train_ids):
    raise UsageError(
      f"--clients_per_round={config.clients_per_round} exceeds the "
      f"{len(train_ids)} training writers in the data: use at most "
      f"{len(train_ids)}"
    )
  server_data = server_config = None
  if config.algorithm in algorithms.SERVER_DATA_ALGORITHMS or config.recalibrate_batch_norm:
    server_data = server_data_lib.server_split(
      data, task, seed=config.seed, unlabeled_path=config.server_data
    )
    logging.info(
      "server data: %d unlabeled (%s), %d validation",
      len(server_data.unlabeled),
      server_data.source,
      len(server_data.validation_y),
    )
  if config.algorithm in algorithms.SERVER_DATA_ALGORITHMS:
    server_config = config.server_distillation_config()
  tf.keras.utils.set_random_seed(config.seed)
  # Member k of an ensemble starts from its own seed; k = 0 for one model.
  model_fn = lambda k=0: task.build_model(
    config.model, seed=config.seed + 1009 * k, norm=config.norm
  )
  recalibration_images = _recalibration_images(config, model_fn, server_data)
  with _execution_context(config):
    algorithm = algorithms.build_algorithm(
      config.algorithm,
      model_fn,
      batch_element_spec(task),
      config.local_training_config(),
      proximal_mu=config.proximal_mu,
      local_objective=config.local_objective,
      feddyn_alpha=config.feddyn_alpha,
      num_clients=len(train_ids),
      server_learning_rate=config.server_lr,
      server_momentum=config.server_momentum,
      ensemble_size=config.ensemble_size,
      assignment=config.assignment,
      member_average=config.member_average,
      seed=config.seed,
      distill_fedppd_teachers=config.distill_fedppd_teachers,
      server_data=server_data,
      server_config=server_config,
      clients_per_round=config.clients_per_round,
      student_fn=lambda: task.build_model(
        config.resolved_student_model(), seed=config.seed + 7919, norm=config.norm
      ),
      posterior_config=(
        config.posterior_config() if config.algorithm in algorithms.FEDPPD_METHODS else None
      ),
      dp=config.dp_config(),
      on_device=config.client_runtime == "litert",
      recalibration_images=recalibration_images,
      prototypes=[
        (
          name,
          functools.partial(task.build_model, name, seed=config.seed + 1009 * p, norm=config.norm),
        )
        for p, name in enumerate(config.prototype_names())
      ],
    )
    state = algorithm.process.initialize()
    outputs = _Outputs(config, state)
    try:
      return _train(
        config,
        data,
        algorithm,
        state,
        outputs,
        _Evaluator(algorithm.evaluation_model_fn or model_fn),
      )
    except runtime.WorkerError as e:
      raise runtime.WorkerError(f"{e} {outputs.resume_hint()}") from None
    finally:
      outputs.close()


def _train(config, data, algorithm, state, outputs, evaluator) -> dict:
  start_round = 0
  teacher_test = None
  if config.resume:
    checkpoint = outputs.latest_checkpoint()
    if checkpoint is not None:
      start_round, state = checkpoint
      logging.info("resuming from round %d", start_round)
  active = config.active_learning_config()
  sizes = {c: data.train.num_examples(c) for c in data.train.client_ids}
  pool = _active_learning_pool(active, config.seed, sizes, outputs.dir, start_round)
  train = _labeled(data.train, pool, sizes)
  # Labeled examples per client, for the simulated finishing times.
  train_sizes = np.array([len(train.y[c]) for c in train.client_ids])
  augmentation = config.task_module().TRAIN_AUGMENTATION
  num_clients = len(data.train.client_ids)
  # With DP noise, metrics.csv gets the epsilon spent after each round.
  dp_epsilons = (
    privacy.epsilons(
      config.dp_noise_multiplier,
      config.clients_per_round,
      num_clients,
      config.rounds,
      config.dp_delta(num_clients),
    )
    if config.dp_noise_multiplier
    else None
  )
  speeds = client_speeds(num_clients, config.seed)
  # FedDyn's clients' own states, as of `start_round`.
  store = None
  if algorithm.client_state is not None:
    store = client_states.ClientStateStore(
      os.path.join(outputs.dir, client_states.DIRECTORY), algorithm.client_state
    )
    store.rewind(start_round)
  # The state waits on the TFF worker between rounds; `held.value` downloads
  # it for evaluation and checkpoints.
  held = runtime.ResidentState(algorithm.process.next, state)
  with (
    _progress(config, start_round) as report,
    _stop_on_sigterm() as stop_requested,
    _devices(config, outputs) as devices,
  ):
    for round_num in range(start_round + 1, config.rounds + 1):
      start = time.perf_counter()
      plan = plan_round(config, train_sizes, speeds, round_num)
      reports = plan.reports
      if devices is not None:
        reports, datasets = _train_on_devices(
          devices, config, train, plan, held, algorithm, round_num
        )
      else:
        datasets = [
          client_dataset(
            train.x[train.client_ids[i]],
            train.y[train.client_ids[i]],
            epochs=config.client_epochs,
            batch_size=config.batch_size,
            seed=int(s),
            augmentation=augmentation,
            work=w,
            poisoned=p,
          )
          for i, s, w, p in zip(
            plan.cohort[reports], plan.seeds[reports], plan.work[reports], plan.poisoned[reports]
          )
        ]
      row = {
        "clients_used": float(len(datasets)),
        "stragglers": float(np.sum(reports & (plan.work < 1.0))),
        "late_clients": float(np.sum(plan.late)),
      }
      if datasets:
        if round_num == config.rounds and algorithm.teacher_fn is not None:
          # The last round's teacher ensemble, for `ensemble_test_accuracy`.
          teacher_test = algorithm.teacher_fn(
            held.value,
            *algorithm.next_args(datasets, plan.cohort[reports]),
            np.concatenate([s.concatenated()[0] for s in _evaluation_splits(data).values()]),
          )
        cohort = plan.cohort[reports]
        if store is None:
          round_metrics = held.next(*algorithm.next_args(datasets, cohort))
        else:
          models = algorithm.client_state.models(cohort, round_num - 1)
          round_metrics, new_states = held.next(
            *algorithm.next_args(
              datasets, cohort, [store.load(int(c), m) for c, m in zip(cohort, models)]
            )
          )
          for c, m, client_state in zip(cohort, models, new_states):
            store.save(round_num, int(c), m, client_state)
        # train_loss, train_accuracy, num_examples, rejected_updates (and
        # FedPPD's student_loss).
        row.update({k: float(v) for k, v in round_metrics["client_work"].items()})
        server = round_metrics.get("finalizer")
        if isinstance(server, dict):  # FedAvg's finalizer measures nothing.
          row.update({k: float(v) for k, v in server.items()})
        row.update(privacy.aggregator_metrics(round_metrics.get("aggregator")))
      # else: every sampled client dropped out; no model changes this round.
      if dp_epsilons is not None:
        row["dp_epsilon"] = float(dp_epsilons[round_num - 1])
      row["seconds"] = time.perf_counter() - start
      last = round_num == config.rounds
      phase_end = pool is not None and round_num in active.phase_ends()
      if round_num % config.eval_every == 0 or last or phase_end:
        row.update(evaluator.summary(algorithm.models_fn(held.value), data.test))
      if phase_end:
        row["labeled_examples"] = float(train.num_examples())
        pool.curve.append(
          {
            "round": round_num,
            "labeled": train.num_examples(),
            "test_accuracy": row["test_accuracy"],
          }
        )
        if not last:
          probs = evaluator.member_probabilities(algorithm.models_fn(held.value), data.train)
          row["annotated"] = float(
            pool.acquire(
              round_num, {c: p.mean(0) for c, p in probs.items()}, sizes, active, config.seed
            )
          )
          train = _labeled(data.train, pool, sizes)
          train_sizes = np.array([len(train.y[c]) for c in train.client_ids])
        # The pool is saved before the checkpoint of this round: a run killed
        # in between resumes from an earlier checkpoint and rewinds the pool.
        pool.save(outputs.dir)
      outputs.release_metrics(round_num, row)
      stopping = stop_requested.is_set()
      if round_num % config.checkpoint_every == 0 or last or phase_end or stopping:
        outputs.save_checkpoint(round_num, held.value)
        if store is not None:
          store.prune(round_num)
      report(round_num, row)
      if stopping and not last:
        raise Stopped(
          f"stopped by SIGTERM after round {round_num}, which is "
          f"checkpointed in {outputs.dir}: continue with --resume"
        )
  return _write_summary(config, data, algorithm, held.value, outputs, evaluator, teacher_test, pool)


def _recalibration_images(config, model_fn, server_data) -> np.ndarray | None:
  """The server images of `--recalibrate_batch_norm` (a seeded draw), or None."""
  if not config.recalibrate_batch_norm:
    return None
  with tf.Graph().as_default():
    layers = model_fn(0).submodules
  if not any(isinstance(layer, tf.keras.layers.BatchNormalization) for layer in layers):
    raise UsageError(
      f"--recalibrate_batch_norm: --model={config.model} --norm={config.norm} has no batch "
      "norm to recalibrate: drop the flag, or use a ResNet with --norm=batch"
    )
  unlabeled = server_data.unlabeled
  if config.recalibrate_batch_norm > len(unlabeled):
    raise UsageError(
      f"--recalibrate_batch_norm={config.recalibrate_batch_norm} exceeds the server's "
      f"{len(unlabeled)} unlabeled images ({server_data.source}): use at most {len(unlabeled)}"
    )
  rng = np.random.default_rng(config.seed)
  return unlabeled[rng.choice(len(unlabeled), config.recalibrate_batch_norm, replace=False)]


def _train_on_devices(devices, config, train, plan, held, algorithm, round_num):
  """The round's reporting clients trained on devices (`device_clients`), each from the
  model it is assigned: the reports left after device failures, and their results as the
  clients' datasets."""
  models = [[np.asarray(w) for w in m.trainable] for m in algorithm.models_fn(held.value)]
  clients = np.flatnonzero(plan.reports)
  names = [train.client_ids[plan.cohort[k]] for k in clients]
  assigned = (
    algorithm.client_models(plan.cohort[clients], round_num - 1)
    if algorithm.client_models is not None
    else [0] * len(clients)
  )
  requests = []
  for k, name, model in zip(clients, names, assigned):
    x = train.x[name]
    requests.append(
      {
        "x": np.full_like(x, np.nan) if plan.poisoned[k] else x,
        "y": train.y[name],
        "order": client_order(
          len(x),
          epochs=config.client_epochs,
          batch_size=config.batch_size,
          seed=int(plan.seeds[k]),
          work=float(plan.work[k]),
        ),
        "batch_size": config.batch_size,
        "model": model,
      }
    )
  results = devices.train(models, requests, names)
  reports = plan.reports.copy()
  reports[clients[[r is None for r in results]]] = False
  return reports, [device_clients.result_dataset(*r) for r in results if r is not None]


@contextlib.contextmanager
def _devices(config, outputs):
  """The run's `device_clients.DevicePool` with `--client_runtime=litert`, else None."""
  if config.client_runtime != "litert":
    yield None
    return
  pool = device_clients.DevicePool(outputs.write_trainable_file(), config.device_processes)
  try:
    yield pool
  finally:
    pool.close()


def _active_learning_pool(
  active: active_learning.ActiveLearningConfig,
  seed: int,
  sizes: dict[str, int],
  output_dir: str,
  start_round: int,
) -> active_learning.Pool | None:
  """The labeled pool of an active-learning run at `start_round`, or None."""
  if not active.enabled:
    return None
  pool = active_learning.Pool.load(output_dir) if start_round else None
  if pool is None:
    pool = active_learning.Pool.start(sizes, active.initial_fraction, seed)
  pool.rewind(start_round)
  return pool


def _labeled(train, pool: active_learning.Pool | None, sizes):
  """The training split restricted to the pool's labeled examples."""
  if pool is None:
    return train
  masks = pool.masks(sizes)
  return dataclasses.replace(
    train,
    x={c: train.x[c][masks[c]] for c in train.client_ids},
    y={c: train.y[c][masks[c]] for c in train.client_ids},
  )


def _write_summary(
  config, data, algorithm, state, outputs, evaluator, teacher_test=None, pool=None
):
  models = algorithm.models_fn(state)
  # Each split predicted once (FEMNIST's shift split is its new clients).
  predicted = {}

  def member_probabilities(split) -> dict[str, np.ndarray]:
    if id(split) not in predicted:
      predicted[id(split)] = evaluator.member_probabilities(models, split)
    return predicted[id(split)]

  member_test = member_probabilities(data.test)
  summary = evaluator.summary(models, data.test, member_probs=member_test)
  if len(models) > 1:
    summary.update(
      evaluator.ensemble_summary(
        models, data, member_test, config.personalization_temperature, config.seed
      )
    )
  rows = outputs.metrics_rows()
  if config.algorithm in algorithms.SERVER_DATA_ALGORITHMS:
    summary.update(
      _server_distillation_summary(data, rows, summary, teacher_test, algorithm.server_device)
    )
  if config.dp_config() is not None:
    summary.update(_privacy_summary(config, rows, len(data.train.client_ids)))
  if algorithm.prototypes_fn is not None:
    summary["prototype_test_accuracy"] = _prototype_accuracies(
      algorithm.prototypes_fn(state), data.test, outputs.dir
    )
  summary.update(
    _uncertainty_summary(config, data, member_probabilities, outputs.dir, teacher_test)
  )
  new_clients = evaluator.summary(
    models, data.new_clients, prefix="new", member_probs=member_probabilities(data.new_clients)
  )
  down, up = algorithm.bytes_per_client_round()
  seconds = [float(r["seconds"]) for r in rows if r.get("seconds")]
  summary.update(
    task=config.task,
    algorithm=config.algorithm,
    rounds=config.rounds,
    seed=config.seed,
    new_client_accuracy=new_clients.get("new_accuracy"),
    bytes_down_per_client_round=down,
    bytes_up_per_client_round=up,
    seconds_per_round=statistics.median(seconds) if seconds else None,
    config=dataclasses.asdict(config),
  )
  if pool is not None:
    summary["active_learning_curve"] = [[p["labeled"], p["test_accuracy"]] for p in pool.curve]
  _save_models(outputs.dir, evaluator.model, models)
  _write_json_atomically(
    os.path.join(outputs.dir, PER_CLIENT_ACCURACY_FILE),
    {c: metrics.accuracy(member_test[c].mean(0), data.test.y[c]) for c in data.test.client_ids},
  )
  _write_json_atomically(os.path.join(outputs.dir, SUMMARY_FILE), summary)
  return summary


def _evaluation_splits(data) -> dict:
  """The splits the final evaluation predicts on: test, and ood and shift when
  the task has them (see `tasks.data.FederatedData`)."""
  splits = {"test": data.test, "ood": data.ood, "shift": data.shift}
  return {
    name: split for name, split in splits.items() if split is not None and split.num_examples()
  }


def _uncertainty_summary(config, data, member_probabilities, output_dir: str, teacher=None) -> dict:
  """`metrics.uncertainty_summary` of the run's model(s), whose
  `member_probabilities(split)` are {client: [K, n, classes]}, and of the last
  round's teachers (keys prefixed `teacher_`) for server-distillation
  algorithms; draws `plots.UNCERTAINTY_FIGURE`."""
  splits = _evaluation_splits(data)
  members = {}
  for name, split in splits.items():
    probs = member_probabilities(split)
    members[name] = np.concatenate([probs[c] for c in split.client_ids], axis=1)
  predictions = {name: metrics.predictive_uncertainty(p) for name, p in members.items()}
  labels = {name: split.concatenated()[1] for name, split in splits.items()}
  summary = metrics.uncertainty_summary(
    predictions["test"],
    labels["test"],
    predictions.get("ood"),
    predictions.get("shift"),
    labels.get("shift"),
  )
  plots.uncertainty_figure(
    os.path.join(output_dir, plots.UNCERTAINTY_FIGURE),
    summary["reliability"],
    {
      "test (in-distribution)" if name == "test" else name: p["entropy"]
      for name, p in predictions.items()
    },
    f"{config.algorithm}, {config.task} ({config.classes} classes), "
    f"seed {config.seed}, {config.rounds} rounds",
  )
  if teacher is not None:
    counts = [splits[name].num_examples() for name in splits]
    teacher_predictions = {}
    for name, probs, mean_entropy in zip(
      splits,
      metrics.split_by_client(teacher["probabilities"], counts),
      metrics.split_by_client(teacher["mean_entropy"], counts),
    ):
      entropy = metrics.entropy(probs)
      teacher_predictions[name] = {
        "probabilities": probs,
        "entropy": entropy,
        "mutual_information": entropy - mean_entropy,
      }
    teachers = metrics.uncertainty_summary(
      teacher_predictions["test"],
      labels["test"],
      teacher_predictions.get("ood"),
      teacher_predictions.get("shift"),
      labels.get("shift"),
    )
    summary.update({f"teacher_{k}": v for k, v in teachers.items()})
  return summary


def _privacy_summary(config, rows, num_clients: int) -> dict:
  """DP keys: epsilon at delta after all rounds (None without noise), z, C.

  `dp_clip_norm` is the fixed clip, or the adaptive clip after the last round
  (`dp_clipping` says which).
  """
  clips = [float(r["dp_clip_norm"]) for r in rows if r.get("dp_clip_norm")]
  dp = config.dp_config()
  noised = dp.noise_multiplier > 0
  delta = config.dp_delta(num_clients) if noised else None
  return {
    "dp_epsilon": float(
      privacy.epsilons(
        dp.noise_multiplier, config.clients_per_round, num_clients, config.rounds, delta
      )[-1]
    )
    if noised
    else None,
    "dp_delta": delta,
    "dp_noise_multiplier": dp.noise_multiplier,
    "dp_clip_norm": clips[-1] if dp.adaptive and clips else dp.clip_norm,
    "dp_clipping": "adaptive" if dp.adaptive else "fixed",
  }


def _server_distillation_summary(data, rows, summary, teacher_test, server_device: str) -> dict:
  """FedBE/FedDF keys: teacher and student accuracy, server time, device."""
  server_seconds = [float(r["server_seconds"]) for r in rows if r.get("server_seconds")]
  # Throughput over the rounds that distilled (others skip the student).
  distilling = [r for r in rows if float(r.get("distill_examples") or 0)]
  examples = sum(float(r["distill_examples"]) for r in distilling)
  distill_seconds = sum(float(r["server_seconds"]) for r in distilling)
  extra = {
    "distilled_test_accuracy": summary["test_accuracy"],
    "ensemble_test_accuracy": None,
    "server_seconds_per_round": (statistics.median(server_seconds) if server_seconds else None),
    "distill_examples_per_second": (examples / distill_seconds if distill_seconds else None),
    "server_device": server_device,
  }
  if teacher_test is not None:
    counts = [data.test.num_examples(c) for c in data.test.client_ids]
    test_probabilities = teacher_test["probabilities"][: sum(counts)]
    extra["ensemble_test_accuracy"] = metrics.classification_summary(
      dict(zip(data.test.client_ids, metrics.split_by_client(test_probabilities, counts))),
      data.test.y,
    )["test_accuracy"]
  return extra


def _prototype_accuracies(prototypes, split, output_dir: str) -> dict[str, float]:
  """Each prototype's test accuracy; saved as `prototypes/<name>.keras`."""
  os.makedirs(os.path.join(output_dir, "prototypes"), exist_ok=True)
  accuracies = {}
  for name, model_fn, weights in prototypes:
    evaluator = _Evaluator(model_fn)
    accuracies[name] = evaluator.summary([weights], split)["test_accuracy"]
    _save_model(os.path.join(output_dir, "prototypes", f"{name}.keras"), evaluator.model, weights)
  return accuracies


def _save_models(output_dir: str, model: tf.keras.Model, models: list):
  """Saves the final model(s): `model.keras`, or `members/member_k.keras`."""
  if len(models) == 1:
    paths = [os.path.join(output_dir, "model.keras")]
  else:
    os.makedirs(os.path.join(output_dir, "members"), exist_ok=True)
    paths = [os.path.join(output_dir, "members", f"member_{k}.keras") for k in range(len(models))]
  for weights, path in zip(models, paths):
    _save_model(path, model, weights)


def _save_model(path: str, model: tf.keras.Model, weights):
  """Saves `model` with `weights` to `path` (.keras) atomically."""
  evaluation.assign_weights(model, weights)
  tmp = path[: -len(".keras")] + ".tmp.keras"
  model.save(tmp)
  os.replace(tmp, path)
