"""State that a client keeps between its rounds, stored for the simulation.

An algorithm declares what its clients keep (`algorithms.algorithm.ClientStates`): FedDyn's
clients a model-sized state g (Acar et al., ICLR 2021, Algorithm 1, line 8), with
Fed-ensemble one per model (the state's key); Ditto's clients their personal model. On
devices it stays on the device. In simulation it has to outlive the round, the Python
process and a resume, and for 105 FEMNIST writers and five LEAF CNNs it is 105 x 5 x 26 MB
= 13.7 GB, more than this machine can keep in memory next to TFF's worker. So
`ClientStateStore` keeps it on disk, in the run's directory: one `.npy` file
per (client, key, round it was written), written to a temporary name and
renamed, so a killed run never leaves half a file.

A resumed run restarts at its last checkpoint, so states written after that
round are stale: `rewind` deletes them and the versions written at or before
the checkpoint take over. `prune`, after each checkpoint, deletes the versions
no resume can need: all but the newest at or before the oldest checkpoint kept (a resume
starts there when the newest checkpoint is unreadable and deleted).
"""

import collections
import os
import re

import numpy as np

DIRECTORY = "client_states"
_NAME = re.compile(r"^client(\d+)_model(\d+)_round(\d+)\.npy$")


class ClientStateError(RuntimeError):
  """A stored client state cannot be read."""


class ClientStateStore:
  """The clients' states of one run, on disk under `directory`."""

  def __init__(self, directory: str, spec):
    """`spec`: what a client keeps (its `shape`, `dtype` and `initial_value()`)."""
    self._dir = directory
    self._spec = spec
    os.makedirs(directory, exist_ok=True)
    # (client, model) -> rounds it was written at, ascending.
    self._rounds = collections.defaultdict(list)
    for name in sorted(os.listdir(directory)):
      match = _NAME.match(name)
      if match:
        client, model, round_num = map(int, match.groups())
        self._rounds[(client, model)].append(round_num)
      elif name.endswith(".tmp.npy"):  # Left by a run killed mid-write.
        os.remove(os.path.join(directory, name))
    for rounds in self._rounds.values():
      rounds.sort()

  def _path(self, client: int, model: int, round_num: int) -> str:
    return os.path.join(self._dir, f"client{client:06d}_model{model:03d}_round{round_num:07d}.npy")

  def stored(self, client: int, model: int) -> bool:
    """Whether (client, model) has a stored state (it trained in a round since the start)."""
    return bool(self._rounds.get((client, model)))

  def load(self, client: int, model: int) -> np.ndarray:
    """The newest state of (client, model); its initial value if it has none yet."""
    rounds = self._rounds.get((client, model))
    if not rounds:
      return self._spec.initial_value()
    path = self._path(client, model, rounds[-1])
    try:
      stored = np.load(path)
    except (OSError, ValueError) as e:
      raise ClientStateError(
        f"cannot read client state {path} ({' '.join(str(e).split())[:200]})"
        ": the run's client_states directory is damaged; start the run "
        "again in a new --output_dir"
      ) from None
    spec = self._spec
    if stored.shape != tuple(spec.shape) or stored.dtype != spec.dtype:
      raise ClientStateError(
        f"client state {path} holds {stored.dtype}{list(stored.shape)}, the "
        f"model needs {spec.dtype}{list(spec.shape)}: it was "
        "written by another model; start the run again in a new "
        "--output_dir"
      )
    return stored

  def save(self, round_num: int, client: int, model: int, value: np.ndarray) -> None:
    """Stores (client, model)'s state as written in round `round_num`."""
    path = self._path(client, model, round_num)
    temporary = path[: -len(".npy")] + ".tmp.npy"
    np.save(temporary, np.asarray(value))
    os.replace(temporary, path)
    rounds = self._rounds[(client, model)]
    if round_num not in rounds:
      rounds.append(round_num)
      rounds.sort()

  def rewind(self, round_num: int) -> None:
    """Forgets the states written after round `round_num` (a resume's start)."""
    for key, rounds in self._rounds.items():
      while rounds and rounds[-1] > round_num:
        os.remove(self._path(*key, rounds.pop()))

  def prune(self, round_num: int) -> None:
    """Deletes versions older than the newest written at or before `round_num`."""
    for key, rounds in self._rounds.items():
      kept = [r for r in rounds if r <= round_num][-1:] + [r for r in rounds if r > round_num]
      for r in set(rounds) - set(kept):
        os.remove(self._path(*key, r))
      rounds[:] = kept
