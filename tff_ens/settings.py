"""Settings declared once: a dataclass field with its default, help, choices and bounds.

A config dataclass declares each of its settings with `setting(...)`; its `__post_init__`
calls `check(self)`, which enforces every declared choice and bound and raises a
`SettingError` (a `ValueError`) naming the field.

A *settings group* is such a dataclass whose settings are also command-line flags and keys
of a run's `config.json`: a library config (`LocalTrainingConfig`, `PosteriorConfig`, ...)
declared next to the code that reads it, or an algorithm module's own `Settings`. A field's
flag is its name, or the name its declaration gives (`flag="client_lr"`); a field that is
no flag (`flag=None`) is the library's own, and one that `uses` another group's flag takes
that flag's value when a run builds the group. `compose` makes one flat config class of
the groups' flags, refusing a flag declared twice; `resolve` builds a group from such a
config, naming a library check's error by its flag, so the library and the command line
share one check and one default.
"""

import contextlib
import dataclasses
import functools
import types
import typing
from typing import Any, Iterable

from absl import flags

_METADATA_KEY = "setting"
# The metadata key of a composed config's field: the group that declares it.
_GROUP_KEY = "group"
# `setting(flag=...)` left out: the flag is the field's name.
_FIELD_NAME = "<the field's name>"
# `setting(before=...)` left out: a run saved before the setting existed did its default.
_NO_VALUE = "<no value>"

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
  flag: str | None = _FIELD_NAME
  uses: str | None = None
  before: Any = _NO_VALUE

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
  flag: str | None = _FIELD_NAME,
  uses: str | None = None,
  choices: Iterable = (),
  above: float | None = None,
  at_least: float | None = None,
  at_most: float | None = None,
  below: float | None = None,
  before: Any = _NO_VALUE,
) -> Any:
  """A dataclass field declaring a setting: its default, a one-line help (the flag's),
  the values it may take (`choices`) or its bounds (`above` or `at_least`, `at_most` or
  `below`; a range needs a lower bound).

  In a settings group, `flag` names its flag when that is not the field's name, None makes
  it the library's own (no flag); `uses` makes it take the value of the flag of that name,
  which another group declares with its default: such a field has none of its own (a
  keyword its builder must give; `resolve` gives the flag's value), or None (unset).
  `before`: what a run did before the flag existed, when
  its default changed that (a saved config without the flag takes it: `saved_values`).
  """
  declared = Setting(help, tuple(choices), above, at_least, at_most, below, flag, uses, before)
  if uses is None:
    return dataclasses.field(default=default, metadata={_METADATA_KEY: declared})
  if default not in (dataclasses.MISSING, None):
    raise TypeError(
      f"a setting that uses --{uses} takes that flag's default, not {default!r}: declare none"
    )
  declared = dataclasses.replace(declared, flag=None)
  return dataclasses.field(default=default, kw_only=True, metadata={_METADATA_KEY: declared})


def declared(field: dataclasses.Field) -> Setting:
  """The field's `Setting` (a no-flag one for a field not made by `setting`)."""
  return field.metadata.get(_METADATA_KEY, Setting(flag=None))


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


# Settings groups ------------------------------------------------------------------------


def group(cls):
  """Makes `cls` a settings group: a frozen dataclass whose values its declarations check
  when it is built (`check`, then the class's own `__post_init__` if it has one)."""
  own = cls.__dict__.get("__post_init__")

  def __post_init__(self):  # noqa: N807
    check(self)
    if own is not None:
      own(self)

  cls.__post_init__ = __post_init__
  return dataclasses.dataclass(frozen=True)(cls)


def flags_of(group: type) -> dict[str, dataclasses.Field]:
  """{flag name: field} of the settings group `group` (a dataclass), in declaration order."""
  named = {}
  for field in dataclasses.fields(group):
    flag = declared(field).flag
    if flag is not None:
      named[field.name if flag == _FIELD_NAME else flag] = field
  return named


