"""End-to-end runs of the training loop and the CLI on the real FEMNIST slice."""

import dataclasses
import gc
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests import numpy_references
from tests.femnist_runs import DATA_DIR
from tests.femnist_runs import QUICK
from tests.femnist_runs import ROOT
from tests.femnist_runs import client_state_values
from tests.femnist_runs import logits_of
from tests.femnist_runs import read_metrics
from tests.femnist_runs import record_teachers
from tests.femnist_runs import reference_test_metrics
from tests.femnist_runs import stacked_logits
from tff_ens import run_files
from tff_ens import settings
from tff_ens.algorithms import algorithm as algorithm_lib
from tff_ens.program import client_states
from tff_ens.program import experiment
from tff_ens.program import run_outputs
from tff_ens.program import simulation
from tff_ens.program import training
from tff_ens.templates import server_distillation


def run_cli(*args, timeout=600):
  return subprocess.run(
    [sys.executable, "-m", "tff_ens.main", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory):
  config = dataclasses.replace(QUICK, output_dir=str(tmp_path_factory.mktemp("fedavg")))
  return config, training.run_experiment(config)


# Sets up fedavg_run, a run of QUICK: 104 s on a loaded machine (tests/watchdog.py).
@pytest.mark.timeout_seconds(600)
def test_fedavg_learns_and_writes_outputs(fedavg_run):
  config, summary = fedavg_run
  rows = read_metrics(config.output_dir)
  assert [int(r["round"]) for r in rows] == [1, 2, 3, 4]
  assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
  assert rows[1]["test_accuracy"] and not rows[0]["test_accuracy"]
  assert summary["test_accuracy"] > 3 / 62  # well above chance
  for key in (
    "task",
    "algorithm",
    "rounds",
    "seed",
    "test_accuracy",
    "test_loss",
    "ece",
    "per_client_accuracy",
    "new_client_accuracy",
    "bytes_down_per_client_round",
    "bytes_up_per_client_round",
    "seconds_per_round",
    "config",
  ):
    assert key in summary, key
  with open(os.path.join(config.output_dir, run_files.SUMMARY_FILE)) as f:
    assert json.load(f)["test_accuracy"] == summary["test_accuracy"]
  assert os.path.exists(os.path.join(config.output_dir, "model.keras"))
  assert os.listdir(os.path.join(config.output_dir, "tensorboard"))
  # The two latest checkpoints are kept.
  assert sorted(os.listdir(os.path.join(config.output_dir, run_files.CHECKPOINT_DIR))) == [
    "round_2",
    "round_4",
  ]


def test_bytes_per_round_are_the_model_size(fedavg_run):
  _, summary = fedavg_run
  cnn_parameters = 6_603_710
  # Down: the model and the round's learning rate. Up: the update, its
  # weight and four metric sums.
  assert summary["bytes_down_per_client_round"] == 4 * cnn_parameters + 4
  assert summary["bytes_up_per_client_round"] == 4 * cnn_parameters + 4 * 5


@pytest.mark.slow
def test_same_seed_same_numbers(fedavg_run, tmp_path):
  config, summary = fedavg_run
  again = training.run_experiment(dataclasses.replace(config, output_dir=str(tmp_path / "again")))
  assert again["test_accuracy"] == pytest.approx(summary["test_accuracy"], abs=1e-3)
  first = [float(r["train_loss"]) for r in read_metrics(config.output_dir)]
  second = [float(r["train_loss"]) for r in read_metrics(tmp_path / "again")]
  np.testing.assert_allclose(first, second, rtol=1e-4)


def test_sampling_is_a_function_of_seed_and_round():
  a = simulation.sample_clients(105, 10, seed=1, round_num=7)
  assert len(set(a)) == 10
  np.testing.assert_array_equal(a, simulation.sample_clients(105, 10, seed=1, round_num=7))
  assert not np.array_equal(a, simulation.sample_clients(105, 10, seed=2, round_num=7))
  assert not np.array_equal(a, simulation.sample_clients(105, 10, seed=1, round_num=8))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedprox", "fedavgm", "fedadam"])
def test_variants_learn(algorithm, tmp_path):
  summary = training.run_experiment(
    dataclasses.replace(QUICK, algorithm=algorithm, rounds=3, output_dir=str(tmp_path))
  )
  assert summary["algorithm"] == algorithm
  assert summary["test_accuracy"] > 2 / 62


@pytest.mark.slow
def test_fedensemble_run_reports_ensemble_metrics(tmp_path):
  summary = training.run_experiment(
    dataclasses.replace(
      QUICK, algorithm="fedensemble", ensemble_size=2, rounds=2, output_dir=str(tmp_path)
    )
  )
  assert summary["ensemble_size"] == 2
  assert len(summary["member_test_accuracy"]) == 2
  for key in ("personalized_accuracy", "entropy_error_auroc", "personalization_temperature"):
    assert key in summary
  assert sorted(os.listdir(tmp_path / "members")) == ["member_0.keras", "member_1.keras"]
  with open(tmp_path / run_files.PERSONALIZED_PER_CLIENT_ACCURACY_FILE) as f:
    per_writer = json.load(f)
  assert np.mean(list(per_writer.values())) == pytest.approx(summary["personalized_accuracy"])


@pytest.mark.slow
def test_digits_run_reports_ood_shift_and_draws_them(tmp_path):
  summary = training.run_experiment(
    dataclasses.replace(
      QUICK,
      algorithm="fedensemble",
      ensemble_size=2,
      rounds=2,
      classes="digits",
      output_dir=str(tmp_path),
    )
  )
  from tasks import femnist

  data = femnist.DIGITS.load_data(DATA_DIR)
  assert sum(summary["reliability"]["count"]) == data.test.num_examples()
  # Recomputed from the saved members: float64 NumPy, scikit-learn's AUROC.
  models = numpy_references.saved_models(tmp_path)
  assert len(models) == 2
  test, ood, shift = (
    numpy_references.mixture(numpy_references.member_probabilities(models, split.concatenated()[0]))
    for split in (data.test, data.ood, data.shift)
  )
  for score in ("entropy", "mutual_information"):
    expected = numpy_references.ood_auroc(test[score], ood[score])
    assert summary[f"ood_auroc_{score}"] == pytest.approx(expected, abs=1e-3), score
  shift_y = data.shift.concatenated()[1]
  expected = numpy_references.accuracy(shift["probabilities"], shift_y)
  assert summary["shift_accuracy"] == pytest.approx(expected, abs=1e-9)
  expected = numpy_references.calibration_error(shift["probabilities"], shift_y)
  assert summary["shift_ece"] == pytest.approx(expected, abs=1e-4)
  assert summary["shift_accuracy"] == summary["new_client_accuracy"]
  with open(tmp_path / "uncertainty.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedbe", "feddf"])
