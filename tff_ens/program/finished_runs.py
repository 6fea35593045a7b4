"""A finished run's directory as `tff_ens.compare` reads it (`load_run`, `Run`).

A run of `python -m tff_ens.main` is its `summary.json` (with the config), its
`metrics.csv` and its saved model(s). `Run.key_flags` names the flags that set it apart
from the defaults, for the flags its algorithm reads. A directory that is not a finished
run is a `CompareError` naming the fix.
"""

import csv
import dataclasses
import json
import os
from typing import Sequence

import tensorflow as tf

from tff_ens import algorithms
from tff_ens import run_files
from tff_ens.program import experiment

# Flags that change where or how a run executes, not what it computes; seed
# and rounds have their own columns.
_UNSHOWN_FLAGS = (
  "data_dir",
  "output_dir",
  "eval_every",
  "checkpoint_every",
  "max_concurrent_clients",
  "clients_per_chunk",
  "worker_growth_mib",
  "workers",
  "worker_credentials",
  "local_worker",
  "resume",
  "server_device",
  "device_processes",
  "browser_clients",
  "stop_grace_seconds",
  "seed",
  "rounds",
)
# What every run's summary.json holds (`config` with its algorithm).
_SUMMARY_KEYS = ("config", "seed", "rounds", "test_accuracy")


class CompareError(ValueError):
  """A run directory that cannot be compared; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Run:
  """A finished run directory of `python -m tff_ens.main`.

  Attributes:
    path: the directory.
    summary: its summary.json; `summary["config"]` holds the run's flags.
    metrics: its metrics.csv, a row (column -> text) per round.
  """

  path: str
  summary: dict
  metrics: list[dict[str, str]]

  @property
  def name(self) -> str:
    return os.path.basename(os.path.normpath(self.path))

  @property
  def config(self) -> dict:
    return experiment.saved_config(self.summary["config"])

  def experiment_config(self):
    """The run's flags (`experiment.config_of`)."""
    return experiment.config_of(self.config)

  def key_flags(self) -> str:
    """ "k=v ..." of the flags that define the run beyond its algorithm, seed
    and rounds: those that differ from their default and that its algorithm
    reads, and those naming its variant (e.g. Fed-ensemble's K)."""
    algorithm = self.config["algorithm"]
    spec = algorithms.REGISTRY.get(algorithm)
    variant = spec.variant_flags if spec is not None else ()
    # A flag this version does not know, or of an algorithm it does not know, is shown.
    known = experiment.FLAG_DEFAULTS
    read = experiment.flags_read(algorithm, self.config.get("task")) if spec else set(known)
    # In the order of `ExperimentConfig`, then flags it does not know.
    order = list(known) + sorted(set(self.config) - set(known))
    defaults = experiment.flag_defaults(self.config.get("task"), self.config.get("classes"))
    return " ".join(
      f"{k}={self.config[k]}"
      for k in order
      if k in self.config
      and k not in _UNSHOWN_FLAGS
      and k != "algorithm"
      and (k in read or k not in known)
      and (k in variant or k not in defaults or self.config[k] != defaults[k])
    )

  def accuracy_by_round(self, key: str = "test_accuracy") -> tuple[list[int], list[float]]:
    """(rounds, values) of the metrics.csv rows that measured `key` (the model's test
    accuracy; FedBE's, FedDF's teachers': teachers_test_accuracy)."""
    evaluated = [r for r in self.metrics if r.get(key)]
    return ([int(r["round"]) for r in evaluated], [float(r[key]) for r in evaluated])

  def model_paths(self) -> list[str]:
    """`model.keras`, or the ensemble's `members/member_k.keras` in order."""
    members_dir = os.path.join(self.path, run_files.MEMBERS_DIR)
    numbered = sorted(
      (int(m.group(1)), os.path.join(members_dir, m.group(0)))
      for name in (os.listdir(members_dir) if os.path.isdir(members_dir) else ())
      if (m := run_files.MEMBER_FILE_PATTERN.fullmatch(name))
    )
    if numbered:
      return [path for _, path in numbered]
    single = os.path.join(self.path, run_files.MODEL_FILE)
    if not os.path.isfile(single):
      raise CompareError(
        f"{self.path} has no {run_files.MODEL_FILE} or "
        f"{run_files.MEMBERS_DIR}/member_k.keras to evaluate"
      )
    return [single]


