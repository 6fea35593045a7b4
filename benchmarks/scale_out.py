r"""Rounds per minute of FedAvg on a local worker and on two workers.

  uv run python benchmarks/scale_out.py [--rounds=2] [--cohorts=20,100]

FedAvg with the LEAF CNN on the FEMNIST slice (1 epoch, batch 20, SGD 0.05),
cohorts of `--cohorts` writers sampled per round as the CLI samples them
(`simulation.sample_clients`; the slice has 105 training writers, so 100 are
drawn without replacement), in two setups:

* "local": `runtime.execution_context()`, one local `worker_binary`, as
  `python -m tff_ens.main` runs without `--workers`;
* "2 workers": two worker services on 127.0.0.1 over mutual TLS
  (`worker_service.WorkerService`, what `python -m tff_ens.worker --credentials=DIR`
  runs) and `execution_context(workers=..., credentials_dir=DIR)`, as
  `--workers=localhost:P1,localhost:P2 --worker_credentials=DIR` runs: each round's
  clients are split in two halves and the partial aggregates merged.

Both setups share this machine's cores and train at most
`--concurrent_clients` clients at once in all (the local worker that many,
each of the two workers half): without a limit, a worker training 100 LEAF CNN
clients at once grew past 10 GiB and was killed for memory. The setups take
turns (`time_setups`) and train the same rounds, so their final models are
compared. Writes the section "## Scale-out on TFF workers" of
`--results`.
"""

import contextlib
import os
import statistics
import tempfile
import time

from absl import app
from absl import flags
import numpy as np
import portpicker
import tensorflow as tf

import report
from tasks import femnist
from tff_ens import algorithms
from tff_ens.execution import runtime
from tff_ens.execution import tls
from tff_ens.execution import worker_service
from tff_ens.program import simulation
from tff_ens.templates import client_work

SECTION = "## Scale-out on TFF workers"

report.define_flags()
flags.DEFINE_integer("rounds", 2, "Timed rounds per setup and cohort size.")
flags.DEFINE_list("cohorts", ["20", "100"], "Clients per round to time.")
flags.DEFINE_integer(
  "concurrent_clients",
  4,
  "Clients trained at once on the machine: by the local "
  "worker, or half by each of the two (even, >= 2).",
)

FLAGS = flags.FLAGS

SEED = 0
SETUPS = ("local", "2 workers")
# Clients of each block's untimed first round.
WARM_UP_CLIENTS = 2


@contextlib.contextmanager
def two_local_workers(concurrent_clients: int):
  """Two worker services on free 127.0.0.1 ports, over mutual TLS with new credentials, as
  `python -m tff_ens.worker` serves; yields their addresses and the credentials."""
  with tempfile.TemporaryDirectory() as directory:
    credentials = os.path.join(directory, "credentials")
    tls.make(credentials, [])
    with contextlib.ExitStack() as stack:
      services = [
        stack.enter_context(
          worker_service.WorkerService(
            portpicker.pick_unused_port(),
            credentials,
            max_concurrent_computation_calls=concurrent_clients,
          )
        )
        for _ in range(2)
      ]
      yield [f"localhost:{s.port}" for s in services], credentials


def cohort_datasets(data, cohort_size: int, round_num: int) -> tuple[list, np.ndarray]:
  """Round `round_num`'s datasets and client indices, as the CLI makes them."""
  ids = data.train.client_ids
  cohort = simulation.sample_clients(len(ids), cohort_size, SEED, round_num)
  return [
    simulation.client_dataset(
      data.train.x[ids[i]], data.train.y[ids[i]], epochs=1, batch_size=20, seed=int(i)
    )
    for i in cohort
  ], cohort


