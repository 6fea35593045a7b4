"""A composed process (Fed-ensemble's, Ditto's) is a `tff.learning.templates.LearningProcess`
that TFF's own program logic drives: `tff.learning.programs.train_model` runs it from a
`tff.program.FederatedDataSource` of client inputs, checkpoints it with
`tff.program.FileProgramStateManager` and resumes it, to the state the tff-ens loop's
`next_fn` reaches by hand (Ditto: its personal models, kept in files, equal to those a
values process returns)."""

import asyncio
import copy
import json

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import algorithms
from tff_ens.execution import runtime
from tff_ens.program import client_states
from tff_ens.program import simulation
from tff_ens.templates import client_work
from tff_ens.templates import transport
from tiny import SPEC
from tiny import tiny_model

LR, NUM_CLIENTS, PER_ROUND, SEED = 0.3, 6, 3, 5
_RNG = np.random.default_rng(2)
# Six clients of two to four 2x2 images.
CLIENTS = [
  (_RNG.random((n, 2, 2, 1), dtype=np.float32), _RNG.integers(0, 3, n).astype(np.int32))
  for n in (2, 3, 4, 2, 3, 4)
]


def _cohort(round_num: int) -> np.ndarray:
  return simulation.sample_clients(NUM_CLIENTS, PER_ROUND, SEED, round_num)


def _datasets(built, cohort) -> list:
  """The cohort's datasets as the loop makes them (`FederatedAlgorithm.client_data`)."""
  batches = lambda x, y: tf.data.Dataset.from_tensor_slices((x, y)).batch(2)
  return [built.client_data(int(c), *CLIENTS[c], batches) for c in cohort]


class _Iterator(tff.program.FederatedDataSourceIterator):
  """Round t's client inputs: the cohort of (SEED, t), its datasets, keys and states (the
  algorithm's `next_args`), the states' files kept by a `ClientStateStore` (the last
  round's recorded by `finish`)."""

  # The population the iterators of a test draw from: (algorithm, store or None).
  population = (None, None)
  # The rounds selected, in order, across resumes.
  selected = []

  def __init__(self, round_num=0):
    (self._built, self._store), self._round = _Iterator.population, round_num

  @classmethod
  def from_bytes(cls, buffer: bytes):
    return cls(json.loads(buffer)["round"])

  def to_bytes(self) -> bytes:
    return json.dumps({"round": self._round}).encode()

  def __deepcopy__(self, memo):
    return _Iterator(self._round)

  @property
  def federated_type(self):
    return self._built.process.next.type_signature.parameter[1]

  def finish(self):
    self._store.round_outputs(self._round, _cohort(self._round), [0] * PER_ROUND, None)

  def select(self, k: int):
    assert k == PER_ROUND
    self._round += 1
    _Iterator.selected.append(self._round)
    cohort = _cohort(self._round)
    states = None
    if self._store is not None:
      # The previous round has run: its clients' new files are the newest.
      previous = self._round - 1
      if previous:
        self._store.round_outputs(previous, _cohort(previous), [0] * PER_ROUND, None)
      states = self._store.round_inputs(self._round, cohort, [0] * PER_ROUND)
    (inputs,) = self._built.next_args(_datasets(self._built, cohort), cohort, states=states)
    return inputs


class _Source(tff.program.FederatedDataSource):
  def __init__(self, iterator):
    self._iterator = iterator

  @property
  def federated_type(self):
    return self._iterator.federated_type

  def iterator(self):
    return copy.deepcopy(self._iterator)


def _train_model(process, source, rounds, state_dir) -> dict:
  """`tff.learning.programs.train_model` for `rounds` rounds; the states it released."""
  released = tff.program.MemoryReleaseManager()
  asyncio.run(
    tff.learning.programs.train_model(
      train_process=process,
      train_data_source=source,
      train_per_round_clients=PER_ROUND,
      train_total_rounds=rounds,
      program_state_manager=tff.program.FileProgramStateManager(str(state_dir)),
      model_output_manager=released,
      evaluation_manager=None,
      evaluation_periodicity=rounds,
    )
  )
  return released.values()


def _flat(weights) -> np.ndarray:
  return np.concatenate([np.ravel(t) for t in tf.nest.flatten(weights)])


def _build(name: str, files: bool = False, **flags):
  return algorithms.build_algorithm(
    name,
    lambda k=0: tiny_model(seed=k),
    SPEC,
    client_work.LocalTrainingConfig(LR),
    num_clients=NUM_CLIENTS,
    transport=transport.Transport(files=files),
    **flags,
  )


@pytest.mark.parametrize("name, flags", [("fedavg", {}), ("fedensemble", {"ensemble_size": 2})])
def test_tffs_train_model_drives_it_to_the_loops_state(name, flags, tmp_path):
  built = _build(name, **flags)
  assert isinstance(built.process, tff.learning.templates.LearningProcess)
  _Iterator.population = (built, None)
  with runtime.execution_context():
    released = _train_model(built.process, _Source(_Iterator()), 3, tmp_path)
    final = released["training_checkpoint_round_3"]
    state = built.process.initialize()
    for round_num in (1, 2, 3):
      cohort = _cohort(round_num)
      state, _ = built.next_fn(state, _datasets(built, cohort), cohort)
    got, want, initial = (
      _flat(built.process.get_model_weights(s)) for s in (final, state, built.process.initialize())
    )
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(want, initial)


def test_a_ditto_process_in_files_is_driven_and_resumed_by_tff_to_the_values_processes_models(
  tmp_path,
):
  files, values = _build("ditto", files=True), _build("ditto", files=False)
  assert isinstance(files.process, tff.learning.templates.LearningProcess)
  assert not isinstance(values.process, tff.learning.templates.LearningProcess)
  store = client_states.ClientStateStore(str(tmp_path / "states"), files.client_states)
  _Iterator.population, _Iterator.selected = (files, store), []
  source = _Source(_Iterator())
  with runtime.execution_context():
    # Two rounds, then train_model again to 4: it resumes from its own saved program state.
    _train_model(files.process, source, 2, tmp_path / "program")
    released = _train_model(files.process, source, 4, tmp_path / "program")
    _Iterator(round_num=4).finish()
    assert _Iterator.selected == [1, 2, 3, 4]  # The second call went on from round 2.
    final = released["training_checkpoint_round_4"]
    state, personal = values.process.initialize(), {}
    for round_num in (1, 2, 3, 4):
      cohort = _cohort(round_num)
      stored = [personal.get(int(c), values.client_states.initial_value()) for c in cohort]
      args = values.next_args(_datasets(values, cohort), cohort, states=stored)
      state, *outputs = values.process.next(state, *args)
      result = values.result(tuple(outputs))
      personal.update({int(c): s for c, s in zip(cohort, result.client_states)})
    got = _flat(files.process.get_model_weights(final))
  np.testing.assert_allclose(got, _flat(state["model"]), rtol=1e-6, atol=1e-7)
  assert sorted(personal) == sorted(c for c in range(NUM_CLIENTS) if store.stored(c, 0))
  for c, want in personal.items():
    np.testing.assert_allclose(store.load(c, 0), want, rtol=1e-6, atol=1e-7)
