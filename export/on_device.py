"""Runs exported files in a standalone runtime, as a phone would, with checked inputs.

A file's metadata (`metadata`) says which runtime it needs: a standalone TFLite
`Interpreter` (no TensorFlow; XNNPACK for float ops as on phones), LiteRT's in the device
environment (`device/`) and tflite-runtime's in the main one, or, for `lce` files,
larq-compute-engine's `lce.testing.Interpreter` (TFLite with LCE's 1-bit kernels
registered), in both. Inputs are checked against the metadata before they reach the
interpreter, whose own errors do not say what was expected: a wrong input shape, dtype or
value range (float32 images in the task's range; integer ids in 0..out_of_vocabulary_id), an
alpha that is not K weights on the simplex, or an empty or mislabeled personalization set
raise `ExportError` with a one-line message. A file whose metadata says `reset_variables`
(an LSTM's state) has its variable tensors reset before each invocation, so that a
prediction does not depend on the previous one. An ensemble predicts and personalizes in
chunks of at most `CHUNK_SIZE` examples per signature call, combined exactly
(`Ensemble.predict`, `Ensemble.personalize`).
"""

import importlib.metadata
import importlib.util
import sys
import time

import numpy as np

try:
  from ai_edge_litert import interpreter as tflite

  RUNTIME = f"ai_edge_litert {importlib.metadata.version('ai-edge-litert')}"
except ImportError:
  from tflite_runtime import interpreter as tflite

  RUNTIME = f"tflite_runtime {importlib.metadata.version('tflite-runtime')}"

from export import ExportError
from export import metadata
from tff_ens.math import personalization

# alpha must sum to 1 within this (float32 rounding of user-computed weights).
ALPHA_SUM_TOLERANCE = 1e-3
# Examples per ensemble signature call: a call's memory grows with its batch (one `personalize`
# call on a Shakespeare role of a K=3 256-unit LSTM ensemble, unrolled, went past 10 GB).
CHUNK_SIZE = 256


def lce_interpreter() -> type:
  """larq-compute-engine's interpreter class (`lce.testing.Interpreter`).

  Its package's `__init__` imports LCE's converter and with it TensorFlow, which the
  interpreter does not use. Without TensorFlow (the device environment) the package is
  registered unexecuted, so that only the interpreter's modules load.
  """
  if importlib.util.find_spec("larq_compute_engine") is None:
    raise ExportError(
      "lce files need larq-compute-engine, which has no wheel for this "
      "platform: run the file where it installs (x86-64, macOS)"
    )
  if importlib.util.find_spec("tensorflow") is None and "larq_compute_engine" not in sys.modules:
    spec = importlib.util.find_spec("larq_compute_engine")
    sys.modules["larq_compute_engine"] = importlib.util.module_from_spec(spec)
  from larq_compute_engine.tflite.python import interpreter

  return interpreter.Interpreter


def load(path: str, num_threads: int = 1) -> "Classifier | Ensemble":
  """The exported file at `path`: an `Ensemble` or a single-model `Classifier`."""
  try:
    with open(path, "rb") as f:
      flatbuffer = f.read()
  except OSError as e:
    raise ExportError(
      f"cannot read {path} ({e.strerror}): pass a .tflite file written by `python -m export`"
    ) from None
  return load_bytes(flatbuffer, num_threads, path)


def load_bytes(
  flatbuffer: bytes, num_threads: int = 1, where: str = "the file"
) -> "Classifier | Ensemble":
  """An exported flatbuffer, as `load` returns it."""
  description = metadata.read(flatbuffer, where)
  kind = Ensemble if description["format"] == "ensemble" else Classifier
  return kind(flatbuffer, description, num_threads)


