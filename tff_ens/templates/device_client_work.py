"""Client work of clients that trained on their devices (`tff_ens.program.device_clients`):
each client's data is its device's result, from which the round computes its update as the
shared local training's (`client_work.client_result`)."""

import collections

import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.templates import client_work as client_work_lib

ModelWeights = tff.learning.models.ModelWeights


def device_result_spec(weights_type: tff.Type) -> collections.OrderedDict:
  """`tf.TensorSpec`s of what a device's local training returns (`tff_ens.program.device_clients`):
  its trained weights (the trainable ones: the trainable file has no others) and sums over
  its examples."""
  return collections.OrderedDict(
    trainable=tuple(tf.TensorSpec(t.shape, t.dtype) for t in weights_type.trainable),
    loss=tf.TensorSpec([], tf.float32),
    correct=tf.TensorSpec([], tf.float32),
    num_examples=tf.TensorSpec([], tf.float32),
  )


def build_device_client_work(
  weights_type: tff.Type, config: client_work_lib.LocalTrainingConfig
) -> client_work_lib.ClientWork:
  """The client-work stage of clients that trained on their devices.

  Each client's data is one element, `device_result_spec`: the weights its device reached by
  local SGD from the broadcast ones (`export.trainable`, in LiteRT), and its sums of loss,
  correct predictions and examples. Its result is `client_work.client_result` of the broadcast
  and trained weights, as `train_locally`'s: initial - trained, weighted by its examples. The
  learning rate is the device file's own, so the round's rate is not used.
  """
  data_type = tff.SequenceType(tff.types.tensorflow_to_type(device_result_spec(weights_type)))

  @tff.tensorflow.computation(weights_type, data_type, tf.float32)
  def client_update(initial_weights, device_result, learning_rate):
    del learning_rate  # Fixed in the device's file.
    result = device_result.get_single_element()
    trained = ModelWeights(list(result["trainable"]), list(initial_weights.non_trainable))
    return client_work_lib.client_result(
      initial_weights,
      trained,
      result["loss"],
      result["correct"],
      result["num_examples"],
      config.max_update_norm,
    )

  return client_work_lib.build_round_client_work(
    client_update, *client_work_lib.sgd_round_fns(client_update, config)
  )
