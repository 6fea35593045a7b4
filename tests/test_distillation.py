"""Tests of `tff_ens.server.distillation`: FedBE's and FedDF's server distillation.

Hand/NumPy checks on the tiny linear models of `tiny.py` (4 features, 3
classes): the targets and losses (AVGLOGITS KL, cross-entropy, sharpening
with a temperature), teacher predictions over a stack of weights, one
training step (also with gradient clipping), SWA (the average of the models
collected at the cycle ends, batch-norm statistics recomputed, the warm-up),
early stopping (the best evaluated student, or the initial one), both
drop-worst rules, the device choice, and `distill` inside a TFF computation
run by the shared TFF context (conftest.py).
"""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.algorithms import fedbe
from tff_ens.algorithms import feddf
from tff_ens.math import drop_worst
from tff_ens.server import distillation
from tff_ens.server import server_data
from tff_ens.server import student as student_lib
from tff_ens.templates import server_distillation
from tiny import tiny_model

ModelWeights = tff.learning.models.ModelWeights
Config = distillation.DistillationConfig

X = np.array(
  [
    [1.0, 0.0, -1.0, 2.0],
    [0.5, -0.5, 1.0, 0.0],
    [-1.0, 2.0, 0.0, 1.0],
    [2.0, 1.0, 0.0, -1.0],
    [0.0, 0.0, 1.0, 3.0],
    [1.0, 1.0, 1.0, 1.0],
  ],
  np.float32,
)
TARGETS = np.array(
  [
    [0.7, 0.2, 0.1],
    [0.1, 0.1, 0.8],
    [0.3, 0.4, 0.3],
    [0.0, 1.0, 0.0],
    [0.5, 0.25, 0.25],
    [0.2, 0.2, 0.6],
  ],
  np.float32,
)


def images(rows):
  return tf.constant(np.asarray(rows, np.float32).reshape(-1, 2, 2, 1))


def softmax(z):
  z = np.asarray(z, np.float64)
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def weights_of(model):
  return tf.nest.map_structure(tf.identity, ModelWeights.from_model(model))


def numpy_logits(weights, rows):
  kernel, bias = (np.asarray(t, np.float64) for t in weights.trainable)
  return np.asarray(rows, np.float64).reshape(len(rows), -1) @ kernel + bias


def stack(*weights):
  return tf.nest.map_structure(lambda *t: tf.stack(t), *weights)


# Targets and losses ---------------------------------------------------------

TEACHER_LOGITS = np.array(
  [[[1.0, 2.0, 0.0], [0.0, 0.0, 3.0]], [[3.0, 0.0, 0.0], [1.0, -1.0, 1.0]]], np.float32
)
STUDENT_LOGITS = np.array([[0.5, 0.5, 0.0], [2.0, 0.0, 1.0]], np.float32)


def test_avg_logits_kl_by_hand():
  # Teacher: softmax of the mean logits [[2, 1, 0], [0.5, -0.5, 2]].
  p = softmax([[2.0, 1.0, 0.0], [0.5, -0.5, 2.0]])
  q = softmax(STUDENT_LOGITS)
  want = np.mean(np.sum(p * np.log(p / q), axis=1))
  got = distillation.avg_logits_kl(TEACHER_LOGITS, STUDENT_LOGITS)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(distillation.avg_logits_targets(TEACHER_LOGITS.mean(0)), p, rtol=1e-6)


def test_cross_entropy_differs_from_kl_by_the_target_entropy():
  p = distillation.mean_probability_targets(TEACHER_LOGITS).numpy()
  np.testing.assert_allclose(p, softmax(TEACHER_LOGITS).mean(0), rtol=1e-6)
  q = softmax(STUDENT_LOGITS)
  cross_entropy = np.mean(-np.sum(p * np.log(q), axis=1))
  entropy = np.mean(-np.sum(p * np.log(p), axis=1))
  np.testing.assert_allclose(
    distillation.distillation_loss("cross_entropy", p, STUDENT_LOGITS), cross_entropy, rtol=1e-5
  )
  np.testing.assert_allclose(
    distillation.distillation_loss("kl", p, STUDENT_LOGITS), cross_entropy - entropy, rtol=1e-4
  )
  with pytest.raises(ValueError, match="unknown loss 'l2'"):
    distillation.distillation_loss("l2", p, STUDENT_LOGITS)


