"""Tests of `tff_ens.settings` and of the run's settings declared with it.

Each setting is declared once, by the settings group that reads it: its bounds and choices
are checked by `settings.check`, a library config's check names the flag it was resolved from
(`settings.resolve`), the run's config is composed of every group's flags
(`settings.compose`, which refuses a flag declared twice) and the command line's flags are
made from it (`settings.define_flags`), `--help` listing them by group.
"""

import dataclasses
import subprocess
import sys

from absl import flags
from absl.testing import flagsaver
import pytest

import tasks
from tests.femnist_runs import QUICK
from tests.femnist_runs import ROOT
from tff_ens import algorithms
from tff_ens import settings
from tff_ens.algorithms import feddf
from tff_ens.program import active_learning
from tff_ens.program import experiment
from tff_ens.program import run_settings
from tff_ens.settings import setting
from tff_ens.templates import client_work
from tff_ens.templates import privacy
from tff_ens.templates import server_distillation


@dataclasses.dataclass(frozen=True)
class Example:
  steps: int = setting(3, "Steps.", above=0)
  rate: float = setting(0.5, "A rate.", at_least=0, at_most=1)
  delta: float = setting(0.0, "A delta.", at_least=0, below=1)
  mode: str = setting("a", "A mode.", choices=("a", "b"))
  size: int | None = setting(None, "A size, or unset.", at_least=0)
  scale: float = setting(1.0, "A scale.", above=0)
  on: bool = setting(True, "A switch.")

  def __post_init__(self):
    settings.check(self)


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(steps=0), "steps must be a positive integer, got 0"),
    (dict(rate=1.5), r"rate must be in \[0, 1\], got 1.5"),
    (dict(delta=1.0), r"delta must be in \[0, 1\), got 1.0"),
    (dict(mode="z"), "unknown mode=z: choose one of a, b"),
    (dict(size=-1), "size must be >= 0, got -1"),
    (dict(scale=0.0), "scale must be > 0, got 0.0"),
  ],
)
def test_check_refuses_what_the_declaration_does_not_allow(change, message):
  with pytest.raises(settings.SettingError, match=f"^{message}$") as error:
    Example(**change)
  assert error.value.name == next(iter(change))
  assert isinstance(error.value, ValueError)


def test_check_allows_the_bounds_and_an_unset_value():
  Example(steps=1, rate=1.0, delta=0.0, mode="b", size=None, scale=1e-9)


def test_a_resolved_group_names_the_flag_it_came_from():
  # The library check (LocalTrainingConfig: learning_rate > 0) speaks of the flag.
  with pytest.raises(settings.SettingError, match="^client_lr must be > 0") as error:
    settings.resolve(client_work.LocalTrainingConfig, dataclasses.replace(QUICK, client_lr=0.0))
  assert error.value.named("--client_lr").startswith("--client_lr must be")
  # A check of a config built from a group (FedDF's student) speaks of the flag too.
  with pytest.raises(settings.SettingError, match="^distill_steps must be a positive"):
    feddf.distillation_config(server_distillation.Settings(distill_steps=0))
  # The same checks reach the command line as one-line usage errors.
  with pytest.raises(experiment.UsageError, match="^--distill_steps must be a positive integer"):
    dataclasses.replace(QUICK, algorithm="feddf", distill_steps=0).validate()
  with pytest.raises(experiment.UsageError, match="^--client_lr must be > 0"):
    dataclasses.replace(QUICK, client_lr=0.0).validate()
  # A library user gets the library's names.
  with pytest.raises(ValueError, match="^learning_rate must be > 0, got 0.0$"):
    client_work.LocalTrainingConfig(learning_rate=0.0)


def test_define_flags_makes_one_flag_of_each_type():
  values = flags.FlagValues()
  settings.define_flags(Example, values)
  values(["prog", "--steps=4", "--mode=b", "--size=7", "--noon"])
  assert (values.steps, values.mode, values.size, values.on, values.rate) == (4, "b", 7, False, 0.5)
  assert values["mode"].parser.enum_values == ["a", "b"]
  assert values["size"].default is None and values["rate"].help == "A rate."
  with pytest.raises(flags.IllegalFlagValueError):
    values(["prog", "--mode=c"])


