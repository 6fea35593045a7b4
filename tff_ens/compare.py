r"""Command line: finished runs side by side, in one table and two figures.

  python -m tff_ens.compare runs/fedavg runs/fedensemble runs/fedbe \
      --output=figures

Prints a row per run (`table`: flags, final test metrics, time and bytes per
round, and each run's accuracy difference to the first run, marked when their
seeds differ). With --output, also writes `test_accuracy_by_round.png` (each
run's test accuracy against the round, from metrics.csv) and
`per_writer_accuracy.png` (each run's accuracy on every test writer). A run's
per-writer accuracies are read from its `per_client_accuracy.json` when it has
one; otherwise its saved model(s) are evaluated on its task's test writers,
loaded as the run loaded them (or from --data_dir). Without the data that
figure is skipped with a one-line warning.

A directory that is not a finished run is one `error:` line and exit code 2.
"""

import csv
import dataclasses
import json
import logging as std_logging
import os
import sys
from typing import Sequence

from absl import app
from absl import flags

# TensorFlow's C++ log starts when it is imported (see tff_ens/main.py).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# pylint: disable=g-import-not-at-top
from matplotlib import figure
from matplotlib import ticker
from matplotlib.backends import backend_agg
import numpy as np
import tensorflow as tf

import tasks
from tff_ens import algorithms
from tff_ens import evaluation
from tff_ens import experiment
from tff_ens import metrics
from tff_ens import run_files

ACCURACY_FIGURE = "test_accuracy_by_round.png"
PER_WRITER_FIGURE = "per_writer_accuracy.png"

# Flags that change where or how a run executes, not what it computes; seed
# and rounds have their own columns.
_UNSHOWN_FLAGS = (
  "data_dir",
  "output_dir",
  "eval_every",
  "checkpoint_every",
  "max_concurrent_clients",
  "workers",
  "resume",
  "server_device",
  "device_processes",
  "seed",
  "rounds",
)
_FEDENSEMBLE_FLAGS = (
  "ensemble_size",
  "assignment",
  "member_average",
  "local_objective",
  "feddyn_alpha",
  "personalization_temperature",
)
_DISTILLATION_FLAGS = (
  "server_data",
  "distill_steps",
  "distill_batch_size",
  "swa",
  "fedbe_distribution",
  "fedbe_samples",
  "fedbe_targets",
  "dirichlet_alpha",
  "fedbe_gaussian",
  "fedbe_var_scale",
  "fedbe_var_clamp",
  "fedbe_dirichlet",
  "sharpen_temperature",
  "swa_warmup_fraction",
  "drop_worst",
  "drop_worst_rule",
  "prototypes",
  "distill_patience",
  "distill_eval_every",
  "distill_min_improvement",
  "distill_keep_initial",
  "distill_clip_norm",
)
_FEDPPD_FLAGS = (
  "student_model",
  "teacher_lr",
  "sgld_temperature",
  "prior_precision",
  "student_lr",
  "student_momentum",
  "student_weight_decay",
  "sgld_scaling",
  "teacher_weight_decay",
  "teacher_step_decay",
  "teacher_step_decay_epochs",
  "teacher_round_decay",
  "student_round_decay",
  "student_minibatch",
  "distill_fedppd_teachers",
)
# Flags only some algorithms read: shown for those only.
_ALGORITHM_FLAGS = {
  "proximal_mu": ("fedprox", "fedensemble"),
  "server_momentum": ("fedavgm",),
  **dict.fromkeys(_FEDENSEMBLE_FLAGS, ("fedensemble",)),
  **dict.fromkeys(_DISTILLATION_FLAGS, algorithms.SERVER_DATA_ALGORITHMS),
  **dict.fromkeys(_FEDPPD_FLAGS, algorithms.FEDPPD_METHODS),
}
# Flags that define an algorithm's variant: shown even at their default.
_VARIANT_FLAGS = {"fedensemble": ("ensemble_size", "local_objective"), "fedbe": ("fedbe_targets",)}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(experiment.ExperimentConfig)}

