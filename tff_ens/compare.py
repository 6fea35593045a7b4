r"""Command line: finished runs side by side, in one table and two figures.

  python -m tff_ens.compare runs/fedavg runs/fedensemble runs/fedbe \
      --output=figures

Prints a row per run (`table`: flags, final test metrics, time and bytes per
round, and each run's accuracy difference to the first run, marked when their
seeds differ). Runs that differ only in their seed are also summarized over their seeds
(`seed_table`: mean ± standard deviation, and the per-client accuracy's difference to the
first configuration paired by seed). With --output, also writes `test_accuracy_by_round.png` (each
run's test accuracy against the round, from metrics.csv, and dashed its teachers' where FedBE's
or FedDF's server step measured them) and
`per_writer_accuracy.png` (each run's accuracy on every test writer). A run's
per-writer accuracies are read from its `per_client_accuracy.json` when it has
one; otherwise its saved model(s) are evaluated on its task's test writers,
loaded as the run loaded them (or from --data_dir). Without the data that
figure is skipped with a one-line warning.

A directory that is not a finished run is one `error:` line and exit code 2.
"""

import logging as std_logging
import os
import sys
import textwrap
from typing import Sequence

from absl import app
from absl import flags

from tff_ens.execution import cpp_log

cpp_log.quiet_unless_verbose(sys.argv)  # Before TensorFlow's import (see tff_ens/main.py).

from matplotlib import figure
from matplotlib import ticker
from matplotlib.backends import backend_agg
import numpy as np
import tensorflow as tf

import tasks
from tff_ens import run_files
from tff_ens.math import evaluation
from tff_ens.math import metrics
from tff_ens.program import experiment
from tff_ens.program import finished_runs

ACCURACY_FIGURE = "test_accuracy_by_round.png"
PER_WRITER_FIGURE = "per_writer_accuracy.png"

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


def table_rows(runs: Sequence[finished_runs.Run]) -> list[dict]:
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


def _aligned(header: Sequence[str], cells: list[list[str]]) -> list[str]:
  """The header and the rows' cells in columns: text left, numbers right."""
  lines = [list(header)] + cells
  widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
  return [
    "  ".join(
      cell.ljust(w) if name in _LEFT else cell.rjust(w)
      for name, cell, w in zip(header, line, widths)
    ).rstrip()
    for line in lines
  ]


def table(runs: Sequence[finished_runs.Run]) -> str:
  """The comparison table (see `table_rows`), with a footnote for seeds."""
  rows = table_rows(runs)
  text = _aligned(_HEADER, [_cells(r) for r in rows])
  if any(r["seed_differs"] for r in rows):
    text.append(
      f"{SEED_DIFFERS} seed differs from #1's ({rows[0]['seed']}): the "
      "difference mixes seed-to-seed variation with the runs' own; it is "
      "not a paired comparison."
    )
  return "\n".join(text)


_SEEDS_HEADER = (
  "#",
  "algorithm",
  "flags",
  "rounds",
  "seeds",
  "accuracy",
  "per-client",
  "personalized",
  "per-client vs #1",
  "personalized vs #1",
)


def seed_groups(runs: Sequence[finished_runs.Run]) -> list[list[finished_runs.Run]]:
  """The runs grouped by all they compute but the seed (algorithm, flags, rounds), in the
  order in which each group first appears."""
  groups = {}
  for run in runs:
    key = (run.config["algorithm"], run.key_flags(), run.summary["rounds"])
    groups.setdefault(key, []).append(run)
  return list(groups.values())


def _mean_std(values: Sequence[float | None]) -> tuple[float, float | None] | None:
  """Mean and sample standard deviation (None for one value) of `values`; None if any
  value is missing."""
  if not values or any(v is None for v in values):
    return None
  return float(np.mean(values)), (float(np.std(values, ddof=1)) if len(values) > 1 else None)


