"""Fed-ensemble: K models trained at the communication cost of one.

Shi, Liang, Wang, Li, Jin: "Fed-ensemble: Ensemble Models in Federated
Learning for Improved Generalization and Uncertainty Quantification", IEEE
T-ASE 2023 (arXiv:2107.10663), Algorithm 1.

The server keeps K models. Every K rounds each client i draws a random
permutation P[i, :] of 0..K-1; in round t it trains model P[i, t mod K]. The
algorithm is FedAvg's four stages with three swapped for the keyed stages it
shares with FedDF's prototypes (`keyed_stages`, composed by `composition.compose`):

* distributor: the client computes its key P[i, t mod K] and receives that model: in
  simulation all K are broadcast and the client keeps its own (`member_delivery=
  "broadcast"`, TFF's runtime makes one value for all clients), or only that one is sent
  with `tff.federated_select` ("select", a deployment's type signature); either way a
  client's download is one model, which the bytes down report; its state is (round, seed);
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
import functools
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.algorithms import fedprox
from tff_ens.math import member_updates
from tff_ens.settings import setting
from tff_ens.templates import built as built_lib
from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import composition
from tff_ens.templates import device_client_work
from tff_ens.templates import feddyn
from tff_ens.templates import keyed_stages
from tff_ens.templates import privacy
from tff_ens.templates import transport as transport_lib

ModelWeights = tff.learning.models.ModelWeights

ASSIGNMENTS = member_updates.ASSIGNMENTS
# How model k averages the clients that trained it: each client once (Shi et
# al., Remark 1, and both of the authors' repositories) or by its examples
# (FedAvg's weighting).
MEMBER_AVERAGES = ("clients", "examples")
MEMBER_DELIVERIES = ("select", "broadcast")
LOCAL_OBJECTIVES = ("sgd", "fedprox", "feddyn")


@settings.group
class Ensemble:
  """The size of a K-model ensemble (Fed-ensemble's, the random walks')."""

  ensemble_size: int = setting(5, "K, the models of the ensemble.", above=0)


@settings.group
class Settings:
  """Fed-ensemble's assignment, average and local objective."""

  assignment: str = setting(
    "permutation",
    "Which model a client trains; random is the paper's Table VII ablation.",
    choices=ASSIGNMENTS,
  )
  member_average: str = setting(
    "clients",
    "Each model's average over its clients: each client once (the paper's Remark 1 and the "
    "authors' code) or by examples (FedAvg's).",
    choices=MEMBER_AVERAGES,
    before="examples",
  )
  local_objective: str = setting(
    "sgd",
    "The clients' objective: sgd, fedprox (with --proximal_mu) or feddyn (with "
    "--feddyn_alpha; K=1 is FedDyn).",
    choices=LOCAL_OBJECTIVES,
  )
  feddyn_alpha: float = setting(
    0.01,
    "FedDyn's alpha (--local_objective=feddyn); its clients' states go to "
    "OUTPUT_DIR/client_states.",
    above=0,
  )
  member_delivery: str = setting(
    "broadcast",
    "How the simulation gives a client the member it trains: broadcast sends all K and the "
    "client keeps its own (one value all clients share in TFF's runtime); select sends only "
    "that one (tff.federated_select, a deployment's type signature), in more time and memory "
    'here (docs/library.md, "Memory"). The same numbers; the bytes down are one member.',
    choices=MEMBER_DELIVERIES,
  )


