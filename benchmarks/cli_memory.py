r"""Peak memory of each algorithm's default CLI run: the driver's and TFF's worker's.

  uv run python benchmarks/cli_memory.py [--rounds=10] [--variants=fedavg,fedppd_distill]
      [--settings=,GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4194304,--worker_growth_mib=0]
      [--data_dir=FULL_SIZE_DIR --cli_flags=--clients_per_round=100 --rounds=20]

Runs `python -m tff_ens.main --task=femnist --rounds=N` as a user does (every
other flag at its default), once per variant (`ALGORITHM[:K[:OBJECTIVE]]`, as
in `cli_round_time.py`; by default every registered algorithm and
FedDyn-ensemble), one run at a time. Every 0.2 s it samples the resident memory
of the driver (the CLI's Python process) and of its children (TFF's worker), and
counts the rounds in `metrics.csv` (`--cli_flags` adds flags to every run: the full-size
FEMNIST's 100-client rounds). It prints each one's peak; the peak of their sum, with the
rounds done then and each one's share; each one after round 5 and after the last round (the
first sample once that round's row is written); the worker's growth between the two, and
each one's peak over the last rounds after round 5 against its peak over as many before
them (`report.peak_growth`; the driver's rise at an evaluation and checkpoint, every 10
rounds by default, falls in both windows: rounds 6-12 and 14-20 of 20); and the median
`seconds` of a round; it logs each one's peak during each round. With `--settings`, each
variant runs once per setting (`NAME=VALUE`: an environment variable, which the worker
inherits; `--FLAG=VALUE`: a flag of the run; empty: neither), one after the other, and the
table gives each run's median round against the variant's first setting. Writes the
section "## Memory of the CLI's default runs" of `--results`.
"""

import csv
import os
import statistics
import tempfile
import threading

from absl import app
from absl import flags
import psutil

import report
from tff_ens import algorithms

SECTION = "## Memory of the CLI's default runs"
GROWTH_FROM = 5  # The round after which growth is measured.

report.define_flags()
flags.DEFINE_integer("rounds", 10, "Rounds of each run.")
flags.DEFINE_list(
  "variants",
  [*algorithms.ALGORITHMS, "fedensemble:5:feddyn"],
  "ALGORITHM[:K[:OBJECTIVE]] of each run.",
)
flags.DEFINE_list(
  "cli_flags",
  [],
  "More flags for every run, e.g. --clients_per_round=100 on a full-size FEMNIST "
  "(benchmarks/full_size_femnist.py) given as --data_dir.",
)
flags.DEFINE_list(
  "settings",
  [""],
  "One run of each variant per entry: NAME=VALUE in its environment, or --FLAG=VALUE a flag "
  "of the run (empty: neither).",
)

FLAGS = flags.FLAGS


def _rows(path: str) -> int:
  """The rounds in the metrics file at `path` so far."""
  try:
    with open(path) as f:
      return max(sum(1 for _ in f) - 1, 0)
  except FileNotFoundError:
    return 0


def _run_setting(setting: str) -> tuple[dict[str, str], list[str]]:
  """The environment and extra flags of a run with `setting` (`NAME=VALUE`, `--FLAG=VALUE`
  or empty)."""
  if not setting:
    return dict(os.environ), []
  name, equals, value = setting.partition("=")
  if not equals or not name.strip("-"):
    raise app.UsageError(f"--settings entry {setting!r} is not NAME=VALUE or --FLAG=VALUE")
  if name.startswith("--"):
    return dict(os.environ), [setting]
  return {**os.environ, name: value}, []


def measure(variant: str, output_dir: str, environment: dict[str, str], extra: list[str]) -> dict:
  """Runs the CLI for `variant` with the `extra` flags in `environment`, sampling its memory;
  the peaks (bytes), the memory after each round (`after[r] = (driver, worker)`), each one's
  peak during each round (`during[r] = (driver, worker)`) and the seconds of each round."""
  command = report.cli_command(variant, FLAGS.rounds, output_dir, *FLAGS.cli_flags, *extra)
  metrics = os.path.join(output_dir, "metrics.csv")
  result = dict(driver=0, worker=0, total=0, total_at=(0, 0, 0), after={}, during={})
  with open(output_dir + ".log", "w") as log:
    driver = psutil.Popen(command, cwd=report.REPO_ROOT, stdout=log, stderr=log, env=environment)
    done = threading.Event()

    def sample():
      while not done.wait(0.2):
        try:
          own = driver.memory_info().rss
          worker = sum(c.memory_info().rss for c in driver.children(recursive=True))
        except psutil.Error:
          continue
        rounds_done = _rows(metrics)
        result["driver"] = max(result["driver"], own)
        result["worker"] = max(result["worker"], worker)
        if own + worker > result["total"]:
          result["total"] = own + worker
          result["total_at"] = (rounds_done, worker, own)
        result["after"].setdefault(rounds_done, (own, worker))
        peaks = result["during"].get(rounds_done + 1, (0, 0))
        result["during"][rounds_done + 1] = (max(peaks[0], own), max(peaks[1], worker))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = driver.wait()
    done.set()
    sampler.join()
  if code:
    with open(output_dir + ".log") as log:  # Its directory goes with the benchmark.
      last = [line for line in log.read().splitlines() if line.strip()][-1:] or ["(empty)"]
    raise SystemExit(f"{variant}: the run failed (exit {code}): {last[0]}")
  with open(metrics) as f:
    result["seconds"] = [float(row["seconds"]) for row in csv.DictReader(f)]
  return result


