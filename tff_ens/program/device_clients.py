"""Clients whose local training runs on phones: LiteRT processes of the device environment.

With `--client_runtime=litert`, each sampled client's local epochs run in the TFLite
interpreter a phone has, not in TensorFlow: the run's model becomes a `--format=trainable`
file (`export.trainable`, builtin ops only), and `export.device_client` processes of the
device environment (`device/`: LiteRT and NumPy, no TensorFlow) stand in for the phones,
`--device_processes` of them at a time. Each trains from the weights the server sent it
(FedAvg's model, or the Fed-ensemble member it is assigned), with
the run's batch size, learning rate and momentum, on its client's examples in the order a
TFF client of the same round would (`simulation.client_order`: the run's epochs, the client's
round seed, a straggler's share), and returns its weights and sums of loss, correct
predictions and examples. TFF then runs the
round as for any client (`device_client_work.build_device_client_work`): the update, its weight,
the aggregation and the server step are FedAvg's.

A device process that fails (it exits, or answers with an error) is a dropout: the client
is left out of the round with a one-line warning naming it, and the process is restarted.
"""

import collections
import concurrent.futures
import json
import logging
import os
import queue
import subprocess
import tempfile

import numpy as np
import tensorflow as tf

from export import device_training
from export import trainable
from tff_ens.program import experiment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICE_PYTHON = os.path.join(REPO_ROOT, "device", ".venv", "bin", "python")
# The run's trainable file, in its output directory.
TRAINABLE_FILE = "trainable.tflite"


class DeviceError(RuntimeError):
  """The device environment cannot run clients (not installed, or a file it rejects)."""


class _Device:
  """One `export.device_client` process."""

  def __init__(self, trainable_path: str, python: str):
    self.process = subprocess.Popen(
      [python, "-m", "export.device_client", trainable_path],
      cwd=REPO_ROOT,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      text=True,
    )
    ready = self.process.stdout.readline()
    if not ready.strip().startswith('{"ready"'):
      self.close()
      raise DeviceError(
        f"the device process did not start ({python} -m export.device_client "
        f"{trainable_path} printed {ready.strip()[:200]!r}): check the device environment "
        "(uv sync --locked --project device)"
      )

  def ask(self, request: dict) -> dict:
    """The answer to `request`; {"error": ...} if the process has exited or garbled it."""
    try:
      self.process.stdin.write(json.dumps(request) + "\n")
      self.process.stdin.flush()
      answer = self.process.stdout.readline()
    except (BrokenPipeError, OSError) as e:
      return {"error": f"the process is gone ({e})"}
    if not answer:
      return {"error": f"the process exited with status {self.process.wait()}"}
    try:
      return json.loads(answer)
    except ValueError:
      return {"error": f"unreadable answer {answer.strip()[:200]!r}"}

  def close(self):
    if self.process.poll() is None:
      self.process.kill()
    self.process.wait()


class DevicePool:
  """`num_devices` device processes serving a run's clients (module docstring)."""

  def __init__(self, trainable_path: str, num_devices: int, python: str = DEVICE_PYTHON):
    if not os.path.exists(python):
      raise DeviceError(
        f"--client_runtime=litert needs the device environment ({python} is missing): "
        "install it with `uv sync --locked --project device`"
      )
    self._trainable_path = trainable_path
    self._python = python
    self._work_dir = tempfile.TemporaryDirectory(prefix="tff_ens_devices_")
    self._idle = queue.Queue()
    for _ in range(num_devices):
      self._idle.put(_Device(trainable_path, python))
    self._num_devices = num_devices

  def train(self, models: list[list[np.ndarray]], requests: list[dict], names: list[str]) -> list:
    """Each request's client trained on its devices, in parallel.

    Args:
      models: the trainable weights of each model the server sent (FedAvg's one,
        Fed-ensemble's K members).
      requests: per client, {"x", "y", "order", "batch_size", "model"}: its examples, the
        indices it trains on in their order, the batch size, and the index in `models` of
        the one it starts from.
      names: the clients' names, for the dropout warnings.

    Returns:
      Per client, (trained weights, loss sum, correct, num_examples), or None if its
      device failed.
    """
    work = self._work_dir.name
    weights_paths = []
    for k, weights in enumerate(models):
      weights_paths.append(os.path.join(work, f"server_weights_{k}.npz"))
      np.savez(
        weights_paths[k], **{device_training.weight_name(i): w for i, w in enumerate(weights)}
      )

    def run(i: int):
      data_path, out_path = (os.path.join(work, f"{kind}_{i}.npz") for kind in ("data", "out"))
      request = requests[i]
      np.savez(data_path, x=request["x"], y=request["y"], order=request["order"])
      device = self._idle.get()
      try:
        answer = device.ask(
          {
            "weights": weights_paths[request["model"]],
            "data": data_path,
            "out": out_path,
            "batch_size": request["batch_size"],
          }
        )
        if "error" in answer:
          logging.warning(
            "device client %s failed (%s): dropped from this round", names[i], answer["error"]
          )
          device.close()
          device = _Device(self._trainable_path, self._python)
          return None
        with np.load(out_path) as trained:
          trained = [trained[device_training.weight_name(k)] for k in range(len(models[0]))]
        return trained, answer["loss"], answer["correct"], answer["num_examples"]
      finally:
        self._idle.put(device)

    with concurrent.futures.ThreadPoolExecutor(self._num_devices) as executor:
      return list(executor.map(run, range(len(requests))))

  def close(self):
    while not self._idle.empty():
      self._idle.get().close()
    self._work_dir.cleanup()


def result_dataset(trained: list[np.ndarray], loss: float, correct: float, num_examples: float):
  """A device's result as the client's data of `device_client_work.build_device_client_work`."""
  return tf.data.Dataset.from_tensors(
    collections.OrderedDict(
      trainable=tuple(tf.constant(w, tf.float32) for w in trained),
      loss=np.float32(loss),
      correct=np.float32(correct),
      num_examples=np.float32(num_examples),
    )
  )


def write_trainable_file(
  run: "experiment.Run", output_dir: str, static_batch: int | None = None
) -> str:
  """The run's model as a `--format=trainable` file (`export.trainable`) with its client
  learning rate and momentum (and `static_batch`), for `--client_runtime=litert`, in
  `output_dir`; its path.

  Raises:
    UsageError: the model does not convert (the message names the layer).
  """
  model = run.task.build_model(run.model.name, seed=run.model.seed, norm=run.model.norm)
  try:
    flatbuffer = trainable.convert_trainable(
      model,
      learning_rate=run.local.learning_rate,
      momentum=run.local.momentum,
      static_batch=static_batch,
    )
  except ValueError as e:
    raise experiment.UsageError(f"--client_runtime={run.devices.runtime}: {e}") from None
  path = os.path.join(output_dir, TRAINABLE_FILE)
  with open(f"{path}.tmp", "wb") as f:
    f.write(flatbuffer)
  os.replace(f"{path}.tmp", path)
  return path
