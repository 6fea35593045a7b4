"""TFF stages for K server models of which each client trains one, picked by a key.

Fed-ensemble's K members (each client trains member P[i, t mod K]) and FedDF's P model
prototypes (client i runs prototype i mod P) are both K models at the server and one key per
client. The stages they share (`composition.compose(..., keyed=True)` makes one process of
them):

* `build_keyed_distributor`: each client computes its key from its index in the population
  and the distributor's state, and downloads only that model (`tff.federated_select`), or,
  for speed in simulation, all K models, of which it keeps that one;
* `build_slot_aggregator`: each client's update is added into slot `key` of K sums, so model
  k is averaged over the clients that trained it; the sums start empty (`unfilled_slots`),
  not as K zero models; with DP (`privacy.DPConfig`, a fixed clip), each update is clipped
  on its client and every slot sum is noised at the server;
* `add_to_slot`, the one place a structure is added into one of K slots (also used by
  `server_step`'s collect aggregator).
"""

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.templates import privacy

ModelWeights = tff.learning.models.ModelWeights


def add_to_slot(slots: tuple, update, key, scale=None, filled=None) -> tuple:
  """`slots` with `update` (times `scale`, if given) added into slot `key`, an int32 scalar
  in [0, K); with `filled` (bool [K], `unfilled_slots`), slot `key` becomes the update if
  it holds no sum yet.

  The slots are K separate structures, not one stacked tensor, and only slot `key` is
  computed: TFF's C++ runtime passes the other slots through without copying, where a
  scatter into a stacked [K, ...] tensor writes all K models for every client (for K = 5 the
  round went from 3.57x to 2.38x FedAvg's time and the worker from 7.0 to 3.5 GiB;
  benchmarks/RESULTS.md).
  """
  if scale is not None:
    scale = tf.cast(scale, tf.float32)
    # A scale of 1 (a client counted once) adds the update as it is, without a pass over it.
    update = tf.cond(
      tf.equal(scale, 1.0),
      lambda: tf.nest.map_structure(tf.identity, update),
      lambda: tf.nest.map_structure(lambda u: scale * u, update),
    )

  def add(slot, k):
    def added():
      return tf.nest.map_structure(tf.add, slot, update)

    if filled is None:
      return added
    return lambda: tf.cond(filled[k], added, lambda: tf.nest.map_structure(tf.identity, update))

  return tuple(
    tf.cond(tf.equal(key, k), add(slot, k), lambda slot=slot: slot) for k, slot in enumerate(slots)
  )


def empty_slots(update_type: tff.Type, num_slots: int) -> tuple:
  """K zero structures of `update_type` and their K zero weights (in a TF graph)."""
  specs = tff.types.type_to_tf_tensor_specs(update_type)
  return (
    tuple(
      tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), specs) for _ in range(num_slots)
    ),
    tf.zeros([num_slots], tf.float32),
  )


def unfilled_slots(update_type: tff.Type, num_slots: int) -> tuple:
  """K slots of `update_type` that hold no sum yet, their K zero weights and K False flags
  (in a TF graph).

  Each tensor is an empty vector of unknown length, which the first update added to the
  slot, flattened (`flat`), replaces (`add_client`). TFF's C++ runtime serializes an
  aggregation's zero and creates it again for the clients: K zero models would be K
  model-sized copies more a round (132 MB for five LEAF CNNs). Whether a slot is filled is
  data (the flags), not read off its size: TensorFlow 2.14's graph optimizer folded
  `tf.size` of a slot passed through a `tf.cond` to the size of the other branch's update.
  """
  specs = tff.types.type_to_tf_tensor_specs(update_type)

  def unfilled(spec):
    return tf.raw_ops.PlaceholderWithDefault(input=tf.zeros([0], spec.dtype), shape=[None])

  return (
    tuple(tf.nest.map_structure(unfilled, specs) for _ in range(num_slots)),
    tf.zeros([num_slots], tf.float32),
    tf.zeros([num_slots], tf.bool),
  )


def flat(update):
  """`update`'s tensors as vectors, as `unfilled_slots`' slots hold them."""
  return tf.nest.map_structure(lambda u: tf.reshape(u, [-1]), update)


def add_client(accumulator: tuple, update, weight, key) -> tuple:
  """An `unfilled_slots` accumulator with one client's `update` (times `weight`) added into
  slot `key` (an int32 scalar), its weight counted and the slot marked filled."""
  slots, weights, filled = accumulator
  num_slots = len(slots)
  return (
    add_to_slot(slots, flat(update), key, weight, filled),
    weights + tf.cast(weight, tf.float32) * tf.one_hot(key, num_slots),
    tf.logical_or(filled, tf.equal(tf.range(num_slots), key)),
  )


