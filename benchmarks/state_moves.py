r"""What moving a held state costs: its upload, its copy on the worker and its download.

  uv run python benchmarks/state_moves.py [--models=1,5,10] [--rounds=6]

`resident_state.ResidentState` keeps a process's state on TFF's worker; it uploads it in the first
round, copies it on the worker before each later round (the CLI's default, which cuts the
worker's chain of held values) and downloads it for evaluation and checkpoints. For a state of
N LEAF CNNs' weights (26.4 MB each; Fed-ensemble's K=5 is 5, FedDyn-ensemble's 10), each N in
a worker of its own, this runs `--rounds` rounds of a computation that only halves the state
and adds the clients' sum, then downloads it, and prints the seconds of the first round (the
upload), the median of the others (the copy), the download's, and the worker's and this
process' (the driver's) peak resident memory, sampled every 0.05 s. The computation does no
training, so the seconds and the memory above the TFF runtime's are the state's moves.
Writes the section "## Moving the held state" of `--results`.
"""

import collections
import statistics
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

import report
from tasks import femnist
from tff_ens.execution import resident_state
from tff_ens.execution import runtime

SECTION = "## Moving the held state"
# The LEAF CNN's weight shapes: two convolutions, two dense layers.
LEAF_CNN_SHAPES = [tuple(w.shape) for w in femnist.build_model("cnn").trainable_weights]
# The weight `measure` checks (the first dense layer's kernel).
CHECKED_WEIGHT = 4

report.define_flags()
flags.DEFINE_list("models", ["1", "5", "10"], "State sizes, in LEAF CNNs' weights.")
flags.DEFINE_integer("rounds", 6, "Rounds per size: one upload, then a copy before each.")
FLAGS = flags.FLAGS


def _process(models: int):
  """`next(state, xs@CLIENTS) -> (state / 2 + sum(xs), sum(xs))` on `models` CNNs' weights."""
  names = [f"model{k}" for k in range(models)]
  member = tff.StructType(
    [
      (name, tff.StructType([tff.TensorType(np.float32, shape) for shape in LEAF_CNN_SHAPES]))
      for name in names
    ]
  )

  @tff.tensorflow.computation(member, np.int32)
  def update(state, total):
    shift = tf.cast(total, tf.float32)
    return collections.OrderedDict(
      (name, [w * 0.5 + shift for w in weights]) for name, weights in zip(names, state)
    )

  @tff.federated_computation(
    tff.FederatedType(member, tff.SERVER), tff.FederatedType(np.int32, tff.CLIENTS)
  )
  def next_fn(state, xs):
    total = tff.federated_sum(xs)
    return tff.federated_map(update, (state, total)), total

  initial = collections.OrderedDict(
    (name, [np.full(shape, k, np.float32) for shape in LEAF_CNN_SHAPES])
    for k, name in enumerate(names)
  )
  return next_fn, initial


def measure(models: int) -> dict:
  """Seconds of the upload round, the copy rounds and the download; peak memory (bytes)."""
  next_fn, initial = _process(models)
  with runtime.execution_context():
    with (
      report.PeakMemory(interval=0.05) as own,
      report.PeakMemory(children=True, interval=0.05) as child,
    ):
      held = resident_state.ResidentState(next_fn, initial)
      del initial
      seconds = []
      for _ in range(FLAGS.rounds):
        start = time.perf_counter()
        held.next([1, 2])
        seconds.append(time.perf_counter() - start)
      start = time.perf_counter()
      state = held.value
      download = time.perf_counter() - start
    # Each weight is k, halved each round plus 3: check the moves kept every tensor in place.
    expected = 6 * (1 - 0.5**FLAGS.rounds)
    for k, weights in enumerate(state.values()):
      np.testing.assert_allclose(
        weights[CHECKED_WEIGHT].flat[0], k * 0.5**FLAGS.rounds + expected, rtol=1e-6
      )
  return dict(
    upload=seconds[0],
    copy=statistics.median(seconds[1:]),
    download=download,
    worker=child.peak,
    driver=own.peak,
    mb=sum(int(np.prod(s)) for s in LEAF_CNN_SHAPES) * 4 * models / 1e6,
  )


def main(argv):
  run = report.start(argv)
  if FLAGS.rounds < 2:
    raise app.UsageError("--rounds must be at least 2: one upload, then copies")
  gib = lambda b: f"{b / 2**30:.2f}"
  rows = []
  for models in map(int, FLAGS.models):
    m = measure(models)
    rows.append(
      f"| {models} | {m['mb']:.0f} | {m['upload']:.2f} | {m['copy']:.2f} | {m['download']:.2f} | "
      f"{gib(m['worker'])} | {gib(m['driver'])} |"
    )
    print(rows[-1], flush=True)
  lines = [
    SECTION,
    "",
    f"A state of N LEAF CNNs' weights held on the worker by `resident_state.ResidentState` for "
    f"{FLAGS.rounds} rounds of a computation without training (the state halved plus the two "
    "clients' sum), then downloaded; each N in a worker of its own. Round 1 uploads the "
    "state; each later round copies it on the worker first (the CLI's default).",
    "",
    *report.run_facts(run, "benchmarks/state_moves.py"),
    "",
    "| CNNs | MB | round 1 s (upload) | later rounds s (copy), median | download s | "
    "worker peak GiB | driver peak GiB |",
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    *rows,
  ]
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
