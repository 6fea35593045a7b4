"""Local SGD of a federated client on a device: an `export.trainable` file in LiteRT.

NumPy and the standalone TFLite interpreter of `export.on_device` only (LiteRT in the device
environment, tflite-runtime in the main one), no TensorFlow. A client's round (FedAvg's
ClientUpdate, McMahan et al., AISTATS 2017, Algorithm 1) is `set_weights(server weights)`,
which also zeroes the file's momentum buffers, then `train_epochs`, whose minibatches follow
`tff_ens.program.simulation.client_dataset`: the examples of `epochs` passes, each pass in its own
order, are concatenated and cut into batches of `batch_size`, so a batch may span two passes
and the last one may be smaller (`tf.data`'s `repeat(epochs).batch(batch_size)`).
"""

from typing import NamedTuple

import numpy as np

from export import ExportError
from export import on_device

SIGNATURES = ("train", "infer", "get_weights", "set_weights")


def weight_name(index: int) -> str:
  """The signature name of the `index`-th trainable variable (`model.trainable_variables`
  order)."""
  return f"w{index}"


def example_order(num_examples: int, epochs: int, seed: int | None) -> np.ndarray:
  """The indices of `epochs` passes over the examples: a new permutation per pass drawn by
  `np.random.default_rng(seed)`, or 0..n-1 each pass if seed is None."""
  if seed is None:
    return np.tile(np.arange(num_examples), epochs)
  rng = np.random.default_rng(seed)
  return np.concatenate([rng.permutation(num_examples) for _ in range(epochs)]).astype(int)


class LocalTraining(NamedTuple):
  """What a client's local epochs return (`DeviceTrainer.train_epochs`)."""

  weights: list[np.ndarray]
  num_examples: int
  mean_loss: float
  accuracy: float


