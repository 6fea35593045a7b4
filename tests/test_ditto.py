"""Tests of `tff_ens.algorithms.ditto` (Li et al., ICML 2021, Algorithm 1): the personal step
by hand, a round against FedAvg's and the personal models kept as the clients' states, and a
run's personal models on its writers."""

import dataclasses
import functools
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from export import ExportError
from export import convert
from export import on_device
from export import runs
import tasks
from tests import numpy_references
from tests.femnist_runs import QUICK
from tff_ens import algorithms
from tff_ens import run_files
from tff_ens import settings
from tff_ens.algorithms import ditto
from tff_ens.program import client_states
from tff_ens.program import experiment
from tff_ens.program import simulation
from tff_ens.program import training
from tff_ens.templates import client_work
from tff_ens.templates import composition
from tff_ens.templates import stateful_client_work
from tiny import CLIENT_DATA
from tiny import SPEC
from tiny import one_batch
from tiny import tiny_model

ModelWeights = tff.learning.models.ModelWeights
Config = client_work.LocalTrainingConfig
LR, LAMBDA = 0.5, 0.3
# The authors' code's Ditto: one lambda for every client, personal models from w^0.
FIXED = dict(ditto_lambda_choice="fixed", ditto_personal_start="w0")


def _numpy(weights):
  return [np.asarray(t, np.float64) for t in weights.trainable]


def _mean_cross_entropy_gradient(kernel, bias, x, y):
  """d mean CE / d (kernel, bias) of a dense layer on rows `x`, labels `y`."""
  logits = x @ kernel + bias
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  d = (p - np.eye(3)[y]) / len(x)
  return x.T @ d, d.sum(0)


def test_personal_step_is_one_sgd_step_with_the_proximal_gradient():
  # v <- v - lr (grad F(v) + lambda (v - w)) (Algorithm 1, line 8): one batch, one step.
  x, y = CLIENT_DATA[1]
  personal = ModelWeights.from_model(tiny_model(seed=5))
  global_weights = ModelWeights.from_model(tiny_model(seed=0))
  config = Config(learning_rate=LR, proximal_mu=LAMBDA)
  new, metrics = ditto.train_personal(
    tiny_model(),
    client_work.local_optimizer(config),
    personal,
    global_weights,
    one_batch(x, y),
    LR,
    config,
  )
  (kernel, bias), (w_kernel, w_bias) = _numpy(personal), _numpy(global_weights)
  grad_kernel, grad_bias = _mean_cross_entropy_gradient(
    kernel, bias, np.asarray(x, np.float64), np.asarray(y)
  )
  want_kernel = kernel - LR * (grad_kernel + LAMBDA * (kernel - w_kernel))
  want_bias = bias - LR * (grad_bias + LAMBDA * (bias - w_bias))
  np.testing.assert_allclose(new.trainable[0], want_kernel, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new.trainable[1], want_bias, rtol=1e-5, atol=1e-6)
  assert float(metrics["num_examples"]) == 3


def test_a_round_is_fedavgs_for_the_global_model_and_keeps_each_personal_model():
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  built = algorithms.build_algorithm(
    "ditto", lambda k=0: tiny_model(), SPEC, Config(LR), ditto_lambda=LAMBDA, **FIXED
  )
  fedavg = algorithms.build_algorithm("fedavg", lambda k=0: tiny_model(), SPEC, Config(LR))
  # Each client's state starts as the initial global model (the authors' code).
  initial = built.client_states.initial_value()
  state = built.process.initialize()
  np.testing.assert_allclose(
    initial, stateful_client_work.flatten(state["model"]).numpy(), rtol=0, atol=0
  )
  personal = [initial + 0.1 * c for c in range(3)]  # Three different personal models.
  new_state, _, new_personal = built.process.next(
    state, composition.client_inputs(datasets, states=personal)
  )
  # The global model moves as FedAvg's.
  fedavg_state = fedavg.process.next(fedavg.process.initialize(), datasets).state
  for got, want in zip(
    _numpy(new_state["model"]), _numpy(fedavg.process.get_model_weights(fedavg_state))
  ):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Each personal model moves from its own start, pulled towards the round's global model.
  config = Config(learning_rate=LR, proximal_mu=LAMBDA)
  for (x, y), start, got in zip(CLIENT_DATA, personal, new_personal):
    start_weights = stateful_client_work.unflatten_numpy(start, state["model"])
    want, _ = ditto.train_personal(
      tiny_model(),
      client_work.local_optimizer(config),
      start_weights,
      state["model"],
      one_batch(x, y),
      LR,
      config,
    )
    np.testing.assert_allclose(got, stateful_client_work.flatten(want), rtol=1e-5, atol=1e-6)
  # The personal model never travels: the bytes are FedAvg's, and three metric sums more.
  (down, up), (fedavg_down, fedavg_up) = (
    built.bytes_per_client_round(),
    fedavg.bytes_per_client_round(),
  )
  assert (down, up) == (fedavg_down, fedavg_up + 3 * 4)