def build_fed_ensemble(
  member_model_fn: Callable[[int], tf.keras.Model],
  element_spec,
  local_config: client_work_lib.LocalTrainingConfig,
  *,
  ensemble_size: int,
  options: Settings = Settings(),
  seed: int = 0,
  dp: privacy.DPConfig | None = None,
  num_clients: int = 0,
  on_device: bool = False,
  client_key: Callable | None = None,
  transport: transport_lib.Transport = transport_lib.VALUES,
) -> built_lib.BuiltProcess:
  """Builds Fed-ensemble as a `tff.templates.IterativeProcess`: `next(state, client_data,
  client_indices[, client_states]) -> (state, metrics[, new client states])`, the indices
  (int32 at CLIENTS) each client's in the population (its permutation row), the states
  FedDyn's g of the member it trains (`assigned_model`), zeros before its first time.

  Args:
    member_model_fn: `k -> Keras model` with member k's initialization (one architecture).
    element_spec: `tf.TensorSpec`s of one client batch `(x, y)`.
    local_config: client training (FedAvg's, or FedProx with `proximal_mu`).
    ensemble_size: K.
    options: the assignment, the members' average and, with `local_objective="feddyn"`,
      FedDyn's local objective and server correction with `feddyn_alpha`; DP and FedDyn
      count every client once whatever `member_average` is.
    seed: seed of the permutations.
    dp: clip every update to `dp.clip_norm`, noise the slot sums (`privatize_slots`).
    num_clients: the population m (FedDyn's h divides by it).
    on_device: the clients' data are their devices' results of training their member
      (`device_client_work.build_device_client_work`), so no FedDyn.
    client_key: `(distributor state, the int32 a client passes with its data) -> [the
      member it trains]` in TensorFlow; None: `member_key`, the member its index in the
      population is assigned in the state's round (`assigned_model`).
    transport: what moves FedDyn's clients' g (`transport.Transport`; with files `next`
      takes each client's two paths, `stateful_client_work.through_files`).
  """
  _check_options(ensemble_size, options, dp, num_clients, on_device)
  uses_feddyn = options.local_objective == "feddyn"
  feddyn_alpha = options.feddyn_alpha if uses_feddyn else 0.0
  k = ensemble_size
  architecture_fn = lambda: member_model_fn(0)
  weights_type = client_work_lib.weights_type_of(architecture_fn)
  client_work, work_stage = _build_client_work(
    architecture_fn, element_spec, local_config, feddyn_alpha, on_device, transport
  )
  initial_members = _initial_members(member_model_fn, k)
  members_type = initial_members.type_signature.result
  distributor = _build_distributor(
    members_type,
    weights_type,
    seed,
    client_key or functools.partial(member_key, ensemble_size=k, assignment=options.assignment),
    options.member_delivery,
  )
  aggregator = keyed_stages.build_slot_aggregator(
    client_work.client_update.type_signature.result[0].update,
    k,
    count_clients_once=options.member_average == "clients" or uses_feddyn,
    dp=dp,
  )
  slots_type = aggregator.next.type_signature.result.result.member
  finalizer = _build_finalizer(members_type, slots_type, weights_type, feddyn_alpha, num_clients)
  process = composition.compose(
    initial_members,
    distributor,
    work_stage,
    aggregator,
    finalizer,
    keyed=True,
    client_state_type=client_work.next_state_type if uses_feddyn else None,
  )
  return built_lib.BuiltProcess(
    process,
    *_transfer_types(weights_type, distributor, client_work, uses_feddyn),
    lambda state: list(state["model"]),
    client_work.client_state_type if uses_feddyn else None,
  )


def _initial_members(member_model_fn, k: int) -> tff.Computation:
  """`() -> the K members' initial ModelWeights`, member i from `member_model_fn(i)`."""

  @tff.tensorflow.computation
  def initial_members():
    return tuple(ModelWeights.from_model(member_model_fn(i)) for i in range(k))

  return initial_members


def _check_options(ensemble_size, options: Settings, dp, num_clients: int, on_device: bool):
  """ValueError for a Fed-ensemble `build_fed_ensemble` cannot build."""
  uses_feddyn = options.local_objective == "feddyn"
  if ensemble_size < 1:
    raise ValueError(f"ensemble_size must be >= 1, got {ensemble_size}")
  if dp is not None and dp.adaptive:
    raise ValueError("Fed-ensemble's DP needs a fixed clip norm > 0")
  if uses_feddyn and on_device:
    raise ValueError("FedDyn's clients keep a state the device file has not: use SGD on devices")
  if uses_feddyn and (dp is not None or num_clients < 1):
    raise ValueError(
      "FedDyn needs num_clients >= 1 and no DP (its client state is the client's unclipped updates)"
    )


