"""A trained run as `tff_ens.main` writes it: config, summary and Keras model(s).

`model.keras` for one model, `members/member_k.keras` for an ensemble (file names from
`tff_ens.run_files`), with `config.json` and `summary.json` beside them. Reading a run needs
no TensorFlow (the device environment reads runs too); `task` and `load_models` import it.
"""

import dataclasses
import json
import os
import types

from export import ExportError
import tasks
from tasks import partition as partition_lib
from tff_ens import run_files
from tff_ens import settings


@dataclasses.dataclass(frozen=True)
class Run:
  """A run directory's files.

  Attributes:
    run_dir: the directory.
    config: config.json (the run's `ExperimentConfig`).
    summary: summary.json (its final metrics).
    model_paths: `model.keras`, or the K ensemble members in order.
  """

  run_dir: str
  config: dict
  summary: dict
  model_paths: tuple[str, ...]

  @property
  def is_ensemble(self) -> bool:
    return len(self.model_paths) > 1

  @property
  def task_name(self) -> str:
    """`--task` (its default where config.json predates the flag)."""
    return self.config.get("task", tasks.DEFAULT_TASK)

  @property
  def classes(self) -> str:
    """`--classes` (its default where config.json predates the flag)."""
    return self.config.get("classes", tasks.DEFAULT_CLASSES)

  @property
  def task(self):
    return tasks.get_task(self.task_name, self.classes)

  @property
  def is_binary(self) -> bool:
    return self.config.get("model") in getattr(self.task, "BINARY_MODEL_NAMES", ())

  def load_models(self) -> list:
    """The Keras model(s), un-compiled (larq's layers are registered by importing tasks)."""
    import tensorflow as tf

    return [tf.keras.models.load_model(p, compile=False) for p in self.model_paths]

  def data_options(self, task) -> dict:
    """The keyword arguments of `task.load_data` that make the run's split: its partition
    (`PartitionConfig.for_task`), seed and task settings (`tasks.task_settings`), from
    config.json, where a flag it lacks takes its declared default (and the seed
    `load_data`'s). `task` is the run's task, or without TensorFlow a module with its
    DEFAULT_PARTITION and SERVER_EXAMPLES (`tasks.plays`)."""
    options = {
      "partition": self._settings(partition_lib.PartitionConfig).for_task(
        task.DEFAULT_PARTITION, task.SERVER_EXAMPLES
      )
    }
    if "seed" in self.config:
      options["seed"] = self.config["seed"]
    group = tasks.task_settings(self.task_name)
    if group is not None:
      options["config"] = self._settings(group)
    return options

  def _settings(self, group: type):
    """`group` resolved from config.json's flags (declared defaults for those it lacks)."""
    fields = {**settings.flags_of(group), **settings.uses_of(group)}
    given = {flag: self.config.get(flag, field.default) for flag, field in fields.items()}
    try:
      return settings.resolve(group, types.SimpleNamespace(**given))
    except settings.SettingError as e:
      raise ExportError(f"{self.run_dir}'s {run_files.CONFIG_FILE}: {e}") from None


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ExportError(
      f"{path} cannot be read ({type(e).__name__}: {e}); is the run complete?"
    ) from None


def load_run(run_dir: str, client: str | None = None) -> Run:
  """Reads `run_dir`; ExportError (one line) if it is not a finished `tff_ens.main` run.

  With `client`, its model is that client's own (`clients/<client>.keras`, written by an
  algorithm whose clients keep one).
  """
  if not os.path.isdir(run_dir):
    raise ExportError(
      f"--run_dir={run_dir} is not a directory: pass the --output_dir of a "
      "finished `python -m tff_ens.main` run"
    )
  members_dir = os.path.join(run_dir, run_files.MEMBERS_DIR)
  numbered = [
    (int(m.group(1)), os.path.join(members_dir, m.group(0)))
    for name in (os.listdir(members_dir) if os.path.isdir(members_dir) else ())
    if (m := run_files.MEMBER_FILE_PATTERN.fullmatch(name))
  ]
  members = [path for _, path in sorted(numbered)]
  single = os.path.join(run_dir, run_files.MODEL_FILE)
  if not members and not os.path.isfile(single):
    raise ExportError(
      f"--run_dir={run_dir} has no model ({run_files.MODEL_FILE} or "
      f"{run_files.MEMBERS_DIR}/member_k.keras): pass a finished `python -m "
      "tff_ens.main` run (models are saved after the last round)"
    )
  config = _read_json(os.path.join(run_dir, run_files.CONFIG_FILE))
  summary = _read_json(os.path.join(run_dir, run_files.SUMMARY_FILE))
  if client is not None:
    clients_dir = os.path.join(run_dir, run_files.CLIENTS_DIR)
    path = os.path.join(clients_dir, f"{client}.keras")
    if not os.path.isfile(path):
      known = (
        sorted(n[: -len(".keras")] for n in os.listdir(clients_dir))
        if os.path.isdir(clients_dir)
        else []
      )
      raise ExportError(
        f"--client={client}: {run_dir} keeps no model of its own for it "
        + (
          f"(it has {len(known)}, e.g. {', '.join(known[:3])})"
          if known
          else f"({config.get('algorithm')} keeps no per-client models: export it without --client)"
        )
      )
    return Run(run_dir, config, summary, (path,))
  return Run(run_dir, config, summary, tuple(members) if members else (single,))
