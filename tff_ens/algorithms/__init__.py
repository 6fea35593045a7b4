"""The algorithms the CLI can run: one module each, imported and registered in one line of
`REGISTRY`.

An algorithm module declares its settings, its builder and its rules in one
`algorithm.Algorithm` (`ALGORITHM`); see `algorithm` and docs/library.md, "Adding an
algorithm".
"""

import dataclasses

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.algorithms import ditto
from tff_ens.algorithms import fed_ensemble
from tff_ens.algorithms import fedadam
from tff_ens.algorithms import fedavg
from tff_ens.algorithms import fedavgm
from tff_ens.algorithms import fedbe
from tff_ens.algorithms import feddf
from tff_ens.algorithms import fedppd
from tff_ens.algorithms import fedppd_distill
from tff_ens.algorithms import fedprox
from tff_ens.algorithms import lg_fedavg
from tff_ens.algorithms import random_walk
from tff_ens.algorithms import vdistill

REGISTRY = {
  spec.name: spec
  for spec in (
    fedavg.ALGORITHM,  # The first is --algorithm's default.
    fedprox.ALGORITHM,
    fedavgm.ALGORITHM,
    fedadam.ALGORITHM,
    fed_ensemble.ALGORITHM,
    fedbe.ALGORITHM,
    feddf.ALGORITHM,
    vdistill.ALGORITHM,
    fedppd.ALGORITHM,
    fedppd_distill.ALGORITHM,
    ditto.ALGORITHM,
    lg_fedavg.ALGORITHM,
    random_walk.ALGORITHM,
  )
}
ALGORITHMS = tuple(REGISTRY)
# Every settings group an algorithm reads, each once, in registration order.
SETTINGS_GROUPS = tuple(dict.fromkeys(g for spec in REGISTRY.values() for g in spec.settings))


def having(capability: str) -> tuple[str, ...]:
  """The algorithms with `capability` (an `Algorithm` field: "dp", "server_data", ...)."""
  return tuple(name for name, spec in REGISTRY.items() if getattr(spec, capability))


def _spec(name: str) -> algorithm.Algorithm:
  """The registered algorithm `name`; ValueError naming the choices if there is none."""
  if name not in REGISTRY:
    raise ValueError(f"unknown algorithm {name!r}: choose one of {', '.join(ALGORITHMS)}")
  return REGISTRY[name]


def build(name: str, context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  """Builds the registered algorithm `name` for `context`.

  Raises:
    ValueError: an unknown algorithm, or a context it cannot take (server data it needs,
      DP, devices or recalibration it does not support).
  """
  spec = _spec(name)
  for capability, given in (
    ("dp", context.dp is not None),
    ("recalibrates", context.recalibration_images is not None),
    ("on_device", context.on_device),
  ):
    if given and not getattr(spec, capability):
      raise ValueError(
        f"{name} does not take {capability}: use one of {', '.join(having(capability))}"
      )
  if spec.server_data and context.server_data is None:
    raise ValueError(f"{name} needs the server's data (context.server_data)")
  return spec.build(context)


def _declared_flags(name: str) -> set[str]:
  """The flags of the settings groups algorithm `name` reads."""
  return {flag for group in _spec(name).settings for flag in settings.flags_of(group)}


def settings_read(name: str, **flags) -> dict:
  """The `flags` (by their command-line names) that algorithm `name` reads: one set of
  settings for several algorithms, each given what it declares."""
  declared = _declared_flags(name)
  return {flag: value for flag, value in flags.items() if flag in declared}


def groups_of(name: str, **flags) -> tuple:
  """The settings groups algorithm `name` reads, with `flags` (by their command-line names,
  e.g. `ensemble_size=3`, and those of other groups its fields use, e.g. `client_epochs=2`)
  and the defaults elsewhere.

  Raises:
    ValueError: a flag none of its groups declares or uses.
    TypeError: a flag a group uses is not given.
  """
  groups = REGISTRY[name].settings
  declared = _declared_flags(name)
  used = {flag for group in groups for flag in settings.uses_of(group)}
  unknown = sorted(set(flags) - declared - used)
  if unknown:
    raise ValueError(f"{name} reads no setting {', '.join(unknown)}: it reads {sorted(declared)}")
  missing = sorted(used - set(flags))
  if missing:
    raise TypeError(f"{name}'s settings use {', '.join(missing)}: pass {missing[0]}=...")
  return tuple(
    group(**{f.name: flags[flag] for flag, f in settings.field_flags_of(group) if flag in flags})
    for group in groups
  )


def build_algorithm(name: str, model_fn, element_spec, local, **options):
  """`build(name, context)` for library users: `options` are the context's other fields
  (`dp=`, `server_data=`, `num_clients=`, ...) and the algorithm's settings by their flags
  (`ensemble_size=3`, `local_objective="feddyn"`)."""
  fields = {f.name for f in dataclasses.fields(algorithm.BuildContext)}
  # What a group's fields may use: the context's seed, the local training's fields
  # (max_update_norm) and the flags given.
  context_defaults = {
    f.name: f.default
    for f in dataclasses.fields(algorithm.BuildContext)
    if f.default is not dataclasses.MISSING
  }
  known = {**context_defaults, **dataclasses.asdict(local), **options}
  used = {flag for group in _spec(name).settings for flag in settings.uses_of(group)}
  flags = {k: v for k, v in options.items() if k not in fields}
  flags.update({flag: known[flag] for flag in used if flag in known and flag not in flags})
  context = algorithm.BuildContext(
    model_fn,
    element_spec,
    local,
    groups=groups_of(name, **flags),
    **{k: v for k, v in options.items() if k in fields},
  )
  return build(name, context)
