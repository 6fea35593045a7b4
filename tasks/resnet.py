"""CIFAR-style residual networks, independent of any task.

He, Zhang, Ren and Sun, "Deep Residual Learning for Image Recognition", CVPR 2016, section
4.2: a 3x3 convolution, three stages of n basic blocks (two 3x3 convolutions each) with
width, 2 * width and 4 * width filters, global average pooling and a dense layer, so
depth = 6n + 2 (ResNet-8: n = 1, ResNet-20: n = 3). The second and third stages halve the
spatial size in their first block, whose shortcut is then a strided 1x1 convolution
(option B of the paper).

`build_binary_resnet` is the same network with 1-bit weights and activations in the blocks
(larq: Geiger and Team, "Larq: An Open-Source Library for Training Binarized Neural
Networks", JOSS 2020): every 3x3 convolution inside the residual blocks binarizes its input
and its kernel with the sign function and a straight-through gradient (Courbariaux et al.,
"Binarized Neural Networks", NeurIPS 2016; BNN's ste_sign), latent kernels clipped to
[-1, 1] after each step (`kernel_constraint`); the first convolution, the strided 1x1
shortcuts and the dense layer stay in full precision, as usual (Rastegari et al.,
"XNOR-Net", ECCV 2016; Liu et al., "Bi-Real Net", ECCV 2018). FedDF (Lin et al., NeurIPS
2020) trains such a binarized ResNet-8 federatedly in its Table 4.

Normalization is batch norm as in the paper or group norm (Wu and He, ECCV 2018), which does
not depend on batch statistics and is the usual choice under non-i.i.d. federated training
(Hsieh et al., ICML 2020).
"""

from collections.abc import Iterator

import larq as lq
import numpy as np
import tensorflow as tf

NORMS = ("batch", "group")
# Binarized activations shift as latent weights flip sign, so batch norm's moving
# statistics must follow faster than Keras' default 0.99 (larq's model zoo uses 0.9).
BINARY_BATCH_NORM_MOMENTUM = 0.9


# How the binarized ResNets train well federatedly (docs/algorithms.md; benchmarks/RESULTS.md,
# "A binarized ResNet-8 worth shipping"): the flags the CLI sets for them unless given. Adam
# on the latent weights (larq's guides), and batch-norm statistics measured on server images
# after each round, since the clients' statistics belong to their own binary weights.
BINARY_RECIPE = {"client_optimizer": "adam", "client_lr": 0.01, "recalibrate_batch_norm": 500}


def seed_stream(seed: int) -> Iterator[int]:
  """Yields distinct initializer seeds derived from `seed`, one per layer that needs one."""
  rng = np.random.default_rng(seed)
  while True:
    yield int(rng.integers(2**31 - 1))


def _check(depth, norm: str):
  if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
    raise ValueError(f"ResNet depth must be 6n+2 with n >= 1 (8, 14, 20, 32, ...), got {depth!r}")
  if norm not in NORMS:
    raise ValueError(f"unknown norm {norm!r}: choose one of {', '.join(NORMS)}")


def _normalization(
  norm: str, group_norm_groups: int, batch_norm_momentum: float = 0.99
) -> tf.keras.layers.Layer:
  if norm == "batch":
    return tf.keras.layers.BatchNormalization(momentum=batch_norm_momentum)
  return tf.keras.layers.GroupNormalization(groups=group_norm_groups)


