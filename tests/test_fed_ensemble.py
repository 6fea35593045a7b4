"""Tests of `tff_ens.algorithms.fed_ensemble` (Shi et al., arXiv:2107.10663, Algorithm 1).

The assignment P[i, t mod K], the one-model-down / one-update-up types, the
per-slot server update on a hand-made example, an end-to-end round checked
against per-client training computed separately, and checkpoint/resume.
"""

import asyncio
import itertools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import algorithms
from tff_ens.algorithms import algorithm
from tff_ens.algorithms import fed_ensemble
from tff_ens.math import member_updates
from tff_ens.program import client_states
from tff_ens.templates import client_work
from tff_ens.templates import composition
from tff_ens.templates import feddyn
from tff_ens.templates import keyed_stages
from tff_ens.templates import transport
from tiny import SPEC
from tiny import one_batch
from tiny import tiny_model

ModelWeights = tff.learning.models.ModelWeights
Config = client_work.LocalTrainingConfig

LR = 0.5


def member_model(k, batch_norm=True):
  """Member k of a tiny ensemble, initialized by k."""
  return tiny_model(seed=10 * k, batch_norm=batch_norm)


def member_shapes():
  model = member_model(0)
  return [tuple(v.shape) for v in model.trainable_variables + model.non_trainable_variables]


CLIENT_DATA = [
  ([[1.0, 0.0, -1.0, 2.0], [0.5, -0.5, 1.0, 0.0]], [0, 2]),
  ([[-1.0, 2.0, 0.0, 1.0], [2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 1.0, 3.0]], [1, 1, 0]),
  ([[0.0, 1.0, 1.0, -2.0], [1.0, 1.0, 1.0, 1.0]], [2, 0]),
]


def assign(seed, client, round_num, k, assignment="permutation"):
  return int(member_updates.assigned_model(seed, client, round_num, k, assignment))


def block_row(seed, client, block, k):
  return [assign(seed, client, t, k) for t in range(block * k, block * k + k)]


# ---------------------------------------------------------------- assignment


@pytest.mark.parametrize("k", [2, 3, 5])
def test_each_block_of_k_rounds_is_a_permutation(k):
  rows = {}
  for seed, client, block in itertools.product([0, 1, 1234], range(8), range(3)):
    row = block_row(seed, client, block, k)
    assert sorted(row) == list(range(k)), (seed, client, block, row)
    rows[seed, client, block] = tuple(row)
  # Different clients draw different permutations (not one shared row).
  for seed, block in itertools.product([0, 1, 1234], range(3)):
    assert len({rows[seed, c, block] for c in range(8)}) > 1
  if k > 2:
    # Blocks are re-drawn: a client's row changes between blocks somewhere.
    assert any(
      len({rows[seed, c, b] for b in range(3)}) > 1 for seed in [0, 1, 1234] for c in range(8)
    )
    # And the seed matters.
    assert any(rows[0, c, b] != rows[1, c, b] for c in range(8) for b in range(3))


def test_rows_are_redrawn_between_blocks_and_clients_k5():
  # Over 8 clients x 4 blocks, a K=5 row (1 of 120) repeats only by chance:
  # most of the 32 rows must be distinct.
  rows = {tuple(block_row(7, c, b, 5)) for c in range(8) for b in range(4)}
  assert len(rows) >= 20


def test_assignment_is_deterministic_and_tensor_inputs_agree():
  for client, round_num in [(0, 0), (3, 4), (17, 11), (123456, 29)]:
    a = assign(5, client, round_num, 3)
    assert assign(5, client, round_num, 3) == a
    # As TFF calls it: tensors (seed int64, index and round int32).
    b = int(
      member_updates.assigned_model(
        tf.constant(5, tf.int64), tf.constant(client, tf.int32), tf.constant(round_num, tf.int32), 3
      )
    )
    assert b == a
  row = member_updates.permutation_row(5, 3, 1, 3).numpy().tolist()
  assert [assign(5, 3, t, 3) for t in range(3, 6)] == row


