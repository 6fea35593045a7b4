"""Tests of `tff_ens.algorithms.ditto` (Li et al., ICML 2021, Algorithm 1): the personal step
by hand, a round against FedAvg's and the personal models kept as the clients' states, and a
run's personal models on its writers."""

import dataclasses
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
from tests.femnist_runs import QUICK
from tff_ens import algorithms
from tff_ens import run_files
from tff_ens.algorithms import ditto
from tff_ens.program import client_states
from tff_ens.program import simulation
from tff_ens.program import training
from tff_ens.templates import client_work
from tff_ens.templates import stateful_client_work
from tiny import CLIENT_DATA
from tiny import SPEC
from tiny import one_batch
from tiny import tiny_model

ModelWeights = tff.learning.models.ModelWeights
Config = client_work.LocalTrainingConfig
LR, LAMBDA = 0.5, 0.3


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
    "ditto", lambda k=0: tiny_model(), SPEC, Config(learning_rate=LR), ditto_lambda=LAMBDA
  )
  fedavg = algorithms.build_algorithm("fedavg", lambda k=0: tiny_model(), SPEC, Config(LR))
  # Each client's state starts as the initial global model (the authors' code).
  initial = built.client_states.initial_value()
  state = built.process.initialize()
  np.testing.assert_allclose(
    initial, stateful_client_work.flatten(state["model"]).numpy(), rtol=0, atol=0
  )
  personal = [initial + 0.1 * c for c in range(3)]  # Three different personal models.
  new_state, _, new_personal = built.process.next(state, datasets, personal)
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
    "ditto", lambda k=0: tiny_model(), SPEC, Config(learning_rate=LR), ditto_lambda=LAMBDA
  )
  fedavg = algorithms.build_algorithm("fedavg", lambda k=0: tiny_model(), SPEC, Config(LR))
  state = built.process.initialize()
  personal = [built.client_states.initial_value()] * len(data)
  new_state, _, new_personal = built.process.next(state, datasets, personal)
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
    "ditto", lambda k=0: tiny_model(), SPEC, Config(LR), ditto_personal_steps=1
  )
  state = built.process.initialize()
  _, metrics, _ = built.process.next(state, [three_batches], [built.client_states.initial_value()])
  assert metrics["client_work"]["num_examples"] == 3  # The global model's three steps.
  assert metrics["client_work"]["personal_train_accuracy"] in (0.0, 1.0)  # One example.


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
  assert 0 <= summary["personalized_accuracy"] <= 1
  # Each writer's personal accuracy is in its own file; the summary has their mean.
  with open(tmp_path / "run" / run_files.PERSONALIZED_PER_CLIENT_ACCURACY_FILE) as f:
    per_writer = json.load(f)
  assert 0 < len(per_writer) <= 105
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
    assert json.load(f)["clients_with_own_model"] == summary["clients_with_own_model"]
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