class _Exported:
  """A flatbuffer, its metadata and the checks of its input."""

  def __init__(self, flatbuffer: bytes, description: dict):
    self.flatbuffer = flatbuffer
    self.metadata = description
    self.class_labels = description["class_labels"]
    self.input_shape = tuple(description["input"]["shape"][1:])
    self.value_range = tuple(description["input"]["value_range"])
    # An int8 input is a quantized float image (`_quantize`); other integers are ids.
    dtype = np.dtype(description["input"]["dtype"])
    self.input_dtype = dtype if np.issubdtype(dtype, np.integer) and dtype != np.int8 else None

  @property
  def size_bytes(self) -> int:
    return len(self.flatbuffer)

  def check_inputs(self, inputs, name: str) -> np.ndarray:
    """`inputs` as the model takes them if they are [n >= 1, *input_shape] in the value
    range: float32 images, or integer ids (0..out_of_vocabulary_id) as the input's dtype."""
    low, high = self.value_range
    shape = ", ".join(map(str, self.input_shape))
    preprocessing = self.metadata["input"]["preprocessing"]
    ids = self.input_dtype is not None
    if ids:
      expected = f"integer ids [n, {shape}] in {low}..{high} ({preprocessing})"
    else:
      expected = f"float32 [n, {shape}] with values in [{low:g}, {high:g}]"
    if not isinstance(inputs, np.ndarray):
      raise ExportError(f"{name} must be a NumPy array of {expected}, got {type(inputs).__name__}")
    dtype_ok = np.issubdtype(inputs.dtype, np.integer) if ids else inputs.dtype == np.float32
    if (
      not dtype_ok
      or inputs.ndim != len(self.input_shape) + 1
      or inputs.shape[1:] != self.input_shape
    ):
      raise ExportError(f"{name} must be {expected}, got {inputs.dtype} {list(inputs.shape)}")
    if not len(inputs):
      raise ExportError(
        f"{name} is empty: pass at least one {'sample' if ids else 'image'} of {expected}"
      )
    if ids:
      if inputs.min() < low or inputs.max() > high:
        raise ExportError(
          f"{name} must be ids in {low}..{high} ({high}: any character outside the "
          f"vocabulary), got {inputs.min()}..{inputs.max()}"
        )
      return inputs.astype(self.input_dtype)
    if not (np.all(np.isfinite(inputs)) and inputs.min() >= low and inputs.max() <= high):
      raise ExportError(
        f"{name} values must be in [{low:g}, {high:g}] ({preprocessing}), got "
        f"{np.nanmin(inputs):g}..{np.nanmax(inputs):g}"
      )
    return inputs


def padded(examples: np.ndarray, size: int) -> np.ndarray:
  """`examples` [m <= size, ...] and copies of its first one, [size, ...]: a fixed-batch
  signature's input, whose outputs past m are dropped (or masked)."""
  return np.concatenate([examples, np.repeat(examples[:1], size - len(examples), axis=0)])


def _chunks(size: int, chunk_size) -> list[slice]:
  """Consecutive slices of at most `chunk_size` of `size` examples."""
  if not (isinstance(chunk_size, (int, np.integer)) and chunk_size >= 1):
    raise ExportError(f"chunk_size must be a positive integer of examples, got {chunk_size!r}")
  return [slice(start, start + chunk_size) for start in range(0, size, chunk_size)]


