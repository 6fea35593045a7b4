"""TFLite's standard metadata, which Netron, the Task Library and Android Studio read.

tflite-support's writer (`tflite_support.metadata_writers`) cannot be installed beside
TensorFlow 2.14 here: tflite-support 0.4.4, its last release, needs protobuf < 4, and the
lock's tensorflow-metadata 1.16 (tensorflow-datasets' dependency) needs protobuf >= 4.25.
So this module writes the same schema (tflite-support's metadata_schema.fbs, version 1.1.0,
file identifier "M001") with the `flatbuffers` package TensorFlow already brings: a
`ModelMetadata` table (name, description, version, author, license) whose first
`SubGraphMetadata` describes subgraph 0's inputs (an image's `ImageProperties`, its
`NormalizationOptions` from 8-bit pixels, its value range as `Stats`) and outputs (the class
probabilities or logits annotated by `labels.txt`, a `TENSOR_AXIS_LABELS` file), in an entry
named `TFLITE_METADATA` of the model's metadata table, with the associated files in a zip
archive appended to the flatbuffer, as tflite-support's `MetadataPopulator` writes them.
"""

import importlib.metadata
import io
import zipfile

import flatbuffers

from export import metadata

METADATA_NAME = "TFLITE_METADATA"
FILE_IDENTIFIER = b"M001"
SCHEMA_VERSION = "1.1.0"
LABELS_FILE = "labels.txt"
# Enums of metadata_schema.fbs.
TENSOR_AXIS_LABELS = 2
COLOR_SPACES = {1: 2, 3: 1}  # channels -> ColorSpaceType GRAYSCALE, RGB
FEATURE_PROPERTIES, IMAGE_PROPERTIES = 1, 2  # ContentProperties
NORMALIZATION_OPTIONS = 1  # ProcessUnitOptions
# The names of the model's input in its signatures (`export.ensemble_module.input_names`,
# `x` of a single model's converted function).
INPUT_NAMES = ("image", "images", "ids", "x")
# Outputs whose last axis is the class, annotated by the labels file.
LABELED_OUTPUTS = ("logits", "probabilities", "member_probabilities")
OUTPUTS = {
  "logits": "class logits [n, classes]: softmax for probabilities, argmax indexes labels.txt",
  "probabilities": "the alpha-weighted mixture of the members' softmax outputs [n, classes]",
  "member_probabilities": "each member's softmax output [n, K, classes]",
  "entropy": "the mixture's predictive entropy [n], nats",
  "mutual_information": "the mixture's entropy minus the members' mean entropy [n], nats",
  "alpha": "personalized member weights [K], softmax(-mean cross-entropy / temperature)",
}


# The tff-ens description's keys the standard metadata is made of (`export.convert.describe`).
DESCRIPTION_KEYS = ("author", "class_labels", "format", "input", "license", "task", "version")


def applies(description: dict) -> bool:
  """Whether `description` is a whole one, as `export.convert.describe` makes it."""
  return all(key in description for key in DESCRIPTION_KEYS)


def tff_ens_version() -> str:
  try:
    return importlib.metadata.version("tff-ens")
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


class _Writer:
  """flatbuffers.Builder with the few helpers the schema's tables need."""

  def __init__(self):
    self.builder = flatbuffers.Builder(1024)

  def string(self, text: str) -> int:
    return self.builder.CreateString(text)

  def tables(self, offsets: list[int]) -> int:
    self.builder.StartVector(4, len(offsets), 4)
    for offset in reversed(offsets):
      self.builder.PrependUOffsetTRelative(offset)
    return self.builder.EndVector()

  def floats(self, values) -> int:
    self.builder.StartVector(4, len(values), 4)
    for value in reversed(values):
      self.builder.PrependFloat32(float(value))
    return self.builder.EndVector()

  def table(self, fields: list[tuple[str, int, int]]) -> int:
    """A table of (kind, slot, value) fields: kind "offset", "byte" or "uint"."""
    self.builder.StartObject(max(slot for _, slot, _ in fields) + 1 if fields else 0)
    for kind, slot, value in fields:
      if kind == "offset":
        self.builder.PrependUOffsetTRelativeSlot(slot, value, 0)
      elif kind == "byte":
        self.builder.PrependUint8Slot(slot, value, 0)
      else:
        self.builder.PrependUint32Slot(slot, value, 0)
    return self.builder.EndObject()


def _labels_file(w: _Writer) -> int:
  return w.table(
    [
      ("offset", 0, w.string(LABELS_FILE)),
      ("offset", 1, w.string("the class labels, one a line, in output order")),
      ("byte", 2, TENSOR_AXIS_LABELS),
    ]
  )


def _input(w: _Writer, name: str, description: dict) -> int:
  """TensorMetadata of the model's input `name` (the image or the ids)."""
  given = description["input"]
  low, high = given["value_range"]
  shape = given["shape"][1:]
  image = given["dtype"] != "int32" and len(shape) == 3 and shape[-1] in COLOR_SPACES
  fields = [
    ("offset", 0, w.string(name)),
    ("offset", 1, w.string(given["preprocessing"])),
  ]
  if image:
    size = w.table([("uint", 0, shape[1]), ("uint", 1, shape[0])])
    properties = w.table([("byte", 0, COLOR_SPACES[shape[-1]]), ("offset", 1, size)])
    content = w.table([("byte", 0, IMAGE_PROPERTIES), ("offset", 1, properties)])
    # x = low + (high - low) * pixel / 255 = (pixel - mean) / std for 8-bit pixels.
    std = 255.0 / (high - low)
    normalization = w.table(
      [("offset", 0, w.floats([0.0 - low * std])), ("offset", 1, w.floats([std]))]
    )
    unit = w.table([("byte", 0, NORMALIZATION_OPTIONS), ("offset", 1, normalization)])
    fields += [("offset", 3, content), ("offset", 4, w.tables([unit]))]
  else:
    features = w.table([])
    fields.append(
      ("offset", 3, w.table([("byte", 0, FEATURE_PROPERTIES), ("offset", 1, features)]))
    )
  stats = w.table([("offset", 0, w.floats([high])), ("offset", 1, w.floats([low]))])
  fields.append(("offset", 5, stats))
  return w.table(fields)


