"""Client work whose clients keep a state between their rounds (FedDyn's g, Ditto's personal
model, LG-FedAvg's local layers).

TFF's `ClientWorkProcess.next` takes exactly (state, weights, data), so such client work is a
stage of its own (`StatefulClientWork`), which `composition.compose` composes with
`client_state_type`. A client's state stays on the client: it is neither downloaded nor
uploaded, and the program stores it between rounds (`program.client_states`).
"""

import dataclasses

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.templates import client_work as client_work_lib


@dataclasses.dataclass(frozen=True)
class StatefulClientWork:
  """A client-work stage whose clients keep a state between their rounds.

  `next(state, downloads, client_data, client_states) -> (state, ClientResults, new client
  states, measurements)`, all per-client values at CLIENTS.
  """

  initialize: tff.Computation
  next: tff.Computation
  client_update: tff.Computation

  @property
  def client_state_type(self) -> tff.Type:
    return self.client_update.type_signature.parameter[3]


def build(
  client_update: tff.Computation,
  config: client_work_lib.LocalTrainingConfig,
  finalize: tff.Computation | None = None,
) -> StatefulClientWork:
  """The stage of local SGD's `client_update(download, data, learning rate, client state) ->
  (ClientResult, metric sums, new client state)`, whose state is the round (its learning
  rate, `client_work.learning_rate_at`); `finalize` turns the summed metrics into the
  round's (default: `client_work.finalize_train_metrics`)."""
  learning_rate, train_metrics = client_work_lib.sgd_round_fns(client_update, config)
  init_fn, run = client_work_lib.round_stage(
    client_update, learning_rate, finalize or train_metrics
  )
  download_type, data_type, _, state_type = client_update.type_signature.parameter

  @tff.federated_computation(
    init_fn.type_signature.result,
    tff.FederatedType(download_type, tff.CLIENTS),
    tff.FederatedType(data_type, tff.CLIENTS),
    tff.FederatedType(state_type, tff.CLIENTS),
  )
  def next_fn(state, downloads, client_data, client_states):
    state, outputs, measurements = run(state, downloads, client_data, client_states)
    return state, outputs[0], outputs[2], measurements

  return StatefulClientWork(init_fn, next_fn, client_update)


def flat_size(specs) -> int:
  """The length of the vector `flatten` makes of tensors of `specs`."""
  return sum(s.shape.num_elements() for s in tf.nest.flatten(specs))


def flatten(tensors):
  """A structure of tensors as one float32 vector: a client's state moves between Python and
  TFF's worker as one tensor, faster than as many (3.6 s against 5.1 s for ten LEAF
  CNN-sized states there and back)."""
  return tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tf.nest.flatten(tensors)], 0)


def unflatten(vector, specs):
  """`flatten`'s inverse, into the structure, shapes and dtypes of `specs`."""
  flat = tf.nest.flatten(specs)
  parts = tf.split(vector, [s.shape.num_elements() for s in flat])
  return tf.nest.pack_sequence_as(
    specs, [tf.cast(tf.reshape(p, s.shape), s.dtype) for p, s in zip(parts, flat)]
  )


def unflatten_numpy(vector: np.ndarray, like):
  """`unflatten` in NumPy, into the structure of `like` (arrays): for evaluation in the
  program, outside TF graphs."""
  parts, start = [], 0
  for t in tf.nest.flatten(like):
    t = np.asarray(t)
    parts.append(np.reshape(vector[start : start + t.size], t.shape).astype(t.dtype))
    start += t.size
  return tf.nest.pack_sequence_as(like, parts)
