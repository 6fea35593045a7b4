"""K Keras models as one TFLite file with `predict` and `personalize` signatures.

The on-device half of Fed-ensemble (Shi et al., arXiv:2107.10663): a phone holds all K
models in one file and

- `predict(image, alpha)` returns the alpha-weighted mixture of the members' softmax
  outputs, the members' outputs, and the mixture's uncertainty (the same quantities as
  `tff_ens.math.metrics.ensemble_uncertainty`);
- `personalize(images, labels, temperature)` returns alpha = softmax(-loss / temperature)
  from the phone's own labeled examples, loss_k being member k's mean cross-entropy on them
  (Sec. IV-C, eq. 3-4; `tff_ens.math.ensemble_math.personalization_weights`). alpha = 1/K is the
  uniform ensemble.

With `static_batch` both signatures take exactly that many inputs (LiteRT.js, the web's
runtime, runs only declared shapes), and `personalize` also takes a `mask` [static_batch]
that leaves padding out of the members' mean losses (`ensemble_math.member_losses`).

A task whose inputs are integer ids (Shakespeare's characters) names them `ids` in both
signatures (`input_names`). Its LSTM members are converted unrolled (Keras' `unroll=True`,
the same weights): the fused LSTM of a single model (`export.convert`) converts for a fixed
batch size only, and the signatures take n inputs; unrolled, the members also keep no state
between calls.

The math is `tff_ens.math.ensemble_math`'s, the formulas the NumPy evaluation computes, here on
`tf.experimental.numpy` in float32, so the two agree to float32 rounding.

`quantization` (`QUANTIZATIONS`) shrinks the members, which hold all the weights:

- float: float32 everywhere.
- dynamic: TFLite's dynamic-range quantization (int8 weights, float activations).
- int8: the members' ops with int8 weights and activations, calibrated on labeled images
  through both signatures; the mixture and personalization math keeps float32, as do the
  inputs and outputs. TFLite's selective quantization (`QuantizationDebugger` with the math's
  op types denylisted), without the quantize-dequantize pairs it leaves after each member's
  softmax: fully quantized, alpha would come out of an int8 softmax, 1/256 steps that do not
  sum to one. Not for LSTM members (`ExportError`): their unrolled gates use the math's op
  types (MUL, ADD, PACK), so the math would be quantized with them.
"""

import collections
import functools

import numpy as np
import tensorflow as tf
import tensorflow.experimental.numpy as tnp
from tensorflow.lite.python import schema_py_generated as schema
from tensorflow.lite.tools import flatbuffer_utils

from export import ExportError
from tff_ens.math import ensemble_math

SIGNATURES = ("predict", "personalize")
QUANTIZATIONS = ("float", "dynamic", "int8")


class EnsembleModule(tf.Module):
  """The K members and the two signatures (see the module docstring), for inputs of
  `input_dtype` [n, *input_shape].

  TFLite names a signature after its Python function, hence the nested `predict` and
  `personalize`, whose alpha length is fixed to K.
  """

  def __init__(
    self,
    members: list[tf.keras.Model],
    input_shape: tuple[int, ...],
    input_dtype,
    static_batch: int | None = None,
  ):
    super().__init__(name="ensemble")
    self.members = [unrolled(m) for m in members]
    image = tf.TensorSpec([static_batch, *input_shape], input_dtype)
    one, many = input_names(input_dtype)

    def predict(image, alpha):
      member_probs = self.member_probabilities(image)
      probabilities, predictive_entropy, mutual_information = ensemble_math.mixture_uncertainty(
        member_probs, alpha, tnp
      )
      return {
        "probabilities": probabilities,
        "member_probabilities": tf.transpose(member_probs, [1, 0, 2]),
        "entropy": predictive_entropy,
        "mutual_information": mutual_information,
      }

    def personalize(images, labels, temperature, mask=None):
      losses = ensemble_math.member_losses(self.member_probabilities(images), labels, tnp, mask)
      return {"alpha": ensemble_math.personalization_weights(losses, temperature, tnp)}

    self.predict = tf.function(
      predict,
      input_signature=[
        tf.TensorSpec.from_spec(image, name=one),
        tf.TensorSpec([len(members)], tf.float32, name="alpha"),
      ],
    )
    # A fixed batch pads the examples to `static_batch`: the mask says which are real.
    self.personalize = tf.function(
      personalize,
      input_signature=[
        tf.TensorSpec.from_spec(image, name=many),
        tf.TensorSpec([static_batch], tf.int32, name="labels"),
        tf.TensorSpec([], tf.float32, name="temperature"),
        *([tf.TensorSpec([static_batch], tf.float32, name="mask")] if static_batch else []),
      ],
    )

  def member_probabilities(self, images):
    """[K, n, classes] softmax outputs of the members (inference mode)."""
    return tf.stack([tf.nn.softmax(m(images, training=False)) for m in self.members])


