"""Tests of `tff_ens.program.client_states`: FedDyn's per-client states on disk."""

import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf

from tff_ens.algorithms import algorithm
from tff_ens.program import client_states
from tff_ens.templates import stateful_client_work

SPEC = algorithm.ClientStates(shape=(6,), dtype=np.dtype(np.float32))


def state(value):
  return np.full((6,), value, np.float32)


def stored_value(store, client, model):
  return float(store.load(client, model)[0])


def state_files(*prefixes):
  """The files of the states `prefixes` (a checkpoint bundle each), sorted."""
  return sorted(p + suffix for p in prefixes for suffix in (".index", ".data-00000-of-00001"))


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
    if round_num in (2, 4):  # Checkpointed.
      store.prune([2, 4][: round_num // 2])
  store.save(5, 1, 0, state(5.0))
  store.rewind(4)
  assert stored_value(store, 0, 0) == 4.0
  assert stored_value(store, 1, 0) == 0.0  # Its only state was after 4.
  assert sorted(os.listdir(tmp_path)) == state_files(
    "client000000_model000_round0000002",
    "client000000_model000_round0000004",
  )


def test_a_client_keeps_only_what_a_resume_can_need(tmp_path):
  store = client_states.ClientStateStore(str(tmp_path), SPEC)
  store.save(1, 1, 0, state(1.0))  # Client 1 trains once, client 0 every round.
  checkpoints = []
  for round_num in range(1, 8):
    store.save(round_num, 0, 0, state(float(round_num)))
    if round_num in (2, 4):  # Checkpointed, as the round loop does every 2 rounds here.
      checkpoints.append(round_num)
      store.prune(checkpoints)
  # Client 0: its newest at or before each checkpoint (2, 4) and its newest (7); 3, 5 and
  # 6 were deleted when the next round replaced them.
  assert sorted(os.listdir(tmp_path)) == state_files(
    "client000000_model000_round0000002",
    "client000000_model000_round0000004",
    "client000000_model000_round0000007",
    "client000001_model000_round0000001",
  )
  assert stored_value(store, 0, 0) == 7.0
  store.rewind(4)  # A resume from the newest checkpoint,
  assert stored_value(store, 0, 0) == 4.0
  store.rewind(2)  # or from the older one when the newest is unreadable.
  assert stored_value(store, 0, 0) == 2.0
  assert stored_value(store, 1, 0) == 1.0


def test_a_half_written_file_is_dropped_and_a_damaged_one_is_named(tmp_path):
  store = client_states.ClientStateStore(str(tmp_path), SPEC)
  store.save(1, 2, 0, state(1.0))
  # A run killed mid-write: a temporary file, and a state whose index was never written.
  (tmp_path / "client000002_model000_round0000002.index.tempstate123").write_bytes(b"x")
  (tmp_path / "client000002_model000_round0000003.data-00000-of-00001").write_bytes(b"x")
  store = client_states.ClientStateStore(str(tmp_path), SPEC)
  assert stored_value(store, 2, 0) == 1.0
  assert sorted(os.listdir(tmp_path)) == state_files("client000002_model000_round0000001")
  (tmp_path / "client000002_model000_round0000001.index").write_bytes(b"not a state")
  with pytest.raises(
    client_states.ClientStateError, match="client000002_model000_round0000001 .*new --output_dir"
  ):
    store.load(2, 0)


def test_a_state_of_another_model_is_refused(tmp_path):
  store = client_states.ClientStateStore(str(tmp_path), SPEC)
  store.save(1, 0, 0, np.zeros((5,), np.float32))
  with pytest.raises(client_states.ClientStateError, match="another model"):
    store.load(0, 0)


def test_a_store_of_earlier_formats_is_converted_when_opened(tmp_path):
  # Earlier versions' formats: a `.npy` file, then a serialized TensorProto per state.
  np.save(tmp_path / "client000003_model001_round0000004.npy", state(4.0))
  (tmp_path / "client000003_model002_round0000005.pb").write_bytes(
    tf.make_tensor_proto(state(5.0)).SerializeToString()
  )
  store = client_states.ClientStateStore(str(tmp_path), SPEC)
  assert stored_value(store, 3, 1) == 4.0
  assert stored_value(store, 3, 2) == 5.0
  assert sorted(os.listdir(tmp_path)) == state_files(
    "client000003_model001_round0000004", "client000003_model002_round0000005"
  )


def test_in_files_the_round_names_each_clients_state_and_the_one_it_writes(tmp_path):
  spec = dataclasses.replace(SPEC, initial=lambda: state(7.0), in_files=True)
  store = client_states.ClientStateStore(str(tmp_path), spec)
  store.save(2, 4, 1, state(2.0))
  store.prune([4])  # Round 4 is checkpointed.
  first, second = store.round_inputs(5, [4, 6], [1, 0])
  assert list(first) == [
    str(tmp_path / "client000004_model001_round0000002"),
    str(tmp_path / "client000004_model001_round0000005"),
  ]
  # A client with no state yet reads the initial one, which the store wrote.
  assert list(second) == [
    str(tmp_path / "initial"),
    str(tmp_path / "client000006_model000_round0000005"),
  ]
  assert stateful_client_work.read_state(second[0], tf.float32).numpy()[0] == 7.0
  # The clients' computations write the new states (`through_files`); the store then finds them.
  for path, value in ((first[1], 5.0), (second[1], 9.0)):
    stateful_client_work.write_state(path, state(value))
  store.round_outputs(5, [4, 6], [1, 0], [first[1], second[1]])
  assert stored_value(store, 4, 1) == 5.0 and stored_value(store, 6, 0) == 9.0
  store.rewind(4)
  assert stored_value(store, 4, 1) == 2.0 and stored_value(store, 6, 0) == 7.0


def test_in_files_a_store_of_another_model_is_refused_when_opened(tmp_path):
  client_states.ClientStateStore(str(tmp_path), SPEC).save(1, 0, 0, np.zeros(5, np.float32))
  with pytest.raises(client_states.ClientStateError, match="another model"):
    client_states.ClientStateStore(str(tmp_path), dataclasses.replace(SPEC, in_files=True))
