"""`python -m tff_ens.compare` on real CLI runs on the FEMNIST slice."""

import csv
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

from matplotlib import image
import numpy as np
import pytest

from tests.femnist_runs import QUICK
from tests.femnist_runs import ROOT
from tests.femnist_runs import read_metrics
from tff_ens import compare
from tff_ens import run_files
from tff_ens.program import finished_runs
from tff_ens.program import training

# Three real runs and CLI processes: minutes (`uv run pytest -m slow`).
pytestmark = pytest.mark.slow

# Two rounds of three writers: FedAvg and a two-member Fed-ensemble of one
# seed, and FedAvg of another seed.
RUN_CONFIGS = {
  "fedavg": dict(algorithm="fedavg", seed=3),
  "fedensemble": dict(algorithm="fedensemble", ensemble_size=2, seed=3),
  "fedavg_seed4": dict(algorithm="fedavg", seed=4),
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
  """`python -m module args`, with TensorFlow's C++ log level left unset."""
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  return subprocess.run(
    [sys.executable, "-m", module, *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, str]:
  root = tmp_path_factory.mktemp("runs")
  for name, changes in RUN_CONFIGS.items():
    training.run_experiment(
      dataclasses.replace(
        QUICK, rounds=2, clients_per_round=3, eval_every=1, output_dir=str(root / name), **changes
      )
    )
  return {name: str(root / name) for name in RUN_CONFIGS}


@pytest.fixture(scope="module")
def runs(run_dirs) -> list[finished_runs.Run]:
  return [finished_runs.load_run(path) for path in run_dirs.values()]


def read_summary(path: str) -> dict:
  with open(os.path.join(path, run_files.SUMMARY_FILE)) as f:
    return json.load(f)


def table_cells(text: str) -> list[dict[str, str]]:
  """The printed table's rows as header -> cell (columns: 2+ spaces)."""
  header, *lines = text.splitlines()
  names = re.split(r"\s{2,}", header)
  return [dict(zip(names, re.split(r"\s{2,}", line))) for line in lines if re.match(r"\d+\s", line)]


def test_rows_are_the_runs_own_numbers(run_dirs, runs):
  rows = compare.table_rows(runs)
  for row, path in zip(rows, run_dirs.values()):
    summary = read_summary(path)
    assert row["run"] == os.path.basename(path)
    assert row["algorithm"] == summary["config"]["algorithm"]
    for key in (
      "seed",
      "rounds",
      "test_accuracy",
      "test_loss",
      "ece",
      "per_client_accuracy",
      "seconds_per_round",
    ):
      assert row[key] == summary[key], key
    assert row["personalized_accuracy"] == summary.get("personalized_accuracy")
    assert row["bytes_down"] == summary["bytes_down_per_client_round"]
    assert row["bytes_up"] == summary["bytes_up_per_client_round"]
  first = read_summary(run_dirs["fedavg"])["test_accuracy"]
  assert rows[0]["accuracy_difference"] is None
  assert rows[1]["accuracy_difference"] == pytest.approx(rows[1]["test_accuracy"] - first)
  assert rows[1]["personalized_accuracy"] is not None  # Fed-ensemble's.


def test_personalized_accuracy_of_each_writer_is_written_beside_the_summary(run_dirs):
  name = run_files.PERSONALIZED_PER_CLIENT_ACCURACY_FILE
  assert not os.path.exists(os.path.join(run_dirs["fedavg"], name))
  with open(os.path.join(run_dirs["fedensemble"], name)) as f:
    per_writer = json.load(f)
  with open(os.path.join(run_dirs["fedensemble"], run_files.PER_CLIENT_ACCURACY_FILE)) as f:
    assert set(per_writer) <= set(json.load(f))
  assert np.mean(list(per_writer.values())) == pytest.approx(
    read_summary(run_dirs["fedensemble"])["personalized_accuracy"]
  )


def test_printed_table_shows_the_summaries(run_dirs, runs):
  cells = table_cells(compare.table(runs))
  assert len(cells) == len(run_dirs)
  for row, path in zip(cells, run_dirs.values()):
    summary = read_summary(path)
    assert int(row["seed"]) == summary["seed"]
    assert int(row["rounds"]) == summary["rounds"] == 2
    for column, key in (
      ("accuracy", "test_accuracy"),
      ("NLL", "test_loss"),
      ("ECE", "ece"),
      ("per-client", "per_client_accuracy"),
    ):
      assert float(row[column]) == pytest.approx(summary[key], abs=5e-5)
    assert float(row["s/round"]) == pytest.approx(summary["seconds_per_round"], abs=5e-3)
    down, up = map(float, row["MB down/up"].split("/"))
    assert down == pytest.approx(summary["bytes_down_per_client_round"] / 1e6, abs=5e-3)
    assert up == pytest.approx(summary["bytes_up_per_client_round"] / 1e6, abs=5e-3)
  fedavg, fedensemble, _ = cells
  assert fedavg["personalized"] == "-"
  assert float(fedensemble["personalized"]) == pytest.approx(
    read_summary(run_dirs["fedensemble"])["personalized_accuracy"], abs=5e-5
  )
  assert fedavg["vs #1"] == "-"
  assert float(fedensemble["vs #1"]) == pytest.approx(
    float(fedensemble["accuracy"]) - float(fedavg["accuracy"]), abs=2e-4
  )


def test_flags_show_what_differs_and_the_variant(runs):
  fedavg, fedensemble, _ = compare.table_rows(runs)
  assert fedavg["flags"] == "clients_per_round=3 client_lr=0.1"
  assert fedensemble["flags"] == (
    "clients_per_round=3 client_lr=0.1 ensemble_size=2 local_objective=sgd"
  )


def test_seed_marker_only_when_seeds_differ(runs):
  fedavg, fedensemble, fedavg_seed4 = runs
  same_seed = compare.table([fedavg, fedensemble])
  assert compare.SEED_DIFFERS not in same_seed
  assert len(same_seed.splitlines()) == 3  # Header and two rows.
  text = compare.table([fedavg, fedensemble, fedavg_seed4])
  cells = table_cells(text)
  assert not cells[1]["vs #1"].endswith(compare.SEED_DIFFERS)
  assert cells[2]["vs #1"].endswith(compare.SEED_DIFFERS)
  assert text.splitlines()[-1].startswith(f"{compare.SEED_DIFFERS} seed differs from #1's (3)")
  # Against a first run of seed 4, both others differ.
  flipped = table_cells(compare.table([fedavg_seed4, fedavg, fedensemble]))
  assert all(c["vs #1"].endswith(compare.SEED_DIFFERS) for c in flipped[1:])


def test_seed_table_is_the_mean_and_std_over_seeds_and_pairs_by_seed(run_dirs, runs):
  fedavg, fedensemble = compare.seed_table_rows(runs)
  seed3, seed4 = read_summary(run_dirs["fedavg"]), read_summary(run_dirs["fedavg_seed4"])
  ensemble = read_summary(run_dirs["fedensemble"])
  assert fedavg["seeds"] == [3, 4] and fedensemble["seeds"] == [3]
  for key in ("test_accuracy", "per_client_accuracy"):
    values = [seed3[key], seed4[key]]
    assert fedavg[key] == pytest.approx((np.mean(values), np.std(values, ddof=1)))
  assert fedavg["personalized_accuracy"] is None and fedavg["per_client_difference"] is None
  # The ensemble's one seed is paired with FedAvg's run of that seed, not the mean of both.
  assert fedensemble["per_client_difference"] == (
    pytest.approx(ensemble["per_client_accuracy"] - seed3["per_client_accuracy"]),
    None,
  )
  assert fedensemble["personalized_difference"][0] == pytest.approx(
    ensemble["personalized_accuracy"] - seed3["per_client_accuracy"]
  )
  text = compare.seed_table(runs)
  assert f"{fedavg['per_client_accuracy'][0]:.4f} ± {fedavg['per_client_accuracy'][1]:.4f}" in text


def test_accuracy_curve_is_metrics_csv(run_dirs, runs):
  for run, path in zip(runs, run_dirs.values()):
    rows = read_metrics(path)
    assert run.accuracy_by_round() == ([1, 2], [float(r["test_accuracy"]) for r in rows])


def test_accuracy_figure_draws_the_teachers_of_a_run_that_measured_them(run_dirs, tmp_path):
  # A run as FedBE's writes it: metrics.csv with the teachers' test accuracy.
  with_teachers = tmp_path / "with_teachers"
  shutil.copytree(run_dirs["fedavg"], with_teachers)
  rows = read_metrics(with_teachers)
  for row in rows:
    row["teachers_test_accuracy"] = str(float(row["test_accuracy"]) / 2)
  with open(with_teachers / run_files.METRICS_FILE, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  plain, teachers = (finished_runs.load_run(str(p)) for p in (run_dirs["fedavg"], with_teachers))
  assert teachers.accuracy_by_round("teachers_test_accuracy") == (
    [1, 2],
    [float(r["test_accuracy"]) / 2 for r in rows],
  )
  assert plain.accuracy_by_round("teachers_test_accuracy") == ([], [])
  compare.plot_accuracy([plain], tmp_path / "plain.png")
  compare.plot_accuracy([teachers], tmp_path / "teachers.png")
  drawn = [image.imread(tmp_path / name) for name in ("plain.png", "teachers.png")]
  assert drawn[0].shape == drawn[1].shape and not np.array_equal(*drawn)


def test_accuracy_figure_labels_name_what_differs_and_its_title_what_is_shared(runs):
  shared, labels = compare.accuracy_labels(runs)
  # FedAvg and a two-member Fed-ensemble of seed 3, FedAvg of seed 4.
  assert "ensemble_size=2" not in shared
  assert [("ensemble_size=2" in label) for label in labels] == [False, True, False]
  assert [label.endswith(f"(seed {seed})") for label, seed in zip(labels, (3, 3, 4))] == [True] * 3
  for run, label in zip(runs, labels):
    own = set(label.split()) & set(run.key_flags().split())
    assert own.isdisjoint(shared)
    assert own | set(shared) == set(run.key_flags().split())


def test_per_writer_accuracies_are_the_runs_and_its_models(run_dirs, runs, tmp_path):
  # Written by the run (per_client_accuracy.json), they average to its
  # summary's per_client_accuracy.
  accuracies = compare.per_writer_accuracies(runs[:2])
  for by_writer, path in zip(accuracies, run_dirs.values()):
    assert len(by_writer) == 105  # The slice's writers with training data.
    assert np.mean(list(by_writer.values())) == pytest.approx(
      read_summary(path)["per_client_accuracy"], abs=1e-6
    )
  # A run without the file (from before it existed): computed from its model
  # on its task's test writers, the same numbers.
  copy = tmp_path / "copy"
  shutil.copytree(run_dirs["fedavg"], copy)
  os.remove(copy / run_files.PER_CLIENT_ACCURACY_FILE)
  [computed] = compare.per_writer_accuracies([finished_runs.load_run(str(copy))])
  assert computed.keys() == accuracies[0].keys()
  for writer, accuracy in accuracies[0].items():
    assert computed[writer] == pytest.approx(accuracy, abs=1e-9), writer


def test_per_writer_accuracies_read_from_file_when_present(run_dirs, tmp_path):
  # A copy without models: the accuracies can only come from the file.
  for name in (run_files.SUMMARY_FILE, run_files.METRICS_FILE):
    shutil.copy(os.path.join(run_dirs["fedavg"], name), tmp_path)
  saved = {"f0001_01": 0.5, "f0002_02": 1.0}
  with open(tmp_path / run_files.PER_CLIENT_ACCURACY_FILE, "w") as f:
    json.dump(saved, f)
  run = finished_runs.load_run(str(tmp_path))
  assert compare.per_writer_accuracies([run]) == [saved]
  with pytest.raises(finished_runs.CompareError, match="has no model.keras"):
    run.model_paths()
  (tmp_path / run_files.PER_CLIENT_ACCURACY_FILE).write_text("[0.5, 1.0]")
  with pytest.raises(finished_runs.CompareError, match="not a JSON object"):
    compare.per_writer_accuracies([run])


def assert_png(path: str):
  with open(path, "rb") as f:
    assert f.read(8) == PNG_SIGNATURE
  assert os.path.getsize(path) > 20_000
  height, width, _ = image.imread(path).shape
  assert width >= 700 and height >= 500


def test_cli_prints_table_and_writes_both_figures(run_dirs, runs, tmp_path):
  output = tmp_path / "figures"
  result = run_module("tff_ens.compare", *run_dirs.values(), f"--output={output}")
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith(compare.table(runs) + "\n\n" + compare.seed_table(runs) + "\n")
  assert result.stderr == ""
  assert_png(output / compare.ACCURACY_FIGURE)
  assert_png(output / compare.PER_WRITER_FIGURE)


def test_cli_without_data_warns_and_skips_per_writer_figure(run_dirs, tmp_path):
  # A run from before per_client_accuracy.json: its writers' accuracies need
  # its data.
  old_run = tmp_path / "old_run"
  shutil.copytree(run_dirs["fedavg"], old_run)
  os.remove(old_run / run_files.PER_CLIENT_ACCURACY_FILE)
  output = tmp_path / "figures"
  result = run_module(
    "tff_ens.compare", str(old_run), f"--output={output}", f"--data_dir={tmp_path}/nowhere"
  )
  assert result.returncode == 0, result.stderr[-3000:]
  [warning] = result.stderr.splitlines()
  assert warning.startswith(f"warning: {compare.PER_WRITER_FIGURE} skipped: ")
  assert "nowhere" in warning
  assert_png(output / compare.ACCURACY_FIGURE)
  assert not (output / compare.PER_WRITER_FIGURE).exists()


def in_progress_copy(run_dir: str, path, rounds: list[int]) -> str:
  """`run_dir` as it was before its summary, with metrics of `rounds` only."""
  path.mkdir()
  shutil.copy(os.path.join(run_dir, run_files.CONFIG_FILE), path)
  row = read_metrics(run_dir)[0]
  with open(path / run_files.METRICS_FILE, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(row))
    writer.writeheader()
    writer.writerows({**row, "round": str(r)} for r in rounds)
  return str(path)


def test_in_progress_message_names_the_rounds(run_dirs, tmp_path):
  path = in_progress_copy(run_dirs["fedavg"], tmp_path / "run", [1, 2, 4])
  with pytest.raises(
    finished_runs.CompareError, match=r"rounds 1-2, 4 of 2 and it has no summary.json"
  ):
    finished_runs.load_run(path)


def test_bad_input_messages(tmp_path):
  with pytest.raises(finished_runs.CompareError, match="nowhere does not exist"):
    finished_runs.load_run(str(tmp_path / "nowhere"))
  (tmp_path / "notes.txt").write_text("not a run\n")
  with pytest.raises(
    finished_runs.CompareError, match="is not a run \\(no metrics.csv or summary.json\\)"
  ):
    finished_runs.load_run(str(tmp_path))


def test_cli_bad_input_is_one_line_and_exit_2(run_dirs, tmp_path):
  path = in_progress_copy(run_dirs["fedavg"], tmp_path / "run", [1])
  result = run_module("tff_ens.compare", run_dirs["fedavg"], path)
  assert result.returncode == 2
  [line] = result.stderr.splitlines()
  assert line.startswith(
    f"error: {path} is a run in progress (or stopped): its metrics.csv has round 1 of 2"
  ), line
  assert result.stdout == ""
