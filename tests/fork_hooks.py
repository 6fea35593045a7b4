"""Counts of the fork handlers that this process's process starts run.

`install()` registers, once per process, two counting hooks:

- "python": `os.register_at_fork(before=...)`, the kind gRPC Python registers with
  GRPC_ENABLE_FORK_SUPPORT=1; CPython runs it in `os.fork()` and in a `subprocess` start
  with a `preexec_fn`, not in one started with vfork() or posix_spawn().
- "c": a glibc `__register_atfork` prepare handler (what `pthread_atfork` registers), the
  kind gRPC's core registers by default: every fork() runs it, whatever called fork()
  (also `subprocess` with `user=`, `group=` or `extra_groups=` and no `preexec_fn`);
  vfork() and posix_spawn() run none.

`counts()` returns how often each has run in this process. Neither can be unregistered:
the C handler's ctypes callback is kept alive for the life of the process.
"""

import ctypes
import os
import threading

_counts = {"python": 0, "c": 0}
_lock = threading.Lock()
_installed = []  # [the C callback], once installed.
_PREPARE = ctypes.CFUNCTYPE(None)


def _count(kind: str) -> None:
  _counts[kind] += 1


def install() -> None:
  """Registers both hooks, once per process."""
  with _lock:
    if _installed:
      return
    os.register_at_fork(before=lambda: _count("python"))
    callback = _PREPARE(lambda: _count("c"))
    register = getattr(ctypes.CDLL(None), "__register_atfork")
    register.argtypes = [_PREPARE, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    register.restype = ctypes.c_int
    if register(callback, None, None, None) != 0:
      raise OSError("__register_atfork failed")
    # glibc may call the callback at any later fork(): it must never be freed.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(callback))
    _installed.append(callback)


def counts() -> dict[str, int]:
  """{"python": n, "c": n}: how often each hook has run in this process."""
  return dict(_counts)