def test_sharpen_raises_to_one_over_the_temperature_and_renormalizes():
  p = np.array([[0.5, 0.3, 0.2], [0.25, 0.25, 0.5]], np.float32)
  # T = 0.5 (the default): p^2 / sum p^2.
  want = [[0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38], [1 / 6, 1 / 6, 4 / 6]]
  np.testing.assert_allclose(distillation.sharpen(p), want, rtol=1e-6)
  np.testing.assert_allclose(distillation.sharpen(p, 0.5), want, rtol=1e-6)
  # T = 1 keeps p; T = 0.25 is p^4 / sum p^4; T = 2 flattens, sqrt(p).
  np.testing.assert_allclose(distillation.sharpen(p, 1.0), p, rtol=1e-6)
  np.testing.assert_allclose(
    distillation.sharpen(p, 0.25)[0], np.array([0.0625, 0.0081, 0.0016]) / 0.0722, rtol=1e-5
  )
  roots = np.sqrt([0.25, 0.25, 0.5])
  np.testing.assert_allclose(distillation.sharpen(p, 2.0)[1], roots / roots.sum(), rtol=1e-6)
  # A small T on small probabilities: p^(1/T) underflows in float32 (1e-50),
  # softmax(log p / T) does not. A zero stays zero.
  small = np.array([[1e-5, 2e-5, 0.0]], np.float32)
  np.testing.assert_allclose(
    distillation.sharpen(small, 0.1), [[1 / 1025, 1024 / 1025, 0.0]], rtol=1e-4
  )


# Teachers -------------------------------------------------------------------


