"""Fed-ensemble: K models trained at the communication cost of one.

Shi, Liang, Wang, Li, Jin: "Fed-ensemble: Ensemble Models in Federated
Learning for Improved Generalization and Uncertainty Quantification", IEEE
T-ASE 2023 (arXiv:2107.10663), Algorithm 1.

The server keeps K models. Every K rounds each client i draws a random
permutation P[i, :] of 0..K-1; in round t it trains model P[i, t mod K]. The
algorithm is FedAvg's four stages with three swapped for the keyed stages it
shares with FedDF's prototypes (`keyed_stages`, composed by `keyed_stages.compose`):

* distributor: the client computes its key P[i, t mod K] and downloads only
  that model with `tff.federated_select` (one model in the type signature);
  its state is (round, seed);
* client work: unchanged, the same `client_work.build_client_work` (or FedDyn's);
* aggregator (`keyed_stages.build_slot_aggregator`): each client uploads one
  update and its key, added into slot `key` of K sums, so model k is averaged
  over the clients that trained it, each client counted once as in the paper's
  Remark 1 and the authors' code (`member_average="clients"`), or weighted by
  its examples ("examples");
* finalizer: model k moves by its slot's mean update; a model no client
  trained this round stays as it was.

With DP (`privacy.DPConfig`, fixed clip C), the aggregator clips each client's
update to norm C before upload, sums the clipped updates unweighted, adds
N(0, (z C)^2) noise to every slot and divides by the expected clients per slot,
m / K (`keyed_stages.privatize_slots`).

With FedDyn's local objective (Acar et al., ICLR 2021; `feddyn_alpha` > 0)
each client keeps a state g per model (`feddyn.train_feddyn`), passed in
and returned by `next` at CLIENTS and stored by the caller
(`client_states.ClientStateStore`), and each model k has FedDyn's server
state h_k, the finalizer's state (`apply_feddyn_correction`); the slots then
average unweighted.

The state is one slot per stage: `model` (a tuple of K `ModelWeights`),
`distributor`, `client_work`, `aggregator`, `finalizer`. The assignment is a
stateless function of (seed, client index, round), so a checkpoint of the state
is complete (with FedDyn, together with the clients' stored states).
"""

import collections
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import feddyn
from tff_ens.templates import federated_algorithm
from tff_ens.templates import keyed_stages
from tff_ens.templates import privacy

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


