"""Tests of `tff_ens.execution.runtime` with real TFF workers and computations (no mocks)."""

import collections
import contextlib
import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import portpicker
import psutil
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tasks import femnist
from tests import numpy_references
from tests import worker_processes
from tests.femnist_runs import DATA_DIR
from tests.femnist_runs import QUICK
from tests.femnist_runs import reference_test_metrics
from tff_ens.execution import client_values
from tff_ens.execution import resident_state
from tff_ens.execution import runtime
from tff_ens.execution import worker_process
from tff_ens.program import reporting
from tff_ens.program import training

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The fixtures every test here uses (pytest finds them by name).
no_stray_workers = worker_processes.no_stray_workers
two_workers = worker_processes.two_workers


@tff.tensorflow.computation(np.int32)
def _busy_double(x):
  """`x * 2`, after ~2.4 GFLOP of work that cannot be folded away."""
  m = tf.random.stateless_normal([200, 200], seed=tf.stack([x, 0]))
  for _ in range(150):
    m = tf.linalg.normalize(m @ m)[0]
  return x * 2 + tf.cast(tf.math.is_nan(tf.reduce_sum(m)), tf.int32)


@tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
def _busy_sum_of_doubles(xs):
  return tff.federated_sum(tff.federated_map(_busy_double, xs))


@tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
def _doubles_at_clients(xs):
  return tff.federated_map(worker_processes.double, xs)


def test_worker_binary_path_is_the_one_in_the_tff_wheel():
  path = worker_process.worker_binary_path()
  assert path.endswith(os.path.join("tensorflow_federated", "data", "worker_binary"))
  assert os.access(path, os.X_OK)


def test_local_context_runs_computations_and_stops_its_worker():
  with runtime.execution_context():
    assert worker_processes.sum_of_doubles([1, 2, 3]) == 12
    assert worker_processes.double(21) == 42
    # Ours is the only worker: TFF's default context did not start one.
    (worker,) = worker_processes.descendants()
    # Its output goes to /dev/null, not to pytest's pipes.
    for fd in (1, 2):
      assert os.readlink(f"/proc/{worker.pid}/fd/{fd}") == "/dev/null"
    # It runs with few malloc arenas, unless the caller chose a number.
    assert worker.environ().get("MALLOC_ARENA_MAX") == os.environ.get(
      "MALLOC_ARENA_MAX", worker_process.WORKER_MALLOC_ARENAS
    )
  assert worker_processes.is_gone(worker.pid)
  assert not worker_processes.descendants()


def test_changing_cohort_sizes_reuse_one_worker_correctly():
  # Each new cohort size closes the previous executor on the worker
  # (benchmarks/worker_memory.py measures the memory that frees); values of
  # later calls are still right, also back at an earlier size.
  with runtime.execution_context():
    for n in (2, 3, 2, 5, 3):
      assert worker_processes.sum_of_doubles(list(range(n))) == n * (n - 1)
    (worker,) = worker_processes.descendants()
  assert worker_processes.is_gone(worker.pid)


def test_local_context_disposes_values_as_soon_as_python_drops_them():
  # TFF's default batches 20 disposals, so the worker kept the values of the last
  # few calls, and with them those calls' per-client values (every client's update
  # of a server step's collect).
  with runtime.execution_context():
    assert worker_processes.sum_of_doubles([1, 2]) == 6
    executors = runtime.current_worker().executors
    assert executors
    assert all(e._dispose_batch_size == 1 for e in executors)


def test_previous_context_is_restored():
  before = tff.framework.get_context_stack().current
  with runtime.execution_context():
    assert tff.framework.get_context_stack().current is not before
  assert tff.framework.get_context_stack().current is before


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_exception_in_block_stops_worker(error):
  with pytest.raises(error):
    with runtime.execution_context(max_concurrent_computation_calls=1):
      assert worker_processes.sum_of_doubles([4, 5]) == 18
      (worker,) = worker_processes.descendants()
      raise error("boom")
  assert worker_processes.is_gone(worker.pid)


def test_computation_fails_instead_of_hanging_when_worker_dies():
  with runtime.execution_context():
    assert worker_processes.sum_of_doubles([1]) == 2
    (worker,) = worker_processes.descendants()
    worker.kill()
    with pytest.raises(RuntimeError, match="exited with code"):
      # Same cardinality: the cached executor fails first.
      worker_processes.sum_of_doubles([5])