def test_ensemble_predictions_and_member_accuracies_match_numpy():
  model = tiny_model(seed=0)
  members = [weights_of(tiny_model(seed=s)) for s in (1, 5, 9)]
  logits = np.stack([numpy_logits(w, X) for w in members])
  out = distillation.ensemble_predictions(model, stack(*members), images(X), batch_size=4)
  np.testing.assert_allclose(out["mean_logits"], logits.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    out["mean_probabilities"], softmax(logits).mean(0), rtol=1e-5, atol=1e-6
  )
  member_entropy = -np.sum(softmax(logits) * np.log(softmax(logits)), -1)
  np.testing.assert_allclose(out["mean_entropy"], member_entropy.mean(0), rtol=1e-5, atol=1e-6)
  # Weighted: member 1 is skipped, member 2 counts twice.
  out = distillation.ensemble_predictions(
    model, stack(*members), images(X), member_weights=[1.0, 0.0, 2.0], batch_size=4
  )
  np.testing.assert_allclose(
    out["mean_logits"], (logits[0] + 2 * logits[2]) / 3, rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(
    out["mean_probabilities"],
    (softmax(logits[0]) + 2 * softmax(logits[2])) / 3,
    rtol=1e-5,
    atol=1e-6,
  )
  np.testing.assert_allclose(
    out["mean_entropy"], (member_entropy[0] + 2 * member_entropy[2]) / 3, rtol=1e-5, atol=1e-6
  )
  y = np.array([0, 1, 2, 0, 1, 2], np.int32)
  np.testing.assert_allclose(
    distillation.member_accuracies(model, stack(*members), images(X), y, batch_size=4),
    np.mean(logits.argmax(-1) == y, axis=1),
    rtol=1e-6,
  )


def test_chance_accuracy_and_the_majority_drop_worst_rule():
  y = np.array([3, 3, 3, 1, 2, 0, 4, 5, 6, 7], np.int32)
  # Majority class 3: 30% > 1/10.
  np.testing.assert_allclose(drop_worst.chance_accuracy(y, 10), 0.3)
  np.testing.assert_allclose(drop_worst.chance_accuracy(np.arange(5), 62), 0.2)
  np.testing.assert_allclose(drop_worst.chance_accuracy(np.arange(62), 62), 1 / 62, rtol=1e-6)
  keep, informative = drop_worst.drop_worst_mask(
    "majority", tf.constant([0.9, 0.05, 0.3, 0.31]), y, 10
  )
  np.testing.assert_array_equal(keep, [True, False, False, True])
  assert bool(informative)
  # None above chance: all kept, and nothing to learn from.
  keep, informative = drop_worst.drop_worst_mask("majority", tf.constant([0.1, 0.3]), y, 10)
  np.testing.assert_array_equal(keep, [True, True])
  assert not bool(informative)
  with pytest.raises(ValueError, match="unknown drop-worst rule 'best'"):
    drop_worst.drop_worst_mask("best", tf.constant([0.1]), y, 10)


def authors_drop_worst(accuracies, num_classes):
  """FedDF's code in NumPy: drop below 1.2 / C, else the low outliers."""
  accuracies = list(accuracies)
  below = [a < 1.2 / num_classes for a in accuracies]
  if any(below):
    return [not b for b in below]
  others = list(accuracies)
  others.remove(max(others))
  lower = np.mean(others) - 1.5 * np.std(others)
  return [a >= lower for a in accuracies]


Y10 = np.arange(10, dtype=np.int32)  # Balanced: chance is 1/10.


def test_authors_drop_worst_rule_drops_below_guessing_by_hand():
  # 1.2 / 10 = 0.12: 0.11 and 0.05 are dropped, 0.13 is kept though the
  # majority rule's 0.1 would keep 0.11 too. No outlier test then.
  accuracies = [0.5, 0.11, 0.13, 0.05, 0.6]
  keep, informative = drop_worst.drop_worst_mask(
    "guess_or_outliers", tf.constant(accuracies), Y10, 10
  )
  np.testing.assert_array_equal(keep, [True, False, True, False, True])
  assert bool(informative)
  np.testing.assert_array_equal(keep, authors_drop_worst(accuracies, 10))
  keep, _ = drop_worst.drop_worst_mask("majority", tf.constant(accuracies), Y10, 10)
  np.testing.assert_array_equal(keep, [True, True, True, False, True])
  # All below guessing: all kept, nothing to learn from.
  keep, informative = drop_worst.drop_worst_mask(
    "guess_or_outliers", tf.constant([0.1, 0.02]), Y10, 10
  )
  np.testing.assert_array_equal(keep, [True, True])
  assert not bool(informative)


def test_authors_drop_worst_rule_drops_low_outliers_by_hand():
  # None below 0.12. Without the best (0.9), the others' mean is 0.425 and
  # their population std sqrt(0.0683 / 4) = 0.1307: the cut is 0.229.
  accuracies = [0.9, 0.5, 0.52, 0.48, 0.2]
  others = np.array([0.5, 0.52, 0.48, 0.2])
  np.testing.assert_allclose(others.mean() - 1.5 * others.std(), 0.425 - 1.5 * np.sqrt(0.0683 / 4))
  keep, informative = drop_worst.drop_worst_mask(
    "guess_or_outliers", tf.constant(accuracies), Y10, 10
  )
  np.testing.assert_array_equal(keep, [True, True, True, True, False])
  assert bool(informative)
  np.testing.assert_array_equal(keep, authors_drop_worst(accuracies, 10))
  # The majority rule keeps all of them.
  keep, _ = drop_worst.drop_worst_mask("majority", tf.constant(accuracies), Y10, 10)
  assert np.all(keep)
  # Equal accuracies (std 0) and two models: none is an outlier.
  for equal in ([0.3] * 5, [0.7, 0.2]):
    keep, _ = drop_worst.drop_worst_mask("guess_or_outliers", tf.constant(equal), Y10, 10)
    assert np.all(keep)


def test_drop_worst_considers_members_only():
  # Slot 3 is no member (an empty slot): its 0 is neither below guessing
  # nor in the outliers' statistics, and it is never kept. Over the members
  # (0.6 set aside), mean 0.525 and std 0.025 cut at 0.4875: all kept.
  accuracies = tf.constant([0.6, 0.5, 0.55, 0.0])
  members = tf.constant([True, True, True, False])
  keep, _ = drop_worst.drop_worst_mask("guess_or_outliers", accuracies, Y10, 10, members=members)
  np.testing.assert_array_equal(keep, [True, True, True, False])
  # With slot 3 a member, it is below guessing and the only one dropped.
  keep, _ = drop_worst.drop_worst_mask("guess_or_outliers", accuracies, Y10, 10)
  np.testing.assert_array_equal(keep, [True, True, True, False])
  # A single member is kept (the authors' code fails on one model).
  keep, _ = drop_worst.drop_worst_mask(
    "guess_or_outliers", accuracies, Y10, 10, members=tf.constant([False, True, False, False])
  )
  np.testing.assert_array_equal(keep, [False, True, False, False])


# Schedules and SWA ------------------------------------------------------------


def test_cyclical_and_cosine_learning_rates():
  config = Config(
    num_steps=8, learning_rate=1.0, min_learning_rate=0.2, cycle_steps=4, lr_schedule="cyclical"
  )
  # t = (step mod 4 + 1) / 4; lr = (1 - t) * 1.0 + t * 0.2.
  np.testing.assert_allclose(
    [student_lib.learning_rate_at(s, config) for s in range(6)],
    [0.8, 0.6, 0.4, 0.2, 0.8, 0.6],
    rtol=1e-6,
  )
  np.testing.assert_array_equal(
    [
      bool(
        student_lib.is_swa_collection_step(
          s, Config(num_steps=12, cycle_steps=4, swa_warmup_steps=4)
        )
      )
      for s in range(12)
    ],
    [s in (7, 11) for s in range(12)],
  )
  cosine = Config(num_steps=10, learning_rate=1.0, lr_schedule="cosine", swa=False)
  np.testing.assert_allclose(
    [student_lib.learning_rate_at(s, cosine) for s in (0, 5, 10)], [1.0, 0.5, 0.0], atol=1e-6
  )


def test_swa_average_is_the_mean_of_the_collected_models():
  models = [
    (tf.constant([1.0, 2.0]), tf.constant(3.0)),
    (tf.constant([2.0, 0.0]), tf.constant(-1.0)),
    (tf.constant([6.0, 1.0]), tf.constant(4.0)),
  ]
  average = models[0]
  for n, model in enumerate(models[1:], start=1):
    average = student_lib.swa_average(average, model, n)
  np.testing.assert_allclose(average[0], [3.0, 1.0], rtol=1e-6)
  np.testing.assert_allclose(average[1], 2.0, rtol=1e-6)


def _fedbe(steps: int, **own) -> distillation.DistillationConfig:
  return fedbe.distillation_config(
    server_distillation.Settings(distill_steps=steps), fedbe.Settings(**own)
  )


def test_fedbe_swa_warm_up_is_a_fraction_of_the_budget():
  # The paper's 250 steps of the authors' 1,580 (20 epochs of 79 batches).
  assert _fedbe(1_580).swa_warmup_steps == 250
  assert _fedbe(200).swa_warmup_steps == 32  # 31.6
  # The authors' code's 500 steps.
  assert _fedbe(1_580, swa_warmup_fraction=500 / 1_580).swa_warmup_steps == 500
  assert _fedbe(100, swa_warmup_fraction=0.0).swa_warmup_steps == 0
  # 200 steps, 32 warm-up: the cycles ending at 50, ..., 200 are collected.
  config = _fedbe(200)
  assert [s + 1 for s in range(200) if student_lib.is_swa_collection_step(s, config)] == list(
    range(50, 201, 25)
  )
  with pytest.raises(ValueError, match="swa_warmup_fraction"):
    fedbe.Settings(swa_warmup_fraction=1.0)
  # The check names the flag of the budget.
  with pytest.raises(ValueError, match="distill_steps must be >= 50 for SWA"):
    _fedbe(40, swa_warmup_fraction=0.7)


def test_feddf_config_takes_the_authors_settings_where_the_paper_is_silent():
  config = feddf.distillation_config(server_distillation.Settings())
  assert (config.optimizer, config.lr_schedule, config.loss) == ("adam", "cosine", "kl")
  assert config.clip_norm == 5.0 and not config.keep_initial_student  # Code.
  # The run's budget: the paper's 10,000 steps with patience 1,000 are flags away.
  assert (config.num_steps, config.patience, config.eval_every) == (200, 100, 20)


def test_config_validation():
  with pytest.raises(ValueError, match="num_steps must be >= 8 for SWA, .*, got 7"):
    Config(num_steps=7, cycle_steps=4, swa_warmup_steps=4)
  Config(num_steps=8, cycle_steps=4, swa_warmup_steps=4)  # Collects the model of step 8.
  with pytest.raises(ValueError, match="exclude each other"):
    Config(num_steps=8, cycle_steps=4, eval_every=2, patience=2)
  with pytest.raises(ValueError, match="unknown optimizer=rmsprop: choose one of sgd, adam"):
    Config(num_steps=8, optimizer="rmsprop", swa=False)
  with pytest.raises(ValueError, match="needs patience"):
    Config(num_steps=8, swa=False, eval_every=2)
  with pytest.raises(ValueError, match="clip_norm must be >= 0"):
    Config(num_steps=8, swa=False, clip_norm=-1.0)


# distill --------------------------------------------------------------------


def test_one_full_batch_sgd_step_by_hand():
  model = tiny_model(seed=0)
  initial = weights_of(model)
  config = Config(
    num_steps=1, batch_size=6, learning_rate=0.5, lr_schedule="constant", momentum=0.0, swa=False
  )
  weights, stats = student_lib.distill(model, initial, images(X), TARGETS, config, seed=0)
  kernel, bias = (np.asarray(t, np.float64) for t in initial.trainable)
  d = (softmax(numpy_logits(initial, X)) - TARGETS) / len(X)
  np.testing.assert_allclose(weights.trainable[0], kernel - 0.5 * X.T @ d, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(weights.trainable[1], bias - 0.5 * d.sum(0), rtol=1e-5, atol=1e-6)
  assert int(stats["steps"]) == 1 and int(stats["examples"]) == 6
  assert int(stats["swa_models"]) == 0


def test_gradient_clipping_scales_a_large_step_to_the_clip_norm():
  model = tiny_model(seed=0)
  initial = weights_of(model)
  x = 100 * X  # A large gradient: X^T d grows with x.
  config = Config(
    num_steps=1,
    batch_size=6,
    learning_rate=0.5,
    lr_schedule="constant",
    momentum=0.0,
    swa=False,
    clip_norm=5.0,
  )
  weights, _ = student_lib.distill(model, initial, images(x), TARGETS, config, seed=0)
  kernel, bias = (np.asarray(t, np.float64) for t in initial.trainable)
  d = (softmax(numpy_logits(initial, x)) - TARGETS) / len(x)
  gradient = [x.T @ d, d.sum(0)]
  norm = np.sqrt(sum(np.sum(g**2) for g in gradient))
  assert norm > 50.0  # Clipping changes this step.
  scale = 5.0 / norm
  np.testing.assert_allclose(
    weights.trainable[0], kernel - 0.5 * scale * gradient[0], rtol=1e-4, atol=1e-6
  )
  np.testing.assert_allclose(
    weights.trainable[1], bias - 0.5 * scale * gradient[1], rtol=1e-4, atol=1e-6
  )
  # SGD moves the weights by lr * 5, where without clipping lr * norm.
  moved = np.sqrt(
    sum(
      np.sum((np.asarray(w) - np.asarray(v)) ** 2)
      for w, v in zip(weights.trainable, initial.trainable)
    )
  )
  np.testing.assert_allclose(moved, 0.5 * 5.0, rtol=1e-4)
  unclipped, _ = student_lib.distill(
    model, initial, images(x), TARGETS, dataclasses.replace(config, clip_norm=0.0), seed=0
  )
  np.testing.assert_allclose(
    unclipped.trainable[0], kernel - 0.5 * gradient[0], rtol=1e-4, atol=1e-5
  )


def swa_config(**overrides):
  values = dict(
    num_steps=12,
    batch_size=2,
    learning_rate=0.5,
    min_learning_rate=0.1,
    cycle_steps=4,
    swa_warmup_steps=4,
    momentum=0.5,
    swa=True,
  )
  values.update(overrides)
  return Config(**values)


def test_swa_returns_the_mean_of_cycle_end_models_with_recomputed_bn():
  model = tiny_model(seed=0, batch_norm=True)
  initial = weights_of(model)
  x = images(X)
  swa, stats = student_lib.distill(model, initial, x, TARGETS, swa_config(), seed=3)
  # The same SGD trajectory without SWA, stopped at the cycle ends past the
  # warm-up (steps 8 and 12; step 4 is the warm-up's end).
  collected = [
    student_lib.distill(model, initial, x, TARGETS, swa_config(num_steps=n, swa=False), seed=3)[0]
    for n in (8, 12)
  ]
  for got, *ends in zip(swa.trainable, *(c.trainable for c in collected)):
    np.testing.assert_allclose(got, np.mean(ends, axis=0), rtol=1e-5, atol=1e-6)
  assert int(stats["swa_models"]) == 2 and int(stats["steps"]) == 12
  assert int(stats["examples"]) == 24
  # Batch norm follows Flatten, so its statistics are those of the images:
  # the mean over batches of 2 of the batch mean and (biased) variance.
  batches = X.reshape(3, 2, 4)
  moving_mean, moving_variance = swa.non_trainable[:2]
  np.testing.assert_allclose(moving_mean, batches.mean(1).mean(0), rtol=1e-5)
  np.testing.assert_allclose(moving_variance, batches.var(1).mean(0), rtol=1e-5)


def test_recompute_batch_norm_of_a_fused_layer_uses_keras_statistics():
  # A BN layer on images is fused; Keras then keeps the unbiased variance.
  model = tf.keras.Sequential(
    [
      tf.keras.layers.Input((2, 2, 1)),
      tf.keras.layers.BatchNormalization(),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(3),
    ]
  )
  x = np.random.RandomState(0).randn(10, 2, 2, 1).astype(np.float32)
  student_lib.recompute_batch_norm(model, x, 4)
  batches = [x[:4].ravel(), x[4:8].ravel(), x[8:].ravel()]
  layer = model.layers[0]
  np.testing.assert_allclose(layer.moving_mean, [np.mean([b.mean() for b in batches])], rtol=1e-5)
  np.testing.assert_allclose(
    layer.moving_variance, [np.mean([b.var(ddof=1) for b in batches])], rtol=1e-5
  )
  assert layer.momentum == 0.99  # Restored.


def test_early_stopping_with_the_initial_student_returns_it_if_unbeaten():
  model = tiny_model(seed=0)
  initial = weights_of(model)
  # Validation labels are the initial student's predictions: accuracy 1 at
  # the start, which no later student can strictly improve.
  y_val = numpy_logits(initial, X).argmax(-1).astype(np.int32)
  config = Config(
    num_steps=100,
    batch_size=2,
    optimizer="adam",
    learning_rate=0.1,
    lr_schedule="cosine",
    loss="kl",
    swa=False,
    eval_every=2,
    patience=4,
    keep_initial_student=True,
  )
  weights, stats = student_lib.distill(
    model, initial, images(X), TARGETS, config, seed=1, validation=(images(X), y_val)
  )
  assert int(stats["steps"]) == 4
  np.testing.assert_allclose(stats["validation_accuracy"], 1.0)
  for got, want in zip(weights.trainable, initial.trainable):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="needs validation data"):
    student_lib.distill(model, initial, images(X), TARGETS, config, seed=1)


def test_early_stopping_takes_only_improvements_above_the_margin():
  model = tiny_model(seed=0)
  initial = weights_of(model)
  # Validation labels are the targets' classes on the training images.
  y_val = np.asarray(TARGETS).argmax(-1).astype(np.int32)
  start = np.mean(numpy_logits(initial, X).argmax(-1) == y_val)
  assert start < 1.0
  results = {}
  for margin in (0.0, 1.0):
    config = Config(
      num_steps=40,
      batch_size=2,
      optimizer="adam",
      learning_rate=0.1,
      lr_schedule="cosine",
      loss="kl",
      swa=False,
      eval_every=2,
      patience=20,
      min_improvement=margin,
      keep_initial_student=True,
    )
    results[margin] = student_lib.distill(
      model, initial, images(X), TARGETS, config, seed=1, validation=(images(X), y_val)
    )
  # Any improvement counts without a margin; none can beat a margin of 1.
  assert float(results[0.0][1]["validation_accuracy"]) > start
  weights, stats = results[1.0]
  assert int(stats["steps"]) == 20
  np.testing.assert_allclose(stats["validation_accuracy"], start)
  for got, want in zip(weights.trainable, initial.trainable):
    np.testing.assert_array_equal(got, want)


# Plain SGD at a constant step size: the first k steps are the same whatever
# the budget, so a run of k steps is the trajectory's student after k steps.
SGD = dict(batch_size=2, learning_rate=0.5, lr_schedule="constant", momentum=0.0, swa=False)


def trajectory(model, initial, num_steps):
  """The students after 1, ..., num_steps steps of SGD (seed 2)."""
  return [
    student_lib.distill(model, initial, images(X), TARGETS, Config(num_steps=k, **SGD), seed=2)[0]
    for k in range(1, num_steps + 1)
  ]


def validation_curve(students, y_val):
  return [np.mean(numpy_logits(w, X).argmax(-1) == y_val) for w in students]


def test_early_stopping_returns_the_student_at_the_validation_peak():
  model = tiny_model(seed=0)
  initial = weights_of(model)
  students = trajectory(model, initial, 12)
  # Validation labels: the student's predictions after 5 steps, so that its
  # accuracy peaks (at 1) there, mid-run; the initial student is below.
  y_val = numpy_logits(students[4], X).argmax(-1).astype(np.int32)
  curve = validation_curve(students, y_val)
  peak = int(np.argmax(curve))  # The first at the maximum.
  assert curve[peak] == 1.0 and peak < 11 and curve[-1] < 1.0
  assert np.mean(numpy_logits(initial, X).argmax(-1) == y_val) < 1.0
  for keep_initial_student in (False, True):
    config = Config(
      num_steps=12, eval_every=1, patience=12, keep_initial_student=keep_initial_student, **SGD
    )
    weights, stats = student_lib.distill(
      model, initial, images(X), TARGETS, config, seed=2, validation=(images(X), y_val)
    )
    assert int(stats["steps"]) == 12
    np.testing.assert_allclose(stats["validation_accuracy"], 1.0)
    for got, want in zip(weights.trainable, students[peak].trainable):
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_early_stopping_without_the_initial_one_returns_the_best_evaluated():
  model = tiny_model(seed=0)
  initial = weights_of(model)
  students = trajectory(model, initial, 12)
  # Validation labels: the initial student's predictions (accuracy 1), which
  # the trained students do not reach.
  y_val = numpy_logits(initial, X).argmax(-1).astype(np.int32)
  curve = validation_curve(students, y_val)
  best = int(np.argmax(curve))
  assert curve[best] < 1.0
  config = Config(num_steps=12, eval_every=1, patience=12, **SGD)
  assert not config.keep_initial_student  # FedDF's code's default.
  weights, stats = student_lib.distill(
    model, initial, images(X), TARGETS, config, seed=2, validation=(images(X), y_val)
  )
  np.testing.assert_allclose(stats["validation_accuracy"], curve[best])
  for got, want in zip(weights.trainable, students[best].trainable):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  # With the initial student as a candidate, it is unbeaten.
  weights, stats = student_lib.distill(
    model,
    initial,
    images(X),
    TARGETS,
    dataclasses.replace(config, keep_initial_student=True),
    seed=2,
    validation=(images(X), y_val),
  )
  np.testing.assert_allclose(stats["validation_accuracy"], 1.0)
  for got, want in zip(weights.trainable, initial.trainable):
    np.testing.assert_array_equal(got, want)
  # A budget shorter than eval_every evaluates no student: the initial one.
  weights, stats = student_lib.distill(
    model,
    initial,
    images(X),
    TARGETS,
    Config(num_steps=3, eval_every=5, patience=5, **SGD),
    seed=2,
    validation=(images(X), y_val),
  )
  np.testing.assert_allclose(stats["validation_accuracy"], -1.0)
  for got, want in zip(weights.trainable, initial.trainable):
    np.testing.assert_array_equal(got, want)


def test_the_validation_curve_is_the_students_accuracy_as_it_trains():
  model = tiny_model(seed=0)
  initial = weights_of(model)
  students = trajectory(model, initial, 12)
  y_val = numpy_logits(students[4], X).argmax(-1).astype(np.int32)
  start = np.mean(numpy_logits(initial, X).argmax(-1) == y_val)
  curve = validation_curve(students, y_val)
  validation = (images(X), y_val)
  # Early stopping: every evaluation, from the start (measured without keep_initial too).
  config = Config(num_steps=12, eval_every=2, patience=12, **SGD)
  _, stats = student_lib.distill(
    model, initial, images(X), TARGETS, config, seed=2, validation=validation
  )
  want = [(0, start)] + [(k, curve[k - 1]) for k in range(2, 13, 2)]
  np.testing.assert_allclose(stats["validation_curve"], want, atol=1e-6)
  # Without early stopping, every curve_every steps; the student trains as without it.
  plain = Config(num_steps=7, **SGD)
  traced, stats = student_lib.distill(
    model,
    initial,
    images(X),
    TARGETS,
    dataclasses.replace(plain, curve_every=3),
    seed=2,
    validation=validation,
  )
  np.testing.assert_allclose(
    stats["validation_curve"], [(0, start), (3, curve[2]), (6, curve[5])], atol=1e-6
  )
  for got, want in zip(traced.trainable, students[6].trainable):
    np.testing.assert_array_equal(got, want)
  # No validation data, or nothing asked: no curve.
  _, stats = student_lib.distill(model, initial, images(X), TARGETS, plain, seed=2)
  assert stats["validation_curve"].shape == (0, 2)


def test_shuffles_are_seeded():
  model = tiny_model(seed=0)
  initial = weights_of(model)
  config = Config(num_steps=5, batch_size=2, learning_rate=0.5, lr_schedule="constant", swa=False)
  a, b, c = (
    student_lib.distill(model, initial, images(X), TARGETS, config, seed=s)[0].trainable[0]
    for s in (4, 4, 5)
  )
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)


