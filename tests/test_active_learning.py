"""Federated active learning: entropy selection, labels revealed, runs."""

import dataclasses
import json
import os

import numpy as np
import pytest

import tasks
from tests.femnist_runs import QUICK
from tests.femnist_runs import read_metrics
from tff_ens.program import active_learning
from tff_ens.program import training

CONFIG = active_learning.ActiveLearningConfig(phases=1, budget=2, rounds=4)


def test_entropy_selection_picks_the_highest_entropy_unlabeled_inputs():
  scores = np.array([0.1, 2.0, 1.5, 3.0, 0.2, 1.9])
  labeled = np.array([False, False, False, True, False, False])
  picked = active_learning.select(scores, labeled, 2, "entropy", np.random.default_rng(0))
  # 3.0 is already labeled: the two highest of the rest are 2.0 and 1.9.
  np.testing.assert_array_equal(picked, [1, 5])


def test_random_selection_draws_unlabeled_inputs_only():
  labeled = np.arange(100) % 2 == 0
  picked = active_learning.select(np.zeros(100), labeled, 10, "random", np.random.default_rng(1))
  assert len(set(picked)) == 10 and not labeled[picked].any()
  np.testing.assert_array_equal(
    picked, active_learning.select(np.zeros(100), labeled, 10, "random", np.random.default_rng(1))
  )


def _one_hot_or_uniform(n, uncertain):
  """Probabilities: uniform (max entropy) on `uncertain`, one-hot elsewhere."""
  probs = np.tile(np.eye(4)[0], (n, 1))
  probs[uncertain] = 0.25
  return probs


def test_acquisition_reveals_labels_of_the_selected_inputs_only():
  sizes = {"a": 30, "b": 5}
  pool = active_learning.Pool.start(sizes, 0.1, seed=0)
  initial = pool.masks(sizes)
  assert [m.sum() for m in initial.values()] == [3, 1]
  uncertain = {"a": [4, 17, 29], "b": [0, 1, 2, 3, 4]}
  probs = {c: _one_hot_or_uniform(n, uncertain[c]) for c, n in sizes.items()}
  revealed = pool.acquire(10, probs, sizes, CONFIG, seed=0)
  masks = pool.masks(sizes)
  for client in sizes:
    new = np.flatnonzero(masks[client] & ~initial[client])
    expected = [i for i in uncertain[client] if not initial[client][i]][:2]
    np.testing.assert_array_equal(new, expected)
  assert revealed == 4
  # The training split the loop builds holds exactly the labeled examples.
  x = {c: np.arange(n, dtype=np.float32) for c, n in sizes.items()}
  train = tasks.data.ClientArrays(("a", "b"), x, dict(x))
  labeled = active_learning.labeled(train, pool, sizes)
  for client in sizes:
    np.testing.assert_array_equal(labeled.y[client], np.flatnonzero(masks[client]))


def test_pool_survives_save_load_and_rewinds_to_a_checkpoint(tmp_path):
  sizes = {"a": 20}
  pool = active_learning.Pool.start(sizes, 0.2, seed=4)
  probs = {"a": np.full((20, 3), 1 / 3)}
  pool.acquire(5, probs, sizes, CONFIG, seed=4)
  pool.acquire(10, probs, sizes, CONFIG, seed=4)
  pool.save(str(tmp_path))
  loaded = active_learning.Pool.load(str(tmp_path))
  np.testing.assert_array_equal(loaded.masks(sizes)["a"], pool.masks(sizes)["a"])
  loaded.rewind(7)
  assert [a["round"] for a in loaded.acquisitions] == [5]
  assert loaded.masks(sizes)["a"].sum() == 4 + 2


def test_rounds_must_split_into_equal_phases():
  with pytest.raises(ValueError, match="rounds=5: does not split into 2 equal phases"):
    active_learning.ActiveLearningConfig(phases=1, rounds=5)


@pytest.fixture(scope="module")
def active_run(tmp_path_factory):
  config = dataclasses.replace(
    QUICK,
    rounds=4,
    eval_every=4,
    active_learning_rounds=1,
    active_budget=3,
    output_dir=str(tmp_path_factory.mktemp("active")),
  )
  return config, training.run_experiment(config)


@pytest.mark.slow
def test_active_learning_run_reports_the_curve(active_run):
  config, summary = active_run
  sizes = tasks.get_task("femnist").load_data(config.data_dir).train
  start = sum(int(np.ceil(0.1 * sizes.num_examples(c))) for c in sizes.client_ids)
  curve = summary["active_learning_curve"]
  assert [point[0] for point in curve] == [start, start + 3 * len(sizes.client_ids)]
  assert curve[-1][1] == summary["test_accuracy"]
  rows = read_metrics(config.output_dir)
  assert [r["labeled_examples"] for r in rows if r["labeled_examples"]] == [
    f"{float(p[0])}" for p in curve
  ]
  with open(os.path.join(config.output_dir, active_learning.POOL_FILE)) as f:
    assert [a["round"] for a in json.load(f)["acquisitions"]] == [2]