_CHILD_PREAMBLE = """
import signal
import time
import numpy as np
import psutil
import tensorflow as tf
import tensorflow_federated as tff
from tff_ens.execution import runtime
from tff_ens.execution import worker_process

# KeyboardInterrupt on SIGINT even if pytest runs with SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

@tff.tensorflow.computation(np.int32)
def slow(x):  # x, after a few seconds of matrix products.
  m = tf.random.stateless_normal([300, 300], seed=tf.stack([x, 0]))
  body = lambda i, m: (i + 1, tf.linalg.normalize(m @ m)[0])
  _, m = tf.while_loop(lambda i, m: i < 3000, body, (0, m))
  return x + tf.cast(tf.math.is_nan(tf.reduce_sum(m)), tf.int32)

@tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
def total(xs):
  return tff.federated_sum(xs)

@tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
def slow_total(xs):
  return tff.federated_sum(tff.federated_map(slow, xs))
"""


@contextlib.contextmanager
def _child_in_block(body: str):
  """Runs `body` in a child Python inside `execution_context()`.

  Yields the child (stdout piped) and its worker's pid, which the child prints
  before running `body`; kills the child at the end.
  """
  code = (
    _CHILD_PREAMBLE
    + textwrap.dedent("""
      with runtime.execution_context():
        assert total([1, 2, 3]) == 6
        (worker,) = [c for c in psutil.Process().children(recursive=True)
                     if c.cmdline()[:1] == [worker_process.worker_binary_path()]]
        print(worker.pid, flush=True)
  """)
    + textwrap.indent(textwrap.dedent(body), "  ")
  )
  with tempfile.TemporaryFile() as child_stderr:
    child = subprocess.Popen(
      [sys.executable, "-c", code],
      cwd=_REPO_ROOT,
      stdout=subprocess.PIPE,
      stderr=child_stderr,
      text=True,
    )
    try:
      line = child.stdout.readline()
      if not line:
        child_stderr.seek(0)
        pytest.fail(f"child failed: {child_stderr.read()[-3000:]!r}")
      worker_pid = int(line)
      worker_processes.SEEN_PIDS.add(worker_pid)
      assert worker_processes.is_worker(psutil.Process(worker_pid))
      yield child, worker_pid
    finally:
      child.kill()
      child.wait()
      child.stdout.close()


@pytest.mark.slow
def test_worker_dies_when_its_parent_is_sigkilled():
  with _child_in_block("time.sleep(600)") as (child, worker_pid):
    child.kill()
    child.wait()
    assert worker_processes.wait_gone(worker_pid, timeout_s=5)
    # Nothing else holds the child's stdout pipe open (the worker did not
    # inherit it), so reading it ends.
    worker_processes.read_to_end(child.stdout, timeout_s=5)


@pytest.mark.slow
def test_sigint_during_a_computation_stops_the_worker():
  body = """
      import atexit
      # Runs after the block's exit, before PDEATHSIG could do the work.
      atexit.register(lambda: print(
          'worker', 'alive' if psutil.pid_exists(worker.pid) else 'gone'))
      try:
        slow_total([1, 2, 3, 4])
      except KeyboardInterrupt:
        print('interrupted', flush=True)
        raise
  """
  with _child_in_block(body) as (child, worker_pid):
    time.sleep(1)  # Let the computation start.
    child.send_signal(signal.SIGINT)
    assert worker_processes.read_to_end(child.stdout, 30) == "interrupted\nworker gone\n"
    child.wait(timeout=30)
    assert child.returncode != 0
    assert worker_processes.is_gone(worker_pid)


def test_two_workers_split_clients_and_agree_with_local(two_workers):
  addresses, local_workers = two_workers
  clients = list(range(1, 7))
  with runtime.execution_context():
    local = _busy_sum_of_doubles(clients)
  assert local == 42
  with runtime.execution_context(workers=addresses):
    assert _busy_sum_of_doubles(clients) == local  # Warm-up (compilation).
    workers = [psutil.Process(w.pid) for w in local_workers]
    cpu_before = [sum(w.cpu_times()[:2]) for w in workers]
    assert _busy_sum_of_doubles(clients) == local
    cpu_used = [sum(w.cpu_times()[:2]) - b for w, b in zip(workers, cpu_before)]
    assert worker_processes.double(5) == 10
  # Each worker computed some of the clients.
  assert min(cpu_used) > 0.2 * max(cpu_used), cpu_used
  # Our workers are still serving; the context only disconnected.
  assert all(w.process.poll() is None for w in local_workers)