def uses_of(group: type) -> dict[str, dataclasses.Field]:
  """{flag name: field} of the fields of `group` that take another group's flag."""
  return {declared(f).uses: f for f in dataclasses.fields(group) if declared(f).uses is not None}


def predated_values(groups: Iterable[type], saved: dict) -> dict:
  """The values of the flags of `groups` that a saved config (`saved`, flag -> value) predates
  and whose declaration says what such a run did (`setting(before=...)`)."""
  return {
    flag: declared(field).before
    for group in dict.fromkeys(groups)
    for flag, field in flags_of(group).items()
    if flag not in saved and declared(field).before is not _NO_VALUE
  }


def upgraded_values(groups: Iterable[type], saved: dict) -> dict:
  """What the settings groups `groups` change in a saved config: each group's
  `upgrade_saved(saved) -> {flag: value}`, if it has one."""
  values = {}
  for group in dict.fromkeys(groups):
    if hasattr(group, "upgrade_saved"):
      values.update(group.upgrade_saved(saved))
  return values


def flags_with_before(groups: Iterable[type]) -> set[str]:
  """The flags of `groups` whose declaration says what a run did before them."""
  return {
    flag
    for group in groups
    for flag, field in flags_of(group).items()
    if declared(field).before is not _NO_VALUE
  }


def group_of(field: dataclasses.Field) -> type | None:
  """The group that declares a field of a `compose`d config."""
  return field.metadata.get(_GROUP_KEY)


def compose(name: str, groups: Iterable[type], *, module: str, bases: tuple = ()) -> type:
  """A frozen dataclass `name` with one field per flag of `groups` (named by the flag, with
  the group's type, default and declaration), subclassing `bases`.

  Raises:
    ValueError: a flag declared by two groups, naming both.
  """
  fields, owners = [], {}
  for group in dict.fromkeys(groups):  # Each group once, in order.
    hints = _type_hints(group)
    for flag, field in flags_of(group).items():
      if flag in owners:
        raise ValueError(
          f"the setting {flag} is declared twice: by {owners[flag].__qualname__} and "
          f"{group.__qualname__}; declare it once and read it from there"
        )
      owners[flag] = group
      spec = dataclasses.replace(declared(field), flag=_FIELD_NAME)
      metadata = {_METADATA_KEY: spec, _GROUP_KEY: group}
      fields.append(
        (flag, hints[field.name], dataclasses.field(default=field.default, metadata=metadata))
      )
  composed = dataclasses.make_dataclass(name, fields, bases=bases, frozen=True)
  composed.__module__ = module
  return composed


@contextlib.contextmanager
def named_by(names: dict[str, str]):
  """Renames a `SettingError` raised inside from a library field's name to the setting's
  (`names`: field -> setting), so a library check speaks of the flag it came from."""
  try:
    yield
  except SettingError as e:
    if e.name not in names:
      raise
    raise SettingError(names[e.name], e.value, e.problem) from None


def resolve(group: type, source, **values):
  """`group` built from the flags of `source` (a `compose`d config, or any object with
  them as attributes) and `values` for its other fields (which replace a flag's). Its
  `SettingError` names the flag it came from, so one check serves the library and the
  command line."""
  named = {**flags_of(group), **uses_of(group)}
  given = {field.name: getattr(source, flag) for flag, field in named.items()}
  with named_by(field_flags(group)):
    return group(**{**given, **values})


def field_flags_of(group: type) -> list[tuple[str, dataclasses.Field]]:
  """(flag name, field) of the group's fields that are or use flags."""
  return list({**flags_of(group), **uses_of(group)}.items())


def field_flags(group: type) -> dict[str, str]:
  """{field name: flag name} of the group's fields that are or use flags."""
  return {field.name: flag for flag, field in {**flags_of(group), **uses_of(group)}.items()}


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
