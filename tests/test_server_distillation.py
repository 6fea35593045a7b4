"""FedBE / FedDF / v-Distillation: TFF stages (the collect aggregator of
tff_ens/templates/server_step.py) and the server step in the driver
(tff_ens/templates/server_distillation.py)."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import numpy_references
from tests.femnist_runs import logits_of
from tff_ens import algorithms
from tff_ens.algorithms import fedbe
from tff_ens.algorithms import feddf
from tff_ens.math import drop_worst
from tff_ens.math import weight_posterior
from tff_ens.server import server_data as server_data_lib
from tff_ens.templates import client_work
from tff_ens.templates import server_distillation as sd
from tff_ens.templates import server_step
from tff_ens.templates import transport
from tiny import CLIENT_DATA
from tiny import MANY
from tiny import SERVER
from tiny import SPEC
from tiny import one_batch
from tiny import record_students
from tiny import tiny_model

ModelWeights = tff.learning.models.ModelWeights


def _weights(value):
  return ModelWeights([tf.constant(value, tf.float32)], [])


def _fedbe(steps: int, batch_size: int = 128, swa: bool = True):
  """FedBE's student, `steps` of `batch_size`."""
  shared = sd.Settings(distill_steps=steps, distill_batch_size=batch_size, distill_curve_every=0)
  return fedbe.distillation_config(shared, swa=swa)


def _feddf(steps: int, batch_size: int = 128, patience: int = 1_000, eval_every: int = 100):
  """FedDF's student, at most `steps` of `batch_size`, stopping early."""
  shared = sd.Settings(distill_steps=steps, distill_batch_size=batch_size)
  own = feddf.Settings(distill_patience=patience, distill_eval_every=eval_every)
  return feddf.distillation_config(shared, own)


# Each algorithm's teachers, targets and temperature in the papers (FedBE Sec. 4 and 5,
# FedDF's AVGLOGITS).
THE_PAPERS = {
  "fedbe": dict(teachers="posterior"),
  "feddf": dict(targets="avg_logits"),
  "vdistill": dict(sharpen_temperature=0.5),
}


# ------------------------------------------------------------ collect aggregator


def test_collect_fills_slots_in_arrival_order():
  capacity = 4
  accumulator = (
    tuple(_weights([0.0, 0.0]) for _ in range(capacity)),
    tf.zeros([capacity]),
    tf.constant(0),
  )
  for update, weight in (([1.0, 2.0], 3.0), ([5.0, 6.0], 0.0), ([7.0, 8.0], 2.0)):
    accumulator = server_step.collect_update(accumulator, _weights(update), weight)
  slots, weights, count = accumulator
  assert int(count) == 3
  np.testing.assert_array_equal([s.trainable[0] for s in slots], [[1, 2], [5, 6], [7, 8], [0, 0]])
  np.testing.assert_array_equal(weights, [3, 0, 2, 0])
  accumulator = server_step.collect_update(accumulator, _weights([9.0, 9.0]), 1.0)
  with pytest.raises(tf.errors.InvalidArgumentError, match="collect slots"):
    server_step.collect_update(accumulator, _weights([9.0, 9.0]), 1.0)


def test_merge_appends_the_second_partial_after_the_first():
  def partial(rows, count):
    return (
      tuple(_weights([float(r)]) for r in rows),
      tf.constant([float(r) for r in rows]) * tf.cast(tf.range(len(rows)) < count, tf.float32),
      tf.constant(count),
    )

  slots, weights, count = server_step.merge_collected(
    partial([1, 2, 0, 0], 2), partial([3, 0, 0, 0], 1)
  )
  assert int(count) == 3
  np.testing.assert_array_equal([s.trainable[0][0] for s in slots], [1, 2, 3, 0])
  np.testing.assert_array_equal(weights, [1, 2, 3, 0])


