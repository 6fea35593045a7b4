"""Converts a trained run to a TFLite flatbuffer, one function per `--format`.

- float: `tf.lite.TFLiteConverter` on the model's inference function for one input (of the
  model's dtype: float32 images, int32 character ids), float32 weights and ops.
- dynamic: the same with `Optimize.DEFAULT` and no representative data: int8 weights,
  float activations (TFLite's dynamic-range quantization).
- int8: full-integer post-training quantization: int8 weights, activations and output
  (and the input, if it is a float image; integer ids stay int32), calibrated on a
  representative dataset of the training clients' inputs.
- qat: quantization-aware training (tensorflow-model-optimization's `quantize_model`),
  fine-tuned for `qat_steps` SGD steps on training writers' examples, then converted with
  `Optimize.DEFAULT` (int8 weights and activations, float input and output).
- lce: a binarized model through larq-compute-engine's converter (1-bit kernels, custom
  ops for LCE's interpreter).
- binary: a binarized model through the stock converter: larq's sign quantizers become
  TFLite SIGN ops and +-1 float kernels, which every TFLite runtime runs.
- trainable: a single model that trains on the device (`trainable`): signatures `train`,
  `infer`, `get_weights`, `set_weights`, builtin ops only, SGD with the run's client
  learning rate and momentum.
- ensemble: the K members of a Fed-ensemble run in one file (`ensemble_module`), float32 or
  with its members quantized (`--quantization=dynamic|int8`, `ensemble_module.QUANTIZATIONS`).

`static_batch` (`--static_batch=N`, for LiteRT.js on the web) fixes every signature's batch
to N (an ensemble's `personalize` and a trainable file's `train` take a mask of the real
examples), keeps an int8 file's input and output float32, unrolls LSTMs, and adds the
`not_sure` threshold to a predicting file's metadata.

Every file carries its description (`metadata`): class labels, the input's dtype and
preprocessing, the outputs; and TFLite's standard metadata (`standard_metadata`). An
LSTM's file keeps its state in variable tensors between invocations (TFLite's fused
UNIDIRECTIONAL_SEQUENCE_LSTM): its metadata says to reset them before each one
(`finalize`), as `on_device` does.
Tensor names are dropped (2.3 kB of a 330 kB ResNet-8): inputs and outputs are found by
position or by signature, whose names stay. Buffers of equal bytes are stored once (the
selective quantizer gives each signature its own copy of the members' weights).
"""

import dataclasses
import hashlib

import larq_compute_engine as lce
import numpy as np
import tensorflow as tf
from tensorflow.lite.tools import flatbuffer_utils
import tensorflow_model_optimization as tfmot

from export import ExportError
from export import ensemble_module
from export import metadata
from export import not_sure
from export import on_device
from export import runs
from export import standard_metadata
from export import trainable

FORMATS = ("float", "dynamic", "int8", "qat", "lce", "binary", "trainable", "ensemble")
QUANTIZATIONS = ensemble_module.QUANTIZATIONS
# Formats built for image models (float inputs): tfmot's QAT, larq's binarized
# convolutions and `trainable`'s layers and gradients (no LSTM among them).
IMAGE_FORMATS = ("qat", "lce", "binary", "trainable")
AUTHOR = "tff-ens (python -m export)"
UNSET_LICENSE = "not set (python -m export --license=...)"
# The formats --static_batch (a fixed batch, for LiteRT.js) does not make, and why.
STATIC_REFUSED = {
  "lce": "lce files run only in LCE's interpreter, which LiteRT.js is not: use --format=binary",
}
# What `finalize` adds to the metadata of a file with variable tensors (an LSTM's state).
RESET_VARIABLES = (
  "the file keeps state in variable tensors (the LSTM's) from one invocation to the next: "
  "reset them before each (Interpreter.resetVariableTensors(); Python: "
  "reset_all_variables()), or the prediction depends on the previous input"
)


