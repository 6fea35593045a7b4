r"""The local worker isolated against open: CLI round time and results, side by side.

  uv run python benchmarks/worker_isolation.py [--rounds=20] [--passes=2] \
      [--variants=fedavg,fedensemble:5]

Runs `python -m tff_ens.main --task=femnist` as a user does (seed 0, 10 clients a round,
1 epoch, batch 20, LEAF CNN) with `--local_worker=open` (TFF's worker on a TCP port of all
interfaces, how every run started it before) and `--local_worker=isolated` (the default: the
worker in a network namespace of its own, reached through a Unix-domain socket that the
launcher bridges to it, `worker_process.start_worker`), the runs in turn (open, isolated,
isolated, open, ... per variant and pass) so that slow periods of a shared machine fall on
both. Reads the `seconds` of every round from each run's `metrics.csv` (evaluation and
checkpoints run only at the last round), and checks that the two runs of a pass wrote the
same metrics.csv but for `seconds` and the same `summary.json` numbers, to the last digit.
"""

import csv
import json
import os
import statistics
import subprocess
import tempfile

from absl import app
from absl import flags

import report

SECTION = "## The local worker isolated in a network namespace"
ISOLATIONS = ("open", "isolated")

report.define_flags()
flags.DEFINE_integer("rounds", 20, "Rounds of each run.")
flags.DEFINE_integer("passes", 2, "Pairs of runs of each variant.")
flags.DEFINE_list("variants", ["fedavg", "fedensemble:5"], "ALGORITHM[:K[:OBJECTIVE]] of each run.")

FLAGS = flags.FLAGS


def run_cli(variant: str, isolation: str, output_dir: str) -> tuple[list[float], list, dict]:
  """Runs the CLI; the `seconds` of each round, the other metrics.csv columns of each round,
  and summary.json's numbers but its times."""
  command = report.cli_command(
    variant,
    FLAGS.rounds,
    output_dir,
    f"--eval_every={FLAGS.rounds}",
    f"--checkpoint_every={FLAGS.rounds}",
    f"--local_worker={isolation}",
  )
  with open(output_dir + ".log", "w") as log:
    subprocess.run(command, cwd=report.REPO_ROOT, stdout=log, stderr=log, check=True)
  with open(os.path.join(output_dir, "metrics.csv")) as f:
    rows = list(csv.DictReader(f))
  with open(os.path.join(output_dir, "summary.json")) as f:
    summary = json.load(f)
  numbers = {
    k: v
    for k, v in summary.items()
    if isinstance(v, (int, float)) and "seconds" not in k and "per_second" not in k
  }
  seconds = [float(row.pop("seconds")) for row in rows]
  return seconds, rows, numbers


def main(argv):
  run = report.start(argv)
  seconds = {(v, i): [] for v in FLAGS.variants for i in ISOLATIONS}
  identical = {v: True for v in FLAGS.variants}
  with tempfile.TemporaryDirectory() as tmp:
    for p in range(FLAGS.passes):
      for variant in FLAGS.variants:
        order = ISOLATIONS if p % 2 == 0 else ISOLATIONS[::-1]
        results = {}
        for isolation in order:
          directory = os.path.join(tmp, f"{variant}_{isolation}_{p}".replace(":", "_"))
          results[isolation] = run_cli(variant, isolation, directory)
          seconds[variant, isolation] += results[isolation][0]
          print(
            f"pass {p + 1}, {variant}, {isolation}: median "
            f"{statistics.median(results[isolation][0]):.3f} s/round",
            flush=True,
          )
        open_run, isolated_run = (results[i][1:] for i in ISOLATIONS)
        identical[variant] &= open_run == isolated_run
  lines = [
    SECTION,
    "",
    f"`python -m tff_ens.main --task=femnist --rounds={FLAGS.rounds} --local_worker=open` "
    "against `--local_worker=isolated` (the default), seed 0, 10 clients a round, 1 epoch, "
    f"batch 20, LEAF CNN, {FLAGS.passes} pairs of runs of each variant in turn (ABBA); the "
    "median of the `seconds` of every round in `metrics.csv` over the runs, and the "
    'isolated/open ratio; "identical": every other metrics.csv column of every round and '
    "every number of summary.json but its times are the same text in both runs of each pair.",
    "",
    *report.run_facts(run, "benchmarks/worker_isolation.py"),
    "",
    "| variant | open: median s/round | isolated: median s/round | ratio | mean open | "
    "mean isolated | ratio | identical |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
  ]
  for variant in FLAGS.variants:
    medians = [statistics.median(seconds[variant, i]) for i in ISOLATIONS]
    means = [statistics.mean(seconds[variant, i]) for i in ISOLATIONS]
    lines.append(
      f"| {variant} | {medians[0]:.3f} | {medians[1]:.3f} | {medians[1] / medians[0]:.3f} | "
      f"{means[0]:.3f} | {means[1]:.3f} | {means[1] / means[0]:.3f} | "
      f"{'yes' if identical[variant] else 'NO'} |"
    )
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