def test_collect_aggregator_returns_every_client_update():
  update_type = tff.types.tensorflow_to_type(ModelWeights([tf.TensorSpec([2], tf.float32)], []))
  process = server_step.build_collect_aggregator(update_type, capacity=4)
  updates = [_weights(v) for v in ([1.0, 2.0], [3.0, 4.0], [5.0, 6.0])]
  output = process.next(process.initialize(), updates, [1.0, 2.0, 3.0])
  stacked, weights = output.result
  np.testing.assert_array_equal(stacked.trainable[0], [[1, 2], [3, 4], [5, 6], [0, 0]])
  np.testing.assert_array_equal(weights, [1, 2, 3, 0])
  assert output.measurements["clients_collected"] == 3


# ---------------------------------------------------------------- teachers


def _collected(updates, weights):
  return (tf.nest.map_structure(lambda *t: tf.stack(t), *updates), tf.constant(weights, tf.float32))


def _softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _validation():
  return tf.constant(SERVER.validation_x), tf.constant(SERVER.validation_y)


def test_fedbe_teachers_are_average_clients_and_gaussian_samples():
  model = tiny_model()
  global_weights = ModelWeights.from_model(model)
  global_weights = tf.nest.map_structure(tf.convert_to_tensor, global_weights)
  updates = [
    tf.nest.map_structure(lambda t, s=s: tf.fill(t.shape, s), global_weights)
    for s in (0.1, -0.3, 7.0)
  ]
  # The third client was rejected (weight 0): no teacher, not in the average.
  config = sd.ServerDistillationConfig(
    teachers="posterior",
    distill=_fedbe(25),
    posterior=weight_posterior.WeightPosterior(num_samples=4),
  )
  stack, weights, average, dropped, informative = sd.teachers(
    model,
    global_weights,
    _collected(updates, [1.0, 3.0, 0.0]),
    tf.constant([1, 2], tf.int64),
    config,
    _validation(),
  )
  assert int(dropped) == 0 and bool(informative)
  assert stack.trainable[0].shape[0] == 1 + 3 + 4  # A, C (all slots), S.
  np.testing.assert_array_equal(weights, [1, 1, 1, 0, 1, 1, 1, 1])
  # A = w - (1 * 0.1 + 3 * -0.3) / 4 = w + 0.2.
  np.testing.assert_allclose(average.trainable[0], global_weights.trainable[0] + 0.2, rtol=1e-6)
  np.testing.assert_allclose(stack.trainable[0][0], average.trainable[0])
  np.testing.assert_allclose(stack.trainable[0][2], global_weights.trainable[0] + 0.3)
  # Samples: the mean model plus noise of std sqrt(var) = sqrt(0.12) per entry.
  samples = stack.trainable[0][4:].numpy()
  deviation = samples - average.trainable[0].numpy()[None]
  assert 0.1 < np.std(deviation) < 0.6


def test_feddf_drops_clients_at_chance_and_averages_the_others():
  model = tiny_model()
  # Pixel c (c < 3) votes for class c: right on every validation image below.
  good = ModelWeights([tf.constant(10 * np.eye(4, 3), tf.float32), tf.zeros([3])], [])
  # Zero kernel, bias for class 0: one class whatever the input, chance level.
  collapsed = ModelWeights([tf.zeros([4, 3]), tf.constant([5.0, 0.0, 0.0])], [])
  images = np.eye(4, dtype=np.float32)[[0, 1, 2, 0, 1, 2]].reshape(6, 2, 2, 1)
  validation = (tf.constant(images), tf.constant([0, 1, 2, 0, 1, 2], tf.int32))
  updates = [
    tf.nest.map_structure(tf.zeros_like, good),
    tf.nest.map_structure(tf.subtract, good, collapsed),
  ]
  config = sd.ServerDistillationConfig(
    targets="avg_logits",
    distill=_feddf(20, patience=10, eval_every=5),
    keep_clients=drop_worst.client_filter(drop_worst.DropWorst()),
  )
  stack, weights, average, dropped, informative = sd.teachers(
    model, good, _collected(updates, [2.0, 5.0]), tf.constant([1, 2], tf.int64), config, validation
  )
  assert int(dropped) == 1 and bool(informative)
  np.testing.assert_array_equal(weights, [1, 0])
  # The average is over the kept client only.
  for got, want in zip(tf.nest.flatten(average), tf.nest.flatten(good)):
    np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(stack.trainable[1][1], collapsed.trainable[1])

  # Every client at chance: nothing to distill from; the server step returns
  # the average of the received clients (a FedAvg step).
  other = ModelWeights([tf.zeros([4, 3]), tf.constant([0.0, 5.0, 0.0])], [])
  updates = [tf.nest.map_structure(tf.subtract, good, m) for m in (collapsed, other)]
  *_, informative = sd.teachers(
    model, good, _collected(updates, [1.0, 3.0]), tf.constant([1, 2], tf.int64), config, validation
  )
  assert not bool(informative)
  data = server_data_lib.ServerData(SERVER.unlabeled, images, validation[1].numpy(), "test")
  new, measurements = sd.DistillationStep(tiny_model, data, config)(
    good, _collected(updates, [1.0, 3.0]), 0
  )
  np.testing.assert_allclose(new.trainable[1], [1.25, 3.75, 0.0], rtol=1e-6)  # (1, 3) / 4 x 5
  assert int(measurements["distilled"]) == 0
  assert int(measurements["distill_steps"]) == 0  # No student to discard.


