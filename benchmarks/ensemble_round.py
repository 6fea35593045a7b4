r"""Round time and worker memory of Fed-ensemble against FedAvg (issue 3).

  uv run python benchmarks/ensemble_round.py [--rounds=4] [--sizes=1,5]

The same 10 FEMNIST writers, LEAF CNN, 1 epoch, batch 20, SGD 0.05: the median
wall time of a round (after one untimed round) of `fedavg` and of
`fedensemble` with K in `--sizes`, all through the TFF C++ runtime of
`runtime.execution_context`, and the peak resident memory of its worker. Each
client trains one model in every variant, so the difference is the server
side: K models in the state, the per-client `federated_select` and the K-slot
`federated_aggregate`. Writes the section "## Fed-ensemble round time
(issue 3)" of `--results`.
"""

import datetime
import os
import shlex
import statistics
import sys
import threading
import time

from absl import app
from absl import flags
import numpy as np
import psutil

from tasks import femnist
from tff_ens import algorithms
from tff_ens import client_work
from tff_ens import runtime
from tff_ens import training
import report

SECTION = "## Fed-ensemble round time (issue 3)"

report.define_flags()
flags.DEFINE_integer("rounds", 4, "Timed rounds per variant (median over).")
flags.DEFINE_list("sizes", ["1", "5"], "Ensemble sizes K to time.")

FLAGS = flags.FLAGS


class PeakMemory:
  """Samples the resident memory of this process' children (the worker)."""

  def __init__(self):
    self.peak = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)

  def _sample(self):
    me = psutil.Process()
    while not self._stop.wait(0.2):
      try:
        rss = sum(c.memory_info().rss for c in me.children(recursive=True))
      except psutil.Error:
        continue
      self.peak = max(self.peak, rss)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def time_rounds(algorithm, datasets, rounds: int) -> list[float]:
  state = algorithm.process.initialize()
  indices = np.arange(len(datasets))
  state, _ = algorithm.next_fn(state, datasets, indices)  # Untimed.
  seconds = []
  for _ in range(rounds):
    start = time.perf_counter()
    state, _ = algorithm.next_fn(state, datasets, indices)
    seconds.append(time.perf_counter() - start)
  return seconds


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  started = datetime.datetime.now().astimezone()
  load_at_start = os.getloadavg()
  data = femnist.load_data(FLAGS.data_dir)
  writers = data.train.client_ids[:10]
  datasets = [training.client_dataset(data.train.x[c], data.train.y[c],
                                      epochs=1, batch_size=20, seed=0)
              for c in writers]
  model_fn = lambda k=0: femnist.build_model("cnn", seed=k)
  config = client_work.LocalTrainingConfig(learning_rate=0.05)
  variants = [("fedavg", 1)] + [("fedensemble", int(k)) for k in FLAGS.sizes]
  rows = []
  for name, k in variants:
    # One worker per variant, so its peak memory is the variant's own.
    with runtime.execution_context(), PeakMemory() as memory:
      algorithm = algorithms.build_algorithm(
          name, model_fn, training.batch_element_spec(femnist), config,
          ensemble_size=k)
      seconds = time_rounds(algorithm, datasets, FLAGS.rounds)
    down, up = algorithm.bytes_per_client_round()
    rows.append((f"{name}" + (f", K={k}" if name == "fedensemble" else ""),
                 statistics.median(seconds), memory.peak, down, up))
    print(f"{rows[-1][0]}: {rows[-1][1]:.2f} s/round, "
          f"worker peak {memory.peak / 2**30:.2f} GiB", flush=True)
  baseline = rows[0][1]
  machine = report.machine_description()
  lines = [
      SECTION, "",
      "Ten fixed FEMNIST writers (LEAF CNN, 1 epoch, batch 20, SGD 0.05), "
      f"median of {FLAGS.rounds} timed rounds after one untimed round; each "
      "variant in its own TFF worker, whose peak resident memory is sampled.",
      "",
      f"- date: {started:%Y-%m-%d %H:%M %Z}",
      f"- machine: nproc={machine['nproc']}, {machine['cpu']}, RAM "
      f"{machine['ram']}",
      "- command (from the repository root): `uv run python "
      f"{shlex.join(['benchmarks/ensemble_round.py', *sys.argv[1:]])}`",
      f"- load average at start: {', '.join(f'{x:.2f}' for x in load_at_start)}"
      f"; at end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
      "",
      "| variant | median s/round | ratio to FedAvg | worker peak memory | "
      "bytes down / up per client |",
      "| --- | ---: | ---: | ---: | ---: |",
  ]
  for name, median, peak, down, up in rows:
    lines.append(f"| {name} | {median:.2f} | {median / baseline:.2f} | "
                 f"{peak / 2**30:.2f} GiB | {down:,} / {up:,} |")
  print("\n".join(lines))
  if FLAGS.results:
    report.write_section(FLAGS.results, SECTION, "\n".join(lines))


if __name__ == "__main__":
  app.run(main)
