r"""Round time and worker memory of Fed-ensemble against FedAvg.

  uv run python benchmarks/ensemble_round.py [--rounds=5] [--warmup_rounds=1] [--passes=2] \
      [--sizes=1,5] [--feddyn_sizes=5] [--deliveries=select,broadcast] \
      [--transports=files,values] [--places=worker,python]

The same 10 FEMNIST writers, LEAF CNN, 1 epoch, batch 20, SGD 0.05: the
median wall time of a round (after `--warmup_rounds` untimed ones) of `fedavg` and of
`fedensemble` with K in `--sizes` (and with FedDyn's local objective for K
in `--feddyn_sizes`), each with every `--member_delivery` of `--deliveries`
(the select of one member per client, or the broadcast of all K of which the
client keeps its own), all through the TFF C++ runtime of
`runtime.execution_context`, in the `--places` the state stays between
rounds: the worker (`resident_state.ResidentState`, as the CLI runs them) or Python
(`next` through the execution context, every round). Each variant runs alone
in a worker of its own, as a CLI run does, and `--passes` passes over the
variants (FedAvg, K=1, K=5, FedAvg, ...) spread slow periods of this shared
machine over all of them; the median is over all of a variant's timed
rounds, and the peak resident memory is its worker's over its rounds and the
copies of its state timed after them.
(Interleaved in one worker, as this benchmark first ran them, the variants
disturbed each other: K=5 took 3.64 s a round there, 2.71 s alone.) These
are a fresh worker's first rounds, slower than a run's later ones (a CLI
run's K=5 rounds 2-5 took 2.3-3.3 s, most later ones 1.4-2.0 s), so with
few `--warmup_rounds` the ratios here overstate a run's: `cli_round_time.py`
times whole CLI runs, and this benchmark splits the difference into its
parts. Each client trains one model in every variant, so the difference is
the server side: K models in the state, the per-client `federated_select` and the K-slot
`federated_aggregate`; with FedDyn also its clients' states (one model-sized
vector each), kept on disk as the CLI keeps them (`ClientStateStore`) and
moved with each `--client_transport` of `--transports`: files the
worker reads and writes, or values from Python to the worker and back.
Last, it times TFF's two ways of sending a model to the 10 clients, with the
models on the worker: `federated_select` of one of K LEAF CNNs per client
(Fed-ensemble's distributor) and `federated_broadcast` of one (FedAvg's);
and, to tell the select's cost per call from its cost per byte, the same
select of only the chosen model's first tensor (the LEAF CNN's first
convolution, 800 weights); and FedDyn's traffic alone: a model-sized state
per client from Python to the clients and back.
Writes the section "## Fed-ensemble round time" of `--results`.
"""

import functools
import statistics
import tempfile
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

import report
from tasks import femnist
from tff_ens import algorithms
from tff_ens.execution import resident_state
from tff_ens.execution import runtime
from tff_ens.program import client_states
from tff_ens.program import simulation
from tff_ens.templates import client_work
from tff_ens.templates import transport as transport_lib

SECTION = "## Fed-ensemble round time"

