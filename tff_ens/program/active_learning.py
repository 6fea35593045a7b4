"""Federated active learning by predictive entropy.

Bhatt, Gupta, Rai, ACML 2023, supplement, Algorithm 2: every client starts
with a small labeled part of its training data and treats the rest as an
unlabeled pool. Training runs in phases; after each phase every client scores
its pool with the global model's predictive distribution (FedPPD's student,
FedAvg's point model, an ensemble's mean), "annotates" the `budget` inputs of
highest predictive entropy (their labels are revealed), and training goes on
from the current model. `selection="random"` annotates a uniformly random
`budget` instead: the baseline the entropy curve is compared with.

The labeled sets are a pure function of the seed and the models at the ends
of the phases; `Pool` records each acquisition with its round so that a
resumed run rewinds to the checkpoint it resumes from.
"""

import dataclasses
import json
import math
import os

import numpy as np

from tff_ens import settings
from tff_ens.math import ensemble_math
from tff_ens.settings import setting

SELECTIONS = ("entropy", "random")
POOL_FILE = "active_learning.json"


@dataclasses.dataclass(frozen=True)
class ActiveLearningConfig:
  """Flags of active learning.

  Attributes:
    phases: A, the number of acquisitions (0: active learning is off). The
      run's rounds are split into A + 1 equal training phases.
    budget: B, inputs each client annotates per acquisition.
    initial_fraction: the labeled part of each client's data at the start
      (at least one example per client).
    selection: "entropy" (the paper's) or "random".
    rounds: the run's rounds.
  """

  phases: int = setting(
    0,
    "Active learning: A acquisitions after A+1 equal phases of --rounds (0: off).",
    flag="active_learning_rounds",
    at_least=0,
  )
  budget: int = setting(
    10,
    "Active learning: inputs each client annotates per acquisition.",
    flag="active_budget",
    above=0,
  )
  initial_fraction: float = setting(
    0.1,
    "Active learning: labeled part of each client's data at the start.",
    flag="active_initial_fraction",
    above=0,
    at_most=1,
  )
  selection: str = setting(
    "entropy",
    "Active learning: annotate the highest predictive entropy, or at random (the baseline).",
    flag="active_selection",
    choices=SELECTIONS,
  )
  rounds: int = setting(uses="rounds", above=0)

  def __post_init__(self):
    settings.check(self)
    if self.rounds % (self.phases + 1):
      raise settings.SettingError(
        "rounds",
        self.rounds,
        f"does not split into {self.phases + 1} equal phases (the acquisitions + 1): use a "
        "multiple of it",
      )

  @property
  def enabled(self) -> bool:
    return self.phases > 0

  def phase_ends(self) -> list[int]:
    """The rounds ending a phase: the last A of them are followed by an
    acquisition, the final one ends the run."""
    length = self.rounds // (self.phases + 1)
    return [length * k for k in range(1, self.phases + 2)]


def select(
  scores: np.ndarray, labeled: np.ndarray, budget: int, selection: str, rng: np.random.Generator
) -> np.ndarray:
  """Indices of the (at most) `budget` unlabeled inputs to annotate.

  Args:
    scores: predictive entropy of each of the client's inputs.
    labeled: bool mask of the inputs already labeled.
    budget: B.
    selection: "entropy": the highest scores (ties: lower index first);
      "random": uniformly among the unlabeled inputs.
    rng: the randomness of "random".
  """
  candidates = np.flatnonzero(~labeled)
  if selection == "entropy":
    order = np.argsort(-scores[candidates], kind="stable")
    return np.sort(candidates[order[:budget]])
  take = min(budget, len(candidates))
  return np.sort(rng.choice(candidates, size=take, replace=False))