def test_on_shuffled_data_the_global_pass_is_fedavgs_and_the_personal_pass_the_next_shuffle():
  """Four clients of six examples, two epochs of batch 2, reshuffled each pass: the global
  model must read the first pass (FedAvg's order) and each personal model the second,
  whatever order TensorFlow would run two independent passes in."""
  rng = np.random.default_rng(3)
  data = [
    (rng.random((6, 2, 2, 1), dtype=np.float32), rng.integers(0, 3, 6).astype(np.int32))
    for _ in range(4)
  ]
  datasets = [
    simulation.client_dataset(x, y, epochs=2, batch_size=2, seed=c) for c, (x, y) in enumerate(data)
  ]
  built = algorithms.build_algorithm(
    "ditto", lambda k=0: tiny_model(), SPEC, Config(LR), ditto_lambda=LAMBDA, **FIXED
  )
  fedavg = algorithms.build_algorithm("fedavg", lambda k=0: tiny_model(), SPEC, Config(LR))
  state = built.process.initialize()
  personal = [built.client_states.initial_value()] * len(data)
  new_state, _, new_personal = built.process.next(
    state, composition.client_inputs(datasets, states=personal)
  )
  fedavg_state = fedavg.process.next(fedavg.process.initialize(), datasets).state
  for got, want in zip(
    _numpy(new_state["model"]), _numpy(fedavg.process.get_model_weights(fedavg_state))
  ):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  config = Config(learning_rate=LR, proximal_mu=LAMBDA)
  for dataset, start, got in zip(datasets, personal, new_personal):
    for _ in dataset:  # The first pass, the global model's.
      pass
    want, _ = ditto.train_personal(
      tiny_model(),
      client_work.local_optimizer(config),
      stateful_client_work.unflatten_numpy(start, state["model"]),
      state["model"],
      dataset,
      LR,
      config,
    )
    np.testing.assert_allclose(got, stateful_client_work.flatten(want), rtol=1e-5, atol=1e-6)


def test_personal_steps_can_be_fewer_than_the_global_ones():
  x, y = CLIENT_DATA[1]
  three_batches = tf.data.Dataset.from_tensor_slices(
    (np.asarray(x, np.float32).reshape(-1, 2, 2, 1), np.asarray(y, np.int32))
  ).batch(1)
  built = algorithms.build_algorithm(
    "ditto", lambda k=0: tiny_model(), SPEC, Config(LR), ditto_personal_steps=1, **FIXED
  )
  state = built.process.initialize()
  _, metrics, _ = built.process.next(
    state, composition.client_inputs([three_batches], states=[built.client_states.initial_value()])
  )
  assert metrics["client_work"]["num_examples"] == 3  # The global model's three steps.
  assert metrics["client_work"]["personal_train_accuracy"] in (0.0, 1.0)  # One example.


@pytest.mark.parametrize("n, held", [(1, 0), (2, 1), (10, 1), (25, 3), (301, 31)])
def test_a_client_holds_out_the_authors_share_of_its_examples_seeded(n, held):
  # The authors' client.py trains on the first int(0.9 n) examples and validates on the rest.
  train, validation = ditto.validation_split(n, 0.1, seed=7, client=3)
  assert len(validation) == held
  assert sorted(np.concatenate([train, validation]).tolist()) == list(range(n))
  np.testing.assert_array_equal(ditto.validation_split(n, 0.1, seed=7, client=3)[1], validation)


def test_the_authors_code_holds_out_a_clients_last_examples():
  train, validation = ditto.validation_split(25, 0.1, seed=7, client=3, which="last")
  np.testing.assert_array_equal(validation, [22, 23, 24])
  np.testing.assert_array_equal(train, np.arange(22))


def test_each_client_holds_out_its_own_random_examples():
  first = ditto.validation_split(301, 0.1, seed=7, client=3)[1]
  assert not np.array_equal(ditto.validation_split(301, 0.1, seed=7, client=4)[1], first)
  assert not np.array_equal(ditto.validation_split(301, 0.1, seed=8, client=3)[1], first)
  assert not np.array_equal(first, np.arange(270, 301))  # Not the authors' last 10%.