def test_random_assignment_is_in_range_and_not_a_permutation():
  k = 3
  values = np.array(
    [[assign(0, client, t, k, "random") for t in range(2 * k)] for client in range(10)]
  )
  assert values.min() >= 0 and values.max() < k
  assert set(values.ravel()) == set(range(k))
  blocks = values.reshape(10, 2, k)
  not_permutations = [b for b in blocks.reshape(-1, k) if sorted(b) != list(range(k))]
  assert not_permutations  # 20 blocks, each a permutation with prob. 2/9.
  assert values.tolist() == [
    [assign(0, client, t, k, "random") for t in range(2 * k)] for client in range(10)
  ]


def test_unknown_assignment_and_bad_size_raise():
  with pytest.raises(ValueError, match="cyclic"):
    member_updates.assigned_model(0, 0, 0, 3, "cyclic")
  with pytest.raises(ValueError, match="ensemble_size"):
    fed_ensemble.build_fed_ensemble(member_model, SPEC, Config(), ensemble_size=0)
  with pytest.raises(ValueError, match="unknown assignment=cyclic"):
    fed_ensemble.Settings(assignment="cyclic")
  with pytest.raises(ValueError, match="unknown member_average=median"):
    fed_ensemble.Settings(member_average="median")


# ------------------------------------------------------------- server update


def test_server_update_hand_example():
  k = 3
  members = tuple(
    ModelWeights([tf.constant(w)], [tf.constant(b)])
    for w, b in (([1.0, 1.0], 10.0), ([2.0, -3.0], 20.0), ([0.5, 0.25], 30.0))
  )
  accumulator = (tuple(tf.nest.map_structure(tf.zeros_like, m) for m in members), tf.zeros([k]))
  clients = [  # (update, weight, key)
    (ModelWeights([tf.constant([1.0, 2.0])], [tf.constant(0.5)]), 1.0, 0),
    (ModelWeights([tf.constant([3.0, -2.0])], [tf.constant(1.5)]), 3.0, 0),
    (ModelWeights([tf.constant([4.0, 4.0])], [tf.constant(2.0)]), 2.0, 2),
  ]
  slots, weights = accumulator
  for update, weight, key in clients:
    slots = keyed_stages.add_to_slot(slots, update, tf.constant(key), tf.constant(weight))
    weights += weight * tf.one_hot(key, k)
  np.testing.assert_allclose(weights, [4.0, 0.0, 2.0])
  np.testing.assert_allclose(
    [s.trainable[0] for s in slots], [[10.0, -4.0], [0.0, 0.0], [8.0, 8.0]]
  )
  np.testing.assert_allclose([s.non_trainable[0] for s in slots], [5.0, 0.0, 4.0])

  new = member_updates.apply_slot_means(members, slots, weights)
  # Slot 0: (1 * u1 + 3 * u2) / 4 = [2.5, -1], non-trainable (0.5 + 4.5) / 4.
  np.testing.assert_allclose(new[0].trainable[0], [1.0 - 2.5, 1.0 + 1.0])
  np.testing.assert_allclose(new[0].non_trainable[0], 10.0 - 1.25)
  # Slot 2: the single client's update.
  np.testing.assert_allclose(new[2].trainable[0], [0.5 - 4.0, 0.25 - 4.0])
  np.testing.assert_allclose(new[2].non_trainable[0], 30.0 - 2.0)
  # Slot 1: nobody trained it; bit-identical.
  assert np.array_equal(new[1].trainable[0].numpy(), [2.0, -3.0])
  assert new[1].non_trainable[0].numpy() == 20.0


# ------------------------------------------------------------------- process


@pytest.fixture(scope="module")
def built():
  return fed_ensemble.build_fed_ensemble(
    member_model,
    SPEC,
    Config(learning_rate=LR),
    ensemble_size=3,
    # The deployment's delivery, whose type signature the communication tests read.
    options=fed_ensemble.Settings(member_average="examples", member_delivery="select"),
    seed=4,
  )


@pytest.fixture(scope="module")
def built_by_clients():
  return fed_ensemble.build_fed_ensemble(
    member_model, SPEC, Config(learning_rate=LR), ensemble_size=3, seed=4
  )


def _intrinsics(computation):
  found = []

  def visit(comp):
    if isinstance(comp, tff.framework.Intrinsic):
      found.append((comp.uri, comp.type_signature))
    return comp, False

  tff.framework.transform_postorder(computation.to_building_block(), visit)
  return found


