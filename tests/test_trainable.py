"""A trainable TFLite file from builtin ops (`export.trainable`) and its device side
(`export.device_training`): each hand-written gradient against TensorFlow's, the file's ops
and signatures, its `train` steps against Keras' SGD in TensorFlow's interpreter, and local
epochs in the device environment (LiteRT, no TensorFlow) against Keras."""

import functools
import json
import os
import subprocess

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.lite.python import schema_py_generated as schema
from tensorflow.lite.tools import flatbuffer_utils

from export import ExportError
from export import device_training
from export import trainable
from tasks import femnist
from tests.exported_runs import REPO_ROOT

DEVICE_PYTHON = os.path.join(REPO_ROOT, "device", ".venv", "bin", "python")
needs_device_env = pytest.mark.skipif(
  not os.path.exists(DEVICE_PYTHON),
  reason="the device environment is not installed: uv sync --locked --project device",
)
LEARNING_RATE = 0.1
NUM_CLASSES = 10
INPUT_SHAPE = (28, 28, 1)


def leaf_like_model(seed: int = 0) -> tf.keras.Model:
  """The LEAF CNN's layers (tasks.femnist), narrower: converts in seconds."""
  seeds = iter(range(10 * seed, 10 * seed + 10))
  init = lambda: tf.keras.initializers.GlorotUniform(seed=next(seeds))
  layers = tf.keras.layers
  return tf.keras.Sequential(
    [
      tf.keras.Input(INPUT_SHAPE),
      layers.Conv2D(4, 5, padding="same", activation="relu", kernel_initializer=init()),
      layers.MaxPool2D(2),
      layers.Conv2D(6, 5, padding="same", activation="relu", kernel_initializer=init()),
      layers.MaxPool2D(2),
      layers.Flatten(),
      layers.Dense(32, activation="relu", kernel_initializer=init()),
      layers.Dense(NUM_CLASSES, kernel_initializer=init()),
    ]
  )


def odd_shapes_model(seed: int = 0) -> tf.keras.Model:
  """Strided valid and same convolutions, pooling of odd sizes (dropped and padded edges)."""
  seeds = iter(range(10 * seed, 10 * seed + 10))
  init = lambda: tf.keras.initializers.GlorotUniform(seed=next(seeds))
  layers = tf.keras.layers
  return tf.keras.Sequential(
    [
      tf.keras.Input(INPUT_SHAPE),
      layers.Conv2D(
        3, 3, strides=2, padding="valid", activation="relu", kernel_initializer=init()
      ),  # 13x13
      layers.MaxPool2D((3, 2), padding="same"),  # 5x7
      layers.Conv2D(4, 3, strides=2, padding="same", kernel_initializer=init()),  # 3x4
      layers.Conv2D(5, 2, padding="valid", activation="relu", kernel_initializer=init()),  # 2x3
      layers.MaxPool2D(2),  # 1x1, the last column dropped
      layers.Flatten(),
      layers.Dense(NUM_CLASSES, kernel_initializer=init()),
    ]
  )


MODELS = {"leaf_like": leaf_like_model, "odd_shapes": odd_shapes_model}


def batch(n: int, seed: int = 0, num_classes: int = NUM_CLASSES):
  """n images as FEMNIST's (a white background, 30% of pixels darker), random labels.

  The background makes equal activations (max-pooling ties, ReLU zeros) common."""
  rng = np.random.default_rng(seed)
  x = np.where(rng.random((n, *INPUT_SHAPE)) < 0.3, rng.random((n, *INPUT_SHAPE)), 1.0)
  return x.astype(np.float32), rng.integers(0, num_classes, n).astype(np.int32)