def test_server_distillation_run_reports_teacher_and_server(algorithm, monkeypatch, tmp_path):
  # A small unlabeled set (test-only writers' images) keeps the server fast.
  from tasks import femnist

  unlabeled = femnist.load_data(DATA_DIR).new_clients.concatenated()[0][:96]
  np.savez(tmp_path / "server.npz", x=unlabeled)
  recorded = record_teachers(monkeypatch, server_distillation.DistillationStep)
  summary = training.run_experiment(
    dataclasses.replace(
      QUICK,
      algorithm=algorithm,
      rounds=2,
      eval_every=1,
      distill_steps=25,
      distill_batch_size=32,
      server_data=str(tmp_path / "server.npz"),
      classes="digits",
      output_dir=str(tmp_path / "out"),
      **(
        {"fedbe_samples": 2}
        if algorithm == "fedbe"
        # Two rounds' clients are at chance: drop-worst would skip the student.
        else {"distill_eval_every": 2, "distill_patience": 4, "drop_worst": False}
      ),
    )
  )
  # The student is one model; the teachers are an ensemble.
  assert summary["ood_auroc_mutual_information"] is None
  assert sum(summary["teacher_reliability"]["count"]) == sum(summary["reliability"]["count"])
  # The last round's teachers, recomputed in NumPy from the models they are made of.
  stack, weights, average, *_ = recorded[-1]["returned"]
  (student,) = numpy_references.saved_models(tmp_path / "out")
  teacher_model = tf.keras.models.clone_model(student)
  data = femnist.DIGITS.load_data(DATA_DIR)
  targets = "avg_logits" if algorithm == "feddf" else "probabilities"
  test, ood, shift = (
    numpy_references.teacher_ensemble(
      stacked_logits(teacher_model, stack, split.concatenated()[0]),
      weights,
      targets,
    )
    for split in (data.test, data.ood, data.shift)
  )
  for score in ("entropy", "mutual_information"):
    expected = numpy_references.ood_auroc(test[score], ood[score])
    assert summary[f"teacher_ood_auroc_{score}"] == pytest.approx(expected, abs=1e-3), score
  expected = numpy_references.accuracy(shift["probabilities"], data.shift.concatenated()[1])
  assert summary["teacher_shift_accuracy"] == pytest.approx(expected, abs=1e-9)
  assert summary["server_device"] == "/CPU:0"
  assert summary["server_seconds_per_round"] > 0
  assert summary["distill_examples_per_second"] > 0
  rows = read_metrics(tmp_path / "out")
  assert all(float(r["distill_steps"]) >= 1 for r in rows)
  # The last student is the saved model; the last evaluation's average is the teachers'.
  validation_x, validation_y = recorded[-1]["validation"]
  student_probabilities = numpy_references.softmax(student(validation_x, training=False))
  expected = numpy_references.accuracy(student_probabilities, validation_y)
  assert float(rows[-1]["student_validation_accuracy"]) == pytest.approx(expected, abs=1e-6)
  test_x, test_y = data.test.concatenated()
  average_logits = logits_of(teacher_model, average, test_x)
  expected = numpy_references.accuracy(numpy_references.softmax(average_logits), test_y)
  assert float(rows[-1]["average_test_accuracy"]) == pytest.approx(expected, abs=1e-6)
  # The student's curve: from step 0, which is the clients' average.
  curves = json.loads((tmp_path / "out" / run_files.CURVES_FILE).read_text())
  assert sorted(curves) == ["1", "2"]
  for r, row in zip(("1", "2"), rows):
    curve = np.array(curves[r]["validation_curve"])
    assert curve[0, 0] == 0 and len(curve) >= 2
    np.testing.assert_allclose(curve[0, 1], float(row["average_validation_accuracy"]))