@dataclasses.dataclass(frozen=True)
class CalibrationData:
  """Training clients' inputs for int8 calibration and QAT fine-tuning.

  Attributes:
    x: inputs [n, *input_shape] of the run's training clients, of the task's INPUT_DTYPE.
    y: int32 labels [n].
  """

  x: np.ndarray
  y: np.ndarray


@dataclasses.dataclass(frozen=True)
class Options:
  """Settings of the conversions that use training data.

  Attributes:
    representative_examples: inputs calibrating int8 activations, drawn at random (seeded)
      from all training clients' examples.
    qat_steps: SGD steps of quantization-aware fine-tuning.
    qat_learning_rate: their learning rate.
    qat_batch_size: their batch size.
    seed: seeds the draws and the fine-tuning order.
  """

  representative_examples: int = 500
  qat_steps: int = 200
  qat_learning_rate: float = 0.005
  qat_batch_size: int = 20
  seed: int = 0


def check_format(
  run: runs.Run, output_format: str, quantization: str = "float", static_batch: int | None = None
):
  """ExportError unless `run` can be exported as `output_format` with `quantization` (and
  `static_batch`)."""
  if output_format not in FORMATS:
    raise ExportError(f"unknown --format={output_format}: choose one of {', '.join(FORMATS)}")
  if quantization not in QUANTIZATIONS:
    raise ExportError(
      f"unknown --quantization={quantization}: choose one of {', '.join(QUANTIZATIONS)}"
    )
  if quantization != "float" and output_format != "ensemble":
    raise ExportError(
      f"--quantization={quantization} applies to --format=ensemble; a single "
      f"model is quantized by its format: use --format={quantization}"
    )
  if output_format in IMAGE_FORMATS and _takes_ids(run.task):
    raise ExportError(
      f"--format={output_format} takes image models (float inputs), and {run.run_dir} is a "
      f"{run.config.get('task')} run of {np.dtype(run.task.INPUT_DTYPE).name} ids: use "
      f"--format={'ensemble' if run.is_ensemble else 'float, dynamic or int8'}"
    )
  if output_format == "ensemble" and not run.is_ensemble:
    raise ExportError(
      f"--format=ensemble needs an ensemble run (members/member_k.keras); "
      f"{run.run_dir} holds one model: use a single-model format"
    )
  if output_format != "ensemble" and run.is_ensemble:
    raise ExportError(
      f"{run.run_dir} holds an ensemble of {len(run.model_paths)} models: use --format=ensemble"
    )
  if static_batch is not None:
    if not (isinstance(static_batch, int) and static_batch >= 1):
      raise ExportError(f"--static_batch must be a positive number of examples, got {static_batch}")
    if output_format in STATIC_REFUSED:
      raise ExportError(f"--static_batch: {STATIC_REFUSED[output_format]}")
  if output_format in ("lce", "binary") and not run.is_binary:
    raise ExportError(
      f"--format={output_format} needs a run of a binarized model (--model="
      f"{' or '.join(run.task.BINARY_MODEL_NAMES)}); {run.run_dir} trained "
      f"--model={run.config.get('model')}"
    )


def _takes_ids(task) -> bool:
  """Whether `task`'s models take integer ids (Shakespeare's characters), not images."""
  return np.issubdtype(task.INPUT_DTYPE, np.integer)