def seed_table_rows(runs: Sequence[finished_runs.Run]) -> list[dict]:
  """One row per group of `seed_groups`: its seeds and the mean and standard deviation over
  them of the test accuracy, the per-client (averaged over writers) and the personalized
  accuracy; `per_client_difference` and `personalized_difference`: the same of its
  per-client and personalized accuracy minus the first group's per-client accuracy, paired
  by seed over the seeds both have (None for the first group, or without a shared seed)."""
  groups = seed_groups(runs)
  reference = {r.summary["seed"]: r.summary.get("per_client_accuracy") for r in groups[0]}

  def paired(summaries, key):
    return _mean_std(
      [
        s[key] - reference[s["seed"]]
        for s in summaries
        if reference.get(s["seed"]) is not None and s.get(key) is not None
      ]
    )

  rows = []
  for index, group in enumerate(groups, 1):
    summaries = [r.summary for r in group]
    rows.append(
      {
        "index": index,
        "algorithm": group[0].config["algorithm"],
        "flags": group[0].key_flags(),
        "rounds": group[0].summary["rounds"],
        "seeds": [s["seed"] for s in summaries],
        "test_accuracy": _mean_std([s["test_accuracy"] for s in summaries]),
        "per_client_accuracy": _mean_std([s.get("per_client_accuracy") for s in summaries]),
        "personalized_accuracy": _mean_std([s.get("personalized_accuracy") for s in summaries]),
        "per_client_difference": None if index == 1 else paired(summaries, "per_client_accuracy"),
        "personalized_difference": (
          None if index == 1 else paired(summaries, "personalized_accuracy")
        ),
      }
    )
  return rows


def _mean_std_cell(value, spec: str = ".4f") -> str:
  if value is None:
    return "-"
  mean, std = value
  return format(mean, spec) + ("" if std is None else f" ± {format(std, '.4f')}")


def seed_table(runs: Sequence[finished_runs.Run]) -> str:
  """The runs' mean ± standard deviation over seeds (see `seed_table_rows`)."""
  rows = seed_table_rows(runs)
  text = _aligned(
    _SEEDS_HEADER,
    [
      [
        str(r["index"]),
        r["algorithm"],
        r["flags"] or "-",
        str(r["rounds"]),
        ",".join(str(seed) for seed in r["seeds"]),
        _mean_std_cell(r["test_accuracy"]),
        _mean_std_cell(r["per_client_accuracy"]),
        _mean_std_cell(r["personalized_accuracy"]),
        _mean_std_cell(r["per_client_difference"], "+.4f"),
        _mean_std_cell(r["personalized_difference"], "+.4f"),
      ]
      for r in rows
    ],
  )
  text.append(
    "mean ± standard deviation over the seeds; vs #1: the per-client or personalized "
    "accuracy minus #1's per-client accuracy of the same seed, over the seeds both have."
  )
  return "\n".join(text)


def accuracy_labels(runs: Sequence[finished_runs.Run]) -> tuple[list[str], list[str]]:
  """(the "k=v" key flags every run has, each run's legend entry: its name, algorithm, the
  key flags of its own and its seed) of the accuracy figure."""
  flags_of = [run.key_flags().split() for run in runs]
  shared = [flag for flag in flags_of[0] if all(flag in f for f in flags_of[1:])]
  labels = [
    " ".join(
      [
        f"#{index} {run.name}: {run.config['algorithm']}",
        *(flag for flag in own if flag not in shared),
        f"(seed {run.summary['seed']})",
      ]
    )
    for index, (run, own) in enumerate(zip(runs, flags_of), 1)
  ]
  return shared, labels


def _new_figure(width: float, height: float) -> figure.Figure:
  fig = figure.Figure(figsize=(width, height), layout="constrained")
  backend_agg.FigureCanvasAgg(fig)
  return fig


