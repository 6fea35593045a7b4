"""CIFAR-style residual networks, independent of any task.

He, Zhang, Ren and Sun, "Deep Residual Learning for Image Recognition", CVPR 2016, section
4.2: a 3x3 convolution, three stages of n basic blocks (two 3x3 convolutions each) with
width, 2 * width and 4 * width filters, global average pooling and a dense layer, so
depth = 6n + 2 (ResNet-8: n = 1, ResNet-20: n = 3). The second and third stages halve the
spatial size in their first block, whose shortcut is then a strided 1x1 convolution
(option B of the paper).

Normalization is batch norm as in the paper or group norm (Wu and He, ECCV 2018), which does
not depend on batch statistics and is the usual choice under non-i.i.d. federated training
(Hsieh et al., ICML 2020).
"""

from collections.abc import Iterator

import numpy as np
import tensorflow as tf

NORMS = ("batch", "group")


def seed_stream(seed: int) -> Iterator[int]:
  """Yields distinct initializer seeds derived from `seed`, one per layer that needs one."""
  rng = np.random.default_rng(seed)
  while True:
    yield int(rng.integers(2**31 - 1))


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
  if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
    raise ValueError(f"ResNet depth must be 6n+2 with n >= 1 (8, 14, 20, 32, ...), got {depth!r}")
  if norm not in NORMS:
    raise ValueError(f"unknown norm {norm!r}: choose one of {', '.join(NORMS)}")
  seeds = seed_stream(seed)

  def conv(filters, kernel_size, strides=1):
    return tf.keras.layers.Conv2D(
        filters, kernel_size, strides=strides, padding="same", use_bias=False,
        kernel_initializer=tf.keras.initializers.HeNormal(seed=next(seeds)))

  def normalize():
    if norm == "batch":
      return tf.keras.layers.BatchNormalization()
    return tf.keras.layers.GroupNormalization(groups=group_norm_groups)

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
      num_classes, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=next(seeds)))(x)
  return tf.keras.Model(inputs, outputs, name=f"resnet{depth}_{norm}norm")
