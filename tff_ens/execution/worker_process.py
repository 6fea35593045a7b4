"""TFF's C++ worker processes: starting, stopping and waiting for one.

`start_worker` runs the `worker_binary` shipped in the TFF wheel with its output away from
the caller's pipes and with `PR_SET_PDEATHSIG=SIGKILL`, so it dies with the thread that
started it even if Python is killed; `stop_worker` stops it; `wait_until_serving` waits
for a started or running worker's gRPC service. `runtime.execution_context` and
`python -m tff_ens.worker` use them.
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from typing import Optional

import tensorflow_federated as tff

# The local worker maps a ~300 MB binary and starts serving in well under a
# second; the timeout only matters when something is wrong.
_START_TIMEOUT_S = 60.0
# How long to wait for a gRPC connection to an already-running worker.
_CONNECT_TIMEOUT_S = 10.0
# Grace period between SIGINT and SIGKILL when stopping a worker.
STOP_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_libc = ctypes.CDLL(None, use_errno=True)


class WorkerError(RuntimeError):
  """A TFF worker did not come up, exited, or stopped answering."""


def worker_binary_path() -> str:
  """Path of the `worker_binary` shipped in the TFF wheel (as TFF finds it)."""
  path = os.path.join(os.path.dirname(tff.__file__), "data", "worker_binary")
  if not os.path.isfile(path):
    raise RuntimeError(f"Expected a TFF worker binary at {path}.")
  return path


def _die_with_parent(parent_pid: int):
  """A `preexec_fn` making the child get SIGKILL when its parent dies."""

  def preexec() -> None:
    # Ignored signals stay ignored across exec, and a parent started in the
    # background by a shell ignores SIGINT: `stop_worker` needs it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # A SIGTERM to the whole process group (systemd, `kill -- -PGID`) is for
    # the driver, which finishes its round, checkpoints and then stops the
    # worker; the worker must not die under the round in flight.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
      raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died between fork() and prctl(): then no signal
    # will ever come.
    if os.getppid() != parent_pid:
      os.kill(os.getpid(), signal.SIGKILL)

  return preexec


# glibc's MALLOC_ARENA_MAX for the worker (see `start_worker`).
WORKER_MALLOC_ARENAS = "2"


def start_worker(
  port: int,
  *,
  max_concurrent_computation_calls: int = -1,
  log_path: Optional[str] = None,
) -> subprocess.Popen:
  """Starts a TFF C++ worker service on `port` (all interfaces).

  The worker's stdout/stderr go to `log_path` (appended) or to /dev/null, never
  to the caller's pipes. It is killed when the calling *thread* exits
  (Linux `PR_SET_PDEATHSIG` follows the thread that forked), so call this from
  a thread that outlives the worker, e.g. the main thread. Stop it with
  `stop_worker`. This does not wait until the worker serves; the first
  `execution_context(workers=...)` that uses it does.

  Args:
    port: TCP port to serve on.
    max_concurrent_computation_calls: Worker flag bounding how many calls of one
      computation (e.g. one per client) run in parallel; nonpositive means no
      limit.
    log_path: Optional file for the worker's output.

  Returns:
    The worker process.
  """
  args = [
    worker_binary_path(),
    f"--port={port}",
    f"--max_concurrent_computation_calls={max_concurrent_computation_calls}",
  ]
  # glibc gives the worker's threads many malloc arenas, which keep the pages
  # of freed tensors: with two, a FedDF worker's peak over 20 rounds is a fifth
  # lower at the same speed (benchmarks/RESULTS.md, "Worker
  # memory and malloc arenas"). A value set by the caller wins.
  env = dict(os.environ)
  env.setdefault("MALLOC_ARENA_MAX", WORKER_MALLOC_ARENAS)
  with contextlib.ExitStack() as stack:
    if log_path is None:
      output = subprocess.DEVNULL
    else:
      output = stack.enter_context(open(log_path, "ab"))
    return subprocess.Popen(
      args,
      stdin=subprocess.DEVNULL,
      stdout=output,
      stderr=output,
      close_fds=True,
      env=env,
      preexec_fn=_die_with_parent(os.getpid()),
    )


def stop_worker(process: subprocess.Popen) -> None:
  """Stops a worker: SIGINT, then SIGKILL after a grace period; reaps it."""
  try:
    if process.poll() is None:
      process.send_signal(signal.SIGINT)
      process.wait(timeout=STOP_GRACE_S)
  except subprocess.TimeoutExpired:
    pass
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()


def wait_until_serving(
  stub: tff.framework.RemoteExecutorGrpcStub,
  address: str,
  process: Optional[subprocess.Popen],
) -> None:
  """Blocks until `stub` is connected, or raises a one-line WorkerError.

  Polls `stub.is_ready` as TFF does. (A `grpc.channel_ready_future` would add a
  second connectivity subscription, which makes grpc's polling thread raise
  "Channel closed!" if the channel is closed soon after.)

  Args:
    stub: Stub of the worker.
    address: The worker's address, for the error message.
    process: The worker process if we started it (its exit ends the wait early
      and the timeout is the start-up one), else None.
  """
  timeout = _CONNECT_TIMEOUT_S if process is None else _START_TIMEOUT_S
  deadline = time.monotonic() + timeout
  while True:
    if process is not None and process.poll() is not None:
      raise WorkerError(
        f"TFF worker {process.args[0]} for {address} exited with code {process.returncode}."
      )
    if stub.is_ready:
      return
    if time.monotonic() > deadline:
      raise WorkerError(
        f"TFF worker at {address} is unreachable (no gRPC connection within {timeout:g} s)."
      )
    time.sleep(0.05)
