"""A Keras model as a TFLite file that trains itself on a device, from builtin ops only.

The file has four signatures (TFLite's on-device training recipe, with resource variables):

- `train(x [n, *input_shape] float32, y [n] int32) -> {"loss": [], "correct": []}`: one SGD
  step on the batch's mean sparse softmax cross-entropy, as Keras' `SGD(learning_rate,
  momentum)` with `SparseCategoricalCrossentropy(from_logits=True)` takes it:
  v <- momentum v - lr g, w <- w + v (w <- w - lr g without momentum); `loss` is the batch's
  loss and `correct` its number of correct predictions, both before the step.
- `infer(x) -> {"logits": [n, classes]}`.
- `get_weights() -> {"w0": ..., "w1": ...}`: the trainable weights, in the order of
  `model.trainable_variables`.
- `set_weights(w0, w1, ...) -> {"num_weights": []}`: replaces them and zeroes the momentum
  buffers, since a federated client starts each round from the server's weights with a fresh
  optimizer. (The output is there because the converter drops a signature without outputs,
  assignments included.)

TFLite's builtin ops have no gradient kernels (ReluGrad, MaxPoolGrad, Conv2DBackpropFilter,
SparseSoftmaxCrossEntropyWithLogits are Flex ops, which LiteRT without the Flex delegate
cannot run). So the forward pass is written here from the model's layers and variables, and
every layer's gradient is spelled out with `tf.custom_gradient` in ops that convert to
builtins (see each function). Supported layers: Conv2D (channels_last, no dilation or groups,
padding same/valid, activation relu/linear), MaxPooling2D (pool size = strides), Flatten, Dense
(activation relu/linear).
"""

import functools
import math
import tempfile
from typing import Callable

import numpy as np
import tensorflow as tf

from export.device_training import SIGNATURES
from export.device_training import weight_name

ACTIVATIONS = ("relu", "linear")
SUPPORTED_LAYERS = (
  "Conv2D (padding same/valid, activation relu/linear), MaxPooling2D "
  "(pool_size == strides), Flatten, Dense (activation relu/linear)"
)


@tf.custom_gradient
def relu(x):
  """max(x, 0); gradient dy * [y > 0] (TF's ReluGrad, which is not a TFLite builtin)."""
  y = tf.nn.relu(x)

  def grad(dy):
    return tf.where(y > 0, dy, tf.zeros_like(dy))

  return y, grad


@tf.custom_gradient
def dense(x, kernel, bias):
  """x W + b; gradients dy W^T, x^T dy and sum_n dy (no BiasAddGrad or broadcast shapes)."""
  y = tf.matmul(x, kernel) + bias

  def grad(dy):
    return (
      tf.matmul(dy, kernel, transpose_b=True),
      tf.matmul(x, dy, transpose_a=True),
      tf.reduce_sum(dy, axis=0),
    )

  return y, grad


def _same_padding(size: int, window: int, stride: int) -> tuple[int, int]:
  """TF's "SAME" padding (before, after) of one spatial axis."""
  total = max((math.ceil(size / stride) - 1) * stride + window - size, 0)
  return total // 2, total - total // 2