def _cross_entropy(kernel, bias, x, y):
  logits = x @ kernel + bias
  logits = logits - logits.max(-1, keepdims=True)
  return np.mean(np.log(np.exp(logits).sum(-1)) - logits[np.arange(len(y)), y])


@pytest.mark.parametrize("metric", ["loss", "accuracy"])
def test_the_validation_score_is_the_mean_cross_entropy_or_the_accuracy_negated(metric):
  x, y = np.float32([[1, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]]), np.int32([0, 2, 2])
  model, weights = tiny_model(), ModelWeights.from_model(tiny_model(seed=3))
  score = ditto.validation_score(model, weights, x.reshape(-1, 2, 2, 1), y, metric)
  kernel, bias = _numpy(weights)
  logits = x @ kernel + bias
  want = (
    _cross_entropy(kernel, bias, x, y) if metric == "loss" else -np.mean(logits.argmax(-1) == y)
  )
  np.testing.assert_allclose(float(score), want, rtol=1e-5)


# A client of 7 examples; with --ditto_validation_fraction=0.5 it validates on 4.
_X = np.random.default_rng(16).random((7, 4))
_Y = np.int32([0, 1, 2, 2, 1, 0, 1])


@pytest.mark.parametrize("min_validation, fallback", [(4, 1.0), (5, 1.0), (5, 0.5)])
def test_a_client_keeps_the_lambda_of_the_lowest_validation_loss_by_hand(min_validation, fallback):
  """One SGD step per candidate from a personal model v of its own towards w^0, each scored
  by its mean cross-entropy on the client's held-out examples (by NumPy); with fewer than
  --ditto_min_validation of them the client keeps --ditto_lambda's step (1, or 0.5, which
  it trains besides the candidates)."""
  built = algorithms.build_algorithm(
    "ditto",
    lambda k=0: tiny_model(),
    SPEC,
    Config(LR),
    ditto_validation_fraction=0.5,
    ditto_min_validation=min_validation,
    ditto_lambda=fallback,
  )
  images = _X.astype(np.float32).reshape(-1, 2, 2, 1)
  dataset = built.client_data(0, images, _Y, one_batch)
  train, held = ditto.validation_split(7, 0.5, seed=0, client=0)
  state = built.process.initialize()
  personal = ModelWeights.from_model(tiny_model(seed=5))
  stored = np.concatenate([stateful_client_work.flatten(personal).numpy(), [0.1, 1.0]])
  _, metrics, (got,) = built.process.next(
    state, composition.client_inputs([dataset], states=[np.float32(stored)])
  )
  assert metrics["client_work"]["num_examples"] == len(train) == 3  # The global model's too.
  (v_kernel, v_bias), (w_kernel, w_bias) = _numpy(personal), _numpy(state["model"])
  g_kernel, g_bias = _mean_cross_entropy_gradient(v_kernel, v_bias, _X[train], _Y[train])
  steps, losses = {}, {}
  for lam in (0.1, 1.0, 2.0, fallback):
    kernel = v_kernel - LR * (g_kernel + lam * (v_kernel - w_kernel))
    bias = v_bias - LR * (g_bias + lam * (v_bias - w_bias))
    steps[lam] = np.concatenate([kernel.ravel(), bias])
    losses[lam] = _cross_entropy(kernel, bias, _X[held], _Y[held])
  best = min((0.1, 1.0, 2.0), key=losses.get)
  # The data make the choice matter: distinct losses, won by another lambda than 1.
  assert best != 1.0 and np.min(np.diff(sorted(losses.values()))) > 1e-3
  want = best if min_validation <= len(held) else fallback
  assert got[-2:].tolist() == [np.float32(want), 1.0]
  np.testing.assert_allclose(got[:-2], steps[want], rtol=1e-5, atol=1e-6)


