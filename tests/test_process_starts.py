"""Process starts run no fork handlers, so none can hang in gRPC's.

A process holding gRPC channels (a TFF context) runs gRPC's pthread_atfork pre-fork
handler in every fork(), and that handler can wait forever for gRPC's threads: a TFF
worker started with a `preexec_fn` (CPython then fork()s and runs Python in the child)
once hung the test suite inside `subprocess.Popen`. Every process the project starts is
started with vfork() or posix_spawn() (no `preexec_fn`, `user`, `group` or
`extra_groups`), which run no fork handlers: `tests.fork_hooks` counts the handlers that
do run, a stress loop starts many workers beside a live channel, and a scan of the
source finds no start that would fork.
"""

import ast
import concurrent.futures
import json
import pathlib
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
import tensorflow_federated as tff

from tests import fork_hooks
from tests import worker_processes
from tff_ens.execution import runtime
from tff_ens.execution import worker_process
from tff_ens.program import device_clients

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
NO_HANDLERS = {"python": 0, "c": 0}

no_stray_workers = worker_processes.no_stray_workers


def test_the_hooks_count_fork_and_not_vfork_or_posix_spawn():
  # In a fresh Python without gRPC, where a fork() cannot hang: CPython forks for a
  # preexec_fn (running the Python hooks too) and for user= (only the C ones), and
  # otherwise starts the child with vfork() or, close_fds=False, posix_spawn().
  script = textwrap.dedent("""
    import json, os, subprocess
    from tests import fork_hooks
    fork_hooks.install()
    starts = {
      "preexec_fn": dict(preexec_fn=lambda: None),
      "user": dict(user=os.getuid()),
      "plain": {},
      "close_fds=False": dict(close_fds=False),
      "start_new_session": dict(start_new_session=True),
      "process_group": dict(process_group=0),
      "cwd and env": dict(cwd="/", env={"A": "1"}),
    }
    result = {}
    for name, kwargs in starts.items():
      before = fork_hooks.counts()
      subprocess.run(["/bin/true"], check=True, **kwargs)
      result[name] = {k: v - before[k] for k, v in fork_hooks.counts().items()}
    print(json.dumps(result))
  """)
  out = subprocess.run(
    [sys.executable, "-c", script],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    check=True,
    timeout=60,
  ).stdout
  assert json.loads(out) == {
    "preexec_fn": {"python": 1, "c": 1},
    "user": {"python": 0, "c": 1},
    "plain": NO_HANDLERS,
    "close_fds=False": NO_HANDLERS,
    "start_new_session": NO_HANDLERS,
    "process_group": NO_HANDLERS,
    "cwd and env": NO_HANDLERS,
  }


def _start_a_worker():
  worker = worker_process.start_worker()
  worker_processes.SEEN_PIDS.add(worker.pid)
  worker_process.stop_worker(worker)


def _start_a_device(path: str):
  # A real device process (`_Device` is what DevicePool starts, and restarts in one of
  # its threads mid-round), given a missing model file: it starts, says nothing and exits.
  def start():
    with pytest.raises(device_clients.DeviceError, match="did not start"):
      device_clients._Device(path, device_clients.DEVICE_PYTHON)

  start()
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pool.submit(start).result()


def _handlers_run_by(start) -> dict:
  before = fork_hooks.counts()
  start()
  return {k: v - before[k] for k, v in fork_hooks.counts().items()}


needs_device_env = pytest.mark.skipif(
  not pathlib.Path(device_clients.DEVICE_PYTHON).exists(),
  reason="the device environment is not installed: uv sync --locked --project device",
)


@pytest.mark.parametrize("start", ["worker", pytest.param("device", marks=needs_device_env)])
def test_starts_beside_live_and_closed_channels_run_no_fork_handlers(start, tmp_path):
  fork_hooks.install()
  missing = str(tmp_path / "missing.tflite")
  start_fn = {"worker": _start_a_worker, "device": lambda: _start_a_device(missing)}[start]
  with runtime.execution_context():
    assert worker_processes.sum_of_doubles([1, 2]) == 6  # The context's channel is live.
    beside_live = _handlers_run_by(start_fn)
    (worker,) = worker_processes.descendants()
    worker.kill()  # The channel's server is gone; the channel is still open.
    assert worker_processes.wait_gone(worker.pid, timeout_s=10)
    beside_dead = _handlers_run_by(start_fn)
  # The context has closed its executors.
  beside_closed = _handlers_run_by(start_fn)
  assert beside_live == beside_dead == beside_closed == NO_HANDLERS


