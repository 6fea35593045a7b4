"""Tests of `tff_ens.settings` and of the run's settings declared with it (`run_settings`).

Each setting is declared once: its bounds and choices are checked by `settings.check`, a
library config's check names the flag it was built from (`settings.build`), and the command
line's flags are made from the declarations (`settings.define_flags`), `--help` listing them.
"""

import dataclasses
import subprocess
import sys

from absl import flags
import pytest

from tests.femnist_runs import QUICK
from tests.femnist_runs import ROOT
from tff_ens import settings
from tff_ens.program import experiment
from tff_ens.program import run_settings
from tff_ens.server import distillation
from tff_ens.settings import setting


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


def test_a_built_config_names_the_setting_it_came_from():
  # The library check (DistillationConfig: num_steps > 0) speaks of the flag.
  with pytest.raises(settings.SettingError, match="^distill_steps must be a positive") as error:
    settings.build(
      distillation.feddf_config,
      dataclasses.replace(QUICK, distill_steps=0),
      {"num_steps": "distill_steps"},
    )
  assert error.value.named("--distill_steps").startswith("--distill_steps must be")
  # The same check reaches the command line as a one-line usage error.
  with pytest.raises(experiment.UsageError, match="^--distill_steps must be a positive integer"):
    dataclasses.replace(QUICK, algorithm="feddf", distill_steps=0).validate()
  # A library user gets the library's names.
  with pytest.raises(ValueError, match="^num_steps must be a positive integer, got 0$"):
    distillation.feddf_config(0)


def test_define_flags_makes_one_flag_of_each_type():
  values = flags.FlagValues()
  settings.define_flags(Example, values)
  values(["prog", "--steps=4", "--mode=b", "--size=7", "--noon"])
  assert (values.steps, values.mode, values.size, values.on, values.rate) == (4, "b", 7, False, 0.5)
  assert values["mode"].parser.enum_values == ["a", "b"]
  assert values["size"].default is None and values["rate"].help == "A rate."
  with pytest.raises(flags.IllegalFlagValueError):
    values(["prog", "--mode=c"])


def test_every_run_setting_is_declared_with_help():
  for field in dataclasses.fields(run_settings.RunSettings):
    assert settings.declared(field).help, field.name
  assert dataclasses.fields(experiment.ExperimentConfig) == dataclasses.fields(
    run_settings.RunSettings
  )


def test_help_lists_every_flag_of_the_run():
  shown = subprocess.run(
    [sys.executable, "-m", "tff_ens.main", "--help"],
    cwd=ROOT,
    capture_output=True,
    text=True,
  ).stdout  # absl's --help exits with 1.
  for field in dataclasses.fields(run_settings.RunSettings):
    assert f"--{field.name}:" in shown or f"--[no]{field.name}:" in shown, field.name
