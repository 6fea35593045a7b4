r"""Median round time of CLI runs: Fed-ensemble against FedAvg.

  uv run python benchmarks/cli_round_time.py [--rounds=40] [--passes=2] \
      [--variants=fedavg,fedensemble:1,fedensemble:5]

Runs `python -m tff_ens.main --task=femnist` as a user does (seed 0, 10
clients a round, 1 epoch, batch 20, LEAF CNN), once per variant and pass, the
variants in turn (FedAvg, K=1, K=5, FedAvg, ...) so that slow periods of a
shared machine fall on all of them, and reads the `seconds` of every round
from each run's `metrics.csv` (a round: sampling, the clients' datasets and
`next`; evaluation and checkpoints are outside it and run only at the last
round here). The issue's target is the median: at most 1.15x FedAvg's; the
mean also counts the rounds in which `resident_state.ResidentState` uploads the
state again after a download. A variant is `ALGORITHM[:K[:OBJECTIVE]]`, e.g. `fedensemble:5:feddyn`.
`ensemble_round.py` splits the difference into its parts.
"""

import csv
import os
import statistics
import subprocess
import tempfile

from absl import app
from absl import flags

import report

SECTION = "## Fed-ensemble round time in the CLI"

report.define_flags()
flags.DEFINE_integer("rounds", 40, "Rounds of each run.")
flags.DEFINE_integer("passes", 2, "Runs of each variant, in turn.")
flags.DEFINE_list(
  "variants", ["fedavg", "fedensemble:1", "fedensemble:5"], "ALGORITHM[:K[:OBJECTIVE]] of each run."
)

FLAGS = flags.FLAGS


def round_seconds(variant: str, output_dir: str) -> list[float]:
  """Runs the CLI for `variant`; the `seconds` of each of its rounds."""
  command = report.cli_command(
    variant,
    FLAGS.rounds,
    output_dir,
    f"--eval_every={FLAGS.rounds}",
    f"--checkpoint_every={FLAGS.rounds}",
  )
  with open(output_dir + ".log", "w") as log:
    subprocess.run(command, cwd=report.REPO_ROOT, stdout=log, stderr=log, check=True)
  with open(os.path.join(output_dir, "metrics.csv")) as f:
    return [float(row["seconds"]) for row in csv.DictReader(f)]


def main(argv):
  run = report.start(argv)
  seconds = {variant: [] for variant in FLAGS.variants}
  with tempfile.TemporaryDirectory() as tmp:
    for p in range(FLAGS.passes):
      for i, variant in enumerate(FLAGS.variants):
        times = round_seconds(variant, os.path.join(tmp, f"run{p}_{i}"))
        seconds[variant] += times
        print(f"pass {p + 1}, {variant}: median {statistics.median(times):.2f} s/round", flush=True)
  baseline = statistics.median(seconds[FLAGS.variants[0]])
  baseline_mean = statistics.mean(seconds[FLAGS.variants[0]])
  lines = [
    SECTION,
    "",
    f"`python -m tff_ens.main --task=femnist --rounds={FLAGS.rounds}` "
    "(seed 0, 10 clients a round, 1 epoch, batch 20, LEAF CNN), "
    f"{FLAGS.passes} runs of each variant in turn; the median of the "
    "`seconds` of every round in `metrics.csv` over the runs, and its "
    f"ratio to {FLAGS.variants[0]}'s; the same for the mean.",
    "",
    *report.run_facts(run, "benchmarks/cli_round_time.py"),
    "",
    "| variant | flags | median s/round | ratio | median of each run | mean s/round | ratio |",
    "| --- | --- | ---: | ---: | --- | ---: | ---: |",
  ]
  for variant, times in seconds.items():
    per_run = [
      statistics.median(times[r * FLAGS.rounds : (r + 1) * FLAGS.rounds])
      for r in range(FLAGS.passes)
    ]
    median, mean = statistics.median(times), statistics.mean(times)
    lines.append(
      f"| {variant} | `{' '.join(report.variant_flags(variant))}` | "
      f"{median:.2f} | {median / baseline:.2f} | "
      f"{', '.join(f'{t:.2f}' for t in per_run)} | "
      f"{mean:.2f} | {mean / baseline_mean:.2f} |"
    )
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
