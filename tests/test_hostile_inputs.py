"""Hostile and broken inputs: each is a one-line error, nothing lost.

A real run (FedAvg, LEAF CNN, one round) is written first, on a small LEAF
directory of real FEMNIST writers. Then its data, its output directory or its
checkpoints are damaged and the run is resumed. Every case must end in one
line naming the file or flag and the fix (`error: ...` and exit code 2 from
the CLI, without a traceback), and leave every file of the earlier run
byte-for-byte as it was.

Every case runs in-process (`training.run_experiment` stops at the data,
before any TFF computation); a representative few also go through the CLI
(`python -m tff_ens.main`, ~15 s each for the imports): a truncated file,
--data_dir naming a file, an unwritable --output_dir (not as root, who may
write anywhere) and another algorithm's checkpoint. tests/test_femnist.py
checks the loader's messages on hand-written files; this suite checks what a
run does with them.
"""

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import weakref

import numpy as np
import pytest

import tasks
from tests.femnist_runs import DATA_DIR
from tests.femnist_runs import ROOT
from tff_ens import run_files
from tff_ens.program import experiment
from tff_ens.program import run_outputs
from tff_ens.program import training

# Real writers for the small LEAF directory: three and two writers in two
# train files, their test examples, and one writer with test data only.
SOURCE_TRAIN = "all_data_5_niid_05_keep_0_train_9.json"
SOURCE_TEST = "all_data_5_niid_05_keep_0_test_9.json"
SOURCE_NEW_CLIENTS = "all_data_11_niid_05_keep_0_test_9.json"
EXAMPLES_PER_WRITER = 40
TRAIN_A = "train/all_data_0_niid_05_keep_0_train_9.json"
TRAIN_B = "train/all_data_1_niid_05_keep_0_train_9.json"
TEST_A = "test/all_data_0_niid_05_keep_0_test_9.json"
TEST_B = "test/all_data_1_niid_05_keep_0_test_9.json"


def _real(split: str, name: str) -> dict:
  return json.loads((pathlib.Path(DATA_DIR) / split / name).read_text())


def _subset(content: dict, writers) -> dict:
  """A LEAF object of `writers` of `content`, their first examples."""
  data = {
    w: {k: content["user_data"][w][k][:EXAMPLES_PER_WRITER] for k in ("x", "y")} for w in writers
  }
  return {
    "users": list(writers),
    "num_samples": [len(data[w]["y"]) for w in writers],
    "user_data": data,
  }


def write_leaf(root: pathlib.Path) -> pathlib.Path:
  """A LEAF femnist directory of six real writers (see the top)."""
  train, test = _real("train", SOURCE_TRAIN), _real("test", SOURCE_TEST)
  new = _real("test", SOURCE_NEW_CLIENTS)
  files = {
    TRAIN_A: _subset(train, train["users"][:3]),
    TRAIN_B: _subset(train, train["users"][3:]),
    TEST_A: _subset(test, test["users"]),
    TEST_B: _subset(new, new["users"][:1]),
  }
  for name, content in files.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(json.dumps(content))
  return root


def snapshot(directory) -> dict[str, str]:
  """Relative path -> SHA-256 of every file under `directory`."""
  directory = pathlib.Path(directory)
  return {
    str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
    for p in sorted(directory.rglob("*"))
    if p.is_file()
  }


def run_cli(config: experiment.ExperimentConfig, *extra: str):
  """`python -m tff_ens.main` with the flags of `config`, then `extra`."""
  flags = [
    f"--{k}={v}" for k, v in dataclasses.asdict(config).items() if v is not None and k != "resume"
  ]
  return subprocess.run(
    [sys.executable, "-m", "tff_ens.main", *flags, *extra],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )


def cli_error(result) -> str:
  """The one `error: ` line of a failed CLI run (exit 2, no traceback)."""
  assert result.returncode == 2, result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: "), result.stderr[-3000:]
  return last


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory):
  """The config of a finished run, whose outputs every case must keep."""
  root = tmp_path_factory.mktemp("hostile")
  data_dir = write_leaf(root / "leaf")
  shutil.copytree(data_dir, root / "pristine")
  config = experiment.ExperimentConfig(
    data_dir=str(data_dir),
    output_dir=str(root / "run"),
    rounds=1,
    clients_per_round=2,
    eval_every=1,
    checkpoint_every=1,
  )
  training.run_experiment(config)
  return config


