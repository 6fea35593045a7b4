r"""Wall time of one FedAvg round through TFF against plain Keras.

  uv run python benchmarks/round_overhead.py [--rounds=5] \
      [--data_dir=../shared/data/femnist]

For the same 10 FEMNIST writers and LEAF CNN (1 epoch, batch 20, SGD with
learning rate 0.05, server learning rate 1), one round of:

  keras          plain Keras in this process: for each client, set the global
                 weights, `model.fit(dataset, epochs=1)` with a model compiled
                 once, then average the weights with NumPy (by example counts);
  train_locally  the same with our client math, `client_work.train_locally`,
                 called in this process without TFF (isolates the math from the
                 runtime);
  ours           `algorithms.build_algorithm("fedavg", ...)` through the TFF C++
                 runtime of `runtime.execution_context`;
  tff_stock      `tff.learning.algorithms.build_weighted_fed_avg` (a Keras model
                 via `from_keras_model`), in the same context;
  model to worker and back
                 no training: an identity TFF computation on the model weights,
                 what every TFF round pays to send the state to the worker and
                 get it back;

the TFF variants with max_concurrent_computation_calls=1 (clients one after
another) and -1 (no limit), each in its own worker. Each variant runs
`--warmup_rounds` rounds that are not timed, then the variants take turns for
`--rounds` timed rounds (so that other jobs' load falls on all of them). The
table gives the median wall time, its ratio to plain Keras, the CPU time of
this process and of the TFF worker, and, as a check that every variant does
the same work, the largest weight difference to Keras after the first round
(all start from the same weights and see the same unshuffled batches).

The table, the machine and the command are written to the section
"## Round overhead" of `--results` (other sections are kept).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import datetime
import platform
import shlex
import statistics
import time
from typing import Callable

from absl import app
from absl import flags
from absl import logging
import numpy as np

# TensorFlow before absl parses flags (see tff_ens/main.py).
import tensorflow as tf
import tensorflow_federated as tff

import report
from tasks import femnist
from tff_ens import algorithms
from tff_ens.execution import runtime
from tff_ens.program import simulation
from tff_ens.templates import client_work

SECTION = "## Round overhead"

report.define_flags()
flags.DEFINE_integer("rounds", 5, "Timed rounds per variant (median over).")
flags.DEFINE_integer("warmup_rounds", 2, "Untimed rounds before those.")
flags.DEFINE_integer("clients", 10, "Writers per round (the first, sorted).")
flags.DEFINE_integer("batch_size", 20, "Client batch size.")
flags.DEFINE_float("learning_rate", 0.05, "Client SGD learning rate.")
flags.DEFINE_list(
  "max_concurrent", ["1", "-1"], "max_concurrent_computation_calls of the TFF worker to try."
)

FLAGS = flags.FLAGS


class Variant:
  """One way of running a round, timed round by round.

  `run_round()` runs one round from the variant's current state. The first
  round (a warm-up) starts from the shared initial weights; `weights_fn()`
  then gives the weights that `weight_diff` compares with Keras' after its
  first round.
  """

  def __init__(
    self,
    name: str,
    run_round: Callable[[], None],
    weights_fn: Callable[[], list[np.ndarray]] | None,
  ):
    self.name = name
    self._run_round = run_round
    self._weights_fn = weights_fn
    self.rounds_run = 0
    self.seconds: list[float] = []
    self.loads: list[float] = []  # 1-min load average before a timed round.
    # CPU seconds of each timed round in this process and in its children
    # (the TFF worker).
    self.cpu: list[tuple[float, float]] = []
    self.weight_diff: float | None = None

  def run(self, timed: bool, reference: list[np.ndarray] | None = None):
    if timed:
      self.loads.append(os.getloadavg()[0])
    cpu_start = cpu_seconds()
    start = time.perf_counter()
    self._run_round()
    if timed:
      self.seconds.append(time.perf_counter() - start)
      self.cpu.append(tuple(b - a for a, b in zip(cpu_start, cpu_seconds())))
    self.rounds_run += 1
    if self.rounds_run == 1 and reference is not None and self._weights_fn is not None:
      self.weight_diff = max_difference(self.weights(), reference)

  def weights(self) -> list[np.ndarray]:
    return self._weights_fn()

  @property
  def median(self) -> float:
    return statistics.median(self.seconds)

  def median_cpu(self) -> tuple[float, float]:
    return tuple(statistics.median(c) for c in zip(*self.cpu))


def cpu_seconds() -> tuple[float, float]:
  """CPU seconds so far of this process and of its running children.

  Wall time on a shared machine depends on other jobs; CPU time much less.
  """
  own = os.times()
  children = 0.0
  pid = str(os.getpid())
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        stat = f.read()
    except OSError:  # Gone meanwhile.
      continue
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[1] == pid:  # ppid; utime and stime follow at 11 and 12.
      children += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
  return own.user + own.system, children


def flat_weights(weights) -> list[np.ndarray]:
  """Trainable then non-trainable arrays of a `ModelWeights` (Keras order)."""
  return [np.asarray(w) for w in list(weights.trainable) + list(weights.non_trainable)]


def max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def average(weight_lists: list[list[np.ndarray]], counts: list[int]):
  """Example-weighted mean of the clients' weights (FedAvg's server step)."""
  total = float(sum(counts))
  return [
    sum(w[i] * (n / total) for w, n in zip(weight_lists, counts))
    for i in range(len(weight_lists[0]))
  ]


def run_interleaved(variants: list[Variant], warmup: int, rounds: int, reference: list[np.ndarray]):
  """Warms up each variant (once overall), then times them round-robin.

  Round-robin spreads a change of the machine's load (other jobs) over all
  variants instead of biasing the ones measured during it.
  """
  for variant in variants:
    while variant.rounds_run < warmup:
      variant.run(timed=False, reference=reference)
  for _ in range(rounds):
    for variant in variants:
      variant.run(timed=True, reference=reference)


def keras_variant(model_fn, datasets, counts, lr) -> Variant:
  """Plain Keras: fit each client from the global weights, average (NumPy)."""
  model = model_fn()
  model.compile(
    optimizer=tf.keras.optimizers.SGD(lr),
    loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
  )
  weights = [model.get_weights()]

  def run_round():
    updated = []
    for dataset in datasets:
      model.set_weights(weights[0])
      model.fit(dataset, epochs=1, verbose=0)
      updated.append(model.get_weights())
    weights[0] = average(updated, counts)

  return Variant("keras", run_round, lambda: weights[0])


def train_locally_variant(model_fn, datasets, counts, lr) -> Variant:
  """Our client math (`train_locally`) in this process, averaged with NumPy."""
  model = model_fn()
  config = client_work.LocalTrainingConfig(learning_rate=lr)
  optimizer = tff.learning.optimizers.build_sgdm(learning_rate=lr)
  n_trainable = len(model.trainable_weights)
  weights = [model.get_weights()]

  def run_round():
    initial = client_work.ModelWeights(
      [tf.constant(w) for w in weights[0][:n_trainable]],
      [tf.constant(w) for w in weights[0][n_trainable:]],
    )
    updated = []
    for dataset in datasets:
      result, _ = client_work.train_locally(
        model, optimizer, initial, dataset, tf.constant(lr, tf.float32), config
      )
      updated.append([w - d for w, d in zip(weights[0], flat_weights(result.update))])
    weights[0] = average(updated, counts)

  return Variant("train_locally (no TFF)", run_round, lambda: weights[0])


def process_variant(name, initialize, next_fn, weights_fn, keras_initial) -> Variant:
  """A TFF process from `initialize()` (in the current TFF context)."""
  state = [initialize()]
  initial_diff = max_difference(flat_weights(weights_fn(state[0])), keras_initial)
  if initial_diff > 0:
    print(f"warning: {name} starts {initial_diff:g} away from Keras' weights")

  def run_round():
    state[0] = next_fn(state[0])

  return Variant(name, run_round, lambda: flat_weights(weights_fn(state[0])))


def machine_busy_seconds() -> float:
  """CPU seconds all processes of the machine have used since boot."""
  with open("/proc/stat") as f:
    fields = [int(v) for v in f.readline().split()[1:]]
  # user nice system idle iowait irq softirq steal ...: all but idle, iowait.
  busy = sum(fields[:8]) - fields[3] - fields[4]
  return busy / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
  """CPU seconds of this process and its reaped children (the TFF workers)."""
  t = os.times()
  return t.user + t.system + t.children_user + t.children_system


def table(variants: list[Variant], baseline: float) -> list[str]:
  rows = [
    "| variant | median s/round | min | max | rounds | ratio to plain "
    "Keras | CPU s/round: Python / TFF worker | max abs weight diff to "
    "Keras after round 1 | median load avg |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for v in variants:
    diff = "-" if v.weight_diff is None else f"{v.weight_diff:.1e}"
    own, worker = v.median_cpu()
    rows.append(
      f"| {v.name} | {v.median:.3f} | {min(v.seconds):.3f} | "
      f"{max(v.seconds):.3f} | {len(v.seconds)} | {v.median / baseline:.2f} "
      f"| {own:.2f} / {worker:.2f} | {diff} | "
      f"{statistics.median(v.loads):.2f} |"
    )
  return rows


def summarize(variants: list[Variant], keras: Variant) -> list[str]:
  """The findings of the table, as Markdown bullets."""
  by_name = {v.name: v for v in variants}
  cpu = lambda v: sum(v.median_cpu())
  lines = []
  for prefix in ("ours", "tff_stock"):
    runs = sorted((v for v in variants if v.name.startswith(prefix + ",")), key=lambda v: v.median)
    if not runs:
      continue
    best = runs[0]
    lines.append(
      f"- {prefix}: fastest with {best.name.split(', ')[1]} ("
      + ", ".join(
        f"{v.name.split(', ')[1]}: {v.median:.2f} s wall, {cpu(v):.2f} CPU s" for v in runs
      )
      + ")."
    )
    within = best.median <= 1.5 * keras.median
    lines.append(
      f"- {prefix} / plain Keras: {best.median / keras.median:.2f}x wall "
      f"time (best setting), {cpu(best) / cpu(keras):.2f}x CPU time: "
      f"{'within' if within else 'NOT within'} 1.5x."
    )
  transfers = [v for v in variants if v.name.startswith("model to worker")]
  ours = [v for v in variants if v.name.startswith("ours,")]
  if transfers and ours:
    transfer = min(v.median for v in transfers)
    extra = min(v.median for v in ours) - keras.median
    lines.append(
      f"- Moving the model state to the TFF worker and back (serializing it "
      f"both ways) costs {transfer:.2f} s a round; ours' best round takes "
      + (f"{extra:.2f} s more than Keras'." if extra > 0 else f"{-extra:.2f} s less than Keras'.")
    )
  local = by_name.get("train_locally (no TFF)")
  if local:
    lines.append(
      f"- Our client math without TFF (train_locally) takes "
      f"{local.median / keras.median:.2f}x the wall time and "
      f"{cpu(local) / cpu(keras):.2f}x the CPU time of Keras' fit."
    )
  return lines


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  load_at_start = os.getloadavg()
  started = datetime.datetime.now().astimezone()
  wall_start, busy_start, own_start = (time.perf_counter(), machine_busy_seconds(), own_seconds())
  logging.set_verbosity(logging.WARNING)  # TFF's keras_utils logs at INFO.
  data = femnist.load_data(FLAGS.data_dir)
  writers = data.train.client_ids[: FLAGS.clients]
  if len(writers) < FLAGS.clients:
    raise app.UsageError(
      f"--clients={FLAGS.clients}: the data has only {len(writers)} training writers"
    )
  counts = [data.train.num_examples(c) for c in writers]
  datasets = [
    tf.data.Dataset.from_tensor_slices((data.train.x[c], data.train.y[c])).batch(FLAGS.batch_size)
    for c in writers
  ]
  element_spec = simulation.batch_element_spec(femnist)
  model_fn = lambda k=0: femnist.build_model("cnn", seed=k)
  lr, warmup, rounds = FLAGS.learning_rate, FLAGS.warmup_rounds, FLAGS.rounds
  print(f"{len(writers)} writers, {sum(counts)} examples a round", flush=True)

  ours = algorithms.build_algorithm(
    "fedavg", model_fn, element_spec, client_work.LocalTrainingConfig(learning_rate=lr)
  )
  indices = np.arange(len(writers))

  def stock_model_fn():
    return tff.learning.models.from_keras_model(
      model_fn(),
      input_spec=element_spec,
      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=[tf.keras.metrics.SparseCategoricalAccuracy()],
    )

  stock = tff.learning.algorithms.build_weighted_fed_avg(
    stock_model_fn, client_optimizer_fn=tff.learning.optimizers.build_sgdm(lr)
  )
  weights_type = client_work.weights_type_of(model_fn)

  @tff.tensorflow.computation(weights_type)
  def identity(weights):
    return tf.nest.map_structure(tf.identity, weights)

  # Keras models made before TFF traces `model_fn` in a graph are invalid
  # after it ("Your Layer or Model is in an invalid state"): make them now.
  keras = keras_variant(model_fn, datasets, counts, lr)
  keras_initial = keras.weights()
  keras.run(timed=False)  # Its first warm-up round: the reference.
  keras_round1 = keras.weights()
  n_trainable = len(weights_type.trainable)
  initial_model_weights = tff.learning.models.ModelWeights(
    keras_initial[:n_trainable], keras_initial[n_trainable:]
  )
  local = train_locally_variant(model_fn, datasets, counts, lr)
  in_process = [keras, local]
  in_tff = []
  # Keras and train_locally run in every block too, interleaved with the TFF
  # variants (the worker idles meanwhile), so all ratios share the same load.
  for max_concurrent in (int(v) for v in FLAGS.max_concurrent):
    with runtime.execution_context(max_concurrent_computation_calls=max_concurrent):
      block = [
        process_variant(
          f"ours, max_concurrent={max_concurrent}",
          ours.process.initialize,
          lambda s: ours.next_fn(s, datasets, indices)[0],
          lambda s: ours.models_fn(s)[0],
          keras_initial,
        ),
        process_variant(
          f"tff_stock, max_concurrent={max_concurrent}",
          stock.initialize,
          lambda s: stock.next(s, datasets).state,
          stock.get_model_weights,
          keras_initial,
        ),
        # What every round pays to move the model to the worker and back.
        Variant(
          f"model to worker and back, max_concurrent={max_concurrent}",
          lambda: identity(initial_model_weights),
          None,
        ),
      ]
      run_interleaved(in_process + block, warmup, rounds, keras_round1)
      in_tff += block
  variants = in_process + in_tff
  for v in variants:
    print(f"{v.name}: median {v.median:.3f} s ({', '.join(f'{s:.2f}' for s in v.seconds)})")

  rows = table(variants, keras.median)
  findings = summarize(variants, keras)
  print("\n".join(rows + [""] + findings))
  machine = report.machine_description()
  nproc = int(machine["nproc"])
  wall = time.perf_counter() - wall_start
  others = (machine_busy_seconds() - busy_start) - (own_seconds() - own_start)
  others_share = max(others, 0.0) / (wall * nproc)
  print(
    f"other processes used {others:.0f} CPU s in {wall:.0f} s ({others_share:.0%} of {nproc} cores)"
  )
  if FLAGS.results:
    section = [
      SECTION,
      "",
      f"One FedAvg round of {len(writers)} fixed FEMNIST writers "
      f"({sum(counts)} examples), LEAF CNN, 1 epoch, batch "
      f"{FLAGS.batch_size}, SGD {lr}, server SGD 1.0: median wall time "
      f"of the timed rounds after {warmup} warm-up rounds per variant. The "
      "variants are timed round-robin, once per TFF context (max_concurrent "
      "setting), so Keras and train_locally have a timed round in every "
      "block; ratios are to the median of all plain-Keras rounds. Variants "
      "are described in `benchmarks/round_overhead.py`; `max_concurrent` is "
      "the TFF worker's `max_concurrent_computation_calls` (-1: no limit).",
      "",
      f"- date: {started:%Y-%m-%d %H:%M %Z}",
      f"- machine: nproc={machine['nproc']}, {machine['cpu']}, "
      f"RAM {machine['ram']}; Python {platform.python_version()}, "
      f"TensorFlow {tf.__version__}, TFF {tff.__version__}",
      f"- command (from the repository root): `uv run python {shlex.join(sys.argv)}`",
      "- load average (1, 5, 15 min) at start: "
      + ", ".join(f"{v:.2f}" for v in load_at_start)
      + "; at end: "
      + ", ".join(f"{v:.2f}" for v in os.getloadavg()),
      f"- CPU used by other processes during the run: {others:.0f} s in "
      f"{wall:.0f} s, {others_share:.0%} of the {nproc} cores (machine "
      "CPU time from /proc/stat less this process' and its TFF workers')",
      "",
      *rows,
      "",
      *findings,
      "",
      "CPU s/round are medians of the CPU time of this Python process and "
      "of its TFF worker process during a round (all threads): they depend "
      "less than wall time on other jobs (shared caches and threads "
      "spinning while they wait still shift them). Under load, the worker "
      "with more busy threads (max_concurrent=-1) gets a larger share of "
      "the cores from the scheduler, which favours it in wall time: compare "
      "the CPU times too. The load average is the median 1-minute one "
      "before the variant's timed rounds; it includes this benchmark's own "
      "load (one to two on its own).",
      "",
    ]
    if load_at_start[0] > 0.5 * nproc or others_share > 0.1:
      section += [
        "**Other jobs were running on the machine** (see the load average "
        "at start and the CPU used by other processes): absolute times are "
        "inflated and noisy and the ratios less so, but re-measure on an "
        "idle machine before relying on small differences.",
        "",
      ]
    report.write_section(FLAGS.results, SECTION, "\n".join(section))
    print(f"wrote {FLAGS.results}")


if __name__ == "__main__":
  app.run(main)
