r"""Round time and worker memory of Fed-ensemble against FedAvg (issue 3).

  uv run python benchmarks/ensemble_round.py [--rounds=4] [--sizes=1,5]

The same 10 FEMNIST writers, LEAF CNN, 1 epoch, batch 20, SGD 0.05: the median
wall time of a round (after one untimed round) of `fedavg` and of
`fedensemble` with K in `--sizes`, all through the TFF C++ runtime of
`runtime.execution_context` as the CLI runs them.
The variants' rounds are interleaved (FedAvg, K=1, K=5, FedAvg, ...) in one
worker, so that load from other processes falls on all variants alike. A
second pass runs each variant alone in its own worker for one round and
samples that worker's peak resident memory. Each client trains one model in
every variant, so the difference is the server side: K models in the state,
the per-client `federated_select` and the K-slot `federated_aggregate`.
Writes the section "## Fed-ensemble round time (issue 3)" of `--results`.
"""

import functools
import statistics
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
flags.DEFINE_integer("rounds", 6, "Timed rounds per variant (median over).")
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


def time_interleaved(algorithms_, datasets,
                     rounds: int) -> tuple[list[list[float]], list[list[float]]]:
  """Per algorithm, wall and CPU seconds of `rounds` rounds, run in turns."""
  indices = np.arange(len(datasets))
  states = []
  for algorithm in algorithms_:  # One untimed round each (tracing, caches).
    state = algorithm.process.initialize()
    states.append(algorithm.next_fn(state, datasets, indices)[0])
  wall = [[] for _ in algorithms_]
  cpu = [[] for _ in algorithms_]
  for _ in range(rounds):
    for i, algorithm in enumerate(algorithms_):
      start, start_cpu = time.perf_counter(), report.cpu_seconds()
      states[i], _ = algorithm.next_fn(states[i], datasets, indices)
      wall[i].append(time.perf_counter() - start)
      cpu[i].append(report.cpu_seconds() - start_cpu)
  return wall, cpu


def peak_worker_memory(build, datasets) -> int:
  """Peak resident bytes of a fresh worker over one initialize and round."""
  with runtime.execution_context(), PeakMemory() as memory:
    algorithm = build()
    state = algorithm.process.initialize()
    algorithm.next_fn(state, datasets, np.arange(len(datasets)))
  return memory.peak


def main(argv):
  run = report.start(argv)
  data = femnist.load_data(FLAGS.data_dir)
  writers = data.train.client_ids[:10]
  datasets = [training.client_dataset(data.train.x[c], data.train.y[c],
                                      epochs=1, batch_size=20, seed=0)
              for c in writers]
  model_fn = lambda k=0: femnist.build_model("cnn", seed=k)
  config = client_work.LocalTrainingConfig(learning_rate=0.05)
  variants = [("fedavg", 1)] + [("fedensemble", int(k)) for k in FLAGS.sizes]
  builders = [
      functools.partial(algorithms.build_algorithm, name, model_fn,
                        training.batch_element_spec(femnist), config,
                        ensemble_size=k)
      for name, k in variants]
  with runtime.execution_context():
    built = [build() for build in builders]
    wall, cpu = time_interleaved(built, datasets, FLAGS.rounds)
  rows = []
  for (name, k), build, algorithm, times, cpu_times in zip(
      variants, builders, built, wall, cpu):
    peak = peak_worker_memory(build, datasets)
    down, up = algorithm.bytes_per_client_round()
    rows.append((f"{name}" + (f", K={k}" if name == "fedensemble" else ""),
                 statistics.median(times), statistics.median(cpu_times), peak,
                 down, up))
    print(f"{rows[-1][0]}: {rows[-1][1]:.2f} s/round "
          f"({', '.join(f'{t:.2f}' for t in times)}), CPU "
          f"{rows[-1][2]:.2f} s/round, worker peak {peak / 2**30:.2f} GiB",
          flush=True)
  baseline, baseline_cpu = rows[0][1], rows[0][2]
  lines = [
      SECTION, "",
      "Ten fixed FEMNIST writers (LEAF CNN, 1 epoch, batch 20, SGD 0.05), "
      f"median of {FLAGS.rounds} timed rounds after one untimed round, the "
      "variants' rounds interleaved in one TFF worker (as the CLI runs "
      "them); peak resident memory of "
      "a fresh worker running one round of the variant alone. CPU seconds "
      "(this process and the worker, user + system) depend less on other "
      "load than wall time.",
      "",
      *report.run_facts(run, "benchmarks/ensemble_round.py"),
      "",
      "| variant | median s/round | ratio to FedAvg | median CPU s/round | "
      "CPU ratio | worker peak memory | bytes down / up per client |",
      "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for name, median, median_cpu, peak, down, up in rows:
    lines.append(f"| {name} | {median:.2f} | {median / baseline:.2f} | "
                 f"{median_cpu:.2f} | {median_cpu / baseline_cpu:.2f} | "
                 f"{peak / 2**30:.2f} GiB | {down:,} / {up:,} |")
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