# The table's columns (see `table_rows`); text is aligned left, numbers right.
_HEADER = (
  "#",
  "run",
  "algorithm",
  "flags",
  "seed",
  "rounds",
  "accuracy",
  "vs #1",
  "NLL",
  "ECE",
  "per-client",
  "personalized",
  "s/round",
  "MB down/up",
)
_LEFT = ("run", "algorithm", "flags")
# Marks an accuracy difference between runs of different seeds.
SEED_DIFFERS = "*"
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

  def experiment_config(self) -> experiment.ExperimentConfig:
    """The run's flags; a flag unknown to this version is left out."""
    return experiment.ExperimentConfig(**{k: v for k, v in self.config.items() if k in _DEFAULTS})

  def key_flags(self) -> str:
    """ "k=v ..." of the flags that define the run beyond its algorithm, seed
    and rounds: those that differ from their default and that its algorithm
    reads, and those naming its variant (e.g. Fed-ensemble's K)."""
    algorithm = self.config["algorithm"]
    variant = _VARIANT_FLAGS.get(algorithm, ())
    # In the order of `ExperimentConfig`, then flags it does not know.
    order = list(_DEFAULTS) + sorted(set(self.config) - set(_DEFAULTS))
    return " ".join(
      f"{k}={self.config[k]}"
      for k in order
      if k in self.config
      and k not in _UNSHOWN_FLAGS
      and k != "algorithm"
      and algorithm in _ALGORITHM_FLAGS.get(k, (algorithm,))
      and (k in variant or k not in _DEFAULTS or self.config[k] != _DEFAULTS[k])
    )

  def test_accuracy_by_round(self) -> tuple[list[int], list[float]]:
    """(rounds, test accuracies) of the metrics.csv rows that evaluated."""
    evaluated = [r for r in self.metrics if r.get("test_accuracy")]
    return ([int(r["round"]) for r in evaluated], [float(r["test_accuracy"]) for r in evaluated])

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


def _read_json(path: str):
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
  config = _read_json(config_path) if os.path.isfile(config_path) else {}
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
  summary = _read_json(summary_path)
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


def table_rows(runs: Sequence[Run]) -> list[dict]:
  """The table's values, one dict per run (None where a run has no value).

  `accuracy_difference` is the test accuracy minus the first run's (None for
  the first); `seed_differs` says the two runs' seeds differ, so that the
  difference is not a paired one.
  """
  reference = runs[0].summary
  rows = []
  for index, run in enumerate(runs, 1):
    summary = run.summary
    first = index == 1
    rows.append(
      {
        "index": index,
        "run": run.name,
        "algorithm": run.config["algorithm"],
        "flags": run.key_flags(),
        "seed": summary["seed"],
        "rounds": summary["rounds"],
        "test_accuracy": summary["test_accuracy"],
        "accuracy_difference": None
        if first
        else (summary["test_accuracy"] - reference["test_accuracy"]),
        "seed_differs": not first and summary["seed"] != reference["seed"],
        "test_loss": summary.get("test_loss"),
        "ece": summary.get("ece"),
        "per_client_accuracy": summary.get("per_client_accuracy"),
        "personalized_accuracy": summary.get("personalized_accuracy"),
        "seconds_per_round": summary.get("seconds_per_round"),
        "bytes_down": summary.get("bytes_down_per_client_round"),
        "bytes_up": summary.get("bytes_up_per_client_round"),
      }
    )
  return rows