def keras_steps(
  model: tf.keras.Model,
  batches,
  momentum: float,
  learning_rate: float = LEARNING_RATE,
  correct: list | None = None,
) -> list[float]:
  """Keras' SGD steps on `batches` (losses before each step); updates `model`. Appends
  each batch's number of correct predictions before its step to `correct`."""
  model.compile(
    optimizer=tf.keras.optimizers.SGD(learning_rate, momentum=momentum),
    loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  losses = []
  for x, y in batches:
    if correct is not None:
      correct.append(int(np.sum(model(x).numpy().argmax(-1) == y)))
    losses.append(float(model.train_on_batch(x, y)))
  return losses


@functools.cache
def trainable_file(name: str, momentum: float) -> bytes:
  """`MODELS[name]()` converted, once per test session."""
  return trainable.convert_trainable(MODELS[name](), learning_rate=LEARNING_RATE, momentum=momentum)


def assert_weights_close(actual, expected, atol=1e-6):
  assert len(actual) == len(expected)
  for i, (a, e) in enumerate(zip(actual, expected)):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=atol, err_msg=f"w{i}")


# Each hand-written gradient against TensorFlow's own (the ops TFLite has no builtin for).


def _gradients(f, *args):
  args = [tf.constant(a) for a in args]
  with tf.GradientTape() as tape:
    tape.watch(args)
    y = f(*args)
    # A random cotangent, so that every output element's gradient counts.
    loss = tf.reduce_sum(
      y * tf.constant(np.random.default_rng(1).standard_normal(y.shape), tf.float32)
    )
  return y, tape.gradient(loss, args)


def _assert_same_gradients(ours, reference, *args):
  y, grads = _gradients(ours, *args)
  y_ref, grads_ref = _gradients(reference, *args)
  np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
  for g, g_ref in zip(grads, grads_ref):
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "size,kernel,strides,padding",
  [
    (9, 5, (1, 1), "SAME"),
    (9, 3, (2, 2), "SAME"),
    (10, 3, (2, 2), "SAME"),
    (9, 3, (2, 2), "VALID"),
    (10, 4, (3, 2), "VALID"),
    (6, 2, (1, 1), "VALID"),
  ],
)
def test_conv2d_gradient_is_tensorflows(size, kernel, strides, padding):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, size, size + 1, 2), dtype=np.float32)
  w = rng.standard_normal((kernel, kernel, 2, 4), dtype=np.float32)
  b = rng.standard_normal(4, dtype=np.float32)
  _assert_same_gradients(
    lambda x, w, b: trainable.conv2d(x, w, b, strides, padding),
    lambda x, w, b: tf.nn.conv2d(x, w, [1, *strides, 1], padding) + b,
    x,
    w,
    b,
  )


@pytest.mark.parametrize(
  "size,pool,padding",
  [
    (8, (2, 2), "VALID"),
    (7, (2, 2), "VALID"),
    (7, (2, 2), "SAME"),
    (8, (3, 3), "SAME"),
    (9, (3, 2), "VALID"),
    (13, (3, 2), "SAME"),
  ],
)
def test_max_pool_gradient_is_tensorflows(size, pool, padding):
  # Values in {0, 1, 2}: most windows hold their maximum more than once, and MaxPoolGrad
  # gives dy to the first.
  x = np.random.default_rng(0).integers(0, 3, (2, size, size + 1, 3)).astype(np.float32)
  _assert_same_gradients(
    lambda x: trainable.max_pool2d(x, pool, padding),
    lambda x: tf.nn.max_pool2d(x, pool, pool, padding),
    x,
  )


def test_relu_dense_and_cross_entropy_gradients_are_tensorflows():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 7), dtype=np.float32)
  w = rng.standard_normal((7, 4), dtype=np.float32)
  b = rng.standard_normal(4, dtype=np.float32)
  _assert_same_gradients(trainable.relu, tf.nn.relu, x)
  _assert_same_gradients(trainable.dense, lambda x, w, b: tf.matmul(x, w) + b, x, w, b)
  labels = np.array([0, 3, 1, 1, 2])
  with tf.GradientTape(persistent=True) as tape:
    logits = tf.constant(x[:, :4])
    tape.watch(logits)
    ours = trainable.mean_cross_entropy(logits, tf.one_hot(labels, 4))
    reference = tf.reduce_mean(
      tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    )
  np.testing.assert_allclose(ours, reference, rtol=1e-6)
  np.testing.assert_allclose(
    tape.gradient(ours, logits), tape.gradient(reference, logits), rtol=1e-5, atol=1e-7
  )


