"""Runs on several TFF worker services: `--workers`, `python -m tff_ens.worker`.

Real workers on 127.0.0.1 and real computations: a round split over two
workers equals the local round; a worker killed mid-run ends the run with a
one-line error and a checkpoint that `--resume` continues on the local
context; the worker CLI serves and stops on SIGINT/SIGTERM without leaving
its `worker_binary` behind.
"""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import portpicker
import psutil
import pytest
import tensorflow as tf

from tests import worker_processes
from tests.femnist_runs import QUICK
from tests.femnist_runs import ROOT
from tests.femnist_runs import read_metrics
from tff_ens import algorithms
from tff_ens import main as cli
from tff_ens import run_files
from tff_ens.execution import runtime
from tff_ens.execution import worker_process
from tff_ens.program import experiment
from tff_ens.program import training
from tff_ens.templates import client_work
from tiny import SERVER
from tiny import SPEC
from tiny import one_batch
from tiny import tiny_model

# The fixtures every test here uses (pytest finds them by name).
no_stray_workers = worker_processes.no_stray_workers
credentials = worker_processes.credentials
tls_workers = worker_processes.tls_workers


# Four tiny clients of different sizes; two workers get two each.
CLIENT_DATA = [
  ([[1.0, 0.0, -1.0, 2.0], [0.5, -0.5, 1.0, 0.0]], [0, 2]),
  ([[-1.0, 2.0, 0.0, 1.0], [2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 1.0, 3.0]], [1, 1, 0]),
  ([[0.0, 1.0, 1.0, -2.0], [1.0, 1.0, 1.0, 1.0]], [2, 0]),
  ([[3.0, -1.0, 0.5, 0.0]], [1]),
]


def _cpu_seconds(service) -> float:
  times = psutil.Process(service.worker.pid).cpu_times()
  return times.user + times.system


@pytest.mark.parametrize("name", ["fedavg", "fedensemble", "fedbe"])
def test_two_tls_workers_round_equals_local_round(name, tls_workers, credentials):
  # FedBE: the clients train on the workers, the server step runs here.
  addresses, services = tls_workers
  algorithm = algorithms.build_algorithm(
    name,
    lambda k=0: tiny_model(seed=10 * k, batch_norm=True),
    SPEC,
    client_work.LocalTrainingConfig(learning_rate=0.5),
    seed=1,
    server_data=SERVER if name == "fedbe" else None,
    clients_per_round=4,
    **(
      dict(distill_steps=25, distill_batch_size=8, distill_curve_every=0, fedbe_samples=2)
      if name == "fedbe"
      else dict(ensemble_size=2)
      if name == "fedensemble"
      else {}
    ),
  )  # Fed-ensemble: clients 5, 2 train member 0; 1, 7 member 1.
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  clients = np.array([5, 1, 7, 2])
  with runtime.execution_context():
    state = algorithm.process.initialize()
    local_state, local_round = algorithm.next_fn(state, datasets, clients)
    local_models = algorithm.models_fn(local_state)
    initial_models = algorithm.models_fn(state)
  cpu_before = [_cpu_seconds(s) for s in services]
  with runtime.execution_context(workers=addresses, credentials_dir=credentials):
    split_state, split_round = algorithm.next_fn(state, datasets, clients)
    split_models = algorithm.models_fn(split_state)
  local_metrics, split_metrics = local_round.metrics, split_round.metrics
  # Both workers computed (the clients were split, not sent to one).
  assert all(_cpu_seconds(s) > b for s, b in zip(services, cpu_before))
  tf.nest.map_structure(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-5), local_models, split_models
  )
  # The round changed every model, so the comparison is not vacuous.
  flat = lambda weights: np.concatenate([np.ravel(t) for t in weights])
  for before, after in zip(initial_models, local_models):
    assert not np.allclose(flat(before.trainable), flat(after.trainable))
  assert (
    split_metrics["client_work"]["num_examples"]
    == local_metrics["client_work"]["num_examples"]
    == 8
  )
  np.testing.assert_allclose(
    split_metrics["client_work"]["train_loss"],
    local_metrics["client_work"]["train_loss"],
    rtol=1e-5,
  )


def _checkpoints(output_dir) -> list[str]:
  try:
    return os.listdir(os.path.join(output_dir, run_files.CHECKPOINT_DIR))
  except FileNotFoundError:
    return []


@pytest.mark.slow
def test_killed_worker_ends_the_run_with_one_line_and_resume_finishes(
  tls_workers, credentials, tmp_path
):
  addresses, services = tls_workers
  config = dataclasses.replace(
    QUICK,
    rounds=3,
    checkpoint_every=1,
    eval_every=3,
    output_dir=str(tmp_path),
    workers=",".join(addresses),
    worker_credentials=credentials,
  )
  killed_at = []

  def kill_after_first_checkpoint():
    deadline = time.monotonic() + 240
    while not _checkpoints(tmp_path) and time.monotonic() < deadline:
      time.sleep(0.05)
    psutil.Process(services[1].worker.pid).kill()
    killed_at.append(time.monotonic())

  killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
  killer.start()
  with pytest.raises(worker_process.WorkerError) as error:
    training.run_experiment(config)
  failed_at = time.monotonic()
  killer.join()
  # Bounded (the runtime waits 10 s for a reconnection), not a hang.
  assert failed_at - killed_at[0] < 60, failed_at - killed_at[0]
  message = str(error.value)
  assert "\n" not in message
  assert addresses[1] in message
  last = max(int(c.split("_")[1]) for c in _checkpoints(tmp_path))
  assert f"last checkpoint is round {last}: rerun with --resume" in message
  assert 1 <= last < 3
  seconds = [r["seconds"] for r in read_metrics(tmp_path)[:last]]
  assert not (tmp_path / run_files.SUMMARY_FILE).exists()

  # The run continues on this machine, on a local worker.
  summary = training.run_experiment(
    dataclasses.replace(config, workers="", worker_credentials="", resume=True)
  )
  rows = read_metrics(tmp_path)
  assert [int(r["round"]) for r in rows] == [1, 2, 3]
  # Rounds up to the checkpoint were kept, not trained again.
  assert [r["seconds"] for r in rows[:last]] == seconds
  assert summary["rounds"] == 3
  assert (tmp_path / run_files.SUMMARY_FILE).exists()