def test_the_candidates_train_on_the_same_batches_the_pass_after_the_global_one():
  """Eight examples, two epochs of batch 2, reshuffled each pass: every candidate must read
  the second pass (the global model the first), so that they differ by lambda alone."""
  rng = np.random.default_rng(4)
  x, y = rng.random((8, 2, 2, 1), dtype=np.float32), rng.integers(0, 3, 8).astype(np.int32)
  batches = functools.partial(simulation.client_dataset, epochs=2, batch_size=2, seed=3)
  built = algorithms.build_algorithm(
    "ditto", lambda k=0: tiny_model(), SPEC, Config(LR), ditto_validation_fraction=0.5
  )
  state = built.process.initialize()
  _, _, (got,) = built.process.next(
    state,
    composition.client_inputs(
      [built.client_data(0, x, y, batches)], states=[built.client_states.initial_value()]
    ),
  )
  train, held = ditto.validation_split(8, 0.5, seed=0, client=0)
  reference = batches(x[train], y[train])
  for _ in reference:  # The first pass, the global model's.
    pass
  second = list(reference)
  same_batches = tf.data.Dataset.from_tensor_slices(second[0]).batch(2)
  for b in second[1:]:
    same_batches = same_batches.concatenate(tf.data.Dataset.from_tensor_slices(b).batch(2))
  scores = {}
  for lam in (0.1, 1.0, 2.0):
    config = Config(learning_rate=LR, proximal_mu=lam)
    # Before its first round a personal model starts from the round's global model.
    weights, _ = ditto.train_personal(
      tiny_model(),
      client_work.local_optimizer(config),
      state["model"],
      state["model"],
      same_batches,
      LR,
      config,
    )
    scores[lam] = (
      float(ditto.validation_score(tiny_model(), weights, x[held], y[held], "loss")),
      weights,
    )
  lam = min(scores, key=lambda k: scores[k][0])
  assert got[-2] == np.float32(lam)
  np.testing.assert_allclose(
    got[:-2], stateful_client_work.flatten(scores[lam][1]), rtol=1e-5, atol=1e-6
  )


@pytest.mark.parametrize("start", ["w0", "first_round"])
def test_a_personal_model_starts_from_w0_or_its_first_rounds_global_model(start):
  """Client 0 moves the global model to w^1 in round 1; in round 2 client 1's personal model
  starts from w^0 or w^1 as set, and client 0's from what it kept."""
  built = algorithms.build_algorithm(
    "ditto",
    lambda k=0: tiny_model(),
    SPEC,
    Config(LR),
    ditto_lambda=LAMBDA,
    ditto_lambda_choice="fixed",
    ditto_personal_start=start,
  )
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA[:2]]
  initial = built.client_states.initial_value()
  state = built.process.initialize()
  w0 = state["model"]
  state, _, (kept,) = built.process.next(
    state, composition.client_inputs(datasets[:1], states=[initial])
  )
  w1 = state["model"]
  assert not np.allclose(stateful_client_work.flatten(w1), stateful_client_work.flatten(w0))
  _, _, got = built.process.next(state, composition.client_inputs(datasets, states=[kept, initial]))
  config = Config(learning_rate=LR, proximal_mu=LAMBDA)
  starts = [
    stateful_client_work.unflatten_numpy(kept, w0),
    w0 if start == "w0" else w1,
  ]
  for dataset, begin, new in zip(datasets, starts, got):
    want, _ = ditto.train_personal(
      tiny_model(), client_work.local_optimizer(config), begin, w1, dataset, LR, config
    )
    weights = new[:-2] if start == "first_round" else new
    np.testing.assert_allclose(weights, stateful_client_work.flatten(want), rtol=1e-5, atol=1e-6)
  if start == "first_round":  # Its lambda and that it has trained.
    assert [s[-2:].tolist() for s in got] == [[np.float32(LAMBDA), 1.0]] * 2


@pytest.mark.parametrize(
  "change, message",
  [
    ({"ditto_lambda_candidates": ""}, "--ditto_lambda_candidates=: list positive numbers"),
    ({"ditto_lambda_candidates": "0,1"}, "--ditto_lambda_candidates=0,1: list positive"),
    ({"ditto_lambda_candidates": "a,1"}, "--ditto_lambda_candidates=a,1: list positive"),
    ({"ditto_lambda_candidates": "1,nan"}, "--ditto_lambda_candidates=1,nan: list positive"),
    ({"ditto_lambda_candidates": "1,1.0"}, "--ditto_lambda_candidates=1,1.0: list each lambda"),
    ({"ditto_lambda_choice": "auto"}, "unknown --ditto_lambda_choice=auto"),
    ({"ditto_min_validation": 0}, "--ditto_min_validation must be a positive integer, got 0"),
    ({"ditto_validation_fraction": 1.0}, "--ditto_validation_fraction must be in \\(0, 1\\)"),
    (
      {"ditto_lambda_choice": "fixed", "ditto_lambda_candidates": "1,2"},
      "--ditto_lambda_candidates=1,2: read only with --ditto_lambda_choice=per_device",
    ),
  ],
)
def test_bad_ditto_flags_are_one_line_errors(change, message):
  config = dataclasses.replace(QUICK, algorithm="ditto", **change)
  with pytest.raises(experiment.UsageError, match=message) as error:
    config.validate()
  assert "\n" not in str(error.value)