def build_resnet(
  depth: int,
  *,
  input_shape: tuple[int, ...],
  num_classes: int,
  norm: str = "batch",
  group_norm_groups: int = 2,
  seed: int = 0,
  width: int = 16,
) -> tf.keras.Model:
  """Returns an un-compiled ResNet-`depth` that maps images to `num_classes` logits.

  Weights are a deterministic function of `seed`. Raises ValueError unless depth = 6n + 2
  with n >= 1, or if `norm` is not one of NORMS.
  """
  _check(depth, norm)
  seeds = seed_stream(seed)

  def conv(filters, kernel_size, strides=1):
    return tf.keras.layers.Conv2D(
      filters,
      kernel_size,
      strides=strides,
      padding="same",
      use_bias=False,
      kernel_initializer=tf.keras.initializers.HeNormal(seed=next(seeds)),
    )

  def normalize():
    return _normalization(norm, group_norm_groups)

  relu = tf.keras.layers.ReLU
  inputs = tf.keras.Input(shape=input_shape)
  x = relu()(normalize()(conv(width, 3)(inputs)))
  for stage in range(3):
    filters = width * 2**stage
    for block in range((depth - 2) // 6):
      strides = 2 if stage > 0 and block == 0 else 1
      y = relu()(normalize()(conv(filters, 3, strides)(x)))
      y = normalize()(conv(filters, 3)(y))
      if strides != 1 or x.shape[-1] != filters:
        x = normalize()(conv(filters, 1, strides)(x))
      x = relu()(tf.keras.layers.Add()([y, x]))
  x = tf.keras.layers.GlobalAveragePooling2D()(x)
  outputs = tf.keras.layers.Dense(
    num_classes, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=next(seeds))
  )(x)
  return tf.keras.Model(inputs, outputs, name=f"resnet{depth}_{norm}norm")


def build_binary_resnet(
  depth: int,
  *,
  input_shape: tuple[int, ...],
  num_classes: int,
  norm: str = "batch",
  group_norm_groups: int = 2,
  seed: int = 0,
  width: int = 16,
) -> tf.keras.Model:
  """Returns an un-compiled binarized ResNet-`depth` (see the module docstring).

  The layout is `build_resnet`'s (depth = 6n + 2, three stages, strided 1x1 shortcuts)
  with the changes binarization needs: the 3x3 convolutions of the blocks are larq
  `QuantConv2D`s with `ste_sign` input and kernel quantizers and `weight_clip` constraints,
  padded with +1 (`pad_values=1.0`, which larq-compute-engine runs without a correction);
  each is followed by normalization, which gives its +-1 sums a real scale, and has its own
  shortcut, so real-valued activations flow around every 1-bit layer (Bi-Real Net, Liu et
  al. 2018, Fig. 1); there is no ReLU before them (the sign of a ReLU output is always +1),
  so the only ReLU is the one before pooling; batch norm uses momentum
  BINARY_BATCH_NORM_MOMENTUM. Raises ValueError like `build_resnet`.
  """
  _check(depth, norm)
  seeds = seed_stream(seed)

  def normalize():
    return _normalization(norm, group_norm_groups, BINARY_BATCH_NORM_MOMENTUM)

  def binary_conv(filters, strides=1):
    return lq.layers.QuantConv2D(
      filters,
      3,
      strides=strides,
      padding="same",
      pad_values=1.0,
      use_bias=False,
      input_quantizer="ste_sign",
      kernel_quantizer="ste_sign",
      kernel_constraint="weight_clip",
      kernel_initializer=tf.keras.initializers.GlorotUniform(seed=next(seeds)),
    )

  def full_precision_conv(filters, kernel_size, strides=1):
    return tf.keras.layers.Conv2D(
      filters,
      kernel_size,
      strides=strides,
      padding="same",
      use_bias=False,
      kernel_initializer=tf.keras.initializers.HeNormal(seed=next(seeds)),
    )

  inputs = tf.keras.Input(shape=input_shape)
  x = normalize()(full_precision_conv(width, 3)(inputs))
  for stage in range(3):
    filters = width * 2**stage
    for block in range((depth - 2) // 6):
      for conv in range(2):
        strides = 2 if stage > 0 and block == 0 and conv == 0 else 1
        y = normalize()(binary_conv(filters, strides)(x))
        if strides != 1 or x.shape[-1] != filters:
          x = normalize()(full_precision_conv(filters, 1, strides)(x))
        x = tf.keras.layers.Add()([y, x])
  x = tf.keras.layers.GlobalAveragePooling2D()(tf.keras.layers.ReLU()(x))
  outputs = tf.keras.layers.Dense(
    num_classes, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=next(seeds))
  )(x)
  return tf.keras.Model(inputs, outputs, name=f"binary_resnet{depth}_{norm}norm")