ES_CONFIG = Config(
  num_steps=40,
  batch_size=2,
  optimizer="adam",
  learning_rate=0.05,
  lr_schedule="cosine",
  loss="kl",
  swa=False,
  eval_every=3,
  patience=9,
)
Y_VAL = np.array([0, 2, 1, 1, 0, 2], np.int32)


@pytest.mark.parametrize("mode", ["swa", "early_stopping"])
def test_distill_streamed_from_files_matches_arrays(mode, tmp_path):
  # 12 steps of 2 over 6 images: later epochs reshuffle; SWA collects twice.
  config = swa_config() if mode == "swa" else ES_CONFIG
  model_fn = lambda: tiny_model(batch_norm=mode == "swa")
  np.save(tmp_path / "x.npy", X.reshape(6, 2, 2, 1))
  x_file = server_data.ImageFile.npy(str(tmp_path / "x.npy"))
  targets_file = server_data.ImageFile.temporary(TARGETS.shape)
  targets_file[0:6] = TARGETS
  initial = weights_of(model_fn())
  validation = (images(X), Y_VAL) if config.eval_every else None
  got, got_stats = student_lib.distill(
    model_fn(), initial, x_file, targets_file, config, seed=3, validation=validation
  )
  want, want_stats = student_lib.distill(
    model_fn(), initial, images(X), TARGETS, config, seed=3, validation=validation
  )
  for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
    np.testing.assert_array_equal(g, w)
  for key, value in want_stats.items():
    np.testing.assert_array_equal(got_stats[key], value)
  if mode == "swa":
    assert got_stats["swa_models"] == 2
  else:
    assert 9 <= got_stats["steps"] < 40  # Stopped early.