# The converted file.


def test_file_has_only_builtin_ops():
  model = flatbuffer_utils.convert_bytearray_to_object(bytearray(trainable_file("leaf_like", 0.9)))
  codes = [max(c.builtinCode, c.deprecatedBuiltinCode) for c in model.operatorCodes]
  names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
  assert all(c.customCode is None for c in model.operatorCodes)
  assert schema.BuiltinOperator.CUSTOM not in codes
  # The ops a Keras train step needs Flex for, lowered here to builtins.
  assert {
    "TRANSPOSE_CONV",
    "BATCH_MATMUL",
    "SELECT_V2",
    "LOG_SOFTMAX",
    "ONE_HOT",
    "VAR_HANDLE",
    "ASSIGN_VARIABLE",
    "READ_VARIABLE",
  } <= {names[c] for c in codes}


def test_signatures_names_shapes_and_dtypes():
  model = MODELS["leaf_like"]()
  interpreter = tf.lite.Interpreter(model_content=trainable_file("leaf_like", 0.9))
  signatures = interpreter.get_signature_list()
  names = [device_training.weight_name(i) for i in range(len(model.trainable_variables))]
  assert names == ["w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7"]
  assert signatures == {
    "train": {"inputs": ["x", "y"], "outputs": ["correct", "loss"]},
    "infer": {"inputs": ["x"], "outputs": ["logits"]},
    "get_weights": {"inputs": [], "outputs": names},
    "set_weights": {"inputs": names, "outputs": ["num_weights"]},
  }

  def described(details):
    return {
      k: (d["shape_signature"].tolist(), np.dtype(d["dtype"]).name) for k, d in details.items()
    }

  train = interpreter.get_signature_runner("train")
  assert described(train.get_input_details()) == {
    "x": ([-1, 28, 28, 1], "float32"),
    "y": ([-1], "int32"),
  }
  assert described(train.get_output_details()) == {
    "loss": ([], "float32"),
    "correct": ([], "float32"),
  }
  infer = interpreter.get_signature_runner("infer")
  assert described(infer.get_output_details()) == {"logits": ([-1, NUM_CLASSES], "float32")}
  shapes = {name: (list(v.shape), "float32") for name, v in zip(names, model.trainable_variables)}
  assert described(interpreter.get_signature_runner("get_weights").get_output_details()) == (shapes)
  set_weights = interpreter.get_signature_runner("set_weights")
  assert described(set_weights.get_input_details()) == shapes
  assert described(set_weights.get_output_details()) == {"num_weights": ([], "int32")}


@pytest.mark.parametrize(
  "name,momentum", [("leaf_like", 0.0), ("leaf_like", 0.9), ("odd_shapes", 0.9)]
)
def test_train_steps_match_keras_sgd(name, momentum):
  # Two batches of different sizes: the second resizes the interpreter's inputs.
  batches = [batch(6, seed=0), batch(4, seed=1)]
  interpreter = tf.lite.Interpreter(model_content=trainable_file(name, momentum))
  model = MODELS[name]()
  initial = [v.numpy() for v in model.trainable_variables]
  # Before training, the file holds the model's weights.
  np.testing.assert_allclose(
    interpreter.get_signature_runner("infer")(x=batches[0][0])["logits"],
    model(batches[0][0]),
    rtol=1e-5,
    atol=1e-6,
  )
  train = interpreter.get_signature_runner("train")
  losses = [float(train(x=x, y=y)["loss"]) for x, y in batches]
  weights = interpreter.get_signature_runner("get_weights")()
  keras_losses = keras_steps(model, batches, momentum)
  np.testing.assert_allclose(losses, keras_losses, rtol=1e-5)
  assert_weights_close(
    [weights[f"w{i}"] for i in range(len(initial))], [v.numpy() for v in model.trainable_variables]
  )
  assert not any(np.allclose(w, v) for w, v in zip(initial, model.trainable_variables))