def describe(
  run: runs.Run,
  output_format: str,
  *,
  quantized_io: bool = False,
  quantization: str = "float",
  static_batch: int | None = None,
  license: str = UNSET_LICENSE,
) -> dict:
  """The metadata of `run` exported as `output_format` (see `metadata`). `quantized_io`:
  int8 output, and int8 input if the task's is float (ids stay the task's INPUT_DTYPE).
  `static_batch`: every signature takes exactly that many inputs (`n` below). `license`:
  the weights' terms, for the standard metadata (`standard_metadata`)."""
  task = run.task
  preprocessing = task.INPUT_DESCRIPTION["preprocessing"]
  quantized_input = quantized_io and not _takes_ids(task)
  input_dtype = "int8" if quantized_input else np.dtype(task.INPUT_DTYPE).name
  if quantized_input:
    preprocessing += (
      "; int8 inputs take round(x / scale + zero_point) with the input tensor's quantization "
      "parameters"
    )
  description = {
    "author": AUTHOR,
    "license": license,
    "version": f"tff-ens {standard_metadata.tff_ens_version()}; "
    + ", ".join(
      f"{key} {run.config[key]}" for key in ("algorithm", "rounds", "seed") if key in run.config
    ),
    "format": output_format,
    "runtime": (metadata.RUNTIME_LCE if output_format == "lce" else metadata.RUNTIME_TFLITE),
    "task": run.task_name,
    "model": run.config.get("model"),
    "algorithm": run.config.get("algorithm"),
    "class_labels": list(task.CLASS_LABELS),
    "input": {
      "shape": [static_batch, *task.INPUT_SHAPE],
      "dtype": input_dtype,
      **task.INPUT_DESCRIPTION,
      "preprocessing": preprocessing,
    },
  }
  if static_batch:
    description["static_batch"] = static_batch
  shape = f"[n, {', '.join(map(str, task.INPUT_SHAPE))}] {input_dtype}"
  description.update(
    _interface(run, output_format, shape, quantized_io, quantization, static_batch)
  )
  return description


def _interface(run, output_format, shape, quantized_io, quantization, static_batch) -> dict:
  """`describe`'s entries of the file's interface: its signatures (an ensemble's, a
  trainable file's) or its output, for inputs of `shape`."""
  task = run.task
  one, many = ensemble_module.input_names(task.INPUT_DTYPE)
  if output_format == "ensemble":
    return dict(
      ensemble_size=len(run.model_paths),
      quantization=quantization,
      # JSON has no infinity; null means the uniform ensemble (an infinite temperature).
      personalization_temperature=_finite_or_none(run.summary.get("personalization_temperature")),
      signatures={
        "predict": f"{one} {shape}, alpha [K] float32 (weights on the "
        "simplex; 1/K each is the uniform ensemble) -> probabilities [n, "
        "classes], member_probabilities [n, K, classes], entropy [n], "
        "mutual_information [n] (nats)",
        "personalize": f"{many} {shape}, labels [n] int32 (n >= 1, the "
        "phone's own labeled examples), temperature [] float32 > 0"
        + (
          f", mask [n] float32 (1: an example, 0: padding of fewer than n={static_batch})"
          if static_batch
          else ""
        )
        + " -> alpha [K] = softmax(-mean cross-entropy of each member / temperature)",
      },
    )
  if output_format == "trainable":
    return dict(
      learning_rate=run.config.get("client_lr"),
      momentum=run.config.get("client_momentum", 0.0),
      signatures={
        "train": f"x {shape}, y [n] int32"
        + (", mask [n] float32 (1: an example, 0: padding)" if static_batch else "")
        + " -> loss [], correct [] (one SGD step on the batch's mean cross-entropy"
        + (" over its examples" if static_batch else "")
        + "; its loss and correct predictions before it)",
        "infer": f"x {shape} -> logits [n, classes]",
        "get_weights": "-> w0, w1, ... (the trainable weights, Keras order)",
        "set_weights": "w0, w1, ... -> num_weights [] (also restarts the momentum)",
      },
    )
  return {
    "output": "logits [n, classes] ("
    + (
      "int8, dequantize with the output tensor's scale and zero point, then "
      if quantized_io
      else ""
    )
    + "softmax for probabilities; argmax indexes class_labels)"
  }


def _finite_or_none(value):
  return None if value is None or not np.isfinite(value) else float(value)


