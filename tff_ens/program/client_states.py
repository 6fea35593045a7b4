"""State that a client keeps between its rounds, stored for the simulation.

An algorithm declares what its clients keep (`algorithms.algorithm.ClientStates`): FedDyn's
clients a model-sized state g (Acar et al., ICLR 2021, Algorithm 1, line 8), with
Fed-ensemble one per model (the state's key); personalized clients their own model. On
devices it stays on the device. In simulation it has to outlive the round, the Python
process and a resume, and for 105 FEMNIST writers and five LEAF CNNs it is 105 x 5 x 26 MB
= 13.7 GB, more than this machine can keep in memory next to TFF's worker. So
`ClientStateStore` keeps it on disk, in the run's directory: one state file per (client, key,
round it was written), a TensorFlow checkpoint bundle of one tensor
(`stateful_client_work.write_state`: an `.index` and a `.data-00000-of-00001` file, each
written under a temporary name and renamed, so a killed run never leaves half a file), which
the program reads and writes or, with `ClientStates.in_files`, the clients' computations in
TFF's worker (`stateful_client_work.through_files`): the program then only names the files
(`round_inputs`).

A resumed run restarts at its last checkpoint, so states written after that
round are stale: `rewind` deletes them and the versions written at or before
the checkpoint take over. What a resume can need is, for each (client, key), its newest
version at or before each checkpoint kept (a resume starts from the older one when the newest
checkpoint is unreadable and deleted), and the run its newest: `prune` deletes the others
after each checkpoint, and a version written since the newest checkpoint is deleted as soon
as a newer one replaces it. So a client keeps at most three versions (one for each of the two
checkpoints kept and its newest), whatever `--checkpoint_every` is. Stores written by earlier
versions (a serialized `TensorProto` or an `.npy` file per state) are converted when opened.
"""

import collections
import os
import re

from google.protobuf import message
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2

from tff_ens.templates import stateful_client_work

DIRECTORY = "client_states"
_NAME = re.compile(r"^client(\d+)_model(\d+)_round(\d+)$")
_INDEX, _DATA = stateful_client_work.STATE_FILE_SUFFIXES
# Earlier versions' formats: a serialized TensorProto, a NumPy array.
_OLD_NAME = re.compile(r"^((?:client\d+_model\d+_round\d+)|initial)\.(pb|npy)$")
_INITIAL = "initial"


class ClientStateError(RuntimeError):
  """A stored client state cannot be read."""


