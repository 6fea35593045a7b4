"""What the page is told about each --tflite file: its metadata, or the one line that says
why LiteRT.js cannot run it.

LiteRT.js (2.5) runs only the shapes a file declares and feeds float32, int32 and uint8
tensors. So it runs the files of `python -m export --static_batch=N` and the single-model
float, dynamic, qat and binary files (a batch of 1), and not: an ensemble or trainable file
of a dynamic batch, a single int8 file (int8 input and output), an LSTM file that keeps state
in variable tensors (LiteRT.js cannot reset them), an lce file (LCE's custom ops), a file
without tff-ens metadata. The page checks the shapes and types again from LiteRT.js's own
view (`static/tffens.js`), and a file LiteRT.js fails to load gets its one line there.
"""

import os

from export import ExportError
from export import metadata

REEXPORT = "export it again with `python -m export ... --static_batch=1`"


def problem(description: dict, name: str) -> str | None:
  """Why LiteRT.js cannot run the file `name` of this metadata, or None if it can."""
  if description.get("runtime") == metadata.RUNTIME_LCE:
    return (
      f"{name} is an lce file: its 1-bit convolutions are larq-compute-engine's custom ops, "
      "which LiteRT.js does not have; export the run with --format=binary --static_batch=1"
    )
  if description.get("static_batch"):
    return None
  if description["format"] in ("ensemble", "trainable"):
    return f"{name} declares a dynamic batch ([-1, ...]) and LiteRT.js runs only fixed shapes: " + (
      REEXPORT if description["format"] == "ensemble" else "export --format=float for the web"
    )
  if description["input"]["dtype"] == "int8":
    return (
      f"{name} takes and returns int8 tensors, which LiteRT.js cannot feed: {REEXPORT} "
      "(int8 inside, float32 input and output)"
    )
  if "reset_variables" in description:
    return (
      f"{name} keeps its LSTM state in variable tensors, which LiteRT.js cannot reset between "
      f"predictions: {REEXPORT} (the LSTM unrolled, no state)"
    )
  return None


def describe(path: str) -> dict:
  """config.json's entry for the file at `path`: name, url, size, metadata, problem.
  ExportError (the command's one line) if it cannot be read."""
  name = os.path.basename(path)
  try:
    with open(path, "rb") as f:
      flatbuffer = f.read()
  except OSError as e:
    raise ExportError(f"cannot read --tflite={path} ({e.strerror}): pass exported .tflite files")
  entry = {"name": name, "url": f"files/{name}", "size": len(flatbuffer), "metadata": None}
  try:
    entry["metadata"] = metadata.read(flatbuffer, name)
  except ExportError as e:
    entry["problem"] = str(e)
  except Exception:  # A corrupted flatbuffer fails anywhere in the reader.
    entry["problem"] = (
      f"{name} is not a readable TFLite file (corrupted or truncated): export it again"
    )
  else:
    entry["problem"] = problem(entry["metadata"], name)
  return entry
