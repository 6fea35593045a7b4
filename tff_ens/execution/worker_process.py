"""TFF's C++ worker processes: starting, stopping and waiting for one.

`start_worker` runs the `worker_binary` shipped in the TFF wheel with its output away from
the caller's pipes and with `PR_SET_PDEATHSIG=SIGKILL`, so it dies with the thread that
started it even if Python is killed; `stop_worker` stops it; `wait_until_serving` waits
for a started or running worker's gRPC service. `runtime.execution_context` and
`python -m tff_ens.worker` use them.

Workers start without a `preexec_fn`, so that CPython starts them with vfork() and exec,
which run no fork handlers: the callers hold live gRPC channels (TFF's contexts), and
gRPC's pthread_atfork pre-fork handler, which any fork() runs, can wait forever for
gRPC's threads (it hung the test suite inside `subprocess.Popen`). What a `preexec_fn`
did in the child (the parent-death signal, SIGINT and SIGTERM) a small Python started
in its place does before it execs the worker (`_EXEC_WITH_PARENT_DEATH_SIGNAL`).
"""

import contextlib
import os
import signal
import subprocess
import sys
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


class WorkerError(RuntimeError):
  """A TFF worker did not come up, exited, or stopped answering."""


def _exit_description(returncode: int) -> str:
  """`code N`, and for a SIGKILL its most likely sender: the kernel's out-of-memory killer."""
  if returncode == -signal.SIGKILL:
    return (
      f"code {returncode} (SIGKILL, as the kernel's out-of-memory killer sends when memory "
      'runs out: docs/library.md, "Memory", says what a run holds and what lowers it)'
    )
  return f"code {returncode}"


def worker_binary_path() -> str:
  """Path of the `worker_binary` shipped in the TFF wheel (as TFF finds it)."""
  path = os.path.join(os.path.dirname(tff.__file__), "data", "worker_binary")
  if not os.path.isfile(path):
    raise RuntimeError(f"Expected a TFF worker binary at {path}.")
  return path


# Run by a Python of its own in the process that becomes the worker (`start_worker`);
# argv: the parent's pid, then the worker's argv. PR_SET_PDEATHSIG is kept across execve
# (the worker binary is not set-user-ID), so the worker gets SIGKILL when the thread that
# started this process exits. Ignored signals stay ignored across exec, and a parent
# started in the background by a shell ignores SIGINT, which `stop_worker` needs. A
# SIGTERM to the whole process group (systemd, `kill -- -PGID`) is for the driver, which
# finishes its round, checkpoints and then stops the worker: the worker must not die
# under the round in flight. Python ignores SIGPIPE and SIGXFSZ, which the worker must
# not inherit (`Popen`'s restore_signals does the same for its own child).
_EXEC_WITH_PARENT_DEATH_SIGNAL = """
import ctypes, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
  sys.exit("prctl(PR_SET_PDEATHSIG): " + os.strerror(ctypes.get_errno()))
# The parent may have died before prctl(): then no signal will ever come.
if os.getppid() != int(sys.argv[1]):
  os.kill(os.getpid(), signal.SIGKILL)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _with_parent_death_signal(args: list[str]) -> list[str]:
  """The command that runs `args` after `_EXEC_WITH_PARENT_DEATH_SIGNAL`.

  `-I -S`: the standard library only, no PYTHON* variables, user or site packages.
  """
  if not sys.executable:
    raise WorkerError("cannot start a TFF worker: sys.executable is unknown")
  return [
    sys.executable,
    "-I",
    "-S",
    "-c",
    _EXEC_WITH_PARENT_DEATH_SIGNAL,
    str(os.getpid()),
    *args,
  ]


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
  (Linux `PR_SET_PDEATHSIG` follows the thread that started the process), so call
  this from a thread that outlives the worker, e.g. the main thread. Stop it with
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
    # No preexec_fn, user, group or extra_groups: CPython then starts the process with
    # vfork() (Modules/_posixsubprocess.c), which runs no fork handlers (module docstring).
    return subprocess.Popen(
      _with_parent_death_signal(args),
      stdin=subprocess.DEVNULL,
      stdout=output,
      stderr=output,
      close_fds=True,
      env=env,
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
        f"TFF worker {worker_binary_path()} for {address} exited with "
        f"{_exit_description(process.returncode)}."
      )
    if stub.is_ready:
      return
    if time.monotonic() > deadline:
      raise WorkerError(
        f"TFF worker at {address} is unreachable (no gRPC connection within {timeout:g} s)."
      )
    time.sleep(0.05)