def conv2d(x, kernel, bias, strides: tuple[int, int], padding: str):
  """tf.nn.conv2d(x, kernel) + bias (NHWC, HWIO), with builtin-only gradients.

  dL/dx is conv2d_transpose(dy, kernel) (TFLite TRANSPOSE_CONV). dL/dkernel, TF's
  Conv2DBackpropFilter, is a matrix product of the input's patches and dy:
  dW[i, j, c, o] = sum_{n, h, w} x_pad[n, s h + i, s w + j, c] dy[n, h, w, o]. The patches
  are strided slices of x_pad, one per kernel offset (i, j), taken channels-first so that
  both factors are [rows, n h w] and the product is one FULLY_CONNECTED, with no transpose
  of the [n h w, kh kw c] patch matrix (1.8 times faster for the LEAF CNN's first layer in
  LiteRT). (As a convolution of x_pad by dy, batch and channels swapped, it would be a
  CONV_2D with the batch size as channels, which the converter rejects when it is unknown.)
  """
  kernel_h, kernel_w, channels, filters = kernel.shape
  height, width = x.shape[1:3]
  if padding == "SAME":
    pads = [_same_padding(height, kernel_h, strides[0]), _same_padding(width, kernel_w, strides[1])]
    out_h, out_w = math.ceil(height / strides[0]), math.ceil(width / strides[1])
  else:
    pads = [(0, 0), (0, 0)]
    out_h = (height - kernel_h) // strides[0] + 1
    out_w = (width - kernel_w) // strides[1] + 1

  @tf.custom_gradient
  def convolve(x, kernel, bias):
    y = tf.nn.conv2d(x, kernel, [1, *strides, 1], padding) + bias

    def grad(dy):
      dx = tf.nn.conv2d_transpose(dy, kernel, tf.shape(x), [1, *strides, 1], padding)
      x_pad = tf.transpose(tf.pad(x, [[0, 0], *pads, [0, 0]]), [3, 0, 1, 2])  # [c, n, h, w]
      patches = tf.concat(
        [
          x_pad[
            :,
            :,
            i : i + strides[0] * (out_h - 1) + 1 : strides[0],
            j : j + strides[1] * (out_w - 1) + 1 : strides[1],
          ]
          for i in range(kernel_h)
          for j in range(kernel_w)
        ],
        axis=0,
      )
      dkernel = tf.matmul(
        tf.reshape(patches, [kernel_h * kernel_w * channels, -1]),
        tf.reshape(tf.transpose(dy, [3, 0, 1, 2]), [filters, -1]),
        transpose_b=True,
      )
      dkernel = tf.reshape(dkernel, kernel.shape)
      return dx, dkernel, tf.reduce_sum(dy, axis=[0, 1, 2])

    return y, grad

  return convolve(x, kernel, bias)