def test_drop_worst_rule_decides_which_clients_feddf_keeps():
  model = tiny_model()
  images = np.eye(4, dtype=np.float32)[[0, 1, 2, 0, 1, 2]].reshape(6, 2, 2, 1)
  validation = (tf.constant(images), tf.constant([0, 1, 2, 0, 1, 2], tf.int32))
  # Pixel c votes for class c: accuracy 1. The last client maps pixel 2 to
  # class 0: accuracy 2/3, above guessing (1.2 / 3) and the majority rate
  # (1/3), but a low outlier of the others (mean 1, std 0).
  good = ModelWeights([tf.constant(10 * np.eye(4, 3), tf.float32), tf.zeros([3])], [])
  kernel = 10 * np.eye(4, 3)
  kernel[2] = [10, 0, 0]
  worse = ModelWeights([tf.constant(kernel, tf.float32), tf.zeros([3])], [])
  updates = [tf.nest.map_structure(tf.zeros_like, good)] * 4 + [
    tf.nest.map_structure(tf.subtract, good, worse)
  ]
  collected = _collected(updates, [1.0] * 5)
  kept = {}
  for rule in drop_worst.DROP_WORST_RULES:
    config = sd.ServerDistillationConfig(
      targets="avg_logits",
      distill=_feddf(20, eval_every=5),
      keep_clients=drop_worst.client_filter(drop_worst.DropWorst(rule=rule)),
    )
    _, weights, _, dropped, informative = sd.teachers(
      model, good, collected, tf.constant([1, 2], tf.int64), config, validation
    )
    assert bool(informative)
    kept[rule] = (weights.numpy(), int(dropped))
  np.testing.assert_array_equal(kept["guess_or_outliers"][0], [1, 1, 1, 1, 0])
  assert kept["guess_or_outliers"][1] == 1
  np.testing.assert_array_equal(kept["majority"][0], [1, 1, 1, 1, 1])
  assert kept["majority"][1] == 0


def test_distillation_targets_sharpen_with_the_configured_temperature():
  logits = np.array([[2.0, 1.0, 0.0], [0.0, 0.5, 1.5]], np.float32)
  p = np.array([[0.5, 0.3, 0.2], [0.25, 0.25, 0.5]], np.float32)
  predictions = {"mean_logits": tf.constant(logits), "mean_probabilities": tf.constant(p)}
  squared = p**2 / np.sum(p**2, -1, keepdims=True)

  def targets(method, **kwargs):
    distill = _feddf(20, eval_every=5) if method == "feddf" else _fedbe(25)
    return sd.distillation_targets(
      sd.ServerDistillationConfig(distill=distill, **{**THE_PAPERS[method], **kwargs}),
      predictions,
    )

  # The papers': FedBE's mean probabilities, v-Distillation's p^2 / sum p^2.
  np.testing.assert_allclose(targets("fedbe"), p, rtol=1e-6)
  np.testing.assert_allclose(targets("vdistill"), squared, rtol=1e-6)
  # The authors' code's T = 0.5 for FedBE; T = 1 for v-Distillation.
  np.testing.assert_allclose(targets("fedbe", sharpen_temperature=0.5), squared, rtol=1e-6)
  np.testing.assert_allclose(targets("vdistill", sharpen_temperature=1.0), p, rtol=1e-6)
  # FedDF: softmax of the mean logits, whatever the temperature.
  e = np.exp(logits - logits.max(-1, keepdims=True))
  np.testing.assert_allclose(
    targets("feddf", sharpen_temperature=0.5), e / e.sum(-1, keepdims=True), rtol=1e-6
  )