class Classifier(_Exported):
  """A single exported model (any format but `ensemble`; a `trainable` file predicts
  through its `infer` signature, and trains through `export.device_training`)."""

  def __init__(self, flatbuffer: bytes, description: dict, num_threads: int = 1):
    super().__init__(flatbuffer, description)
    self._infer = None
    if description["runtime"] == metadata.RUNTIME_LCE:
      self._lce = lce_interpreter()(flatbuffer, num_threads=num_threads)
      version = importlib.metadata.version("larq-compute-engine")
      self.runtime = f"larq_compute_engine {version} (lce.testing.Interpreter)"
    elif description["format"] == "trainable":  # Its `infer` signature predicts.
      self._lce = None
      self._infer = tflite.Interpreter(
        model_content=flatbuffer, num_threads=num_threads
      ).get_signature_runner("infer")
      self.runtime = f"{RUNTIME} (Interpreter, infer signature)"
    else:
      self._lce = None
      self._interpreter = tflite.Interpreter(model_content=flatbuffer, num_threads=num_threads)
      self._input = self._interpreter.get_input_details()[0]
      self._output = self._interpreter.get_output_details()[0]
      self._interpreter.allocate_tensors()
      self.runtime = f"{RUNTIME} (Interpreter)"
    self._reset_variables = "reset_variables" in description

  def logits(self, inputs: np.ndarray) -> np.ndarray:
    """float32 [n, classes] logits of inputs [n, *input_shape] (`check_inputs`).

    As many inputs per call as the graph's fixed batch (1 unless exported with
    --static_batch; the last call padded), as an app classifies: some graphs (group
    normalization's reshapes, the fused LSTM) cannot be resized to another batch.
    """
    inputs = self.check_inputs(inputs, "image" if self.input_dtype is None else "ids")
    if self._lce is not None:
      return np.asarray(self._lce.predict(inputs), np.float32)
    if self._infer is not None:
      return self._infer(x=inputs)["logits"]
    batch = self._input["shape"][0]
    outputs = []
    for chunk in _chunks(len(inputs), batch):
      if self._reset_variables:
        self._interpreter.reset_all_variables()
      examples = padded(inputs[chunk], batch)
      self._interpreter.set_tensor(self._input["index"], _quantize(examples, self._input))
      self._interpreter.invoke()
      logits = self._interpreter.get_tensor(self._output["index"])[: len(inputs[chunk])]
      outputs.append(_dequantize(logits, self._output))
    return np.concatenate(outputs)

  def predict_classes(self, inputs: np.ndarray) -> np.ndarray:
    return self.logits(inputs).argmax(-1)


