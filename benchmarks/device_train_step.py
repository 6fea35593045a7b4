r"""Time of one local SGD step of the LEAF CNN: Keras against the trainable TFLite file.

  uv run python benchmarks/device_train_step.py [--batch_size=64] [--repeats=15]

One client step on a batch of FEMNIST training images (the slice's first writers), the
variants measured one after the other in one run: Keras `train_on_batch` (TensorFlow's own
threads), and the `--format=trainable` file (`export.trainable`) through
`export.device_training.DeviceTrainer` in tflite-runtime here and in LiteRT in the device
environment (no TensorFlow; skipped if it is not installed), one and two interpreter threads.
Each variant's median over `--repeats` steps after 3 untimed ones. Writes the section
"## On-device training step" of `--results`.
"""

import json
import os
import subprocess
import tempfile
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

from export import device_training
from export import trainable
import report
from tasks import femnist

# Replaces the default TFF context that importing TFF (through tasks) installs, whose
# clean-up at interpreter exit fails.
from tff_ens.execution import runtime  # noqa: F401

SECTION = "## On-device training step"
DEVICE_PYTHON = os.path.join(report.REPO_ROOT, "device", ".venv", "bin", "python")
LEARNING_RATE = 0.05
WARMUP = 3

report.define_flags()
flags.DEFINE_integer("batch_size", 64, "Examples per step.")
flags.DEFINE_integer("repeats", 15, "Timed steps per variant (median over).")
FLAGS = flags.FLAGS

# The device process: times `repeats` steps of the file at each thread count.
_DEVICE_TIMING = """
import json, sys, time
import numpy as np
from export import device_training
path, data, repeats, warmup = sys.argv[1], np.load(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
result = {}
for threads in (1, 2):
  trainer = device_training.DeviceTrainer.load(path, threads)
  times = []
  for _ in range(warmup + repeats):
    start = time.perf_counter()
    trainer.train_step(data["x"], data["y"])
    times.append(time.perf_counter() - start)
  result[threads] = 1000 * float(np.median(times[warmup:]))
result["runtime"] = trainer.runtime
result["tensorflow"] = "tensorflow" in sys.modules
print(json.dumps(result))
"""


def _median_ms(step, repeats: int) -> float:
  times = []
  for _ in range(WARMUP + repeats):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  return 1000 * float(np.median(times[WARMUP:]))


def main(argv):
  started = report.start(argv)
  data = femnist.load_data(FLAGS.data_dir)
  x, y = data.train.concatenated()
  x, y = x[: FLAGS.batch_size], y[: FLAGS.batch_size].astype(np.int32)
  model = femnist.build_model("cnn", seed=0)
  flatbuffer = trainable.convert_trainable(model, learning_rate=LEARNING_RATE)
  model.compile(
    optimizer=tf.keras.optimizers.SGD(LEARNING_RATE),
    loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  rows = [
    (
      "Keras train_on_batch (TensorFlow 2.14)",
      "TensorFlow's",
      _median_ms(lambda: model.train_on_batch(x, y), FLAGS.repeats),
    )
  ]
  for threads in (1, 2):
    trainer = device_training.DeviceTrainer(flatbuffer, threads)
    rows.append(
      (
        f"trainable file, {trainer.runtime.split(' (')[0]}",
        str(threads),
        _median_ms(lambda: trainer.train_step(x, y), FLAGS.repeats),
      )
    )
  if os.path.exists(DEVICE_PYTHON):
    with tempfile.TemporaryDirectory() as work:
      path, batch = os.path.join(work, "cnn.tflite"), os.path.join(work, "batch.npz")
      with open(path, "wb") as f:
        f.write(flatbuffer)
      np.savez(batch, x=x, y=y)
      out = subprocess.run(
        [DEVICE_PYTHON, "-c", _DEVICE_TIMING, path, batch, str(FLAGS.repeats), str(WARMUP)],
        cwd=report.REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
      )
      device = json.loads(out.stdout.strip().splitlines()[-1])
    assert not device["tensorflow"]
    for threads in ("1", "2"):
      rows.append(
        (
          f"trainable file, {device['runtime'].split(' (')[0]} (device environment)",
          threads,
          device[threads],
        )
      )
  keras_ms = rows[0][2]
  lines = [
    SECTION,
    "",
    f"One SGD step (learning rate {LEARNING_RATE}) of the LEAF CNN on {FLAGS.batch_size} "
    "FEMNIST training images, median of "
    f"{FLAGS.repeats} steps after {WARMUP} untimed ones, variants measured one after the "
    "other in one run. The trainable file is `python -m export --format=trainable` "
    f"({len(flatbuffer):,} bytes; builtin ops only, so LiteRT runs it without the Flex "
    "delegate).",
    "",
    *report.run_facts(started, "benchmarks/device_train_step.py"),
    "",
    "| variant | threads | ms per step | / Keras |",
    "| --- | --- | ---: | ---: |",
    *[f"| {name} | {threads} | {ms:.1f} | {ms / keras_ms:.2f} |" for name, threads, ms in rows],
  ]
  report.publish(SECTION, lines)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  app.run(main)
