r"""Shakespeare's LSTM trained on every position of its windows against the last one alone.

  uv run python benchmarks/shakespeare_train_positions.py \
      --data_dir=../shared/data/shakespeare [--steps=160] [--eval_every=20] \
      [--batch_size=128] [--test_windows=1000] [--results=]

One client's local training (`client_work.train_locally`, the task's LSTM of 256 units,
Adam 0.001 restarted every `--eval_every` steps as `--client_optimizer=adam` restarts it
every round, batch 128: the Fed-ensemble paper's Table II recipe) on windows drawn
uniformly, seeded, from every training role's training windows (the iid split's pool),
with `--train_positions=every` and `=last` from the same initial weights, in turn every
`--eval_every` steps, so that the machine's load falls on both. After each turn: the loss
and accuracy of the model's output (the last position, LEAF's accuracy) on
`--test_windows` of the roles' test windows, and the turn's wall seconds per step.
Writes the section "## Shakespeare: every position against the last" of `--results`.
"""

import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

import report
from tasks import plays
from tasks import shakespeare
from tff_ens.templates import client_work

SECTION = "## Shakespeare: every position against the last"

report.define_flags()
flags.DEFINE_integer("steps", 160, "Local steps of each variant.")
flags.DEFINE_integer("eval_every", 20, "Steps between evaluations (and Adam restarts).")
flags.DEFINE_integer("batch_size", 128, "Windows a step.")
flags.DEFINE_integer("test_windows", 1000, "Test windows evaluated (a seeded draw).")
flags.DEFINE_float("learning_rate", 0.001, "Adam's learning rate.")
flags.DEFINE_integer("seed", 0, "Draws of the windows and the model's initial weights.")

FLAGS = flags.FLAGS


def pooled(split, count: int, rng) -> tuple[np.ndarray, np.ndarray]:
  """`count` windows drawn without replacement from every client of `split`."""
  x, y = split.concatenated()
  keep = rng.choice(len(y), count, replace=False)
  return x[keep].astype(np.int32), y[keep]


def main(argv):
  run = report.start(argv)
  data = plays.load_roles(
    FLAGS.data_dir,
    min_characters=1_000,
    held_out_fraction=0.1,
    eval_samples=0,
    seed=FLAGS.seed,
  )
  rng = np.random.default_rng(FLAGS.seed)
  train_x, train_y = pooled(data.train, FLAGS.steps * FLAGS.batch_size, rng)
  test_x, test_y = pooled(data.test, FLAGS.test_windows, rng)
  initial = shakespeare.build_model("lstm", seed=FLAGS.seed)
  weights = {
    positions: tf.nest.map_structure(
      lambda v: tf.constant(v.numpy()), client_work.ModelWeights.from_model(initial)
    )
    for positions in client_work.TRAIN_POSITIONS
  }
  models = {p: shakespeare.build_model("lstm", seed=FLAGS.seed) for p in weights}
  configs = {
    p: client_work.LocalTrainingConfig(
      learning_rate=FLAGS.learning_rate, optimizer="adam", train_positions=p
    )
    for p in weights
  }
  # One optimizer per variant, so that `train_locally` is traced once each.
  optimizers = {p: client_work.local_optimizer(c) for p, c in configs.items()}
  rows = []
  for turn in range(FLAGS.steps // FLAGS.eval_every):
    window = slice(
      turn * FLAGS.eval_every * FLAGS.batch_size, (turn + 1) * FLAGS.eval_every * FLAGS.batch_size
    )
    row = {"steps": (turn + 1) * FLAGS.eval_every}
    for positions, model in models.items():
      dataset = tf.data.Dataset.from_tensor_slices((train_x[window], train_y[window])).batch(
        FLAGS.batch_size
      )
      config = configs[positions]
      start = time.perf_counter()
      result, metrics = client_work.train_locally(
        model,
        optimizers[positions],
        weights[positions],
        dataset,
        FLAGS.learning_rate,
        config,
      )
      seconds = time.perf_counter() - start
      weights[positions] = tf.nest.map_structure(tf.subtract, weights[positions], result.update)
      weights[positions].assign_weights_to(model)
      logits = model.predict(test_x, batch_size=250, verbose=0)
      loss = tf.keras.losses.sparse_categorical_crossentropy(test_y, logits, from_logits=True)
      row[positions] = (
        float(metrics["loss"] / metrics["num_examples"]),
        float(np.mean(loss)),
        float(np.mean(np.argmax(logits, -1) == test_y)),
        seconds / FLAGS.eval_every,
      )
    rows.append(row)
    print(row, flush=True)
  lines = [
    SECTION,
    "",
    f"One client's local training on {len(train_y):,} training windows drawn from all "
    f"{len(data.train.client_ids)} training roles (seed {FLAGS.seed}), the task's LSTM "
    f"(256 units), Adam {FLAGS.learning_rate} restarted every {FLAGS.eval_every} steps, "
    f"batch {FLAGS.batch_size}; both variants from the same initial weights, in turn every "
    f"{FLAGS.eval_every} steps. Test: the model's output (the last position) on "
    f"{len(test_y):,} test windows of the roles. Train loss: the turn's mean over its "
    "windows (every: over their 80 positions).",
    "",
    *report.run_facts(run, "benchmarks/shakespeare_train_positions.py"),
    "",
    "| steps | every: train loss | every: test loss | every: test accuracy | last: train "
    "loss | last: test loss | last: test accuracy | s/step every | s/step last | ratio |",
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for row in rows:
    (ea, eb, ec, es), (la, lb, lc, ls) = row["every"], row["last"]
    lines.append(
      f"| {row['steps']} | {ea:.3f} | {eb:.3f} | {ec:.4f} | {la:.3f} | {lb:.3f} | {lc:.4f} "
      f"| {es:.2f} | {ls:.2f} | {es / ls:.2f} |"
    )
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
