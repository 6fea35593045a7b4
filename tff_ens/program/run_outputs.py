"""Writing a run's output directory: config, metrics, checkpoints and final models.

`RunOutputs` writes `config.json` (refusing a directory that holds another run),
`metrics.csv` (one row per round), TensorBoard events under `tensorboard/` and
checkpoints under `checkpoints/` (`tff.program.FileProgramStateManager`, written
atomically), and reads the checkpoint a `--resume` continues from. `save_models` writes
the final model(s) in Keras format. File names are in `run_files`.
"""

import asyncio
import csv
import gc
import json
import logging
import os
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import run_files
from tff_ens.math import evaluation
from tff_ens.program import experiment
from tff_ens.program import run_settings


class RunOutputs:
  """The run's files: config, metrics (CSV and TensorBoard), checkpoints."""

  def __init__(self, config: run_settings.Outputs, initial_state):
    """`initial_state`: the algorithm's, which `take_start` gives unless `--resume` finds a
    checkpoint (read against its structure here)."""
    self.dir = config.directory
    self._loop = asyncio.new_event_loop()
    self._start = (0, initial_state)
    self._prepare_dir(config, initial_state)
    self._curves = self._read_curves()
    self._checkpoints = tff.program.FileProgramStateManager(
      os.path.join(self.dir, run_files.CHECKPOINT_DIR),
      prefix=run_files.CHECKPOINT_PREFIX,
      keep_total=2,
      keep_first=False,
    )
    self._csv = tff.program.CSVFileReleaseManager(
      os.path.join(self.dir, run_files.METRICS_FILE),
      save_mode=tff.program.CSVSaveMode.WRITE,
      key_fieldname="round",
    )
    self._tensorboard = tff.program.TensorBoardReleaseManager(
      os.path.join(self.dir, run_files.TENSORBOARD_DIR)
    )

  def _prepare_dir(self, config: run_settings.Outputs, initial_state):
    if os.path.exists(self.dir) and not os.path.isdir(self.dir):
      raise experiment.UsageError(f"--output_dir={self.dir} is a file: choose a directory")
    config_path = os.path.join(self.dir, run_files.CONFIG_FILE)
    fixed_rounds = config.fixed_rounds_reason
    free = experiment.RESUME_FREE_KEYS + (() if fixed_rounds else ("rounds",))
    wanted = {k: v for k, v in config.flags.items() if k not in free}
    if os.path.exists(config_path):
      try:
        with open(config_path, "rb") as f:
          saved = json.load(f)
      except (OSError, ValueError):  # Unreadable, not UTF-8 or not JSON.
        saved = None
      if not isinstance(saved, dict):
        raise experiment.UsageError(
          f"{config_path} is not a run's config (a JSON object of its "
          "flags): restore it, or choose a new --output_dir"
        )
      saved = {k: v for k, v in experiment.saved_config(saved).items() if k not in free}
      if saved:
        # A flag added after the run started takes its default there.
        saved = {**{k: experiment.FLAG_DEFAULTS[k] for k in wanted}, **saved}
      if saved != wanted:
        changed = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
        why = f"; --rounds stays: {fixed_rounds}" if "rounds" in changed else ""
        raise experiment.UsageError(
          f"--output_dir={self.dir} holds a different run (it has "
          f"{' '.join(f'--{k}={saved.get(k)}' for k in changed)}{why}): pass "
          "those flags to continue it, or choose a new --output_dir"
        )
    checkpoints = os.path.join(self.dir, run_files.CHECKPOINT_DIR)
    started = os.path.isdir(checkpoints) and any(
      name.startswith(run_files.CHECKPOINT_PREFIX) for name in os.listdir(checkpoints)
    )
    if started and not config.resume:
      raise experiment.UsageError(
        f"--output_dir={self.dir} already holds this run: pass --resume "
        "to continue it, or choose a new --output_dir"
      )
    if started:
      # Read before anything is written: a checkpoint that does not fit
      # leaves the directory as it was.
      resumed = self._read_checkpoint(checkpoints, config, initial_state)
      if resumed is not None:
        logging.info("resuming from round %d", resumed[0])
        self._start = resumed
    try:
      os.makedirs(self.dir, exist_ok=True)
      run_files.write_json_atomically(config_path, config.flags)
    except OSError as e:
      raise experiment.UsageError(
        f"cannot write to --output_dir={self.dir} ({e.strerror}): choose a writable directory"
      ) from None

  def _read_checkpoint(
    self, directory: str, config: run_settings.Outputs, initial_state
  ) -> tuple[int, Any] | None:
    """(round, state) of the last checkpoint in `directory`, or None.

    Raises UsageError, naming the checkpoint, if it cannot be read or its
    state does not have this run's structure, shapes and dtypes (e.g.
    checkpoints copied from another run, or a config.json edited by hand).
    """
    manager = tff.program.FileProgramStateManager(directory, prefix=run_files.CHECKPOINT_PREFIX)
    versions = self._loop.run_until_complete(manager.get_versions())
    if not versions:
      return None
    path = os.path.join(directory, f"{run_files.CHECKPOINT_PREFIX}{versions[-1]}")
    try:
      structure = {"round": 0, "state": initial_state}
      saved = self._loop.run_until_complete(manager.load(versions[-1], structure))
    except (ValueError, TypeError):  # The nesting differs.
      mismatch = "its nesting differs"
    except (tf.errors.OpError, OSError) as e:
      raise experiment.UsageError(
        f"cannot read checkpoint {path} ({' '.join(str(e).split())[:200]})"
        ": delete it to resume from the one before it, or choose a new "
        "--output_dir"
      ) from None
    else:
      mismatch = state_mismatch(initial_state, saved["state"])
      if mismatch is None:
        if int(saved["round"]) > config.rounds:
          raise experiment.UsageError(
            f"checkpoint {path} is of round {int(saved['round'])}, past --rounds="
            f"{config.rounds}: pass --rounds={int(saved['round'])} or more"
          )
        return int(saved["round"]), saved["state"]
    raise experiment.UsageError(
      f"checkpoint {path} does not fit the state of --algorithm="
      f"{config.algorithm} --model={config.model} ({mismatch}): another "
      "run, or a version of tff-ens with another state layout, wrote it; restore this "
      "run's own checkpoints, or choose a new --output_dir"
    )

  def take_start(self) -> tuple[int, Any]:
    """(round, state) the run continues from: the last checkpoint with `--resume` (read and
    checked when the outputs were opened, before anything was written), else (0, the
    initial state). Given once: the outputs then let it go, so that a state the run has
    moved on from is not kept for the whole run."""
    start, self._start = self._start, None
    return start

  def checkpoint_rounds(self) -> list[int]:
    """The rounds of the checkpoints kept, ascending: a `--resume` starts from the newest, or
    from the one before it when the newest is deleted as unreadable."""
    return list(self._loop.run_until_complete(self._checkpoints.get_versions()))

  def resume_hint(self) -> str:
    """Where a stopped run continues from: its last checkpoint, if any."""
    versions = self._loop.run_until_complete(self._checkpoints.get_versions())
    if not versions:
      return f"No round of --output_dir={self.dir} was checkpointed: run it again"
    return (
      f"The run's last checkpoint is round {versions[-1]}: rerun with "
      "--resume (on the same or other --workers) to continue from it"
    )

  def save_checkpoint(self, round_num: int, state):
    self._loop.run_until_complete(
      self._checkpoints.save({"round": round_num, "state": state}, round_num)
    )
    # TFF's writer (`tf.saved_model.save` of the state made variables) leaves that copy of
    # the state in reference cycles, which a long run's driver frees only at Python's rare
    # full collections: one state more for every checkpoint until then (benchmarks/
    # RESULTS.md, "The driver's memory across evaluations and checkpoints").
    gc.collect()

  def release_metrics(self, round_num: int, row: dict):
    async def release():
      await asyncio.gather(
        self._csv.release(row, key=round_num), self._tensorboard.release(row, key=round_num)
      )

    self._loop.run_until_complete(release())

  def release_curves(self, round_num: int, curves: dict):
    """Adds the round's learning curves (name: [[step, value], ...]) to `CURVES_FILE`, a JSON
    object keyed by round, rewritten atomically; rounds from `round_num` on (left by a run
    that resumes from an earlier checkpoint) are replaced."""
    self._curves = {r: c for r, c in self._curves.items() if int(r) < round_num}
    if curves:
      self._curves[str(round_num)] = curves
    path = os.path.join(self.dir, run_files.CURVES_FILE)
    if self._curves or os.path.exists(path):
      run_files.write_json_atomically(path, self._curves)

  def _read_curves(self) -> dict:
    """The curves an earlier attempt of this run wrote, or {}."""
    path = os.path.join(self.dir, run_files.CURVES_FILE)
    if not os.path.exists(path):
      return {}
    try:
      with open(path) as f:
        curves = json.load(f)
      if isinstance(curves, dict) and all(r.isdigit() for r in curves):
        return curves
    except (OSError, ValueError):
      pass
    raise experiment.UsageError(
      f"{path} is not a run's learning curves (a JSON object keyed by round): restore or "
      "delete it, or choose a new --output_dir"
    )

  def metrics_rows(self) -> list[dict]:
    with open(os.path.join(self.dir, run_files.METRICS_FILE)) as f:
      return list(csv.DictReader(f))

  def close(self):
    self._loop.close()