@pytest.mark.slow
def test_feddf_over_two_prototypes_reports_each(monkeypatch, tmp_path):
  from tasks import femnist
  from tff_ens.algorithms import model_prototypes

  unlabeled = femnist.load_data(DATA_DIR).new_clients.concatenated()[0][:64]
  np.savez(tmp_path / "server.npz", x=unlabeled)
  recorded = record_teachers(monkeypatch, model_prototypes.PrototypeStep)
  summary = training.run_experiment(
    dataclasses.replace(
      QUICK,
      algorithm="feddf",
      prototypes="cnn,resnet8",
      rounds=1,
      clients_per_round=2,
      distill_steps=4,
      distill_batch_size=32,
      distill_eval_every=2,
      server_data=str(tmp_path / "server.npz"),
      output_dir=str(tmp_path / "out"),
    )
  )
  accuracies = summary["prototype_test_accuracy"]
  assert sorted(accuracies) == ["cnn", "resnet8"]
  # Each prototype's accuracy is its saved model's, predicted apart from the evaluator.
  x, y = femnist.load_data(DATA_DIR).test.concatenated()
  saved = {}
  for name, accuracy in accuracies.items():
    path = tmp_path / "out" / "prototypes" / f"{name}.keras"
    saved[name] = tf.keras.models.load_model(path, compile=False)
    assert accuracy == pytest.approx(reference_test_metrics([saved[name]], x, y)[0], abs=1e-12)
  assert sorted(os.listdir(tmp_path / "out" / "prototypes")) == ["cnn.keras", "resnet8.keras"]
  # The teachers: both clients' models, one of each architecture, their logits averaged
  # (AVGLOGITS), recomputed in NumPy from the models the last round kept.
  clients, _, keep, *_ = recorded[-1]["returned"]
  members = [
    stacked_logits(tf.keras.models.clone_model(saved[name]), stack, x)
    for name, stack in zip(("cnn", "resnet8"), clients)
  ]
  assert [int(k.sum()) for k in keep] == [1, 1]
  teachers = numpy_references.teacher_ensemble(
    np.concatenate(members), np.concatenate(keep), "avg_logits"
  )
  expected = numpy_references.accuracy(teachers["probabilities"], y)
  assert summary["ensemble_test_accuracy"] == pytest.approx(expected, abs=1e-9)
  # The round's resnet8 student is the saved resnet8, on the server's validation images.
  (row,) = read_metrics(tmp_path / "out")
  validation_x, validation_y = recorded[-1]["validation"]
  logits = saved["resnet8"](validation_x, training=False)
  expected = numpy_references.accuracy(numpy_references.softmax(logits), validation_y)
  assert float(row["student_validation_accuracy_resnet8"]) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
  "change, message",
  [
    (
      dict(algorithm="fedavg", prototypes="cnn,resnet8"),
      "--prototypes=cnn,resnet8: --algorithm=fedavg does not read it",
    ),
    (dict(algorithm="feddf", prototypes="cnn"), "two or more different"),
    (dict(algorithm="feddf", prototypes="cnn,vgg"), "unknown model vgg"),
    (dict(algorithm="feddf", prototypes="resnet8,cnn"), "starts with resnet8 but --model=cnn"),
    (
      dict(algorithm="feddf", prototypes="cnn,resnet8", recalibrate_batch_norm=100),
      "--prototypes=cnn,resnet8: not with --recalibrate_batch_norm",
    ),
    (
      dict(algorithm="feddf", distill_min_improvement=-0.1),
      "--distill_min_improvement must be >= 0",
    ),
    (dict(rounds=0), "--rounds must be a positive integer"),
    (dict(algorithm="feddf", server_device="tpu"), "--server_device='tpu'"),
    (dict(algorithm="fedbe", distill_steps=10), "--distill_steps must be >= 25 for SWA"),
    (dict(algorithm="fedsgd"), "unknown --algorithm=fedsgd"),
    (dict(task="mnist"), "unknown --task=mnist: choose one of femnist, cifar10, cifar100"),
    (dict(model="vgg"), "unknown --model=vgg"),
    (dict(clients_per_round=106), "exceeds the 105 training writers"),
    (dict(lr_schedule="cosine"), "unknown --lr_schedule=cosine"),
    (
      dict(local_objective="feddyn"),
      "--local_objective=feddyn: --algorithm=fedavg does not read it",
    ),
    (
      dict(algorithm="fedensemble", local_objective="feddyn", feddyn_alpha=0.0),
      "--feddyn_alpha must be > 0",
    ),
    (
      dict(
        algorithm="fedensemble", local_objective="feddyn", dp_noise_multiplier=1.0, dp_clip_norm=1.0
      ),
      "does not combine with DP",
    ),
    (
      dict(algorithm="ditto", client_transport="values", clients_per_chunk=2),
      "a round in chunks \\(--clients_per_chunk\\) cannot .* use --client_transport=files",
    ),
  ],
)
def test_bad_flags_raise_one_line_errors(change, message, tmp_path):
  config = dataclasses.replace(QUICK, output_dir=str(tmp_path / "out"), **change)
  with pytest.raises(experiment.UsageError, match=message) as error:
    training.run_experiment(config)
  assert "\n" not in str(error.value)


