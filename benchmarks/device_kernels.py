"""The device environment's half of `kernel_agreement.py`: the steps in LiteRT Python with
each kernel set (`OpResolverType`), NumPy and LiteRT only.

  device/.venv/bin/python benchmarks/device_kernels.py WORK

reads WORK/static.tflite and WORK/inputs.npz (the weights w0, w1, ... as in
`export.device_client`'s requests; x, y, order, batch_size) and writes WORK/RESOLVER.npz (the
weights after the steps, flat, and each step's loss).
"""

import os
import sys

import numpy as np

RESOLVERS = ("AUTO", "BUILTIN_WITHOUT_DEFAULT_DELEGATES", "BUILTIN_REF")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(work: str) -> None:
  """In the device environment: each resolver's steps on `work`'s inputs, saved there."""
  from export import device_training

  inputs = np.load(os.path.join(work, "inputs.npz"))
  with open(os.path.join(work, "static.tflite"), "rb") as f:
    flatbuffer = f.read()
  for resolver in RESOLVERS:
    trainer = device_training.DeviceTrainer(flatbuffer, op_resolver=resolver)
    names = map(device_training.weight_name, range(len(trainer.weight_shapes)))
    trainer.set_weights([inputs[name] for name in names])
    losses = []
    trained = trainer.train_epochs(
      inputs["x"],
      inputs["y"],
      batch_size=int(inputs["batch_size"]),
      order=inputs["order"],
      step_losses=losses,
    )
    np.savez(
      os.path.join(work, f"{resolver}.npz"),
      weights=np.concatenate([w.ravel() for w in trained.weights]),
      losses=np.array(losses),
    )


if __name__ == "__main__":
  sys.path.insert(0, REPO_ROOT)
  main(sys.argv[1])
