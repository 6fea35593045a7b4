"""Tests of `tff_ens.templates.privacy`: DP-FedAvg's aggregation and its accounting.

The accounting is checked against dp_accounting's own composition and, for
full participation, against the Gaussian mechanism's RDP by hand. The
aggregation runs as real TFF rounds: the clipped mean against per-client
updates computed outside TFF and clipped with NumPy, the noise's standard
deviation on a model with thousands of weights, the DP event TFF records, and
a short DP-FedAvg run on the FEMNIST slice.
"""

import dataclasses
import json
import os

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests.femnist_runs import QUICK
from tests.femnist_runs import read_metrics
from tests.tiny import POSTERIOR_USES
from tff_ens import algorithms
from tff_ens import run_files
from tff_ens.algorithms import fed_ensemble
from tff_ens.algorithms import fedavg
from tff_ens.algorithms import fedppd
from tff_ens.math import fedppd_local
from tff_ens.math import member_updates
from tff_ens.program import experiment
from tff_ens.program import training
from tff_ens.templates import client_work
from tff_ens.templates import composition
from tff_ens.templates import privacy
from tiny import SPEC
from tiny import one_batch
from tiny import tiny_model

Config = client_work.LocalTrainingConfig

LR = 0.5
CLIENT_DATA = [
  ([[1.0, 0.0, -1.0, 2.0], [0.5, -0.5, 1.0, 0.0]], [0, 2]),
  ([[-1.0, 2.0, 0.0, 1.0], [2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 1.0, 3.0]], [1, 1, 0]),
  ([[0.0, 1.0, 1.0, -2.0], [1.0, 1.0, 1.0, 1.0]], [2, 0]),
  ([[2.0, -1.0, 0.5, 0.0]], [1]),
]


# ---------------------------------------------------------------- accounting


def _library_epsilon(z, m, n, rounds, delta):
  accountant = dp_accounting.rdp.RdpAccountant(
    neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
  )
  accountant.compose(
    dp_accounting.SampledWithoutReplacementDpEvent(n, m, dp_accounting.GaussianDpEvent(z / 2)),
    rounds,
  )
  return accountant.get_epsilon(delta)