def test_a_config_saved_before_the_defaults_changed_keeps_what_its_run_did():
  # Written before --member_average and the pooled FEMNIST split existed.
  old = dataclasses.asdict(experiment.ExperimentConfig(algorithm="fedensemble"))
  for name in settings.flags_with_before(experiment.ALL_GROUPS):
    del old[name]
  old.update(partition="iid", server_unlabeled_examples=10_000, server_validation_examples=1_000)
  saved = experiment.saved_config(old)
  assert saved["member_average"] == "examples"
  assert "drop_worst_rule" not in saved  # Not Fed-ensemble's: its default, which it accepts.
  feddf_old = dataclasses.asdict(experiment.ExperimentConfig(algorithm="feddf"))
  del feddf_old["member_average"], feddf_old["drop_worst_rule"]
  assert experiment.saved_config(feddf_old)["drop_worst_rule"] == "majority"
  assert saved["partition"] is None and saved["server_unlabeled_examples"] is None
  assert experiment.resolve(experiment.ExperimentConfig(**saved)).partition is None
  assert experiment.saved_config(dataclasses.asdict(QUICK)) == dataclasses.asdict(QUICK)


def test_a_config_saved_before_teacher_labels_keeps_labelling_the_whole_set():
  for algorithm in ("fedbe", "feddf", "vdistill", "fedppd_distill", "fedavg"):
    old = dataclasses.asdict(experiment.ExperimentConfig(algorithm=algorithm))
    del old["teacher_labels"]
    saved = experiment.saved_config(old)
    assert saved.get("teacher_labels") == (None if algorithm == "fedavg" else "all")


def test_a_config_saved_before_train_positions_keeps_shakespeares_last_position():
  for task, resumed in (("shakespeare", "last"), ("femnist", None)):
    old = dataclasses.asdict(experiment.ExperimentConfig(task=task))
    del old["train_positions"]
    assert experiment.saved_config(old).get("train_positions") == resumed