def test_training_batches_visit_each_example_once_an_epoch_in_a_new_order():
  x = np.arange(7, dtype=np.float32).reshape(7, 1)
  batches = [
    b.numpy()[:, 0].astype(int)
    for b, _ in server_data.training_batches(x, x, batch_size=3, num_steps=6, seed=5)
  ]
  assert [len(b) for b in batches] == [3] * 6
  epochs = [np.concatenate(batches[k : k + 2]) for k in (0, 2, 4)]  # 2 full batches an epoch.
  for epoch in epochs:
    assert len(set(epoch)) == 6  # No repeat; the 7th example waits for a later epoch.
  assert len({tuple(e) for e in epochs}) == 3
  again = [b.numpy() for b, _ in server_data.training_batches(x, x, 3, 6, seed=5)]
  np.testing.assert_array_equal(np.concatenate(again)[:, 0], np.concatenate(batches))


def test_the_draws_made_ahead_are_the_minibatches_the_student_read_before():
  # Read by `training_batches` when it drew them as the student went (seed 5, and [3, 9]).
  x = np.arange(7, dtype=np.float32).reshape(7, 1)
  before = [[5, 0, 2], [3, 4, 1], [3, 4, 5], [0, 2, 1], [4, 3, 0], [1, 6, 2]]
  np.testing.assert_array_equal(server_data.drawn_rows(7, 3, 6, seed=5), before)
  read = [b.numpy()[:, 0] for b, _ in server_data.training_batches(x, x, 3, 6, seed=5)]
  np.testing.assert_array_equal(read, before)
  drawn = server_data.drawn_rows(50, 8, 8, tf.constant([3, 9], tf.int64))
  np.testing.assert_array_equal(drawn[0], [30, 49, 41, 16, 27, 8, 46, 39])
  np.testing.assert_array_equal(drawn[7], [1, 6, 49, 7, 45, 44, 19, 15])