@pytest.mark.parametrize(
  "z, m, n, rounds", [(1.0, 10, 105, 50), (0.3, 4, 105, 7), (2.0, 20, 1000, 200)]
)
def test_epsilon_is_dp_accountings_composition(z, m, n, rounds):
  delta = privacy.default_target_delta(n)
  got = privacy.epsilons(z, m, n, rounds, delta)
  assert got.shape == (rounds,)
  for r in (1, rounds // 2, rounds):
    np.testing.assert_allclose(got[r - 1], _library_epsilon(z, m, n, r, delta), rtol=1e-9)


def test_full_participation_epsilon_by_hand():
  # m = N: no sampling; the sum of clipped updates has replace-one
  # sensitivity 2C, so R rounds of noise z C are (alpha, 2 R alpha / z^2)-RDP,
  # converted to (epsilon, delta) as in Canonne et al. 2020 (Prop. 12).
  z, n, rounds, delta = 4.0, 50, 10, 1e-5
  alpha = np.array(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
  alpha = alpha[alpha > 1.01]
  rdp = 2 * rounds * alpha / z**2
  by_hand = np.min(rdp + np.log1p(-1 / alpha) - np.log(delta * alpha) / (alpha - 1))
  got = privacy.epsilons(z, n, n, rounds, delta)[-1]
  np.testing.assert_allclose(got, by_hand, rtol=1e-9)
  # Sampling 10 of the 50 amplifies privacy.
  assert privacy.epsilons(z, 10, n, rounds, delta)[-1] < got / 2


def test_epsilon_grows_with_rounds_and_shrinks_with_noise():
  delta = privacy.default_target_delta(105)
  by_round = privacy.epsilons(1.0, 10, 105, 30, delta)
  assert np.all(np.diff(by_round) > 0)
  by_noise = [privacy.epsilons(z, 10, 105, 30, delta)[-1] for z in (0.5, 1.0, 2.0, 4.0)]
  assert np.all(np.diff(by_noise) < 0)
  larger_delta = privacy.epsilons(1.0, 10, 105, 30, 10 * delta)[-1]
  assert larger_delta < by_round[-1]
  with pytest.raises(ValueError, match="noise multiplier > 0"):
    privacy.epsilons(0.0, 10, 105, 30, delta)


def test_default_delta_is_below_one_over_n():
  assert privacy.default_target_delta(105) == pytest.approx(105**-1.1)
  assert privacy.default_target_delta(105) < 1 / 105


# --------------------------------------------------------------- aggregation


def wide_model(seed=0):
  """Flatten(2x2x1) -> Dense(1000) -> Dense(3): 8003 weights to noise."""
  init = tf.keras.initializers.RandomNormal(stddev=0.5, seed=seed)
  return tf.keras.Sequential(
    [
      tf.keras.layers.Input((2, 2, 1)),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(1000, kernel_initializer=init),
      tf.keras.layers.Dense(3, kernel_initializer=init),
    ]
  )


def _flat(weights):
  return np.concatenate([np.ravel(t) for t in tf.nest.flatten(weights)])


def _clipped_update(model_fn, initial, x, y, clip):
  """One client's update from `train_locally`, clipped by NumPy."""
  result, _ = client_work.train_locally(
    model_fn(),
    tff.learning.optimizers.build_sgdm(learning_rate=LR),
    initial,
    one_batch(x, y),
    tf.constant(LR),
    Config(learning_rate=LR),
  )
  update = _flat(result.update)
  norm = np.linalg.norm(update)
  return update * min(1.0, clip / norm), norm


def _dp_fedavg(model_fn, dp):
  process = fedavg.build_fedavg(
    model_fn, SPEC, Config(learning_rate=LR), aggregator_factory=dp.aggregator_factory()
  ).process
  return process


def _dp_event(state) -> dp_accounting.DpEvent:
  """The DP event TFF's DP aggregator recorded in the last round of `state`."""
  return dp_accounting.DpEvent.from_named_tuple(state.aggregator.dp_event)


def _effective_noise_multiplier(event):
  events = event.events if isinstance(event, dp_accounting.ComposedDpEvent) else [event]
  return sum(e.noise_multiplier**-2 for e in events) ** -0.5


def test_clipped_mean_without_noise_is_clipped_updates_over_cohort():
  clip, m = 0.05, 3
  process = _dp_fedavg(tiny_model, privacy.DPConfig(0.0, clip, clients_per_round=m))
  state = process.initialize()
  w0 = process.get_model_weights(state)
  data = CLIENT_DATA[:m]
  output = process.next(state, [one_batch(x, y) for x, y in data])
  step = _flat(w0) - _flat(process.get_model_weights(output.state))

  clipped, norms = zip(*[_clipped_update(tiny_model, w0, x, y, clip) for x, y in data])
  assert min(norms) > clip  # Every update is clipped ...
  np.testing.assert_allclose(step, np.sum(clipped, 0) / m, rtol=1e-4, atol=1e-7)
  assert np.linalg.norm(step) <= clip * (1 + 1e-5)  # ... so is their mean.
  assert _dp_event(output.state) == dp_accounting.GaussianDpEvent(0.0)


def test_noise_of_the_mean_has_std_z_clip_over_cohort():
  clip, z, m = 0.1, 0.5, 4
  process = _dp_fedavg(wide_model, privacy.DPConfig(z, clip, clients_per_round=m))
  state = process.initialize()
  w0 = process.get_model_weights(state)
  output = process.next(state, [one_batch(x, y) for x, y in CLIENT_DATA])
  clipped = [_clipped_update(wide_model, w0, x, y, clip)[0] for x, y in CLIENT_DATA]
  noise_free = _flat(w0) - np.sum(clipped, 0) / m
  noise = _flat(process.get_model_weights(output.state)) - noise_free
  assert noise.size == 8003
  np.testing.assert_allclose(np.std(noise), z * clip / m, rtol=0.05)
  assert abs(np.mean(noise)) < 4 * z * clip / m / np.sqrt(noise.size)
  # What TFF records for accounting is the flag's z.
  assert _effective_noise_multiplier(_dp_event(output.state)) == (pytest.approx(z))


def test_adaptive_clip_is_measured_and_accounted_at_z():
  z, m = 0.15, 2
  process = _dp_fedavg(tiny_model, privacy.DPConfig(z, 0.0, clients_per_round=m))
  output = process.next(process.initialize(), [one_batch(x, y) for x, y in CLIENT_DATA[:m]])
  metrics = privacy.aggregator_metrics(output.metrics["aggregator"])
  # TFF starts the clip at 0.1 and moves it by at most a factor exp(0.2).
  assert 0.1 * np.exp(-0.2) <= metrics["dp_clip_norm"] <= 0.1 * np.exp(0.2)
  event = _dp_event(output.state)
  assert isinstance(event, dp_accounting.ComposedDpEvent)  # Update + count.
  assert _effective_noise_multiplier(event) == pytest.approx(z, rel=1e-5)
  assert privacy.aggregator_metrics({"mean_value": ()}) == {}


def test_fed_ensemble_slots_are_clipped_and_noised():
  clip, z, m, k, seed = 0.1, 0.5, 4, 2, 4
  built = fed_ensemble.build_fed_ensemble(
    lambda i: wide_model(seed=10 * i),
    SPEC,
    Config(learning_rate=LR),
    ensemble_size=k,
    seed=seed,
    dp=privacy.DPConfig(z, clip, clients_per_round=m),
  )
  indices = [0, 1, 2, 3]
  keys = [int(member_updates.assigned_model(seed, i, 0, k)) for i in indices]
  assert sorted(set(keys)) == [0, 1], "pick clients training both members"
  state = built.process.initialize()
  before = list(state["model"])
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  clients = [np.int32(i) for i in indices]
  new_state, _ = built.process.next(state, composition.client_inputs(datasets, clients))
  noise = []
  for member in range(k):
    clipped = [
      _clipped_update(wide_model, before[member], x, y, clip)[0]
      for (x, y), key in zip(CLIENT_DATA, keys)
      if key == member
    ]
    # Slot sums over the expected m / K clients per member, plus noise.
    noise_free = _flat(before[member]) - np.sum(clipped, 0) / (m / k)
    noise.append(_flat(new_state["model"][member]) - noise_free)
  noise = np.concatenate(noise)
  np.testing.assert_allclose(np.std(noise), z * clip / (m / k), rtol=0.05)
  # Not a function of --seed (which would let it be subtracted): the same
  # round again draws other noise.
  again, _ = built.process.next(state, composition.client_inputs(datasets, clients))
  for a, b in zip(again["model"], new_state["model"]):
    assert np.all(_flat(a) != _flat(b))
  with pytest.raises(ValueError, match="fixed clip norm"):
    fed_ensemble.build_fed_ensemble(
      tiny_model,
      SPEC,
      Config(),
      ensemble_size=k,
      dp=privacy.DPConfig(0.1, 0.0, clients_per_round=m),
    )


def test_fedppd_clips_the_joined_teacher_and_student_update():
  clip, m = 0.05, 2
  config = fedppd_local.PosteriorConfig(**POSTERIOR_USES, teacher_step_size=0.01, student_lr=0.5)
  built = fedppd.build_fedppd(
    lambda: tiny_model(0),
    lambda: tiny_model(5),
    SPEC,
    config,
    aggregator_factory=privacy.DPConfig(0.0, clip, clients_per_round=m).aggregator_factory(),
  )
  state = built.process.initialize()
  w0 = built.process.get_model_weights(state)
  data = [one_batch(x, y) for x, y in CLIENT_DATA[:m]]
  output = built.process.next(state, data)
  step = _flat(w0) - _flat(built.process.get_model_weights(output.state))
  clipped = []
  for dataset in data:
    result, _ = fedppd.train_teacher_student(
      tiny_model(0), tiny_model(5), w0, dataset, tf.constant(0), config
    )
    update = _flat(result.update)
    assert np.linalg.norm(update) > clip
    clipped.append(update * clip / np.linalg.norm(update))
  np.testing.assert_allclose(step, np.sum(clipped, 0) / m, rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------- the flags


@pytest.mark.parametrize("algorithm", ["fedbe", "feddf", "vdistill", "fedppd_distill"])
def test_dp_for_distillation_algorithms_is_refused(algorithm):
  config = dataclasses.replace(
    QUICK, algorithm=algorithm, dp_noise_multiplier=0.1, dp_clip_norm=1.0
  )
  refused = f"--dp_clip_norm=1.0: {algorithm}'s server needs more than the mean of the clients'"
  with pytest.raises(experiment.UsageError, match=refused):
    config.validate()
  with pytest.raises(ValueError, match=f"{algorithm} does not take dp"):
    algorithms.build_algorithm(
      algorithm,
      lambda k=0: tiny_model(),
      SPEC,
      Config(),
      dp=privacy.DPConfig(0.1, 1.0, clients_per_round=4),
      **({"client_epochs": 1} if algorithm == "fedppd_distill" else {}),  # FedPPD's SGLD.
    )


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(dp_noise_multiplier=-0.1), "--dp_noise_multiplier must be >= 0"),
    (dict(dp_clip_norm=-1.0), "--dp_clip_norm must be >= 0"),
    (dict(dp_noise_multiplier=1.0, dp_target_delta=1.5), "--dp_target_delta must be in"),
    (dict(dp_target_delta=1e-5), "needs --dp_noise_multiplier > 0"),
    (
      dict(algorithm="fedensemble", dp_noise_multiplier=0.1),
      "fedensemble clips with a fixed norm only: set --dp_clip_norm",
    ),
    # QUICK samples 4 clients: TFF's adaptive clip allows z < 0.4.
    (dict(dp_noise_multiplier=0.5), "below 0.4"),
  ],
)
def test_bad_dp_flags_are_one_line_errors(change, message):
  with pytest.raises(experiment.UsageError, match=message) as error:
    dataclasses.replace(QUICK, **change).validate()
  assert "\n" not in str(error.value)