def _stress(rounds: int, serve_every: int, computations_on_workers: bool) -> float:
  """`rounds` times: two workers started while channels are live, then stopped.

  The local context's channel runs a computation every round; every `serve_every`
  rounds, the two workers are awaited through channels of their own (and, with
  `computations_on_workers`, run a computation split between them). Returns the seconds
  it took.
  """
  fork_hooks.install()
  before = fork_hooks.counts()
  start = time.monotonic()
  with runtime.execution_context():
    for i in range(rounds):
      assert worker_processes.sum_of_doubles([i, 1]) == 2 * (i + 1)
      workers, channels = [], []
      try:
        for _ in range(2):
          workers.append(worker_process.start_worker())
          worker_processes.SEEN_PIDS.add(workers[-1].pid)
        if i % serve_every == 0:
          for worker in workers:
            channels.append(grpc.insecure_channel(worker.address))
            stub = tff.framework.RemoteExecutorGrpcStub(channels[-1])
            worker_process.wait_until_serving(stub, worker.address, worker.process)
          if computations_on_workers:
            with runtime.execution_context(workers=[w.address for w in workers]):
              assert worker_processes.sum_of_doubles([i, 1, 2]) == 2 * (i + 3)
      finally:
        for worker in workers:
          worker_process.stop_worker(worker)
        for channel in channels:
          channel.close()
  assert fork_hooks.counts() == before
  return time.monotonic() - start


def test_many_worker_starts_beside_live_channels_never_hang():
  # The fork deadlock was a race (60 plain starts did not show it); this checks that
  # starts beside live channels stay fork-free and quick: 30 workers, 10 of them awaited.
  # The watchdog (tests/watchdog.py) turns a hang into a failure.
  assert _stress(rounds=15, serve_every=3, computations_on_workers=False) < 120


@pytest.mark.slow
@pytest.mark.timeout_seconds(900)
def test_many_worker_starts_running_computations_never_hang():
  _stress(rounds=60, serve_every=1, computations_on_workers=True)


# The source never starts a process in a way that forks --------------------------------

_SCANNED = ("tff_ens", "export", "tasks", "tests", "benchmarks")
_STARTS = {"Popen", "run", "call", "check_call", "check_output"}
# subprocess forks (and runs every fork handler) for these.
_FORKING_KEYWORDS = {"preexec_fn", "user", "group", "extra_groups"}
_FORKING_CALLS = {"fork", "forkpty", "ProcessPoolExecutor"}
_FORKING_MODULES = {"multiprocessing", "pty"}


def _forking_starts(path: pathlib.Path, root: pathlib.Path = REPO_ROOT) -> list[str]:
  text = path.read_text()
  words = ("preexec_fn", "user", "group", "fork", "ProcessPool", "multiprocessing", "pty")
  if not any(word in text for word in words):
    return []
  tree = ast.parse(text, filename=str(path))
  found = []
  for node in ast.walk(tree):
    where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
    if isinstance(node, ast.Call):
      name = getattr(node.func, "attr", getattr(node.func, "id", None))
      keywords = {k.arg for k in node.keywords}
      if "preexec_fn" in keywords or (name in _STARTS and keywords & _FORKING_KEYWORDS):
        found.append(f"{where}: {ast.unparse(node)[:80]}")
      elif name in _FORKING_CALLS:
        found.append(f"{where}: {ast.unparse(node)[:80]}")
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
      if any(str(m).split(".")[0] in _FORKING_MODULES for m in modules):
        found.append(f"{where}: imports {modules}")
  return found


def test_no_process_start_in_the_source_forks():
  files = [p for d in _SCANNED for p in sorted((REPO_ROOT / d).rglob("*.py"))]
  assert len(files) > 100
  found = [line for path in files for line in _forking_starts(path)]
  assert not found, "process starts that fork (and run gRPC's fork handlers):\n" + "\n".join(found)


def test_the_scan_finds_forking_starts(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text(
    "import multiprocessing\n"
    "subprocess.Popen(['x'], preexec_fn=f)\n"
    "subprocess.run(['x'], user='nobody')\n"
    "subprocess.run(['x'], start_new_session=True)\n"
    "os.fork()\n"
  )
  assert [line.split(":")[1] for line in _forking_starts(bad, tmp_path)] == ["1", "2", "3", "5"]
