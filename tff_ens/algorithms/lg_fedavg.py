"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov and Morency, "Think
Locally, Act Globally: Federated Learning with Local and Global Representations", 2020,
Algorithm 1): every client keeps its own lower (representation) layers, and the server
averages only the top ones.

The server's model is the top `lg_global_layers` layers with weights (`split_layers`); it is
broadcast, each sampled client puts it on top of its own lower layers (its state,
`stateful_client_work`; the initial model's before its first round), trains the whole model
as FedAvg's clients do, keeps the new lower layers and uploads the update of the top ones,
which FedAvg's aggregator and finalizer average. A client's model for evaluation is its own
lower layers under the global top (`ClientStates.model`); the global model alone has the
initial lower layers.

The authors' code (pliang279/LG-FedAvg, `main_lg.py`) starts from a model trained by FedAvg
and keeps, per client, the best local model on its test data; this module starts from the
run's initial model, like every other algorithm, and selects nothing on test data.
"""

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.algorithms import fedavg
from tff_ens.algorithms import own_models
from tff_ens.settings import setting
from tff_ens.templates import built as built_lib
from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import composition
from tff_ens.templates import server_optimizer
from tff_ens.templates import stateful_client_work

ModelWeights = tff.learning.models.ModelWeights


@settings.group
class Settings:
  """Which layers LG-FedAvg's server averages."""

  lg_global_layers: int = setting(
    2,
    "LG-FedAvg: the top layers with weights that the server averages; the lower ones stay on "
    "each client (2: the LEAF CNN's dense classifier over a local convolutional "
    "representation, the paper's split of representation and global model).",
    above=0,
  )


def split_layers(model: tf.keras.Model, global_layers: int) -> tuple[list[bool], list[bool]]:
  """Which of `ModelWeights.from_model(model)`'s trainable and non-trainable tensors belong to
  the top `global_layers` of its (top-level) layers with weights."""
  layers = [layer for layer in model.layers if layer.weights]
  if not 0 < global_layers < len(layers):
    raise ValueError(
      f"lg_global_layers={global_layers}: the model has {len(layers)} layers with weights; "
      f"keep at least one local and one global (1 to {len(layers) - 1})"
    )
  top = {id(v) for layer in layers[-global_layers:] for v in layer.weights}
  return (
    [id(v) in top for v in model.trainable_weights],
    [id(v) in top for v in model.non_trainable_weights],
  )


def part(weights, masks, keep: bool):
  """The tensors of `weights` (a `ModelWeights`) whose mask is `keep`."""
  return ModelWeights(
    [t for t, m in zip(weights.trainable, masks[0]) if m == keep],
    [t for t, m in zip(weights.non_trainable, masks[1]) if m == keep],
  )


def join(global_part, local_part, masks):
  """The whole `ModelWeights` of its global and local parts (`part`'s inverse)."""

  def merge(globals_, locals_, mask):
    globals_, locals_ = list(globals_), list(locals_)
    return [globals_.pop(0) if m else locals_.pop(0) for m in mask]

  return ModelWeights(
    merge(global_part.trainable, local_part.trainable, masks[0]),
    merge(global_part.non_trainable, local_part.non_trainable, masks[1]),
  )


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  model_fn = lambda: context.model_fn(0)
  model = model_fn()
  masks = split_layers(model, context.group(Settings).lg_global_layers)
  initial = ModelWeights.from_model(model)
  weights_type = client_work_lib.weights_type_of(model_fn)
  specs = tff.types.type_to_tf_tensor_specs(weights_type)
  global_type = tff.types.tensorflow_to_type(part(specs, masks, True))
  local_specs = part(specs, masks, False)
  state_type = tff.TensorType(np.float32, [stateful_client_work.flat_size(local_specs)])
  data_type = tff.SequenceType(tff.types.tensorflow_to_type(context.element_spec))
  client_work_lib.check_data_fits_model(model_fn, context.element_spec)
  optimizer = client_work_lib.local_optimizer(context.local)

  @tff.tensorflow.computation(global_type, data_type, tf.float32, state_type)
  def client_update(download, dataset, learning_rate, local_state):
    local = stateful_client_work.unflatten(local_state, local_specs)
    start = join(download, local, masks)
    model = client_work_lib.model_to_overwrite(model_fn)
    result, metrics = client_work_lib.train_locally(
      model, optimizer, start, dataset, learning_rate, context.local
    )
    trained = tf.nest.map_structure(tf.subtract, start, result.update)
    update = tff.learning.templates.ClientResult(
      part(result.update, masks, True), result.update_weight
    )
    return update, metrics, stateful_client_work.flatten(part(trained, masks, False))

  client_work = context.transport.stateful_client_work(client_update, context.local)

  @tff.tensorflow.computation
  def initial_global():
    return part(ModelWeights.from_model(model_fn()), masks, True)

  rate = fedavg.server_learning_rate(context, fedavg.LEARNING_RATE)
  distributor, aggregator, finalizer = server_optimizer.fedavg_stages(
    global_type, server_optimizer.build_server_optimizer(rate)
  )
  process = composition.compose(
    initial_global,
    distributor,
    client_work,
    aggregator,
    finalizer,
    client_state_type=client_work.next_state_type,
  )
  initial_local = tf.nest.map_structure(np.asarray, part(initial, masks, False))
  update = client_update.type_signature
  built = built_lib.BuiltProcess(
    process,
    tff.StructType(list(update.parameter)[:1] + list(update.parameter)[2:3]),
    tff.StructType(list(update.result)[:2]),
    lambda state: [join(state["model"], initial_local, masks)],
  )
  states = algorithm.ClientStates.of(
    state_type,
    initial=lambda: stateful_client_work.flatten(initial_local).numpy(),
    model=lambda state, models: join(
      part(models[0], masks, True),
      stateful_client_work.unflatten_numpy(state, initial_local),
      masks,
    ),
  )
  return algorithm.FederatedAlgorithm.of(
    "lg_fedavg", built, context, client_states=states, summary=own_models.summary(states)
  )


ALGORITHM = algorithm.Algorithm(
  "lg_fedavg",
  "LG-FedAvg (Liang et al. 2020): local lower layers on every client, the top ones averaged",
  build,
  settings=(fedavg.ServerSettings, Settings),
)