def test_a_config_saved_before_fedadam_resumes_with_the_algorithms_server_lr():
  # Before FedAdam every config.json held server_lr, 1 by default, which FedBE never read.
  for algorithm, server_lr, resumed in (
    ("fedavg", 1.0, None),
    ("fedbe", 1.0, None),
    ("fedavgm", 0.5, 0.5),
  ):
    old = {
      **dataclasses.asdict(experiment.ExperimentConfig(algorithm=algorithm)),
      "server_lr": server_lr,
    }
    del old["server_epsilon"]
    assert experiment.saved_config(old)["server_lr"] == resumed
  new_run = dataclasses.asdict(experiment.ExperimentConfig(algorithm="fedavg", server_lr=1.0))
  assert experiment.saved_config(new_run)["server_lr"] == 1.0
  with pytest.raises(experiment.UsageError, match="--server_lr must be > 0, got 0.0"):
    dataclasses.replace(QUICK, algorithm="fedadam", server_lr=0.0).validate()


def test_output_dir_of_another_run_is_refused_and_kept(fedavg_run):
  config, _ = fedavg_run
  metrics_path = os.path.join(config.output_dir, run_files.METRICS_FILE)
  before = pathlib.Path(metrics_path).read_bytes()
  refused = f"holds a different run \\(it has --client_lr={config.client_lr}\\)"
  with pytest.raises(experiment.UsageError, match=refused):
    training.run_experiment(dataclasses.replace(config, client_lr=0.2))
  with pytest.raises(experiment.UsageError, match="pass --resume"):
    training.run_experiment(config)
  assert pathlib.Path(metrics_path).read_bytes() == before


def test_a_moved_run_directory_resumes(fedavg_run, tmp_path):
  config, _ = fedavg_run
  moved = tmp_path / "moved"  # Its config; its checkpoints are another test's.
  moved.mkdir()
  shutil.copy(os.path.join(config.output_dir, run_files.CONFIG_FILE), moved)
  outputs = run_outputs.RunOutputs(
    experiment.resolve(dataclasses.replace(config, output_dir=str(moved), resume=True)).outputs,
    None,
  )
  outputs.close()
  assert json.loads((moved / run_files.CONFIG_FILE).read_text())["output_dir"] == str(moved)


def test_client_states_outlive_the_older_checkpoint(tmp_path):
  # A resume from the older of the two checkpoints kept (the newer deleted as unreadable)
  # finds the client states of its round.
  outputs = run_outputs.RunOutputs(
    experiment.resolve(dataclasses.replace(QUICK, output_dir=str(tmp_path))).outputs, None
  )
  spec = algorithm_lib.ClientStates(shape=(2,), dtype=np.dtype(np.float32))
  store = client_states.ClientStateStore(str(tmp_path / client_states.DIRECTORY), spec)
  for round_num in (1, 2, 3, 4):
    store.save(round_num, 0, 0, np.full((2,), round_num, np.float32))
    if round_num % 2 == 0:
      outputs.save_checkpoint(round_num, {"w": np.zeros((2,), np.float32)})
      store.prune(outputs.checkpoint_rounds())
  assert outputs.checkpoint_rounds() == [2, 4]
  outputs.close()
  store.rewind(2)
  assert store.load(0, 0)[0] == 2.0


def test_run_from_before_a_new_flag_resumes_at_its_default(tmp_path):
  config = dataclasses.replace(QUICK, output_dir=str(tmp_path), resume=True)
  old = dataclasses.asdict(config)
  del old["active_budget"]  # As if the run predates --active_budget.
  (tmp_path / run_files.CONFIG_FILE).write_text(json.dumps(old))
  run_outputs.RunOutputs(experiment.resolve(config).outputs, None).close()
  (tmp_path / run_files.CONFIG_FILE).write_text(json.dumps(old))
  with pytest.raises(experiment.UsageError, match="it has --active_budget=10\\)"):
    run_outputs.RunOutputs(
      experiment.resolve(dataclasses.replace(config, active_budget=3)).outputs, None
    )


