"""Tests of `tff_ens.algorithms.random_walk` (Shi et al., Sec. V-H): the walks fixed by the
seed, a round in which every walker's model becomes its client's, and a resumed walk."""

import dataclasses
import shutil

import numpy as np
import pytest
import tensorflow_federated as tff

from tests.femnist_runs import QUICK
from tff_ens import algorithms
from tff_ens import run_files
from tff_ens.algorithms import random_walk
from tff_ens.program import training
from tff_ens.templates import client_work
from tiny import CLIENT_DATA
from tiny import SPEC
from tiny import one_batch
from tiny import tiny_model

ModelWeights = tff.learning.models.ModelWeights
Config = client_work.LocalTrainingConfig
LR = 0.5


def test_the_walks_are_fixed_by_the_seed():
  walks = [random_walk.walk_positions(105, 5, 0, t, "uniform") for t in range(1, 4)]
  again = [random_walk.walk_positions(105, 5, 0, t, "uniform") for t in range(1, 4)]
  other = [random_walk.walk_positions(105, 5, 1, t, "uniform") for t in range(1, 4)]
  np.testing.assert_array_equal(walks, again)
  assert not np.array_equal(walks, other)
  assert all(((w >= 0) & (w < 105)).all() for w in walks)
  # A ring: the walkers start spread over a seeded order of the clients and move one step a
  # round, so in N rounds each visits every client once.
  ring = np.array([random_walk.walk_positions(10, 2, 0, t, "ring") for t in range(1, 11)])
  for walker in ring.T:
    assert sorted(walker) == list(range(10))
  np.testing.assert_array_equal(ring[5:, 0], ring[:5, 1])  # Walker 1 starts half a ring on.


def test_a_round_replaces_every_walkers_model_by_its_clients():
  built = algorithms.build_algorithm(
    "random_walk",
    lambda k=0: tiny_model(seed=10 * k),
    SPEC,
    Config(learning_rate=LR),
    ensemble_size=3,
  )
  state = built.process.initialize()
  walkers = list(state["model"])
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  # The cohort's order is the walkers': client 2 carries walker 0, 0 walker 1, 1 walker 2.
  new_state, _ = built.next_fn(state, datasets, np.array([2, 0, 1]))
  config = Config(learning_rate=LR)
  for k, (x, y) in enumerate(CLIENT_DATA):
    result, _ = client_work.train_locally(
      tiny_model(), client_work.local_optimizer(config), walkers[k], one_batch(x, y), LR, config
    )
    want = [
      np.asarray(w) - np.asarray(u) for w, u in zip(walkers[k].trainable, result.update.trainable)
    ]
    for got, w in zip(new_state["model"][k].trainable, want):
      np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_resumed_walk_continues_the_same_walks(tmp_path):
  config = dataclasses.replace(
    QUICK,
    algorithm="random_walk",
    ensemble_size=2,
    rounds=3,
    checkpoint_every=1,
    output_dir=str(tmp_path / "run"),
  )
  summary = training.run_experiment(config)
  checkpoints = tmp_path / "run" / run_files.CHECKPOINT_DIR
  shutil.rmtree(checkpoints / f"{run_files.CHECKPOINT_PREFIX}3")
  again = training.run_experiment(dataclasses.replace(config, resume=True))
  assert again["test_accuracy"] == summary["test_accuracy"]
  assert again["member_test_accuracy"] == summary["member_test_accuracy"]