# --------------------------------------------------- the rows the teachers label


def _numpy_logits(stack, m, x):
  kernel, bias = (np.asarray(t[m], np.float64) for t in stack.trainable)
  return np.asarray(x, np.float64).reshape(len(x), -1) @ kernel + bias


@pytest.mark.parametrize("method", ["fedbe", "feddf"])
def test_teachers_label_the_rows_the_student_reads_as_the_whole_set(method, monkeypatch):
  # Three clients around a tiny global model; FedBE's SWA student (25 steps of 4) and
  # FedDF's (at most 20 of 4) read at most 100 and 80 of the 500 unlabeled images.
  global_weights = ModelWeights.from_model(tiny_model(seed=0))
  global_weights = tf.nest.map_structure(tf.convert_to_tensor, global_weights)
  updates = [
    tf.nest.map_structure(tf.subtract, global_weights, ModelWeights.from_model(tiny_model(seed=s)))
    for s in (4, 5, 6)
  ]
  collected = _collected(updates, [2.0, 1.0, 3.0])
  if method == "fedbe":  # Sharpened mean probabilities, of the average, clients and samples.
    fields = dict(distill=_fedbe(25, batch_size=4), sharpen_temperature=0.5)
    fields.update(posterior=weight_posterior.WeightPosterior(num_samples=2))
  else:  # AVGLOGITS of the clients.
    fields = dict(distill=_feddf(20, batch_size=4, patience=20, eval_every=5))
  calls = record_students(monkeypatch)
  results = {}
  for labels in sd.TEACHER_LABELS:
    config = sd.ServerDistillationConfig(
      teacher_labels=labels, seed=7, **THE_PAPERS[method], **fields
    )
    step = sd.DistillationStep(tiny_model, MANY, config)
    results[labels] = step(global_weights, collected, 2)
  read, whole = calls
  assert whole["labelled"] == 500
  assert read["labelled"] <= 4 * fields["distill"].num_steps
  # The same minibatches, with the same targets, and so the same student (to rounding).
  assert len(read["batches"]) == len(whole["batches"]) == fields["distill"].num_steps
  for (x, targets), (x_all, targets_all) in zip(read["batches"], whole["batches"]):
    np.testing.assert_array_equal(x, x_all)
    # Equal to float32 rounding: the teachers' inference batches hold other rows.
    np.testing.assert_allclose(targets, targets_all, rtol=1e-6, atol=1e-7)
  for a, b in zip(tf.nest.flatten(results["read"][0]), tf.nest.flatten(results["all"][0])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert int(results["read"][1]["distill_examples"]) == 4 * fields["distill"].num_steps
  # The targets by hand, from the round's teachers.
  stack, weights, *_ = step._teachers(global_weights, collected, sd.round_seed(config, 2))
  members = [m for m in range(len(weights)) if weights[m] > 0]
  for x, targets in read["batches"]:
    logits = np.stack([_numpy_logits(stack, m, x) for m in members])
    if method == "fedbe":
      p = np.mean([_softmax(z) for z in logits], 0)
      want = p**2 / np.sum(p**2, -1, keepdims=True)
    else:
      want = _softmax(logits.mean(0))
    np.testing.assert_allclose(targets, want, rtol=1e-5, atol=1e-6)


# --------------------------------------- teachers' batch-norm statistics on server images


def _dense_batch_norm_dense(seed=0):
  """Flatten(2x2x1) -> Dense(4) -> BatchNorm -> Dense(3): the statistics depend on the first
  dense layer, which differs between models of different seeds."""
  init = lambda k: tf.keras.initializers.RandomNormal(stddev=0.5, seed=seed + k)
  return tf.keras.Sequential(
    [
      tf.keras.layers.Input((2, 2, 1)),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(4, kernel_initializer=init(0), bias_initializer=init(1)),
      tf.keras.layers.BatchNormalization(),
      tf.keras.layers.Dense(3, kernel_initializer=init(2)),
    ]
  )


@pytest.mark.parametrize("method", ["feddf", "fedbe"])
def test_each_teacher_measures_its_batch_norm_statistics_on_the_server_images(method):
  global_weights = ModelWeights.from_model(_dense_batch_norm_dense(seed=0))
  global_weights = tf.nest.map_structure(tf.convert_to_tensor, global_weights)
  updates = [
    tf.nest.map_structure(
      tf.subtract, global_weights, ModelWeights.from_model(_dense_batch_norm_dense(seed=s))
    )
    for s in (4, 5, 6)
  ]
  collected = _collected(updates, [2.0, 1.0, 3.0])
  fields = dict(distill=_feddf(4, batch_size=4, patience=4, eval_every=2))
  if method == "fedbe":  # The average, the clients and two Gaussian samples.
    fields = dict(
      distill=_fedbe(25, batch_size=4), posterior=weight_posterior.WeightPosterior(num_samples=2)
    )
  config = sd.ServerDistillationConfig(seed=7, **THE_PAPERS[method], **fields)
  images = np.random.default_rng(3).normal(size=(40, 2, 2, 1)).astype(np.float32)
  step = sd.DistillationStep(_dense_batch_norm_dense, SERVER, config, recalibration_images=images)
  stack, _, average, _, _ = step._teachers(global_weights, collected, sd.round_seed(config, 2))
  plain = sd.DistillationStep(_dense_batch_norm_dense, SERVER, config)
  own_stack, *_ = plain._teachers(global_weights, collected, sd.round_seed(config, 2))
  num_teachers = 6 if method == "fedbe" else 3
  assert stack.trainable[0].shape[0] == num_teachers
  models = [tf.nest.map_structure(lambda t, m=m: t[m], stack) for m in range(num_teachers)]
  for m, model in enumerate([*models, average]):
    # Keras' training-mode statistics: the batch mean and biased variance of the dense
    # layer's outputs over the server images, for this model's own dense weights.
    kernel, bias = (np.asarray(t, np.float64) for t in model.trainable[:2])
    features = images.reshape(len(images), 4).astype(np.float64) @ kernel + bias
    moving_mean, moving_variance = (np.asarray(t) for t in model.non_trainable)
    np.testing.assert_allclose(moving_mean, features.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(moving_variance, features.var(0), rtol=1e-5, atol=1e-5)
    if m < num_teachers:  # The teachers' trainable weights are those formed without it.
      for got, own in zip(model.trainable, (t[m] for t in own_stack.trainable)):
        np.testing.assert_allclose(got, own, rtol=1e-6, atol=1e-6)
  # Without recalibration the clients keep their own (initial) statistics, 0 and 1.
  np.testing.assert_array_equal(own_stack.non_trainable[1], np.ones_like(stack.non_trainable[1]))
  # The student's model keeps its batch-norm momentum (a second model recalibrates).
  assert step._model.layers[2].momentum == 0.99


def test_the_rows_read_are_labelled_once_and_the_whole_set_when_all_are_read():
  x = np.arange(10, dtype=np.float32).reshape(10, 1)
  draws = [np.array([[7, 2], [2, 9]]), np.array([[9, 0]])]
  read = server_data_lib.read_rows(x, draws)
  np.testing.assert_array_equal(read.images[:, 0], [0, 2, 7, 9])  # Once each, in order.
  for d, b in zip(draws, read.batches):
    np.testing.assert_array_equal(read.images[b], x[d])
  whole = server_data_lib.read_rows(x, draws, whole=True)
  assert whole.images is x and whole.batches[0] is not None
  np.testing.assert_array_equal(whole.batches[1], draws[1])
  every = server_data_lib.read_rows(x, [np.arange(10).reshape(5, 2)])
  assert every.images is x  # Every row read: the set itself, no copy.


# --------------------------------------------------- Keras' graph and eager classes


def test_the_step_runs_after_its_model_class_was_built_in_a_graph():
  """TFF traces the clients' models in a `tf.compat.v1.Graph` after the step built its
  model; Keras then gives Sequential its graph bases, and the step's eager model fails
  unless the step restores them. The round must equal a step's that saw no graph."""
  global_weights = tf.nest.map_structure(
    tf.convert_to_tensor, ModelWeights.from_model(tiny_model(0))
  )
  updates = [
    tf.nest.map_structure(tf.subtract, global_weights, ModelWeights.from_model(tiny_model(seed=s)))
    for s in (4, 5)
  ]
  collected = _collected(updates, [1.0, 2.0])
  config = sd.ServerDistillationConfig(
    targets="avg_logits", distill=_feddf(4, batch_size=4), seed=7
  )
  untouched = sd.DistillationStep(tiny_model, MANY, config)(global_weights, collected, 1)
  step = sd.DistillationStep(tiny_model, MANY, config)
  with tf.Graph().as_default():
    tiny_model(1)
  new_weights, metrics = step(global_weights, collected, 1)
  for a, b in zip(tf.nest.flatten(new_weights), tf.nest.flatten(untouched[0])):
    np.testing.assert_array_equal(a, b)
  assert metrics["distill_steps"] == untouched[1]["distill_steps"] == 4


# ------------------------------------------------------------------ process


def _algorithm(method, **flags):
  """`method` on the tiny model, three clients a round, seed 3; `flags` are its settings and
  the build context's other fields."""
  local = client_work.LocalTrainingConfig(learning_rate=0.5)
  return algorithms.build_algorithm(
    method,
    lambda k=0: tiny_model(),
    SPEC,
    local,
    server_data=SERVER,
    clients_per_round=3,
    seed=3,
    distill_batch_size=8,
    distill_curve_every=0,
    **flags,
  )


@pytest.mark.parametrize("method", THE_PAPERS)
def test_one_round_distills_from_the_cohort(method):
  student = {}
  if method == "feddf":
    # Without drop-worst: these tiny clients are at chance level, and a round
    # of only such clients skips distillation (test above).
    student.update(distill_steps=30, distill_patience=10, distill_eval_every=5, drop_worst=False)
  else:
    student.update(distill_steps=25)
  if method == "fedbe":
    student.update(fedbe_samples=2)
  process = _algorithm(method, **student).process
  state = process.initialize()
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  state_after, metrics, teachers = process.next(state, datasets)
  teacher = teachers.predict(SERVER.validation_x)
  finalizer = metrics["finalizer"]
  assert metrics["aggregator"]["clients_collected"] == 3
  assert finalizer["distill_steps"] >= 1
  assert finalizer["distill_examples"] == 8 * finalizer["distill_steps"]
  assert finalizer["server_seconds"] > 0.0
  assert int(state_after["round"]) == 1
  assert teachers.device == "/CPU:0"  # Where TF placed the step (no GPU here).
  before = process.get_model_weights(state)
  after = process.get_model_weights(state_after)
  # The student's accuracy is the new model's on the validation images, predicted here.
  logits = logits_of(tiny_model(), after, SERVER.validation_x)
  expected = numpy_references.accuracy(numpy_references.softmax(logits), SERVER.validation_y)
  assert finalizer["student_validation_accuracy"] == pytest.approx(expected)
  assert any(not np.allclose(a, b) for a, b in zip(tf.nest.flatten(after), tf.nest.flatten(before)))
  # The teachers' probabilities of that round: one distribution per image,
  # and their members' mean entropy, at least 0 and at most the entropy of
  # the mean (the mutual information is >= 0 for a mixture, not AVGLOGITS).
  probabilities = teacher["probabilities"]
  assert probabilities.shape == (6, 3)
  np.testing.assert_allclose(probabilities.sum(-1), 1.0, rtol=1e-5)
  assert teacher["mean_entropy"].shape == (6,)
  assert (teacher["mean_entropy"] >= 0).all()
  if method != "feddf":
    entropy = numpy_references.entropy(probabilities)
    assert (teacher["mean_entropy"] <= entropy + 1e-5).all()
  # Same state and data, same round: the process is deterministic.
  again, *_ = process.next(state, datasets)
  for a, b in zip(tf.nest.flatten(process.get_model_weights(again)), tf.nest.flatten(after)):
    np.testing.assert_array_equal(a, b)


def test_fedbe_without_distillation_is_fedavgs_model_with_fedbes_teachers():
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  local = client_work.LocalTrainingConfig(learning_rate=0.5)
  fedavg = algorithms.build_algorithm("fedavg", lambda k=0: tiny_model(), SPEC, local).process
  fedavg_state, *_ = fedavg.next(fedavg.initialize(), datasets)
  distilled = _algorithm("fedbe", distill_steps=25, fedbe_samples=2).process
  plain = _algorithm("fedbe", distill_steps=25, fedbe_samples=2, fedbe_distill=False).process
  _, _, distilled_teachers = distilled.next(distilled.initialize(), datasets)
  state, metrics, teachers = plain.next(plain.initialize(), datasets)
  # The round's model is the clients' weight average, FedAvg's, with no student step.
  for a, b in zip(
    tf.nest.flatten(plain.get_model_weights(state)),
    tf.nest.flatten(fedavg.get_model_weights(fedavg_state)),
  ):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  assert metrics["finalizer"]["distilled"] == 0 and metrics["finalizer"]["distill_steps"] == 0
  # The teachers are the distilling run's: the same average, clients and samples.
  np.testing.assert_allclose(
    teachers.predict(SERVER.validation_x)["probabilities"],
    distilled_teachers.predict(SERVER.validation_x)["probabilities"],
    rtol=1e-6,
  )


def test_upload_is_one_model_as_fedavg():
  local = client_work.LocalTrainingConfig(learning_rate=0.5)
  built = algorithms.build_algorithm(
    "fedbe", lambda k=0: tiny_model(), SPEC, local, server_data=SERVER, clients_per_round=3
  )
  fedavg = algorithms.build_algorithm("fedavg", lambda k=0: tiny_model(), SPEC, local)
  assert built.bytes_per_client_round() == fedavg.bytes_per_client_round()


def test_config_rejects_unknown_values():
  with pytest.raises(ValueError, match="unknown teachers=samples"):
    sd.ServerDistillationConfig(teachers="samples", distill=_fedbe(25))
  with pytest.raises(ValueError, match="unknown targets=logits"):
    sd.ServerDistillationConfig(targets="logits", distill=_fedbe(25))
  with pytest.raises(ValueError, match="unknown targets=C\\+S"):
    weight_posterior.WeightPosterior(targets="C+S")
  with pytest.raises(ValueError, match="sharpen_temperature must be > 0"):
    sd.ServerDistillationConfig(distill=_fedbe(25), sharpen_temperature=0.0)
  with pytest.raises(ValueError, match="unknown rule=chance"):
    drop_worst.DropWorst(rule="chance")


@pytest.mark.parametrize(
  "method, options",
  [
    ("fedbe", dict(fedbe_samples=2)),
    ("feddf", dict(drop_worst=False)),
    ("vdistill", {}),
  ],
)
def test_updates_collected_as_files_give_the_round_values_give(method, options):
  # Two clients of three slots: the empty slot is zeros either way.
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA[:2]]
  rounds = []
  for files in (False, True):
    process = _algorithm(
      method, transport=transport.Transport(files=files), distill_steps=25, **options
    ).process
    state, metrics, teachers = process.next(process.initialize(), datasets)
    rounds.append((state, metrics, teachers.predict(SERVER.validation_x)["probabilities"]))
  (values_state, values_metrics, values_teachers), (files_state, files_metrics, files_teachers) = (
    rounds
  )
  assert files_metrics["aggregator"]["clients_collected"] == 2
  for a, b in zip(tf.nest.flatten(files_state), tf.nest.flatten(values_state), strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(files_teachers, values_teachers)
  assert files_metrics["finalizer"]["distill_steps"] == values_metrics["finalizer"]["distill_steps"]