def _leaves(type_spec):
  if isinstance(type_spec, tff.TensorType):
    return [type_spec]
  return [leaf for t in type_spec for leaf in _leaves(t)]


def test_state_holds_k_members(built):
  state_type = built.process.next.type_signature.parameter[0]
  members = state_type.member.model
  assert len(members) == 3
  for member in members:
    assert [tuple(t.shape) for t in _leaves(member)] == member_shapes()


def test_a_client_downloads_one_member_and_uploads_one_update(built):
  shapes = member_shapes()
  intrinsics = _intrinsics(built.process.next)
  # Server -> clients: one federated_select of one member per client ...
  selects = [t for uri, t in intrinsics if uri == "federated_select"]
  assert len(selects) == 1
  keys_type = selects[0].parameter[0]
  assert keys_type.member == tff.TensorType(np.int32, [1])  # One key: one model.
  selected = selects[0].result
  assert selected.placement is tff.CLIENTS
  assert isinstance(selected.member, tff.SequenceType)
  assert [tuple(t.shape) for t in _leaves(selected.member.element)] == shapes
  # ... and broadcasts of a few scalars only (round, seed; learning rate).
  broadcasts = [t for uri, t in intrinsics if uri == "federated_broadcast"]
  assert broadcasts
  for b in broadcasts:
    assert all(t.shape == () for t in _leaves(b.result.member))
  assert sum(algorithm.type_size_bytes(b.result) for b in broadcasts) == 4 + 8 + 4

  # Clients -> server: one update of one member's shape, its weight and the key.
  (aggregate,) = [t for uri, t in intrinsics if uri == "federated_aggregate"]
  update, weight, key = aggregate.parameter[0].member
  assert [tuple(t.shape) for t in _leaves(update)] == shapes
  assert weight == tff.TensorType(np.float32)
  assert key == tff.TensorType(np.int32, [1])

  # The declared per-client types say the same.
  model = built.download_type.model
  assert [tuple(t.shape) for t in _leaves(model)] == shapes
  upload = built.upload_type
  assert [tuple(t.shape) for t in _leaves(upload.client_result[0].update)] == shapes
  assert upload.key == tff.TensorType(np.int32, [1])


def _trained_update(initial, x, y):
  result, _ = client_work.train_locally(
    member_model(0),
    tff.learning.optimizers.build_sgdm(learning_rate=LR),
    initial,
    one_batch(x, y),
    tf.constant(LR),
    Config(learning_rate=LR),
  )
  return float(result.update_weight), tf.nest.map_structure(np.asarray, result.update)


def _flat(weights):
  return [np.asarray(t) for t in tf.nest.flatten(weights)]


def test_initial_members_are_the_members_initializations(built):
  members = list(built.process.initialize()["model"])
  assert len(members) == 3
  for k, m in enumerate(members):
    model = member_model(k)
    expected = [v.numpy() for v in model.trainable_variables + model.non_trainable_variables]
    for got, e in zip(_flat(m), expected, strict=True):
      np.testing.assert_array_equal(got, e)


def test_round_trains_only_the_assigned_members(built):
  seed, k = 4, 3
  indices = [0, 5]
  keys = [assign(seed, i, 0, k) for i in indices]
  assert keys[0] != keys[1], "pick indices whose round-0 models differ"
  data = CLIENT_DATA[:2]
  state = built.process.initialize()
  before = list(state["model"])
  new_state, metrics = built.process.next(
    state,
    composition.client_inputs([one_batch(x, y) for x, y in data], [np.int32(i) for i in indices]),
  )
  after = list(new_state["model"])
  assert len(after) == k and all(isinstance(m, ModelWeights) for m in after)

  for member in range(k):
    trainers = [c for c, key in enumerate(keys) if key == member]
    if not trainers:  # Nobody trained it: bit-identical.
      for got, was in zip(_flat(after[member]), _flat(before[member]), strict=True):
        assert np.array_equal(got, was)
      continue
    # Trained: the example-weighted mean of its trainers' models.
    results = [_trained_update(before[member], *data[c]) for c in trainers]
    total = sum(w for w, _ in results)
    expected = tf.nest.map_structure(
      lambda w0, *us: w0 - sum(w * u for (w, _), u in zip(results, us)) / total,
      before[member],
      *[u for _, u in results],
    )
    for got, e, was in zip(
      _flat(after[member]), _flat(expected), _flat(before[member]), strict=True
    ):
      np.testing.assert_allclose(got, e, rtol=1e-5, atol=1e-6)
    assert any(
      not np.array_equal(g, w) for g, w in zip(_flat(after[member]), _flat(before[member]))
    )

  assert metrics["aggregator"]["models_trained"] == len(set(keys))
  assert metrics["client_work"]["num_examples"] == 5.0
  assert new_state["distributor"]["round"] == 1
  assert new_state["distributor"]["seed"] == seed
  # The distributor reports the key state of the next round: what the training loop reads a
  # client's next model from (FedDyn's stored states), with no round counter of its own.
  assert metrics["distributor"] == new_state["distributor"]
  assert new_state["client_work"] == 1