def main(argv):
  run = report.start(argv)
  gib = lambda b: f"{b / 2**30:.2f}"
  # Parsed once, so a bad entry fails before the first run.
  settings = [(setting, *_run_setting(setting)) for setting in FLAGS.settings]
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for i, variant in enumerate(FLAGS.variants):
      for j, (setting, environment, extra) in enumerate(settings):
        m = measure(variant, os.path.join(tmp, f"run{i}_{j}"), environment, extra)
        after = m["after"]
        last = after.get(FLAGS.rounds, (0, 0))
        mid = after.get(min(GROWTH_FROM, FLAGS.rounds), (0, 0))
        growth = f"{100 * (last[1] / mid[1] - 1):+.0f}%" if mid[1] and last[1] else "-"
        peak_growth = {}
        for index, process in enumerate(("driver", "worker")):
          during = {r: peaks[index] for r, peaks in m["during"].items()}
          peak_growth[process] = report.peak_growth(during, GROWTH_FROM, FLAGS.rounds)
          print(
            f"{variant} {setting}: {process} peak GiB during each round: "
            + ", ".join(f"{r}: {gib(b)}" for r, b in sorted(during.items()) if r <= FLAGS.rounds),
            flush=True,
          )
        median = statistics.median(m["seconds"])
        if j == 0:
          first_median = median  # The ratio's base: the variant's first setting.
        rows.append(
          f"| {variant} | `{' '.join(report.variant_flags(variant))}` | "
          f"{f'`{setting}`' if setting else '-'} | "
          f"{gib(m['worker'])} | {gib(m['driver'])} | {gib(m['total'])} | "
          f"{m['total_at'][0]}: {gib(m['total_at'][1])} + {gib(m['total_at'][2])} | "
          f"{gib(mid[1])} | {gib(last[1])} | {growth} | {peak_growth['worker']} | "
          f"{gib(mid[0])} | {gib(last[0])} | {peak_growth['driver']} | "
          f"{median:.1f} | {median / first_median:.2f} |"
        )
        print(rows[-1], flush=True)
  r5, rn = min(GROWTH_FROM, FLAGS.rounds), FLAGS.rounds
  first, last = (f"{w[0]}-{w[-1]}" if w else "-" for w in report.peak_windows(GROWTH_FROM, rn))
  command = " ".join(
    ["python -m tff_ens.main --task=femnist", f"--rounds={FLAGS.rounds}", *FLAGS.cli_flags]
  )
  lines = [
    SECTION,
    "",
    f"`{command}` with the variant's flags, and every flag not given there at its default "
    "(seed 0, 10 clients a round, 1 epoch, batch 20, LEAF CNN; evaluation and a checkpoint "
    "every 10 rounds and at the end), "
    "one run at a time; resident memory sampled every 0.2 s: the driver (the CLI's process), its "
    "TFF worker (its children), the peak of their sum and when it was reached, each after a "
    "round (once the round's row is in `metrics.csv`, after the round's evaluation), each one's "
    "peak over the last rounds against its peak over as many after round 5 (which a copy of "
    "the held state every few rounds does not sway, as it sways a single sample; the driver's "
    "windows compare like with like when they hold as many evaluations, as rounds 6-12 and "
    "14-20 of 20 do), and the median `seconds` of a round.",
    "",
    *report.run_facts(run, "benchmarks/cli_memory.py"),
    "",
    "| variant | flags | setting | worker peak GiB | driver peak GiB | "
    "worker + driver peak GiB | at the sum's peak: rounds done: worker + driver GiB | "
    f"worker after round {r5} | worker after round {rn} | "
    f"worker growth | worker's peak in rounds {last} against {first} | "
    f"driver after round {r5} | driver after round {rn} | "
    f"driver's peak in rounds {last} against {first} | median s/round | "
    "round time against the variant's first setting |",
    "| --- | --- | --- |" + " ---: |" * 3 + " --- |" + " ---: |" * 9,
    *rows,
  ]
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
