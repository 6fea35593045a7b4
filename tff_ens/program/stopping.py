"""Stopping a run on a signal: after its round, or at once.

The first SIGTERM or Ctrl-C (SIGINT) asks the run to stop after the round in flight, which is
then checkpointed (`Stopper.requested`); a second one, or the grace period after the first
(`--stop_grace_seconds`), stops it at once by raising `StopNow` in the main thread, from the
signal handler. Writing a run's files is a critical section (`Stopper.writing`): a stop
asked for during one waits for it to end, so a checkpoint or a metrics file is never left
half written. A stopped run resumes from its last checkpoint (`--resume`).
"""

import contextlib
import logging
import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopNow(Exception):
  """A second signal (or the grace period) stopped the run in the middle of a round."""

  def __init__(self, signum: int):
    self.signum = signum
    super().__init__(signal.Signals(signum).name)


class Stopper:
  """The run's signal handlers (main thread only; elsewhere signals keep their defaults)."""

  def __init__(self, grace_seconds: float = 0.0):
    self._grace = grace_seconds
    self._requested = threading.Event()
    self._writing = 0
    self._pending = None  # The signal of a stop asked for while writing.
    self._timer = None
    self.signum = None  # The first signal received.

  @property
  def signal_name(self) -> str | None:
    """The first signal's name ("SIGTERM", "SIGINT"), or None."""
    return signal.Signals(self.signum).name if self.signum is not None else None

  @property
  def requested(self) -> bool:
    """Whether a signal asked the run to stop (after its round, or at once)."""
    return self._requested.is_set()

  def _handle(self, signum, frame):
    del frame
    if not self._requested.is_set():
      self.signum = signum
      self._requested.set()
      logging.warning(
        "%s: stopping after this round (send it again to stop at once)",
        signal.Signals(signum).name,
      )
      if self._grace > 0:
        self._timer = threading.Timer(self._grace, os.kill, (os.getpid(), signum))
        self._timer.daemon = True
        self._timer.start()
      return
    if self._writing:
      self._pending = signum
      return
    raise StopNow(signum)

  @contextlib.contextmanager
  def writing(self):
    """A critical section: a stop at once waits until it ends."""
    self._writing += 1
    try:
      yield
    finally:
      self._writing -= 1
    if not self._writing and self._pending is not None:
      signum, self._pending = self._pending, None
      raise StopNow(signum)

  @contextlib.contextmanager
  def installed(self):
    """The handlers, for the duration of the block."""
    if threading.current_thread() is not threading.main_thread():
      yield self
      return
    previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
    try:
      yield self
    finally:
      if self._timer is not None:
        self._timer.cancel()
      for s, handler in previous.items():
        signal.signal(s, handler)