def test_set_weights_restarts_momentum():
  # A round that diverged (NaN weights and velocities), then a new round from the server's
  # weights: the same steps as a fresh Keras optimizer from them.
  interpreter = tf.lite.Interpreter(model_content=trainable_file("leaf_like", 0.9))
  train = interpreter.get_signature_runner("train")
  set_weights = interpreter.get_signature_runner("set_weights")
  get_weights = interpreter.get_signature_runner("get_weights")
  server = MODELS["leaf_like"](seed=1)
  server_weights = {f"w{i}": v.numpy() for i, v in enumerate(server.trainable_variables)}
  set_weights(**{k: np.full_like(v, np.nan) for k, v in server_weights.items()})
  x, y = batch(4)
  assert np.isnan(train(x=x, y=y)["loss"])
  set_weights(**server_weights)
  for k, v in get_weights().items():
    np.testing.assert_array_equal(v, server_weights[k])
  batches = [batch(5, seed=2), batch(5, seed=3)]
  losses = [float(train(x=x, y=y)["loss"]) for x, y in batches]
  np.testing.assert_allclose(losses, keras_steps(server, batches, 0.9), rtol=1e-5)
  weights = get_weights()
  assert_weights_close(
    [weights[f"w{i}"] for i in range(len(weights))], [v.numpy() for v in server.trainable_variables]
  )


def test_leaf_cnn_train_steps_match_keras_sgd():
  model = femnist.build_model("cnn", seed=0)
  batches = [
    batch(16, seed=0, num_classes=femnist.NUM_CLASSES),
    batch(9, seed=1, num_classes=femnist.NUM_CLASSES),
  ]
  flatbuffer = trainable.convert_trainable(model, learning_rate=0.05, momentum=0.9)
  # The velocities' initial values share the weights' buffer: one copy of the weights.
  weight_bytes = sum(v.numpy().nbytes for v in model.trainable_variables)
  assert weight_bytes < len(flatbuffer) < 1.01 * weight_bytes
  interpreter = tf.lite.Interpreter(model_content=flatbuffer)
  train = interpreter.get_signature_runner("train")
  losses = [float(train(x=x, y=y)["loss"]) for x, y in batches]
  weights = interpreter.get_signature_runner("get_weights")()
  keras_losses = keras_steps(model, batches, 0.9, learning_rate=0.05)
  np.testing.assert_allclose(losses, keras_losses, rtol=1e-5)
  assert_weights_close(
    [weights[f"w{i}"] for i in range(len(weights))],
    [v.numpy() for v in model.trainable_variables],
    atol=1e-5,
  )


# The device side.


def test_example_order_and_batches_follow_repeat_then_batch():
  np.testing.assert_array_equal(device_training.example_order(3, 2, None), [0, 1, 2, 0, 1, 2])
  order = device_training.example_order(5, 3, seed=7)
  assert len(order) == 15
  for epoch in range(3):  # each pass a permutation of its own
    assert sorted(order[5 * epoch : 5 * epoch + 5]) == list(range(5))
  assert not np.array_equal(order[:5], order[5:10])
  np.testing.assert_array_equal(order, device_training.example_order(5, 3, seed=7))


