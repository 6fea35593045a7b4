"""The watchdog (tests/watchdog.py) turns a test blocked in C, GIL held, into a failure.

A small pytest session in a child process runs the watchdog with a 2-second default on
three tests: one that sleeps 3 s in libc with a longer limit from its marker, one
deadlocked in C holding the GIL (a mutex it locks twice, called through `ctypes.PyDLL`,
which keeps the GIL: a futex wait as in a fork() stuck in gRPC's pre-fork handler, which
no signal ends), and one that must not run. Neither a Python timer thread nor a SIGALRM
handler could fire in the deadlock (pytest-timeout's thread and signal methods both let
it hang: measured, see tests/watchdog.py).
"""

import os
import pathlib
import subprocess
import sys
import textwrap
import time

import psutil

from tests import watchdog

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

_TESTS = textwrap.dedent("""\
  import ctypes
  import pytest

  libc = ctypes.PyDLL(None)  # Calls keep the GIL.

  @pytest.mark.timeout_seconds(30)
  def test_longer_with_its_marker():
    libc.sleep(3)

  def deadlock_in_c():
    mutex = ctypes.create_string_buffer(64)  # PTHREAD_MUTEX_INITIALIZER: zeros.
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)

  def test_hangs_in_c():
    deadlock_in_c()

  def test_never_runs():
    pass
""")


def test_a_test_blocked_in_c_ends_the_run_with_its_name_and_stacks(tmp_path):
  (tmp_path / "test_blocked.py").write_text(_TESTS)
  start = time.monotonic()
  child = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "pytest",
      "-p",
      "tests.watchdog",
      "-o",
      "watchdog_seconds=2",
      "-p",
      "no:cacheprovider",
      "-v",
      "test_blocked.py",
    ],
    cwd=tmp_path,
    env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    output, _ = child.communicate(timeout=60)
  finally:
    child.kill()
  seconds = time.monotonic() - start
  assert child.returncode == 1, output
  assert seconds < 30, output
  assert "test_blocked.py::test_longer_with_its_marker PASSED" in output
  assert "watchdog: test_blocked.py::test_hangs_in_c did not finish within 2 s" in output
  stacks = output.split("watchdog: test_blocked.py::test_hangs_in_c")[1]
  assert "Timeout (0:00:02)!" in stacks
  assert 'test_blocked.py", line 13 in deadlock_in_c' in stacks
  assert 'test_blocked.py", line 16 in test_hangs_in_c' in stacks
  assert "test_never_runs" not in output
  # The printer exits with the session.
  tag = watchdog.printer_tag(child.pid)
  time.sleep(0.5)
  assert not [p for p in psutil.process_iter(["cmdline"]) if tag in (p.info["cmdline"] or [])]