def test_teachers_and_drop_worst_in_a_tff_computation():
  members = stack(*(weights_of(tiny_model(seed=s)) for s in (1, 5, 9)))
  model_fn = lambda: tiny_model(seed=0)
  stacked_type = tff.types.tensorflow_to_type(
    tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), members)
  )

  @tff.tensorflow.computation(
    stacked_type, tff.TensorType(np.float32, [6, 2, 2, 1]), tff.TensorType(np.int32, [6])
  )
  def teachers(stacked, x, y):
    predictions = distillation.ensemble_predictions(model_fn(), stacked, x)
    accuracies = distillation.member_accuracies(model_fn(), stacked, x, y)
    keep, _ = drop_worst.drop_worst_mask("guess_or_outliers", accuracies, y, 3)
    kept = distillation.ensemble_predictions(
      model_fn(), stacked, x, member_weights=tf.cast(keep, tf.float32)
    )
    return predictions, accuracies, keep, kept

  predictions, accuracies, keep, kept = teachers(members, X.reshape(6, 2, 2, 1), Y_VAL)
  logits = np.stack([numpy_logits(_member(members, m), X) for m in range(3)])
  np.testing.assert_allclose(predictions["mean_logits"], logits.mean(0), rtol=1e-5, atol=1e-6)
  want = np.mean(logits.argmax(-1) == Y_VAL, axis=1)
  np.testing.assert_allclose(accuracies, want, rtol=1e-6)
  np.testing.assert_array_equal(keep, authors_drop_worst(want, 3))
  assert 0 < np.sum(keep) < 3  # The example drops some, not all.
  np.testing.assert_allclose(kept["mean_logits"], logits[keep].mean(0), rtol=1e-5, atol=1e-6)