def _windows_to_channels(t, pool: tuple[int, int]):
  """[n, h ph, w pw, c] -> [n, h, w, ph pw c], window offsets (i, j) row-major, then c
  (SPACE_TO_DEPTH for square windows)."""
  (_, height, width, channels), (ph, pw) = t.shape, pool
  if ph == pw:
    return tf.nn.space_to_depth(t, ph)
  t = tf.reshape(t, [-1, height // ph, ph, width // pw, pw, channels])
  return tf.reshape(
    tf.transpose(t, [0, 1, 3, 2, 4, 5]), [-1, height // ph, width // pw, ph * pw * channels]
  )


def _channels_to_windows(t, pool: tuple[int, int]):
  """The inverse of `_windows_to_channels` (DEPTH_TO_SPACE for square windows)."""
  (_, height, width, depth), (ph, pw) = t.shape, pool
  if ph == pw:
    return tf.nn.depth_to_space(t, ph)
  t = tf.reshape(t, [-1, height, width, ph, pw, depth // (ph * pw)])
  return tf.reshape(
    tf.transpose(t, [0, 1, 3, 2, 4, 5]), [-1, height * ph, width * pw, depth // (ph * pw)]
  )


def max_pool2d(x, pool: tuple[int, int], padding: str):
  """tf.nn.max_pool2d with strides = pool size, with a builtin-only gradient.

  TF's MaxPoolGrad gives each window's dy to the window's first input (row-major) equal to
  its maximum. Here the windows' inputs are moved to channels (one [n, h, w, c] part per
  offset (i, j)), and the offsets in row-major order take what is left of dy where they
  equal the maximum: dx_k = [x_k = y] r_k, r_{k+1} = [x_k != y] r_k, r_0 = dy (selects, so
  no NaN * 0). "SAME" pads x with -inf to whole windows, "VALID" crops it to them.
  """
  height, width = x.shape[1:3]
  if padding == "SAME":
    out_h, out_w = math.ceil(height / pool[0]), math.ceil(width / pool[1])
    pads = [_same_padding(height, pool[0], pool[0]), _same_padding(width, pool[1], pool[1])]
  else:
    out_h, out_w = height // pool[0], width // pool[1]
    pads = [(0, out_h * pool[0] - height), (0, out_w * pool[1] - width)]  # <= 0: a crop

  @tf.custom_gradient
  def pool_max(x):
    y = tf.nn.max_pool2d(x, pool, pool, padding)

    def grad(dy):
      windows = tf.pad(
        x, [[0, 0], *[[max(p, 0) for p in axis] for axis in pads], [0, 0]], constant_values=-np.inf
      )[:, : out_h * pool[0], : out_w * pool[1], :]
      parts, rest = [], dy
      for offset in tf.split(_windows_to_channels(windows, pool), pool[0] * pool[1], axis=3):
        is_max = tf.equal(offset, y)
        parts.append(tf.where(is_max, rest, 0.0))
        rest = tf.where(is_max, 0.0, rest)
      dx = _channels_to_windows(tf.concat(parts, axis=3), pool)
      top, left = max(pads[0][0], 0), max(pads[1][0], 0)
      dx = dx[:, top : top + height, left : left + width, :]
      return tf.pad(dx, [[0, 0], [0, height - dx.shape[1]], [0, width - dx.shape[2]], [0, 0]])

    return y, grad

  return pool_max(x)


@tf.custom_gradient
def mean_cross_entropy(logits, one_hot_labels):
  """mean_n -log softmax(logits_n)[y_n]; gradient (softmax - one_hot) / n (TF's
  SparseSoftmaxCrossEntropyWithLogits is not a TFLite builtin)."""
  log_probs = tf.nn.log_softmax(logits)
  loss = -tf.reduce_mean(tf.reduce_sum(one_hot_labels * log_probs, axis=1))

  def grad(dloss):
    n = tf.cast(tf.shape(logits)[0], logits.dtype)
    return dloss * (tf.exp(log_probs) - one_hot_labels) / n, None

  return loss, grad


@tf.custom_gradient
def masked_mean_cross_entropy(logits, one_hot_labels, mask):
  """`mean_cross_entropy` over the examples of mask 1 only (a fixed batch's real ones, the
  rest padding): sum_n m_n ce_n / sum_n m_n; gradient m_n (softmax - one_hot) / sum_n m_n,
  a select, so that padding adds exact zeros."""
  log_probs = tf.nn.log_softmax(logits)
  real = mask > 0
  losses = tf.where(real, -tf.reduce_sum(one_hot_labels * log_probs, axis=1), 0.0)
  count = tf.reduce_sum(mask)
  loss = tf.reduce_sum(losses) / count

  def grad(dloss):
    dlogits = tf.where(real[:, None], dloss * (tf.exp(log_probs) - one_hot_labels) / count, 0.0)
    return dlogits, None, None

  return loss, grad


def _activation(layer) -> Callable:
  name = layer.get_config().get("activation")
  if name not in ACTIVATIONS:
    raise ValueError(
      f"layer {layer.name!r} ({type(layer).__name__}) has activation {name!r}: "
      f"convert_trainable supports {' and '.join(ACTIVATIONS)}"
    )
  return relu if name == "relu" else tf.identity


def _unsupported(layer, why: str) -> ValueError:
  return ValueError(
    f"layer {layer.name!r} ({type(layer).__name__}{why}) cannot be trained with "
    f"TFLite builtins: convert_trainable supports {SUPPORTED_LAYERS}"
  )


def _conv2d_layer(x, kernel, bias, *, activation, strides, padding):
  return activation(conv2d(x, kernel, bias, strides, padding))


def _dense_layer(x, kernel, bias, *, activation):
  return activation(dense(x, kernel, bias))


def _layer_steps(model: tf.keras.Model) -> list[tuple[Callable, list]]:
  """(apply(x, *weights), the layer's weight variables) for each layer of `model`, or a
  ValueError naming the first layer this module cannot train as Keras would."""
  layers_lib = tf.keras.layers
  steps = []
  for layer in model.layers:
    kind = type(layer)
    if kind is layers_lib.InputLayer:
      continue
    config = layer.get_config()
    if layer.compute_dtype != "float32":
      raise _unsupported(layer, f" computing in {layer.compute_dtype}")
    # Keras adds regularizers to the loss and applies constraints after each step.
    extras = [
      k for k, v in config.items() if k.endswith(("_regularizer", "_constraint")) and v is not None
    ]
    if extras:
      raise _unsupported(layer, f" with {', '.join(extras)}")
    if config.get("data_format", "channels_last") != "channels_last":
      raise _unsupported(layer, " with channels_first")
    if kind is layers_lib.Conv2D:
      if (
        tuple(config["dilation_rate"]) != (1, 1) or config["groups"] != 1 or not config["use_bias"]
      ):
        raise _unsupported(layer, " with dilation, groups or no bias")
      steps.append(
        (
          functools.partial(
            _conv2d_layer,
            activation=_activation(layer),
            strides=tuple(config["strides"]),
            padding=config["padding"].upper(),
          ),
          [layer.kernel, layer.bias],
        )
      )
    elif kind is layers_lib.MaxPool2D:
      if tuple(config["pool_size"]) != tuple(config["strides"]):
        raise _unsupported(layer, " with strides != pool_size")
      steps.append(
        (
          functools.partial(
            max_pool2d, pool=tuple(config["pool_size"]), padding=config["padding"].upper()
          ),
          [],
        )
      )
    elif kind is layers_lib.Flatten:
      steps.append(
        (functools.partial(tf.reshape, shape=[-1, math.prod(layer.input_shape[1:])]), [])
      )
    elif kind is layers_lib.Dense:
      if not config["use_bias"] or len(layer.input_shape) != 2:
        raise _unsupported(layer, " without bias or on a [n, ...] input of rank > 2")
      steps.append(
        (functools.partial(_dense_layer, activation=_activation(layer)), [layer.kernel, layer.bias])
      )
    else:
      raise _unsupported(layer, "")
  return steps


class TrainableModule(tf.Module):
  """The model's trainable weights (`w0`, ...), momentum buffers and the four signatures."""

  def __init__(
    self,
    model: tf.keras.Model,
    learning_rate: float,
    momentum: float = 0.0,
    static_batch: int | None = None,
  ):
    super().__init__(name="trainable")
    if not isinstance(model, tf.keras.Sequential):
      raise ValueError(
        f"model {model.name!r} is a {type(model).__name__}: convert_trainable "
        "supports Sequential models of " + SUPPORTED_LAYERS
      )
    input_shape = tuple(model.input_shape[1:])
    if None in input_shape:
      raise ValueError(
        f"model {model.name!r} has input shape {input_shape}: "
        "convert_trainable needs every dimension but the batch known"
      )
    steps = _layer_steps(model)
    position = {id(v): i for i, v in enumerate(model.trainable_variables)}
    self.weights = [
      tf.Variable(v.numpy(), name=weight_name(i)) for i, v in enumerate(model.trainable_variables)
    ]
    # Keras' velocities v start at 0. They are stored as variables initialized to copies of
    # the weights, which the converter stores once for both, and a flag that is 0 until the
    # first step: zeros of the weights' shapes would be a second copy of the model in the
    # file, and variables of unknown shape (a scalar 0 broadcast in the first step) corrupt
    # memory in LiteRT 2.3 with its default XNNPACK delegate.
    self.velocities = (
      [tf.Variable(w.numpy(), name=f"velocity{i}") for i, w in enumerate(self.weights)]
      if momentum > 0
      else []
    )
    if self.velocities:
      self.velocity_started = tf.Variable(0.0, name="velocity_started")
    # A non-trainable layer weight is a constant of the file.
    self._steps = [
      (
        apply,
        [
          self.weights[position[id(v)]] if id(v) in position else tf.constant(v.numpy())
          for v in variables
        ],
      )
      for apply, variables in steps
    ]
    self.learning_rate = learning_rate
    self.momentum = momentum
    self.num_classes = model.output_shape[-1]
    x_spec = tf.TensorSpec([static_batch, *input_shape], tf.float32, name="x")
    y_spec = tf.TensorSpec([static_batch], tf.int32, name="y")
    if static_batch is None:
      self.train = tf.function(self._train, input_signature=[x_spec, y_spec])
    else:
      mask_spec = tf.TensorSpec([static_batch], tf.float32, name="mask")
      self.train = tf.function(self._masked_train, input_signature=[x_spec, y_spec, mask_spec])
    self.infer = tf.function(lambda x: {"logits": self.logits(x)}, input_signature=[x_spec])
    self.get_weights = tf.function(
      lambda: {weight_name(i): tf.identity(w) for i, w in enumerate(self.weights)},
      input_signature=[],
    )
    self.set_weights = tf.function(
      self._set_weights,
      input_signature=[
        tf.TensorSpec(w.shape, w.dtype, name=weight_name(i)) for i, w in enumerate(self.weights)
      ],
    )

  def logits(self, x):
    for apply, weights in self._steps:
      x = apply(x, *[tf.convert_to_tensor(w) for w in weights])
    return x

  def _train(self, x, y):
    with tf.GradientTape() as tape:
      logits = self.logits(x)
      loss = mean_cross_entropy(logits, tf.one_hot(y, self.num_classes))
    # Before the step, as Keras and TFF's client work count training accuracy.
    correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, tf.int32), y), tf.float32))
    self._step(tape.gradient(loss, self.weights))
    return {"loss": loss, "correct": correct}

  def _masked_train(self, x, y, mask):
    """`_train` on the examples of mask 1 (`masked_mean_cross_entropy`), the rest padding."""
    with tf.GradientTape() as tape:
      logits = self.logits(x)
      loss = masked_mean_cross_entropy(logits, tf.one_hot(y, self.num_classes), mask)
    hits = tf.equal(tf.argmax(logits, -1, tf.int32), y)
    correct = tf.reduce_sum(tf.where(mask > 0, tf.cast(hits, tf.float32), 0.0))
    self._step(tape.gradient(loss, self.weights))
    return {"loss": loss, "correct": correct}

  def _step(self, grads):
    """SGD(M) on the weights (module docstring)."""
    if self.velocities:
      started = self.velocity_started > 0
      for w, v, g in zip(self.weights, self.velocities, grads):
        # A select, not v * 0: a velocity left NaN by a diverged round must not leak into
        # the next one.
        v.assign(-g * self.learning_rate + tf.where(started, v * self.momentum, 0.0))
        w.assign_add(v)
      self.velocity_started.assign(1.0)
    else:
      for w, g in zip(self.weights, grads):
        w.assign_sub(g * self.learning_rate)

  def _set_weights(self, *weights):
    for w, value in zip(self.weights, weights):
      w.assign(value)
    if self.velocities:
      self.velocity_started.assign(0.0)
    # A signature without outputs is dropped with its assignments by the converter.
    return {"num_weights": tf.constant(len(weights), tf.int32)}


def convert_trainable(
  model: tf.keras.Model,
  *,
  learning_rate: float,
  momentum: float = 0.0,
  static_batch: int | None = None,
) -> bytes:
  """`model` as a TFLite flatbuffer with the `train`, `infer`, `get_weights` and
  `set_weights` signatures (module docstring), builtin ops and resource variables only.

  `static_batch` (for runtimes that run only declared shapes, LiteRT.js): `train` and `infer`
  take exactly that many examples, and `train` a third input, `mask [static_batch]` float32,
  1 for a real example and 0 for padding, and steps on the mean over the real ones (a last
  partial batch padded to the size trains as the dynamic file's smaller batch does).
  """
  if not learning_rate > 0 or not momentum >= 0:
    raise ValueError(
      f"learning_rate must be > 0 and momentum >= 0, got {learning_rate} and {momentum}"
    )
  if static_batch is not None and not (isinstance(static_batch, int) and static_batch >= 1):
    raise ValueError(f"static_batch must be a positive number of examples, got {static_batch}")
  module = TrainableModule(model, learning_rate, momentum, static_batch)
  with tempfile.TemporaryDirectory() as saved_model_dir:
    tf.saved_model.save(
      module,
      saved_model_dir,
      signatures={name: getattr(module, name).get_concrete_function() for name in SIGNATURES},
    )
    converter = tf.lite.TFLiteConverter.from_saved_model(
      saved_model_dir, signature_keys=list(SIGNATURES)
    )
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    converter.experimental_enable_resource_variables = True
    return converter.convert()
