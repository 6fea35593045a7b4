r"""How far apart correct runtimes train the same steps: LiteRT.js against LiteRT Python's
three kernel sets, and those against each other.

  uv run python benchmarks/kernel_agreement.py [--steps=10] [--batch_size=20]

The LEAF CNN (seed 0) as a static-batch trainable file, `--steps` steps of `--batch_size`
FEMNIST slice images from the same weights: in a headless page (`browser_clients.BrowserPool`,
the run's browser client) and in LiteRT Python (the device environment,
`export.device_training.DeviceTrainer`, the run's LiteRT client) with each `OpResolverType`:
AUTO (what LiteRT clients use: builtin kernels with XNNPack), BUILTIN_WITHOUT_DEFAULT_DELEGATES
and BUILTIN_REF. For each pair: the largest weight difference after the steps, the share of
weights that are bit-equal, and the largest step-loss difference. Writes the section
"## Kernel agreement: LiteRT.js against LiteRT Python's kernel sets (issue 65)" of
`--results`.
"""

import itertools
import os
import subprocess
import tempfile

from absl import app
from absl import flags
import device_kernels
import numpy as np

from export import device_training
from export import trainable
import report
from tasks import femnist

# Replaces the default TFF context that importing TFF (through tasks) installs, whose
# clean-up at interpreter exit fails.
from tff_ens.execution import runtime  # noqa: F401
from tff_ens.program import browser_clients
from tff_ens.program import device_clients

SECTION = "## Kernel agreement: LiteRT.js against LiteRT Python's kernel sets (issue 65)"


def agreement(a: dict, b: dict) -> tuple[float, float, float]:
  """(max |weight difference|, share bit-equal, max |step-loss difference|)."""
  return (
    float(np.max(np.abs(a["weights"] - b["weights"]))),
    float(np.mean(a["weights"] == b["weights"])),
    float(np.max(np.abs(a["losses"] - b["losses"]))),
  )


def browser_steps(path: str, weights: list, request: dict) -> dict:
  """The same steps in a headless page, the run's browser client."""
  pool = browser_clients.BrowserPool(path, 1)
  try:
    ((trained, *_),) = pool.train([weights], [request], ["kernels"])
    return {
      "weights": np.concatenate([w.ravel() for w in trained]),
      "losses": np.array(pool.step_losses[0]),
    }
  finally:
    pool.close()


def measured(settings) -> tuple[int, dict[str, dict]]:
  """The model's size, and each runtime's weights and step losses after the steps."""
  batch, n = settings.batch_size, settings.steps * settings.batch_size
  x, y = femnist.load_data(settings.data_dir).train.concatenated()
  request = {"x": x[:n].astype(np.float32), "y": y[:n].astype(np.int32), "order": np.arange(n)}
  request.update(batch_size=batch, model=0)
  model = femnist.build_model("cnn", seed=0)
  weights = [w.numpy() for w in model.trainable_variables]
  named = {device_training.weight_name(i): w for i, w in enumerate(weights)}
  with tempfile.TemporaryDirectory() as work:
    path = os.path.join(work, "static.tflite")
    with open(path, "wb") as f:
      f.write(trainable.convert_trainable(model, learning_rate=0.05, static_batch=batch))
    np.savez(os.path.join(work, "inputs.npz"), **named, **request)
    subprocess.run(
      [device_clients.DEVICE_PYTHON, device_kernels.__file__, work],
      cwd=report.REPO_ROOT,
      check=True,
    )
    runs = {}
    for resolver in device_kernels.RESOLVERS:
      with np.load(os.path.join(work, f"{resolver}.npz")) as saved:
        runs[f"LiteRT Python {resolver}"] = dict(saved)
    runs["LiteRT.js (headless Chromium)"] = browser_steps(path, weights, request)
  return model.count_params(), runs


def main(argv):
  started = report.start(argv)
  settings = flags.FLAGS
  size, runs = measured(settings)
  rows = [(a, b, *agreement(runs[a], runs[b])) for a, b in itertools.combinations(runs, 2)]
  lines = [
    SECTION,
    "",
    f"The LEAF CNN (seed 0, {size:,} weights), {settings.steps} steps of "
    f"{settings.batch_size} FEMNIST slice images from the same weights, learning rate 0.05, "
    "static-batch trainable file; each runtime and kernel set once.",
    "",
    *report.run_facts(started, "benchmarks/kernel_agreement.py"),
    "",
    "| runtime | against | max weight difference | weights bit-equal | max step-loss difference |",
    "| --- | --- | ---: | ---: | ---: |",
    *[f"| {a} | {b} | {dw:.2g} | {eq:.1%} | {dl:.2g} |" for a, b, dw, eq, dl in rows],
  ]
  report.publish(SECTION, lines)


report.define_flags()
flags.DEFINE_integer("steps", 10, "Training steps.")
flags.DEFINE_integer("batch_size", 20, "Examples per step.")

if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  app.run(main)