def test_a_ditto_run_saved_before_per_device_lambdas_resumes_with_one_lambda_from_w0():
  old = dataclasses.asdict(experiment.ExperimentConfig(algorithm="ditto"))
  del old["ditto_lambda_choice"], old["ditto_personal_start"]
  saved = experiment.saved_config(old)
  assert (saved["ditto_lambda_choice"], saved["ditto_personal_start"]) == ("fixed", "w0")
  options = settings.resolve(ditto.Settings, experiment.ExperimentConfig(**saved))
  assert not options.keeps_lambda  # The states are the personal models alone, as then.


@pytest.mark.slow
def test_a_run_evaluates_each_writer_with_its_own_model_and_resumes(tmp_path):
  config = dataclasses.replace(
    QUICK, algorithm="ditto", rounds=2, checkpoint_every=1, output_dir=str(tmp_path / "run")
  )
  summary = training.run_experiment(config)
  stored = os.listdir(tmp_path / "run" / client_states.DIRECTORY)
  sampled = {name.split("_")[0] for name in stored if name.startswith("client")}
  assert summary["clients_with_own_model"] == len(sampled) <= 8
  assert summary["clients_with_own_model"] + summary["clients_without_own_model"] == 105
  # Each client that trained holds the lambda its validation examples chose.
  assert set(summary["ditto_lambda_clients"]) <= {"0.1", "1", "2"}
  assert sum(summary["ditto_lambda_clients"].values()) == len(sampled)
  # Each writer's personal accuracy is in its own file, that of its saved model (the global
  # one for a writer that never trained), predicted here; the summary has their mean.
  with open(tmp_path / "run" / run_files.PERSONALIZED_PER_CLIENT_ACCURACY_FILE) as f:
    per_writer = json.load(f)
  test = tasks.femnist.load_data(QUICK.data_dir).test
  assert sorted(per_writer) == sorted(c for c in test.client_ids if len(test.y[c]))
  (global_model,) = numpy_references.saved_models(tmp_path / "run")
  own = tmp_path / "run" / run_files.CLIENTS_DIR
  assert len(os.listdir(own)) == summary["clients_with_own_model"]
  for writer, accuracy in per_writer.items():
    path = own / f"{writer}.keras"
    model = tf.keras.models.load_model(path, compile=False) if path.exists() else global_model
    expected = numpy_references.accuracy(
      numpy_references.member_probabilities([model], test.x[writer])[0], test.y[writer]
    )
    assert accuracy == pytest.approx(expected, abs=1e-9), writer
  assert np.mean(list(per_writer.values())) == pytest.approx(summary["personalized_accuracy"])
  assert "personalized_per_client_accuracy" not in summary
  # Resumed from round 1, the run ends where the uninterrupted one did.
  os.remove(tmp_path / "run" / run_files.SUMMARY_FILE)
  checkpoints = tmp_path / "run" / run_files.CHECKPOINT_DIR
  shutil.rmtree(checkpoints / f"{run_files.CHECKPOINT_PREFIX}2")
  again = training.run_experiment(dataclasses.replace(config, resume=True))
  assert again["personalized_accuracy"] == summary["personalized_accuracy"]
  assert again["test_accuracy"] == summary["test_accuracy"]
  with open(tmp_path / "run" / run_files.SUMMARY_FILE) as f:
    resumed = json.load(f)
  assert resumed["clients_with_own_model"] == summary["clients_with_own_model"]
  assert resumed["ditto_lambda_clients"] == summary["ditto_lambda_clients"]
  # A writer's personal model exports for its phone, and runs there as in Keras.
  writers = sorted(os.listdir(tmp_path / "run" / run_files.CLIENTS_DIR))
  assert len(writers) == summary["clients_with_own_model"]
  writer = writers[0][: -len(".keras")]
  run = runs.load_run(str(tmp_path / "run"), client=writer)
  (personal,) = run.load_models()
  exported = on_device.load_bytes(convert.export_run(run, "float"))
  x = tasks.femnist.load_data(QUICK.data_dir).test.x[writer][:4]
  np.testing.assert_allclose(exported.logits(x), personal(x, training=False), atol=1e-4)
  with pytest.raises(ExportError, match="--client=nobody: .* keeps no model of its own"):
    runs.load_run(str(tmp_path / "run"), client="nobody")
