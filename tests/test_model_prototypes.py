"""FedDF across model prototypes (tff_ens/algorithms/model_prototypes.py)."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import numpy_references
from tests.femnist_runs import logits_of
from tff_ens import algorithms
from tff_ens.algorithms import fedbe
from tff_ens.algorithms import feddf
from tff_ens.algorithms import model_prototypes as mp
from tff_ens.math import drop_worst as drop_worst_lib
from tff_ens.server import distillation
from tff_ens.templates import client_work
from tff_ens.templates import server_distillation as sd
from tff_ens.templates import transport
from tiny import CLIENT_DATA
from tiny import MANY
from tiny import SERVER
from tiny import SPEC
from tiny import one_batch
from tiny import record_students
from tiny import tiny_model

ModelWeights = tff.learning.models.ModelWeights
LOCAL = client_work.LocalTrainingConfig(learning_rate=0.5)
# Two architectures: Flatten-Dense (15 values) and Flatten-BN-Dense (31).
MODEL_FNS = (lambda: tiny_model(seed=1), lambda: tiny_model(seed=2, batch_norm=True))
NAMES = ("dense", "bn")


def _config(drop_worst=True, keep_initial_student=False):
  return sd.ServerDistillationConfig(
    targets="avg_logits",
    distill=feddf.distillation_config(
      sd.Settings(distill_steps=20, distill_batch_size=8),
      feddf.Settings(
        distill_patience=10, distill_eval_every=5, distill_keep_initial=keep_initial_student
      ),
    ),
    keep_clients=drop_worst_lib.client_filter(drop_worst_lib.DropWorst(enabled=drop_worst)),
    seed=3,
  )


def _build(drop_worst=True, keep_initial_student=False, upload_files=False):
  return mp.build_heterogeneous_feddf(
    MODEL_FNS,
    NAMES,
    SPEC,
    LOCAL,
    SERVER,
    _config(drop_worst, keep_initial_student),
    clients_per_round=4,
    transport=transport.Transport(files=upload_files),
  )


def test_pack_and_unpack_round_trip_with_padding_and_stacking():
  weights = ModelWeights.from_model(tiny_model(seed=5, batch_norm=True))
  size = mp.packed_size(weights) + 7
  packed = mp.pack(weights, size)
  assert packed.shape == (size,)
  np.testing.assert_array_equal(packed[-7:], np.zeros(7))
  for a, b in zip(tf.nest.flatten(mp.unpack(packed, weights)), tf.nest.flatten(weights)):
    np.testing.assert_array_equal(a, b)
  stacked = mp.unpack(tf.stack([packed, 2 * packed]), weights)
  for a, b in zip(tf.nest.flatten(stacked), tf.nest.flatten(weights)):
    np.testing.assert_allclose(a, np.stack([b, 2 * b]))


def test_mean_logits_across_prototypes_weights_each_by_its_teachers():
  a, b = np.array([[1.0, 2.0]]), np.array([[4.0, -1.0]])
  mean = mp.mean_logits_across([{"mean_logits": a}, {"mean_logits": b}], [3.0, 1.0])
  np.testing.assert_allclose(mean, (3 * a + b) / 4)


def test_a_client_trains_its_own_prototype_as_fedavg_would():
  size = _build().download_type.model[0].shape[0]
  assert size == 31  # The larger prototype: 4*3+3 dense, 2*4 BN values, 4*3+3.
  model = MODEL_FNS[1]()
  start = ModelWeights.from_model(model)
  data = one_batch(*CLIENT_DATA[1])
  work = mp.build_prototype_client_work(MODEL_FNS, SPEC, LOCAL, size)
  result, _ = work.client_update((mp.pack(start, size).numpy(), np.int32(1)), data, 0.5)
  packed_update, prototype = result.update
  assert prototype == 1
  plain = client_work.build_client_work(MODEL_FNS[1], SPEC, LOCAL)
  expected, _ = plain.client_update(start, data, 0.5)
  for a, b in zip(
    tf.nest.flatten(mp.unpack(packed_update, start)), tf.nest.flatten(expected.update)
  ):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert result.update_weight == expected.update_weight == 3


def _validation_accuracy(logits) -> float:
  return numpy_references.accuracy(numpy_references.softmax(logits), SERVER.validation_y)


def _client_models(prototypes, datasets) -> list:
  """(prototype, trained weights, examples) of each client, client i training prototype
  i mod P from `prototypes` as FedAvg's client work does."""
  trained = []
  for i, data in enumerate(datasets):
    p = i % len(MODEL_FNS)
    start = ModelWeights(*tf.nest.map_structure(np.asarray, tuple(prototypes[p])))
    work = client_work.build_client_work(MODEL_FNS[p], SPEC, LOCAL)
    result, _ = work.client_update(start, data, LOCAL.learning_rate)
    trained.append((p, result.update, int(result.update_weight)))
  return trained


