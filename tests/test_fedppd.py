"""FedPPD's client update: SGLD teacher, online-distilled student, process."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

import tasks
from tests import tiny
from tests.femnist_runs import QUICK
from tests.femnist_runs import read_metrics
from tff_ens.algorithms import fedbe
from tff_ens.algorithms import fedppd
from tff_ens.algorithms import fedppd_distill
from tff_ens.execution import resident_state
from tff_ens.execution import runtime
from tff_ens.math import fedppd_local
from tff_ens.math import weight_posterior
from tff_ens.program import experiment
from tff_ens.program import training
from tff_ens.templates import server_distillation

ModelWeights = tff.learning.models.ModelWeights


def test_sgld_step_noise_has_variance_step_size_times_temperature():
  weights = [tf.zeros([200_000]), tf.ones([3, 100_000])]
  gradients = [tf.zeros([200_000]), tf.fill([3, 100_000], 4.0)]
  step_size, temperature = 0.01, 0.5
  new = fedppd_local.sgld_step(
    weights, gradients, step_size, temperature, tf.constant([1, 2], tf.int64)
  )
  # Drift -(eps/2) g: 0 for the first tensor, 1 - 0.005 * 4 for the second.
  np.testing.assert_allclose(np.mean(new[0]), 0.0, atol=1e-3)
  np.testing.assert_allclose(np.mean(new[1]), 0.98, atol=1e-3)
  for tensor in new:
    np.testing.assert_allclose(np.std(tensor), np.sqrt(step_size * temperature), rtol=0.01)
  # The two tensors draw different noise.
  assert not np.allclose(new[0][:1000], new[1][0, :1000] - 0.98)


def test_sgld_step_at_temperature_zero_is_gradient_descent_at_half_step():
  new = fedppd_local.sgld_step(
    [tf.constant([1.0, -2.0])], [tf.constant([3.0, 1.0])], 0.1, 0.0, tf.constant([0, 0], tf.int64)
  )
  np.testing.assert_allclose(new[0], [1.0 - 0.15, -2.0 - 0.05], rtol=1e-6)


def test_distillation_loss_is_cross_entropy_to_teacher_by_hand():
  teacher = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
  student_logits = np.array([[2.0, 0.5, -1.0], [0.0, 1.0, 3.0]])
  log_q = student_logits - np.log(np.exp(student_logits).sum(1, keepdims=True))
  expected = -np.mean(np.sum(teacher * log_q, 1))
  got = fedppd_local.distillation_loss(
    tf.constant(teacher, tf.float32), tf.constant(student_logits, tf.float32)
  )
  np.testing.assert_allclose(got, expected, rtol=1e-6)


def _initial(teacher_seed=0, student_seed=5):
  return fedppd.join(
    ModelWeights.from_model(tiny.tiny_model(teacher_seed)),
    ModelWeights.from_model(tiny.tiny_model(student_seed)),
  )


X = [[1, 0, 0, 1], [0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1]]
Y = [0, 1, 2, 1]


def test_client_update_is_one_sgld_step_then_one_distillation_step():
  """T = 0 and no input noise: both steps checked against a separate path,
  with both networks' weight decay."""
  config = fedppd_local.PosteriorConfig(
    **tiny.POSTERIOR_USES,
    teacher_step_size=0.01,
    temperature=0.0,
    prior_precision=0.5,
    teacher_weight_decay=0.1,
    student_lr=0.3,
    student_weight_decay=0.2,
    input_noise_std=0.0,
  )
  initial = _initial()
  result, metrics = fedppd.train_teacher_student(
    tiny.tiny_model(), tiny.tiny_model(), initial, tiny.one_batch(X, Y), tf.constant(0), config
  )
  x = np.asarray(X, np.float32)
  y = np.asarray(Y)
  # Teacher: w - eps/2 * (N * grad mean NLL + (lambda + N wd) w), N = 4.
  kernel, bias = (np.asarray(t) for t in initial.trainable[:2])
  p = tf.nn.softmax(x @ kernel + bias).numpy()
  delta = (p - np.eye(3)[y]) / len(y)
  teacher_kernel = kernel - 0.005 * (4 * x.T @ delta + 0.9 * kernel)
  teacher_bias = bias - 0.005 * (4 * delta.sum(0) + 0.9 * bias)
  update = result.update.trainable
  np.testing.assert_allclose(kernel - update[0], teacher_kernel, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(bias - update[1], teacher_bias, rtol=1e-5, atol=1e-6)
  # Student: one SGD step on the cross-entropy to the *updated* teacher,
  # plus 0.2 w.
  targets = tf.nn.softmax(tf.constant(x @ teacher_kernel + teacher_bias, tf.float32))
  student = [tf.Variable(t) for t in initial.trainable[2:]]
  with tf.GradientTape() as tape:
    loss = fedppd_local.distillation_loss(targets, x @ student[0] + student[1])
  grads = tape.gradient(loss, student)
  for k in range(2):
    np.testing.assert_allclose(
      update[2 + k], 0.3 * (grads[k] + 0.2 * student[k]), rtol=1e-4, atol=1e-6
    )
  assert float(result.update_weight) == 4.0
  np.testing.assert_allclose(metrics["student_loss"], 4 * loss, rtol=1e-5)


def test_authors_scaling_steps_on_the_mean_loss_with_weight_decay():
  """lib/sgld_optim.py without noise: w - lr/2 (grad mean NLL + wd w)."""
  config = fedppd_local.PosteriorConfig(
    **tiny.POSTERIOR_USES,
    teacher_step_size=0.2,
    temperature=0.0,
    sgld_scaling="authors",
    teacher_weight_decay=0.1,
    input_noise_std=0.0,
  )
  initial = _initial()
  result, _ = fedppd.train_teacher_student(
    tiny.tiny_model(), tiny.tiny_model(), initial, tiny.one_batch(X, Y), tf.constant(0), config
  )
  x, y = np.asarray(X, np.float64), np.asarray(Y)
  kernel, bias = (np.asarray(t, np.float64) for t in initial.trainable[:2])
  p = _softmax(x @ kernel + bias)
  delta = (p - np.eye(3)[y]) / len(y)
  np.testing.assert_allclose(
    result.update.trainable[0], 0.1 * (x.T @ delta + 0.1 * kernel), rtol=1e-4, atol=1e-7
  )
  np.testing.assert_allclose(
    result.update.trainable[1], 0.1 * (delta.sum(0) + 0.1 * bias), rtol=1e-4, atol=1e-7
  )


def test_chain_parameters_in_the_authors_units_give_their_noise():
  assert fedppd_local.chain_parameters("posterior", 4e-4, 0.5, 200.0) == (4e-4, 0.5)
  eps, temperature = fedppd_local.chain_parameters("authors", 0.05, 1.0, 200.0)
  np.testing.assert_allclose([eps, temperature], [0.05 / 200, 4 / 200])
  # Their noise: std 2 sqrt(lr) / N.
  np.testing.assert_allclose(np.sqrt(eps * temperature), 2 * np.sqrt(0.05) / 200)
  _, half = fedppd_local.chain_parameters("authors", 0.05, 0.5, 200.0)
  np.testing.assert_allclose(half, 2 / 200)


def test_scheduled_rate_decays_by_round_and_every_three_epochs():
  for round_num in range(4):
    for epoch in range(7):
      got = fedppd_local.scheduled_rate(0.05, round_num, epoch, 0.99, 0.85, 3)
      np.testing.assert_allclose(got, 0.05 * 0.99**round_num * 0.85 ** (epoch // 3), rtol=1e-6)
  np.testing.assert_allclose(fedppd_local.scheduled_rate(0.1, 5, 4, 1.0), 0.1)


def _softmax(logits):
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _teacher_step(w, x, y, eps, num_data, prior):
  """SGLD at T = 0 of the tiny model: w - eps/2 (N grad mean NLL + prior w)."""
  delta = (_softmax(x @ w[0] + w[1]) - np.eye(3)[y]) / len(y)
  return [
    w[0] - eps / 2 * (num_data * x.T @ delta + prior * w[0]),
    w[1] - eps / 2 * (num_data * delta.sum(0) + prior * w[1]),
  ]


def _student_step(s, t, x, lr):
  """SGD on the mean cross-entropy to the tiny teacher's probabilities."""
  delta = (_softmax(x @ s[0] + s[1]) - _softmax(x @ t[0] + t[1])) / len(x)
  return [s[0] - lr * x.T @ delta, s[1] - lr * delta.sum(0)]


def _replay(initial, steps, num_data, eps=0.2, prior=0.0, lr=0.3):
  """Final (teacher, student) after `steps` of ("t"|"s"|"ts", x, y, eps, lr)
  or ("t"|"s"|"ts", x, y) with the default rates."""
  weights = [np.asarray(w, np.float64) for w in initial.trainable]
  teacher, student = weights[:2], weights[2:]
  for role, x, y, *rates in steps:
    step_eps, step_lr = rates or (eps, lr)
    x = np.asarray(x, np.float64).reshape(len(y), 4)
    if "t" in role:
      teacher = _teacher_step(teacher, x, np.asarray(y), step_eps, num_data, prior)
    if "s" in role:
      student = _student_step(student, teacher, x, step_lr)
  return teacher + student


# Six examples with labels 0-5 (class = label % 3), two local epochs,
# unshuffled, in batches of two: [0 1] [2 3] [4 5] [0 1] [2 3] [4 5].
X6 = np.eye(4, dtype=np.float32)[[0, 1, 2, 3, 0, 1]] + np.arange(6, dtype=np.float32)[:, None] / 10
LABELS6 = np.arange(6)


def _six(epochs=2, batch_size=2):
  return (
    tf.data.Dataset.from_tensor_slices((X6.reshape(6, 2, 2, 1), (LABELS6 % 3).astype(np.int32)))
    .repeat(epochs)
    .batch(batch_size)
  )


def _stream(mode, dataset, epochs):
  """(role, example ids) of `minibatch_stream`, ids read off x."""
  ids = {tuple(np.round(row, 4)): i for i, row in enumerate(X6)}
  out = []
  for x, _, role in fedppd_local.minibatch_stream(
    dataset, fedppd_local.batch_sizes(dataset), mode, epochs
  ):
    rows = np.round(x.numpy().reshape(-1, 4), 4)
    out.append(("tsb"[int(role)], [ids[tuple(r)] for r in rows]))
  return out


def test_minibatch_stream_orders_the_student_minibatches():
  batches = [[0, 1], [2, 3], [4, 5]] * 2
  assert _stream("same", _six(), 2) == [("b", b) for b in batches]
  # Fresh: after each teacher batch, the next one of another pass.
  assert _stream("fresh", _six(), 2) == [
    step for t, s in zip(batches, batches[1:] + batches[:1]) for step in (("t", t), ("s", s))
  ]
  # Alternating epochs: an epoch of teacher batches, then of student ones.
  epoch = [[0, 1], [2, 3], [4, 5]]
  assert (
    _stream("alternate_epochs", _six(), 2)
    == ([("t", b) for b in epoch] + [("s", b) for b in epoch]) * 2
  )


def test_alternate_epochs_puts_a_batch_in_the_epoch_of_its_first_example():
  # Five examples, two epochs, batches of two: [0 1] [2 3] [4 0] | [1 2] [3 4]
  # (the third batch starts in epoch 0).
  dataset = (
    tf.data.Dataset.from_tensor_slices((X6[:5].reshape(5, 2, 2, 1), np.zeros(5, np.int32)))
    .repeat(2)
    .batch(2)
  )
  np.testing.assert_array_equal(
    fedppd_local.batch_epochs(fedppd_local.batch_sizes(dataset), 2), [0, 0, 0, 1, 1]
  )
  first, second = [[0, 1], [2, 3], [4, 0]], [[1, 2], [3, 4]]
  assert _stream("alternate_epochs", dataset, 2) == (
    [("t", b) for b in first]
    + [("s", b) for b in first]
    + [("t", b) for b in second]
    + [("s", b) for b in second]
  )


@pytest.mark.parametrize("mode", fedppd_local.STUDENT_MINIBATCHES)
def test_client_update_follows_the_student_minibatch_order(mode):
  """T = 0, no input noise: the update is that of the replayed order."""
  config = fedppd_local.PosteriorConfig(
    max_update_norm=0.0,
    seed=0,
    teacher_step_size=0.2,
    temperature=0.0,
    teacher_weight_decay=0.0,
    student_lr=0.3,
    student_weight_decay=0.0,
    student_minibatch=mode,
    input_noise_std=0.0,
    epochs=2,
  )
  initial = _initial()
  result, metrics = fedppd.train_teacher_student(
    tiny.tiny_model(), tiny.tiny_model(), initial, _six(), tf.constant(0), config
  )
  steps = [(role, X6[ids], LABELS6[ids] % 3) for role, ids in _stream(mode, _six(), 2)]
  steps = [("ts" if role == "b" else role, x, y) for role, x, y in steps]
  expected = _replay(initial, steps, num_data=6)
  got = [w - u for w, u in zip(initial.trainable, result.update.trainable)]
  for e, g in zip(expected, got):
    np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6)
  assert float(metrics["num_examples"]) == 12.0
  # The orders differ: so do the students.
  if mode != "same":
    same = _replay(initial, [("ts", x, y) for _, x, y in steps[::2]], num_data=6)
    assert not np.allclose(same[2], expected[2], atol=1e-5)


def test_client_update_schedules_the_step_sizes_by_round_and_epoch():
  """Round 2: eps * 0.9^2 * 0.5^epoch (step decay every epoch), student
  lr * 0.8^2."""
  config = fedppd_local.PosteriorConfig(
    max_update_norm=0.0,
    seed=0,
    teacher_step_size=0.2,
    temperature=0.0,
    teacher_weight_decay=0.0,
    teacher_round_decay=0.9,
    teacher_step_decay=0.5,
    teacher_step_decay_epochs=1,
    student_lr=0.3,
    student_round_decay=0.8,
    student_weight_decay=0.0,
    student_minibatch="same",
    input_noise_std=0.0,
    epochs=2,
  )
  initial = _initial()
  dataset = _six(batch_size=6)
  result, _ = fedppd.train_teacher_student(
    tiny.tiny_model(), tiny.tiny_model(), initial, dataset, tf.constant(2), config
  )
  y = LABELS6 % 3
  expected = _replay(
    initial,
    [("ts", X6, y, 0.2 * 0.81, 0.3 * 0.64), ("ts", X6, y, 0.2 * 0.81 * 0.5, 0.3 * 0.64)],
    num_data=6,
  )
  got = [w - u for w, u in zip(initial.trainable, result.update.trainable)]
  for e, g in zip(expected, got):
    np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6)
  # Without the schedules the result differs.
  flat = _replay(initial, [("ts", X6, y), ("ts", X6, y)], num_data=6)
  assert not np.allclose(flat[0], expected[0], atol=1e-5)


@pytest.mark.parametrize(
  "change, message",
  [
    ({"student_minibatch": "next"}, "unknown student_minibatch"),
    ({"sgld_scaling": "torch"}, "unknown sgld_scaling"),
    ({"teacher_step_decay": 0.0}, "teacher_step_decay must be > 0"),
    ({"teacher_step_decay_epochs": 0}, "teacher_step_decay_epochs must be"),
    ({"teacher_weight_decay": -1e-4}, "teacher_weight_decay must be >= 0"),
  ],
)
def test_config_rejects_bad_options(change, message):
  with pytest.raises(ValueError, match=message):
    fedppd_local.PosteriorConfig(**tiny.POSTERIOR_USES, **change)


def test_client_noise_is_reproducible_and_differs_by_round():
  config = fedppd_local.PosteriorConfig(**tiny.POSTERIOR_USES, teacher_step_size=0.01)
  run = (
    lambda round_num: fedppd.train_teacher_student(
      tiny.tiny_model(),
      tiny.tiny_model(),
      _initial(),
      tiny.one_batch(X, Y),
      tf.constant(round_num),
      config,
    )[0]
    .update.trainable[0]
    .numpy()
  )
  np.testing.assert_array_equal(run(3), run(3))
  assert not np.allclose(run(3), run(4))


def test_process_averages_students_and_uploads_teacher_plus_student():
  config = fedppd_local.PosteriorConfig(
    **tiny.POSTERIOR_USES, teacher_step_size=0.01, student_lr=0.5
  )
  with runtime.execution_context():
    built = fedppd.build_fedppd(tiny.tiny_model, lambda: tiny.tiny_model(7), tiny.SPEC, config)
    state = built.process.initialize()
    (before,) = built.models_fn(state)
    data = [tiny.one_batch(X[:2], Y[:2]), tiny.one_batch(X[2:], Y[2:])]
    output = built.process.next(state, data)
    (after,) = built.models_fn(output.state)
  assert not np.allclose(before.trainable[0], after.trainable[0])
  metrics = output.metrics["client_work"]
  assert metrics["num_examples"] == 4.0
  assert np.isfinite(metrics["student_loss"])
  upload = built.upload_type[0].update
  # Two tiny models (Dense 4 -> 3): 2 * (12 + 3) float32 tensors.
  assert sum(np.prod(t.shape) for t in tff.structure.flatten(upload)) == 30


@pytest.mark.slow
def test_fedppd_run_evaluates_and_saves_the_student(tmp_path):
  config = dataclasses.replace(
    QUICK, algorithm="fedppd", rounds=2, eval_every=1, output_dir=str(tmp_path)
  )
  summary = training.run_experiment(config)
  for key in ("test_accuracy", "test_loss", "ece", "new_client_accuracy"):
    assert np.isfinite(summary[key])
  assert float(read_metrics(tmp_path)[0]["student_loss"]) > 0
  saved = tf.keras.models.load_model(tmp_path / "model.keras")
  assert saved.name == "femnist_ppd_student"
  # A client uploads its teacher and its student, float32.
  sizes = [tasks.femnist.build_model(m).count_params() for m in ("cnn", "cnn_ppd_student")]
  assert summary["bytes_up_per_client_round"] == 4 * sum(sizes) + 4 + 4 * 5


@pytest.mark.parametrize(
  "change, message",
  [
    ({"student_model": "vgg"}, "unknown --student_model=vgg"),
    ({"sgld_temperature": -1.0}, "--sgld_temperature must be >= 0, got -1.0"),
  ],
)
def test_bad_fedppd_flags_are_one_line_errors(change, message):
  config = dataclasses.replace(QUICK, algorithm="fedppd", **change)
  with pytest.raises(experiment.UsageError, match=message):
    config.validate()


@pytest.mark.slow
def test_fedppd_distill_run_distills_the_students(tmp_path):
  unlabeled = tasks.femnist.load_data(QUICK.data_dir).new_clients
  np.savez(tmp_path / "server.npz", x=unlabeled.concatenated()[0][:64])
  config = dataclasses.replace(
    QUICK,
    algorithm="fedppd_distill",
    student_model="cnn",
    rounds=1,
    distill_steps=25,
    distill_batch_size=32,
    fedbe_samples=1,
    server_data=str(tmp_path / "server.npz"),
    output_dir=str(tmp_path / "out"),
  )
  summary = training.run_experiment(config)
  assert np.isfinite(summary["test_accuracy"])
  assert summary["server_device"] == "/CPU:0"
  assert summary["distill_examples_per_second"] > 0
  assert float(read_metrics(config.output_dir)[0]["distill_steps"]) == 25


@pytest.mark.slow
def test_fedppd_distill_distills_the_teachers_when_asked():
  """Without a teacher config the teachers are averaged as in FedPPD; with
  one they are distilled, the students' step unchanged."""
  config = fedppd_local.PosteriorConfig(
    **tiny.POSTERIOR_USES, teacher_step_size=0.01, student_lr=0.5
  )
  student_settings = server_distillation.Settings(
    distill_steps=25, distill_batch_size=8, distill_curve_every=0
  )
  server = server_distillation.ServerDistillationConfig(
    teachers="posterior",
    distill=fedbe.distillation_config(student_settings),
    posterior=weight_posterior.WeightPosterior(num_samples=2),
    seed=3,
  )
  data = [tiny.one_batch(X[:2], Y[:2]), tiny.one_batch(X[2:], Y[2:])]

  def one_round(build):
    with runtime.execution_context():
      built = build()
      state = built.process.initialize()
      new_state, metrics = resident_state.state_first(built.process.next(state, data))[:2]
      return (
        fedppd.split(
          built.process.get_model_weights(new_state),
          fedppd.count_teacher_tensors(tiny.tiny_model),
        ),
        metrics,
      )

  student = lambda: tiny.tiny_model(7)
  (averaged, _), _ = one_round(
    lambda: fedppd.build_fedppd(tiny.tiny_model, student, tiny.SPEC, config)
  )
  (kept, student_a), plain = one_round(
    lambda: fedppd_distill.build_fedppd_distill(
      tiny.tiny_model, student, tiny.SPEC, config, tiny.SERVER, server, clients_per_round=2
    )
  )
  (distilled, student_b), both = one_round(
    lambda: fedppd_distill.build_fedppd_distill(
      tiny.tiny_model,
      student,
      tiny.SPEC,
      config,
      tiny.SERVER,
      server,
      clients_per_round=2,
      teacher_server_config=server,
    )
  )
  for a, k in zip(averaged.trainable, kept.trainable):
    np.testing.assert_allclose(k, a, rtol=1e-5, atol=1e-7)
  for a, b in zip(student_a.trainable, student_b.trainable):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
  assert not np.allclose(distilled.trainable[0], kept.trainable[0])
  assert "teacher_distill_steps" not in plain["finalizer"]
  assert both["finalizer"]["teacher_distill_steps"] == 25
  assert both["finalizer"]["distill_steps"] == 25