def plot_accuracy(runs: Sequence[finished_runs.Run], path: str) -> None:
  """Writes each run's test accuracy against the round to `path` (PNG), and dashed in
  the same color its teachers' where the server step has teachers (FedBE, FedDF)."""
  fig = _new_figure(8, 5)
  axes = fig.add_subplot()
  shared, labels = accuracy_labels(runs)
  for index, (run, label) in enumerate(zip(runs, labels), 1):
    rounds, accuracies = run.accuracy_by_round()
    (line,) = axes.plot(rounds, accuracies, marker="o", label=label)
    rounds, accuracies = run.accuracy_by_round("teachers_test_accuracy")
    if rounds:
      axes.plot(
        rounds,
        accuracies,
        linestyle="--",
        marker="x",
        color=line.get_color(),
        label=f"#{index} {run.name}: its teachers",
      )
  axes.set_xlabel("round")
  axes.set_ylabel("test accuracy")
  axes.set_title(
    "\n".join(["Test accuracy by round", *textwrap.wrap(" ".join(shared), 100)]),
    fontsize="medium",
  )
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


def _read_accuracies(path: str) -> dict[str, float]:
  """A `per_client_accuracy.json`: a JSON object, writer -> accuracy."""
  accuracies = finished_runs.read_json(path)
  if not (
    isinstance(accuracies, dict) and all(isinstance(a, (int, float)) for a in accuracies.values())
  ):
    raise finished_runs.CompareError(f"{path} is not a JSON object of writer -> accuracy")
  return {c: float(a) for c, a in accuracies.items()}


def per_writer_accuracies(
  runs: Sequence[finished_runs.Run], data_dir: str | None = None
) -> list[dict[str, float]]:
  """Each run's accuracy on every test writer (writer -> accuracy).

  From the run's `per_client_accuracy.json` if it has one, else from its
  model(s) on its task's test split, loaded from `data_dir` or the run's
  own data directory (once for runs that load the same data).

  Raises:
    tasks.DataError: if a run's data cannot be loaded.
    finished_runs.CompareError: if a run's model cannot.
  """
  loaded = {}
  accuracies = []
  for run in runs:
    saved = os.path.join(run.path, run_files.PER_CLIENT_ACCURACY_FILE)
    if os.path.isfile(saved):
      accuracies.append(_read_accuracies(saved))
      continue
    try:
      resolved = experiment.resolve(run.experiment_config())
    except experiment.UsageError as e:
      raise finished_runs.CompareError(
        f"{run.path}: this version cannot load its data ({e})"
      ) from None
    key = (
      resolved.task,
      data_dir or resolved.data_dir,
      resolved.partition,
      repr(resolved.task_config),
      resolved.seed,
    )
    if key not in loaded:
      loaded[key] = resolved.load_data(data_dir).test
    accuracies.append(writer_accuracies(finished_runs.load_models(run), loaded[key]))
  return accuracies


def plot_per_writer(
  runs: Sequence[finished_runs.Run], path: str, data_dir: str | None = None
) -> None:
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
      raise finished_runs.CompareError(
        "no run given: python -m tff_ens.compare RUN_DIR [RUN_DIR ...] [--output=DIR]"
      )
    runs = [finished_runs.load_run(path) for path in argv[1:]]
    if FLAGS.output:
      try:
        os.makedirs(FLAGS.output, exist_ok=True)
      except OSError as e:
        raise finished_runs.CompareError(
          f"cannot create --output={FLAGS.output} ({e.strerror}): choose a writable directory"
        ) from None
  except finished_runs.CompareError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(table(runs))
  if any(len(group) > 1 for group in seed_groups(runs)):
    print()
    print(seed_table(runs))
  if not FLAGS.output:
    return 0
  accuracy_path = os.path.join(FLAGS.output, ACCURACY_FIGURE)
  plot_accuracy(runs, accuracy_path)
  print(f"wrote {accuracy_path}")
  per_writer_path = os.path.join(FLAGS.output, PER_WRITER_FIGURE)
  try:
    plot_per_writer(runs, per_writer_path, FLAGS.data_dir)
  except (finished_runs.CompareError, tasks.DataError) as e:
    print(f"warning: {PER_WRITER_FIGURE} skipped: {' '.join(str(e).split())}", file=sys.stderr)
  else:
    print(f"wrote {per_writer_path}")
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