report.define_flags()
flags.DEFINE_integer("rounds", 5, "Timed rounds per variant and pass.")
flags.DEFINE_integer(
  "warmup_rounds",
  1,
  "Untimed rounds before them (tracing, caches; more: past a fresh worker's growth).",
  lower_bound=1,
)
flags.DEFINE_integer("passes", 2, "Passes over the variants.")
flags.DEFINE_list("sizes", ["1", "5"], "Ensemble sizes K to time.")
flags.DEFINE_list("feddyn_sizes", ["5"], "Ensemble sizes K to time with --local_objective=feddyn.")
flags.DEFINE_list(
  "deliveries", ["select", "broadcast"], "Fed-ensemble's --member_delivery values to time."
)
flags.DEFINE_list(
  "transports", ["files", "values"], "--client_transport values to time with FedDyn."
)
flags.DEFINE_list(
  "places", ["worker", "python"], "Where the state stays between rounds: worker (the CLI), python."
)
flags.DEFINE_list(
  "growth_mib",
  [str(resident_state.MAX_GROWTH_BYTES // 2**20)],
  "The held state's growth budgets (the CLI's --worker_growth_mib) to time with the state on "
  "the worker: 0 copies it every round.",
)

FLAGS = flags.FLAGS


class Rounds:
  """Runs an algorithm's rounds with its state on the worker or in Python, and its clients'
  states (FedDyn's) in a `ClientStateStore` under `directory`, as the CLI does."""

  def __init__(self, algorithm, on_worker: bool, directory: str, growth_mib: int = 0):
    self._algorithm = algorithm
    state = algorithm.process.initialize()
    self._held = resident_state.ResidentState(
      algorithm.process.next, state, max_growth_bytes=growth_mib * 2**20
    )
    self._state = None if on_worker else state
    self._round = 0
    self._store = None
    if algorithm.client_states is not None:
      self._store = client_states.ClientStateStore(directory, algorithm.client_states)
      self._key_state = state["distributor"]  # Which of its states each client trains.

  @property
  def cut_every(self) -> int | None:
    """Every how many rounds the held state is copied (`ResidentState.cut_every`)."""
    return self._held.cut_every

  def copy_seconds(self, in_files: bool) -> float:
    """Seconds to copy the held state once (`ResidentState.cut`), through a file on the
    worker or through this process."""
    self._held.copy_in_files = in_files
    start = time.perf_counter()
    self._held.cut()
    return time.perf_counter() - start

  def next(self, datasets):
    self._round += 1
    cohort = np.arange(len(datasets))
    keys = states = None
    if self._store is not None:
      keys = self._algorithm.client_states.keys_of(cohort, self._key_state)
      states = self._store.round_inputs(self._round, cohort, keys)
    args = self._algorithm.next_args(datasets, cohort, states=states)
    if self._state is None:
      outputs = self._held.next(*args)
    else:
      self._state, *outputs = resident_state.state_first(
        self._algorithm.process.next(self._state, *args)
      )
      outputs = tuple(outputs)
    result = self._algorithm.result(outputs)
    if self._store is not None:
      self._store.round_outputs(self._round, cohort, keys, result.client_states)
      self._key_state = result.metrics["distributor"]


def time_alone(build, on_worker: bool, datasets, rounds: int, growth_mib: int, warmup_rounds: int):
  """`rounds` rounds of `build()` in a fresh worker.

  Returns their wall and CPU seconds (after `warmup_rounds` untimed ones: tracing,
  caches, the worker's growth), the worker's peak resident bytes, the algorithm's bytes down
  and up per client and round, every how many rounds the held state was copied
  (`ResidentState.cut_every`; None: not within these rounds), and, with the state on the
  worker, the seconds of three copies of it after the rounds through a file and through this
  process, alternated (`Rounds.copy_seconds`; else empty).
  """
  wall, cpu = [], []
  with (
    runtime.execution_context(),
    report.PeakMemory(children=True) as memory,
    tempfile.TemporaryDirectory() as directory,
  ):
    algorithm = build()
    run = Rounds(algorithm, on_worker, directory, growth_mib)
    for _ in range(warmup_rounds):
      run.next(datasets)
    for _ in range(rounds):
      start, start_cpu = time.perf_counter(), report.cpu_seconds()
      run.next(datasets)
      wall.append(time.perf_counter() - start)
      cpu.append(report.cpu_seconds() - start_cpu)
    copies = {True: [], False: []}
    for _ in range(3 if on_worker else 0):
      for in_files in copies:
        copies[in_files].append(run.copy_seconds(in_files))
  return wall, cpu, memory.peak, algorithm.bytes_per_client_round(), run.cut_every, copies


def distribution_seconds(
  model_fn, ensemble_size: int, clients: int, rounds: int
) -> dict[str, float]:
  """Median seconds to send each client one of K models, or one model to all.

  Each client only sums its model's first tensor, so the time is TFF's
  moving of the models to the clients. "select_first_tensor" selects only
  the chosen model's first tensor: the same calls, few bytes.
  """
  k = ensemble_size

  @tff.tensorflow.computation
  def initial_members():
    return tuple(tuple(model_fn(i).trainable_weights) for i in range(k))

  members_type = tff.FederatedType(initial_members.type_signature.result, tff.SERVER)
  model_type = members_type.member[0]

  @tff.tensorflow.computation(members_type.member, np.int32)
  def select_member(members, key):
    return tf.switch_case(key, [lambda m=m: tuple(tf.identity(t) for t in m) for m in members])

  @tff.tensorflow.computation(members_type.member, np.int32)
  def select_first_tensor(members, key):
    return tf.switch_case(key, [lambda m=m: tf.identity(m[0]) for m in members])

  @tff.tensorflow.computation(tff.SequenceType(model_type))
  def first_sum_of_selected(models):
    return models.reduce(0.0, lambda s, m: s + tf.reduce_sum(m[0]))

  @tff.tensorflow.computation(tff.SequenceType(select_first_tensor.type_signature.result))
  def sum_of_selected_tensor(tensors):
    return tensors.reduce(0.0, lambda s, t: s + tf.reduce_sum(t))

  @tff.tensorflow.computation(model_type)
  def first_sum(model):
    return tf.reduce_sum(model[0])

  @tff.tensorflow.computation(members_type.member)
  def first_member(members):
    return members[0]

  @tff.tensorflow.computation(np.int32)
  def key_of(index):
    return tf.reshape(index % k, [1])

  clients_type = tff.FederatedType(np.int32, tff.CLIENTS)

  def selecting(select_fn, client_sum):
    @tff.federated_computation(members_type, clients_type)
    def select(members, indices):
      selected = tff.federated_select(
        tff.federated_map(key_of, indices),
        tff.federated_value(np.int32(k - 1), tff.SERVER),
        members,
        select_fn,
      )
      return members, tff.federated_sum(tff.federated_map(client_sum, selected))

    return select

  @tff.federated_computation(members_type, clients_type)
  def broadcast(members, indices):
    del indices
    model = tff.federated_broadcast(tff.federated_map(first_member, members))
    return members, tff.federated_sum(tff.federated_map(first_sum, model))

  @tff.tensorflow.computation(model_type)
  def plus_one(model):
    return tuple(t + 1.0 for t in model)

  @tff.federated_computation(members_type, tff.FederatedType(model_type, tff.CLIENTS))
  def client_states_through(members, states):
    return members, tff.federated_map(plus_one, states)

  seconds = {}
  indices = [np.int32(i) for i in range(clients)]
  states = [tuple(np.asarray(t) for t in model_fn(i).trainable_weights) for i in range(clients)]
  for name, comp, argument in [
    ("select", selecting(select_member, first_sum_of_selected), indices),
    ("select_first_tensor", selecting(select_first_tensor, sum_of_selected_tensor), indices),
    ("broadcast", broadcast, indices),
    ("client_states", client_states_through, states),
  ]:
    held = resident_state.ResidentState(comp, initial_members())
    held.next(argument)  # Untimed: uploads the models, compiles.
    times = []
    for _ in range(rounds):
      start = time.perf_counter()
      held.next(argument)
      times.append(time.perf_counter() - start)
    seconds[name] = statistics.median(times)
  return seconds


def main(argv):
  run = report.start(argv)
  data = femnist.load_data(FLAGS.data_dir)
  writers = data.train.client_ids[:10]
  datasets = [
    simulation.client_dataset(data.train.x[c], data.train.y[c], epochs=1, batch_size=20, seed=0)
    for c in writers
  ]
  model_fn = lambda k=0: femnist.build_model("cnn", seed=k)
  config = client_work.LocalTrainingConfig(learning_rate=0.05)
  variants = [
    (growth, name, k, objective, delivery, transport)
    # The held state's growth budget in MiB, None with the state in Python.
    for growth in [
      budget
      for place in FLAGS.places
      for budget in ([int(b) for b in FLAGS.growth_mib] if place == "worker" else [None])
    ]
    for name, k, objective, delivery, transport in [("fedavg", 1, "sgd", "select", None)]
    + [
      ("fedensemble", int(k), "sgd", delivery, None)
      for k in FLAGS.sizes
      for delivery in FLAGS.deliveries
    ]
    + [
      ("fedensemble", int(k), "feddyn", delivery, transport)
      for k in FLAGS.feddyn_sizes
      for delivery in FLAGS.deliveries
      for transport in FLAGS.transports
    ]
  ]
  wall = [[] for _ in variants]
  cpu = [[] for _ in variants]
  peaks = [0] * len(variants)
  transfers = [None] * len(variants)
  cut_every = [set() for _ in variants]
  copies = [{True: [], False: []} for _ in variants]
  for _ in range(FLAGS.passes):
    for i, (growth, name, k, objective, delivery, transport) in enumerate(variants):
      build = functools.partial(
        algorithms.build_algorithm,
        name,
        model_fn,
        simulation.batch_element_spec(femnist),
        config,
        num_clients=len(writers),
        transport=transport_lib.FILES if transport == "files" else transport_lib.VALUES,
        **algorithms.settings_read(
          name, ensemble_size=k, local_objective=objective, member_delivery=delivery
        ),
      )
      times, cpu_times, peak, transfers[i], cut, copy_times = time_alone(
        build, growth is not None, datasets, FLAGS.rounds, growth or 0, FLAGS.warmup_rounds
      )
      cut_every[i].add(cut)
      for in_files, seconds in copy_times.items():
        copies[i][in_files] += seconds
      wall[i] += times
      cpu[i] += cpu_times
      peaks[i] = max(peaks[i], peak)
      print(f"{variants[i]}: {', '.join(f'{t:.2f}' for t in times)} s", flush=True)
  k = max(int(size) for size in FLAGS.sizes + FLAGS.feddyn_sizes)
  with runtime.execution_context():
    moving = distribution_seconds(model_fn, k, len(datasets), FLAGS.rounds)
  print(f"models to {len(datasets)} clients: {moving}", flush=True)
  rows = []
  for variant, times, cpu_times, peak, (down, up), cuts, copy_times in zip(
    variants, wall, cpu, peaks, transfers, cut_every, copies
  ):
    growth, name, k, objective, delivery, transport = variant
    rows.append(
      (
        growth,
        f"{name}"
        + (f", K={k}" if name == "fedensemble" else "")
        + (f", FedDyn (states as {transport})" if objective == "feddyn" else "")
        + (f", {delivery}" if name == "fedensemble" else "")
        + (
          ", state through Python"
          if growth is None
          else ", state on the worker (CLI)"
          + (f", copied after {growth} MiB of growth" if growth else "")
        ),
        statistics.median(times),
        statistics.mean(times),
        statistics.median(cpu_times),
        peak,
        down,
        up,
        ", ".join("-" if c is None else str(c) for c in sorted(cuts, key=str)),
        " / ".join(f"{statistics.median(copy_times[f]):.2f}" for f in (True, False))
        if copy_times[True]
        else "-",
      )
    )
  # Ratios are to FedAvg run the same way (state in Python, or on the worker with the
  # same growth budget): the first row of each.
  baselines = {row[0]: row[2:5] for row in reversed(rows)}
  lines = [
    SECTION,
    "",
    "Ten fixed FEMNIST writers (LEAF CNN, 1 epoch, batch 20, SGD 0.05). "
    "Each variant runs alone in a TFF worker of its own, as a CLI run "
    f"does: {FLAGS.warmup_rounds} untimed round(s), then {FLAGS.rounds} timed ones, in "
    f"{FLAGS.passes} passes over the variants; the median is over the "
    f"{FLAGS.rounds * FLAGS.passes} timed rounds, the peak resident memory "
    "is the worker's, the copies timed after the rounds included. CPU seconds "
    "(this process and the worker, user + system) depend less on other load than "
    "wall time. The mean includes "
    "the rounds that copy the held state (`ResidentState`, every N rounds once a "
    "growth budget is measured; -: none in the timed rounds), which the median "
    "may leave out. The copy's seconds are medians of copies of the held state after a "
    "variant's rounds, alternated: through a file the worker writes and reads back (the "
    "CLI's) and through this process.",
    "",
    *report.run_facts(run, "benchmarks/ensemble_round.py"),
    "",
    "| variant | median s/round | ratio to FedAvg (same state place) | mean s/round | "
    "mean ratio | median CPU s/round | CPU ratio | state copied every N rounds | "
    "a copy's s: file / through Python | worker peak memory | bytes down / up per client |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for place, name, median, mean, median_cpu, peak, down, up, cuts, copy in rows:
    baseline, baseline_mean, baseline_cpu = baselines[place]
    lines.append(
      f"| {name} | {median:.2f} | {median / baseline:.2f} | {mean:.2f} | "
      f"{mean / baseline_mean:.2f} | {median_cpu:.2f} | {median_cpu / baseline_cpu:.2f} | "
      f"{cuts} | {copy} | {peak / 2**30:.2f} GiB | {down:,} / {up:,} |"
    )
  lines += [
    "",
    f"Sending the models to the {len(datasets)} clients, with the models "
    "on the worker (median seconds a round): `federated_select` of one of "
    f"K={k} LEAF CNNs per client {moving['select']:.2f} s, "
    f"`federated_broadcast` of one LEAF CNN {moving['broadcast']:.2f} s; "
    "`federated_select` of only the first tensor (800 weights) of one of "
    f"the K per client {moving['select_first_tensor']:.2f} s (the "
    "select's cost grows with the bytes it sends). A model-sized state per "
    "client (FedDyn's g) from Python to the clients and a changed one back "
    f"to Python: {moving['client_states']:.2f} s.",
  ]
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