class DeviceTrainer:
  """A trainable file in the standalone interpreter: set_weights, train_epochs, get_weights."""

  def __init__(self, flatbuffer: bytes, num_threads: int = 1, op_resolver: str = "AUTO"):
    """`op_resolver`: the interpreter's kernels, an `OpResolverType` name (AUTO: its builtin
    kernels with XNNPack; BUILTIN_WITHOUT_DEFAULT_DELEGATES; BUILTIN_REF, the reference ones)."""
    kernels = on_device.tflite.OpResolverType.__members__
    if op_resolver not in kernels:
      raise ExportError(f"op_resolver={op_resolver} is not one of {', '.join(kernels)}")
    interpreter = on_device.tflite.Interpreter(
      model_content=flatbuffer,
      num_threads=num_threads,
      experimental_op_resolver_type=kernels[op_resolver],
    )
    missing = [s for s in SIGNATURES if s not in interpreter.get_signature_list()]
    if missing:
      raise ExportError(
        f"the file has no {', '.join(missing)} signature(s): write it with "
        "export.trainable.convert_trainable"
      )
    self._train = interpreter.get_signature_runner("train")
    self._infer = interpreter.get_signature_runner("infer")
    self._get_weights = interpreter.get_signature_runner("get_weights")
    self._set_weights = interpreter.get_signature_runner("set_weights")
    inputs = self._set_weights.get_input_details()
    self.weight_shapes = [tuple(inputs[weight_name(i)]["shape"]) for i in range(len(inputs))]
    train_inputs = self._train.get_input_details()
    self.input_shape = tuple(train_inputs["x"]["shape_signature"][1:])
    # A file of `convert_trainable(static_batch=B)`: batches padded to B, with a mask.
    self.static_batch = int(train_inputs["x"]["shape"][0]) if "mask" in train_inputs else None
    self.num_classes = int(self._infer.get_output_details()["logits"]["shape_signature"][-1])
    self.runtime = f"{on_device.RUNTIME} (Interpreter, signature runners)"

  @classmethod
  def load(cls, path: str, num_threads: int = 1) -> "DeviceTrainer":
    with open(path, "rb") as f:
      return cls(f.read(), num_threads)

  def get_weights(self) -> list[np.ndarray]:
    weights = self._get_weights()
    return [weights[weight_name(i)] for i in range(len(self.weight_shapes))]

  def set_weights(self, weights: list[np.ndarray]) -> None:
    """Replaces the trainable weights and zeroes the momentum buffers (a fresh optimizer)."""
    shapes = [np.shape(w) for w in weights]
    if shapes != self.weight_shapes:
      raise ExportError(
        f"set_weights needs {len(self.weight_shapes)} arrays of shapes "
        f"{self.weight_shapes}, got {shapes}"
      )
    self._set_weights(**{weight_name(i): np.asarray(w, np.float32) for i, w in enumerate(weights)})

  def logits(self, x: np.ndarray) -> np.ndarray:
    return self._infer(x=self._check_x(x))["logits"]

  def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
    """One SGD step on the batch; its mean cross-entropy before the step."""
    return float(self._step(self._check_x(x), self._check_y(y, len(x)))["loss"])

  def _step(self, x: np.ndarray, y: np.ndarray) -> dict:
    """The `train` signature on a batch, padded with copies of its first example and masked
    in a static-batch file."""
    if self.static_batch is None:
      return self._train(x=x, y=y)
    n, size = len(x), self.static_batch
    if not 1 <= n <= size:
      raise ExportError(f"the file trains on batches of 1 to {size} examples, got {n}")
    pad = np.zeros(size - n, int)
    mask = np.arange(size) < n
    return self._train(
      x=np.concatenate([x, x[pad]]), y=np.concatenate([y, y[pad]]), mask=mask.astype(np.float32)
    )

  def train_epochs(
    self,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int = 1,
    batch_size: int,
    seed: int | None = None,
    order: np.ndarray | None = None,
    step_losses: list | None = None,
  ) -> "LocalTraining":
    """One `train` step per minibatch of the example stream, cut as the module docstring says.

    Args:
      x, y: the client's examples, float32 [n, *input_shape] and integer class indices [n].
      epochs, seed: the stream is `example_order(n, epochs, seed)`...
      batch_size: ...cut into batches of this size, the last one possibly smaller.
      order: the stream's example indices instead (epochs and seed unused), e.g. the order
        of the main environment's `tf.data` pipeline.
      step_losses: if given, each step's loss is appended to it.

    Returns:
      `LocalTraining`: the weights after the last step, the number of examples trained on
      (len(order)), their mean loss and accuracy, each example's taken before its batch's
      step (nan if none).
    """
    x, y = self._check_x(x), self._check_y(y, len(x))
    if order is None:
      order = example_order(len(x), epochs, seed)
    order = np.asarray(order)
    if (
      batch_size < 1
      or order.ndim != 1
      or (
        len(order)
        and not (
          np.issubdtype(order.dtype, np.integer) and 0 <= order.min() and order.max() < len(x)
        )
      )
    ):
      raise ExportError(
        f"batch_size must be >= 1 and order indices of the {len(x)} examples, "
        f"got batch_size={batch_size}, order {order.dtype} {list(order.shape)}"
      )
    loss_sum = correct = 0.0
    losses = [] if step_losses is None else step_losses
    for start in range(0, len(order), batch_size):
      batch = order[start : start + batch_size]
      step = self._step(x[batch], y[batch])
      losses.append(float(step["loss"]))
      loss_sum += len(batch) * losses[-1]
      correct += float(step["correct"])
    n = len(order)
    return LocalTraining(
      self.get_weights(), n, loss_sum / n if n else float("nan"), correct / n if n else float("nan")
    )

  def _check_x(self, x) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32 or x.shape[1:] != self.input_shape:
      raise ExportError(
        f"x must be float32 [n, {', '.join(map(str, self.input_shape))}], got "
        f"{x.dtype} {list(x.shape)}"
      )
    return x

  def _check_y(self, y, n: int) -> np.ndarray:
    y = np.asarray(y)
    if (
      y.shape != (n,)
      or not np.issubdtype(y.dtype, np.integer)
      or (n and (y.min() < 0 or y.max() >= self.num_classes))
    ):
      raise ExportError(
        f"y must be {n} class indices in 0..{self.num_classes - 1}, got {y.dtype} {list(y.shape)}"
      )
    return y.astype(np.int32)
