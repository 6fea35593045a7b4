"""What an app needs to use a .tflite file, stored inside the file.

The description (class labels, the expected input and its preprocessing, the outputs, and
for ensembles K and the run's personalization temperature) is JSON in an entry named
`METADATA_NAME` of the flatbuffer's `metadata` table (TFLite schema, `Model.metadata`:
named byte buffers that interpreters ignore), which any flatbuffer reader can get at: on
Android, `Model.getRootAsModel(buffer).metadata(i)` of the TFLite schema. Beside it,
`export.standard_metadata` writes TFLite's standard `TFLITE_METADATA` entry (tflite-support's
schema) that Netron, the Task Library and Android Studio read.

Added to a model object of TensorFlow's `flatbuffer_utils` (the TFLite schema's object API;
`export.convert.finalize`); read with the schema's zero-copy accessors, so reading a 130 MB
ensemble does not copy its weights. The schema is LiteRT's copy in the device environment
(`device/`, no TensorFlow), TensorFlow's in the main one.
"""

import importlib.util
import json
import os
import sys

import numpy as np

from export import ExportError


def _tflite_schema():
  """The TFLite schema's generated module: LiteRT's; else TensorFlow's, which where TensorFlow
  is not imported yet is loaded from its file alone (it imports only flatbuffers and NumPy),
  so that reading metadata (`python -m export.web`) does not import TensorFlow."""
  if importlib.util.find_spec("ai_edge_litert") is not None:
    from ai_edge_litert import schema_py_generated

    return schema_py_generated
  name = "tensorflow.lite.python.schema_py_generated"
  if "tensorflow" in sys.modules:
    return importlib.import_module(name)
  (package_dir,) = importlib.util.find_spec("tensorflow").submodule_search_locations
  path = os.path.join(package_dir, "lite", "python", "schema_py_generated.py")
  spec = importlib.util.spec_from_file_location(f"{__name__}._tflite_schema", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


schema = _tflite_schema()

METADATA_NAME = "tff_ens"
# The metadata's "runtime": what runs the file (`export.on_device` follows it).
RUNTIME_TFLITE = "tflite"
RUNTIME_LCE = "larq_compute_engine"


def add(model: schema.ModelT, description: dict):
  """Adds (or replaces) the `METADATA_NAME` entry of a TFLite model object, in place."""
  add_entry(model, METADATA_NAME, json.dumps(description, sort_keys=True).encode())


def add_entry(model: schema.ModelT, name: str, data: bytes):
  """Adds (or replaces) the metadata entry `name` holding `data`, in place."""
  buffer = schema.BufferT()
  buffer.data = np.frombuffer(data, np.uint8)
  model.buffers.append(buffer)
  entry = schema.MetadataT()
  entry.name = name
  entry.buffer = len(model.buffers) - 1
  # Names read from a flatbuffer are bytes.
  model.metadata = [m for m in (model.metadata or []) if m.name not in (name, name.encode())] + [
    entry
  ]


def read(flatbuffer: bytes, where: str = "the file") -> dict:
  """The description added by `add`; ExportError if `flatbuffer` has none."""
  if len(flatbuffer) < 8 or flatbuffer[4:8] != b"TFL3":
    raise ExportError(
      f"{where} is not a TFLite flatbuffer: pass a .tflite file written by `python -m export`"
    )
  model = schema.Model.GetRootAs(flatbuffer, 0)
  for i in range(model.MetadataLength()):
    entry = model.Metadata(i)
    if entry.Name().decode() == METADATA_NAME:
      return json.loads(model.Buffers(entry.Buffer()).DataAsNumpy().tobytes())
  raise ExportError(
    f"{where} has no {METADATA_NAME!r} metadata: it was not written by "
    "`python -m export`; export the run again"
  )