# AUTO is what LiteRT clients use; the reference kernels are LiteRT's other correct answer.
@pytest.mark.parametrize("op_resolver", ["AUTO", "BUILTIN_REF"])
def test_device_trainer_matches_keras_in_this_environment(op_resolver):
  flatbuffer = trainable_file("leaf_like", 0.9)
  trainer = device_training.DeviceTrainer(flatbuffer, op_resolver=op_resolver)
  x, y = batch(7, seed=4)
  order = device_training.example_order(len(x), epochs=2, seed=0)
  weights, num_examples, mean_loss, accuracy = trainer.train_epochs(
    x, y, epochs=2, batch_size=4, order=order
  )
  model = MODELS["leaf_like"]()
  # 14 examples in batches of 4, 4, 4, 2: the second spans both epochs.
  correct = []
  keras_losses = keras_steps(
    model,
    [(x[order[i : i + 4]], y[order[i : i + 4]]) for i in range(0, 14, 4)],
    0.9,
    correct=correct,
  )
  assert num_examples == 14
  assert accuracy == sum(correct) / 14
  np.testing.assert_allclose(mean_loss, np.dot(keras_losses, [4, 4, 4, 2]) / 14, rtol=1e-5)
  assert_weights_close(weights, [v.numpy() for v in model.trainable_variables])
  same_weights, num_examples, mean_loss, _ = trainer.train_epochs(x[:0], y[:0], batch_size=4)
  assert (num_examples, np.isnan(mean_loss)) == (0, True)
  assert all(np.array_equal(a, b) for a, b in zip(same_weights, weights))
  with pytest.raises(ValueError, match=r"set_weights needs 8 arrays of shapes"):
    trainer.set_weights(weights[:-1])
  with pytest.raises(ValueError, match=r"y must be 7 class indices in 0..9"):
    trainer.train_epochs(x, y + 5, epochs=1, batch_size=4)


def test_device_trainer_names_an_unknown_kernel_set():
  with pytest.raises(ExportError, match="op_resolver=FAST is not one of AUTO, BUILTIN"):
    device_training.DeviceTrainer(trainable_file("leaf_like", 0.9), op_resolver="FAST")


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_static_batch_file_trains_as_the_dynamic_one(momentum):
  # 2 epochs of 11 examples in batches of 4: the last batch (2 examples) is padded and masked.
  x, y = batch(11, seed=6)
  static = trainable.convert_trainable(
    MODELS["leaf_like"](), learning_rate=LEARNING_RATE, momentum=momentum, static_batch=4
  )
  runs = []
  for flatbuffer in (trainable_file("leaf_like", momentum), static):
    trainer, losses = device_training.DeviceTrainer(flatbuffer), []
    runs.append(
      (trainer.train_epochs(x, y, epochs=2, batch_size=4, seed=3, step_losses=losses), losses)
    )
  (dynamic, dynamic_losses), (padded, padded_losses) = runs
  assert len(padded_losses) == 6
  # Padding adds exact zeros to the gradients' sums, in another summation order.
  np.testing.assert_allclose(padded_losses, dynamic_losses, rtol=1e-6)
  assert (padded.num_examples, padded.accuracy) == (dynamic.num_examples, dynamic.accuracy)
  assert_weights_close(padded.weights, dynamic.weights, atol=1e-7)
  interpreter = tf.lite.Interpreter(model_content=static)
  details = interpreter.get_signature_runner("train").get_input_details()
  assert {k: list(d["shape_signature"]) for k, d in details.items()} == {
    "x": [4, *INPUT_SHAPE],
    "y": [4],
    "mask": [4],
  }
  with pytest.raises(ValueError, match=r"^static_batch must be a positive number of examples"):
    trainable.convert_trainable(MODELS["leaf_like"](), learning_rate=0.1, static_batch=0)


# Runs two federated rounds in the device process from the same server weights: set_weights,
# train_epochs (2 epochs of 7 examples in batches of 4, the order drawn from seed 0).
DEVICE_ROUNDS = """
import json, sys
import numpy as np
from export import device_training
trainer = device_training.DeviceTrainer.load(sys.argv[1])
data = np.load(sys.argv[2])
server = [data[f"w{i}"] for i in range(len(trainer.weight_shapes))]
rounds = []
for _ in range(2):
  trainer.set_weights(server)
  rounds.append(trainer.train_epochs(data["x"], data["y"], epochs=2, batch_size=4, seed=0))
(weights, num_examples, mean_loss, _), again = rounds
np.savez(sys.argv[3], *weights)
print(json.dumps({"runtime": trainer.runtime, "num_examples": num_examples,
                  "mean_loss": mean_loss, "tensorflow": "tensorflow" in sys.modules,
                  "rounds_equal": all(np.array_equal(a, b) for a, b in zip(weights, again[0]))}))
"""