@contextlib.contextmanager
def setup_context(setup: str, concurrent_clients: int):
  """The TFF context of `setup` (one of SETUPS), its workers started here."""
  if setup == "local":
    with runtime.execution_context(max_concurrent_computation_calls=concurrent_clients):
      yield
  else:
    with two_local_workers(concurrent_clients // 2) as (addresses, credentials):
      with runtime.execution_context(workers=addresses, credentials_dir=credentials):
        yield


def time_setups(algorithm, data, cohorts: list[int], rounds: int, concurrent_clients: int):
  """Times `rounds` rounds of each cohort size in each setup.

  The setups run in turns, in blocks of one round per cohort size, ordered
  ABBA..., so that a drift in the machine's load falls on both alike; one
  setup's workers at a time hold memory. Each block starts its context and
  runs an untimed round of WARM_UP_CLIENTS clients (tracing, compilation).
  Every setup trains the same cohorts in the same order.

  Returns:
    ({setup: {cohort size: (wall seconds, CPU seconds) of each round}},
     {setup: the final model weights}).
  """
  states, weights = {}, {}
  times = {setup: {size: ([], []) for size in cohorts} for setup in SETUPS}
  for block in range(rounds):
    for setup in SETUPS if block % 2 == 0 else SETUPS[::-1]:
      with setup_context(setup, concurrent_clients):
        if setup not in states:
          states[setup] = algorithm.process.initialize()
        states[setup], _ = algorithm.next_fn(
          states[setup], *cohort_datasets(data, WARM_UP_CLIENTS, 0)
        )
        for size in cohorts:
          datasets, cohort = cohort_datasets(data, size, block + 1)
          start, start_cpu = time.perf_counter(), report.cpu_seconds()
          states[setup], _ = algorithm.next_fn(states[setup], datasets, cohort)
          times[setup][size][0].append(time.perf_counter() - start)
          times[setup][size][1].append(report.cpu_seconds() - start_cpu)
          print(f"{setup}, {size} clients: {times[setup][size][0][-1]:.1f} s", flush=True)
        weights[setup] = algorithm.models_fn(states[setup])[0]
  return times, weights


def main(argv):
  run = report.start(argv)
  data = femnist.load_data(FLAGS.data_dir)
  cohorts = [int(c) for c in FLAGS.cohorts]
  if max(cohorts) > len(data.train.client_ids):
    raise app.UsageError(f"--cohorts: at most {len(data.train.client_ids)} training writers")
  if FLAGS.concurrent_clients < 2 or FLAGS.concurrent_clients % 2:
    raise app.UsageError("--concurrent_clients must be even and >= 2")
  algorithm = algorithms.build_algorithm(
    "fedavg",
    lambda k=0: femnist.build_model("cnn", seed=SEED),
    simulation.batch_element_spec(femnist),
    client_work.LocalTrainingConfig(learning_rate=0.05),
  )
  results, weights = time_setups(algorithm, data, cohorts, FLAGS.rounds, FLAGS.concurrent_clients)
  difference = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(*(tf.nest.flatten(weights[setup]) for setup in SETUPS))
  )
  lines = [
    SECTION,
    "",
    "FedAvg, LEAF CNN, 1 epoch, batch 20, SGD 0.05 on the FEMNIST slice; "
    "per round a cohort sampled as the CLI samples it (105 training "
    'writers, so 100 are drawn without replacement). "local" is one '
    'local TFF worker (the CLI without `--workers`), "2 workers" two '
    "worker services on 127.0.0.1 given to `execution_context(workers="
    "...)` as `--workers` does: each round's clients are split in halves "
    "and the partial aggregates merged. At most "
    f"{FLAGS.concurrent_clients} clients train at once in either setup "
    "(`max_concurrent_computation_calls` of the local worker, half of it "
    "on each of the two; unlimited, a worker training 100 clients at once "
    "went past 10 GiB and was killed for memory). The setups take turns "
    f"in {FLAGS.rounds} blocks (ABBA order), each a fresh context, an "
    f"untimed round of {WARM_UP_CLIENTS} clients, then one timed round "
    "per cohort size; medians over the blocks. CPU seconds are this "
    "process and its workers (user + system).",
    "",
    *report.run_facts(run, "benchmarks/scale_out.py", ", no GPU"),
    "",
    "| clients per round | runtime | median s/round | rounds per minute | "
    "median CPU s/round | rounds per minute vs local |",
    "| ---: | --- | ---: | ---: | ---: | ---: |",
  ]
  for size in cohorts:
    local_median = statistics.median(results["local"][size][0])
    for setup in SETUPS:
      wall, cpu = results[setup][size]
      median = statistics.median(wall)
      lines.append(
        f"| {size} | {setup} | {median:.1f} | {60 / median:.2f} | "
        f"{statistics.median(cpu):.1f} | {local_median / median:.2f} |"
      )
  medians = {
    setup: {size: [statistics.median(t) for t in results[setup][size]] for size in cohorts}
    for setup in SETUPS
  }
  ratios = ", ".join(
    f"{medians['local'][size][0] / medians['2 workers'][size][0]:.2f}x "
    f"the local rounds per minute with "
    f"{medians['2 workers'][size][1] / medians['local'][size][1]:.2f}x "
    f"its CPU seconds at {size} clients"
    for size in cohorts
  )
  lines += [
    "",
    "Reading: both setups share this machine's 2 cores, so two workers "
    "cannot be faster here; the table measures what splitting a round "
    f"costs. Two workers ran {ratios}. Each worker receives the model "
    "state and its half of the clients, the two partial sums are merged, "
    "and TFF 0.87 runs the after-merge step on one worker with the first "
    "half's arguments (state and datasets) sent once more. A speed-up "
    "needs workers on separate machines, whose cores add up; this machine "
    "cannot show one. After the same rounds the two setups' models differ "
    f"by at most {difference:.1e} (largest absolute weight difference; "
    "one round on two workers matches the local round within 1e-5 in "
    "tests/test_scale_out.py, so this is float rounding of the sums in "
    "another order, carried through the rounds).",
  ]
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