def apply_slot_means(members, slots, weights):
  """Model k minus its slot's mean update; untouched if nobody trained it.

  Shi et al., Algorithm 1, line 9: theta_k <- weighted mean of the returned
  models that started from theta_k (as `theta_k - mean delta`).

  Args:
    members: a tuple of K models (structures of tensors).
    slots: a tuple of K summed updates (`keyed_stages.build_slot_aggregator`).
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
) -> federated_algorithm.BuiltProcess:
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
      (`tff_ens.program.device_clients`): their data are the results
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
    work_stage = client_work
  else:
    client_work = (
      client_work_lib.build_device_client_work(weights_type, local_config)
      if on_device
      else client_work_lib.build_client_work(architecture_fn, element_spec, local_config)
    )
    work_stage = client_work.process

  @tff.tensorflow.computation
  def initial_members():
    return tuple(ModelWeights.from_model(member_model_fn(i)) for i in range(k))

  members_type = initial_members.type_signature.result
  distributor = _build_distributor(members_type, weights_type, k, seed, assignment)
  update_type = client_work.client_update.type_signature.result[0].update
  aggregator = keyed_stages.build_slot_aggregator(
    update_type,
    k,
    count_clients_once=member_average == "clients" or uses_feddyn,
    dp=dp,
  )
  slots_type = aggregator.next.type_signature.result.result.member
  finalizer = _build_finalizer(
    members_type, slots_type, weights_type, feddyn_alpha if uses_feddyn else 0.0, num_clients
  )
  process = keyed_stages.compose(
    initial_members,
    distributor,
    work_stage,
    aggregator,
    finalizer,
    client_state_type=client_work.client_state_type if uses_feddyn else None,
  )
  client_update_type = client_work.client_update.type_signature
  download = tff.StructType(
    [
      ("model", distributor.next.type_signature.result.result[0].member),
      ("assignment", distributor.initialize.type_signature.result.member),
      ("learning_rate", client_update_type.parameter.learning_rate),
    ]
  )
  # FedDyn's third result, the client's new g, stays on the client.
  uploaded = client_update_type.result
  if uses_feddyn:
    uploaded = tff.StructType(list(client_update_type.result)[:2])
  key_type = distributor.next.type_signature.result.result[1].member
  upload = tff.StructType([("client_result", uploaded), ("key", key_type)])
  return federated_algorithm.BuiltProcess(
    process, download, upload, lambda state: list(state["model"])
  )


def _build_distributor(members_type, weights_type, k: int, seed: int, assignment: str):
  """Fed-ensemble's distributor: client i downloads member `assigned_model` of the round
  (`keyed_stages.build_keyed_distributor`); its state is (round, seed)."""
  key_state = collections.OrderedDict(round=np.int32(0), seed=np.int64(seed))
  key_state_type = collections.OrderedDict(round=np.int32, seed=np.int64)

  @tff.tensorflow.computation(key_state_type, np.int32)
  def client_key(state, client_index):
    return tf.reshape(
      assigned_model(state["seed"], client_index, state["round"], k, assignment), [1]
    )

  @tff.tensorflow.computation(members_type, np.int32)
  def select_member(members, key):
    return tf.switch_case(
      key, [lambda m=m: tuple(tf.identity(t) for t in tf.nest.flatten(m)) for m in members]
    )

  selected_type = select_member.type_signature.result

  @tff.tensorflow.computation(tff.SequenceType(selected_type), tff.TensorType(np.int32, [1]))
  def to_model_weights(selected, key):
    del key  # The client trains the member it was sent.
    flat = selected.reduce(tuple(tf.zeros(t.shape, t.dtype) for t in selected_type), lambda _, x: x)
    return tf.nest.pack_sequence_as(tff.types.type_to_tf_tensor_specs(weights_type), list(flat))

  @tff.tensorflow.computation(key_state_type)
  def next_round(state):
    return collections.OrderedDict(round=state["round"] + 1, seed=state["seed"])

  return keyed_stages.build_keyed_distributor(
    members_type, key_state, client_key, select_member, to_model_weights, next_round
  )


def _build_finalizer(members_type, slots_type, weights_type, feddyn_alpha: float, num_clients):
  """Fed-ensemble's finalizer: each member moves by its slot's mean update
  (`apply_slot_means`); with FedDyn (`feddyn_alpha` > 0) its state is the K models' h and
  the members are corrected by them (`apply_feddyn_correction`)."""

  @tff.tensorflow.computation(members_type, slots_type)
  def slot_means(members, slots):
    return apply_slot_means(members, *slots)

  if not feddyn_alpha:

    @tff.federated_computation
    def initialize():
      return tff.federated_value((), tff.SERVER)

    @tff.federated_computation(
      initialize.type_signature.result,
      tff.FederatedType(members_type, tff.SERVER),
      tff.FederatedType(slots_type, tff.SERVER),
    )
    def next_fn(state, members, slots):
      return tff.templates.MeasuredProcessOutput(
        state, tff.federated_map(slot_means, (members, slots)), tff.federated_value((), tff.SERVER)
      )

    return tff.templates.MeasuredProcess(initialize, next_fn)

  @tff.tensorflow.computation
  def zero_corrections():
    specs = tff.types.type_to_tf_tensor_specs(weights_type.trainable)
    return tuple(tuple(tf.zeros(s.shape, s.dtype) for s in specs) for _ in range(len(members_type)))

  @tff.tensorflow.computation(members_type, zero_corrections.type_signature.result, slots_type)
  def correct(members, corrections, slots):
    return apply_feddyn_correction(
      apply_slot_means(members, *slots), corrections, *slots, feddyn_alpha, num_clients
    )

  @tff.federated_computation
  def initialize_feddyn():
    return tff.federated_eval(zero_corrections, tff.SERVER)

  @tff.federated_computation(
    initialize_feddyn.type_signature.result,
    tff.FederatedType(members_type, tff.SERVER),
    tff.FederatedType(slots_type, tff.SERVER),
  )
  def next_feddyn(corrections, members, slots):
    members, corrections = tff.federated_map(correct, (members, corrections, slots))
    return tff.templates.MeasuredProcessOutput(
      corrections, members, tff.federated_value((), tff.SERVER)
    )

  return tff.templates.MeasuredProcess(initialize_feddyn, next_feddyn)
