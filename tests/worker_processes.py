"""The `worker_binary` processes of a test module: finding, awaiting, stopping.

Test modules that start TFF workers import `no_stray_workers` (autouse: no
worker before the module's tests, none left after), `two_workers` (isolated local
workers), `tls_workers` (worker services over mutual TLS, with `credentials`), and the
small computations below to run on them. A test that hangs is ended by the
watchdog (tests/watchdog.py).
"""

import threading
import time

import numpy as np
import portpicker
import psutil
import pytest
import tensorflow_federated as tff

from tff_ens.execution import tls
from tff_ens.execution import worker_process
from tff_ens.execution import worker_service


@tff.tensorflow.computation(np.int32)
def double(x):
  return x * 2


@tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
def sum_of_doubles(xs):
  """The sum over the clients of 2 x, with any number of clients."""
  return tff.federated_sum(tff.federated_map(double, xs))


# Every worker pid a test saw, checked once more when its module ends.
SEEN_PIDS = set()


def is_worker(proc: psutil.Process) -> bool:
  """Whether `proc` runs TFF's worker binary (not a launcher naming it in its arguments)."""
  try:
    return proc.cmdline()[:1] == [worker_process.worker_binary_path()]
  except (psutil.NoSuchProcess, psutil.ZombieProcess):
    return False


def descendants() -> list[psutil.Process]:
  """Live worker_binary processes descending from this process."""
  workers = [c for c in psutil.Process().children(recursive=True) if is_worker(c)]
  SEEN_PIDS.update(w.pid for w in workers)
  return workers


def is_gone(pid: int) -> bool:
  try:
    return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return True


def is_live_worker(pid: int) -> bool:
  try:
    return not is_gone(pid) and is_worker(psutil.Process(pid))
  except psutil.NoSuchProcess:
    return False


def wait_gone(pid: int, timeout_s: float) -> bool:
  deadline_s = time.monotonic() + timeout_s
  while not is_gone(pid):
    if time.monotonic() > deadline_s:
      return False
    time.sleep(0.05)
  return True


def read_to_end(pipe, timeout_s: float):
  """All of `pipe` up to its end; TimeoutError if it does not end within `timeout_s`.

  (A test that merely might hang needs no timeout: the watchdog, tests/watchdog.py,
  ends a hung test.)
  """
  result = []
  reader = threading.Thread(target=lambda: result.append(pipe.read()), daemon=True)
  reader.start()
  reader.join(timeout_s)
  if not result:
    raise TimeoutError(f"the pipe did not end within {timeout_s:g} s")
  return result[0]


@pytest.fixture(scope="module", autouse=True)
def no_stray_workers():
  assert not descendants(), "worker_binary processes before the tests"
  yield
  assert not descendants()
  stray = [pid for pid in SEEN_PIDS if is_live_worker(pid)]
  assert not stray, f"worker_binary processes left running: {stray}"


@pytest.fixture
def two_workers():
  """Two isolated local workers (`worker_process.LocalWorker`s, reached at their `unix:`
  addresses), always stopped afterwards."""
  workers = []
  try:
    for _ in range(2):
      workers.append(worker_process.start_worker())
      SEEN_PIDS.add(workers[-1].pid)
    yield [w.address for w in workers], workers
  finally:
    for worker in workers:
      worker_process.stop_worker(worker)


@pytest.fixture(scope="module")
def credentials(tmp_path_factory):
  """A credentials directory (`tls.make`) for the module's worker services."""
  directory = str(tmp_path_factory.mktemp("credentials") / "run")
  tls.make(directory, [])
  return directory


@pytest.fixture
def tls_workers(credentials):
  """Two worker services (`worker_service.WorkerService`) on free loopback ports, serving
  mutual TLS with `credentials`, always stopped afterwards. Yields their addresses and the
  services."""
  services = []
  try:
    for _ in range(2):
      services.append(worker_service.WorkerService(portpicker.pick_unused_port(), credentials))
      SEEN_PIDS.add(services[-1].worker.pid)
    yield [f"localhost:{s.port}" for s in services], services
  finally:
    for service in services:
      service.stop()