def _build_client_work(
  architecture_fn, element_spec, local_config, feddyn_alpha, on_device, transport
):
  """`(client work, its stage)`: FedDyn's (`feddyn_alpha` > 0, its states moved by
  `transport`), the devices' results, or the shared local training."""
  if feddyn_alpha:
    client_work = feddyn.build_feddyn_client_work(
      architecture_fn, element_spec, local_config, feddyn_alpha, transport
    )
    return client_work, client_work
  weights_type = client_work_lib.weights_type_of(architecture_fn)
  client_work = (
    device_client_work.build_device_client_work(weights_type, local_config)
    if on_device
    else client_work_lib.build_client_work(architecture_fn, element_spec, local_config)
  )
  return client_work, client_work.process


def _transfer_types(weights_type, distributor, client_work, uses_feddyn: bool):
  """What one client downloads and uploads: the member it trains, whatever the delivery (Shi
  et al.: one model down), with its assignment and learning rate; its result (FedDyn's new g,
  its third, stays on the client) and its key."""
  client_update_type = client_work.client_update.type_signature
  download = tff.StructType(
    [
      ("model", weights_type),
      ("assignment", distributor.initialize.type_signature.result.member),
      ("learning_rate", client_update_type.parameter.learning_rate),
    ]
  )
  uploaded = client_update_type.result
  if uses_feddyn:
    uploaded = tff.StructType(list(client_update_type.result)[:2])
  key_type = distributor.next.type_signature.result.result[1].member
  return download, tff.StructType([("client_result", uploaded), ("key", key_type)])


def member_key(state, client_index, *, ensemble_size: int, assignment: str):
  """The member client `client_index` trains in the round of the distributor's `state`
  (`member_updates.assigned_model`), as a [1] tensor."""
  return tf.reshape(
    member_updates.assigned_model(
      state["seed"], client_index, state["round"], ensemble_size, assignment
    ),
    [1],
  )


def _build_distributor(members_type, weights_type, seed: int, key_fn, delivery: str):
  """Fed-ensemble's distributor: each client downloads the member `key_fn(state, its int32)`
  names (`keyed_stages.build_keyed_distributor`); its state is (round, seed). `delivery`: one
  of `MEMBER_DELIVERIES`."""
  key_state = collections.OrderedDict(round=np.int32(0), seed=np.int64(seed))
  key_state_type = collections.OrderedDict(round=np.int32, seed=np.int64)

  @tff.tensorflow.computation(key_state_type, np.int32)
  def client_key(state, client_index):
    return key_fn(state, client_index)

  def member(members, key):
    return tf.switch_case(
      key, [lambda m=m: tuple(tf.identity(t) for t in tf.nest.flatten(m)) for m in members]
    )

  def as_model_weights(flat):
    return tf.nest.pack_sequence_as(tff.types.type_to_tf_tensor_specs(weights_type), list(flat))

  @tff.tensorflow.computation(members_type, np.int32)
  def select_member(members, key):
    return member(members, key)

  selected_type = select_member.type_signature.result

  @tff.tensorflow.computation(tff.SequenceType(selected_type), tff.TensorType(np.int32, [1]))
  def to_model_weights(selected, key):
    del key  # The client trains the member it was sent.
    flat = selected.reduce(tuple(tf.zeros(t.shape, t.dtype) for t in selected_type), lambda _, x: x)
    return as_model_weights(flat)

  pick_member = None
  if delivery == "broadcast":

    @tff.tensorflow.computation(members_type, tff.TensorType(np.int32, [1]))
    def pick_member(members, key):
      return as_model_weights(member(members, key[0]))

  @tff.tensorflow.computation(key_state_type)
  def next_round(state):
    return collections.OrderedDict(round=state["round"] + 1, seed=state["seed"])

  return keyed_stages.build_keyed_distributor(
    members_type,
    key_state,
    client_key,
    select_member,
    to_model_weights,
    next_round,
    pick_download=pick_member,
  )


