"""A run killed (SIGKILL) after a checkpoint and continued with --resume ends in the state an
uninterrupted run ends in, bit for bit: its final checkpoint, the clients' stored states,
metrics.csv and summary.json. For the algorithms whose round depends on more than the model
(clients' states, keyed members, walks), with McMahan et al.'s 2NN (`--model=mlp`) on the
FEMNIST slice, so that it runs in the default test set. (FedAvg's resumes exactly too:
`test_training`'s finished run continued to more rounds.)"""

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

from tests.femnist_runs import QUICK
from tests.femnist_runs import ROOT
from tests.femnist_runs import TIMINGS
from tests.femnist_runs import client_state_values
from tests.femnist_runs import read_metrics
from tests.femnist_runs import without_timings
from tff_ens import run_files
from tff_ens.program import training

# Three rounds, a checkpoint after the second, three clients a round of three local steps.
TINY = dataclasses.replace(
  QUICK,
  model="mlp",
  rounds=3,
  clients_per_round=3,
  client_steps=3,
  eval_every=3,
  checkpoint_every=2,
)


# What measures time, and the flags that differ between the two runs by design.
def _flags(config) -> list[str]:
  return [
    f"--{k}={v}"
    for k, v in dataclasses.asdict(config).items()
    if k not in ("output_dir", "resume") and v is not None
  ]


def _killed_after_round_2(config, output_dir):
  """The CLI run of `config` in `output_dir`, SIGKILLed once round 2 is checkpointed."""
  checkpoint = output_dir / run_files.CHECKPOINT_DIR / "round_2"
  process = subprocess.Popen(
    [sys.executable, "-m", "tff_ens.main", *_flags(config), f"--output_dir={output_dir}"],
    cwd=ROOT,
    start_new_session=True,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  deadline = time.time() + 300
  while not checkpoint.exists():
    if process.poll() is not None:
      pytest.fail(f"the run ended before it could be killed: {process.stderr.read()[-2000:]}")
    if time.time() > deadline:
      os.killpg(process.pid, signal.SIGKILL)
      pytest.fail("the run did not checkpoint round 2 in 300 s")
    time.sleep(0.05)
  os.killpg(process.pid, signal.SIGKILL)
  process.wait()
  if (output_dir / run_files.SUMMARY_FILE).exists():
    pytest.fail("killed too late: the run had finished")


def _checkpoint(output_dir, round_num: int) -> dict[str, np.ndarray]:
  """Every variable of the run's checkpoint of `round_num`, by name."""
  path = output_dir / run_files.CHECKPOINT_DIR / f"round_{round_num}" / "variables" / "variables"
  reader = tf.train.load_checkpoint(str(path))
  names = set(reader.get_variable_to_shape_map()) - {"_CHECKPOINTABLE_OBJECT_GRAPH"}
  return {name: reader.get_tensor(name) for name in names}


@pytest.mark.timeout_seconds(900)
@pytest.mark.parametrize(
  "algorithm, flags",
  [
    pytest.param("ditto", {}, id="ditto"),
    pytest.param("fedensemble", {"ensemble_size": 2}, id="fedensemble"),
    pytest.param("lg_fedavg", {}, id="lg_fedavg"),
    pytest.param("fedensemble", {"ensemble_size": 1, "local_objective": "feddyn"}, id="feddyn"),
    pytest.param("random_walk", {"ensemble_size": 2}, id="random_walk"),
  ],
)
def test_a_killed_run_resumes_to_the_uninterrupted_state_bit_for_bit(algorithm, flags, tmp_path):
  config = dataclasses.replace(TINY, algorithm=algorithm, **flags)
  training.run_experiment(dataclasses.replace(config, output_dir=str(tmp_path / "uninterrupted")))
  _killed_after_round_2(config, tmp_path / "killed")
  # Resumed in this process (the kill is the CLI's; a resume reads only the directory).
  training.run_experiment(
    dataclasses.replace(config, output_dir=str(tmp_path / "killed"), resume=True)
  )
  want, got = _checkpoint(tmp_path / "uninterrupted", 3), _checkpoint(tmp_path / "killed", 3)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
  want_states, got_states = (client_state_values(tmp_path / d) for d in ("uninterrupted", "killed"))
  assert sorted(got_states) == sorted(want_states)
  assert bool(want_states) == (algorithm in ("ditto", "lg_fedavg") or "local_objective" in flags)
  for name, value in want_states.items():
    np.testing.assert_array_equal(got_states[name], value, err_msg=name)
  if algorithm == "ditto":  # A personal model that trained ends with its lambda and 1.
    lambdas = {float(s[-2]) for s in got_states.values() if s[-1] == 1.0}
    assert lambdas and lambdas <= {float(np.float32(lam)) for lam in (0.1, 1.0, 2.0)}
  rows, want_rows = read_metrics(tmp_path / "killed"), read_metrics(tmp_path / "uninterrupted")
  assert [without_timings(r) for r in rows] == [without_timings(r) for r in want_rows]
  summary, got_summary = (
    json.loads((tmp_path / d / run_files.SUMMARY_FILE).read_text())
    for d in ("uninterrupted", "killed")
  )
  assert sorted(got_summary) == sorted(summary)
  for key, value in summary.items():
    if key not in TIMINGS and key != "config":
      assert got_summary[key] == value, key