# ------------------------------------------------------------ FEMNIST run


@pytest.mark.slow
def test_dp_fedavg_run_reports_epsilon_for_its_delta(tmp_path):
  z = 0.3
  config = dataclasses.replace(QUICK, rounds=2, dp_noise_multiplier=z, output_dir=str(tmp_path))
  summary = training.run_experiment(config)
  n, m = 105, config.clients_per_round  # Training writers of the slice.
  delta = n**-1.1
  assert summary["dp_delta"] == pytest.approx(delta)
  assert summary["dp_epsilon"] == pytest.approx(_library_epsilon(z, m, n, 2, delta), rel=1e-9)
  assert summary["dp_noise_multiplier"] == z
  assert summary["dp_clipping"] == "adaptive"
  with open(os.path.join(config.output_dir, run_files.SUMMARY_FILE)) as f:
    assert json.load(f)["dp_epsilon"] == summary["dp_epsilon"]
  rows = read_metrics(config.output_dir)
  epsilons = [float(r["dp_epsilon"]) for r in rows]
  assert epsilons[0] == pytest.approx(_library_epsilon(z, m, n, 1, delta))
  assert epsilons[0] < epsilons[1] == pytest.approx(summary["dp_epsilon"])
  clips = [float(r["dp_clip_norm"]) for r in rows]
  assert all(c > 0 for c in clips)
  assert summary["dp_clip_norm"] == pytest.approx(clips[-1])
  assert np.isfinite(float(rows[-1]["test_accuracy"]))