class ClientStateStore:
  """The clients' states of one run, on disk under `directory`."""

  def __init__(self, directory: str, spec):
    """`spec`: what a client keeps (`algorithms.algorithm.ClientStates`)."""
    self._dir = os.path.abspath(directory)  # TFF's worker may run in another directory.
    self._spec = spec
    # Owner only: what clients keep (personal models, FedDyn's g) is derived from their data.
    os.makedirs(self._dir, mode=0o700, exist_ok=True)
    # (client, model) -> rounds it was written at, ascending.
    self._rounds = collections.defaultdict(list)
    # The newest checkpoint's round (`rewind`, `prune`): versions after it that a newer one
    # replaces are needed by no resume.
    self._newest_checkpoint = 0
    names = sorted(os.listdir(self._dir))
    present = set(names)  # A full-size run's store holds tens of thousands of files.
    for name in names:
      path = os.path.join(self._dir, name)
      if ".tmp" in name or ".tempstate" in name:  # Left by a run killed mid-write.
        os.remove(path)
        continue
      if name.endswith(_DATA) and name[: -len(_DATA)] + _INDEX not in present:
        os.remove(path)  # Its index was never written.
        continue
      old = _OLD_NAME.match(name)
      if old:  # Written by an earlier version.
        self._write(os.path.join(self._dir, old.group(1)), self._read_old(path))
        os.remove(path)
        name = old.group(1) + _INDEX
      match = _NAME.match(name[: -len(_INDEX)]) if name.endswith(_INDEX) else None
      if match:
        client, model, round_num = map(int, match.groups())
        self._rounds[(client, model)].append(round_num)
    for rounds in self._rounds.values():
      rounds.sort()
    if spec.in_files:
      self._write(os.path.join(self._dir, _INITIAL), spec.initial_value())
      if self._rounds:  # The clients read them in TFF's worker: check one here.
        self.load(*min(self._rounds))

  def _path(self, client: int, model: int, round_num: int) -> str:
    """The state file's prefix (`stateful_client_work.write_state`)."""
    return os.path.join(self._dir, f"client{client:06d}_model{model:03d}_round{round_num:07d}")

  @staticmethod
  def _write(path: str, value: np.ndarray) -> None:
    stateful_client_work.write_state(path, tf.constant(np.asarray(value)))

  def _remove(self, path: str) -> None:
    # The index first: what is left is no state.
    for suffix in stateful_client_work.STATE_FILE_SUFFIXES:
      os.remove(path + suffix)

  def _read_old(self, path: str) -> np.ndarray:
    """A state file of an earlier version."""
    try:
      if path.endswith(".npy"):
        return np.load(path)
      with open(path, "rb") as f:
        return tf.make_ndarray(tensor_pb2.TensorProto.FromString(f.read()))
    except (OSError, ValueError, TypeError, message.DecodeError) as e:
      raise self._damaged(path, e) from None

  @staticmethod
  def _damaged(path: str, error: Exception) -> ClientStateError:
    return ClientStateError(
      f"cannot read client state {path} ({' '.join(str(error).split())[:200]})"
      ": the run's client_states directory is damaged; start the run "
      "again in a new --output_dir"
    )

  def _read(self, path: str) -> np.ndarray:
    spec = self._spec
    try:
      stored = stateful_client_work.read_state(path, tf.as_dtype(spec.dtype)).numpy()
    except tf.errors.OpError as e:
      raise self._damaged(path, e) from None
    if stored.shape != tuple(spec.shape):
      raise ClientStateError(
        f"client state {path} holds {stored.dtype}{list(stored.shape)}, the "
        f"model needs {spec.dtype}{list(spec.shape)}: it was "
        "written by another model; start the run again in a new "
        "--output_dir"
      )
    return stored

  def stored(self, client: int, model: int) -> bool:
    """Whether (client, model) has a stored state (it trained in a round since the start)."""
    return bool(self._rounds.get((client, model)))

  def load(self, client: int, model: int) -> np.ndarray:
    """The newest state of (client, model); its initial value if it has none yet."""
    rounds = self._rounds.get((client, model))
    if not rounds:
      return self._spec.initial_value()
    return self._read(self._path(client, model, rounds[-1]))

  def save(self, round_num: int, client: int, model: int, value: np.ndarray) -> None:
    """Stores (client, model)'s state as written in round `round_num`."""
    self._write(self._path(client, model, round_num), value)
    self._record(round_num, client, model)

  def _record(self, round_num: int, client: int, model: int) -> None:
    rounds = self._rounds[(client, model)]
    if round_num not in rounds:
      rounds.append(round_num)
      rounds.sort()
    if len(rounds) > 1 and rounds[-2] > self._newest_checkpoint:
      self._remove(self._path(client, model, rounds.pop(-2)))

  def round_inputs(self, round_num: int, clients, models) -> list:
    """What `next` takes for each (client, model) of round `round_num`: its newest state,
    or with `in_files` the paths of that state (the initial one's before its first round)
    and of the state the round writes."""
    if not self._spec.in_files:
      return [self.load(int(c), int(m)) for c, m in zip(clients, models)]
    inputs = []
    for c, m in zip(clients, models):
      rounds = self._rounds.get((int(c), int(m)))
      read = self._path(int(c), int(m), rounds[-1]) if rounds else os.path.join(self._dir, _INITIAL)
      inputs.append(np.array([read, self._path(int(c), int(m), round_num)]))
    return inputs

  def round_outputs(self, round_num: int, clients, models, outputs) -> None:
    """Stores the states `next` returned for round `round_num` (`round_inputs`' clients), or
    with `in_files` (`outputs` None) records the files the clients wrote."""
    for i, (c, m) in enumerate(zip(clients, models)):
      if self._spec.in_files:
        self._record(round_num, int(c), int(m))
      else:
        self.save(round_num, int(c), int(m), outputs[i])

  def rewind(self, round_num: int) -> None:
    """Forgets the states written after round `round_num` (a resume's start, its newest
    checkpoint)."""
    for key, rounds in self._rounds.items():
      while rounds and rounds[-1] > round_num:
        self._remove(self._path(*key, rounds.pop()))
    self._newest_checkpoint = round_num

  def prune(self, checkpoints) -> None:
    """Deletes the versions no resume can need, given the rounds of the checkpoints kept:
    all but the newest at or before each of them and the newest of all."""
    for key, rounds in self._rounds.items():
      kept = {rounds[-1]} if rounds else set()
      for checkpoint in checkpoints:
        before = [r for r in rounds if r <= checkpoint]
        kept.update(before[-1:])
      for r in set(rounds) - kept:
        self._remove(self._path(*key, r))
      rounds[:] = sorted(kept)
    self._newest_checkpoint = max(checkpoints, default=0)