@pytest.mark.parametrize("average, weights", [("examples", (2, 3)), ("clients", (1, 1))])
def test_two_clients_on_one_member_are_averaged_as_member_average_says(
  average, weights, built, built_by_clients
):
  process = (built if average == "examples" else built_by_clients).process
  seed, k = 4, 3
  # Two clients with the same round-0 model.
  pairs = [
    (i, j)
    for i in range(30)
    for j in range(i + 1, 30)
    if assign(seed, i, 0, k) == assign(seed, j, 0, k)
  ]
  i, j = pairs[0]
  member = assign(seed, i, 0, k)
  data = CLIENT_DATA[:2]  # 2 and 3 examples.
  state = process.initialize()
  before = list(state["model"])
  new_state, metrics = process.next(
    state, composition.client_inputs([one_batch(x, y) for x, y in data], [np.int32(i), np.int32(j)])
  )
  after = list(new_state["model"])
  (wa, ua), (wb, ub) = [_trained_update(before[member], *d) for d in data]
  assert (wa, wb) == (2.0, 3.0)
  ca, cb = weights
  expected = tf.nest.map_structure(
    lambda w, a, b: w - (ca * a + cb * b) / (ca + cb), before[member], ua, ub
  )
  for got, e in zip(_flat(after[member]), _flat(expected), strict=True):
    np.testing.assert_allclose(got, e, rtol=1e-5, atol=1e-6)
  for other in set(range(k)) - {member}:
    for got, was in zip(_flat(after[other]), _flat(before[other])):
      assert np.array_equal(got, was)
  assert metrics["aggregator"]["models_trained"] == 1


def _run(process, state, rounds):
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  indices = [np.int32(i) for i in (2, 7, 11)]
  for _ in range(rounds):
    state, _ = process.next(state, composition.client_inputs(datasets, indices))
  return state


def test_resume_from_checkpoint_equals_uninterrupted_run(built, tmp_path):
  process = built.process
  uninterrupted = _run(process, process.initialize(), 4)

  state = _run(process, process.initialize(), 2)
  manager = tff.program.FileProgramStateManager(str(tmp_path))
  asyncio.run(manager.save(state, 2))
  del state
  loaded = asyncio.run(manager.load(2, process.initialize()))
  assert loaded["distributor"]["round"] == 2
  resumed = _run(process, loaded, 2)

  flat_a, flat_b = tf.nest.flatten(uninterrupted), tf.nest.flatten(resumed)
  assert len(flat_a) == len(flat_b)
  for a, b in zip(flat_a, flat_b):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
  assert resumed["distributor"]["round"] == 4
  assert resumed["client_work"] == 4
  # Four rounds with 3 clients and K=3 trained every member at least once.
  initial = list(process.initialize()["model"])
  final = list(resumed["model"])
  for m0, m1 in zip(initial, final):
    assert any(not np.allclose(a, b) for a, b in zip(_flat(m0), _flat(m1)))


