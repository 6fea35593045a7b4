"""FedAvg's server-side stages of one model: its initial weights and the finalizer that
applies a server optimizer to the averaged update (FedOpt), batch-norm statistics included.

FedAvg, FedProx, FedAvgM and FedAdam share them (`algorithms.fedavg.build_fedavg`); the
finalizer is the only stage FedAvgM's and FedAdam's papers change, by its optimizer.
"""

from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

ModelWeights = tff.learning.models.ModelWeights


def build_initial_weights_fn(model_fn: Callable[[], tf.keras.Model]):
  """A TFF computation returning the initial `ModelWeights` of `model_fn`."""

  @tff.tensorflow.computation
  def initial_weights():
    return ModelWeights.from_model(model_fn())

  return initial_weights


def build_server_optimizer(learning_rate: float = 1.0, momentum: float = 0.0):
  """Server optimizer: SGD with rate 1 is FedAvg; momentum > 0 is FedAvgM."""
  return tff.learning.optimizers.build_sgdm(learning_rate=learning_rate, momentum=momentum or None)


@tf.function
def batch_norm_statistics(model: tf.keras.Model, weights: ModelWeights, images) -> ModelWeights:
  """`weights` with the batch-norm statistics that `model` holding them measures on `images`.

  The population statistics of Ioffe and Szegedy (ICML 2015, Algorithm 2, step 10),
  estimated on one batch: every batch-norm layer runs in training mode with momentum 0, so
  its moving mean and variance become those of its inputs over `images` (SWA's
  `update_bn`, Izmailov et al., UAI 2018, over a single batch). The trainable weights and
  the other non-trainable ones are unchanged.
  """
  model_weights = ModelWeights.from_model(model)
  tf.nest.map_structure(lambda v, t: v.assign(t), model_weights, weights)
  for layer in model.submodules:
    if isinstance(layer, tf.keras.layers.BatchNormalization):
      layer.momentum = 0.0
  model(images, training=True)  # tf.function orders it after the assignments.
  return ModelWeights(
    list(weights.trainable), [tf.identity(v) for v in model_weights.non_trainable]
  )


def each_with_batch_norm_statistics(model: tf.keras.Model, stacked, images):
  """`stacked` models (leading axis: the models), each with the batch-norm statistics it
  measures on `images` (`batch_norm_statistics`, one model at a time on `model`, whose
  layers it leaves with momentum 0)."""
  members = [
    batch_norm_statistics(model, tf.nest.map_structure(lambda t, m=m: t[m], stacked), images)
    for m in range(tf.nest.flatten(stacked)[0].shape[0])
  ]
  return tf.nest.map_structure(lambda *t: tf.stack(t), *members)


def build_finalizer(
  server_optimizer,
  weights_type: tff.Type,
  recalibration: tuple[Callable[[], tf.keras.Model], np.ndarray] | None = None,
):
  """Finalizer applying the averaged update to trainable and BN weights.

  Trainable weights take a server optimizer step with the averaged delta as
  gradient (Reddi et al., ICLR 2021, Algorithm 1: FedOpt); non-trainable
  weights (batch-norm statistics) become the average of the clients' ones,
  i.e. `w - mean(w - w_i)`. TFF's `build_apply_optimizer_finalizer` leaves
  non-trainable weights unchanged, which freezes batch-norm statistics at
  their initial values, hence this finalizer. With `recalibration = (model_fn,
  images)` the new model's batch-norm statistics are instead measured on the
  server's `images` (`batch_norm_statistics`): the clients' statistics belong to their own
  weights, which a binarized network's averaged weights do not reproduce.
  """
  trainable_type = weights_type.trainable

  @tff.tensorflow.computation
  def init_optimizer():
    return server_optimizer.initialize(tuple(tff.types.type_to_tf_tensor_specs(trainable_type)))

  optimizer_state_type = init_optimizer.type_signature.result

  @tff.tensorflow.computation(optimizer_state_type, weights_type, weights_type)
  def apply_update(optimizer_state, weights, update):
    optimizer_state, trainable = server_optimizer.next(
      optimizer_state, tuple(weights.trainable), tuple(update.trainable)
    )
    non_trainable = tf.nest.map_structure(tf.subtract, weights.non_trainable, update.non_trainable)
    new_weights = ModelWeights(list(trainable), non_trainable)
    if recalibration is not None:
      model_fn, images = recalibration
      new_weights = batch_norm_statistics(model_fn(), new_weights, tf.constant(images))
    return optimizer_state, new_weights

  @tff.federated_computation
  def init_fn():
    return tff.federated_eval(init_optimizer, tff.SERVER)

  @tff.federated_computation(
    init_fn.type_signature.result,
    tff.FederatedType(weights_type, tff.SERVER),
    tff.FederatedType(weights_type, tff.SERVER),
  )
  def next_fn(state, weights, update):
    state, new_weights = tff.federated_map(apply_update, (state, weights, update))
    return tff.templates.MeasuredProcessOutput(
      state, new_weights, tff.federated_value((), tff.SERVER)
    )

  return tff.learning.templates.FinalizerProcess(init_fn, next_fn)


def fedavg_stages(
  weights_type: tff.Type,
  server_optimizer=None,
  aggregator_factory: tff.aggregators.WeightedAggregationFactory | None = None,
  recalibration: tuple[Callable[[], tf.keras.Model], np.ndarray] | None = None,
):
  """FedAvg's stages around its client work (McMahan et al. 2017, Algorithm 1's server):
  `(distributor, aggregator, finalizer)`, the broadcast of the model, the clients' updates'
  mean weighted by their examples (or `aggregator_factory`'s, e.g. DP-FedAvg's) and
  `build_finalizer`'s step of `server_optimizer` (default: SGD at 1, FedAvg's) on it."""
  # no_nan_division: a round where every update was rejected (total weight
  # 0) leaves the model unchanged instead of turning it into NaN.
  factory = aggregator_factory or tff.aggregators.MeanFactory(no_nan_division=True)
  return (
    tff.learning.templates.build_broadcast_process(weights_type),
    factory.create(weights_type, tff.TensorType(np.float32)),
    build_finalizer(server_optimizer or build_server_optimizer(), weights_type, recalibration),
  )
