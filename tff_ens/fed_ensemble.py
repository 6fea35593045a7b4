"""Fed-ensemble: K models trained at the communication cost of one.

Shi, Liang, Wang, Li, Jin: "Fed-ensemble: Ensemble Models in Federated
Learning for Improved Generalization and Uncertainty Quantification", IEEE
T-ASE 2023 (arXiv:2107.10663), Algorithm 1.

The server keeps K models. Every K rounds each client i draws a random
permutation P[i, :] of 0..K-1; in round t it trains model P[i, t mod K]. The
algorithm is FedAvg's four stages with two swapped:

* distributor: the client computes its key P[i, t mod K] and downloads only
  that model with `tff.federated_select` (one model in the type signature);
* client work: unchanged, the same `client_work.build_client_work`;
* aggregator: each client uploads one update and its key; a
  `tff.federated_aggregate` adds it into slot `key` of K accumulators, so
  model k is averaged over the clients that trained it, each client counted
  once as in the paper's Remark 1 and the authors' code
  (`member_average="clients"`), or weighted by its examples ("examples");
* finalizer: model k moves by its slot's mean update; a model no client
  trained this round stays as it was.

With DP (`privacy.DPConfig`, fixed clip C), each client clips its update to
norm C before upload, the slots sum the clipped updates unweighted, and the
server adds N(0, (z C)^2) noise to every slot and divides by the expected
clients per slot, m / K (`privatize_slots`).

With FedDyn's local objective (Acar et al., ICLR 2021; `feddyn_alpha` > 0)
each client keeps a state g per model (`feddyn.train_feddyn`), passed in
and returned by `next` at CLIENTS and stored by the caller
(`client_states.ClientStateStore`), and each model k has FedDyn's server
state h_k (`apply_feddyn_correction`); the slots then average unweighted.

The K models live in the server state (a tuple of K `ModelWeights`), and the
assignment is a stateless function of (seed, client index, round), so a
checkpoint of the state is complete (with FedDyn, together with the clients'
stored states).
"""

import collections
import dataclasses
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import client_work as client_work_lib
from tff_ens import feddyn
from tff_ens import privacy

ModelWeights = tff.learning.models.ModelWeights

ASSIGNMENTS = ("permutation", "random")
# How model k averages the clients that trained it: each client once (Shi et
# al., Remark 1, and both of the authors' repositories) or by its examples
# (FedAvg's weighting).
MEMBER_AVERAGES = ("clients", "examples")


def _client_seed(seed, client_index, stream: int, counter):
  """A stateless-RNG seed unique to (run seed, client, stream, counter)."""
  key = tf.stack([tf.cast(seed, tf.int64), tf.cast(client_index, tf.int64)])
  key = tf.random.experimental.stateless_fold_in(key, stream)
  return tf.random.experimental.stateless_fold_in(key, tf.cast(counter, tf.int64))


def permutation_row(seed, client_index, block, ensemble_size: int):
  """P[i, :] for block `block` = floor(t / K): a random permutation of 0..K-1.

  Shi et al., Algorithm 1, line 4: each client draws an independent
  permutation every K rounds.
  """
  scores = tf.random.stateless_uniform(
    [ensemble_size], seed=_client_seed(seed, client_index, 0, block)
  )
  return tf.argsort(scores)