def test_broadcast_delivery_trains_as_select_and_reports_one_member_down(built):
  broadcast = fed_ensemble.build_fed_ensemble(
    member_model,
    SPEC,
    Config(learning_rate=LR),
    ensemble_size=3,
    options=fed_ensemble.Settings(member_average="examples", member_delivery="broadcast"),
    seed=4,
  )
  uris = [uri for uri, _ in _intrinsics(broadcast.process.next)]
  assert "federated_select" not in uris
  selected = _run(built.process, built.process.initialize(), 4)
  broadcasted = _run(broadcast.process, broadcast.process.initialize(), 4)
  for a, b in zip(tf.nest.flatten(selected), tf.nest.flatten(broadcasted)):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
  # The simulation broadcasts the K members; a client's download, as reported, is the one
  # it trains, as with the select.
  members = broadcast.process.next.type_signature.parameter[0].member.model
  one_member = algorithm.type_size_bytes(members[0])
  broadcasts = [t for uri, t in _intrinsics(broadcast.process.next) if uri == "federated_broadcast"]
  assert max(algorithm.type_size_bytes(b.result) for b in broadcasts) == 3 * one_member
  assert algorithm.type_size_bytes(broadcast.download_type.model) == one_member
  assert broadcast.download_type == built.download_type


# ------------------------------------------------------------ communication


def test_fed_ensemble_bytes_equal_fedavg_bytes():
  model_fn = member_model
  ensemble = algorithms.build_algorithm("fedensemble", model_fn, SPEC, Config(), ensemble_size=3)
  fedavg = algorithms.build_algorithm("fedavg", model_fn, SPEC, Config())
  # BatchNorm(4): 4 x 4 values; Dense: 4 x 3 + 3.
  num_params = 4 * 4 + 4 * 3 + 3
  down, up = ensemble.bytes_per_client_round()
  fedavg_down, fedavg_up = fedavg.bytes_per_client_round()
  # One member (not K), the round and seed (int32, int64), the learning rate.
  assert down == 4 * num_params + 4 + 8 + 4
  # One update, its weight, four float32 metric sums, the int32[1] key.
  assert up == 4 * num_params + 4 + 16 + 4
  assert abs(down - fedavg_down) <= 16
  assert abs(up - fedavg_up) <= 16
  assert down < 2 * 4 * num_params  # Far from K models.


# ------------------------------------------------------------------- FedDyn


def test_feddyn_server_correction_hand_example():
  # Acar et al., Algorithm 1, lines 9-10, for model 0 (two clients) and
  # model 1 (nobody); alpha = 0.5, m = 4 clients in the population.
  members = (
    ModelWeights([tf.constant([0.8, 1.6])], []),  # after the mean
    ModelWeights([tf.constant([3.0, 3.0])], []),
  )
  corrections = ((tf.constant([0.1, -0.2]),), (tf.constant([1.0, 1.0]),))
  slots = (ModelWeights([tf.constant([0.4, 0.8])], []), ModelWeights([tf.constant([0.0, 0.0])], []))
  new_members, new_corrections = member_updates.apply_feddyn_correction(
    members, corrections, slots, tf.constant([2.0, 0.0]), 0.5, 4
  )
  # h = [0.1, -0.2] + 0.5 / 4 * [0.4, 0.8]; w = mean - h / 0.5.
  np.testing.assert_allclose(new_corrections[0][0], [0.15, -0.1], rtol=1e-6)
  np.testing.assert_allclose(new_members[0].trainable[0], [0.5, 1.8], rtol=1e-6)
  # Nobody trained model 1: neither it nor its h moves.
  np.testing.assert_array_equal(new_corrections[1][0], [1.0, 1.0])
  np.testing.assert_array_equal(new_members[1].trainable[0], [3.0, 3.0])


