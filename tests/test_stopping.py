"""Tests of `tff_ens.program.stopping`: the first signal asks for a stop after the round, the
second stops at once, but never inside a critical section (a run's files being written)."""

import os
import signal
import time

import pytest

from tff_ens.program import stopping


def test_first_signal_asks_second_stops_at_once():
  stopper = stopping.Stopper()
  with stopper.installed():
    os.kill(os.getpid(), signal.SIGTERM)
    assert stopper.requested and stopper.signal_name == "SIGTERM"
    with pytest.raises(stopping.StopNow, match="SIGINT"):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(1)  # The handler runs here.


def test_a_stop_during_writing_waits_for_the_write_to_end():
  stopper = stopping.Stopper()
  written = []
  with stopper.installed():
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(stopping.StopNow):
      with stopper.writing():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        written.append("checkpoint")  # Not interrupted.
  assert written == ["checkpoint"]


def test_the_grace_period_stops_at_once_after_the_first_signal():
  stopper = stopping.Stopper(grace_seconds=0.5)
  with stopper.installed():
    os.kill(os.getpid(), signal.SIGTERM)
    start = time.monotonic()
    with pytest.raises(stopping.StopNow):
      while time.monotonic() - start < 10:
        time.sleep(0.05)
    assert time.monotonic() - start < 5


def test_the_handlers_are_restored():
  before = signal.getsignal(signal.SIGTERM)
  with stopping.Stopper().installed():
    assert signal.getsignal(signal.SIGTERM) is not before
  assert signal.getsignal(signal.SIGTERM) is before