@pytest.mark.parametrize(
  "workers, message",
  [
    ("localhost", "'localhost' is not host:port"),
    ("10.0.0.2:8000,:8001", "':8001' is not host:port"),
    ("10.0.0.2:99999", "'10.0.0.2:99999' is not host:port"),
    ("10.0.0.2:8000,10.0.0.2:8000", "10.0.0.2:8000 is named twice"),
  ],
)
def test_bad_workers_flag_is_refused(workers, message):
  config = dataclasses.replace(QUICK, workers=workers)
  with pytest.raises(experiment.UsageError, match=message) as error:
    config.validate()
  assert str(error.value).startswith(f"--workers={workers}: ")


def test_cli_flag_is_the_config_field():
  # `main` builds the config from the flag of each field's name.
  assert cli.FLAGS["workers"].default == experiment.ExperimentConfig.workers


def test_concurrency_limit_with_workers_is_refused():
  config = dataclasses.replace(QUICK, workers="10.0.0.2:8000", max_concurrent_clients=2)
  with pytest.raises(experiment.UsageError, match="tff_ens.worker --max_concurrent_clients"):
    config.validate()


@pytest.mark.slow
def test_unreachable_worker_is_a_usage_error_naming_the_flag(tmp_path):
  address = f"127.0.0.1:{portpicker.pick_unused_port()}"
  config = dataclasses.replace(QUICK, workers=address, output_dir=str(tmp_path / "out"))
  with pytest.raises(experiment.UsageError) as error:
    training.run_experiment(config)
  message = str(error.value)
  assert message.startswith(f"--workers={address}: TFF worker at {address} is unreachable")
  assert "python -m tff_ens.worker --port=" in message
  assert "\n" not in message
  assert not (tmp_path / "out").exists()  # Nothing written.


@pytest.fixture(scope="module")
def worker_clis(credentials):
  """`python -m tff_ens.worker` with credentials on a free port and on a port a plain socket
  holds, and without credentials, started at once so that their imports overlap.

  Yields {"free", "busy" or "bare": (process, port)}; the processes are killed and reaped
  at the end.
  """
  with socket.socket() as busy:
    busy.bind(("", 0))
    busy.listen()
    ports = {
      "free": portpicker.pick_unused_port(),
      "busy": busy.getsockname()[1],
      "bare": portpicker.pick_unused_port(),
    }
    started = {}
    try:
      for name, port in ports.items():
        door = [] if name == "bare" else [f"--credentials={credentials}"]
        started[name] = (
          subprocess.Popen(
            [sys.executable, "-m", "tff_ens.worker", f"--port={port}", *door],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
          ),
          port,
        )
      yield started
    finally:
      for process, _ in started.values():
        process.kill()
        process.communicate()


@pytest.mark.slow
def test_worker_cli_serves_and_stops_on_sigterm(worker_clis, credentials):
  # (SIGINT takes the same path: both raise KeyboardInterrupt.)
  cli, port = worker_clis["free"]
  line = cli.stdout.readline()
  assert f"serving on port {port} of all interfaces, mutual TLS" in line, cli.stderr.read()[-2000:]
  assert f"--workers=THIS_HOST:{port} --worker_credentials=" in line
  (worker,) = [
    c for c in psutil.Process(cli.pid).children(recursive=True) if worker_processes.is_worker(c)
  ]
  worker_processes.SEEN_PIDS.add(worker.pid)
  with runtime.execution_context(workers=[f"127.0.0.1:{port}"], credentials_dir=credentials):
    assert worker_processes.sum_of_doubles([1, 2, 3]) == 12
  cli.send_signal(signal.SIGTERM)
  assert cli.wait(timeout=30) == 0
  assert worker_processes.is_gone(worker.pid)


# Sets up worker_clis: three `python -m tff_ens.worker` importing TensorFlow at once, 140 s on
# a loaded machine (tests/watchdog.py).
@pytest.mark.timeout_seconds(600)
@pytest.mark.parametrize(
  "name, error",
  [
    ("busy", "error: port {port} is in use: choose another --port"),
    (
      "bare",
      "error: a worker service serves only drivers it can verify: pass --credentials=DIR "
      "(made by `python -m tff_ens.credentials --dir=DIR --hosts=WORKER_HOST,...`), or "
      "--insecure_loopback for plaintext on 127.0.0.1 only",
    ),
  ],
)
def test_worker_cli_refuses_to_start_with_one_line(worker_clis, name, error):
  cli, port = worker_clis[name]
  _, stderr = cli.communicate(timeout=180)
  assert cli.returncode == 2
  assert stderr.strip().splitlines()[-1] == error.format(port=port)