@pytest.mark.parametrize("state_files", [False, True], ids=["values", "files"])
def test_feddyn_rounds_match_algorithm_1_computed_client_by_client(state_files, tmp_path):
  seed, k, alpha, m = 4, 2, 0.2, 5
  indices = [0, 1, 3]
  built = fed_ensemble.build_fed_ensemble(
    member_model,
    SPEC,
    Config(learning_rate=LR),
    ensemble_size=k,
    options=fed_ensemble.Settings(local_objective="feddyn", feddyn_alpha=alpha),
    seed=seed,
    num_clients=m,
    transport=transport.Transport(files=state_files),
  )
  # The clients' g as the CLI keeps them: passed as values, or in files the worker reads and
  # writes (`stateful_client_work.through_files`).
  store = client_states.ClientStateStore(
    str(tmp_path), algorithm.ClientStates.of(built.client_state_type, in_files=state_files)
  )
  optimizer = tff.learning.optimizers.build_sgdm(learning_rate=LR)
  state = built.process.initialize()
  members = [tf.nest.map_structure(np.asarray, w) for w in state["model"]]
  h = [[np.zeros_like(t) for t in w.trainable] for w in members]
  # Each client's g per model, as the CLI's store keeps them: one vector.
  shapes = [t.shape for t in members[0].trainable]
  sizes = [t.size for t in members[0].trainable]
  unpack = lambda v: [
    t.reshape(shape) for t, shape in zip(np.split(v, np.cumsum(sizes)[:-1]), shapes)
  ]
  g = {(c, j): np.zeros(sum(sizes), np.float32) for c in indices for j in range(k)}
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  for round_num in range(2):
    keys = [assign(seed, c, round_num, k) for c in indices]
    # In files the new g stay where the clients wrote them; as values they come back.
    state, metrics, *outputs = built.process.next(
      state,
      composition.client_inputs(
        datasets, [np.int32(c) for c in indices], store.round_inputs(round_num, indices, keys)
      ),
    )
    assert len(outputs) == (0 if state_files else 1)
    store.round_outputs(round_num, indices, keys, outputs[0] if outputs else None)
    new_g = [store.load(c, j) for c, j in zip(indices, keys)]
    # Expected: each client's FedDyn update from its model and its own g,
    # then the unweighted per-model mean and h's correction.
    updates = {}
    for c, j, data in zip(indices, keys, datasets):
      result, _, client_g = feddyn.train_feddyn(
        member_model(0),
        optimizer,
        members[j],
        data,
        tf.constant(LR),
        Config(learning_rate=LR),
        alpha,
        [tf.constant(t) for t in unpack(g[c, j])],
      )
      updates.setdefault(j, []).append(tf.nest.map_structure(np.asarray, result.update))
      g[c, j] = np.concatenate([np.ravel(t) for t in client_g])
    for j, us in updates.items():
      total = tf.nest.map_structure(lambda *t: sum(t), *us)
      mean = tf.nest.map_structure(lambda w, s: w - s / len(us), members[j], total)
      h[j] = [hj + alpha / m * s for hj, s in zip(h[j], total.trainable)]
      members[j] = ModelWeights(
        [w - hj / alpha for w, hj in zip(mean.trainable, h[j])], mean.non_trainable
      )
    for got, c, j in zip(new_g, indices, keys, strict=True):
      np.testing.assert_allclose(got, g[c, j], rtol=1e-5, atol=1e-6)
    for j in range(k):
      for a, b in zip(_flat(state["model"][j]), _flat(members[j]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
      for a, b in zip(state["finalizer"][j], h[j], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert metrics["aggregator"]["models_trained"] == len(updates)
  # The second round started from non-zero g and h (not a vacuous check).
  assert any(np.any(t != 0) for t in h[0] + h[1])


def test_feddyn_client_state_stays_on_the_client():
  fedavg = algorithms.build_algorithm("fedensemble", member_model, SPEC, Config(), ensemble_size=3)
  feddyn = algorithms.build_algorithm(
    "fedensemble",
    member_model,
    SPEC,
    Config(),
    ensemble_size=3,
    local_objective="feddyn",
    num_clients=10,
  )
  # g is neither downloaded nor uploaded: the bytes are Fed-ensemble's.
  assert feddyn.bytes_per_client_round() == fedavg.bytes_per_client_round()
  assert feddyn.client_states is not None and fedavg.client_states is None
  # g is one float32 vector, as long as the model's trainable weights, zeros at first.
  zeros = feddyn.client_states.initial_value()
  assert not zeros.any()
  assert zeros.dtype == np.float32 and zeros.shape == (
    sum(int(np.prod(v.shape)) for v in member_model(0).trainable_variables),
  )
  key_state = {"round": np.int32(2), "seed": np.int64(0)}  # The distributor's state.
  assert feddyn.assigned_models([0, 1, 3], key_state) == [assign(0, c, 2, 3) for c in (0, 1, 3)]
  # A client keeps one g per member: the member it trains is its state's key.
  assert feddyn.client_states.keys_of([0, 1, 3], key_state) == [
    assign(0, c, 2, 3) for c in (0, 1, 3)
  ]
  with pytest.raises(ValueError, match="fedavg reads no setting local_objective"):
    algorithms.build_algorithm(
      "fedavg", member_model, SPEC, Config(), local_objective="feddyn", num_clients=10
    )
