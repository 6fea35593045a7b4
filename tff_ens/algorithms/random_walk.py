"""Random walks (Shi et al., Fed-ensemble, IEEE T-ASE 2023, Sec. V-H): models that walk from
client to client, each client training the model it receives in turn, with no averaging at
the server. One walk (K = 1) is FedAvg Random Walk; K independent walks form Fed-ensemble
Random Walk, whose prediction is their ensemble's (the mixture, its uncertainty and the
personalized weights of Fed-ensemble apply).

Each round walker k's model is trained by the client its walk has reached and moves on
(`walk_positions`: uniformly at random among all clients, or along a seeded ring). The
round's cohort is the walkers' clients (`FederatedAlgorithm.cohort`), and the walks are a
function of (seed, round), so a resumed run continues the same walks. The stages are
Fed-ensemble's K keyed models (`fed_ensemble.build_fed_ensemble`) with each client keyed by
its walker (`walker_key`): a model's slot holds one client's update, so its new weights are
that client's.
"""

import numpy as np
import tensorflow as tf

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.algorithms import fed_ensemble
from tff_ens.settings import setting

WALKS = ("uniform", "ring")


@settings.group
class Settings:
  """How the walkers move."""

  walk: str = setting(
    "uniform",
    "Random walks: each walker's next client is drawn uniformly from all clients, or is the next"
    " one along a ring (a seeded order of the clients, the walkers spread evenly on it).",
    choices=WALKS,
  )


def walk_positions(num_clients: int, walkers: int, seed: int, round_num: int, walk: str):
  """The client each walker trains at in round `round_num` (from 1): a function of the seed.

  "uniform": independent uniform draws each round (walkers may meet at one client). "ring":
  walker k starts at position floor(k N / K) of a seeded permutation of the N clients and
  moves one position a round.
  """
  if walk == "uniform":
    return np.random.default_rng([seed, 4, round_num]).integers(num_clients, size=walkers)
  ring = np.random.default_rng([seed, 4]).permutation(num_clients)
  starts = (np.arange(walkers) * num_clients) // walkers
  return ring[(starts + round_num - 1) % num_clients]


def walker_key(key_state, walker):
  """The member a client trains: that of the walker (its int32) that reached it."""
  del key_state  # The walks, not the round, say which client trains which model.
  return tf.reshape(walker, [1])


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  k = context.group(fed_ensemble.Ensemble).ensemble_size
  built = fed_ensemble.build_fed_ensemble(
    context.model_fn,
    context.element_spec,
    context.local,
    ensemble_size=k,
    seed=context.seed,
    client_key=walker_key,
  )
  walk = context.group(Settings).walk
  return algorithm.FederatedAlgorithm.of(
    "random_walk",
    built,
    context,
    client_keys=lambda clients, slots: slots,
    cohort=lambda num_clients, seed, round_num, sample: walk_positions(
      num_clients, k, seed, round_num, walk
    ),
  )


ALGORITHM = algorithm.Algorithm(
  "random_walk",
  "Random walks (Shi et al. 2021, Sec. V-H): K models passed from client to client, no server "
  "average; their ensemble predicts",
  build,
  settings=(fed_ensemble.Ensemble, Settings),
  variant_flags=("ensemble_size",),
)