def input_names(input_dtype) -> tuple[str, str]:
  """The input's name in `predict` and in `personalize`: image(s), or ids for integer ids."""
  return ("ids", "ids") if np.issubdtype(input_dtype, np.integer) else ("image", "images")


def unrolled(model: tf.keras.Model) -> tf.keras.Model:
  """`model` with its LSTM layers unrolled (`unroll=True`) and the same weights; `model`
  itself if it has none."""
  if not _has_lstm(model):
    return model

  def clone(layer):
    config = layer.get_config()
    if isinstance(layer, tf.keras.layers.LSTM):
      config["unroll"] = True
    return type(layer).from_config(config)

  copy = tf.keras.models.clone_model(model, clone_function=clone)
  copy.set_weights(model.get_weights())
  return copy


def _has_lstm(model: tf.keras.Model) -> bool:
  return any(isinstance(layer, tf.keras.layers.LSTM) for layer in model.layers)


def _converter(module: EnsembleModule) -> tf.lite.TFLiteConverter:
  return tf.lite.TFLiteConverter.from_concrete_functions(
    [module.predict.get_concrete_function(), module.personalize.get_concrete_function()], module
  )


def operator_types(flatbuffer: bytes) -> set[str]:
  """The builtin operator names ("CONV_2D", ...) a TFLite flatbuffer uses."""
  names = {
    code: name for name, code in vars(schema.BuiltinOperator).items() if not name.startswith("_")
  }
  model = flatbuffer_utils.convert_bytearray_to_object(bytearray(flatbuffer))
  return {names[max(c.builtinCode, c.deprecatedBuiltinCode)] for c in model.operatorCodes}


def _calibration_inputs(
  inputs: np.ndarray,
  labels: np.ndarray,
  ensemble_size: int,
  seed: int,
  batch_size: int = 10,
  masked: bool = False,
):
  """TFLite's representative dataset for both signatures: full batches of `inputs` with
  alpha drawn from Dir(1) for `predict`, their `labels` (and, `masked`, a mask of ones) for
  `personalize` (TFLite's calibrator resizes the inputs but not the labels to a last,
  smaller batch)."""
  one, many = input_names(inputs.dtype)

  def generate():
    rng = np.random.default_rng(seed)
    for start in range(0, len(labels) - batch_size + 1, batch_size):
      batch = slice(start, start + batch_size)
      alpha = rng.dirichlet(np.ones(ensemble_size)).astype(np.float32)
      yield "predict", {one: inputs[batch], "alpha": alpha}
      mask = {"mask": np.ones(batch_size, np.float32)} if masked else {}
      yield (
        "personalize",
        {
          many: inputs[batch],
          "labels": labels[batch].astype(np.int32),
          "temperature": np.float32(1.0),
          **mask,
        },
      )

  return generate


def check_quantization(members: list[tf.keras.Model], quantization: str):
  """ExportError if `members` cannot be quantized as `quantization` (module docstring)."""
  if quantization == "int8" and _has_lstm(members[0]):
    raise ExportError(
      "--quantization=int8 cannot keep an LSTM ensemble's mixture and personalization float "
      "(the unrolled LSTM's MUL, ADD and PACK are the math's op types, and personalize's "
      "alpha comes out 1/K): use --quantization=dynamic"
    )