def _output(w: _Writer, name: str) -> int:
  features = w.table([])
  content = w.table([("byte", 0, FEATURE_PROPERTIES), ("offset", 1, features)])
  fields = [
    ("offset", 0, w.string(name)),
    ("offset", 1, w.string(OUTPUTS.get(name, name))),
    ("offset", 3, content),
  ]
  if name in LABELED_OUTPUTS:
    fields.append(("offset", 6, w.tables([_labels_file(w)])))
  return w.table(fields)


def _tensor_names(model, subgraph: int) -> tuple[list[str], list[str]]:
  """Subgraph `subgraph`'s input and output names, in its order, from its signature."""
  graph = model.subgraphs[subgraph]
  names = {}
  for signature in model.signatureDefs or []:
    if signature.subgraphIndex == subgraph:
      for mapping in [*signature.inputs, *signature.outputs]:
        names[mapping.tensorIndex] = _text(mapping.name)
  inputs = [names.get(t, f"input_{i}") for i, t in enumerate(graph.inputs)]
  outputs = [
    names.get(t, "logits" if len(graph.outputs) == 1 else f"output_{i}")
    for i, t in enumerate(graph.outputs)
  ]
  return inputs, outputs


def _signature_key(model, subgraph: int) -> str:
  keys = [s.signatureKey for s in model.signatureDefs or [] if s.subgraphIndex == subgraph]
  return _text(keys[0]) if keys else "main"


def _text(name) -> str:
  return name.decode() if isinstance(name, bytes) else name


def model_metadata(model, description: dict) -> bytes:
  """The ModelMetadata flatbuffer of a model object (`flatbuffer_utils`) and its tff-ens
  `description` (`export.metadata`)."""
  w = _Writer()
  inputs, outputs = _tensor_names(model, 0)
  if description["format"] not in ("ensemble", "trainable"):  # The converter's `output_0`.
    outputs = ["logits"]
  input_tables = [
    _input(w, name, description) if name in INPUT_NAMES else _extra_input(w, name)
    for name in inputs
  ]
  output_tables = [_output(w, name) for name in outputs]
  subgraph = w.table(
    [
      ("offset", 0, w.string(_signature_key(model, 0))),
      ("offset", 2, w.tables(input_tables)),
      ("offset", 3, w.tables(output_tables)),
    ]
  )
  kind = (
    f"an ensemble of {description['ensemble_size']} members ({description['quantization']})"
    if description["format"] == "ensemble"
    else f"one model ({description['format']})"
  )
  text = (
    f"{description['task']} classifier trained by tff-ens ({description.get('algorithm')}), "
    f"{kind}; signatures: {', '.join(description.get('signatures', {})) or 'serving_default'}. "
    "The full description (preprocessing, signatures, the run's temperature and 'not sure' "
    "threshold) is JSON in the metadata entry 'tff_ens'."
  )
  root = w.table(
    [
      ("offset", 0, w.string(f"tff-ens {description['task']} {description['format']}")),
      ("offset", 1, w.string(text)),
      ("offset", 2, w.string(description["version"])),
      ("offset", 3, w.tables([subgraph])),
      ("offset", 4, w.string(description["author"])),
      ("offset", 5, w.string(description["license"])),
      ("offset", 7, w.string(SCHEMA_VERSION)),
    ]
  )
  w.builder.Finish(root, file_identifier=FILE_IDENTIFIER)
  return bytes(w.builder.Output())


def _extra_input(w: _Writer, name: str) -> int:
  """TensorMetadata of a non-image input (alpha, labels, mask, temperature)."""
  descriptions = {
    "alpha": "member weights [K] on the simplex (1/K each: the uniform ensemble)",
    "labels": "int32 class indices [n] of the personalization examples",
    "mask": "float32 [n]: 1 for an example, 0 for padding",
    "temperature": "float32 [] > 0: the personalization temperature",
  }
  return w.table(
    [("offset", 0, w.string(name)), ("offset", 1, w.string(descriptions.get(name, name)))]
  )


def add(model, description: dict):
  """Adds (or replaces) the `TFLITE_METADATA` entry of a model object, in place."""
  metadata.add_entry(model, METADATA_NAME, model_metadata(model, description))


def with_associated_files(flatbuffer: bytes, description: dict) -> bytes:
  """`flatbuffer` followed by the zip archive of its associated files (`labels.txt`)."""
  archive = io.BytesIO()
  archive.write(flatbuffer)
  with zipfile.ZipFile(archive, "a") as files:
    labels = [label.replace("\n", "\\n") for label in description["class_labels"]]
    files.writestr(LABELS_FILE, "\n".join(labels) + "\n")
  return archive.getvalue()