def _number(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def _megabytes(num_bytes) -> str:
  return _number(None if num_bytes is None else num_bytes / 1e6, ".2f")


def _cells(row: dict) -> list[str]:
  difference = _number(row["accuracy_difference"], "+.4f")
  return [
    str(row["index"]),
    row["run"],
    row["algorithm"],
    row["flags"] or "-",
    str(row["seed"]),
    str(row["rounds"]),
    _number(row["test_accuracy"], ".4f"),
    difference + (SEED_DIFFERS if row["seed_differs"] else ""),
    _number(row["test_loss"], ".4f"),
    _number(row["ece"], ".4f"),
    _number(row["per_client_accuracy"], ".4f"),
    _number(row["personalized_accuracy"], ".4f"),
    _number(row["seconds_per_round"], ".2f"),
    f"{_megabytes(row['bytes_down'])}/{_megabytes(row['bytes_up'])}",
  ]


def table(runs: Sequence[Run]) -> str:
  """The comparison table (see `table_rows`), with a footnote for seeds."""
  rows = table_rows(runs)
  lines = [_HEADER] + [_cells(r) for r in rows]
  widths = [max(len(line[i]) for line in lines) for i in range(len(_HEADER))]
  text = [
    "  ".join(
      cell.ljust(w) if name in _LEFT else cell.rjust(w)
      for name, cell, w in zip(_HEADER, line, widths)
    ).rstrip()
    for line in lines
  ]
  if any(r["seed_differs"] for r in rows):
    text.append(
      f"{SEED_DIFFERS} seed differs from #1's ({rows[0]['seed']}): the "
      "difference mixes seed-to-seed variation with the runs' own; it is "
      "not a paired comparison."
    )
  return "\n".join(text)


def _label(index: int, run: Run) -> str:
  return " ".join(
    filter(
      None,
      (
        f"#{index} {run.name}: {run.config['algorithm']}",
        run.key_flags(),
        f"(seed {run.summary['seed']})",
      ),
    )
  )


def _new_figure(width: float, height: float) -> figure.Figure:
  fig = figure.Figure(figsize=(width, height), layout="constrained")
  backend_agg.FigureCanvasAgg(fig)
  return fig


def plot_accuracy(runs: Sequence[Run], path: str) -> None:
  """Writes each run's test accuracy against the round to `path` (PNG)."""
  fig = _new_figure(8, 5)
  axes = fig.add_subplot()
  for index, run in enumerate(runs, 1):
    rounds, accuracies = run.test_accuracy_by_round()
    axes.plot(rounds, accuracies, marker="o", label=_label(index, run))
  axes.set_xlabel("round")
  axes.set_ylabel("test accuracy")
  axes.set_title("Test accuracy by round")
  axes.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  axes.grid(alpha=0.3)
  axes.legend(fontsize="small")
  fig.savefig(path, dpi=120)


def writer_accuracies(models: Sequence[tf.keras.Model], split) -> dict[str, float]:
  """writer -> accuracy of the uniform average of `models`' probabilities."""
  x, _ = split.concatenated()
  probs = np.mean([evaluation.predict_probabilities(m, x) for m in models], axis=0)
  counts = [split.num_examples(c) for c in split.client_ids]
  return {
    c: metrics.accuracy(p, split.y[c])
    for c, p in zip(split.client_ids, metrics.split_by_client(probs, counts))
    if len(split.y[c])
  }


def load_models(run: Run) -> list[tf.keras.Model]:
  models = []
  for path in run.model_paths():
    try:
      models.append(tf.keras.models.load_model(path, compile=False))
    except (OSError, ValueError) as e:
      raise CompareError(
        f"{path} cannot be loaded ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
      ) from None
  return models


def _read_accuracies(path: str) -> dict[str, float]:
  """A `per_client_accuracy.json`: a JSON object, writer -> accuracy."""
  accuracies = _read_json(path)
  if not (
    isinstance(accuracies, dict) and all(isinstance(a, (int, float)) for a in accuracies.values())
  ):
    raise CompareError(f"{path} is not a JSON object of writer -> accuracy")
  return {c: float(a) for c, a in accuracies.items()}


def per_writer_accuracies(
  runs: Sequence[Run], data_dir: str | None = None
) -> list[dict[str, float]]:
  """Each run's accuracy on every test writer (writer -> accuracy).

  From the run's `per_client_accuracy.json` if it has one, else from its
  model(s) on its task's test split, loaded from `data_dir` or the run's
  own data directory (once for runs that load the same data).

  Raises:
    tasks.DataError: if a run's data cannot be loaded.
    CompareError: if a run's model cannot.
  """
  loaded = {}
  accuracies = []
  for run in runs:
    saved = os.path.join(run.path, run_files.PER_CLIENT_ACCURACY_FILE)
    if os.path.isfile(saved):
      accuracies.append(_read_accuracies(saved))
      continue
    config = run.experiment_config()
    task = config.task_module()
    key = (task, data_dir or config.data_dir, config.partition_config(), config.seed)
    if key not in loaded:
      loaded[key] = task.load_data(key[1], partition=key[2], seed=config.seed).test
    accuracies.append(writer_accuracies(load_models(run), loaded[key]))
  return accuracies


def plot_per_writer(runs: Sequence[Run], path: str, data_dir: str | None = None) -> None:
  """Writes the distribution of each run's per-writer accuracy to `path`.

  See `per_writer_accuracies` for where they come from and what it raises.
  """
  accuracies = [list(a.values()) for a in per_writer_accuracies(runs, data_dir)]
  fig = _new_figure(max(6, 2 + 1.6 * len(runs)), 5)
  axes = fig.add_subplot()
  positions = np.arange(1, len(runs) + 1)
  axes.boxplot(
    accuracies,
    positions=positions,
    widths=0.5,
    showmeans=True,
    showfliers=False,
    medianprops={"color": "black"},
    meanprops={"marker": "D", "markerfacecolor": "white", "markeredgecolor": "black"},
  )
  jitter = np.random.default_rng(0)
  for position, values in zip(positions, accuracies):
    axes.scatter(
      position + jitter.uniform(-0.18, 0.18, len(values)), values, s=10, alpha=0.45, zorder=3
    )
  axes.set_xticks(
    positions,
    [
      f"#{i} {run.name}\n{run.config['algorithm']}, seed "
      f"{run.summary['seed']}\n{len(values)} writers"
      for i, (run, values) in enumerate(zip(runs, accuracies), 1)
    ],
  )
  axes.set_ylabel("test accuracy of one writer")
  axes.set_title(
    "Accuracy per test writer\nbox: quartiles, line: median, diamond: mean (per-client accuracy)",
    fontsize="medium",
  )
  axes.grid(axis="y", alpha=0.3)
  fig.savefig(path, dpi=120)


FLAGS = flags.FLAGS


def define_flags():
  """The command's flags, defined only when it runs (as export.evaluate's):
  importing this module defines none, so none clashes with tff_ens.main's."""
  flags.DEFINE_string(
    "output", None, "Directory for the figures; without it, only the table is printed."
  )
  flags.DEFINE_string(
    "data_dir", None, "Task data for the per-writer figure; default: each run's --data_dir."
  )


def main(argv):
  std_logging.getLogger("tensorflow").setLevel(std_logging.ERROR)
  try:
    if len(argv) < 2:
      raise CompareError(
        "no run given: python -m tff_ens.compare RUN_DIR [RUN_DIR ...] [--output=DIR]"
      )
    runs = [load_run(path) for path in argv[1:]]
    if FLAGS.output:
      try:
        os.makedirs(FLAGS.output, exist_ok=True)
      except OSError as e:
        raise CompareError(
          f"cannot create --output={FLAGS.output} ({e.strerror}): choose a writable directory"
        ) from None
  except CompareError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(table(runs))
  if not FLAGS.output:
    return 0
  accuracy_path = os.path.join(FLAGS.output, ACCURACY_FIGURE)
  plot_accuracy(runs, accuracy_path)
  print(f"wrote {accuracy_path}")
  per_writer_path = os.path.join(FLAGS.output, PER_WRITER_FIGURE)
  try:
    plot_per_writer(runs, per_writer_path, FLAGS.data_dir)
  except (CompareError, tasks.DataError) as e:
    print(f"warning: {PER_WRITER_FIGURE} skipped: {' '.join(str(e).split())}", file=sys.stderr)
  else:
    print(f"wrote {per_writer_path}")
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