@contextlib.contextmanager
def damaged_data(config: experiment.ExperimentConfig, damage):
  """The run's data directory after `damage(path)`; restored afterwards."""
  data_dir = pathlib.Path(config.data_dir)
  try:
    damage(data_dir)
    yield
  finally:
    if data_dir.is_dir():
      shutil.rmtree(data_dir)
    else:
      data_dir.unlink()
    shutil.copytree(data_dir.with_name("pristine"), data_dir)


def _edit(name: str, change):
  """Damage: `change(leaf object)` applied to the file `name`."""

  def damage(root):
    content = json.loads((root / name).read_text())
    change(content)
    (root / name).write_text(json.dumps(content))

  return damage


def _replace(name: str, data: bytes):
  def damage(root):
    (root / name).write_bytes(data)

  return damage


def _truncate(name: str):
  def damage(root):
    content = (root / name).read_bytes()
    (root / name).write_bytes(content[: len(content) // 2])

  return damage


def _first(content) -> dict:
  return content["user_data"][content["users"][0]]


def _no_examples(content):
  for writer in content["users"]:
    content["user_data"][writer] = {"x": [], "y": []}
  content["num_samples"] = [0] * len(content["users"])


def _every_train_writer_without_examples(root):
  _edit(TRAIN_A, _no_examples)(root)
  _edit(TRAIN_B, _no_examples)(root)


def _copy_writer(source: str, target: str):
  """Damage: the first writer of `source` also in `target`."""

  def damage(root):
    copied = json.loads((root / source).read_text())
    writer = copied["users"][0]

    def add(content):
      content["users"].append(writer)
      content["num_samples"].append(copied["num_samples"][0])
      content["user_data"][writer] = copied["user_data"][writer]

    _edit(target, add)(root)

  return damage


def _set(key, value):
  return lambda content: content.__setitem__(key, value)


def _set_first(key, value):
  return lambda content: _first(content).__setitem__(key, value)


def _set_pixel(value):
  return lambda content: _first(content)["x"][1].__setitem__(7, value)


def _set_label(value):
  return lambda content: _first(content)["y"].__setitem__(2, value)


def _list_first_writer_twice(content):
  content["users"].append(content["users"][0])
  content["num_samples"].append(content["num_samples"][0])


# name -> (damage, what the message must hold). `{data}` is the data dir.
DATA_CASES = {
  "empty file": (_replace(TRAIN_A, b""), [f"{{data}}/{TRAIN_A}: empty", "copy it again"]),
  "truncated file": (
    _truncate(TEST_A),
    [f"{{data}}/{TEST_A}: not valid JSON", "truncated", "copy it again or regenerate it with LEAF"],
  ),
  "not JSON": (
    _replace(TRAIN_B, b"<html>503 Service Unavailable</html>"),
    [f"{{data}}/{TRAIN_B}: not valid JSON", "copy it again"],
  ),
  "not UTF-8": (
    _replace(TRAIN_B, b'{"users": ["f\xe9\xff"]}'),
    [f"{{data}}/{TRAIN_B}: not UTF-8 text", "copy it again"],
  ),
  "a directory named .json": (
    lambda root: (root / "train/extra.json").mkdir(),
    ["{data}/train/extra.json: cannot be read (Is a directory)", "move it out of the directory"],
  ),
  "every writer without examples": (
    _every_train_writer_without_examples,
    ["{data}/train: no writer in its *.json files has examples", "copy LEAF's train files into it"],
  ),
  "pixel rows of 783": (
    _edit(TRAIN_A, lambda c: _first(c)["x"].__setitem__(0, _first(c)["x"][0][:783])),
    [f"{{data}}/{TRAIN_A}: writer 'f2062_39'", "784 numbers", "regenerate the file with LEAF"],
  ),
  "pixel rows of 785": (
    _edit(TRAIN_A, lambda c: _first(c).__setitem__("x", [row + [1.0] for row in _first(c)["x"]])),
    [
      f"{{data}}/{TRAIN_A}: writer 'f2062_39'",
      "784 values",
      "[40, 785]",
      "regenerate the file with LEAF",
    ],
  ),
  "label 62": (
    _edit(TEST_A, _set_label(62)),
    [
      f"{{data}}/{TEST_A}: writer 'f2062_39'",
      "labels must be integers in 0..61, found [62]",
      "regenerate the file with LEAF",
    ],
  ),
  "label -1": (
    _edit(TRAIN_B, _set_label(-1)),
    [f"{{data}}/{TRAIN_B}: writer 'f1640_48'", "found [-1]"],
  ),
  "label beyond int64": (
    _edit(TRAIN_A, _set_label(10**30)),
    [f"{{data}}/{TRAIN_A}: writer 'f2062_39'", "labels must be integers in 0..61"],
  ),
  "NaN pixel": (
    _edit(TRAIN_A, _set_pixel(float("nan"))),
    [f"{{data}}/{TRAIN_A}: writer 'f2062_39': NaN pixel", "regenerate the file with LEAF"],
  ),
  "pixel null": (
    _edit(TRAIN_A, _set_pixel(None)),
    [
      f"{{data}}/{TRAIN_A}: writer 'f2062_39'",
      "pixel values must be numbers in [0, 1], found None",
    ],
  ),
  "pixel as text": (
    _edit(TEST_B, _set_pixel("0.5")),
    [f"{{data}}/{TEST_B}: writer", "found '0.5'"],
  ),
  "x null": (
    _edit(TRAIN_A, _set_first("x", None)),
    [f"{{data}}/{TRAIN_A}: writer 'f2062_39'", "x and y must be lists, found NoneType and list"],
  ),
  "users a string": (
    _edit(TRAIN_A, _set("users", "f2062_39")),
    [f"{{data}}/{TRAIN_A}: users and num_samples must be lists", "regenerate the file with LEAF"],
  ),
  "user_data null": (
    _edit(TRAIN_A, _set("user_data", None)),
    [f"{{data}}/{TRAIN_A}: users and num_samples must be lists and user_data an object"],
  ),
  "num_samples 40.0": (
    _edit(TRAIN_A, _set("num_samples", [40.0] * 3)),
    [f"{{data}}/{TRAIN_A}: writer 'f2062_39': num_samples entry 40.0 is not an integer"],
  ),
  "writer id a number": (
    _edit(TRAIN_A, lambda c: c["users"].__setitem__(0, 2062)),
    [f"{{data}}/{TRAIN_A}: users must be writer id strings, found 2062"],
  ),
  "writer listed twice": (
    _edit(TRAIN_A, _list_first_writer_twice),
    [f"{{data}}/{TRAIN_A}: writer 'f2062_39' is listed more than once in users"],
  ),
  "users shorter than num_samples": (
    _edit(TRAIN_A, lambda c: c["users"].pop()),
    [f"{{data}}/{TRAIN_A}: 2 users but 3 num_samples entries"],
  ),
  "writer only in user_data": (
    _edit(TRAIN_A, lambda c: (c["users"].pop(), c["num_samples"].pop())),
    [f"{{data}}/{TRAIN_A}: user_data holds writer(s) missing from users ('f1667_29')"],
  ),
  "duplicate writer across train files": (
    _copy_writer(TRAIN_A, TRAIN_B),
    [
      "writer 'f2062_39' appears in two train files",
      f"{{data}}/{TRAIN_A} and {{data}}/{TRAIN_B}",
      "remove one of the copies",
    ],
  ),
  "duplicate writer across test files": (
    _copy_writer(TEST_B, TEST_A),
    ["appears in two test files", "remove one of the copies"],
  ),
  "data_dir is a file": (
    lambda root: (shutil.rmtree(root), root.write_text("a file")),
    [
      "FEMNIST data directory {data} is not a directory",
      "pass a LEAF femnist directory with train/ and test/",
    ],
  ),
}
# Through the CLI as well: a damaged file and a bad flag.
CLI_DATA_CASES = ("truncated file", "data_dir is a file")


@pytest.mark.parametrize("case", DATA_CASES)
def test_damaged_data_is_a_one_line_error_and_keeps_the_run(previous_run, case):
  damage, expected = DATA_CASES[case]
  before = snapshot(previous_run.output_dir)
  with damaged_data(previous_run, damage):
    with pytest.raises(tasks.DataError) as error:
      training.run_experiment(dataclasses.replace(previous_run, resume=True))
  message = str(error.value)
  assert "\n" not in message
  for part in expected:
    assert part.format(data=previous_run.data_dir) in message, message
  assert snapshot(previous_run.output_dir) == before


def test_writer_without_examples_is_skipped_with_a_warning(previous_run, caplog):
  def empty_first_writer(content):
    _first(content).update(x=[], y=[])
    content["num_samples"][0] = 0

  writers = tasks.femnist.load_data(previous_run.data_dir).train.client_ids
  with damaged_data(previous_run, _edit(TRAIN_A, empty_first_writer)):
    with caplog.at_level(logging.WARNING):
      data = tasks.femnist.load_data(previous_run.data_dir)
  assert "f2062_39" in writers
  assert set(data.train.client_ids) == set(writers) - {"f2062_39"}
  warning = caplog.records[-1].getMessage()
  assert warning == (
    f"{previous_run.data_dir}/{TRAIN_A}: skipping 1 writer(s) without examples (f2062_39)"
  )


@pytest.mark.slow
@pytest.mark.parametrize("case", CLI_DATA_CASES)
def test_cli_with_damaged_data(previous_run, case):
  damage, expected = DATA_CASES[case]
  before = snapshot(previous_run.output_dir)
  with damaged_data(previous_run, damage):
    line = cli_error(run_cli(previous_run, "--resume"))
  for part in expected:
    assert part.format(data=previous_run.data_dir) in line, line
  assert snapshot(previous_run.output_dir) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_cli_unwritable_output_dir(previous_run):
  before = snapshot(previous_run.output_dir)
  os.chmod(previous_run.output_dir, 0o500)
  try:
    line = cli_error(run_cli(previous_run, "--resume"))
  finally:
    os.chmod(previous_run.output_dir, 0o755)
  assert line == (
    f"error: cannot write to --output_dir="
    f"{previous_run.output_dir} (Permission denied): choose a "
    "writable directory"
  )
  assert snapshot(previous_run.output_dir) == before


def test_output_dir_inside_a_file(previous_run, tmp_path):
  # What root meets too: the directory cannot be created.
  (tmp_path / "notes.txt").write_text("keep me")
  output_dir = tmp_path / "notes.txt" / "run"
  with pytest.raises(experiment.UsageError) as error:
    training.run_experiment(dataclasses.replace(previous_run, output_dir=str(output_dir)))
  assert str(error.value) == (
    f"cannot write to --output_dir={output_dir} (Not a directory): choose a writable directory"
  )
  assert (tmp_path / "notes.txt").read_text() == "keep me"


def _run_with_copied_checkpoints(previous_run, tmp_path, **change):
  """A run dir of `change`d flags holding `previous_run`'s checkpoints.

  As if its config.json were edited by hand: the config check passes, the
  checkpoint does not fit.
  """
  config = dataclasses.replace(previous_run, output_dir=str(tmp_path / "run"), **change)
  shutil.copytree(previous_run.output_dir, config.output_dir)
  (tmp_path / "run" / run_files.CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(config)))
  return config


def _mismatch_message(output_dir, algorithm, model, mismatch="its nesting differs") -> str:
  return (
    f"checkpoint {output_dir}/{run_files.CHECKPOINT_DIR}/"
    f"{run_files.CHECKPOINT_PREFIX}1 does not fit the state of "
    f"--algorithm={algorithm} --model={model} ({mismatch}): another run, or a version of "
    "tff-ens with another state layout, wrote it; restore this run's own checkpoints, or "
    "choose a new --output_dir"
  )


@pytest.mark.slow
def test_cli_checkpoint_of_another_algorithm(previous_run, tmp_path):
  # FedAvgM's server keeps a momentum buffer that FedAvg's state has not.
  config = _run_with_copied_checkpoints(previous_run, tmp_path, algorithm="fedavgm")
  before = snapshot(config.output_dir)
  line = cli_error(run_cli(config, "--resume"))
  assert line == f"error: {_mismatch_message(config.output_dir, config.algorithm, config.model)}"
  assert snapshot(config.output_dir) == before


def test_checkpoint_of_another_model(previous_run, tmp_path):
  config = _run_with_copied_checkpoints(
    previous_run, tmp_path, model="cnn_ppd_student", resume=True
  )
  before = snapshot(config.output_dir)
  with pytest.raises(experiment.UsageError) as error:
    training.run_experiment(config)
  assert str(error.value) == _mismatch_message(config.output_dir, config.algorithm, config.model)
  assert snapshot(config.output_dir) == before


# Checkpoints of the same nesting, and the run's config.json, through the
# run's outputs (`run_outputs.RunOutputs`) with small states.

STATE = {
  "bias": np.zeros([3], np.float32),
  "kernel": np.ones([2, 3], np.float32),
  "round": np.int32(4),
}


def _outputs(output_dir, state):
  return run_outputs.RunOutputs(
    experiment.resolve(
      experiment.ExperimentConfig(output_dir=str(output_dir), resume=True)
    ).outputs,
    state,
  )


def test_outputs_let_the_initial_state_go_once_the_run_took_it(tmp_path):
  kernel = np.ones([2, 3], np.float32)
  outputs = _outputs(tmp_path, {**STATE, "kernel": kernel})
  taken = weakref.ref(kernel)
  del kernel
  gc.collect()
  assert taken() is not None
  assert outputs.take_start()[0] == 0
  gc.collect()
  assert taken() is None  # The run holds its state on the worker, not twice here.
  outputs.close()


@pytest.fixture
def saved_state(tmp_path):
  """An output dir whose round-1 checkpoint holds STATE + 1."""
  outputs = _outputs(tmp_path, STATE)
  outputs.save_checkpoint(1, {k: v + np.ones_like(v) for k, v in STATE.items()})
  outputs.close()
  return tmp_path


def test_checkpoint_that_fits_is_resumed(saved_state):
  outputs = _outputs(saved_state, STATE)
  round_num, state = outputs.take_start()
  assert outputs.take_start() is None  # Given once, then let go.
  outputs.close()
  assert round_num == 1
  for key, value in STATE.items():
    np.testing.assert_array_equal(state[key], value + 1)
    assert state[key].dtype == value.dtype


@pytest.mark.parametrize(
  "state, mismatch",
  [
    (
      {**STATE, "kernel": np.ones([2, 5], np.float32)},
      "tensor 1 is float32 [2, 3] where this run has float32 [2, 5]",
    ),
    (
      {**STATE, "bias": np.zeros([3], np.int32)},
      "tensor 0 is float32 [3] where this run has int32 [3]",
    ),
    ({**STATE, "momentum": np.zeros([3], np.float32)}, "its nesting differs"),
  ],
)
def test_checkpoint_that_does_not_fit_is_refused(saved_state, state, mismatch):
  before = snapshot(saved_state)
  with pytest.raises(experiment.UsageError) as error:
    _outputs(saved_state, state)
  assert str(error.value) == _mismatch_message(saved_state, "fedavg", "cnn", mismatch)
  assert snapshot(saved_state) == before


def test_unreadable_checkpoint_is_refused(saved_state):
  variables = saved_state / "checkpoints/round_1/variables"
  for path in variables.iterdir():
    path.write_bytes(b"")
  before = snapshot(saved_state)
  with pytest.raises(experiment.UsageError) as error:
    _outputs(saved_state, STATE)
  message = str(error.value)
  assert message.startswith(f"cannot read checkpoint {saved_state}/checkpoints/round_1 (")
  assert message.endswith(
    "): delete it to resume from the one before it, or choose a new --output_dir"
  )
  assert "\n" not in message
  assert snapshot(saved_state) == before


@pytest.mark.parametrize("content", [b"", b'{"rounds": 1', b"[1, 2]", b"\xff\xfe"])
def test_damaged_config_json_is_refused(saved_state, content):
  (saved_state / run_files.CONFIG_FILE).write_bytes(content)
  before = snapshot(saved_state)
  with pytest.raises(experiment.UsageError) as error:
    _outputs(saved_state, STATE)
  assert str(error.value) == (
    f"{saved_state}/config.json is not a run's config (a JSON object of "
    "its flags): restore it, or choose a new --output_dir"
  )
  assert snapshot(saved_state) == before
