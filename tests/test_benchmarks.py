"""The round-time and memory benchmarks run against the current algorithm API: each at its
smallest size on the FEMNIST slice, its section written to a scratch results file with a
row per variant."""

import pathlib
import re
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.timeout_seconds(1800)]


def _run(script: str, results: pathlib.Path, *flags: str) -> str:
  subprocess.run(
    [sys.executable, f"benchmarks/{script}", f"--results={results}", *flags],
    cwd=REPO_ROOT,
    check=True,
    capture_output=True,
  )
  return results.read_text()


def test_ensemble_round_times_both_deliveries_and_the_client_states(tmp_path):
  text = _run(
    "ensemble_round.py",
    tmp_path / "results.md",
    "--rounds=1",
    "--warmup_rounds=2",
    "--passes=1",
    "--sizes=2",
    "--feddyn_sizes=2",
    "--places=worker",
    "--growth_mib=1024,0",
  )
  assert "| fedavg, state on the worker (CLI), copied after 1024 MiB of growth |" in text
  assert "| fedavg, state on the worker (CLI) |" in text
  assert "| state copied every N rounds | a copy's s: file / through Python |" in text
  assert "| fedensemble, K=2, select, state on the worker (CLI) |" in text
  assert "| fedensemble, K=2, broadcast, state on the worker (CLI) |" in text
  for transport in ("files", "values"):
    assert f"| fedensemble, K=2, FedDyn (states as {transport}), select, state on" in text
  assert "FedDyn's g) from Python to the clients" in text


def test_resident_memory_runs_a_one_model_and_a_server_data_algorithm(tmp_path):
  text = _run(
    "resident_memory.py",
    tmp_path / "results.md",
    "--rounds=1",
    "--algorithms=fedavg,fedbe",
    "--distill_steps=25",
  )
  # One row per algorithm (one transport for FedAvg, which moves nothing), each measured:
  # memory after the round, its peak and the driver's, and the round's seconds.
  for name in ("fedavg", "fedbe"):
    rows = [line for line in text.splitlines() if line.startswith(f"| {name} |")]
    assert rows, name
    for row in rows:
      after, worker_peak, driver_peak, seconds = (float(c) for c in row.split("|")[4:8])
      assert 0 < after <= worker_peak and driver_peak > 0 and seconds > 0, row


def test_cli_memory_measures_a_cli_run(tmp_path):
  text = _run(
    "cli_memory.py",
    tmp_path / "results.md",
    "--rounds=1",
    "--variants=fedavg",
    "--cli_flags=--clients_per_round=3",
  )
  assert "`python -m tff_ens.main --task=femnist --rounds=1 --clients_per_round=3`" in text
  (header,) = [line for line in text.splitlines() if line.startswith("| variant |")]
  (row,) = [line for line in text.splitlines() if line.startswith("| fedavg |")]
  assert row.count("|") == header.count("|")
  worker_peak, driver_peak, total_peak = (float(c) for c in row.split("|")[4:7])
  assert 0 < worker_peak < total_peak and 0 < driver_peak < total_peak
  assert total_peak <= worker_peak + driver_peak + 0.01  # Each printed to 0.01 GiB.
  # When the sum peaked: the rounds done then, and its two shares.
  rounds_done, shares = row.split("|")[7].split(":")
  worker_share, driver_share = (float(c) for c in shares.split("+"))
  assert int(rounds_done) in (0, 1)
  assert abs(worker_share + driver_share - total_peak) <= 0.02


def test_state_moves_moves_a_state_and_checks_it(tmp_path):
  # The script checks the downloaded state against the computation's closed form.
  text = _run("state_moves.py", tmp_path / "results.md", "--models=1", "--rounds=2")
  (row,) = [line for line in text.splitlines() if line.startswith("| 1 | 26 |")]
  assert all(float(c) > 0 for c in row.split("|")[3:8])


def test_worker_memory_runs_fedavg(tmp_path):
  text = _run(
    "worker_memory.py", tmp_path / "results.md", "--rounds=2", "--algorithm=fedavg", "--cohorts=2,3"
  )
  # One row per round, the cohorts cycling through --cohorts, each factory's worker measured.
  rows = [line.split("|")[1:5] for line in text.splitlines() if re.match(r"\| \d+ \| \d", line)]
  assert [(int(r), int(c)) for r, c, _, _ in rows] == [(1, 2), (2, 3)]
  assert all(float(a) > 0 and float(b) > 0 for _, _, a, b in rows)


def test_client_state_disk_counts_at_most_three_versions_per_client(tmp_path):
  text = _run(
    "client_state_disk.py",
    tmp_path / "results.md",
    "--rounds=6",
    "--checkpoint_every=2",
    "--timed=2",
    f"--state_dir={tmp_path}",
  )
  rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| 105 |")]
  assert [int(r[2]) for r in rows] == [1, 5]
  for row in rows:
    pairs = int(row[3].split(" of ")[0].replace(",", ""))
    end, peak = (int(row[i].replace(",", "")) for i in (4, 6))
    assert 0 < pairs <= end <= peak <= 3 * pairs