def test_every_flag_is_declared_once_with_help_by_a_settings_group():
  fields = dataclasses.fields(experiment.ExperimentConfig)
  groups = experiment.COMMON_GROUPS + tuple(experiment.TASK_GROUPS.values())
  groups += algorithms.SETTINGS_GROUPS
  assert [f.name for f in fields] == [flag for g in groups for flag in settings.flags_of(g)]
  for field in fields:
    assert settings.declared(field).help, field.name
    assert settings.group_of(field) in groups, field.name


def test_a_library_default_is_its_flags_default():
  defaults = {f.name: f.default for f in dataclasses.fields(experiment.ExperimentConfig)}
  for group in experiment.COMMON_GROUPS + algorithms.SETTINGS_GROUPS:
    for flag, field in settings.flags_of(group).items():
      assert field.default == defaults[flag], f"{group.__qualname__}.{field.name} and --{flag}"
    # A field that takes another group's flag has no default of its own but None: its
    # builder gives the flag's value.
    uses = {field.name: defaults[flag] for flag, field in settings.uses_of(group).items()}
    for field in settings.uses_of(group).values():
      assert field.default in (dataclasses.MISSING, None), f"{group.__qualname__}.{field.name}"
    # A group built from the defaults of the run is the library's config given those
    # values (DP's defaults are no DP, for which there is no config).
    if group is not privacy.DPConfig:
      resolved = settings.resolve(group, experiment.ExperimentConfig())
      if group is run_settings.RunSettings:  # Unset, the model is the task's first.
        assert resolved.model == tasks.get_task(resolved.task).MODEL_NAMES[0]
        resolved = dataclasses.replace(resolved, model=None)
      assert resolved == group(**uses), group


def test_a_setting_that_uses_another_flag_refuses_a_default_of_its_own():
  with pytest.raises(TypeError, match="uses --rounds takes that flag's default, not 100"):
    settings.setting(100, uses="rounds")
  with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'rounds'"):
    active_learning.ActiveLearningConfig()


@pytest.mark.parametrize("task", ["femnist", "shakespeare", "cifar10"])
def test_a_config_from_python_is_the_command_lines(task):
  from tff_ens import main as cli

  cli.FLAGS.mark_as_parsed()
  with flagsaver.as_parsed(task=task):
    assert cli.config_of_flags() == experiment.ExperimentConfig(task=task)
  assert experiment.ExperimentConfig(task=task).model == tasks.get_task(task).MODEL_NAMES[0]
  assert experiment.ExperimentConfig(task="shakespeare").model == "lstm"
  with pytest.raises(experiment.UsageError, match="unknown --model=cnn for task shakespeare"):
    experiment.ExperimentConfig(task="shakespeare", model="cnn").validate()


def test_a_setting_declared_twice_is_refused():
  @dataclasses.dataclass(frozen=True)
  class Other:
    on: bool = setting(False, "The same flag again.")

  @dataclasses.dataclass(frozen=True)
  class Renamed:
    switch: bool = setting(False, "The same flag, renamed.", flag="steps")

  for twice in (Other, Renamed):
    with pytest.raises(ValueError, match=r"the setting (on|steps) is declared twice: by Example"):
      settings.compose("Config", [Example, twice], module=__name__)
  composed = settings.compose("Config", [Example], module=__name__)
  assert composed().steps == 3 and settings.group_of(dataclasses.fields(composed)[0]) is Example


def test_help_lists_every_flag_under_the_algorithms_that_read_it():
  shown = subprocess.run(
    [sys.executable, "-m", "tff_ens.main", "--help"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  for field in dataclasses.fields(experiment.ExperimentConfig):
    assert f"  --{field.name}: " in shown, field.name
  section = shown[shown.index("--algorithm=fedavgm (") :]
  assert section.index("--server_momentum:") < section.index("\n\n")


def test_settings_read_keeps_what_each_algorithm_declares():
  shared = dict(ensemble_size=5, local_objective="feddyn", distill_steps=20)
  assert algorithms.settings_read("fedavg", **shared) == {}
  assert algorithms.settings_read("fedensemble", **shared) == {
    "ensemble_size": 5,
    "local_objective": "feddyn",
  }
  assert algorithms.settings_read("fedbe", **shared) == {"distill_steps": 20}
  with pytest.raises(ValueError, match="unknown algorithm 'fedsgd'"):
    algorithms.settings_read("fedsgd", **shared)
