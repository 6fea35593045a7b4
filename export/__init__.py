"""TFLite export and on-device evaluation of trained tff-ens runs.

`python -m export` converts a run of any task (`export.convert`; the task describes the
input, `tasks.INPUT_DESCRIPTION`), `python -m export.evaluate` runs the file in a standalone
TFLite runtime (`export.on_device`) on the task's test clients.
"""


class ExportError(ValueError):
  """A one-line, user-facing problem with a run, a file or an input; names the fix."""
