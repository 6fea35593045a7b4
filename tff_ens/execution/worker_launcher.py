"""The process that becomes or guards a local TFF worker; standard library only.

Run by `worker_process.start_worker` as `python -I -S worker_launcher.py MODE ...`, in a
fresh, single-threaded Python without gRPC, so nothing here can wait in gRPC's fork
handlers (it starts its one child with vfork() and exec, as `subprocess` does):

- `exec PARENT_PID BINARY ARGS...`: sets the signals the worker needs and
  `PR_SET_PDEATHSIG=SIGKILL`, then execs BINARY (TFF's `worker_binary`), which listens on
  `[::]:PORT` without credentials.
- `isolate PARENT_PID SOCKET STATUS_FD BINARY ARGS...`: moves into a network namespace of
  its own (and a user namespace unless it runs as root), where nothing else has an
  interface: there `worker_binary`'s `[::]:PORT` is reachable only from inside. It starts
  the worker there (through `exec`), and bridges the Unix-domain socket SOCKET, in a
  directory only its user can enter, to the worker's port: the driver's one way in. It
  writes `ok WORKER_PID` or `error: WHY` on STATUS_FD, forwards SIGINT to the worker, and
  ends as the worker ended (its exit code, or killed by the same signal).

Both die with the thread that started them (`PR_SET_PDEATHSIG`, kept across execve: the
binary is not set-user-ID), and so does the worker with its launcher. A SIGTERM to the
whole process group is for the driver, which finishes its round first: both ignore it.
"""

import ctypes
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import threading

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_CLONE_NEWUSER = 0x10000000  # <linux/sched.h>
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913  # <linux/sockios.h>
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1  # <linux/if.h>
_SPLICE_BYTES = 1 << 20  # One move through a pipe (Linux's default pipe-max-size).
_F_SETPIPE_SZ = 1031  # <linux/fcntl.h>


def _die_with_parent(parent_pid: int) -> None:
  """SIGKILL when the thread that started this process exits."""
  if _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_PDEATHSIG): " + os.strerror(ctypes.get_errno()))
  if os.getppid() != parent_pid:  # The parent died before prctl(): no signal will come.
    os.kill(os.getpid(), signal.SIGKILL)


def _exec_worker(parent_pid: int, argv: list[str]) -> None:
  """Execs the worker with default SIGINT, SIGPIPE and SIGXFSZ (Python ignores the last two,
  and a parent started in the background by a shell ignores SIGINT, which stopping needs)."""
  signal.signal(signal.SIGINT, signal.SIG_DFL)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  signal.signal(signal.SIGPIPE, signal.SIG_DFL)
  signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
  _die_with_parent(parent_pid)
  os.execv(argv[0], argv)


def _unshare(flags: int) -> int:
  """0, or the errno of unshare(flags)."""
  return 0 if _LIBC.unshare(flags) == 0 else ctypes.get_errno()


def _enter_private_network() -> None:
  """A network namespace of this process's own, with only its loopback, up.

  Root (with CAP_SYS_ADMIN) makes the network namespace alone; any other user, or root
  without the capability, makes it inside a new user namespace that maps only its own
  uid and gid, so that files the worker writes are the user's as before.
  """
  uid, gid = os.getuid(), os.getgid()
  error = _unshare(_CLONE_NEWNET) if os.geteuid() == 0 else -1
  if error:
    error = _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    if error:
      raise OSError(error, f"unshare(CLONE_NEWUSER|CLONE_NEWNET): {os.strerror(error)}")
    for name, text in (
      ("setgroups", "deny"),
      ("uid_map", f"{uid} {uid} 1"),
      ("gid_map", f"{gid} {gid} 1"),
    ):
      with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = struct.pack("16sH22x", b"lo", 0)
    flags = struct.unpack("16sH22x", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


def _pump(source: socket.socket, sink: socket.socket) -> None:
  """Moves bytes from `source` to `sink` until `source` ends, through a pipe (splice: the
  bytes stay in the kernel), then ends `sink`'s sending side."""
  read_end, write_end = os.pipe()
  try:
    fcntl.fcntl(write_end, _F_SETPIPE_SZ, _SPLICE_BYTES)
  except OSError:
    pass  # A smaller pipe only means more moves.
  try:
    while True:
      moved = os.splice(source.fileno(), write_end, _SPLICE_BYTES)
      if not moved:
        break
      while moved:
        moved -= os.splice(read_end, sink.fileno(), moved)
    sink.shutdown(socket.SHUT_WR)
  except OSError:  # Either side reset or closed: end both.
    for s in (source, sink):
      try:
        s.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
  finally:
    os.close(read_end)
    os.close(write_end)


def _bridge(client: socket.socket, port: int) -> None:
  """Joins a driver's connection to the worker's port, both ways, until both end."""
  try:
    worker = socket.create_connection(("127.0.0.1", port))
  except OSError:  # Not serving yet: the driver's gRPC channel connects again.
    client.close()
    return
  worker.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # As gRPC's own sockets.
  back = threading.Thread(target=_pump, args=(worker, client), daemon=True)
  back.start()
  _pump(client, worker)
  back.join()
  client.close()
  worker.close()


def _serve(listener: socket.socket, port: int) -> None:
  while True:
    client, _ = listener.accept()
    threading.Thread(target=_bridge, args=(client, port), daemon=True).start()


def _port_of(argv: list[str]) -> int:
  (port,) = [int(a.split("=", 1)[1]) for a in argv if a.startswith("--port=")]
  return port


def _isolate(parent_pid: int, path: str, status_fd: int, argv: list[str]) -> None:
  """The `isolate` mode of the module doc."""
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  _die_with_parent(parent_pid)
  with os.fdopen(status_fd, "w") as status:
    try:
      _enter_private_network()
      listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
      listener.bind(path)
      os.chmod(path, 0o600)
      listener.listen(16)
    except OSError as e:
      status.write(f"error: {e.strerror or e}\n")
      sys.exit(3)
    worker = subprocess.Popen(
      [sys.executable, "-I", "-S", __file__, "exec", str(os.getpid()), *argv], close_fds=True
    )
    status.write(f"ok {worker.pid}\n")
  signal.signal(signal.SIGINT, lambda signum, frame: worker.send_signal(signal.SIGINT))
  threading.Thread(target=_serve, args=(listener, _port_of(argv)), daemon=True).start()
  code = worker.wait()
  if code < 0:  # Killed: end the same way, so that the driver sees the signal.
    if -code != signal.SIGKILL:  # Whose handler cannot be set.
      signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
  sys.exit(code)


if __name__ == "__main__":
  mode, parent = sys.argv[1], int(sys.argv[2])
  if mode == "exec":
    _exec_worker(parent, sys.argv[3:])
  else:
    _isolate(parent, sys.argv[3], int(sys.argv[4]), sys.argv[5:])
