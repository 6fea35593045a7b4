r"""Disk of the clients' stored states (FedDyn's g, per member with Fed-ensemble).

  uv run python benchmarks/client_state_disk.py [--rounds=300] [--checkpoint_every=25]

Drives a `client_states.ClientStateStore` through a run's rounds as the round loop does:
each round's cohort from the CLI's sampler (`simulation.sample_clients`, seed 0), each
client's key from Fed-ensemble's permutations (`member_updates.assigned_model`; K=1 is
FedDyn), one version written per client a round, and after every `--checkpoint_every`
rounds the two newest checkpoints handed to `prune`. States are one number here; the disk
is the states' count times the LEAF CNN's state (its trainable weights as float32, FedDyn's
g). For the slice (105 writers, 10 a round) and the full size (3,597 writers, 100 a round)
it prints the states at the end and at their peak, their size, and the writers with a state.
Then it times writing and reading LEAF-CNN-sized states (`--timed` of each): in this store
(from Python), and in a TensorFlow function as a client's computation does in TFF's worker
(`stateful_client_work.through_files`), in the store's format (a checkpoint bundle,
`stateful_client_work.write_state`) and, side by side, in the serialized `TensorProto` of
`tf.io.serialize_tensor` that earlier versions wrote.
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
from tff_ens.templates import stateful_client_work

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


def count_states(directory: str) -> int:
  """The states in a store's directory (each a bundle of two files, counted by its index)."""
  index = stateful_client_work.STATE_FILE_SUFFIXES[0]
  return sum(name.endswith(index) for name in os.listdir(directory))


def count_files(writers: int, per_round: int, k: int, directory: str) -> dict:
  """The store's states through `--rounds` rounds: at the end, at their peak, and the
  (client, key) pairs with a state."""
  spec = algorithm_lib.ClientStates(shape=(1,), dtype=np.dtype(np.float32))
  store = client_states.ClientStateStore(directory, spec)
  key_of = tf.function(lambda client, t: member_updates.assigned_model(0, client, t, k))
  checkpoints, peak = [], 0
  for round_num in range(1, FLAGS.rounds + 1):
    for client in simulation.sample_clients(writers, per_round, 0, round_num):
      key = int(key_of(tf.constant(client, tf.int64), tf.constant(round_num - 1))) if k > 1 else 0
      store.save(round_num, int(client), key, np.zeros(1, np.float32))
    peak = max(peak, count_states(directory))
    if round_num % FLAGS.checkpoint_every == 0:
      checkpoints = (checkpoints + [round_num])[-2:]  # The checkpoints a run keeps.
      store.prune(checkpoints)
  end = count_states(directory)
  pairs = sum(store.stored(c, key) for c in range(writers) for key in range(k))
  return {"end": end, "peak": max(peak, end), "pairs": pairs}


def median_seconds(fn, count: int) -> float:
  """The median seconds of `fn(i)` for i in 0..count-1."""
  seconds = []
  for i in range(count):
    start = time.perf_counter()
    fn(i)
    seconds.append(time.perf_counter() - start)
  return float(np.median(seconds))


def time_states(state_size: int, directory: str) -> dict[str, float]:
  """Median seconds to write and to read one state of `state_size` float32: through the
  store, and in a TensorFlow function in both formats."""
  spec = algorithm_lib.ClientStates(shape=(state_size,), dtype=np.dtype(np.float32))
  store = client_states.ClientStateStore(directory, spec)
  value = np.random.default_rng(0).standard_normal(state_size).astype(np.float32)
  tensor = tf.constant(value)
  path = lambda kind, i: os.path.join(directory, f"{kind}{i}")

  # As in a client's computation (`stateful_client_work.through_files`), and before it.
  @tf.function
  def write_bundle(p):
    stateful_client_work.write_state(p, tensor)

  @tf.function
  def write_proto(p):
    tf.io.write_file(p, tf.io.serialize_tensor(tensor))

  read_bundle = tf.function(lambda p: stateful_client_work.read_state(p, tf.float32))
  read_proto = tf.function(lambda p: tf.io.parse_tensor(tf.io.read_file(p), tf.float32))
  n = FLAGS.timed
  seconds = {
    "store write": [median_seconds(lambda i: store.save(1, i, 0, value), n)],
    "store read": [median_seconds(lambda i: store.load(i, 0), n)],
  }
  # Two passes each, alternating the formats: the disk's slow periods fall on both.
  for _ in range(2):
    for name, fn in [
      ("bundle write", lambda i: write_bundle(path("bundle", i))),
      ("bundle read", lambda i: read_bundle(path("bundle", i))),
      ("proto write", lambda i: write_proto(path("proto", i))),
      ("proto read", lambda i: read_proto(path("proto", i))),
    ]:
      seconds.setdefault(name, []).append(median_seconds(fn, n))
  return {name: float(np.median(s)) for name, s in seconds.items()}


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
    seconds = time_states(state_size, directory)
  ms = {k: v * 1e3 for k, v in seconds.items()}
  lines = [
    SECTION,
    "",
    f"A run's stored client states after {FLAGS.rounds} rounds with a checkpoint every "
    f"{FLAGS.checkpoint_every} (the two newest kept), cohorts and keys as the CLI draws them "
    f"(seed 0); a state is the LEAF CNN's {state_size:,} trainable weights in float32 "
    f"({state_bytes / 1e6:.1f} MB).",
    "",
    *report.run_facts(run, "benchmarks/client_state_disk.py"),
    "",
    "| writers | clients a round | K | (writer, member) pairs with a state | states at the end | "
    "GB at the end | states at the peak | GB at the peak | GB of one state per pair |",
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    *rows,
    "",
    f"One {state_bytes / 1e6:.1f} MB state (medians of {FLAGS.timed}, in "
    f"`{FLAGS.state_dir or tempfile.gettempdir()}`), milliseconds:",
    "",
    "| | write | read | write + read | against the TensorProto |",
    "| --- | ---: | ---: | ---: | ---: |",
  ]
  proto = ms["proto write"] + ms["proto read"]
  for name, label in [
    ("store", "the store, from Python (a checkpoint bundle)"),
    ("bundle", "a client's computation: checkpoint bundle (the store's format)"),
    ("proto", "a client's computation: serialized TensorProto (earlier versions')"),
  ]:
    both = ms[f"{name} write"] + ms[f"{name} read"]
    lines.append(
      f"| {label} | {ms[f'{name} write']:.0f} | {ms[f'{name} read']:.0f} | {both:.0f} | "
      f"{both / proto:.2f} |"
    )
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
