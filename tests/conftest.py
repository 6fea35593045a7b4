"""Shared test setup: one TFF execution context (one worker) for the session.

TFF installs a default context at import that, on the first computation call,
starts a `worker_binary` holding pytest's pipes open and outliving Python (see
`tff_ens.execution.runtime`). Every test here therefore runs inside
`runtime.execution_context()`, entered once and shared by all test modules so
the worker starts once, and left (worker stopped and reaped) when the session
ends.

Test modules that manage TFF contexts and workers themselves (they call
`execution_context(` in their source, like `test_runtime.py`, which counts
the worker processes it starts) run with no shared context: it is closed
before such a module and entered again, lazily, for the next module that
needs it. The context is thread-local; pytest runs tests in the main thread.

Every test runs under the watchdog of `tests/watchdog.py`: one that hangs, even blocked
in C, ends the run with its name and every thread's stack.

The device environment (device/: LiteRT without TensorFlow) is created from its lock before
the tests are collected if it is missing, so a fresh clone's `uv run pytest` runs its tests.
"""

import contextlib
import inspect
import os
import pathlib
import shutil
import subprocess

import pytest

from tff_ens.execution import runtime

pytest_plugins = ["tests.watchdog", "tests.chromium"]

DEVICE_PROJECT = pathlib.Path(__file__).resolve().parents[1] / "device"


def pytest_configure(config):
  """`uv sync --locked --project device` when device/.venv has no Python yet (a fresh clone);
  without uv the tests that need that environment skip, saying so."""
  del config
  if (DEVICE_PROJECT / ".venv" / "bin" / "python").exists():
    return
  uv = os.environ.get("UV") or shutil.which("uv")
  if uv is not None:
    subprocess.run(
      [uv, "sync", "--locked", "--quiet", "--project", str(DEVICE_PROJECT)], check=True
    )


class _SharedContext:
  """`runtime.execution_context()`, opened on demand and closed explicitly."""

  def __init__(self):
    self._stack = None

  @property
  def active(self) -> bool:
    return self._stack is not None

  def open(self) -> None:
    if self._stack is None:
      stack = contextlib.ExitStack()
      stack.enter_context(runtime.execution_context())
      self._stack = stack

  def close(self) -> None:
    if self._stack is not None:
      stack, self._stack = self._stack, None
      stack.close()


def _manages_own_context(module) -> bool:
  try:
    source = inspect.getsource(module)
  except (OSError, TypeError):
    return False
  return "execution_context(" in source


@pytest.fixture(scope="session", autouse=True)
def _tff_session_context():
  """The session's TFF execution context; stopped (worker reaped) at the end."""
  shared = _SharedContext()
  try:
    yield shared
  finally:
    shared.close()


@pytest.fixture(scope="module", autouse=True)
def _tff_context_for_module(request, _tff_session_context):
  """Makes the shared context current for this module, unless it brings its own."""
  if _manages_own_context(request.module):
    _tff_session_context.close()
  else:
    _tff_session_context.open()
  yield