def read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise CompareError(
      f"{path} cannot be read ({type(e).__name__}: {' '.join(str(e).split())})"
    ) from None


def _read_metrics(path: str) -> list[dict[str, str]]:
  try:
    with open(path, newline="") as f:
      rows = list(csv.DictReader(f))
    for row in rows:
      int(row["round"])
  except (OSError, ValueError, KeyError, TypeError, csv.Error) as e:
    raise CompareError(
      f"{path} is not a run's metrics ({type(e).__name__}: {' '.join(str(e).split())})"
    ) from None
  return rows


def _ranges(numbers: Sequence[int]) -> str:
  """1, 2, 3, 5 -> "1-3, 5"."""
  spans = []
  for n in sorted(numbers):
    if spans and n == spans[-1][1] + 1:
      spans[-1][1] = n
    else:
      spans.append([n, n])
  return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _in_progress_error(path: str, metrics_path: str) -> CompareError:
  """The error for a run with metrics.csv but no summary.json yet."""
  rounds = [int(r["round"]) for r in _read_metrics(metrics_path)]
  config_path = os.path.join(path, run_files.CONFIG_FILE)
  config = read_json(config_path) if os.path.isfile(config_path) else {}
  total = config.get("rounds") if isinstance(config, dict) else None
  done = (
    f"has round{'s' if len(rounds) > 1 else ''} {_ranges(rounds)}" if rounds else "has no round yet"
  )
  return CompareError(
    f"{path} is a run in progress (or stopped): its {run_files.METRICS_FILE} "
    f"{done}{f' of {total}' if total else ''} and it has no "
    f"{run_files.SUMMARY_FILE} yet: compare it when it has finished (a "
    "stopped run continues with --resume)"
  )


def load_run(path: str) -> Run:
  """Reads a finished run; CompareError (one line) if `path` is not one."""
  if not os.path.exists(path):
    raise CompareError(
      f"{path} does not exist: pass the --output_dir of a `python -m tff_ens.main` run"
    )
  if not os.path.isdir(path):
    raise CompareError(
      f"{path} is not a directory: pass the --output_dir of a `python -m tff_ens.main` run"
    )
  metrics_path = os.path.join(path, run_files.METRICS_FILE)
  summary_path = os.path.join(path, run_files.SUMMARY_FILE)
  has_metrics, has_summary = (os.path.isfile(metrics_path), os.path.isfile(summary_path))
  if not has_metrics and not has_summary:
    raise CompareError(
      f"{path} is not a run (no {run_files.METRICS_FILE} or "
      f"{run_files.SUMMARY_FILE}): pass the --output_dir of a `python -m "
      "tff_ens.main` run"
    )
  if not has_summary:
    raise _in_progress_error(path, metrics_path)
  if not has_metrics:
    raise CompareError(
      f"{path} has a {run_files.SUMMARY_FILE} but no {run_files.METRICS_FILE}: restore it"
    )
  summary = read_json(summary_path)
  if not (
    isinstance(summary, dict)
    and all(k in summary for k in _SUMMARY_KEYS)
    and isinstance(summary["config"], dict)
    and "algorithm" in summary["config"]
  ):
    raise CompareError(
      f"{summary_path} is not a run's summary (a JSON object with "
      f"{', '.join(_SUMMARY_KEYS)}): restore it or rerun the run"
    )
  return Run(path, summary, _read_metrics(metrics_path))


def load_models(run: Run) -> list[tf.keras.Model]:
  """The run's Keras model(s), in `Run.model_paths` order; CompareError if one cannot load."""
  models = []
  for path in run.model_paths():
    try:
      models.append(tf.keras.models.load_model(path, compile=False))
    except (OSError, ValueError) as e:
      raise CompareError(
        f"{path} cannot be loaded ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
      ) from None
  return models
