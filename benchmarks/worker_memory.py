r"""Memory of the TFF worker when the cohort size changes between rounds.

  uv run python benchmarks/worker_memory.py [--rounds=12] [--algorithm=fedensemble]

Client dropouts (`--dropout_rate`) give most rounds a different number of
clients, and TFF builds one executor per cohort size. The benchmark runs
`--rounds` rounds of `--algorithm` on FEMNIST writers with cohort sizes
cycling through `--cohorts` and prints the worker's resident memory after
each round, once with `runtime.execution_context` as the CLI uses it (one
executor, closed when the cohort size changes) and once with TFF's stock
`ResourceManagingExecutorFactory` (an executor kept per cohort size).
Writes the section "## Worker memory with changing cohort sizes" of
`--results`.
"""

import datetime
import os
import sys

from absl import app
from absl import flags
import numpy as np
import tensorflow_federated as tff

import report
from tasks import femnist
from tff_ens import algorithms
from tff_ens.execution import runtime
from tff_ens.execution import worker_process
from tff_ens.program import simulation
from tff_ens.templates import client_work

SECTION = "## Worker memory with changing cohort sizes"

report.define_flags()
flags.DEFINE_integer("rounds", 12, "Rounds per variant.")
flags.DEFINE_string("algorithm", "fedensemble", "Algorithm to run (K = 5).")
flags.DEFINE_list("cohorts", ["2", "3", "4", "5", "6"], "Cohort sizes, cycled over the rounds.")
FLAGS = flags.FLAGS


def measure(data, factory: str) -> list[int | str]:
  """Worker RSS (MiB) after each round with executor `factory`.

  Rounds after the worker died (e.g. out of memory) read "worker died".
  """
  stock = runtime._LatestExecutorFactory
  if factory == "tff":
    runtime._LatestExecutorFactory = tff.framework.ResourceManagingExecutorFactory
  try:
    with runtime.execution_context():
      algorithm = algorithms.build_algorithm(
        FLAGS.algorithm,
        lambda k=0: femnist.build_model("cnn", seed=k),
        simulation.batch_element_spec(femnist),
        client_work.LocalTrainingConfig(learning_rate=0.05),
        **algorithms.settings_read(FLAGS.algorithm, ensemble_size=5),
      )
      state = algorithm.process.initialize()
      worker = report.local_worker()
      writers = data.train.client_ids
      rss = []
      for round_num in range(FLAGS.rounds):
        n = int(FLAGS.cohorts[round_num % len(FLAGS.cohorts)])
        datasets = [
          simulation.client_dataset(
            data.train.x[w], data.train.y[w], epochs=1, batch_size=20, seed=i
          )
          for i, w in enumerate(writers[:n])
        ]
        try:
          state, _ = algorithm.next_fn(state, datasets, np.arange(n))
        except worker_process.WorkerError as e:  # E.g. killed for lack of memory.
          print(f"{factory}: round {round_num + 1}: {e}", flush=True)
          return rss + ["worker died"] * (FLAGS.rounds - round_num)
        rss.append(worker.memory_info().rss // 2**20)
        print(f"{factory}: round {round_num + 1} cohort {n} worker {rss[-1]} MiB", flush=True)
      return rss
  finally:
    runtime._LatestExecutorFactory = stock


def main(argv):
  del argv
  data = femnist.load_data(FLAGS.data_dir)
  results = {factory: measure(data, factory) for factory in ("latest", "tff")}
  cohorts = [int(FLAGS.cohorts[r % len(FLAGS.cohorts)]) for r in range(FLAGS.rounds)]
  lines = [
    "| round | cohort | worker MiB, one executor (ours) | "
    "worker MiB, one per cohort size (TFF's factory) |",
    "|---:|---:|---:|---:|",
  ]
  lines += [
    f"| {r + 1} | {c} | {a} | {b} |"
    for r, (c, a, b) in enumerate(zip(cohorts, results["latest"], results["tff"]))
  ]
  table = "\n".join(lines)
  print(table)
  machine = report.machine_description()
  text = (
    f"{SECTION}\n\n"
    f"{datetime.date.today()}, {machine['nproc']} cores "
    f"({machine['cpu']}), {machine['ram']}; command: `uv run python "
    f"{' '.join(['benchmarks/worker_memory.py'] + sys.argv[1:])}`.\n"
    f"`--algorithm={FLAGS.algorithm}` (K = 5 LEAF CNNs), the first "
    "writers of the FEMNIST slice, cohort sizes cycling as shown; "
    "resident memory of the TFF worker after each round.\n\n"
    f"{table}\n"
  )
  if FLAGS.results:
    report.write_section(FLAGS.results, SECTION, text)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  app.run(main)