def state_mismatch(expected, loaded) -> str | None:
  """The first tensor of `loaded` whose shape or dtype is not `expected`'s.

  Both are process states of one nesting; None if every tensor matches.
  """
  for i, (want, got) in enumerate(zip(tf.nest.flatten(expected), tf.nest.flatten(loaded))):
    want, got = np.asarray(want), np.asarray(got)
    if (want.shape, want.dtype) != (got.shape, got.dtype):
      return (
        f"tensor {i} is {got.dtype} {list(got.shape)} where this run "
        f"has {want.dtype} {list(want.shape)}"
      )
  return None


def save_models(output_dir: str, model: tf.keras.Model, models: list):
  """Saves the final model(s): `model.keras`, or `members/member_k.keras`."""
  if len(models) == 1:
    paths = [os.path.join(output_dir, run_files.MODEL_FILE)]
  else:
    os.makedirs(os.path.join(output_dir, run_files.MEMBERS_DIR), exist_ok=True)
    paths = [
      os.path.join(output_dir, run_files.MEMBERS_DIR, run_files.member_file(k))
      for k in range(len(models))
    ]
  for weights, path in zip(models, paths):
    save_model(path, model, weights)


def save_model(path: str, model: tf.keras.Model, weights):
  """Saves `model` with `weights` to `path` (.keras) atomically."""
  evaluation.assign_weights(model, weights)
  tmp = path[: -len(".keras")] + ".tmp.keras"
  model.save(tmp)
  os.replace(tmp, path)