def _build_finalizer(members_type, slots_type, weights_type, feddyn_alpha: float, num_clients):
  """Fed-ensemble's finalizer: each member moves by its slot's mean update
  (`apply_slot_means`); with FedDyn (`feddyn_alpha` > 0) its state is the K models' h and
  the members are corrected by them (`apply_feddyn_correction`)."""

  @tff.tensorflow.computation(members_type, slots_type)
  def slot_means(members, slots):
    return member_updates.apply_slot_means(members, *slots)

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
    return member_updates.apply_feddyn_correction(
      member_updates.apply_slot_means(members, *slots),
      corrections,
      *slots,
      feddyn_alpha,
      num_clients,
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


def assigned_models(key_state, clients, ensemble_size: int, assignment: str) -> list[int]:
  """The member each of `clients` trains in the round whose distributor state is
  `key_state` (`assigned_model`, as the distributor computes it)."""
  return [
    int(
      member_updates.assigned_model(
        key_state["seed"], c, key_state["round"], ensemble_size, assignment
      )
    )
    for c in clients
  ]


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  k = context.group(Ensemble).ensemble_size
  options = context.group(Settings)
  local = fedprox.local_config(context) if options.local_objective == "fedprox" else context.local
  built = build_fed_ensemble(
    context.model_fn,
    context.element_spec,
    local,
    ensemble_size=k,
    options=options,
    seed=context.seed,
    dp=context.dp,
    num_clients=context.num_clients,
    on_device=context.on_device,
    transport=context.transport,
  )
  members = lambda clients, key_state: assigned_models(key_state, clients, k, options.assignment)
  states = None
  if built.client_state_type is not None:
    states = algorithm.ClientStates.of(built.client_state_type, keys=members)
  return algorithm.FederatedAlgorithm.of(
    "fedensemble",
    built,
    context,
    client_keys=lambda clients, slots: clients,
    assigned_models=members,
    client_states=states,
  )


def validate(groups, facts: algorithm.RunFacts) -> None:
  """FedDyn keeps each client's unclipped updates, which DP cannot; devices train with plain
  SGD(M); Fed-ensemble's DP clips at a fixed norm."""
  local_objective = groups[Settings].local_objective
  if local_objective == "feddyn" and facts.dp is not None:
    raise settings.SettingError(
      "local_objective",
      "feddyn",
      "FedDyn keeps each client's unclipped updates: it does not combine with DP (--dp_*); "
      "use --local_objective=sgd or fedprox",
    )
  if local_objective != "sgd" and facts.on_devices:
    raise settings.SettingError(
      "client_runtime",
      facts.client_runtime,
      "the device file trains with plain SGD(M) on all its examples, so "
      f"--local_objective={local_objective} is not supported there: use "
      "--local_objective=sgd or --client_runtime=tff",
    )
  if facts.dp is not None and facts.dp.noise_multiplier and not facts.dp.clip_norm:
    raise settings.SettingError(
      "dp_clip_norm",
      0.0,
      "--algorithm=fedensemble clips with a fixed norm only: set --dp_clip_norm > 0",
    )


ALGORITHM = algorithm.Algorithm(
  "fedensemble",
  "Fed-ensemble (Shi et al. 2021): K models, one per client per round",
  build,
  settings=(Ensemble, Settings, fedprox.Settings),
  validate=validate,
  dp=True,
  on_device=True,
  variant_flags=("ensemble_size", "local_objective"),
)