def convert_ensemble(
  members: list[tf.keras.Model],
  input_shape: tuple[int, ...],
  quantization: str,
  input_dtype,
  inputs: np.ndarray | None = None,
  labels: np.ndarray | None = None,
  seed: int = 0,
  static_batch: int | None = None,
) -> bytes:
  """One TFLite flatbuffer with the `predict` and `personalize` signatures for inputs of
  `input_dtype` [n, *input_shape], n any or exactly `static_batch` (then `personalize`
  takes a `mask` [static_batch] of the real examples).

  `quantization` is one of `QUANTIZATIONS` (module docstring); int8 calibrates on labeled
  `inputs` (of `input_dtype`) and `labels` [n].
  """
  check_quantization(members, quantization)
  module = functools.partial(
    EnsembleModule, input_shape=input_shape, input_dtype=input_dtype, static_batch=static_batch
  )
  converter = _converter(module(members))
  if quantization == "float":
    return converter.convert()
  converter.optimizations = [tf.lite.Optimize.DEFAULT]
  if quantization == "dynamic":
    return converter.convert()
  # The math's op types: those of a two-member ensemble (one member folds the mixture's
  # stack and sum away) that a member alone does not use, and RESHAPE, which the math
  # shares with the members' flatten: alpha[:, None] quantized would not sum to one.
  math_ops = {"RESHAPE"} | (
    operator_types(_converter(module(members[:2])).convert())
    - operator_types(tf.lite.TFLiteConverter.from_keras_model(unrolled(members[0])).convert())
  )
  converter.representative_dataset = _calibration_inputs(
    inputs,
    labels,
    len(members),
    seed,
    **({"batch_size": static_batch, "masked": True} if static_batch else {}),
  )
  debugger = tf.lite.experimental.QuantizationDebugger(
    converter=converter,
    debug_dataset=converter.representative_dataset,
    debug_options=tf.lite.experimental.QuantizationDebugOptions(denylisted_ops=sorted(math_ops)),
  )
  return _drop_fake_quantization(debugger.get_nondebug_quantized_model())


def _drop_fake_quantization(flatbuffer: bytes) -> bytes:
  """`flatbuffer` without QUANTIZE -> DEQUANTIZE pairs from float32 to float32.

  The selective quantizer leaves such a pair after each member's float softmax (an op with a
  fixed output range): the probabilities would be rounded to steps of 1/256, and a rounded
  zero would cost a personalization loss of -log(1e-12).
  """
  model = flatbuffer_utils.convert_bytearray_to_object(bytearray(flatbuffer))
  code = [max(c.builtinCode, c.deprecatedBuiltinCode) for c in model.operatorCodes]
  replaced = []  # Per subgraph: the pair's float output -> its float input.
  for subgraph in model.subgraphs:
    producer = {out: op for op in subgraph.operators for out in op.outputs}
    consumers = collections.Counter(i for op in subgraph.operators for i in op.inputs)
    replace, dropped = {}, set()
    for op in subgraph.operators:
      if code[op.opcodeIndex] != schema.BuiltinOperator.DEQUANTIZE:
        continue
      quantize = producer.get(op.inputs[0])
      if (
        quantize is not None
        and code[quantize.opcodeIndex] == schema.BuiltinOperator.QUANTIZE
        and subgraph.tensors[quantize.inputs[0]].type == schema.TensorType.FLOAT32
        and consumers[op.inputs[0]] == 1
      ):
        replace[op.outputs[0]] = quantize.inputs[0]
        dropped.update((id(op), id(quantize)))
    subgraph.operators = [op for op in subgraph.operators if id(op) not in dropped]
    for op in subgraph.operators:
      op.inputs = [replace.get(i, i) for i in op.inputs]
    subgraph.outputs = [replace.get(i, i) for i in subgraph.outputs]
    replaced.append(replace)
  for signature in model.signatureDefs:
    for output in signature.outputs:
      output.tensorIndex = replaced[signature.subgraphIndex].get(
        output.tensorIndex, output.tensorIndex
      )
  return bytes(flatbuffer_utils.convert_object_to_bytearray(model))
