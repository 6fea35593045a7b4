"""TFF's C++ worker processes: starting, stopping and waiting for one.

`start_worker` runs the `worker_binary` shipped in the TFF wheel with its output away from
the caller's pipes and with `PR_SET_PDEATHSIG=SIGKILL`, so it dies with the thread that
started it even if Python is killed, by default in a network namespace of its own, reached
only through a Unix-domain socket that only this user can open (`worker_launcher`);
`stop_worker` stops it; `wait_until_serving` waits for a started or running worker's gRPC
service. `runtime.execution_context` and `python -m tff_ens.worker` use them.

Workers start without a `preexec_fn`, so that CPython starts them with vfork() and exec,
which run no fork handlers: the callers hold live gRPC channels (TFF's contexts), and
gRPC's pthread_atfork pre-fork handler, which any fork() runs, can wait forever for
gRPC's threads (it hung the test suite inside `subprocess.Popen`). What a `preexec_fn`
would do in the child (the parent-death signal, SIGINT and SIGTERM, the namespace) a
small Python started in its place does before it execs the worker (`worker_launcher`).
"""

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

import portpicker
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


class IsolationError(WorkerError):
  """A local worker's network namespace cannot be made here."""


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


# How a local worker is reachable (`start_worker`).
ISOLATIONS = ("isolated", "open")
# worker_binary's --max_concurrent_computation_calls: any nonpositive value is no limit.
NO_CLIENT_LIMIT = 0
# The port the worker listens on inside its own network namespace, where no other
# process has one.
_PRIVATE_PORT = 8000
_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_launcher.py")
# glibc's MALLOC_ARENA_MAX for the worker (see `start_worker`).
WORKER_MALLOC_ARENAS = "2"


@dataclasses.dataclass(frozen=True)
class LocalWorker:
  """A worker this process started.

  `process` is what to wait on and stop: the launcher that bridges an isolated worker's
  socket (it ends as the worker ends), or the worker itself. `address` is the gRPC target:
  `unix:PATH` of a socket only this user can reach, or `localhost:PORT` of a worker open to
  every local user and host (isolation "open"). `pid` is the worker's own, for its memory.
  """

  process: subprocess.Popen
  address: str
  pid: int
  directory: Optional[str] = None  # The socket's, removed when the worker stops.


def _launcher(mode: str, *args: str) -> list[str]:
  """The command that runs `worker_launcher.py` in `mode` with this process as its parent.

  `-I -S`: the standard library only, no PYTHON* variables, user or site packages.
  """
  if not sys.executable:
    raise WorkerError("cannot start a TFF worker: sys.executable is unknown")
  return [sys.executable, "-I", "-S", _LAUNCHER, mode, str(os.getpid()), *args]


def _worker_env() -> dict:
  """The worker's environment: this one, with glibc's malloc arenas capped.

  glibc gives the worker's threads many malloc arenas, which keep the pages of freed
  tensors: with two, a FedDF worker's peak over 20 rounds is a fifth lower at the same
  speed (benchmarks/RESULTS.md, "Worker memory and malloc arenas"). A value set by the
  caller wins.
  """
  env = dict(os.environ)
  env.setdefault("MALLOC_ARENA_MAX", WORKER_MALLOC_ARENAS)
  return env


def _popen(command: list[str], log_path: Optional[str], **kwargs) -> subprocess.Popen:
  """`command` with its output in `log_path` (appended) or /dev/null, never the caller's
  pipes. No preexec_fn, user, group or extra_groups: CPython then starts the process with
  vfork() (Modules/_posixsubprocess.c), which runs no fork handlers (module docstring)."""
  with contextlib.ExitStack() as stack:
    output = subprocess.DEVNULL if log_path is None else stack.enter_context(open(log_path, "ab"))
    return subprocess.Popen(
      command,
      stdin=subprocess.DEVNULL,
      stdout=output,
      stderr=output,
      close_fds=True,
      env=_worker_env(),
      **kwargs,
    )


_SOCKET = "socket"
# Linux's limit on a Unix-domain socket's path (sun_path), its final NUL included.
_MAX_SOCKET_PATH = 108