@needs_device_env
def test_device_env_trains_like_keras(tmp_path):
  path = tmp_path / "trainable.tflite"
  path.write_bytes(trainable_file("leaf_like", 0.9))
  server = MODELS["leaf_like"](seed=1)
  x, y = batch(7, seed=5)
  np.savez(
    tmp_path / "inputs.npz",
    x=x,
    y=y,
    **{f"w{i}": v.numpy() for i, v in enumerate(server.trainable_variables)},
  )
  result = subprocess.run(
    [
      DEVICE_PYTHON,
      "-c",
      DEVICE_ROUNDS,
      str(path),
      str(tmp_path / "inputs.npz"),
      str(tmp_path / "weights.npz"),
    ],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
    env={**os.environ, "PYTHONPATH": REPO_ROOT},
  )
  assert result.returncode == 0, result.stderr[-2000:]
  device = json.loads(result.stdout.strip().splitlines()[-1])
  assert device["runtime"].startswith("ai_edge_litert 2.3")
  assert not device["tensorflow"]
  assert device["rounds_equal"]
  order = device_training.example_order(len(x), epochs=2, seed=0)
  keras_losses = keras_steps(
    server, [(x[order[i : i + 4]], y[order[i : i + 4]]) for i in range(0, 14, 4)], 0.9
  )
  assert device["num_examples"] == 14
  np.testing.assert_allclose(
    device["mean_loss"], np.dot(keras_losses, [4, 4, 4, 2]) / 14, rtol=1e-5
  )
  weights = np.load(tmp_path / "weights.npz")
  assert_weights_close(
    [weights[f"arr_{i}"] for i in range(len(weights.files))],
    [v.numpy() for v in server.trainable_variables],
  )


# Bad inputs.


@pytest.mark.parametrize(
  "layers,message",
  # Layers are built in the test: made at collection, a Keras layer can be invalid in the
  # graph state an earlier test of the session leaves.
  [
    (
      lambda: [tf.keras.layers.BatchNormalization(name="bn")],
      r"^layer 'bn' \(BatchNormalization\) cannot be trained with TFLite builtins: "
      r"convert_trainable supports Conv2D",
    ),
    (
      lambda: [tf.keras.layers.Flatten(), tf.keras.layers.Dense(3, activation="tanh", name="d")],
      r"^layer 'd' \(Dense\) has activation 'tanh': convert_trainable supports relu and linear$",
    ),
    (
      lambda: [tf.keras.layers.Dense(3, name="d")],
      r"^layer 'd' \(Dense without bias or on a \[n, ...\] input of rank > 2\)",
    ),
    (
      lambda: [tf.keras.layers.MaxPool2D(3, strides=2, name="p")],
      r"^layer 'p' \(MaxPooling2D with strides != pool_size\) cannot be trained",
    ),
    (
      lambda: [tf.keras.layers.Conv2D(2, 3, kernel_regularizer="l2", name="c")],
      r"^layer 'c' \(Conv2D with kernel_regularizer\) cannot be trained",
    ),
  ],
)
def test_unsupported_layer_is_a_one_line_value_error(layers, message):
  model = tf.keras.Sequential(
    [
      tf.keras.Input(INPUT_SHAPE),
      *layers(),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(NUM_CLASSES),
    ]
  )
  with pytest.raises(ValueError, match=message) as error:
    trainable.convert_trainable(model, learning_rate=LEARNING_RATE)
  assert "\n" not in str(error.value)


def test_functional_model_is_a_one_line_value_error():
  inputs = tf.keras.Input(INPUT_SHAPE)
  model = tf.keras.Model(
    inputs, tf.keras.layers.Dense(2)(tf.keras.layers.Flatten()(inputs)), name="functional"
  )
  with pytest.raises(
    ValueError,
    match=r"^model 'functional' is a Functional: "
    r"convert_trainable supports Sequential models of ",
  ):
    trainable.convert_trainable(model, learning_rate=LEARNING_RATE)
