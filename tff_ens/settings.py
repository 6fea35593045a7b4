"""Settings declared once: a dataclass field with its default, help, choices and bounds.

A config dataclass declares each of its settings with `setting(...)`; its `__post_init__`
calls `check(self)`, which enforces every declared choice and bound and raises a
`SettingError` (a `ValueError`) naming the field. `run_settings.RunSettings` declares the
command line's settings this way: `define_flags` makes one absl flag per field, and `build`
names a library config's `SettingError` by the setting it was built from, so the library and
the command line share one check.
"""

import dataclasses
import functools
import types
import typing
from typing import Any, Callable, Iterable

from absl import flags

_METADATA_KEY = "setting"

# The flags `define_flags` makes are its caller's (`--help` lists a main module's own flags).
flags.disclaim_key_flags()


@dataclasses.dataclass(frozen=True)
class Setting:
  """A field's declaration beyond its type and default (see `setting`)."""

  help: str = ""
  choices: tuple = ()
  above: float | None = None
  at_least: float | None = None
  at_most: float | None = None
  below: float | None = None

  def problem(self, value, integer: bool = False) -> str | None:
    """Why `value` (of an `integer` setting or not) is not allowed, or None; None (unset)
    is always allowed."""
    if value is None:
      return None
    if self.choices and value not in self.choices:
      return f"choose one of {', '.join(map(str, self.choices))}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return None
    low_ok = (self.above is None or value > self.above) and (
      self.at_least is None or value >= self.at_least
    )
    high_ok = (self.at_most is None or value <= self.at_most) and (
      self.below is None or value < self.below
    )
    if low_ok and high_ok:
      return None
    return f"must be {self.bounds(integer)}"

  def bounds(self, integer: bool) -> str:
    """The allowed range in words: "> 0", "a positive integer", "in [0, 1)"."""
    if self.at_most is not None or self.below is not None:
      start = f"({self.above:g}" if self.above is not None else f"[{self.at_least:g}"
      end = f"{self.at_most:g}]" if self.at_most is not None else f"{self.below:g})"
      return f"in {start}, {end}"
    if self.above == 0 and integer:
      return "a positive integer"
    return f"> {self.above:g}" if self.above is not None else f">= {self.at_least:g}"


def setting(
  default: Any = dataclasses.MISSING,
  help: str = "",  # noqa: A002 (absl's word for it)
  *,
  choices: Iterable = (),
  above: float | None = None,
  at_least: float | None = None,
  at_most: float | None = None,
  below: float | None = None,
) -> Any:
  """A dataclass field declaring a setting: its default, a one-line help (the flag's),
  the values it may take (`choices`) or its bounds (`above` or `at_least`, `at_most` or
  `below`; a range needs a lower bound)."""
  declared = Setting(help, tuple(choices), above, at_least, at_most, below)
  return dataclasses.field(default=default, metadata={_METADATA_KEY: declared})


def declared(field: dataclasses.Field) -> Setting:
  """The field's `Setting` (an empty one for a field not made by `setting`)."""
  return field.metadata.get(_METADATA_KEY, Setting())


class SettingError(ValueError):
  """A setting's value is not allowed: `name` is the field, `problem` why."""

  def __init__(self, name: str, value: Any, problem: str):
    self.name, self.value, self.problem = name, value, problem
    super().__init__(self.named(name))

  def named(self, name: str) -> str:
    """The message with the setting called `name` (e.g. a flag, "--distill_steps"): "unknown
    NAME=VALUE: choose one of ...", "NAME must be ..., got VALUE" or "NAME=VALUE: PROBLEM"."""
    if self.problem.startswith("choose one of"):
      return f"unknown {name}={self.value}: {self.problem}"
    if self.problem.startswith("must be"):
      return f"{name} {self.problem}, got {self.value}"
    return f"{name}={self.value}: {self.problem}"


def check(config) -> None:
  """Raises `SettingError` for the first field of the dataclass `config` whose value its
  declaration does not allow."""
  hints = _type_hints(type(config))
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    problem = declared(field).problem(value, _flag_type(hints[field.name]) is int)
    if problem is not None:
      raise SettingError(field.name, value, problem)


def build(factory: Callable, source, names: dict[str, str], **values):
  """`factory(**{argument: source.<name>} for argument: name in names, **values)`: a
  library config from `source`'s settings. Its `SettingError` names the setting of
  `source` it came from, so one check serves the library and the command line."""
  try:
    return factory(
      **{argument: getattr(source, name) for argument, name in names.items()}, **values
    )
  except SettingError as e:
    if e.name not in names:
      raise
    raise SettingError(names[e.name], e.value, e.problem) from None


@functools.cache
def _type_hints(config_class) -> dict:
  return typing.get_type_hints(config_class)


def _flag_type(annotation) -> type:
  """`int` of `int` or `int | None`."""
  if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
    (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
  return annotation


def define_flags(config_class, flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """One absl flag per field of `config_class`, of its type, default, help and choices."""
  hints = _type_hints(config_class)
  for field in dataclasses.fields(config_class):
    spec = declared(field)
    kind = _flag_type(hints[field.name])
    args = (field.name, field.default, spec.help)
    if kind is bool:
      flags.DEFINE_bool(*args, flag_values=flag_values)
    elif spec.choices:
      flags.DEFINE_enum(*args[:2], list(spec.choices), spec.help, flag_values=flag_values)
    elif kind is int:
      flags.DEFINE_integer(*args, flag_values=flag_values)
    elif kind is float:
      flags.DEFINE_float(*args, flag_values=flag_values)
    else:
      flags.DEFINE_string(*args, flag_values=flag_values)
