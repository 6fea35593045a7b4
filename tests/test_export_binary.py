"""Tests of the binarized ResNets (larq) and their two exports, `lce` and `binary`."""

import larq as lq
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from export import convert
from export import metadata
from export import on_device
from tasks import femnist
from tasks import resnet
from tff_ens.templates import client_work


def _binary_layers(model):
  return [layer for layer in model.layers if isinstance(layer, lq.layers.QuantConv2D)]


@pytest.fixture(scope="module")
def trained_binary_resnet8():
  """A binarized ResNet-8 after a few SGD steps on random data.

  Training moves batch norm's statistics off their initial (0, 1): with them, an untrained
  binary convolution's integer sums hit 0 exactly after normalization, where float
  rounding decides the sign and exports cannot agree with Keras.
  """
  tf.keras.utils.set_random_seed(0)
  model = femnist.build_model("resnet8_binary")
  rng = np.random.default_rng(0)
  x = rng.random((64, *femnist.INPUT_SHAPE), dtype=np.float32)
  y = rng.integers(femnist.NUM_CLASSES, size=64)
  model.compile(
    tf.keras.optimizers.SGD(0.1), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  )
  model.fit(x, y, batch_size=16, epochs=3, verbose=0)
  return model


@pytest.mark.parametrize("name, depth", [("resnet8_binary", 8), ("resnet20_binary", 20)])
def test_binary_resnet_layout(name, depth):
  model = femnist.build_model(name)
  binary = _binary_layers(model)
  assert len(binary) == depth - 2
  for layer in binary:
    assert layer.input_quantizer.__class__ is lq.quantizers.SteSign
    assert layer.kernel_quantizer.__class__ is lq.quantizers.SteSign
    assert isinstance(layer.kernel_constraint, lq.constraints.WeightClip)
  # First and last layers in full precision.
  weighted = [
    layer
    for layer in model.layers
    if layer.weights and not isinstance(layer, tf.keras.layers.BatchNormalization)
  ]
  assert type(weighted[0]) is tf.keras.layers.Conv2D
  assert type(weighted[-1]) is tf.keras.layers.Dense
  assert model.output_shape == (None, femnist.NUM_CLASSES)
  assert all(
    layer.momentum == resnet.BINARY_BATCH_NORM_MOMENTUM
    for layer in model.layers
    if isinstance(layer, tf.keras.layers.BatchNormalization)
  )


def test_federated_client_update_clips_latent_weights():
  model = femnist.build_model("resnet8_binary")
  initial = tff.learning.models.ModelWeights.from_model(model)
  initial = tf.nest.map_structure(lambda v: tf.constant(v.numpy()), initial)
  rng = np.random.default_rng(0)
  dataset = tf.data.Dataset.from_tensor_slices(
    (
      rng.random((8, *femnist.INPUT_SHAPE), dtype=np.float32),
      rng.integers(femnist.NUM_CLASSES, size=8).astype(np.int32),
    )
  ).batch(4)
  client_work.train_locally(
    model,
    tff.learning.optimizers.build_sgdm(learning_rate=0.0),
    initial,
    dataset,
    tf.constant(100.0),
    client_work.LocalTrainingConfig(learning_rate=100.0),
  )
  kernels = [layer.kernel.numpy() for layer in _binary_layers(model)]
  assert max(np.abs(k).max() for k in kernels) <= 1.0
  # A rate of 100 moves some latent weights to the clip.
  assert any(np.isclose(np.abs(k).max(), 1.0) for k in kernels)


@pytest.mark.slow
def test_lce_and_binary_exports_match_keras(trained_binary_resnet8):
  model = trained_binary_resnet8
  x = np.random.default_rng(1).random((16, *femnist.INPUT_SHAPE), dtype=np.float32)
  keras = model.predict(x, verbose=0)
  sizes = {}
  for output_format in ("lce", "binary"):
    flatbuffer = convert.convert_model(model, output_format)
    sizes[output_format] = len(flatbuffer)
    description = {
      "format": output_format,
      "class_labels": list(femnist.CLASS_LABELS),
      "runtime": (metadata.RUNTIME_LCE if output_format == "lce" else metadata.RUNTIME_TFLITE),
      "input": {
        "shape": [None, 28, 28, 1],
        "dtype": "float32",
        "value_range": [0.0, 1.0],
        "preprocessing": "",
      },
    }
    exported = on_device.Classifier(flatbuffer, description)
    assert exported.runtime.split()[0] == (
      "larq_compute_engine" if output_format == "lce" else "tflite_runtime"
    )
    logits = exported.logits(x)
    np.testing.assert_allclose(logits, keras, atol=1e-3 * np.abs(keras).max())
    assert np.array_equal(logits.argmax(-1), keras.argmax(-1))
  float_size = len(convert.convert_model(femnist.build_model("resnet8"), "float"))
  assert sizes["lce"] <= 0.15 * float_size
  assert sizes["binary"] > 0.9 * float_size  # +-1 kept as float32.