def _member(stacked, m):
  return tf.nest.map_structure(lambda t: t[m], stacked)


# Device -----------------------------------------------------------------------


@pytest.mark.skipif(bool(tf.config.list_logical_devices("GPU")), reason="checks the CPU-only path")
def test_choose_device_without_gpu():
  for requested in (None, "", "auto", "cpu", "/CPU:0", "/device:cpu:0"):
    assert distillation.choose_device(requested) == "/CPU:0"
  with pytest.raises(ValueError, match=r"--server_device='gpu'.*sees 0 GPU"):
    distillation.choose_device("gpu")
  with pytest.raises(ValueError, match="--server_device='tpu'"):
    distillation.choose_device("tpu")


def test_the_students_fused_adam_is_tffs_adam():
  # The student applies Adam with TF's fused kernel; FedDF's student used TFF's functional
  # `build_adam` before, and the numbers must not change.
  config = Config(
    num_steps=4,
    batch_size=4,
    optimizer="adam",
    learning_rate=0.05,
    lr_schedule="constant",
    loss="kl",
    swa=False,
  )
  model = tiny_model(seed=0)
  initial = weights_of(model)
  got, _ = student_lib.distill(model, initial, images(X), TARGETS, config, seed=2)
  reference = tiny_model(seed=0)
  variables = reference.trainable_variables
  adam = tff.learning.optimizers.build_adam(0.05)
  state = adam.initialize(tuple(tf.TensorSpec(v.shape, v.dtype) for v in variables))

  @tf.function
  def step(x, targets, state):
    with tf.GradientTape() as tape:
      loss = distillation.distillation_loss("kl", targets, reference(x, training=True))
    state, new = adam.next(state, tuple(variables), tuple(tape.gradient(loss, variables)))
    for v, t in zip(variables, new):
      v.assign(t)
    return state

  for x, targets in server_data.training_batches(images(X), TARGETS, 4, 4, seed=2):
    state = step(x, targets, state)
  for g, w in zip(got.trainable, variables):
    np.testing.assert_array_equal(g, w)
