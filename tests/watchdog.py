"""The test suite's watchdog: a test that hangs fails the run, naming it, with every stack.

A pytest plugin (tests/conftest.py loads it). Each test (setup, call and teardown) runs
under `faulthandler.dump_traceback_later(limit, exit=True)`: its timer is a C thread,
which fires even while the main thread is blocked in C holding the GIL, as in a fork()
waiting in gRPC's pre-fork handler. A Python timer thread (pytest-timeout's
method=thread) needs the GIL to run, and SIGALRM's Python handler (its method=signal, or
`signal.alarm`) runs only once the main thread is back in the interpreter: neither fires
then (measured with pytest-timeout 2.4 and --timeout=2: a test deadlocked on a pthread
mutex through `ctypes.PyDLL` ran on with either method until killed at 40 s). On expiry
faulthandler writes every thread's Python stack and exits the process with status 1.

faulthandler writes into a pipe read by a small Python started once per session (the
printer), which writes to the terminal's stderr what pytest would not: before the stacks,
which test hung and its limit. pytest writes the printer a line as each test starts.

The limit is the ini option `watchdog_seconds` (pyproject.toml: the fast set's default),
or `watchdog_slow_seconds` for a test marked slow; a test declares its own with
`@pytest.mark.timeout_seconds(N)`. `watchdog_seconds = 0` turns the watchdog off.
Collecting the tests runs under `watchdog_collection_seconds`.
"""

import faulthandler
import os
import subprocess
import sys

import pytest

MARKER = "timeout_seconds"

# argv[1]: a tag naming the pytest process, for tests and `ps`. stdin: b"\0LIMIT NAME\n"
# before each test, and faulthandler's dump if one hangs; stdout: the terminal's stderr.
_PRINTER = r"""
import sys
current = b"?"
out = sys.stdout.buffer
for line in sys.stdin.buffer:
  if line.startswith(b"\0"):
    current = line[1:].rstrip(b"\n")
    continue
  limit, _, name = current.partition(b" ")
  out.write(
    b"\n\nwatchdog: " + name + b" did not finish within " + limit + b" s; "
    b"pytest exits with status 1 (a longer test declares its limit with "
    b"@pytest.mark.timeout_seconds(N)). Its threads' stacks:\n\n"
  )
  out.write(line)
  out.flush()
  for rest in sys.stdin.buffer:
    out.write(rest)
    out.flush()
  break
"""


def printer_tag(pid: int) -> str:
  """The printer's argv[1] for the pytest process `pid`."""
  return f"tests.watchdog-printer-of-{pid}"


class _Watchdog:
  def __init__(self, stderr_fd: int):
    self._stderr = stderr_fd
    # Started like every process here: without a preexec_fn, so with vfork() (see
    # tests/test_process_starts.py).
    self._printer = subprocess.Popen(
      [sys.executable, "-I", "-S", "-c", _PRINTER, printer_tag(os.getpid())],
      stdin=subprocess.PIPE,
      stdout=stderr_fd,
      stderr=stderr_fd,
      bufsize=0,
    )

  def arm(self, seconds: float, name: str) -> None:
    """Exits the process with every stack unless `disarm` comes within `seconds`."""
    out = self._stderr
    if self._printer.poll() is None:
      try:
        self._printer.stdin.write(f"\0{seconds:g} {name}\n".encode(errors="replace"))
        out = self._printer.stdin.fileno()
      except OSError:
        pass
    if out == self._stderr:  # No printer: the stacks without the test's name.
      os.write(out, f"watchdog: {name} runs (limit {seconds:g} s)\n".encode())
    faulthandler.dump_traceback_later(seconds, exit=True, file=out)

  def disarm(self) -> None:
    faulthandler.cancel_dump_traceback_later()

  def close(self) -> None:
    self.disarm()
    self._printer.stdin.close()
    try:
      self._printer.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self._printer.kill()
      self._printer.wait()
    os.close(self._stderr)


_KEY = pytest.StashKey[_Watchdog]()


def pytest_addoption(parser):
  parser.addini(
    "watchdog_seconds",
    "Per-test time limit in seconds that also stops a test blocked in C "
    "(tests/watchdog.py); 0: none",
    default="0",
  )
  parser.addini(
    "watchdog_slow_seconds", "The watchdog's limit for tests marked slow; 0: none", default="0"
  )
  parser.addini(
    "watchdog_collection_seconds", "Time limit for collecting the tests; 0: none", default="0"
  )


def pytest_configure(config):
  config.addinivalue_line(
    "markers",
    f"{MARKER}(seconds): this test's limit for the watchdog (tests/watchdog.py), in place "
    "of the ini option watchdog_seconds",
  )
  if float(config.getini("watchdog_seconds")) > 0 and _KEY not in config.stash:
    # pytest's capture is suspended here: fd 2 is the terminal's stderr (as in pytest's
    # own faulthandler plugin).
    config.stash[_KEY] = _Watchdog(os.dup(sys.stderr.fileno()))


def pytest_unconfigure(config):
  watchdog = config.stash.get(_KEY, None)
  if watchdog is not None:
    del config.stash[_KEY]
    watchdog.close()


def limit_of(item) -> float:
  """The test's limit in seconds (module docstring); 0: none."""
  marker = item.get_closest_marker(MARKER)
  if marker is not None:
    return float(marker.args[0])
  if item.get_closest_marker("slow") is not None:
    return float(item.config.getini("watchdog_slow_seconds"))
  return float(item.config.getini("watchdog_seconds"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
  watchdog = item.config.stash.get(_KEY, None)
  seconds = limit_of(item)
  if watchdog is None or seconds <= 0:
    return (yield)
  watchdog.arm(seconds, item.nodeid)
  try:
    return (yield)
  finally:
    watchdog.disarm()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection(session):
  watchdog = session.config.stash.get(_KEY, None)
  seconds = float(session.config.getini("watchdog_collection_seconds"))
  if watchdog is None or seconds <= 0:
    return (yield)
  watchdog.arm(seconds, "the collection of the tests")
  try:
    return (yield)
  finally:
    watchdog.disarm()