def test_two_workers_refuse_clients_placed_results(two_workers):
  addresses, _ = two_workers
  with runtime.execution_context(workers=addresses):
    with pytest.raises(ValueError, match="CLIENTS-placed"):
      _doubles_at_clients([1, 2, 3])
  with runtime.execution_context(workers=addresses[:1]):
    assert _doubles_at_clients([1, 2, 3]) == [2, 4, 6]


@pytest.mark.slow
def test_two_workers_run_a_tff_learning_round_like_local(two_workers):
  addresses, _ = two_workers

  def model_fn():
    keras_model = tf.keras.Sequential(
      [
        tf.keras.layers.Input((4,)),
        tf.keras.layers.Dense(3),
      ]
    )
    return tff.learning.models.from_keras_model(
      keras_model,
      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      input_spec=collections.OrderedDict(
        x=tf.TensorSpec([None, 4], tf.float32),
        y=tf.TensorSpec([None], tf.int32),
      ),
    )

  def client_data(seed):
    rng = np.random.default_rng(seed)
    return tf.data.Dataset.from_tensor_slices(
      collections.OrderedDict(
        x=rng.normal(size=(12, 4)).astype(np.float32),
        y=rng.integers(0, 3, 12).astype(np.int32),
      )
    ).batch(4)

  process = tff.learning.algorithms.build_weighted_fed_avg(
    model_fn, client_optimizer_fn=tff.learning.optimizers.build_sgdm(0.1)
  )
  data = [client_data(i) for i in range(5)]
  # `get_model_weights` is a computation too: outside a block it would run in
  # TFF's default context, which starts a worker of its own.
  with runtime.execution_context():
    state = process.initialize()
    local = process.next(state, data)
    local_weights = process.get_model_weights(local.state).trainable
  with runtime.execution_context(workers=addresses):
    merged = process.next(state, data)
    merged_weights = process.get_model_weights(merged.state).trainable
  tf.nest.map_structure(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    local_weights,
    merged_weights,
  )
  assert (
    local.metrics["client_work"]["train"]["num_examples"]
    == merged.metrics["client_work"]["train"]["num_examples"]
    == 60
  )


def test_unreachable_worker_gives_one_line_error_quickly():
  address = f"127.0.0.1:{portpicker.pick_unused_port()}"
  start = time.monotonic()
  with pytest.raises(RuntimeError) as error:
    with runtime.execution_context(workers=[address]):
      pytest.fail("entered the block without a worker")
  assert time.monotonic() - start < 30
  message = str(error.value)
  assert address in message
  assert "\n" not in message


def test_concurrency_limit_is_for_local_workers_only(two_workers):
  addresses, _ = two_workers
  with pytest.raises(ValueError, match="start_worker"):
    with runtime.execution_context(workers=addresses, max_concurrent_computation_calls=2):
      pass


_COUNTER_STATE = tff.FederatedType(
  collections.OrderedDict(rounds=np.int32, totals=tff.TensorType(np.float32, [3])), tff.SERVER
)


@tff.tensorflow.computation(_COUNTER_STATE.member, np.int32)
def _count(state, total):
  return collections.OrderedDict(
    rounds=state["rounds"] + 1, totals=state["totals"] * 0.5 + tf.cast(total, tf.float32)
  )


@tff.federated_computation(_COUNTER_STATE, tff.FederatedType(np.int32, tff.CLIENTS))
def _counter_next(state, xs):
  """A stateful round: rounds + 1, totals halved plus sum(2 x) over clients."""
  total = tff.federated_sum(tff.federated_map(worker_processes.double, xs))
  metrics = collections.OrderedDict(total=total)
  return (tff.federated_map(_count, (state, total)), tff.federated_zip(metrics))


_INITIAL_COUNTER = collections.OrderedDict(
  rounds=np.int32(0), totals=np.array([1.0, -2.0, 0.25], np.float32)
)


