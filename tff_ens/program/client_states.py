"""State that a client keeps between its rounds, stored for the simulation.

FedDyn's clients each keep a model-sized state g (Acar et al., ICLR 2021,
Algorithm 1, line 8); with Fed-ensemble, one per model. On devices it stays on
the device. In simulation it has to outlive the round, the Python process and
a resume, and for 105 FEMNIST writers and five LEAF CNNs it is 105 x 5 x 26 MB
= 13.7 GB, more than this machine can keep in memory next to TFF's worker. So
`ClientStateStore` keeps it on disk, in the run's directory: one `.npy` file
per (client, model, round it was written), written to a temporary name and
renamed, so a killed run never leaves half a file.

A resumed run restarts at its last checkpoint, so states written after that
round are stale: `rewind` deletes them and the versions written at or before
the checkpoint take over. `prune`, after each checkpoint, deletes the versions
no resume can need (all but the newest at or before the checkpoint).
"""

import collections
import dataclasses
import os
import re

import numpy as np

DIRECTORY = "client_states"
_NAME = re.compile(r"^client(\d+)_model(\d+)_round(\d+)\.npy$")


class ClientStateError(RuntimeError):
  """A stored client state cannot be read."""


@dataclasses.dataclass(frozen=True)
class ClientStateSpec:
  """What an algorithm's clients keep between rounds.

  Attributes:
    shape, dtype: a client's state (zeros before its first round), one per model it
      trains (`federated_algorithm.FederatedAlgorithm.client_models`).
  """

  shape: tuple[int, ...]
  dtype: np.dtype

  def zeros(self) -> np.ndarray:
    """A client's state before its first round."""
    return np.zeros(self.shape, self.dtype)


class ClientStateStore:
  """The clients' states of one run, on disk under `directory`."""

  def __init__(self, directory: str, spec: ClientStateSpec):
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

  def load(self, client: int, model: int) -> np.ndarray:
    """The newest state of (client, model); zeros if it has none yet."""
    rounds = self._rounds.get((client, model))
    if not rounds:
      return self._spec.zeros()
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
    if stored.shape != spec.shape or stored.dtype != spec.dtype:
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
