"""FedDyn's clients (Acar et al., ICLR 2021, Algorithm 1): local training with a state.

A FedDyn client minimizes its loss minus a linear term in its state g plus a proximal term
(`train_feddyn`), then updates g; the state stays on the client between its rounds, so its
client work is a `stateful_client_work.StatefulClientWork`. Fed-ensemble uses it with one g
per model (`fed_ensemble`).
"""

import dataclasses
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import stateful_client_work
from tff_ens.templates import transport as transport_lib


def train_feddyn(
  model: tf.keras.Model,
  optimizer,
  initial_weights,
  dataset: tf.data.Dataset,
  learning_rate,
  config: client_work_lib.LocalTrainingConfig,
  alpha: float,
  dyn_state,
):
  """FedDyn's client update (Acar et al., ICLR 2021, Algorithm 1, lines 7-8).

  Local SGD (`client_work.train_locally`) on F(w) - <g, w> + alpha/2 ||w - w0||^2, g
  being the client's state `dyn_state` (zeros before its first round), then
  the state update g <- g - alpha (w - w0) (line 8), i.e. g + alpha * update.
  A rejected update is zeros, so it leaves g unchanged.

  The objective's gradient grad F(w) - g + alpha (w - w0) is computed as the authors' code
  does (alpemreacar/FedDyn, `train_feddyn_mdl`): alpha w as weight decay, and the fixed
  g + alpha w0 computed once, not at every step: one pass over the weights fewer a step, the
  same gradient up to float32 rounding (which moves a run's numbers in their later digits;
  benchmarks/RESULTS.md, "FedDyn's gradient in its authors' form").

  Returns:
    `(ClientResult, metrics, new g)` as `client_work.train_locally`'s, except that the
    update's weight is 1 (0 if rejected): FedDyn's server averages the
    returned models unweighted (line 10).
  """
  result, metrics = client_work_lib.train_locally(
    model,
    optimizer,
    initial_weights,
    dataset,
    learning_rate,
    dataclasses.replace(config, weight_decay=config.weight_decay + alpha, proximal_mu=0.0),
    linear_term=[g + alpha * w0 for g, w0 in zip(dyn_state, initial_weights.trainable)],
  )
  new_state = [g + alpha * u for g, u in zip(dyn_state, result.update.trainable)]
  weight = 1.0 - metrics["rejected"]
  return (tff.learning.templates.ClientResult(result.update, weight), metrics, new_state)


def build_feddyn_client_work(
  model_fn: Callable[[], tf.keras.Model],
  element_spec,
  config: client_work_lib.LocalTrainingConfig,
  alpha: float,
  transport: transport_lib.Transport = transport_lib.VALUES,
) -> stateful_client_work.StatefulClientWork:
  """FedDyn's client work (`train_feddyn`) with coefficient `alpha`.

  A client's state is its g, one value per trainable weight of the model, flattened into one
  float32 vector (`stateful_client_work.flatten`), moved by `transport`.
  """
  if alpha <= 0:
    raise ValueError(f"FedDyn's alpha must be > 0, got {alpha}")
  client_work_lib.check_data_fits_model(model_fn, element_spec)
  weights_type = client_work_lib.weights_type_of(model_fn)
  data_type = tff.SequenceType(tff.types.tensorflow_to_type(element_spec))
  optimizer = client_work_lib.local_optimizer(config)
  specs = tff.types.type_to_tf_tensor_specs(weights_type.trainable)
  if any(spec.dtype != tf.float32 for spec in tf.nest.flatten(specs)):
    raise TypeError(f"FedDyn needs float32 trainable weights, got {specs}")
  state_type = tff.TensorType(np.float32, [stateful_client_work.flat_size(specs)])

  @tff.tensorflow.computation(weights_type, data_type, tf.float32, state_type)
  def client_update(download, dataset, learning_rate, dyn_state):
    g = list(stateful_client_work.unflatten(dyn_state, specs))
    model = client_work_lib.model_to_overwrite(model_fn)
    result, metrics, new_g = train_feddyn(
      model, optimizer, download, dataset, learning_rate, config, alpha, g
    )
    return result, metrics, stateful_client_work.flatten(new_g)

  return transport.stateful_client_work(client_update, config)