def _plain_rounds(cohorts):
  state, totals = _INITIAL_COUNTER, []
  for xs in cohorts:
    state, metrics = _counter_next(state, xs)
    totals.append(metrics["total"])
  return state, totals


@pytest.mark.parametrize("several_workers", [False, True])
def test_resident_state_matches_state_through_python(several_workers, two_workers):
  # Cohort sizes change (the state moves to a new executor), and the state
  # is read between rounds, as the CLI does for checkpoints.
  cohorts = [[1, 2], [3, 4, 5], [6, 7, 8], [1, 2], [9]]
  addresses = two_workers[0] if several_workers else ()
  with runtime.execution_context():
    expected_state, expected_totals = _plain_rounds(cohorts)
  with runtime.execution_context(workers=addresses):
    # Copied before every round but the first and those after a read.
    held = resident_state.ResidentState(_counter_next, _INITIAL_COUNTER, max_growth_bytes=0)
    totals, read = [], []
    for i, xs in enumerate(cohorts):
      totals.append(held.next(xs)["total"])
      if i in (1, 2):
        read.append(held.value["rounds"])
    state = held.value
  assert totals == expected_totals == [6, 24, 42, 6, 18]
  assert read == [2, 3]
  assert isinstance(state, collections.OrderedDict)
  assert state["rounds"] == expected_state["rounds"] == 5
  np.testing.assert_array_equal(state["totals"], expected_state["totals"])
  assert state["totals"].dtype == np.float32


def test_resident_state_with_a_dead_worker_gives_one_line_error():
  with runtime.execution_context():
    held = resident_state.ResidentState(_counter_next, _INITIAL_COUNTER)
    assert held.next([1, 2])["total"] == 6
    (worker,) = worker_processes.descendants()
    worker.kill()
    with pytest.raises(worker_process.WorkerError, match="exited with code -9") as error:
      held.next([3, 4])
  assert "\n" not in str(error.value)
  assert "out-of-memory killer" in str(error.value)


_BIG = 2_500_000  # float32s: 10 MB.
# A nested state, as a process's: named and unnamed structures, an empty one.
_BIG_STATE = tff.FederatedType(
  tff.StructType(
    [
      ("big", tff.TensorType(np.float32, [_BIG])),
      ("empty", tff.StructType([])),
      ("pair", tff.StructType([tff.TensorType(np.int32), tff.TensorType(np.float32, [2])])),
    ]
  ),
  tff.SERVER,
)


@tff.tensorflow.computation(np.int32)
def _expand(x):
  return tf.fill([_BIG], tf.cast(x, tf.float32))


@tff.tensorflow.computation(_BIG_STATE.member, _BIG_STATE.member[0])
def _shift(state, total):
  rounds, pair = state.pair
  return collections.OrderedDict(
    big=state.big * 0.5 + total, empty=(), pair=(rounds + 1, pair + total[:2])
  )


@tff.federated_computation(_BIG_STATE, tff.FederatedType(np.int32, tff.CLIENTS))
def _big_next(state, xs):
  """Each client makes a 10 MB value; the state is halved plus their sum."""
  total = tff.federated_sum(tff.federated_map(_expand, xs))
  return tff.federated_map(_shift, (state, total)), tff.federated_sum(xs)


_BIG_INITIAL = collections.OrderedDict(
  big=np.zeros(_BIG, np.float32), empty=(), pair=(np.int32(0), np.ones(2, np.float32))
)


def _held_run(max_growth_bytes, rounds):
  """(worker's RSS after each held round, final state, the cut's period)."""
  with runtime.execution_context():
    (worker,) = worker_processes.descendants()
    held = resident_state.ResidentState(_big_next, _BIG_INITIAL, max_growth_bytes=max_growth_bytes)
    rss = []
    for _ in range(rounds):
      held.next([1, 2, 3])
      rss.append(worker.memory_info().rss)
    return np.array(rss, np.float64), held.value, held.cut_every


