"""Clients that train on devices (`--client_runtime=litert`): the client-work stage
on device results, one client's update against TFF's own client in the same data order, the
device processes (a killed one is a dropout), the CLI run and its bad inputs."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from export import device_training
from export import trainable
from tests.exported_runs import DATA_DIR
from tests.exported_runs import REPO_ROOT
from tests.exported_runs import small_femnist_model
from tests.femnist_runs import read_metrics
from tests.femnist_runs import without_timings
from tff_ens import algorithms
from tff_ens import run_files
from tff_ens.algorithms import fedavg
from tff_ens.execution import runtime
from tff_ens.math import member_updates
from tff_ens.program import browser_clients
from tff_ens.program import device_clients
from tff_ens.program import experiment
from tff_ens.program import simulation
from tff_ens.templates import client_work
from tff_ens.templates import device_client_work

ModelWeights = tff.learning.models.ModelWeights
needs_device_env = pytest.mark.skipif(
  not os.path.exists(device_clients.DEVICE_PYTHON),
  reason="the device environment is not installed: uv sync --locked --project device",
)
CONFIG = client_work.LocalTrainingConfig(learning_rate=0.1)
SPEC = (tf.TensorSpec([None, 28, 28, 1], tf.float32), tf.TensorSpec([None], tf.int32))


def femnist_like(n: int, seed: int):
  """White-background images with dark strokes and labels 0..61."""
  rng = np.random.default_rng(seed)
  x = np.where(rng.random((n, 28, 28, 1)) < 0.15, rng.random((n, 28, 28, 1)), 1.0)
  return x.astype(np.float32), rng.integers(0, 62, n).astype(np.int32)


def test_device_result_becomes_fedavgs_update():
  weights_type = client_work.weights_type_of(lambda: small_femnist_model(0))
  stage = device_client_work.build_device_client_work(weights_type, CONFIG)
  initial = ModelWeights.from_model(small_femnist_model(0))
  trained = [w.numpy() + 0.5 for w in initial.trainable]
  with runtime.execution_context():
    result, sums = stage.client_update(
      initial, device_clients.result_dataset(trained, 30.0, 4.0, 12.0), np.float32(0.1)
    )
    broken, broken_sums = stage.client_update(
      initial,
      device_clients.result_dataset([np.full_like(w, np.nan) for w in trained], 9.0, 1.0, 12.0),
      np.float32(0.1),
    )
  for update in result.update.trainable:
    np.testing.assert_allclose(update, -0.5, atol=1e-6)  # initial - trained
  assert result.update_weight == 12.0
  assert dict(sums) == {"loss": 30.0, "correct": 4.0, "num_examples": 12.0, "rejected": 0.0}
  # A NaN device result is rejected as a NaN TFF client is (`reject_bad_update`).
  assert broken.update_weight == 0.0
  assert all(np.all(u == 0) for u in broken.update.trainable)
  assert dict(broken_sums) == {"loss": 0.0, "correct": 0.0, "num_examples": 0.0, "rejected": 1.0}


@pytest.mark.parametrize("work", [1.0, 0.5])
def test_one_clients_update_matches_tff_client_in_the_same_order(work):
  x, y = femnist_like(7, seed=1)
  initial = ModelWeights.from_model(small_femnist_model(3))
  tff_client = client_work.build_client_work(lambda: small_femnist_model(0), SPEC, CONFIG)
  # Two shuffled epochs in batches of 3 (a straggler with work 0.5: 3 of the 5 batches).
  order = simulation.client_order(7, epochs=2, batch_size=3, seed=5, work=work)
  dataset = simulation.client_dataset(x, y, epochs=2, batch_size=3, seed=5, work=work)
  np.testing.assert_array_equal(np.concatenate([b for _, b in dataset]), y[order])
  with runtime.execution_context():
    tff_result, tff_sums = tff_client.client_update(initial, dataset, np.float32(0.1))
  trainer = device_training.DeviceTrainer(
    trainable.convert_trainable(small_femnist_model(0), learning_rate=0.1)
  )
  trainer.set_weights([w.numpy() for w in initial.trainable])
  local = trainer.train_epochs(x, y, batch_size=3, order=order)
  for tff_update, device_weights, w0 in zip(
    tff_result.update.trainable, local.weights, initial.trainable
  ):
    np.testing.assert_allclose(w0.numpy() - device_weights, tff_update, atol=2e-6)
  assert local.num_examples == tff_sums["num_examples"] == (14 if work == 1 else 9)
  np.testing.assert_allclose(local.mean_loss * local.num_examples, tff_sums["loss"], rtol=1e-5)
  assert local.accuracy * local.num_examples == tff_sums["correct"]


def test_fedavg_on_device_aggregates_the_device_results():
  model_fn = lambda: small_femnist_model(0)
  process = fedavg.build_fedavg(model_fn, SPEC, CONFIG, on_device=True).process
  with runtime.execution_context():
    state = process.initialize()
    start = process.get_model_weights(state)
    results = [
      device_clients.result_dataset([w + shift for w in start.trainable], 1.0, 1.0, n)
      for shift, n in ((1.0, 1.0), (4.0, 3.0))
    ]
    output = process.next(state, results)
    new = process.get_model_weights(output.state)
  # The example-weighted mean of the trained models: w + (1 * 1 + 4 * 3) / 4.
  for before, after in zip(start.trainable, new.trainable):
    np.testing.assert_allclose(after, before + 13 / 4, atol=1e-5)


def test_fed_ensemble_on_device_averages_each_members_device_results():
  algorithm = algorithms.build_algorithm(
    "fedensemble", small_femnist_model, SPEC, CONFIG, ensemble_size=3, seed=7, on_device=True
  )
  clients = [0, 1, 2, 3, 4]
  with runtime.execution_context():
    state = algorithm.process.initialize()
  assigned = algorithm.assigned_models(clients, state["distributor"])
  assert assigned == [
    int(member_updates.assigned_model(7, c, 0, 3, "permutation")) for c in clients
  ]
  with runtime.execution_context():
    members = algorithm.models_fn(state)
    # Client c's device returns its assigned member's weights plus c.
    results = [
      device_clients.result_dataset([w + c for w in members[k].trainable], 1.0, 1.0, 2.0)
      for c, k in zip(clients, assigned)
    ]
    new_members = algorithm.models_fn(
      algorithm.process.next(state, *algorithm.next_args(results, clients))[0]
    )
  for k in range(3):
    shifts = [c for c, m in zip(clients, assigned) if m == k]
    expected_shift = np.mean(shifts) if shifts else 0.0
    for before, after in zip(members[k].trainable, new_members[k].trainable):
      np.testing.assert_allclose(after, np.asarray(before) + expected_shift, atol=1e-5)


@needs_device_env
def test_a_killed_device_is_a_dropout_and_is_replaced(tmp_path, caplog):
  path = tmp_path / "trainable.tflite"
  path.write_bytes(trainable.convert_trainable(small_femnist_model(0), learning_rate=0.1))
  weights = [w.numpy() for w in small_femnist_model(0).trainable_variables]
  x, y = femnist_like(5, seed=2)
  order = simulation.client_order(5, epochs=1, batch_size=2, seed=0)
  request = {"x": x, "y": y, "order": order, "batch_size": 2, "model": 0}
  pool = device_clients.DevicePool(str(path), 1)
  try:
    first = pool.train([weights], [request], ["writer_a"])[0]
    pool._idle.queue[0].process.kill()  # The phone dies before the next round.
    with caplog.at_level("WARNING"):
      dropped = pool.train([weights], [request], ["writer_b"])
    again = pool.train([weights], [request], ["writer_c"])[0]
  finally:
    pool.close()
  assert dropped == [None]
  assert "device client writer_b failed" in caplog.text and "dropped" in caplog.text
  assert first[1:] == again[1:] and first[3] == 5
  for a, b in zip(first[0], again[0]):
    np.testing.assert_array_equal(a, b)


def test_device_pool_without_the_device_environment_is_one_line(tmp_path):
  with pytest.raises(
    device_clients.DeviceError, match=r"install it with `uv sync --locked --project device`$"
  ):
    device_clients.DevicePool(str(tmp_path / "t.tflite"), 1, python=str(tmp_path / "no_python"))


@pytest.mark.parametrize(
  "flags, message",
  [
    (
      {"algorithm": "fedbe"},
      "--client_runtime=litert: fedbe's clients cannot train on devices: use one of fedavg, "
      "fedavgm, fedadam, fedensemble",
    ),
    (
      {"algorithm": "fedensemble", "local_objective": "feddyn"},
      "--local_objective=feddyn is not supported there",
    ),
    ({"client_optimizer": "adam"}, "--client_optimizer=adam is not supported there"),
    ({"lr_schedule": "step"}, "--lr_schedule=step is not supported there"),
    ({"task": "cifar10", "data_dir": None}, "augments its training images"),
    ({"device_processes": 0}, "--device_processes must be a positive integer"),
    (
      {"client_runtime": "phone"},
      "unknown --client_runtime=phone: choose one of tff, litert, browser",
    ),
    (
      {"client_runtime": "browser", "algorithm": "fedbe"},
      "--client_runtime=browser: fedbe's clients cannot train on devices",
    ),
    (
      {"client_runtime": "browser", "browser_clients": "phone:80"},
      r"^--browser_clients=phone:80 is neither headless nor HOST:PORT \(an IP address and a "
      r"port\): use e.g. --browser_clients=0.0.0.0:8765 for phones on this network$",
    ),
    (
      {"browser_clients": "127.0.0.1:8765"},
      r"^--browser_clients is for --client_runtime=browser \(drop the flag\)$",
    ),
  ],
)
def test_bad_client_runtime_settings_are_usage_errors(flags, message):
  config = experiment.ExperimentConfig(
    **{"data_dir": DATA_DIR, "client_runtime": "litert", **flags}
  )
  with pytest.raises(experiment.UsageError, match=message):
    config.validate()


def test_browser_clients_without_chromium_or_litert_js_are_one_line(monkeypatch, tmp_path):
  config = experiment.ExperimentConfig(data_dir=DATA_DIR, client_runtime="browser")
  # LiteRT.js's entry file in place (whether or not `npm ci` ran here), Chromium missing.
  installed = tmp_path / "litertjs"
  (installed / "core" / "dist").mkdir(parents=True)
  (installed / "core" / "dist" / "index.js").touch()
  monkeypatch.setattr(browser_clients.server, "LITERT_DIR", str(installed))
  monkeypatch.setattr(browser_clients.drive, "CHROMIUM", str(tmp_path / "chromium"))
  with pytest.raises(
    experiment.UsageError,
    match=r"^--browser_clients=headless needs Chromium \(.*/chromium is missing\): apt-get "
    r"install chromium, or pass --browser_clients=HOST:PORT and open the URL elsewhere$",
  ):
    config.validate()
  # Phones need no Chromium here, but the page needs LiteRT.js.
  assert browser_clients.missing("0.0.0.0:8765") is None
  monkeypatch.setattr(browser_clients.server, "LITERT_DIR", str(tmp_path / "none"))
  assert browser_clients.missing("0.0.0.0:8765") == (
    "--client_runtime=browser needs LiteRT.js: run `npm ci --prefix export/web`"
  )


CLI = [
  sys.executable,
  "-m",
  "tff_ens.main",
  "--task=femnist",
  f"--data_dir={DATA_DIR}",
  "--clients_per_round=3",
  "--rounds=2",
  "--eval_every=1",
  "--checkpoint_every=1",
  "--client_runtime=litert",
]


@pytest.mark.slow
@needs_device_env
def test_cli_litert_run_killed_after_round_1_resumes_to_the_same_model(tmp_path):
  whole = subprocess.run(
    [*CLI, f"--output_dir={tmp_path / 'whole'}"],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert whole.returncode == 0, whole.stderr[-2000:]
  killed = subprocess.Popen(
    [*CLI, f"--output_dir={tmp_path / 'killed'}"],
    cwd=REPO_ROOT,
    start_new_session=True,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  first_checkpoint = tmp_path / "killed" / run_files.CHECKPOINT_DIR / "round_1"
  deadline = time.time() + 600
  while not first_checkpoint.exists() and time.time() < deadline:
    assert killed.poll() is None, "the run ended before it could be killed"
    time.sleep(0.2)
  killed.send_signal(signal.SIGKILL)  # The driver; its device processes see their input end.
  killed.wait()
  resumed = subprocess.run(
    [*CLI, f"--output_dir={tmp_path / 'killed'}", "--resume"],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  # The device processes train each round's clients as before the kill: every number equal.
  whole, again = (read_metrics(tmp_path / run) for run in ("whole", "killed"))
  assert [without_timings(r) for r in again] == [without_timings(r) for r in whole]
  summaries = [
    json.loads((tmp_path / run / "summary.json").read_text()) for run in ("whole", "killed")
  ]
  assert summaries[1]["test_accuracy"] == summaries[0]["test_accuracy"]
  assert summaries[1]["test_loss"] == summaries[0]["test_loss"]
  assert (tmp_path / "whole" / device_clients.TRAINABLE_FILE).exists()
  assert float(whole[0]["clients_used"]) == 3 and float(whole[0]["num_examples"]) > 0


@needs_device_env
def test_a_litert_round_of_the_program_trains_as_tff_clients_do(tmp_path):
  # One round of the program's own loop with its clients in LiteRT processes, against the
  # same round with TFF clients: the same clients and examples, and the model within the
  # kernels' float differences (benchmarks/RESULTS.md: LiteRT against TFF clients).
  from tests.femnist_runs import QUICK
  from tests.femnist_runs import read_metrics
  from tff_ens.program import training

  rows = {}
  for runtime_name in ("tff", "litert"):
    config = dataclasses.replace(
      QUICK,
      rounds=1,
      clients_per_round=2,
      client_runtime=runtime_name,
      output_dir=str(tmp_path / runtime_name),
    )
    summary = training.run_experiment(config)
    rows[runtime_name] = (read_metrics(tmp_path / runtime_name)[0], summary)
  (tff_row, tff_summary), (litert_row, litert_summary) = rows["tff"], rows["litert"]
  assert litert_row["num_examples"] == tff_row["num_examples"]
  assert float(litert_row["train_loss"]) == pytest.approx(float(tff_row["train_loss"]), rel=1e-3)
  assert litert_summary["test_loss"] == pytest.approx(tff_summary["test_loss"], rel=1e-3)