def merge_slots(a: tuple, b: tuple) -> tuple:
  """Two `unfilled_slots` accumulators' sums: a slot filled in one of them is taken as it is."""
  slots_a, weights_a, filled_a = a
  slots_b, weights_b, filled_b = b

  def merged(k):
    def either():
      return tf.cond(filled_a[k], lambda: slots_a[k], lambda: slots_b[k])

    return tf.cond(
      tf.logical_and(filled_a[k], filled_b[k]),
      lambda: tf.nest.map_structure(tf.add, slots_a[k], slots_b[k]),
      either,
    )

  return (
    tuple(merged(k) for k in range(len(slots_a))),
    weights_a + weights_b,
    tf.logical_or(filled_a, filled_b),
  )


def filled_slots(slots: tuple, filled, update_type: tff.Type) -> tuple:
  """`unfilled_slots`' K slots in `update_type`'s shapes; zeros for a slot no client filled."""
  specs = tff.types.type_to_tf_tensor_specs(update_type)

  def shaped(slot, k):
    return tf.cond(
      filled[k],
      lambda: tf.nest.map_structure(lambda t, s: tf.reshape(t, s.shape), slot, specs),
      lambda: tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), specs),
    )

  return tuple(shaped(slot, k) for k, slot in enumerate(slots))


def build_keyed_distributor(
  models_type: tff.Type,
  initial_key_state,
  client_key: tff.Computation,
  select_model: tff.Computation,
  to_download: tff.Computation,
  next_key_state: tff.Computation | None = None,
  pick_download: tff.Computation | None = None,
) -> tff.templates.MeasuredProcess:
  """The distributor of K server models, one to each client by its key.

  `next(state, models, client_indices) -> (state, (downloads, keys) at CLIENTS, state)`: a
  client
  computes `client_key(state, index)` (int32 [1]), downloads `select_model(models, key)` with
  `tff.federated_select` and turns it into its download with `to_download(selected, key)`.
  Its measurements are its new state, the key state of the next round, so that a caller can
  know a client's key before that round (`algorithms.algorithm.FederatedAlgorithm.assigned_models`).

  Args:
    models_type: the K models' type (a tuple of K structures).
    initial_key_state: the state the keys depend on (e.g. the round and a seed), a
      structure of NumPy values.
    client_key: TFF computation `(key state, int32 index) -> int32 [1]`.
    select_model: TFF computation `(models, int32 key) -> selected`; TFF 0.87's
      `federated_select` needs an unnamed structure of tensors (it fails on structs whose
      names are not in alphabetical order, as in `ModelWeights`).
    to_download: TFF computation `(sequence of selected, int32 [1]) -> download`.
    next_key_state: TFF computation advancing the key state each round; None: it stays.
    pick_download: TFF computation `(models, int32 [1]) -> download`, the same download as
      `to_download(select_model(models, key), key)`. Given, every client receives all K
      models (`tff.federated_broadcast`) and keeps its own: K times the bytes down in a
      deployment, but in TFF 0.87's simulation runtime a broadcast creates one value that
      all clients share, where a select serializes each client's model and creates it anew
      on the client, in more time and about K models more memory per client
      (benchmarks/RESULTS.md, "Fed-ensemble round time" and "Fed-ensemble's delivery at
      scale").
  """
  num_models = len(models_type)

  @tff.federated_computation
  def initialize():
    return tff.federated_value(initial_key_state, tff.SERVER)

  state_type = initialize.type_signature.result

  @tff.federated_computation(
    state_type, tff.FederatedType(models_type, tff.SERVER), tff.FederatedType(np.int32, tff.CLIENTS)
  )
  def next_fn(state, models, client_indices):
    keys = tff.federated_map(client_key, (tff.federated_broadcast(state), client_indices))
    if pick_download is None:
      selected = tff.federated_select(
        keys, tff.federated_value(np.int32(num_models - 1), tff.SERVER), models, select_model
      )
      downloads = tff.federated_map(to_download, (selected, keys))
    else:
      downloads = tff.federated_map(pick_download, (tff.federated_broadcast(models), keys))
    new_state = state if next_key_state is None else tff.federated_map(next_key_state, state)
    return tff.templates.MeasuredProcessOutput(new_state, (downloads, keys), new_state)

  return tff.templates.MeasuredProcess(initialize, next_fn)