def _socket_directory() -> str:
  """A new directory that only this user can enter (mode 0700), in the temporary directory,
  or in /tmp where that one's path is too long for the socket in it."""
  for parent in (None, "/tmp"):
    directory = tempfile.mkdtemp(prefix="tff_ens_worker_", dir=parent)
    if len(os.path.join(directory, _SOCKET).encode()) < _MAX_SOCKET_PATH:
      return directory
    os.rmdir(directory)
  raise WorkerError(f"no directory for the TFF worker's socket: {directory} is too long")


def start_worker(
  *,
  isolation: str = "isolated",
  port: Optional[int] = None,
  max_concurrent_computation_calls: int = NO_CLIENT_LIMIT,
  log_path: Optional[str] = None,
) -> LocalWorker:
  """Starts a TFF C++ worker; stop it with `stop_worker`.

  With isolation "isolated" (the default), the worker runs in a network namespace of its
  own and is reached only through a Unix-domain socket in a new directory that only this
  user can enter (`worker_launcher`'s `isolate`): no TCP port on this machine leads to it.
  With "open", it listens on `port` (a free one if None) of all interfaces, without
  credentials, as TFF's own contexts start it: every local user and every host that can
  route here can run computations in it (docs/security.md).

  Its output goes to `log_path` (appended) or to /dev/null. It is killed when the calling
  *thread* exits (`PR_SET_PDEATHSIG` follows the thread that started the process), so call
  this from a thread that outlives the worker, e.g. the main thread. This does not wait
  until it serves; the first `execution_context(workers=...)` that uses it does.

  Args:
    isolation: One of `ISOLATIONS`.
    port: For isolation "open": the TCP port.
    max_concurrent_computation_calls: Worker flag bounding how many calls of one
      computation (e.g. one per client) run in parallel; nonpositive means no limit.
    log_path: Optional file for the worker's output.

  Raises:
    IsolationError: one line naming the fix, if the namespace cannot be made.
  """
  if isolation not in ISOLATIONS:
    raise ValueError(f"isolation={isolation!r}: choose one of {', '.join(ISOLATIONS)}")
  flags = [f"--max_concurrent_computation_calls={max_concurrent_computation_calls}"]
  if isolation == "open":
    port = port or portpicker.pick_unused_port()
    command = _launcher("exec", worker_binary_path(), f"--port={port}", *flags)
    process = _popen(command, log_path)
    return LocalWorker(process, f"localhost:{port}", process.pid)
  directory = _socket_directory()
  path = os.path.join(directory, _SOCKET)
  read_end, write_end = os.pipe()
  try:
    command = _launcher(
      "isolate", path, str(write_end), worker_binary_path(), f"--port={_PRIVATE_PORT}", *flags
    )
    process = _popen(command, log_path, pass_fds=(write_end,))
    os.close(write_end)
    write_end = None
    with os.fdopen(read_end) as status:
      read_end = None
      line = status.readline().strip()
  except BaseException:
    shutil.rmtree(directory, ignore_errors=True)
    raise
  finally:
    for fd in (read_end, write_end):
      if fd is not None:
        os.close(fd)
  if not line.startswith("ok "):
    process.wait()
    shutil.rmtree(directory, ignore_errors=True)
    why = line.removeprefix("error: ") or f"the launcher exited with code {process.returncode}"
    raise IsolationError(
      f"cannot isolate the local TFF worker in a network namespace of its own ({why}): allow "
      "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu "
      "kernel.apparmor_restrict_unprivileged_userns=0; in a container, a seccomp profile that "
      "allows unshare, docs/security.md)"
    )
  return LocalWorker(process, f"unix:{path}", int(line.split()[1]), directory)


def stop_worker(worker: LocalWorker) -> None:
  """Stops a worker: SIGINT, then SIGKILL after a grace period; reaps it and removes its
  socket's directory."""
  process = worker.process
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
    if worker.directory is not None:
      shutil.rmtree(worker.directory, ignore_errors=True)


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