class Pool:
  """Which training examples of each client are labeled, and the curve.

  Attributes:
    initial: client id -> indices labeled at the start.
    acquisitions: [{"round": r, "added": {client id: indices}}].
    curve: [{"round": r, "labeled": n, "test_accuracy": a}], one per phase.
  """

  def __init__(self, initial, acquisitions=(), curve=()):
    self.initial = initial
    self.acquisitions = list(acquisitions)
    self.curve = list(curve)

  @classmethod
  def start(cls, sizes: dict[str, int], fraction: float, seed: int) -> "Pool":
    """A seeded random `fraction` (at least 1) of each client's examples."""
    initial = {}
    for k, (client, n) in enumerate(sorted(sizes.items())):
      rng = np.random.default_rng([seed, k, 7])
      take = min(n, max(1, math.ceil(fraction * n)))
      initial[client] = np.sort(rng.choice(n, size=take, replace=False))
    return cls(initial)

  def masks(self, sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """client id -> bool mask of its labeled examples."""
    masks = {c: np.zeros(n, bool) for c, n in sizes.items()}
    for c, indices in self.initial.items():
      masks[c][indices] = True
    for acquisition in self.acquisitions:
      for c, indices in acquisition["added"].items():
        masks[c][indices] = True
    return masks

  def rewind(self, round_num: int) -> None:
    """Forgets what happened after `round_num` (a resumed run's start)."""
    self.acquisitions = [a for a in self.acquisitions if a["round"] <= round_num]
    self.curve = [p for p in self.curve if p["round"] <= round_num]

  def acquire(
    self,
    round_num: int,
    probabilities: dict[str, np.ndarray],
    sizes: dict[str, int],
    config: ActiveLearningConfig,
    seed: int,
  ) -> int:
    """Annotates B inputs per client; returns how many were revealed.

    Args:
      round_num: the round ending the phase.
      probabilities: client id -> the global model's predictive
        probabilities on *all* its training inputs (labeled ones ignored).
      sizes: client id -> number of training examples.
      config: the flags.
      seed: the run's seed (for "random").
    """
    masks = self.masks(sizes)
    added = {}
    for k, client in enumerate(sorted(sizes)):
      rng = np.random.default_rng([seed, k, round_num])
      picked = select(
        ensemble_math.entropy(probabilities[client]),
        masks[client],
        config.budget,
        config.selection,
        rng,
      )
      if len(picked):
        added[client] = picked
    self.acquisitions.append({"round": round_num, "added": added})
    return sum(len(v) for v in added.values())

  def save(self, directory: str) -> None:
    """Writes the pool atomically to `directory/POOL_FILE`."""
    value = {
      "initial": {c: v.tolist() for c, v in self.initial.items()},
      "acquisitions": [
        {"round": a["round"], "added": {c: np.asarray(v).tolist() for c, v in a["added"].items()}}
        for a in self.acquisitions
      ],
      "curve": self.curve,
    }
    path = os.path.join(directory, POOL_FILE)
    with open(f"{path}.tmp", "w") as f:
      json.dump(value, f)
    os.replace(f"{path}.tmp", path)

  @classmethod
  def load(cls, directory: str) -> "Pool | None":
    """The pool saved in `directory`, or None if there is none."""
    path = os.path.join(directory, POOL_FILE)
    if not os.path.exists(path):
      return None
    with open(path) as f:
      value = json.load(f)
    as_arrays = lambda d: {c: np.asarray(v, np.int64) for c, v in d.items()}
    return cls(
      as_arrays(value["initial"]),
      [{"round": a["round"], "added": as_arrays(a["added"])} for a in value["acquisitions"]],
      value["curve"],
    )


def pool_at_round(
  active: ActiveLearningConfig,
  seed: int,
  sizes: dict[str, int],
  output_dir: str,
  start_round: int,
) -> Pool | None:
  """The labeled pool of an active-learning run at `start_round`, or None."""
  if not active.enabled:
    return None
  pool = Pool.load(output_dir) if start_round else None
  if pool is None:
    pool = Pool.start(sizes, active.initial_fraction, seed)
  pool.rewind(start_round)
  return pool


def labeled(train, pool: Pool | None, sizes):
  """The training split restricted to the pool's labeled examples."""
  if pool is None:
    return train
  masks = pool.masks(sizes)
  return dataclasses.replace(
    train,
    x={c: train.x[c][masks[c]] for c in train.client_ids},
    y={c: train.y[c][masks[c]] for c in train.client_ids},
  )
