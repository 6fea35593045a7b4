"""Tests of `tff_ens.program.client_states`: FedDyn's per-client states on disk."""

import os

import numpy as np
import pytest

from tff_ens.algorithms import algorithm
from tff_ens.program import client_states

SPEC = algorithm.ClientStates(shape=(6,), dtype=np.dtype(np.float32))


def state(value):
  return np.full((6,), value, np.float32)


def stored_value(store, client, model):
  return float(store.load(client, model)[0])


def test_a_client_starts_at_zeros_and_reads_its_newest_state(tmp_path):
  store = client_states.ClientStateStore(str(tmp_path), SPEC)
  assert stored_value(store, 4, 1) == 0.0
  store.save(1, 4, 1, state(1.0))
  store.save(3, 4, 1, state(3.0))
  store.save(2, 4, 0, state(2.0))
  assert stored_value(store, 4, 1) == 3.0
  assert stored_value(store, 4, 0) == 2.0
  assert stored_value(store, 5, 1) == 0.0
  # A new store (a new process) finds the same states.
  again = client_states.ClientStateStore(str(tmp_path), SPEC)
  assert stored_value(again, 4, 1) == 3.0
  assert again.load(4, 1).dtype == np.float32


def test_rewind_forgets_states_written_after_the_checkpoint(tmp_path):
  store = client_states.ClientStateStore(str(tmp_path), SPEC)
  for round_num in (2, 4, 5, 6):
    store.save(round_num, 0, 0, state(float(round_num)))
  store.save(5, 1, 0, state(5.0))
  store.rewind(4)
  assert stored_value(store, 0, 0) == 4.0
  assert stored_value(store, 1, 0) == 0.0  # Its only state was after 4.
  assert sorted(os.listdir(tmp_path)) == [
    "client000000_model000_round0000002.npy",
    "client000000_model000_round0000004.npy",
  ]


def test_prune_keeps_what_a_resume_can_need(tmp_path):
  store = client_states.ClientStateStore(str(tmp_path), SPEC)
  for round_num in (1, 2, 3, 5):
    store.save(round_num, 0, 0, state(float(round_num)))
  store.prune(4)
  # The newest at or before the checkpoint (3) and the later one (5).
  assert sorted(os.listdir(tmp_path)) == [
    "client000000_model000_round0000003.npy",
    "client000000_model000_round0000005.npy",
  ]
  store.rewind(4)
  assert stored_value(store, 0, 0) == 3.0


def test_a_half_written_file_is_dropped_and_a_damaged_one_is_named(tmp_path):
  store = client_states.ClientStateStore(str(tmp_path), SPEC)
  store.save(1, 2, 0, state(1.0))
  (tmp_path / "client000002_model000_round0000002.tmp.npy").write_bytes(b"x")
  store = client_states.ClientStateStore(str(tmp_path), SPEC)
  assert stored_value(store, 2, 0) == 1.0
  assert not any(name.endswith(".tmp.npy") for name in os.listdir(tmp_path))
  path = tmp_path / "client000002_model000_round0000001.npy"
  path.write_bytes(b"not a numpy file")
  with pytest.raises(
    client_states.ClientStateError, match="client000002_model000_round0000001.npy.*new --output_dir"
  ):
    store.load(2, 0)


def test_a_state_of_another_model_is_refused(tmp_path):
  store = client_states.ClientStateStore(str(tmp_path), SPEC)
  store.save(1, 0, 0, np.zeros((5,), np.float32))
  with pytest.raises(client_states.ClientStateError, match="another model"):
    store.load(0, 0)
