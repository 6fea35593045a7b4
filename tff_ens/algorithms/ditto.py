"""Ditto (Li, Hu, Beirami and Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, Algorithm 1): a global model by FedAvg, and on every client a
personal model v_k that minimizes its loss plus lambda/2 ||v_k - w^t||^2 towards the round's
global model w^t (eq. 2).

FedAvg's distributor, aggregator and finalizer; the client work keeps v_k as the client's
state (`stateful_client_work`): each sampled client trains the global model as FedAvg's
clients do and uploads its update, and takes SGD steps on its personal model with the
proximal gradient lambda (v_k - w^t) (Algorithm 1, lines 7-8), which never leaves it. A
personal model starts from the initial global model w^0, as in the authors' code
(litian96/ditto, `fedbase.py`); a client never sampled has none and uses the global model.

The authors' code takes the personal and the global steps on the same minibatches, one of
each in turn; the two chains do not interact within a round, so here the personal steps run
after the global ones, on a second pass over the client's dataset (`ditto_personal_steps` 0)
or on that many of its batches: the same examples and epochs, in the dataset's next seeded
shuffle, while the global pass is FedAvg's exactly.
"""

import collections
import dataclasses

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
from tff_ens.templates import transport as transport_lib

ModelWeights = tff.learning.models.ModelWeights


@settings.group
class Settings:
  """Ditto's personal models."""

  ditto_lambda: float = setting(
    1.0,
    "Ditto's lambda, the pull of each personal model towards the global one (eq. 2; the "
    "authors' scripts' 1; the paper also picks it per device from {0.1, 1, 2}).",
    at_least=0,
  )
  ditto_personal_steps: int = setting(
    0,
    "Ditto: SGD steps of a personal model per round (0: the global model's local steps, on the"
    " same minibatches, as the authors' code).",
    at_least=0,
  )


@tf.function
def train_personal(
  model: tf.keras.Model,
  optimizer,
  personal: ModelWeights,
  global_weights: ModelWeights,
  dataset: tf.data.Dataset,
  learning_rate,
  config: client_work_lib.LocalTrainingConfig,
):
  """Ditto's personal update (Algorithm 1, line 8): local SGD from `personal` on the client's
  loss plus the proximal term `config.proximal_mu`/2 ||v - w^t||^2 towards `global_weights`;
  returns `(new personal weights, metric sums)`."""

  def objective_gradient(grads, weights):
    # The proximal term's centre is the round's global model, not the personal start.
    return [
      client_work_lib.local_objective_gradient(g, w, center, config)
      for g, w, center in zip(grads, weights, global_weights.trainable)
    ]

  result, metrics = client_work_lib.train_locally(
    model,
    optimizer,
    personal,
    dataset,
    learning_rate,
    config,
    objective_gradient=objective_gradient,
  )
  # A rejected update (not finite) is zeros: the personal model stays.
  return tf.nest.map_structure(tf.subtract, personal, result.update), metrics


def build_client_work(
  model_fn, element_spec, config, options: Settings, transport=transport_lib.VALUES
):
  """Ditto's client work: FedAvg's local training of the global model, then the personal
  model's (`train_personal`), whose weights are the client's state (one float32 vector,
  moved by `transport`)."""
  client_work_lib.check_data_fits_model(model_fn, element_spec)
  weights_type = client_work_lib.weights_type_of(model_fn)
  data_type = tff.SequenceType(tff.types.tensorflow_to_type(element_spec))
  specs = tff.types.type_to_tf_tensor_specs(weights_type)
  state_type = tff.TensorType(np.float32, [stateful_client_work.flat_size(specs)])
  optimizer = client_work_lib.local_optimizer(config)
  personal_config = dataclasses.replace(config, proximal_mu=options.ditto_lambda)

  @tff.tensorflow.computation(weights_type, data_type, tf.float32, state_type)
  def client_update(download, dataset, learning_rate, personal_state):
    global_model = client_work_lib.model_to_overwrite(model_fn)
    result, metrics = client_work_lib.train_locally(
      global_model, optimizer, download, dataset, learning_rate, config
    )
    personal = stateful_client_work.unflatten(personal_state, specs)
    if options.ditto_personal_steps:
      dataset = dataset.repeat().take(options.ditto_personal_steps)
    # After the global pass: the first pass over a reshuffling dataset gets FedAvg's order.
    with tf.control_dependencies(tf.nest.flatten((result, metrics))):
      personal_model = client_work_lib.model_to_overwrite(model_fn)
      personal, personal_metrics = train_personal(
        personal_model, optimizer, personal, download, dataset, learning_rate, personal_config
      )
    metrics = collections.OrderedDict(
      metrics,
      personal_loss=personal_metrics["loss"],
      personal_correct=personal_metrics["correct"],
      personal_examples=personal_metrics["num_examples"],
    )
    return result, metrics, stateful_client_work.flatten(personal)

  @tff.tensorflow.computation(client_update.type_signature.result[1])
  def finalize(sums):
    measured = client_work_lib.finalize_train_metrics(sums)
    n = tf.maximum(sums["personal_examples"], 1.0)
    measured["personal_train_loss"] = sums["personal_loss"] / n
    measured["personal_train_accuracy"] = sums["personal_correct"] / n
    return measured

  return transport.stateful_client_work(client_update, config, finalize)


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  model_fn = lambda: context.model_fn(0)
  weights_type = client_work_lib.weights_type_of(model_fn)
  client_work = build_client_work(
    model_fn,
    context.element_spec,
    context.local,
    context.group(Settings),
    context.transport,
  )
  rate = fedavg.server_learning_rate(context, fedavg.LEARNING_RATE)
  distributor, aggregator, finalizer = server_optimizer.fedavg_stages(
    weights_type, server_optimizer.build_server_optimizer(rate)
  )
  process = composition.compose(
    server_optimizer.build_initial_weights_fn(model_fn),
    distributor,
    client_work,
    aggregator,
    finalizer,
    client_state_type=client_work.next_state_type,
  )
  update = client_work.client_update.type_signature
  built = built_lib.BuiltProcess(
    process,
    tff.StructType(list(update.parameter)[:1] + list(update.parameter)[2:3]),
    tff.StructType(list(update.result)[:2]),
    lambda state: [state["model"]],
  )
  initial = ModelWeights.from_model(model_fn())
  states = algorithm.ClientStates.of(
    client_work.client_state_type,
    initial=lambda: stateful_client_work.flatten(initial).numpy(),
    model=lambda state, models: stateful_client_work.unflatten_numpy(state, models[0]),
  )
  return algorithm.FederatedAlgorithm.of(
    "ditto", built, context, client_states=states, summary=own_models.summary(states)
  )


ALGORITHM = algorithm.Algorithm(
  "ditto",
  "Ditto (Li et al. 2021): FedAvg's global model and a personal model per client pulled towards it",
  build,
  settings=(fedavg.ServerSettings, Settings),
)