def test_resident_state_cuts_the_workers_chain_of_held_states():
  # TFF's worker keeps a call's per-client values alive while a state derived
  # from the call is, back to the last fresh state: held without a cut, three
  # clients' 10 MB values pile up round after round (measured: 27 MB a round).
  # With a 20 MB budget the state is copied from its bytes on the worker every
  # few rounds; with 0, every round. How flat the worker's memory then
  # stays is measured by benchmarks/resident_memory.py, not here: the plateau's
  # height varies with the machine's load (CI once measured it still rising by
  # 100 MB with a cut every few rounds).
  rounds = 24
  rss_uncut, state_uncut, uncut_every = _held_run(2**40, rounds)
  _, state_cut, cut_every = _held_run(20 * 2**20, rounds)
  rss_copied, state_copied, copied_every = _held_run(0, rounds)
  uncut_growth = rss_uncut.max() - rss_uncut[0]
  assert uncut_every is None
  assert cut_every is not None and cut_every <= 4
  assert copied_every == 1
  # Less than the uncut chain; by how much varies with the load (a run of the whole suite
  # once measured 220 MB for the copies against 350 MB uncut, another 220 against 860, a
  # loaded one 90 MB uncut):
  # benchmarks/resident_memory.py measures it.
  assert rss_copied.max() - rss_copied[0] < uncut_growth
  # The copies, made tensor by tensor, keep every tensor in its place.
  for state in (state_cut, state_copied):
    assert list(state) == ["big", "empty", "pair"]
    np.testing.assert_array_equal(state["big"], state_uncut["big"])
    assert state["pair"][0] == state_uncut["pair"][0] == rounds
    np.testing.assert_array_equal(state["pair"][1], state_uncut["pair"][1])
  # Every round adds 1 + 2 + 3 to half the previous value.
  np.testing.assert_allclose(state_cut["big"][:3], 12 * (1 - 0.5**rounds), rtol=1e-6)
  np.testing.assert_array_equal(state_cut["pair"][1], 1 + 6 * rounds)


def test_resident_state_copies_through_a_file_or_through_python_alike(monkeypatch, tmp_path):
  # A local worker copies its held state through a file in memory, or in the temporary
  # directory when memory has no room for it, or else through this process: the same
  # state each way, and no file left behind; a copy directory a killed process left there
  # over an hour ago is removed, another process's copy under way and other files are not.
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  left_behind, other = tmp_path / "tff_ens_state_left", tmp_path / "other"
  under_way = tmp_path / "tff_ens_state_under_way"
  for directory, age in [(left_behind, 7200), (other, 7200), (under_way, 0)]:
    directory.mkdir()
    (directory / "state.index").write_bytes(b"x")
    os.utime(directory, (time.time() - age,) * 2)
  made = []
  temporary_directory = tempfile.TemporaryDirectory

  def recorded(*args, **kwargs):
    directory = temporary_directory(*args, **kwargs)
    made.append(pathlib.Path(directory.name))
    return directory

  monkeypatch.setattr(tempfile, "TemporaryDirectory", recorded)
  states, places, in_memory = [], [], None
  with runtime.execution_context():
    # Through this process, through a file in memory, then with no room in memory.
    for in_files, memory_full in [(False, False), (True, False), (True, True)]:
      if memory_full:
        monkeypatch.setattr(resident_state, "_free_bytes", lambda directory: 0)
      made.clear()
      held = resident_state.ResidentState(
        _big_next, _BIG_INITIAL, max_growth_bytes=0, copy_in_files=in_files
      )
      if in_files and not memory_full:
        # A machine whose memory has no room for the 10 MB state copies it in the temporary
        # directory.
        in_memory = resident_state._copy_directory(held._state_bytes)
      for _ in range(3):
        held.next([1, 2, 3])
      states.append(held.value)
      places.append({directory.parent for directory in made})
      assert len(made) == (2 if in_files else 0)  # Before rounds 2 and 3.
      assert not any(directory.exists() for directory in made)
  assert places[0] == set()
  assert places[1] == {pathlib.Path(in_memory or tmp_path)}
  assert places[2] == {tmp_path}
  assert not left_behind.exists() and other.exists() and under_way.exists()
  for state in states[1:]:
    np.testing.assert_array_equal(state["big"], states[0]["big"])
    np.testing.assert_array_equal(state["pair"][1], states[0]["pair"][1])
    assert state["pair"][0] == states[0]["pair"][0] == 3