def assigned_model(
  seed, client_index, round_num, ensemble_size: int, assignment: str = "permutation"
):
  """The model client `client_index` trains in round `round_num` (0-based).

  "permutation": P[i, t mod K] (Shi et al., Algorithm 1, line 6), so every
  client trains every model once in each block of K rounds. "random": a
  uniformly random model per client and round (the paper's Table VII
  ablation).
  """
  if assignment == "permutation":
    row = permutation_row(seed, client_index, round_num // ensemble_size, ensemble_size)
    return row[round_num % ensemble_size]
  if assignment == "random":
    return tf.random.stateless_uniform(
      [], seed=_client_seed(seed, client_index, 1, round_num), maxval=ensemble_size, dtype=tf.int32
    )
  raise ValueError(f"unknown assignment {assignment!r}: choose one of {', '.join(ASSIGNMENTS)}")


def scatter_add_update(accumulator, update, weight, key):
  """Adds `weight * update` into slot `key` of the K-slot accumulator.

  Implements the per-model sums of Shi et al., Algorithm 1, line 9:
  sum over clients i with P[i, t mod K] = k of n_i * w_i.

  Args:
    accumulator: `(slots, weights)`: a tuple of K structures like `update`
      and the K summed weights.
    update: one client's update.
    weight: its weight (1, or its number of examples; see MEMBER_AVERAGES).
    key: the slot, an int32 scalar in [0, K).

  The slots are K separate structures, not one stacked tensor, and only slot
  `key` is computed: TFF's C++ runtime passes the other slots through without
  copying, where a scatter into a stacked [K, ...] tensor writes all K models
  for every client (for K = 5 the round went from 3.57x to 2.38x FedAvg's
  time and the worker from 7.0 to 3.5 GiB; benchmarks/RESULTS.md).
  """
  slots, weights = accumulator
  weight = tf.cast(weight, tf.float32)

  def add(slot):
    return lambda: tf.nest.map_structure(lambda s, u: s + weight * u, slot, update)

  slots = tuple(
    tf.cond(tf.equal(key, k), add(slot), lambda slot=slot: slot) for k, slot in enumerate(slots)
  )
  return slots, weights + weight * tf.one_hot(key, len(slots))


def apply_slot_means(members, slots, weights):
  """Model k minus its slot's mean update; untouched if nobody trained it.

  Shi et al., Algorithm 1, line 9: theta_k <- weighted mean of the returned
  models that started from theta_k (as `theta_k - mean delta`).

  Args:
    members: a tuple of K models (structures of tensors).
    slots: a tuple of K summed updates, as `scatter_add_update` makes.
    weights: the K summed weights.
  """

  def apply(member, slot, total):
    mean = lambda w, s: tf.where(total > 0, w - s / tf.maximum(total, 1e-12), w)
    return tf.nest.map_structure(mean, member, slot)

  return tuple(apply(m, s, weights[k]) for k, (m, s) in enumerate(zip(members, slots)))


def apply_feddyn_correction(members, corrections, slots, weights, alpha: float, num_clients: int):
  """FedDyn's server update for every model (Acar et al., Algorithm 1, 9-10).

  For model k, with u_i = w_k - w_i the updates of the clients that trained
  it (summed in slot k, unweighted) and m = `num_clients` the population:

      h_k <- h_k + (alpha / m) sum_i u_i      (line 9: h - alpha/m sum (w_i - w))
      w_k <- mean_i w_i - h_k / alpha         (line 10)

  Args:
    members: the K models after `apply_slot_means` (mean_i w_i, or w_k
      unchanged when nobody trained it).
    corrections: the K h's, one tensor per trainable weight.
    slots, weights: the K unweighted update sums and client counts.
    alpha: FedDyn's alpha.
    num_clients: m.

  Returns:
    (members, corrections); a model nobody trained keeps both unchanged.
  """
  new_members, new_corrections = [], []
  for member, h, slot, total in zip(members, corrections, slots, tf.unstack(weights)):
    trained = total > 0
    h = [
      tf.where(trained, h_t + (alpha / num_clients) * u, h_t) for h_t, u in zip(h, slot.trainable)
    ]
    trainable = [tf.where(trained, w - h_t / alpha, w) for w, h_t in zip(member.trainable, h)]
    new_members.append(ModelWeights(trainable, list(member.non_trainable)))
    new_corrections.append(tuple(h))
  return tuple(new_members), tuple(new_corrections)


def privatize_slots(slots, noise_stddev, clients_per_slot: float):
  """DP-FedAvg's server step on the K slot sums of clipped updates.

  McMahan et al., ICLR 2018, Algorithm 1, applied per slot: every slot sum
  gets Gaussian noise of standard deviation `noise_stddev` (z C,
  `privacy.add_gaussian_noise`, unseeded), and every slot's weight becomes
  the fixed `clients_per_slot` (m / K), so `apply_slot_means` divides by a
  count that does not depend on who was sampled. A client adds to one slot
  only, so the K sums together have DP-FedAvg's L2 sensitivity C and the same
  privacy accounting (`privacy.epsilons`).

  Returns:
    (noised slots, weights [K]) for `apply_slot_means`.
  """
  noised = tuple(privacy.add_gaussian_noise(slot, noise_stddev) for slot in slots)
  return noised, tf.fill([len(slots)], tf.constant(clients_per_slot, tf.float32))


@dataclasses.dataclass(frozen=True)
class FedEnsembleProcess:
  """The built Fed-ensemble process and the types that cross the network.

  `download_type` is what one client receives in a round, `upload_type` what
  it sends; both come from the computations' type signatures.
  """

  process: tff.templates.IterativeProcess
  download_type: tff.Type
  upload_type: tff.Type


def build_fed_ensemble(
  member_model_fn: Callable[[int], tf.keras.Model],
  element_spec,
  local_config: client_work_lib.LocalTrainingConfig,
  *,
  ensemble_size: int,
  seed: int = 0,
  assignment: str = "permutation",
  dp: privacy.DPConfig | None = None,
  feddyn_alpha: float = 0.0,
  num_clients: int = 0,
  member_average: str = "clients",
  on_device: bool = False,
) -> FedEnsembleProcess:
  """Builds Fed-ensemble as a `tff.templates.IterativeProcess`.

  `next(state, client_data, client_indices)`: `client_data` are the cohort's
  datasets, `client_indices` (int32 at CLIENTS) each client's fixed index in
  the population, from which it derives its permutation row. With FedDyn,
  `next(state, client_data, client_indices, client_states) -> (state,
  metrics, new client states)`: each client's FedDyn state g for the model it
  trains this round (`assigned_model`), zeros before its first time.

  Args:
    member_model_fn: `k -> Keras model` with member k's initialization (all
      members share one architecture).
    element_spec: `tf.TensorSpec`s of one client batch `(x, y)`.
    local_config: client training (FedAvg's, or FedProx with `proximal_mu`).
    ensemble_size: K.
    seed: seed of the permutations.
    assignment: "permutation" or "random".
    dp: clip every update to `dp.clip_norm` and noise the slot sums
      (`privatize_slots`); fixed clipping only. None: plain slot means.
    feddyn_alpha: > 0: FedDyn's local objective and server correction with
      this alpha; 0: the local objective of `local_config`.
    num_clients: the population m (FedDyn's h divides by it).
    member_average: one of MEMBER_AVERAGES; DP and FedDyn count every
      client once whatever it is.
    on_device: the clients trained their assigned member on their devices
      (`tff_ens.device_clients`): their data are the results
      (`client_work.build_device_client_work`), so no FedDyn.
  """
  if member_average not in MEMBER_AVERAGES:
    raise ValueError(
      f"unknown member_average {member_average!r}: choose one of {', '.join(MEMBER_AVERAGES)}"
    )
  if ensemble_size < 1:
    raise ValueError(f"ensemble_size must be >= 1, got {ensemble_size}")
  if assignment not in ASSIGNMENTS:
    raise ValueError(f"unknown assignment {assignment!r}: choose one of {', '.join(ASSIGNMENTS)}")
  if dp is not None and dp.adaptive:
    raise ValueError("Fed-ensemble's DP needs a fixed clip norm > 0")
  uses_feddyn = feddyn_alpha > 0
  if uses_feddyn and on_device:
    raise ValueError("FedDyn's clients keep a state the device file has not: use SGD on devices")
  if uses_feddyn and (dp is not None or num_clients < 1):
    raise ValueError(
      "FedDyn needs num_clients >= 1 and no DP (its client state is the client's unclipped updates)"
    )
  k = ensemble_size
  architecture_fn = lambda: member_model_fn(0)
  weights_type = client_work_lib.weights_type_of(architecture_fn)
  if uses_feddyn:
    client_work = feddyn.build_feddyn_client_work(
      architecture_fn, element_spec, local_config, feddyn_alpha
    )
    work_init, work_next = client_work.initialize, client_work.next
  else:
    client_work = (
      client_work_lib.build_device_client_work(weights_type, local_config)
      if on_device
      else client_work_lib.build_client_work(architecture_fn, element_spec, local_config)
    )
    work_init = client_work.process.initialize
    work_next = client_work.process.next
  data_type = tff.FederatedType(client_work.client_update.type_signature.parameter[1], tff.CLIENTS)

  @tff.tensorflow.computation
  def initial_members():
    return tuple(ModelWeights.from_model(member_model_fn(i)) for i in range(k))

  members_type = initial_members.type_signature.result

  # Distributor: state = (seed, 0-based round).
  @tff.tensorflow.computation(collections.OrderedDict(round=np.int32, seed=np.int64), np.int32)
  def client_key(assignment_state, client_index):
    key = assigned_model(
      assignment_state["seed"], client_index, assignment_state["round"], k, assignment
    )
    return tf.reshape(key, [1])

  # Selected values are unnamed flat tuples: TFF 0.87's federated_select fails
  # on structs whose names are not in alphabetical order, as in ModelWeights.
  @tff.tensorflow.computation(members_type, np.int32)
  def select_member(members, key):
    return tf.switch_case(
      key, [lambda m=m: tuple(tf.identity(t) for t in tf.nest.flatten(m)) for m in members]
    )

  selected_type = select_member.type_signature.result

  @tff.tensorflow.computation(tff.SequenceType(selected_type))
  def to_model_weights(selected):
    flat = selected.reduce(tuple(tf.zeros(t.shape, t.dtype) for t in selected_type), lambda _, x: x)
    return tf.nest.pack_sequence_as(tff.types.type_to_tf_tensor_specs(weights_type), list(flat))

  @tff.tensorflow.computation(collections.OrderedDict(round=np.int32, seed=np.int64))
  def next_round(assignment_state):
    return collections.OrderedDict(
      round=assignment_state["round"] + 1, seed=assignment_state["seed"]
    )

  # Aggregator: per-slot sums with federated_aggregate.
  update_type = client_work.client_update.type_signature.result[0].update

  @tff.tensorflow.computation
  def zero_slots():
    specs = tff.types.type_to_tf_tensor_specs(update_type)
    return (
      tuple(tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), specs) for _ in range(k)),
      tf.zeros([k], tf.float32),
    )

  accumulator_type = zero_slots.type_signature.result

  @tff.tensorflow.computation(
    accumulator_type, (update_type, np.float32, tff.TensorType(np.int32, [1]))
  )
  def accumulate(accumulator, value):
    update, weight, key = value
    return scatter_add_update(accumulator, update, weight, key[0])

  @tff.tensorflow.computation(accumulator_type, accumulator_type)
  def merge(a, b):
    return tf.nest.map_structure(tf.add, a, b)

  @tff.tensorflow.computation(accumulator_type)
  def report(accumulator):
    return accumulator

  @tff.tensorflow.computation(np.float32)
  def count_once(weight):
    # A rejected update (weight 0) stays uncounted.
    return tf.minimum(weight, 1.0)

  if dp is not None:

    @tff.tensorflow.computation(update_type, np.float32)
    def clip(update, weight):
      # A rejected update (weight 0) is zeros and stays uncounted.
      return (privacy.clip_update(update, dp.clip_norm), tf.minimum(weight, 1.0))

  @tff.tensorflow.computation(members_type, accumulator_type)
  def finalize(members, accumulator):
    slots, weights = accumulator
    if dp is not None:
      slots, weights = privatize_slots(
        slots, dp.noise_multiplier * dp.clip_norm, dp.clients_per_round / k
      )
    return apply_slot_means(members, slots, weights)

  if uses_feddyn:

    @tff.tensorflow.computation
    def zero_corrections():
      specs = tff.types.type_to_tf_tensor_specs(weights_type.trainable)
      return tuple(tuple(tf.zeros(s.shape, s.dtype) for s in specs) for _ in range(k))

    @tff.tensorflow.computation(
      members_type, zero_corrections.type_signature.result, accumulator_type
    )
    def finalize_feddyn(members, corrections, accumulator):
      slots, weights = accumulator
      return apply_feddyn_correction(
        apply_slot_means(members, slots, weights),
        corrections,
        slots,
        weights,
        feddyn_alpha,
        num_clients,
      )

  @tff.tensorflow.computation(accumulator_type)
  def members_trained(accumulator):
    return tf.reduce_sum(tf.cast(accumulator[1] > 0, tf.int32))

  @tff.federated_computation
  def init_fn():
    state = collections.OrderedDict(
      members=tff.federated_eval(initial_members, tff.SERVER),
      assignment=tff.federated_value(
        collections.OrderedDict(round=np.int32(0), seed=np.int64(seed)), tff.SERVER
      ),
      client_work=work_init(),
    )
    if uses_feddyn:
      state["feddyn"] = tff.federated_eval(zero_corrections, tff.SERVER)
    return tff.federated_zip(state)

  state_type = init_fn.type_signature.result
  indices_type = tff.FederatedType(np.int32, tff.CLIENTS)

  def round_fn(state, client_data, client_indices, client_states=None):
    # Distributor: each client derives its key, downloads one model.
    keys = tff.federated_map(
      client_key, (tff.federated_broadcast(state.assignment), client_indices)
    )
    selected = tff.federated_select(
      keys, tff.federated_value(np.int32(k - 1), tff.SERVER), state.members, select_member
    )
    start_weights = tff.federated_map(to_model_weights, selected)
    # Client work: FedAvg's (or FedDyn's, on the client's own state).
    if uses_feddyn:
      work_state, result, new_client_states, work_metrics = work_next(
        state.client_work, start_weights, client_data, client_states
      )
    else:
      work = work_next(state.client_work, start_weights, client_data)
      work_state, result, work_metrics = (work.state, work.result, work.measurements)
    # Aggregator: one update and its key per client, summed into K slots
    # (with DP: clipped on the client, weighted 1; FedDyn: weighted 1).
    update, weight = result.update, result.update_weight
    if dp is not None:
      update, weight = tff.federated_map(clip, (update, weight))
    elif member_average == "clients":
      weight = tff.federated_map(count_once, weight)
    slots = tff.federated_aggregate(
      tff.federated_zip((update, weight, keys)), zero_slots(), accumulate, merge, report
    )
    # Finalizer: per-model mean update (with DP: noised, fixed count; with
    # FedDyn: corrected by h_k).
    if uses_feddyn:
      members, corrections = tff.federated_map(
        finalize_feddyn, (state.members, state.feddyn, slots)
      )
    else:
      members = tff.federated_map(finalize, (state.members, slots))
    new_state = collections.OrderedDict(
      members=members,
      assignment=tff.federated_map(next_round, state.assignment),
      client_work=work_state,
    )
    if uses_feddyn:
      new_state["feddyn"] = corrections
    new_state = tff.federated_zip(new_state)
    metrics = tff.federated_zip(
      collections.OrderedDict(
        client_work=work_metrics,
        aggregator=tff.federated_zip(
          collections.OrderedDict(members_trained=tff.federated_map(members_trained, slots))
        ),
      )
    )
    if uses_feddyn:
      return new_state, metrics, new_client_states
    return new_state, metrics

  if uses_feddyn:

    @tff.federated_computation(
      state_type,
      data_type,
      indices_type,
      tff.FederatedType(client_work.client_state_type, tff.CLIENTS),
    )
    def next_fn(state, client_data, client_indices, client_states):
      return round_fn(state, client_data, client_indices, client_states)
  else:

    @tff.federated_computation(state_type, data_type, indices_type)
    def next_fn(state, client_data, client_indices):
      return round_fn(state, client_data, client_indices)

  client_update_type = client_work.client_update.type_signature
  download = tff.StructType(
    [
      ("model", selected_type),
      ("assignment", state_type.member.assignment),
      ("learning_rate", client_update_type.parameter.learning_rate),
    ]
  )
  # FedDyn's third result, the client's new g, stays on the client.
  uploaded = client_update_type.result
  if uses_feddyn:
    uploaded = tff.StructType(list(client_update_type.result)[:2])
  upload = tff.StructType([("client_result", uploaded), ("key", client_key.type_signature.result)])
  return FedEnsembleProcess(tff.templates.IterativeProcess(init_fn, next_fn), download, upload)
