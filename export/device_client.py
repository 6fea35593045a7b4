r"""A phone standing in for a federated client: serves local training requests in LiteRT.

  python -m export.device_client TRAINABLE.tflite    (in the device environment)

Started by `tff_ens.program.device_clients` (the simulation's driver), one process per concurrent
client. It loads the `--format=trainable` file once, prints one JSON line
`{"ready": true, "runtime": ...}`, then answers one JSON line per request line on stdin:

- request: {"weights": NPZ, "data": NPZ, "batch_size": B, "out": NPZ}: set the file's
  weights to NPZ's w0, w1, ... (the model the server sent), train
  `export.device_training.DeviceTrainer.train_epochs` on data's x, y in batches of B of the
  examples data's `order` lists (the driver's `tff_ens.program.simulation.client_order`: the order a
  TFF client would train in, its epochs and a straggler's share included), and write the
  trained weights to out;
- answer: {"num_examples": n, "loss": sum of the examples' losses, "correct": number of
  correct predictions}, both taken before each batch's step, or {"error": "..."}.

An empty line or end of input stops it. NumPy and LiteRT only, no TensorFlow.
"""

import json
import sys

import numpy as np

from export import ExportError
from export import device_training


def train(trainer: device_training.DeviceTrainer, request: dict) -> dict:
  """One client's local training as the module docstring describes; its answer."""
  with np.load(request["weights"]) as weights:
    trainer.set_weights([weights[device_training.weight_name(i)] for i in range(len(weights))])
  with np.load(request["data"]) as data:
    x, y, order = data["x"], data["y"], data["order"]
  result = trainer.train_epochs(x, y, batch_size=request["batch_size"], order=order)
  np.savez(
    request["out"], **{device_training.weight_name(i): w for i, w in enumerate(result.weights)}
  )
  n = result.num_examples
  return {
    "num_examples": n,
    "loss": result.mean_loss * n if n else 0.0,
    "correct": result.accuracy * n if n else 0.0,
  }


def serve(path: str, requests=sys.stdin, answers=sys.stdout) -> None:
  """Loads the file at `path`, then answers `requests` (lines) until an empty one."""
  trainer = device_training.DeviceTrainer.load(path)
  print(json.dumps({"ready": True, "runtime": trainer.runtime}), file=answers, flush=True)
  for line in requests:
    if not line.strip():
      break
    try:
      answer = train(trainer, json.loads(line))
    except (ExportError, OSError, KeyError, ValueError) as e:
      answer = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(answer), file=answers, flush=True)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit("usage: python -m export.device_client TRAINABLE.tflite")
  serve(sys.argv[1])