def test_one_round_distills_every_prototype_from_all_clients():
  built = _build(drop_worst=False)
  process = built.process
  state = process.initialize()
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  new_state, metrics, _ = process.next(state, datasets, [0, 1, 2])
  assert metrics["aggregator"]["clients_collected"] == 3
  finalizer = metrics["finalizer"]
  # Each student's accuracy is its new prototype's, predicted here in NumPy.
  for name, model_fn, weights in zip(NAMES, MODEL_FNS, new_state["model"]):
    expected = _validation_accuracy(logits_of(model_fn(), weights, SERVER.validation_x))
    assert finalizer[f"student_validation_accuracy_{name}"] == pytest.approx(expected), name
  assert finalizer["student_validation_accuracy"] == finalizer["student_validation_accuracy_dense"]
  assert finalizer["dropped_clients"] == 0
  assert finalizer["distill_steps"] >= 2
  # What the first prototype's student competes with, recomputed from the clients' models
  # trained apart from the round: their weight average, and all clients' mean logits.
  clients = _client_models(state["model"], datasets)
  first = [(weights, n) for p, weights, n in clients if p == 0]
  average = tf.nest.map_structure(
    lambda *w: np.average(w, axis=0, weights=[n for _, n in first]), *[w for w, _ in first]
  )
  expected = _validation_accuracy(logits_of(MODEL_FNS[0](), average, SERVER.validation_x))
  assert finalizer["average_validation_accuracy"] == pytest.approx(expected)
  mean_logits = np.mean(
    [logits_of(MODEL_FNS[p](), w, SERVER.validation_x) for p, w, _ in clients], axis=0
  )
  assert finalizer["teachers_validation_accuracy"] == pytest.approx(
    _validation_accuracy(mean_logits)
  )
  for before, after in zip(state["model"], new_state["model"]):
    assert any(
      not np.allclose(a, b) for a, b in zip(tf.nest.flatten(after), tf.nest.flatten(before))
    )
  again, *_ = process.next(state, datasets, [0, 1, 2])
  for a, b in zip(tf.nest.flatten(again["model"]), tf.nest.flatten(new_state["model"])):
    np.testing.assert_array_equal(a, b)


