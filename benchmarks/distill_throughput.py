r"""Examples/second of server distillation against Keras `fit` (issues 4 and 20).

  uv run python benchmarks/distill_throughput.py [--steps=150] [--repeats=2]

The LEAF CNN on the unlabeled server images of the FEMNIST slice (the images
of the writers that have test data only), batch `--batch_size`, soft targets
from an ensemble of two differently initialized CNNs (`ensemble_predictions`).
Variants, each `--steps` steps:

  fit, SGD        Keras `model.fit(x, targets)` compiled with SGD (1e-3,
                  momentum 0.9) and cross-entropy to the targets;
  distill, SWA    `student_lib.Student.distill` with FedBE's config (cyclical
                  step size, SWA collection every 25 steps), in the driver as
                  the server step runs it (`tf.data`, one compiled step);
  distill, SWA, from files
                  the same, the images streamed from a `.npy` file and the
                  targets from a temporary file (`server_data.ImageFile`);
  fit, Adam       Keras `fit` with Adam 1e-3 and KL divergence;
  distill, Adam   `distill` with FedDF's config (Adam, cosine, early stopping
                  on 500 training images as validation every 100 steps, with
                  a patience above `--steps` so every step runs);

Each variant runs once untimed (tracing, graph set-up), then the variants take
turns for `--repeats` timed runs (so that other jobs' load falls on all of
them); the table gives the best examples/second of each (examples processed
in training steps over wall time, teacher labeling excluded), the best
examples per CPU-second (less sensitive to other jobs on a shared machine) and
the ratios to `fit` with the same optimizer. Writes the section "## Distillation
throughput (issues 4 and 20)" of `--results`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tempfile
import time

from absl import app
from absl import flags
import numpy as np

# TensorFlow before absl parses flags (see tff_ens/main.py).
import tensorflow as tf
import tensorflow_federated as tff

import report
from tasks import femnist
from tff_ens.server import distillation
from tff_ens.server import server_data
from tff_ens.server import student as student_lib

SECTION = "## Distillation throughput (issues 4 and 20)"

report.define_flags()
flags.DEFINE_integer("steps", 150, "Training steps per timed run.")
flags.DEFINE_integer("batch_size", 64, "Distillation batch size.")
flags.DEFINE_integer("repeats", 2, "Timed runs per variant (best of).")

FLAGS = flags.FLAGS

ModelWeights = tff.learning.models.ModelWeights


def model_fn():
  return femnist.build_model("cnn", seed=0)


def soft_targets(x):
  """Mean probabilities of two CNNs (seeds 1 and 2) on `x`."""
  model = model_fn()
  teachers = [ModelWeights.from_model(femnist.build_model("cnn", seed=s)) for s in (1, 2)]
  stacked = tf.nest.map_structure(lambda *v: tf.stack(v), *teachers)
  return distillation.ensemble_predictions(model, stacked, x)["mean_probabilities"].numpy()


def fit_variant(x, targets, optimizer: str):
  """A timed `model.fit` of about FLAGS.steps steps.

  SGD with cross-entropy on the logits, or Adam with KL divergence on the
  softmax of the logits (Keras' KLDivergence takes probabilities), as
  `distill` computes them.
  """
  model = model_fn()
  if optimizer == "sgd":
    model.compile(
      tf.keras.optimizers.SGD(1e-3, momentum=0.9),
      tf.keras.losses.CategoricalCrossentropy(from_logits=True),
    )
  else:
    model = tf.keras.Sequential([model, tf.keras.layers.Softmax()])
    model.compile(tf.keras.optimizers.Adam(1e-3), tf.keras.losses.KLDivergence())
  batch = FLAGS.batch_size
  epochs = max(1, round(FLAGS.steps / -(-len(x) // batch)))

  def timed():
    start = time.perf_counter()
    model.fit(x, targets, batch_size=batch, epochs=epochs, shuffle=True, verbose=0)
    return epochs * len(x), time.perf_counter() - start

  return timed


def distill_variant(x, targets, config, validation=None):
  """A timed `distill` of arrays (a `Student` built once, as the server step keeps it)."""
  model = model_fn()
  weights = tf.nest.map_structure(tf.identity, ModelWeights.from_model(model))
  student = student_lib.Student(model, config)

  def timed():
    start = time.perf_counter()
    _, stats = student.distill(weights, x, targets, 0, validation=validation)
    return int(stats["examples"]), time.perf_counter() - start

  return timed


def file_variant(x, targets, config, directory):
  """A timed `distill` whose images and targets stream from files (`ImageFile`s)."""
  np.save(os.path.join(directory, "x.npy"), x)
  images = server_data.ImageFile.npy(os.path.join(directory, "x.npy"))
  soft = server_data.ImageFile.temporary(targets.shape)
  soft[0 : len(targets)] = targets
  model = model_fn()
  weights = tf.nest.map_structure(tf.identity, ModelWeights.from_model(model))
  student = student_lib.Student(model, config)

  def timed():
    start = time.perf_counter()
    _, stats = student.distill(weights, images, soft, 0)
    return int(stats["examples"]), time.perf_counter() - start

  return timed


def main(argv):
  run = report.start(argv)
  data = femnist.load_data(FLAGS.data_dir)
  x, _ = data.new_clients.concatenated()
  targets = soft_targets(x)
  train_x, train_y = data.train.concatenated()
  validation = (tf.constant(train_x[:500]), tf.constant(train_y[:500]))
  swa = distillation.fedbe_config(FLAGS.steps, batch_size=FLAGS.batch_size)
  adam = distillation.feddf_config(
    FLAGS.steps, batch_size=FLAGS.batch_size, patience=FLAGS.steps + 1, eval_every=100
  )
  with tempfile.TemporaryDirectory() as directory:
    variants = {
      "fit, SGD": fit_variant(x, targets, "sgd"),
      "distill, SWA": distill_variant(x, targets, swa),
      "distill, SWA, from files": file_variant(x, targets, swa, directory),
      "fit, Adam": fit_variant(x, targets, "adam"),
      "distill, Adam (early stopping)": distill_variant(x, targets, adam, validation),
    }
    for name, timed in variants.items():
      examples, seconds = timed()  # Untimed.
      print(f"{name}: untimed run {examples / seconds:.0f} examples/s", flush=True)
    best = {name: 0.0 for name in variants}
    best_cpu = {name: 0.0 for name in variants}
    for repeat in range(FLAGS.repeats):
      for name, timed in variants.items():
        cpu_start = report.cpu_seconds()
        examples, seconds = timed()
        cpu = report.cpu_seconds() - cpu_start
        best[name] = max(best[name], examples / seconds)
        best_cpu[name] = max(best_cpu[name], examples / cpu)
        print(
          f"run {repeat + 1}, {name}: {examples / seconds:.0f} "
          f"examples/s, {examples / cpu:.0f} examples/CPU-s",
          flush=True,
        )
  lines = [
    SECTION,
    "",
    f"LEAF CNN on the {len(x):,} unlabeled server images of the FEMNIST "
    f"slice (test-only writers), batch {FLAGS.batch_size}, about "
    f"{FLAGS.steps} steps per run, soft targets of two CNNs; best of "
    f"{FLAGS.repeats} timed runs after one untimed run, variants taking "
    "turns, all on the device TensorFlow chooses (the CPU here). `distill` "
    "runs in the driver as the server step runs it (a `tf.data` "
    "pipeline, one compiled step) with FedBE's config (SGD momentum 0.9, "
    "cyclical step size, SWA every 25 steps) or FedDF's (Adam, cosine, "
    "validation on 500 images every 100 steps); each is compared with Keras "
    '`fit` with the same optimizer and loss. "from files" streams the images '
    "from a `.npy` file and the targets from a temporary file "
    "(`server_data.ImageFile`), as a `--server_data=FILE.npy` run does.",
    "",
    *report.run_facts(
      run,
      "benchmarks/distill_throughput.py",
      ", GPU" if tf.config.list_logical_devices("GPU") else ", no GPU",
    ),
    "",
    "| variant | examples/s | ratio to `fit` | examples/CPU-second | ratio to `fit` |",
    "| --- | ---: | ---: | ---: | ---: |",
  ]
  for name in variants:
    fit = "fit, Adam" if "Adam" in name else "fit, SGD"
    lines.append(
      f"| {name} | {best[name]:,.0f} | {best[name] / best[fit]:.2f} | "
      f"{best_cpu[name]:,.0f} | {best_cpu[name] / best_cpu[fit]:.2f} |"
    )
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