class Ensemble(_Exported):
  """An exported ensemble: `predict(image, alpha)` and `personalize(images, labels)`, in
  chunks of at most `chunk_size` examples per signature call (an ids task's signatures name
  their input `ids`)."""

  def __init__(self, flatbuffer: bytes, description: dict, num_threads: int = 1):
    super().__init__(flatbuffer, description)
    self.ensemble_size = description["ensemble_size"]
    temperature = description.get("personalization_temperature")
    # The run's temperature; null in the metadata is the uniform ensemble's infinity.
    self.temperature = float("inf") if temperature is None else temperature
    interpreter = tflite.Interpreter(model_content=flatbuffer, num_threads=num_threads)
    self._predict = interpreter.get_signature_runner("predict")
    self._personalize = interpreter.get_signature_runner("personalize")
    signatures = interpreter.get_signature_list()
    (self._predict_input,) = set(signatures["predict"]["inputs"]) - {"alpha"}
    (self._personalize_input,) = set(signatures["personalize"]["inputs"]) - {
      "labels",
      "temperature",
      "mask",
    }
    # A fixed-batch file (--static_batch) takes exactly this many examples per call.
    self.static_batch = description.get("static_batch")
    self.runtime = f"{RUNTIME} (Interpreter, signature runners)"

  def uniform_alpha(self) -> np.ndarray:
    return np.full(self.ensemble_size, 1.0 / self.ensemble_size, np.float32)

  def predict(
    self, image: np.ndarray, alpha: np.ndarray | None = None, chunk_size: int = CHUNK_SIZE
  ) -> dict:
    """The `predict` signature: probabilities, member_probabilities, entropy,
    mutual_information for inputs [n, *input_shape] (`check_inputs`) and alpha [K]
    (uniform if None), on chunks of at most `chunk_size` inputs (each input's outputs are
    its own, so the chunks' concatenation is the one-call result to float32 rounding)."""
    image = self.check_inputs(image, self._predict_input)
    alpha = self.uniform_alpha() if alpha is None else self._check_alpha(alpha)
    outputs = []
    for chunk in _chunks(len(image), self.static_batch or chunk_size):
      examples = image[chunk]
      if self.static_batch:
        examples = padded(examples, self.static_batch)
      output = self._predict(**{self._predict_input: examples, "alpha": alpha})
      outputs.append({key: value[: len(image[chunk])] for key, value in output.items()})
    return {key: np.concatenate([o[key] for o in outputs]) for key in outputs[0]}

  def personalize(
    self,
    images: np.ndarray,
    labels: np.ndarray,
    temperature: float | None = None,
    chunk_size: int = CHUNK_SIZE,
  ) -> np.ndarray:
    """alpha [K] = softmax(-loss / temperature) (Fed-ensemble eq. 4) from all the labeled
    images (the run's temperature if None), through the `personalize` signature on chunks
    of at most `chunk_size` of them, so that a call's memory stays bounded.

    The signature returns alpha, not the losses. At temperature 1 a chunk's log alpha is
    -loss_c minus its log-sum-exp, a constant over the members; the size-weighted mean of
    the chunks' log alpha is therefore -loss plus a constant, loss being the mean over all
    images, and `personalization.personalization_weights` of its negation at `temperature`
    is the one-call alpha (softmax ignores the constant). A chunk's alpha_k is at least
    EPSILON / K (a member's loss is at most -log EPSILON, `ensemble_math`), so its log is
    finite in float32.
    """
    if isinstance(images, np.ndarray) and images.ndim >= 1 and not len(images):
      raise ExportError(
        "the personalization set is empty: personalize needs at least one "
        "labeled example (else use the uniform alpha = 1/K)"
      )
    images = self.check_inputs(images, self._personalize_input)
    labels = np.asarray(labels)
    if labels.shape != (len(images),) or not np.issubdtype(labels.dtype, np.integer):
      raise ExportError(
        f"labels must be {len(images)} integers (one per image), got "
        f"{labels.dtype} {list(labels.shape)}"
      )
    if labels.min() < 0 or labels.max() >= len(self.class_labels):
      raise ExportError(
        f"labels must be class indices in 0..{len(self.class_labels) - 1}, "
        f"got {labels.min()}..{labels.max()}"
      )
    temperature = self.temperature if temperature is None else temperature
    if not temperature > 0:
      raise ExportError(f"temperature must be > 0 (inf: uniform), got {temperature}")
    labels = labels.astype(np.int32)
    mean_log_alpha = np.zeros(self.ensemble_size)
    for chunk in _chunks(len(images), self.static_batch or chunk_size):
      inputs = {self._personalize_input: images[chunk], "labels": labels[chunk]}
      if self.static_batch:  # Padded, with a mask of the chunk's examples.
        mask = np.arange(self.static_batch) < len(labels[chunk])
        inputs = {name: padded(x, self.static_batch) for name, x in inputs.items()}
        inputs["mask"] = mask.astype(np.float32)
      alpha = self._personalize(**inputs, temperature=np.float32(1.0))["alpha"]
      mean_log_alpha += len(labels[chunk]) / len(labels) * np.log(alpha.astype(np.float64))
    return personalization.personalization_weights(-mean_log_alpha, temperature).astype(np.float32)

  def _check_alpha(self, alpha) -> np.ndarray:
    alpha = np.asarray(alpha, np.float32)
    k = self.ensemble_size
    if alpha.shape != (k,):
      raise ExportError(
        f"alpha must hold one weight per member, K={k}, got shape {list(alpha.shape)}"
      )
    if not (
      np.all(np.isfinite(alpha))
      and alpha.min() >= 0
      and abs(alpha.sum() - 1) <= ALPHA_SUM_TOLERANCE
    ):
      raise ExportError(
        f"alpha must be K={k} non-negative weights summing to 1 (1/K each "
        f"for the uniform ensemble), got {np.round(alpha, 4).tolist()}"
      )
    return alpha


def _quantize(x: np.ndarray, details: dict) -> np.ndarray:
  """x as the input tensor's type (round(x / scale + zero_point) for a quantized one)."""
  scale, zero_point = details["quantization"]
  if not scale:
    return x.astype(details["dtype"])
  info = np.iinfo(details["dtype"])
  return np.clip(np.round(x / scale + zero_point), info.min, info.max).astype(details["dtype"])


def _dequantize(q: np.ndarray, details: dict) -> np.ndarray:
  if details["dtype"] == np.float32:
    return q
  scale, zero_point = details["quantization"]
  return ((q.astype(np.float32) - zero_point) * scale).astype(np.float32)


def latency_ms(run_once, repeats: int = 50, warmup: int = 5) -> float:
  """Median wall time of `run_once()` in milliseconds, after `warmup` calls."""
  for _ in range(warmup):
    run_once()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run_once()
    times.append(time.perf_counter() - start)
  return 1000 * float(np.median(times))