def privatize_slots(slots, noise_stddev, clients_per_slot: float):
  """DP-FedAvg's server step on the K slot sums of clipped updates.

  McMahan et al., ICLR 2018, Algorithm 1, applied per slot: every slot sum gets Gaussian
  noise of standard deviation `noise_stddev` (z C, `privacy.add_gaussian_noise`, unseeded),
  and every slot's weight becomes the fixed `clients_per_slot` (m / K), so the mean divides
  by a count that does not depend on who was sampled. A client adds to one slot only, so
  the K sums together have DP-FedAvg's L2 sensitivity C and the same privacy accounting
  (`privacy.epsilons`).

  Returns:
    (noised slots, weights [K]).
  """
  noised = tuple(privacy.add_gaussian_noise(slot, noise_stddev) for slot in slots)
  return noised, tf.fill([len(slots)], tf.constant(clients_per_slot, tf.float32))


def _slot_sums(update_type: tff.Type, num_slots: int, dp: privacy.DPConfig | None):
  """`build_slot_aggregator`'s `tff.federated_aggregate` computations: `(zero, accumulate,
  merge, report)` of the K slot sums, `report` giving `((slots, weights), models trained)`
  (the slots noised with `dp`)."""

  @tff.tensorflow.computation
  def zero():
    return unfilled_slots(update_type, num_slots)

  accumulator_type = zero.type_signature.result

  @tff.tensorflow.computation(
    accumulator_type, (update_type, np.float32, tff.TensorType(np.int32, [1]))
  )
  def accumulate(accumulator, value):
    update, weight, key = value
    return add_client(accumulator, update, weight, key[0])

  @tff.tensorflow.computation(accumulator_type, accumulator_type)
  def merge(a, b):
    return merge_slots(a, b)

  @tff.tensorflow.computation(accumulator_type)
  def report(accumulator):
    # The models trained are counted before DP's fixed weights replace the counts.
    slots, weights, filled = accumulator
    slots = filled_slots(slots, filled, update_type)
    trained = tf.reduce_sum(tf.cast(weights > 0, tf.int32))
    if dp is not None:
      slots, weights = privatize_slots(
        slots, dp.noise_multiplier * dp.clip_norm, dp.clients_per_round / num_slots
      )
    return (slots, weights), trained

  return zero, accumulate, merge, report


def build_slot_aggregator(
  update_type: tff.Type,
  num_slots: int,
  *,
  count_clients_once: bool = True,
  dp: privacy.DPConfig | None = None,
) -> tff.templates.AggregationProcess:
  """K weighted sums, one per key: `next(state, updates, weights, keys) -> (slots, slot
  weights)` at SERVER.

  Client i's update goes into slot `key_i` with weight 1 (`count_clients_once`: each model's
  average counts each client once, Shi et al., Remark 1) or its own weight (its examples);
  a rejected update (weight 0) stays uncounted. With `dp` (a fixed clip norm), each update is
  clipped on its client and weighted 1, and the slot sums are noised (`privatize_slots`,
  m / K clients per slot).
  """
  if dp is not None and dp.adaptive:
    raise ValueError("DP over K slots needs a fixed clip norm > 0")

  @tff.tensorflow.computation(update_type, np.float32)
  def client_contribution(update, weight):
    if dp is not None:
      update = privacy.clip_update(update, dp.clip_norm)
    if dp is not None or count_clients_once:
      weight = tf.minimum(weight, 1.0)
    return update, weight

  zero, accumulate, merge, report = _slot_sums(update_type, num_slots, dp)
  reported_type = report.type_signature.result

  @tff.tensorflow.computation(reported_type)
  def slot_sums(reported):
    return reported[0]

  @tff.tensorflow.computation(reported_type)
  def models_trained(reported):
    return reported[1]

  @tff.federated_computation
  def initialize():
    return tff.federated_value((), tff.SERVER)

  @tff.federated_computation(
    initialize.type_signature.result,
    tff.FederatedType(update_type, tff.CLIENTS),
    tff.FederatedType(np.float32, tff.CLIENTS),
    tff.FederatedType(tff.TensorType(np.int32, [1]), tff.CLIENTS),
  )
  def next_fn(state, updates, weights, keys):
    updates, weights = tff.federated_map(client_contribution, (updates, weights))
    reported = tff.federated_aggregate(
      tff.federated_zip((updates, weights, keys)), zero(), accumulate, merge, report
    )
    return tff.templates.MeasuredProcessOutput(
      state,
      tff.federated_map(slot_sums, reported),
      tff.federated_zip(
        collections.OrderedDict(models_trained=tff.federated_map(models_trained, reported))
      ),
    )

  return tff.templates.AggregationProcess(initialize, next_fn)