@pytest.mark.parametrize(
  "algorithm", [{"algorithm": "fedavg"}, {"algorithm": "fedensemble", "ensemble_size": 2}]
)
def test_a_run_writes_its_summary_after_its_worker_has_stopped(algorithm, monkeypatch, tmp_path):
  # The final evaluation does not add to the worker's memory: the worker is gone by then,
  # and the summary needs no TFF context (none is installed outside the run's). FedAvg's
  # model comes from the state by a TFF computation (`get_model_weights`), Fed-ensemble's
  # members in Python.
  workers_at_summary = []
  write_summary = reporting.write_summary

  def recording_write_summary(*args, **kwargs):
    workers_at_summary.append(worker_processes.descendants())
    return write_summary(*args, **kwargs)

  monkeypatch.setattr(reporting, "write_summary", recording_write_summary)
  config = dataclasses.replace(
    QUICK, rounds=1, clients_per_round=2, output_dir=str(tmp_path), **algorithm
  )
  summary = training.run_experiment(config)
  assert workers_at_summary == [[]]
  # The summary's accuracy is that of the model(s) it saved, predicted apart from the run.
  x, y = femnist.load_data(DATA_DIR).test.concatenated()
  expected, _ = reference_test_metrics(numpy_references.saved_models(tmp_path), x, y)
  assert summary["test_accuracy"] == pytest.approx(expected, abs=1e-9)
  assert summary["algorithm"] == algorithm["algorithm"]


def _recorded_cohorts(monkeypatch) -> list[int]:
  """The CLIENTS cardinality of every executor made on a worker from now on."""
  seen = []
  set_cardinalities = tff.framework.RemoteExecutor.set_cardinalities

  def recording(self, cardinalities):
    seen.append(cardinalities.get(tff.CLIENTS, 0))
    return set_cardinalities(self, cardinalities)

  monkeypatch.setattr(tff.framework.RemoteExecutor, "set_cardinalities", recording)
  return seen


@pytest.mark.parametrize("name", ["fedavg", "fedensemble"])
def test_a_round_in_chunks_equals_the_round_in_one_call(name, monkeypatch):
  # Seven clients in chunks of at most 3 (three chunks, merged as they finish) against one
  # call: the same models and metrics up to float summation order, and the worker saw no
  # executor for more than 3 clients. The state is held on the worker (ResidentState) for
  # the whole round and goes through the context for the chunked one.
  from tff_ens import algorithms
  from tff_ens.templates import client_work
  from tiny import SPEC
  from tiny import one_batch
  from tiny import tiny_model

  algorithm = algorithms.build_algorithm(
    name,
    lambda k=0: tiny_model(seed=10 * k),
    SPEC,
    client_work.LocalTrainingConfig(learning_rate=0.5),
    seed=1,
    clients_per_round=7,
    **({"ensemble_size": 2} if name == "fedensemble" else {}),
  )
  rng = np.random.default_rng(0)
  datasets = [
    one_batch(rng.normal(size=(n, 4)), rng.integers(0, 3, n)) for n in (2, 3, 1, 4, 2, 3, 2)
  ]
  clients = np.arange(7)
  # The chunked round takes its datasets made when their chunk is sent (the program's).
  made = []
  lazy = client_values.ClientValues(lambda k: made.append(k) or datasets[k], range(7))
  results = {}
  for chunk in (0, 3):
    seen = _recorded_cohorts(monkeypatch)
    with runtime.execution_context(clients_per_chunk=chunk):
      initial = algorithm.process.initialize()
      before = tf.nest.flatten(algorithm.models_fn(initial))
      held = resident_state.ResidentState(algorithm.process.next, initial)
      args = algorithm.next_args(datasets if chunk == 0 else lazy, clients)
      assert made == []
      outputs = held.next(*args)
      results[chunk] = (algorithm.models_fn(held.value), algorithm.result(outputs).metrics)
    assert max(seen) == (7 if chunk == 0 else 3), seen
  # Chunk by chunk (3, 2 and 2 clients), then the first chunk's again for the merged
  # result's step (TFF's `after_merge` takes the first chunk's argument).
  assert made == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2], made
  whole, chunked = (tf.nest.flatten(results[c]) for c in (0, 3))
  assert len(whole) == len(chunked) > 4
  for a, b in zip(whole, chunked):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  assert not np.allclose(before[0], tf.nest.flatten(results[3][0])[0])  # It trained.
