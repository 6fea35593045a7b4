"""Tests of the FEMNIST models and the task-independent ResNet builder."""

import numpy as np
import pytest
import tensorflow as tf

from tasks import femnist
from tasks import resnet


def _layers_of(model, kind):
  return [layer for layer in model.layers if isinstance(layer, kind)]


@pytest.fixture(scope="module")
def models():
  return {name: femnist.build_model(name) for name in femnist.MODEL_NAMES}


@pytest.mark.parametrize("name", femnist.MODEL_NAMES)
def test_model_maps_images_to_logits(models, name):
  model = models[name]
  assert model.input_shape == (None, 28, 28, 1)
  assert model.output_shape == (None, femnist.NUM_CLASSES)
  last = model.layers[-1]
  assert isinstance(last, tf.keras.layers.Dense)
  assert last.activation is tf.keras.activations.linear  # Logits, no softmax.
  logits = model(np.random.default_rng(0).random((2, 28, 28, 1), dtype=np.float32))
  assert logits.shape == (2, femnist.NUM_CLASSES)
  assert np.isfinite(logits.numpy()).all()


def test_cnn_has_leaf_parameter_count(models):
  conv1 = 5 * 5 * 1 * 32 + 32
  conv2 = 5 * 5 * 32 * 64 + 64
  flat = (28 // 2 // 2) ** 2 * 64  # Two 2x2 max-pools of 28x28 "same" convolutions.
  dense = flat * 2048 + 2048
  logits = 2048 * 62 + 62
  assert models["cnn"].count_params() == conv1 + conv2 + dense + logits == 6_603_710


def test_mlp_is_mcmahans_2nn(models):
  # 784 -> 200 -> 200 -> 62, with biases (McMahan et al. 2017, Sec. 3).
  assert models["mlp"].count_params() == (784 * 200 + 200) + (200 * 200 + 200) + (200 * 62 + 62)


@pytest.mark.parametrize("name", femnist.MODEL_NAMES)
def test_weights_are_a_function_of_the_seed(models, name):
  same = femnist.build_model(name, seed=0).get_weights()
  other = femnist.build_model(name, seed=1).get_weights()
  weights = models[name].get_weights()
  assert all(np.array_equal(a, b) for a, b in zip(weights, same, strict=True))
  kernels = [(a, b) for a, b in zip(weights, other, strict=True) if a.ndim > 1]
  assert kernels and not any(np.array_equal(a, b) for a, b in kernels)
  # Every layer draws its own kernel: no two layers of one shape share initial values.
  first = [a for a in weights if a.ndim > 1]
  assert len({a.tobytes() for a in first}) == len(first)


@pytest.mark.parametrize("name, depth", [("resnet8", 8), ("resnet20", 20)])
def test_resnet_depth_counts_weighted_layers(models, name, depth):
  model = models[name]
  convs = _layers_of(model, tf.keras.layers.Conv2D)
  shortcuts = [c for c in convs if c.kernel_size == (1, 1)]
  assert len(shortcuts) == 2  # Into stages 2 and 3.
  assert len(convs) - len(shortcuts) + len(_layers_of(model, tf.keras.layers.Dense)) == depth
  assert [c.filters for c in shortcuts] == [32, 64]
  assert model.layers[-3].output_shape == (None, 7, 7, 64)  # 28 -> 14 -> 7 spatially.
  assert len(_layers_of(model, tf.keras.layers.BatchNormalization)) == len(convs)


def test_resnet20_is_deeper_than_resnet8(models):
  assert len(models["resnet20"].layers) > len(models["resnet8"].layers)
  assert models["resnet20"].count_params() > models["resnet8"].count_params()


@pytest.mark.parametrize("name", ["resnet8", "resnet20"])
def test_group_norm_variant(name):
  model = femnist.build_model(name, norm="group")
  assert not _layers_of(model, tf.keras.layers.BatchNormalization)
  groups = _layers_of(model, tf.keras.layers.GroupNormalization)
  assert len(groups) == len(_layers_of(model, tf.keras.layers.Conv2D))
  assert all(layer.groups == 2 for layer in groups)
  assert model.output_shape == (None, femnist.NUM_CLASSES)


def test_resnet_is_task_independent():
  model = resnet.build_resnet(
    8, input_shape=(32, 32, 3), num_classes=10, width=8, norm="group", group_norm_groups=4
  )
  assert model.output_shape == (None, 10)
  assert model(tf.zeros((1, 32, 32, 3))).shape == (1, 10)
  assert max(c.filters for c in _layers_of(model, tf.keras.layers.Conv2D)) == 32


def test_unknown_model_name():
  with pytest.raises(
    ValueError, match="unknown model .vgg.: choose one of cnn, cnn_ppd_student, resnet8, resnet20"
  ):
    femnist.build_model("vgg")


def test_cnn_rejects_group_norm():
  with pytest.raises(ValueError, match="no normalization layers"):
    femnist.build_model("cnn", norm="group")


@pytest.mark.parametrize("depth", [0, 2, 7, 9, 21, -4, 20.0, "20", True])
def test_invalid_resnet_depth(depth):
  with pytest.raises(ValueError, match="6n\\+2"):
    resnet.build_resnet(depth, input_shape=(28, 28, 1), num_classes=62)


def test_unknown_norm():
  with pytest.raises(ValueError, match="unknown norm 'layer': choose one of batch, group"):
    femnist.build_model("resnet8", norm="layer")