def test_packed_updates_collected_as_files_give_the_round_values_give():
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  states = []
  for files in (False, True):
    process = _build(drop_worst=False, upload_files=files).process
    state, metrics, _ = process.next(process.initialize(), datasets, [0, 1, 2])
    assert metrics["aggregator"]["clients_collected"] == 3
    states.append(state)
  for a, b in zip(tf.nest.flatten(states[1]), tf.nest.flatten(states[0]), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_prototype_no_client_ran_is_distilled_from_the_others():
  # Clients 0 and 2 both run prototype 0; prototype 1 is distilled from
  # their logits, from its previous weights, and early stopping that keeps
  # the initial student when none beats it keeps it at least as accurate on
  # validation as it was.
  built = _build(drop_worst=False, keep_initial_student=True)
  state = built.process.initialize()
  model = MODEL_FNS[1]()
  distillation.assign_variables(model, state["model"][1])
  before = distillation.accuracy(model(SERVER.validation_x), SERVER.validation_y)
  datasets = [one_batch(*CLIENT_DATA[0]), one_batch(*CLIENT_DATA[1])]
  _, metrics, _ = built.process.next(state, datasets, [0, 2])
  assert metrics["aggregator"]["clients_collected"] == 2
  assert metrics["finalizer"]["distilled"] == 1
  assert metrics["finalizer"]["student_validation_accuracy_bn"] >= before


def test_teachers_are_the_avglogits_of_every_clients_model():
  # Clients 0 and 2 run the dense prototype, client 1 the batch-norm one;
  # the teachers' probabilities are the softmax of the mean of the three
  # trained models' logits, each trained as FedAvg would train it.
  built = _build(drop_worst=False)
  state = built.process.initialize()
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  images = SERVER.validation_x
  *_, round_teachers = built.process.next(state, datasets, [0, 1, 2])
  teachers = round_teachers.predict(images)["probabilities"]
  logits = []
  for i, data in enumerate(datasets):
    model_fn, start = MODEL_FNS[i % 2], state["model"][i % 2]
    result, _ = client_work.build_client_work(model_fn, SPEC, LOCAL).client_update(start, data, 0.5)
    model = model_fn()
    distillation.assign_variables(
      model, tf.nest.map_structure(lambda w, u: w - u, start, result.update)
    )
    logits.append(model(images, training=False))
  np.testing.assert_allclose(teachers, tf.nn.softmax(np.mean(logits, 0)), rtol=1e-5, atol=1e-6)


def test_teachers_label_once_the_rows_the_students_read_as_the_whole_set(monkeypatch):
  # Each prototype's student reads at most 20 minibatches of 8 of the 500 unlabeled images,
  # drawn from its own seed; the teachers label the rows either reads, once.
  calls = record_students(monkeypatch)
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  states, teachers = {}, {}
  for labels in sd.TEACHER_LABELS:
    config = dataclasses.replace(_config(drop_worst=False), teacher_labels=labels)
    built = mp.build_heterogeneous_feddf(
      MODEL_FNS, NAMES, SPEC, LOCAL, MANY, config, clients_per_round=4
    )
    states[labels], _, teachers[labels] = built.process.next(
      built.process.initialize(), datasets, [0, 1, 2]
    )
  read, whole = calls[:2], calls[2:]  # One call per prototype.
  assert read[0]["labelled"] == read[1]["labelled"] <= 2 * 20 * 8
  assert whole[0]["labelled"] == whole[1]["labelled"] == 500
  # The same minibatches with the same targets, so the same students (to rounding).
  for student, student_all in zip(read, whole):
    assert len(student["batches"]) == len(student_all["batches"]) == 20
    for (x, targets), (x_all, targets_all) in zip(student["batches"], student_all["batches"]):
      np.testing.assert_array_equal(x, x_all)
      # Equal to float32 rounding: the teachers' inference batches hold other rows.
      np.testing.assert_allclose(targets, targets_all, rtol=1e-6, atol=1e-7)
  read_model, whole_model = (tf.nest.flatten(states[k]["model"]) for k in ("read", "all"))
  for a, b in zip(read_model, whole_model):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # The targets are the teachers' AVGLOGITS (softmax of the three clients' mean logits,
  # checked by hand above) on each minibatch.
  for x, targets in read[0]["batches"] + read[1]["batches"]:
    want = teachers["read"].predict(x)["probabilities"]
    np.testing.assert_allclose(targets, want, rtol=1e-5, atol=1e-6)


def test_algorithm_reports_one_model_download_of_the_largest_prototype():
  algorithm = algorithms.build_algorithm(
    "feddf",
    lambda k=0: MODEL_FNS[0](),
    SPEC,
    LOCAL,
    server_data=SERVER,
    clients_per_round=4,
    prototypes=",".join(NAMES),
    build_model=lambda name, seed: dict(zip(NAMES, MODEL_FNS))[name](),
  )
  # FedAvg's bytes for the larger prototype, plus the prototype's index.
  fedavg = algorithms.build_algorithm("fedavg", lambda k=0: MODEL_FNS[1](), SPEC, LOCAL)
  down, up = fedavg.bytes_per_client_round()
  assert algorithm.bytes_per_client_round() == (down + 4, up + 4)
  state = algorithm.process.initialize()
  # One model per prototype in the state, each of its prototype's shapes.
  for model_fn, weights in zip(MODEL_FNS, state["model"], strict=True):
    shapes = [w.shape for w in model_fn().trainable_weights]
    assert [np.shape(w) for w in weights.trainable] == shapes


def test_rejects_one_prototype_and_other_methods():
  with pytest.raises(ValueError, match="fedppd reads no setting prototypes"):
    algorithms.build_algorithm("fedppd", lambda k=0: MODEL_FNS[0](), SPEC, LOCAL, prototypes="a,b")
  with pytest.raises(ValueError, match="two or more"):
    mp.build_heterogeneous_feddf(
      MODEL_FNS[:1], NAMES[:1], SPEC, LOCAL, SERVER, _config(), clients_per_round=4
    )
  with pytest.raises(ValueError, match="got teachers='posterior'"):
    mp.build_heterogeneous_feddf(
      MODEL_FNS,
      NAMES,
      SPEC,
      LOCAL,
      SERVER,
      sd.ServerDistillationConfig(
        teachers="posterior", distill=fedbe.distillation_config(sd.Settings(distill_steps=25))
      ),
      clients_per_round=4,
    )
