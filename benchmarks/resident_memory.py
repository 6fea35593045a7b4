r"""Worker memory with the state held on the worker between rounds.

  uv run python benchmarks/resident_memory.py [--rounds=16] \
      [--algorithms=fedensemble,vdistill] [--distill_steps=20] \
      [--places=python,uncut,cli] [--transports=files,values]

TFF's worker keeps the per-client values of a call alive for as long as a
state derived from that call is held there, back to the last state uploaded
from Python. For each algorithm, the benchmark runs `--rounds` rounds on ten
fixed FEMNIST writers (LEAF CNN, 1 epoch, batch 20, SGD 0.05; K = 5 for
Fed-ensemble), each way in a fresh worker: the state through Python every
round; held on the worker without a cut (`resident_state.ResidentState` with no
memory budget); and held as the CLI holds it (`ResidentState`'s default
copy of the state made on the worker every round), each in the
`--places` given; and with each `--client_transport` of `--transports` where
it matters (a server step's collected updates, clients' states). It prints
the worker's resident memory after rounds 1, 5, 10 and the last, its peak,
this process' (the driver's) peak, and the median seconds of a round. Writes
the section "## State on the worker and worker memory" of `--results`.
"""

import statistics
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

import report
from tasks import femnist
from tff_ens import algorithms
from tff_ens.execution import resident_state
from tff_ens.execution import runtime
from tff_ens.program import client_states
from tff_ens.program import simulation
from tff_ens.server import server_data as server_data_lib
from tff_ens.templates import client_work
from tff_ens.templates import transport as transport_lib

SECTION = "## State on the worker and worker memory"
PLACES = (
  ("python", "through Python every round"),
  ("uncut", "held on the worker, no cut"),
  ("cli", "held on the worker, cut as the CLI does"),
)

report.define_flags()
flags.DEFINE_integer("rounds", 16, "Rounds per algorithm and state place.")
flags.DEFINE_list("algorithms", ["fedensemble", "vdistill"], "Algorithms to run.")
flags.DEFINE_list("places", [place for place, _ in PLACES], "Where the state stays between rounds.")
flags.DEFINE_list(
  "transports",
  ["files", "values"],
  "--client_transport values, for algorithms whose clients keep states or whose server step "
  "collects their updates.",
)
flags.DEFINE_integer(
  "distill_steps",
  25,
  "Server distillation steps a round (vdistill, fedbe, feddf); FedBE's SWA needs 25 or more.",
)
FLAGS = flags.FLAGS


def run_rounds(name: str, place: str, transport: str, data, datasets):
  """(worker RSS bytes after each round, seconds of each round, driver peak RSS bytes, whether
  `--client_transport` changes how `name` runs: its server step collects the clients'
  updates, or its clients keep states)."""
  server_data = None
  if algorithms.REGISTRY[name].server_data:
    server_data = server_data_lib.server_split(data, femnist, seed=0)
  with (
    runtime.execution_context(),
    report.PeakMemory() as driver,
    tempfile.TemporaryDirectory() as directory,
  ):
    worker = report.local_worker()
    algorithm = algorithms.build_algorithm(
      name,
      lambda k=0: femnist.build_model("cnn", seed=k),
      simulation.batch_element_spec(femnist),
      client_work.LocalTrainingConfig(learning_rate=0.05),
      build_model=lambda model, seed: femnist.build_model(model, seed=seed),
      model="cnn",
      task=femnist,
      server_data=server_data,
      num_clients=len(datasets),
      clients_per_round=len(datasets),
      transport=transport_lib.FILES if transport == "files" else transport_lib.VALUES,
      **algorithms.settings_read(name, ensemble_size=5, distill_steps=FLAGS.distill_steps),
    )
    store = None
    if algorithm.client_states is not None:
      store = client_states.ClientStateStore(directory, algorithm.client_states)
    state = algorithm.process.initialize()
    if place != "python":
      held = resident_state.ResidentState(
        algorithm.process.next, state, **({"max_growth_bytes": 2**60} if place == "uncut" else {})
      )
    cohort = np.arange(len(datasets))
    rss, seconds = [], []
    for round_num in range(1, FLAGS.rounds + 1):
      keys = [0] * len(cohort)  # One state per client (personal models, own layers).
      states = store.round_inputs(round_num, cohort, keys) if store is not None else None
      args = algorithm.next_args(datasets, cohort, states=states)
      start = time.perf_counter()
      if place == "python":
        state, *outputs = resident_state.state_first(algorithm.process.next(state, *args))
      else:
        outputs = held.next(*args)
      if store is not None:
        store.round_outputs(round_num, cohort, keys, algorithm.result(tuple(outputs)).client_states)
      seconds.append(time.perf_counter() - start)
      rss.append(worker.memory_info().rss)
      print(
        f"{name}, {place}, {transport}: round {len(rss)} worker {rss[-1] / 2**30:.2f} GiB, "
        f"{seconds[-1]:.2f} s",
        flush=True,
      )
  moves = algorithm.client_states is not None or algorithms.REGISTRY[name].server_data
  return rss, seconds, driver.peak, moves


def main(argv):
  run = report.start(argv)
  data = femnist.load_data(FLAGS.data_dir)
  datasets = [
    simulation.client_dataset(data.train.x[c], data.train.y[c], epochs=1, batch_size=20, seed=0)
    for c in data.train.client_ids[:10]
  ]
  marks = sorted({r for r in (1, 5, 10, FLAGS.rounds) if r <= FLAGS.rounds})
  rows = []
  descriptions = dict(PLACES)
  for name in FLAGS.algorithms:
    for place in FLAGS.places:
      for transport in FLAGS.transports:
        rss, seconds, driver_peak, moves = run_rounds(name, place, transport, data, datasets)
        rows.append(
          f"| {name} | {descriptions[place]} | {transport if moves else '-'} | "
          + " | ".join(f"{rss[r - 1] / 2**30:.2f}" for r in marks)
          + f" | {max(rss) / 2**30:.2f} | {driver_peak / 2**30:.2f} | "
          f"{statistics.median(seconds):.2f} |"
        )
        if not moves:  # The other transports would run the same rounds.
          break
  lines = [
    SECTION,
    "",
    f"Ten fixed FEMNIST writers, LEAF CNN, {FLAGS.rounds} rounds per row, "
    "each row in a fresh TFF worker; resident memory of the worker after "
    "the rounds shown, its peak over the rounds, and the median seconds "
    f"of a round. Fed-ensemble has K = 5; server distillation runs "
    f"{FLAGS.distill_steps} steps a round.",
    "",
    *report.run_facts(run, "benchmarks/resident_memory.py"),
    "",
    "| algorithm | state | client transport | "
    + " | ".join(f"worker GiB after round {r}" for r in marks)
    + " | worker peak GiB | driver peak GiB | median s/round |",
    "| --- | --- | --- |" + " ---: |" * (len(marks) + 3),
    *rows,
  ]
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
