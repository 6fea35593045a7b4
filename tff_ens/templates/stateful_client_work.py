"""Client work whose clients keep a state between their rounds (FedDyn's g, a personal model,
a client's own layers).

TFF's `ClientWorkProcess.next` takes exactly (state, weights, data), so such client work is a
stage of its own (`StatefulClientWork`), which `composition.compose` composes with
`client_state_type`. A client's state stays on the client: it is neither downloaded nor
uploaded, and the program stores it between rounds (`program.client_states`).

In simulation the state either passes through TFF's executor with the round's other values
or, with `state_files`, stays in files: each client gets the path of its state and the path
to write its new one, and its computation reads and writes them in the worker
(`through_files`, `write_state`). A model-sized state moved as a value costs about a FedAvg
round for ten clients (benchmarks/RESULTS.md, "Fed-ensemble round time"); as files it never
leaves the worker's disk.
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
  state_files: bool = False

  @property
  def client_state_type(self) -> tff.Type:
    """What a client keeps between its rounds."""
    return self.client_update.type_signature.parameter[3]

  @property
  def next_state_type(self) -> tff.Type:
    """What `next` takes for each client's state: the state, or with `state_files` the paths
    to read it from and to write the new one to (`PATHS_TYPE`)."""
    return PATHS_TYPE if self.state_files else self.client_state_type


# A client's (state to read, new state to write) with `state_files`.
PATHS_TYPE = tff.TensorType(np.str_, [2])


# The one tensor of a client's state file (`write_state`).
_STATE_NAME = "state"
# The files of the state file `prefix` (`prefix + suffix`): its index, written last (a
# state is complete once its index is there), and its data.
STATE_FILE_SUFFIXES = (".index", ".data-00000-of-00001")


def write_state(prefix, value):
  """Writes `value` as the state file `prefix`: a TensorFlow checkpoint bundle
  (`prefix.index` and `prefix.data-00000-of-00001`, each written under a temporary name and
  renamed by `tf.raw_ops.SaveV2`), which TensorFlow writes from and reads into the tensor's
  own buffer: half the time of a serialized `TensorProto` for a LEAF CNN-sized state
  (benchmarks/RESULTS.md, "Clients' stored states on disk"). In a graph or eagerly."""
  return tf.raw_ops.SaveV2(
    prefix=prefix, tensor_names=[_STATE_NAME], shape_and_slices=[""], tensors=[value]
  )


def read_state(prefix, dtype):
  """The state in the file `prefix` (`write_state`'s)."""
  return tf.raw_ops.RestoreV2(
    prefix=prefix, tensor_names=[_STATE_NAME], shape_and_slices=[""], dtypes=[dtype]
  )[0]


def through_files(client_update: tff.Computation) -> tff.Computation:
  """`client_update(download, data, learning rate, state) -> (result, metrics, new state)`
  as `(download, data, learning rate, paths) -> (result, metrics, paths[1])`: the state is
  read from the file `paths[0]` and the new one written to `paths[1]` (`write_state`'s
  format) before the result is returned."""
  download_type, data_type, rate_type, state_type = client_update.type_signature.parameter

  @tff.tensorflow.computation(download_type, data_type, rate_type, PATHS_TYPE)
  def update(download, data, learning_rate, paths):
    state = tf.ensure_shape(read_state(paths[0], state_type.dtype), state_type.shape)
    result, metrics, new_state = client_update(download, data, learning_rate, state)
    written = write_state(paths[1], new_state)
    with tf.control_dependencies([written]):
      return tf.nest.map_structure(tf.identity, (result, metrics, paths[1]))

  return update


def build(
  client_update: tff.Computation,
  config: client_work_lib.LocalTrainingConfig,
  finalize: tff.Computation | None = None,
  state_files: bool = False,
) -> StatefulClientWork:
  """The stage of local SGD's `client_update(download, data, learning rate, client state) ->
  (ClientResult, metric sums, new client state)`, whose state is the round (its learning
  rate, `client_work.learning_rate_at`); `finalize` turns the summed metrics into the
  round's (default: `client_work.finalize_train_metrics`); `state_files`: the clients' states
  are files (`through_files`)."""
  learning_rate, train_metrics = client_work_lib.sgd_round_fns(client_update, config)
  work = through_files(client_update) if state_files else client_update
  init_fn, run = client_work_lib.round_stage(work, learning_rate, finalize or train_metrics)
  download_type, data_type, _, state_type = work.type_signature.parameter

  @tff.federated_computation(
    init_fn.type_signature.result,
    tff.FederatedType(download_type, tff.CLIENTS),
    tff.FederatedType(data_type, tff.CLIENTS),
    tff.FederatedType(state_type, tff.CLIENTS),
  )
  def next_fn(state, downloads, client_data, client_states):
    state, outputs, measurements = run(state, downloads, client_data, client_states)
    return state, outputs[0], outputs[2], measurements

  return StatefulClientWork(init_fn, next_fn, client_update, state_files)


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
