"""TFLite export and on-device evaluation of trained tff-ens runs.

`python -m export` converts a run (`export.convert`), `python -m export.evaluate` runs the
file in a standalone TFLite runtime (`export.on_device`) on FEMNIST writers.
"""


class ExportError(ValueError):
  """A one-line, user-facing problem with a run, a file or an input; names the fix."""