def test_learning_curves_are_kept_by_round_and_rewound_on_resume(tmp_path):
  config = dataclasses.replace(QUICK, output_dir=str(tmp_path), resume=True)
  path = tmp_path / run_files.CURVES_FILE
  outputs = run_outputs.RunOutputs(experiment.resolve(config).outputs, None)
  outputs.release_curves(1, {"validation_curve": [[0.0, 0.5], [20.0, 0.6]]})
  outputs.release_curves(2, {})  # A round that distilled nothing adds no entry.
  outputs.release_curves(3, {"validation_curve": [[0.0, 0.7]]})
  outputs.close()
  assert json.loads(path.read_text()) == {
    "1": {"validation_curve": [[0.0, 0.5], [20.0, 0.6]]},
    "3": {"validation_curve": [[0.0, 0.7]]},
  }
  # A resume from round 1's checkpoint runs rounds 2 and 3 again: theirs are replaced.
  outputs = run_outputs.RunOutputs(experiment.resolve(config).outputs, None)
  outputs.release_curves(2, {"validation_curve": [[0.0, 0.4]]})
  outputs.close()
  assert sorted(json.loads(path.read_text())) == ["1", "2"]
  # A file that is not a run's curves is named, and left as it was.
  path.write_text("[1, 2]")
  with pytest.raises(experiment.UsageError, match="is not a run's learning curves"):
    run_outputs.RunOutputs(experiment.resolve(config).outputs, None)
  assert path.read_text() == "[1, 2]"


@pytest.mark.slow
def test_max_update_norm_rejects_larger_updates(tmp_path):
  config = dataclasses.replace(
    QUICK, rounds=1, eval_every=1, max_update_norm=1e-6, output_dir=str(tmp_path)
  )
  training.run_experiment(config)
  (row,) = read_metrics(tmp_path)
  assert float(row["rejected_updates"]) == config.clients_per_round
  assert float(row["train_loss"]) == 0.0  # Rejected clients' metrics drop.


# Without --model, Shakespeare's run takes its lstm (cnn would be refused before the data).
@pytest.mark.parametrize("task", ["femnist", "shakespeare"])
def test_cli_missing_data_dir_is_one_line(task, tmp_path):
  result = run_cli(
    f"--task={task}", f"--data_dir={tmp_path}/nowhere", f"--output_dir={tmp_path}/out"
  )
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith("error: ")
  assert "nowhere" in result.stderr.strip().splitlines()[-1]


# A line of TensorFlow's C++ log: "2026-11-24 22:02:46.860114: I tensorflow/...".
CPP_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] ", re.MULTILINE)


