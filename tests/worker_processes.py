"""The `worker_binary` processes of a test module: finding, awaiting, stopping.

Test modules that start TFF workers import `no_stray_workers` (autouse: no
worker before the module's tests, none left after), `two_workers`, and the
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

from tff_ens.execution import worker_process


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
  try:
    return any("data/worker_binary" in arg for arg in proc.cmdline())
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
  """Two worker services on free 127.0.0.1 ports, always stopped afterwards."""
  processes = []
  try:
    addresses = []
    for _ in range(2):
      port = portpicker.pick_unused_port()
      processes.append(worker_process.start_worker(port))
      SEEN_PIDS.add(processes[-1].pid)
      addresses.append(f"127.0.0.1:{port}")
    yield addresses, processes
  finally:
    for process in processes:
      worker_process.stop_worker(process)
