"""Client dropouts, stragglers and rejected updates in the training loop."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tests.femnist_runs import QUICK
from tests.femnist_runs import read_metrics
from tff_ens.program import experiment
from tff_ens.program import simulation
from tff_ens.program import training


def test_no_faults_by_default():
  reports, work = simulation.simulate_faults(
    10, seed=0, round_num=1, dropout_rate=0.0, straggler_rate=0.0
  )
  assert reports.all() and (work == 1.0).all()


def test_faults_are_seeded_and_follow_the_rates():
  reports, work = simulation.simulate_faults(
    10_000, seed=1, round_num=2, dropout_rate=0.3, straggler_rate=0.4
  )
  again = simulation.simulate_faults(
    10_000, seed=1, round_num=2, dropout_rate=0.3, straggler_rate=0.4
  )
  np.testing.assert_array_equal(reports, again[0])
  np.testing.assert_array_equal(work, again[1])
  assert abs(1 - reports.mean() - 0.3) < 0.02
  straggles = work < 1.0
  assert abs(straggles.mean() - 0.4) < 0.02
  # A straggler's share of its epochs is uniform on (0, 1].
  assert work.min() > 0.0
  assert abs(work[straggles].mean() - 0.5) < 0.02


def test_straggler_dataset_stops_after_its_share_of_batches():
  x = np.zeros((100, 28, 28, 1), np.float32)
  y = np.zeros(100, np.int32)
  count = lambda work: sum(
    1 for _ in simulation.client_dataset(x, y, epochs=2, batch_size=10, seed=0, work=work)
  )
  assert count(1.0) == 20
  assert count(0.25) == 5
  assert count(1e-9) == 1


@pytest.mark.slow
def test_fed_ensemble_survives_dropouts_and_stragglers(tmp_path):
  # Fed-ensemble: the clients that report keep their assigned models (FedAvg
  # shares the loop; its all-dropout round is tested below).
  config = dataclasses.replace(
    QUICK,
    algorithm="fedensemble",
    ensemble_size=2,
    rounds=3,
    eval_every=3,
    dropout_rate=0.5,
    straggler_rate=0.5,
    output_dir=str(tmp_path),
  )
  summary = training.run_experiment(config)
  assert np.isfinite(summary["test_accuracy"])
  rows = read_metrics(tmp_path)
  used = [float(r["clients_used"]) for r in rows]
  expected = [simulation.simulate_faults(4, config.seed, r, 0.5, 0.5)[0].sum() for r in (1, 2, 3)]
  assert used == expected


@pytest.mark.slow
def test_round_where_every_client_drops_out_keeps_the_model(tmp_path):
  config = dataclasses.replace(
    QUICK, rounds=2, eval_every=1, dropout_rate=1.0, output_dir=str(tmp_path)
  )
  training.run_experiment(config)
  rows = read_metrics(tmp_path)
  assert [float(r["clients_used"]) for r in rows] == [0.0, 0.0]
  # No client trained: the model is the initial one in both rounds.
  assert rows[0]["test_accuracy"] == rows[1]["test_accuracy"]


def test_fault_rates_outside_zero_one_are_refused():
  with pytest.raises(experiment.UsageError, match="--dropout_rate must be in"):
    dataclasses.replace(QUICK, dropout_rate=1.5).validate()


def test_first_to_finish_keeps_the_fastest_reporting_clients():
  durations = np.array([5.0, 1.0, 3.0, 2.0, 4.0])
  reports = np.array([True, True, True, False, True])
  kept = simulation.first_to_finish(durations, reports, m=2)
  # Client 3 would be second but dropped out.
  np.testing.assert_array_equal(kept, [False, True, True, False, False])
  np.testing.assert_array_equal(simulation.first_to_finish(durations, reports, m=0), reports)
  # Fewer reporting clients than m: all of them.
  np.testing.assert_array_equal(simulation.first_to_finish(durations, reports, m=9), reports)


def test_round_plan_poisons_and_drops_only_reporting_clients():
  config = dataclasses.replace(
    QUICK, clients_per_round=8, dropout_rate=0.3, aggregate_first=4, nan_clients_per_round=2
  )
  sizes = np.arange(20, 220, 10)
  speeds = simulation.client_speeds(len(sizes), config.seed)
  faults = dict(
    seed=config.seed,
    epochs=config.client_epochs,
    batch_size=config.batch_size,
    dropout_rate=config.dropout_rate,
    aggregate_first=config.aggregate_first,
    nan_clients=config.nan_clients_per_round,
  )
  for round_num in range(1, 30):
    cohort = simulation.sample_clients(len(sizes), 8, config.seed, round_num)
    plan = simulation.plan_round(cohort, sizes, speeds, round_num, **faults)
    again = simulation.plan_round(cohort, sizes, speeds, round_num, **faults)
    np.testing.assert_array_equal(plan.reports, again.reports)
    assert plan.reports.sum() <= 4
    assert not (plan.late & plan.reports).any()
    assert not (plan.poisoned & ~plan.reports).any()
    assert plan.poisoned.sum() == min(2, plan.reports.sum())
    # Every late client is slower than every aggregated one.
    batches = np.ceil(sizes[plan.cohort] / config.batch_size)
    durations = plan.work * batches / speeds[plan.cohort]
    if plan.late.any() and plan.reports.any():
      assert durations[plan.late].min() >= durations[plan.reports].max()


@pytest.mark.slow
def test_nan_updates_are_rejected_and_late_clients_left_out(tmp_path):
  config = dataclasses.replace(
    QUICK,
    rounds=2,
    eval_every=2,
    aggregate_first=3,
    nan_clients_per_round=1,
    output_dir=str(tmp_path),
  )
  summary = training.run_experiment(config)
  rows = read_metrics(tmp_path)
  assert [float(r["clients_used"]) for r in rows] == [3.0, 3.0]
  assert [float(r["late_clients"]) for r in rows] == [1.0, 1.0]
  assert [float(r["rejected_updates"]) for r in rows] == [1.0, 1.0]
  # The NaN client never reaches the model.
  assert np.isfinite(float(rows[-1]["train_loss"]))
  assert np.isfinite(summary["test_loss"])
  model = tf.keras.models.load_model(tmp_path / "model.keras")
  assert all(np.isfinite(w).all() for w in model.get_weights())