@pytest.mark.slow
def test_cli_is_quiet_unless_verbosity_asks(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  quiet = subprocess.run(
    [
      sys.executable,
      "-m",
      "tff_ens.main",
      f"--data_dir={DATA_DIR}",
      "--rounds=2",
      "--clients_per_round=2",
      "--eval_every=1",
      f"--output_dir={tmp_path}/quiet",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert quiet.returncode == 0, quiet.stderr[-2000:]
  assert not CPP_LOG_LINE.search(quiet.stderr), CPP_LOG_LINE.findall(quiet.stderr)[:3]
  assert "round 2/2" in quiet.stderr  # The per-round log line stays.
  # Asked for, TensorFlow's log is there from the import on (a run that
  # stops at its data shows it as well as a whole run).
  verbose = subprocess.run(
    [
      sys.executable,
      "-m",
      "tff_ens.main",
      "--verbosity=1",
      f"--data_dir={tmp_path}/nowhere",
      f"--output_dir={tmp_path}/v",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert verbose.returncode == 2
  assert CPP_LOG_LINE.search(verbose.stderr)


def _start_and_await(config, output_dir, path, seconds=300):
  """Starts the CLI run of `config` in its own process group; waits for `path` (at most
  `seconds`).

  Returns the process and the run's flags.
  """
  flags = [
    f"--{k}={v}"
    for k, v in dataclasses.asdict(config).items()
    if k not in ("output_dir", "resume") and v is not None
  ]
  process = subprocess.Popen(
    [sys.executable, "-m", "tff_ens.main", *flags, f"--output_dir={output_dir}"],
    cwd=ROOT,
    start_new_session=True,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  deadline = time.time() + seconds
  while not path():
    if process.poll() is not None:
      pytest.fail("the run ended before it could be signalled")
    if time.time() > deadline:
      os.killpg(process.pid, signal.SIGKILL)
      pytest.fail(f"the run did not get to the point awaited in {seconds} s")
    time.sleep(0.2)
  return process, flags


def _killed_after_round_2(config, output_dir) -> list[str]:
  """SIGKILLs the CLI run of `config` once round 2 is checkpointed; returns its flags."""
  first_checkpoint = output_dir / run_files.CHECKPOINT_DIR / "round_2"
  process, flags = _start_and_await(config, output_dir, first_checkpoint.exists)
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert not (output_dir / run_files.SUMMARY_FILE).exists()
  return flags


def _resumed_summary(flags, output_dir) -> dict:
  """The summary of the run in `output_dir` continued with --resume."""
  result = run_cli(*flags, f"--output_dir={output_dir}", "--resume")
  assert result.returncode == 0, result.stderr[-2000:]
  assert [int(r["round"]) for r in read_metrics(output_dir)] == [1, 2, 3, 4]
  with open(output_dir / run_files.SUMMARY_FILE) as f:
    return json.load(f)


def _resume_matches(flags, output_dir, summary):
  # The same state, so the same numbers (tests/test_resume.py checks the state itself).
  resumed = _resumed_summary(flags, output_dir)
  assert resumed["test_accuracy"] == summary["test_accuracy"]
  assert resumed["test_loss"] == summary["test_loss"]


@pytest.mark.slow
def test_fedbe_sigkilled_then_resumed_ends_where_an_uninterrupted_run_does(tmp_path):
  # The server step runs in the driver between TFF calls; its state (the model and
  # the round that seeds it) is all in the checkpoint.
  from tasks import femnist

  np.save(tmp_path / "server.npy", femnist.load_data(DATA_DIR).new_clients.concatenated()[0][:96])
  config = dataclasses.replace(
    QUICK,
    algorithm="fedbe",
    distill_steps=25,
    distill_batch_size=32,
    fedbe_samples=2,
    server_data=str(tmp_path / "server.npy"),
    output_dir=str(tmp_path / "uninterrupted"),
  )
  summary = training.run_experiment(config)
  output_dir = tmp_path / "killed"
  resumed = _resumed_summary(_killed_after_round_2(config, output_dir), output_dir)
  for key in ("test_accuracy", "test_loss", "ensemble_test_accuracy"):
    assert resumed[key] == pytest.approx(summary[key], rel=1e-6, abs=1e-9), key
  rows, uninterrupted = read_metrics(output_dir), read_metrics(tmp_path / "uninterrupted")
  for row, want in zip(rows[2:], uninterrupted[2:]):  # The rounds run after the resume.
    assert float(row["train_loss"]) == pytest.approx(float(want["train_loss"]), rel=1e-5)


@pytest.mark.slow
def test_feddyn_client_states_resume_from_the_checkpoint(tmp_path):
  # FedDyn's clients keep a state on disk (tff_ens.program.client_states). A run
  # killed after round 3 wrote states but before round 4's checkpoint must
  # resume from round 2's checkpoint *and* round 2's client states.
  config = dataclasses.replace(
    QUICK,
    algorithm="fedensemble",
    ensemble_size=2,
    local_objective="feddyn",
    feddyn_alpha=0.1,
    output_dir=str(tmp_path / "uninterrupted"),
  )
  summary = training.run_experiment(config)
  states = tmp_path / "killed" / "client_states"
  process, flags = _start_and_await(
    config,
    tmp_path / "killed",
    lambda: states.is_dir() and any("round0000003" in name for name in os.listdir(states)),
  )
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert not (tmp_path / "killed" / run_files.CHECKPOINT_DIR / "round_4").exists(), (
    "killed too late to test the resume"
  )
  _resume_matches(flags, tmp_path / "killed", summary)
  want = client_state_values(tmp_path / "uninterrupted")
  got = client_state_values(tmp_path / "killed")
  assert sorted(got) == sorted(want)
  assert any("round0000004" in name for name in want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.slow
def test_sigterm_checkpoints_the_round_and_stops(fedavg_run, tmp_path):
  config, summary = fedavg_run
  output_dir = tmp_path / "terminated"
  # No checkpoint before round 4 but the one SIGTERM makes; the signal goes
  # to the whole process group, TFF's worker included, as systemd sends it.
  config = dataclasses.replace(config, checkpoint_every=4)
  process, flags = _start_and_await(
    config, output_dir, lambda: len(_metrics_or_empty(output_dir)) >= 1
  )
  os.killpg(process.pid, signal.SIGTERM)
  _, stderr = process.communicate(timeout=120)
  assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
  last = stderr.strip().splitlines()[-1]
  stopped_after = int(last.split("after round ")[1].split(",")[0])
  assert last.endswith("continue with --resume")
  checkpoints = os.listdir(output_dir / run_files.CHECKPOINT_DIR)
  assert checkpoints == [f"round_{stopped_after}"]
  assert len(read_metrics(output_dir)) == stopped_after
  assert not (output_dir / run_files.SUMMARY_FILE).exists()
  _resume_matches(flags, output_dir, summary)


def _metrics_or_empty(output_dir):
  try:
    return read_metrics(output_dir)
  except FileNotFoundError:
    return []


@pytest.mark.slow
@pytest.mark.parametrize("second", ["signal", "grace"])
def test_a_second_signal_or_the_grace_period_stops_a_round_in_its_server_step(second, tmp_path):
  # v-Distillation with a server step of a minute or more: the stop comes in round 2, in the
  # student's distillation; round 1 is checkpointed and the run resumes from it.
  config = dataclasses.replace(
    QUICK,
    algorithm="vdistill",
    rounds=2,
    checkpoint_every=1,
    distill_steps=20_000,
    distill_batch_size=8,
    stop_grace_seconds=2.0 if second == "grace" else 0.0,
  )
  output_dir = tmp_path / "stopped"
  round_1 = output_dir / run_files.CHECKPOINT_DIR / "round_1"
  # Round 1 takes minutes on a loaded machine.
  process, _ = _start_and_await(config, output_dir, round_1.exists, seconds=1800)
  time.sleep(20)  # Round 2's clients are done; its server step distills for a minute or more.
  os.killpg(process.pid, signal.SIGTERM)
  if second == "signal":
    time.sleep(1)
    os.killpg(process.pid, signal.SIGTERM)
  _, stderr = process.communicate(timeout=60)
  assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
  last = stderr.strip().splitlines()[-1]
  assert last.startswith("stopped by SIGTERM in round 2: The run's last checkpoint is round 1")
  assert os.listdir(output_dir / run_files.CHECKPOINT_DIR) == ["round_1"]
  assert len(read_metrics(output_dir)) == 1  # Round 1's row, whole.
  assert not (output_dir / run_files.SUMMARY_FILE).exists()
  # --resume runs round 2 again from round 1's checkpoint (test_sigkill_then_resume...).


@pytest.mark.slow
def test_a_finished_run_resumed_with_more_rounds_ends_where_a_longer_run_does(fedavg_run, tmp_path):
  config, summary = fedavg_run
  shorter = dataclasses.replace(config, output_dir=str(tmp_path), rounds=2)
  training.run_experiment(shorter)
  longer = training.run_experiment(dataclasses.replace(shorter, rounds=4, resume=True))
  assert [int(r["round"]) for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
  assert longer["rounds"] == 4
  # The same state at round 2, and the same cohorts and data order after it: the same model.
  assert longer["test_accuracy"] == summary["test_accuracy"]
  assert longer["test_loss"] == summary["test_loss"]


def test_a_checkpoint_leaves_no_copy_of_the_state_behind(tmp_path):
  # TFF's writer makes the state variables inside reference cycles; left to Python's rare
  # full collections, a long run's driver would hold one state more for every checkpoint.
  state = {"w": np.ones((1000, 7), np.float32)}
  outputs = run_outputs.RunOutputs(
    experiment.resolve(dataclasses.replace(QUICK, output_dir=str(tmp_path))).outputs, state
  )
  gc.disable()  # Only the collections the code makes itself.
  try:
    for round_num in (1, 2, 3):
      outputs.save_checkpoint(round_num, state)
    copies = [v for v in gc.get_objects() if isinstance(v, tf.Variable) and v.shape == (1000, 7)]
  finally:
    gc.enable()
    outputs.close()
  assert copies == []


def test_resume_refuses_a_checkpoint_past_rounds_and_a_schedule_over_other_rounds(tmp_path):
  config = dataclasses.replace(QUICK, output_dir=str(tmp_path), resume=True)
  outputs = run_outputs.RunOutputs(
    experiment.resolve(config).outputs, {"w": np.zeros((2,), np.float32)}
  )
  outputs.save_checkpoint(4, {"w": np.ones((2,), np.float32)})
  outputs.close()
  with pytest.raises(experiment.UsageError, match="of round 4, past --rounds=3: pass --rounds=4"):
    run_outputs.RunOutputs(
      experiment.resolve(dataclasses.replace(config, rounds=3)).outputs,
      {"w": np.zeros((2,), np.float32)},
    )
  assert json.loads((tmp_path / run_files.CONFIG_FILE).read_text())["rounds"] == 4
  step = dataclasses.replace(config, output_dir=str(tmp_path / "step"), lr_schedule="step")
  run_outputs.RunOutputs(experiment.resolve(step).outputs, None).close()
  with pytest.raises(experiment.UsageError, match="--rounds=4; --rounds stays: --lr_schedule=step"):
    run_outputs.RunOutputs(experiment.resolve(dataclasses.replace(step, rounds=8)).outputs, None)
