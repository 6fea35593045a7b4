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
  e.g. `ensemble_size=3`) and the defaults elsewhere.

  Raises:
    ValueError: a flag none of its groups declares.
  """
  declared = _declared_flags(name)
  groups = REGISTRY[name].settings
  unknown = sorted(set(flags) - declared)
  if unknown:
    raise ValueError(f"{name} reads no setting {', '.join(unknown)}: it reads {sorted(declared)}")
  return tuple(
    group(**{f.name: flags[flag] for flag, f in settings.flags_of(group).items() if flag in flags})
    for group in groups
  )


def build_algorithm(name: str, model_fn, element_spec, local, **options):
  """`build(name, context)` for library users: `options` are the context's other fields
  (`dp=`, `server_data=`, `num_clients=`, ...) and the algorithm's settings by their flags
  (`ensemble_size=3`, `local_objective="feddyn"`)."""
  fields = {f.name for f in dataclasses.fields(algorithm.BuildContext)}
  context = algorithm.BuildContext(
    model_fn,
    element_spec,
    local,
    groups=groups_of(name, **{k: v for k, v in options.items() if k not in fields}),
    **{k: v for k, v in options.items() if k in fields},
  )
  return build(name, context)
