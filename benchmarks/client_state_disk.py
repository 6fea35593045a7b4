r"""Disk of the clients' stored states (FedDyn's g, per member with Fed-ensemble).

  uv run python benchmarks/client_state_disk.py [--rounds=300] [--checkpoint_every=25]

Drives a `client_states.ClientStateStore` through a run's rounds as the round loop does:
each round's cohort from the CLI's sampler (`simulation.sample_clients`, seed 0), each
client's key from Fed-ensemble's permutations (`member_updates.assigned_model`; K=1 is
FedDyn), one version written per client a round, and after every `--checkpoint_every`
rounds the two newest checkpoints handed to `prune`. States are one number here; the disk
is the files' count times the LEAF CNN's state (its trainable weights as float32, FedDyn's
g). For the slice (105 writers, 10 a round) and the full size (3,597 writers, 100 a round)
it prints the files at the end and at their peak, their size, and the writers with a state.
Then it times writing and reading LEAF-CNN-sized states in this store (`--timed` of each).
Writes the section "## Clients' stored states on disk" of `--results`.
"""

import os
import tempfile
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

import report
from tasks import femnist
from tff_ens.algorithms import algorithm as algorithm_lib
from tff_ens.math import member_updates
from tff_ens.program import client_states
from tff_ens.program import simulation

SECTION = "## Clients' stored states on disk"
# (writers, clients a round, K) of the slice and of LEAF's full FEMNIST.
FEDERATIONS = ((105, 10, 1), (105, 10, 5), (3597, 100, 1), (3597, 100, 5))

report.define_flags()
flags.DEFINE_integer("rounds", 300, "Rounds of each run.")
flags.DEFINE_integer("checkpoint_every", 25, "Rounds between checkpoints (the CLI's flag).")
flags.DEFINE_integer("timed", 20, "LEAF-CNN-sized states written and read for the timing.")
flags.DEFINE_string(
  "state_dir", None, "Directory (on the disk runs write to) for the timing; default: /tmp."
)

FLAGS = flags.FLAGS


def count_files(writers: int, per_round: int, k: int, directory: str) -> dict:
  """The store's files through `--rounds` rounds: at the end, at their peak, and the
  (client, key) pairs with a state."""
  spec = algorithm_lib.ClientStates(shape=(1,), dtype=np.dtype(np.float32))
  store = client_states.ClientStateStore(directory, spec)
  key_of = tf.function(lambda client, t: member_updates.assigned_model(0, client, t, k))
  checkpoints, peak = [], 0
  for round_num in range(1, FLAGS.rounds + 1):
    for client in simulation.sample_clients(writers, per_round, 0, round_num):
      key = int(key_of(tf.constant(client, tf.int64), tf.constant(round_num - 1))) if k > 1 else 0
      store.save(round_num, int(client), key, np.zeros(1, np.float32))
    peak = max(peak, len(os.listdir(directory)))
    if round_num % FLAGS.checkpoint_every == 0:
      checkpoints = (checkpoints + [round_num])[-2:]  # The checkpoints a run keeps.
      store.prune(checkpoints)
  end = len(os.listdir(directory))
  pairs = sum(store.stored(c, key) for c in range(writers) for key in range(k))
  return {"end": end, "peak": max(peak, end), "pairs": pairs}


def time_states(state_size: int, directory: str) -> tuple[float, float]:
  """Seconds to write and to read one state of `state_size` float32 (the medians)."""
  spec = algorithm_lib.ClientStates(shape=(state_size,), dtype=np.dtype(np.float32))
  store = client_states.ClientStateStore(directory, spec)
  value = np.random.default_rng(0).standard_normal(state_size).astype(np.float32)
  writes, reads = [], []
  for client in range(FLAGS.timed):
    start = time.perf_counter()
    store.save(1, client, 0, value)
    writes.append(time.perf_counter() - start)
  for client in range(FLAGS.timed):
    start = time.perf_counter()
    store.load(client, 0)
    reads.append(time.perf_counter() - start)
  return float(np.median(writes)), float(np.median(reads))


def main(argv):
  run = report.start(argv)
  state_size = femnist.build_model("cnn", seed=0).count_params()
  state_bytes = 4 * state_size
  gb = lambda files: f"{files * state_bytes / 1e9:.1f}"
  rows = []
  for writers, per_round, k in FEDERATIONS:
    with tempfile.TemporaryDirectory() as directory:
      files = count_files(writers, per_round, k, directory)
    rows.append(
      f"| {writers:,} | {per_round} | {k} | {files['pairs']:,} of {writers * k:,} | "
      f"{files['end']:,} | {gb(files['end'])} | {files['peak']:,} | {gb(files['peak'])} | "
      f"{gb(writers * k)} |"
    )
    print(rows[-1], flush=True)
  with tempfile.TemporaryDirectory(dir=FLAGS.state_dir) as directory:
    write, read = time_states(state_size, directory)
  lines = [
    SECTION,
    "",
    f"A run's stored client states after {FLAGS.rounds} rounds with a checkpoint every "
    f"{FLAGS.checkpoint_every} (the two newest kept), cohorts and keys as the CLI draws them "
    f"(seed 0); a state is the LEAF CNN's {state_size:,} trainable weights in float32 "
    f"({state_bytes / 1e6:.1f} MB a file).",
    "",
    *report.run_facts(run, "benchmarks/client_state_disk.py"),
    "",
    "| writers | clients a round | K | (writer, member) pairs with a state | files at the end | "
    "GB at the end | files at the peak | GB at the peak | GB of one state per pair |",
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    *rows,
    "",
    f"Writing one {state_bytes / 1e6:.1f} MB state (a temporary file renamed) took "
    f"{write * 1e3:.0f} ms and reading it {read * 1e3:.0f} ms (medians of {FLAGS.timed}, in "
    f"`{FLAGS.state_dir or tempfile.gettempdir()}`).",
  ]
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