def calibration_data(
  task, data_dir: str | None, examples: int | None, seed: int, data_options: dict | None = None
) -> CalibrationData:
  """`examples` inputs (all if None or fewer) drawn without replacement from all training
  clients (`task.load_data(data_dir, **data_options)`: the run's split,
  `runs.Run.data_options`), in random order (`seed`), as the task's INPUT_DTYPE."""
  train = task.load_data(data_dir, **(data_options or {})).train
  x, y = train.concatenated()
  chosen = np.random.default_rng(seed).permutation(len(y))[:examples]
  return CalibrationData(np.asarray(x[chosen], task.INPUT_DTYPE), y[chosen])


def _representative_dataset(data: CalibrationData, batch: int = 1):
  """TFLite's representative dataset: one single-input batch of `batch` inputs at a time."""

  def generate():
    for start in range(0, len(data.x) - batch + 1, batch):
      yield [data.x[start : start + batch]]

  return generate


def fine_tune_quantization_aware(
  model: tf.keras.Model, data: CalibrationData, options: Options
) -> tf.keras.Model:
  """tfmot's `quantize_model(model)` after `options.qat_steps` SGD steps on `data`.

  Fake-quantization of weights and activations during training (Jacob et al., CVPR 2018,
  Sec. 3) with tfmot's default 8-bit scheme, which folds batch norm into convolutions.
  """
  try:
    qat_model = tfmot.quantization.keras.quantize_model(model)
  except (ValueError, RuntimeError) as e:
    raise ExportError(
      f"--format=qat: tensorflow-model-optimization cannot quantize this "
      f"model ({' '.join(str(e).split())[:200]}); use --format=int8"
    ) from None
  qat_model.compile(
    optimizer=tf.keras.optimizers.SGD(options.qat_learning_rate),
    loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  dataset = (
    tf.data.Dataset.from_tensor_slices((data.x, data.y))
    .shuffle(len(data.y), seed=options.seed)
    .repeat()
    .batch(options.qat_batch_size)
  )
  qat_model.fit(dataset, steps_per_epoch=options.qat_steps, epochs=1, verbose=0)
  return qat_model


def convert_model(
  model: tf.keras.Model,
  output_format: str,
  data: CalibrationData | None = None,
  options: Options = Options(),
  static_batch: int | None = None,
) -> bytes:
  """A single Keras model as a TFLite flatbuffer in `output_format` (without metadata).

  `data` (training clients' examples) is needed by int8 and qat. The input keeps the
  model's dtype; int8 quantizes a float input, never integer ids. With `static_batch` the
  graph takes that many inputs, its LSTMs unrolled (no state kept between calls), and int8
  keeps float32 input and output (LiteRT.js has no int8 tensors).
  """
  if output_format == "lce":
    return lce.convert_keras_model(model)
  if output_format == "qat":
    model = fine_tune_quantization_aware(model, data, options)
  if static_batch:
    model = ensemble_module.unrolled(model)
  # One input per call, as LCE's converter does: group normalization's reshapes do not run
  # in TFLite with an unknown batch size, nor does the fused LSTM (its state has the batch's
  # size).
  input_dtype = model.inputs[0].dtype
  batch = static_batch or 1
  fixed_input = tf.function(lambda x: model(x, training=False)).get_concrete_function(
    tf.TensorSpec([batch, *model.input_shape[1:]], input_dtype)
  )
  converter = tf.lite.TFLiteConverter.from_concrete_functions([fixed_input], model)
  if output_format in ("dynamic", "int8", "qat"):
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
  if output_format == "int8":
    converter.representative_dataset = _representative_dataset(data, batch)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    if not static_batch:
      if input_dtype.is_floating:
        converter.inference_input_type = tf.int8
      converter.inference_output_type = tf.int8
  return converter.convert()


def export_run(
  run: runs.Run,
  output_format: str,
  data_dir: str | None = None,
  options: Options = Options(),
  quantization: str = "float",
  static_batch: int | None = None,
  license: str = UNSET_LICENSE,
) -> bytes:
  """`run` as a TFLite flatbuffer in `output_format`, with its metadata attached.

  `data_dir` (default: the run's) is read for int8, qat and the int8 ensemble, split as the
  run's (`runs.Run.data_options`), and for a `static_batch` file, whose metadata gets the
  `not_sure` threshold (`not_sure`) from its outputs on the run's test inputs. Raises
  ExportError if the format, `quantization` or `static_batch` does not fit the run.
  """
  check_format(run, output_format, quantization, static_batch)
  models = run.load_models()
  if output_format == "ensemble":
    ensemble_module.check_quantization(models, quantization)
  data = None
  if "int8" in (output_format, quantization) or output_format == "qat":
    data = calibration_data(
      run.task,
      data_dir or run.config.get("data_dir"),
      None if output_format == "qat" else options.representative_examples,
      options.seed,
      run.data_options(run.task),
    )
  if output_format == "trainable":
    if run.config.get("client_lr") is None:
      raise ExportError(
        f"{run.run_dir}'s config.json has no client_lr: --format=trainable "
        "trains at the run's client learning rate; export a tff_ens.main run"
      )
    try:
      flatbuffer = trainable.convert_trainable(
        models[0],
        learning_rate=run.config["client_lr"],
        momentum=run.config.get("client_momentum", 0.0),
        static_batch=static_batch,
      )
    except ValueError as e:
      raise ExportError(f"--format=trainable: {e}") from None
  elif output_format == "ensemble":
    flatbuffer = ensemble_module.convert_ensemble(
      models,
      run.task.INPUT_SHAPE,
      quantization,
      run.task.INPUT_DTYPE,
      *((data.x, data.y) if data else ()),
      seed=options.seed,
      static_batch=static_batch,
    )
  else:
    flatbuffer = convert_model(models[0], output_format, data, options, static_batch)
  description = describe(
    run,
    output_format,
    quantization=quantization,
    quantized_io=output_format == "int8" and not static_batch,
    static_batch=static_batch,
    license=license,
  )
  if static_batch and output_format != "trainable":  # A file that predicts: its threshold.
    exported = on_device.load_bytes(finalize(flatbuffer, description))
    description["not_sure"] = not_sure.threshold(
      exported,
      run.task.load_data(data_dir or run.config.get("data_dir"), **run.data_options(run.task)),
      run.summary,
      run.task.INPUT_DTYPE,
      options.seed,
    )
  return finalize(flatbuffer, description)


def finalize(flatbuffer: bytes, description: dict) -> bytes:
  """`flatbuffer` without tensor names, with each distinct buffer stored once and with
  `description` attached (`metadata`), to which a file with variable tensors adds
  `reset_variables` (`RESET_VARIABLES`), and, for a whole description (`describe`'s), with
  TFLite's standard metadata and its labels file (`standard_metadata`).

  By hand rather than with `flatbuffer_utils.strip_strings`, which also deletes the
  signature definitions (the ensemble's `predict` and `personalize`).
  """
  model = flatbuffer_utils.convert_bytearray_to_object(bytearray(flatbuffer))
  # Variable tensors' buffers (their initial values) stay their own.
  variables = {t.buffer for g in model.subgraphs for t in g.tensors if t.isVariable}
  first_of_bytes, same_as = {}, {}
  for i, buffer in enumerate(model.buffers):
    if buffer.data is not None and len(buffer.data) and i not in variables:
      digest = hashlib.sha256(buffer.data.tobytes()).digest()
      same_as[i] = first_of_bytes.setdefault(digest, i)
  for subgraph in model.subgraphs:
    for tensor in subgraph.tensors:
      tensor.name = None
      tensor.buffer = same_as.get(tensor.buffer, tensor.buffer)
  for i, first in same_as.items():
    if first != i:
      model.buffers[i].data = None
  if variables:
    description = {**description, "reset_variables": RESET_VARIABLES}
  metadata.add(model, description)
  if not standard_metadata.applies(description):
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model))
  standard_metadata.add(model, description)
  return standard_metadata.with_associated_files(
    bytes(flatbuffer_utils.convert_object_to_bytearray(model)), description
  )
