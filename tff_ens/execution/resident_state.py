"""A process's state held on its TFF worker between rounds (`ResidentState`), and copied there.

`ResidentState` keeps a state on the single worker of the current
`runtime.execution_context` instead of moving it to Python and back every round, and cuts
the chain of earlier calls' values that a held state keeps alive on the worker by copying it
afresh (through a file a local worker writes and reads back, or through this process).
"""

import asyncio
from collections.abc import Iterator
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

import grpc
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.proto.v0 import executor_pb2

from tff_ens.execution import runtime
from tff_ens.execution import tls
from tff_ens.execution import worker_process


class _CopyingExecutor(tff.framework.RemoteExecutor):
  """TFF's remote executor that can also make a worker's value again from its bytes."""

  def __init__(self, stub, channel: grpc.Channel, **kwargs):
    super().__init__(stub, **kwargs)
    # Without (de)serializers: the serialized value passes through as bytes.
    self._compute_bytes = channel.unary_unary(
      tls.EXECUTOR_SERVICE + "Compute",
      request_serializer=executor_pb2.ComputeRequest.SerializeToString,
    )
    self._create_from_bytes = channel.unary_unary(
      tls.EXECUTOR_SERVICE + "CreateValue",
      response_deserializer=executor_pb2.CreateValueResponse.FromString,
    )

  async def copy(self, value):
    """A new value on the worker with `value`'s contents, created from its serialized form
    (which passes through this process as bytes, not parsed); it depends on no earlier call."""
    computed = self._compute_bytes(
      executor_pb2.ComputeRequest(executor=self._executor_id, value_ref=value.reference)
    )
    # The value is field 1 of both messages: the request is the response's bytes and the
    # executor's field.
    request = (
      computed + executor_pb2.CreateValueRequest(executor=self._executor_id).SerializeToString()
    )
    del computed
    created = self._create_from_bytes(request)
    return type(value)(created.value_ref, value.type_signature, self)


def _split_and_join(state_type: tff.FederatedType, paths: list) -> tuple[Any, Any]:
  """Computations that split a SERVER-placed structure into its tensors (at `paths`, from
  `_tensor_paths`), each at the server, and zip such tensors back into the structure (TFF's
  executor cannot select from a federated value), compiled for the worker."""
  member = state_type.member
  tensor_types = [_at(member, path) for path in paths]

  @tff.federated_computation(state_type)
  def split(state):
    return [_at(state, path) for path in paths]

  @tff.federated_computation([tff.FederatedType(t, tff.SERVER) for t in tensor_types])
  def join(parts):
    return tff.federated_zip(_packed(member, iter(parts)))

  return tuple(tff.backends.native.desugar_and_transform_to_native(c) for c in (split, join))


def _save_and_load(state_type: tff.FederatedType, paths: list) -> tuple[Any, Any]:
  """Computations that write a SERVER-placed structure's tensors (at `paths`) to a
  TensorFlow checkpoint bundle at a path (TensorFlow's `SaveV2`, returning the path), and
  read them back from it into the structure (`RestoreV2`), compiled for the worker. What
  `load` returns depends only on the path it is given."""
  member = state_type.member
  tensor_types = [_at(member, path) for path in paths]
  names = [str(i) for i in range(len(paths))]
  slices = [""] * len(paths)

  @tff.tensorflow.computation([*tensor_types, tff.TensorType(np.str_)])
  def save_tensors(tensors_and_prefix):
    *tensors, prefix = tensors_and_prefix
    saved = tf.raw_ops.SaveV2(
      prefix=prefix, tensor_names=names, shape_and_slices=slices, tensors=tensors
    )
    with tf.control_dependencies([saved]):
      return tf.identity(prefix)

  @tff.tensorflow.computation(np.str_)
  def load_tensors(prefix):
    tensors = tf.raw_ops.RestoreV2(
      prefix=prefix,
      tensor_names=names,
      shape_and_slices=slices,
      dtypes=[t.dtype for t in tensor_types],
    )
    return [tf.ensure_shape(t, spec.shape) for t, spec in zip(tensors, tensor_types)]

  path_type = tff.FederatedType(np.str_, tff.SERVER)

  @tff.federated_computation(state_type, path_type)
  def save(state, prefix):
    return tff.federated_map(
      save_tensors, tff.federated_zip([_at(state, path) for path in paths] + [prefix])
    )

  @tff.federated_computation(path_type)
  def load(prefix):
    tensors = tff.federated_map(load_tensors, prefix)
    return tff.federated_zip(_packed(member, (tensors[i] for i in range(len(paths)))))

  return tuple(tff.backends.native.desugar_and_transform_to_native(c) for c in (save, load))


def _tensor_paths(type_spec, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
  """The index paths of the tensors in a (nested) structure type."""
  if isinstance(type_spec, tff.StructType):
    return [p for i, element in enumerate(type_spec) for p in _tensor_paths(element, prefix + (i,))]
  return [prefix]


def _at(value, path: tuple[int, ...]):
  """`value[i][j]...` for the path (i, j, ...)."""
  for i in path:
    value = value[i]
  return value


def _packed(type_spec, tensors: Iterator):
  """`type_spec`'s structure (a `tff.structure.Struct`) of the next tensors."""
  if not isinstance(type_spec, tff.StructType):
    return next(tensors)
  return tff.structure.Struct(
    [(name, _packed(element, tensors)) for name, element in tff.structure.iter_elements(type_spec)]
  )


# Where a local worker writes its held state to copy it (`ResidentState`), if it has room
# for it: a file system in memory; else the system's temporary directory.
_MEMORY_DIRECTORY = "/dev/shm"
_COPY_PREFIX = "tff_ens_state_"
# A copy lasts seconds (the class doc of `ResidentState`); a copy directory older than this
# was left by a process that died during its copy.
_STALE_COPY_SECONDS = 3600

# `ResidentState`'s default growth budget (the CLI's --worker_growth_mib): a copy every N
# rounds, N the most rounds a local worker grew within 1 GiB.
MAX_GROWTH_BYTES = 2**30


class ResidentState:
  """Runs `next(state, *args) -> (state, metrics)` keeping the state on the worker.

  TFF's execution contexts return every result to Python, so a round of
  `process.next(state, data)` moves the whole server state to the worker and
  back. With 10 FEMNIST clients that is 0.4 s of a 3.0 s FedAvg round (one
  LEAF CNN, 26 MB) and 4.5 s of an 8.4 s Fed-ensemble round (five, 132 MB)
  (benchmarks/RESULTS.md, "Fed-ensemble round time"). TFF 0.87 has no API
  that leaves a result on the executor (`tff.program`'s native context
  materializes its arguments), so this drives the worker's executor directly
  through the public `tff.framework.RemoteExecutor`, as the sync context does
  inside `invoke`: the state stays a value on the worker between calls, only
  the metrics come back, and `value` downloads the state when it is needed
  (evaluation, checkpoints). The computation, its arguments and its results
  are the same as `next(state, *args)` through the context; only where the
  state waits between rounds changes. The state moves (up, down, and in the
  copy below) one tensor at a time, so neither process holds more than one
  tensor's bytes beside it.

  While a state the worker derived from a call is held there, TFF's worker
  keeps that call's per-client values alive, and through the state passed in,
  those of every earlier call back to the last state uploaded from Python:
  held round after round, the worker grew by 0.7 GB a round for
  v-Distillation (ten client models collected) and up to 0.4 GB for a K=5
  Fed-ensemble, where it stays flat when the state moves through Python
  (benchmarks/RESULTS.md, "State on the worker and worker memory"): each of its
  TensorFlow calls keeps its arguments for as long as its result lives. So the
  chain is cut by a fresh copy of the state, made on the worker from a value that
  holds no earlier one, before the state's next round after every N rounds held,
  N the most rounds a local worker's growth after the first round stayed within
  `max_growth_bytes` (at least 1; every round when it is 0, and for a remote worker,
  whose memory is not visible here; none when `value` downloaded the state). A local
  worker writes the state to a file, in memory where there is room, and reads it
  back from the file's path (`_save_and_load`); a remote one makes it again from the
  serialized bytes of its tensors, one at a time, passing through this process
  (`_CopyingExecutor.copy`, `_split_and_join`): a K=5 Fed-ensemble's 132 MB in 0.25 s
  against 0.88 s, a K=5 FedDyn-ensemble's 264 MB in 0.66 s against 2.59 s, on 2 cores
  (benchmarks/RESULTS.md, "The held state copied through a file"). The default, 1 GiB,
  copies a K=5 ensemble's state every few rounds on the FEMNIST slice, where it
  shortens the median round by 0.65-0.95 s against a copy every round, and every
  round at 100 clients a round on the full-size FEMNIST, where one round outgrows it
  (benchmarks/RESULTS.md, "Fed-ensemble round time with the held state copied after
  1 GiB"). The state is also uploaded again in the round after `value` downloaded it.

  With a context over several workers (TFF's mergeable form) the state goes
  through the context as usual.
  """

  def __init__(
    self,
    next_computation,
    state,
    *,
    max_growth_bytes: int = MAX_GROWTH_BYTES,
    copy_in_files: bool = True,
  ):
    """`next_computation`: a TFF computation `(state, *args) -> (state, metrics)`, or a
    Python function (a `server_step.DriverProcess`'s `next`), whose state is in Python.
    `copy_in_files` (an attribute, changeable between calls): a local worker copies the
    state through a file; else, as a remote one always does, through this process."""
    self._next = next_computation
    self._worker = (
      runtime.current_worker() if isinstance(next_computation, tff.Computation) else None
    )
    self._state = state  # The Python value, or None while only on the worker.
    self._remote = None
    self._max_growth_bytes = max_growth_bytes
    self.copy_in_files = copy_in_files
    self._first_rss = None  # The local worker's RSS after the first round.
    self._rounds_held = 0  # Rounds since the state was last uploaded or copied.
    self._cut_every = None if max_growth_bytes else 1  # N of the class doc, once measured.
    self._executor = None
    self._clients = None
    self._comp = self._split = self._join = self._save = self._load = None
    if self._worker is not None:
      self._compiled = tff.backends.native.desugar_and_transform_to_native(next_computation)
      state_type = self._compiled.type_signature.parameter[0]
      self._state_member = state_type.member
      self._paths = _tensor_paths(self._state_member)  # Its tensors', in `_split`'s order.
      self._split_and_join = _split_and_join(state_type, self._paths)
      self._save_and_load = _save_and_load(state_type, self._paths)
      tensor_types = [_at(self._state_member, path) for path in self._paths]
      # A dimension not known before the run counts as 0.
      sizes = [
        np.prod([d or 0 for d in t.shape or ()]) * np.dtype(t.dtype).itemsize for t in tensor_types
      ]
      self._state_bytes = int(sum(sizes))
      # The state's smallest tensor: computing it waits for a copy to be complete.
      self._smallest = int(np.argmin(sizes or [0]))

  @property
  def value(self):
    """The state as a Python structure (downloaded once after each `next`)."""
    if self._state is None:
      self._state = self._download(self._remote, 0)
      self._remote = None  # Uploaded again next round (see the class doc).
      self._rounds_held = 0
    return self._state

  @property
  def cut_every(self) -> int | None:
    """N of the class doc: rounds between copies once measured, else None."""
    return self._cut_every

  def next(self, *args) -> Any:
    """One call of the computation on the held state.

    Returns its metrics, or, for a computation with more results after the
    state (`(state, metrics, client states)`), the tuple of them all.
    """
    clients = self._cohort_size(args)
    chunk = 0 if self._worker is None else self._worker.clients_per_chunk
    if self._worker is None or 0 < chunk < clients:
      # Through the context, which runs a cohort larger than a chunk in chunks.
      self._state, *results = state_first(self._next(self.value, *args))
      return results[0] if len(results) == 1 else tuple(results)
    parameter = self._compiled.type_signature.parameter
    with self._worker_errors():
      self._use_executor(clients)
      if self._remote is None:
        self._remote = self._upload(self._state)
      elif self._cut_due():
        # Copied only before the state is used again: a state that `value` downloaded
        # in between is uploaded fresh instead.
        self._cut()
      values = [self._remote] + [
        self._run(self._executor.create_value(tff.tensorflow.transform_args(a), t))
        for a, t in zip(args, list(parameter)[1:])
      ]
      call = self._run(
        self._executor.create_call(self._comp, self._run(self._executor.create_struct(values)))
      )
      self._remote = self._run(self._executor.create_selection(call, 0))
      self._state = None
      results = tuple(
        self._download(self._run(self._executor.create_selection(call, i)), i)
        for i in range(1, len(self._next.type_signature.result))
      )
    self._rounds_held += 1
    return results[0] if len(results) == 1 else results

  def _cohort_size(self, args) -> int:
    """The clients of a call on the held state with `args` (0 without a worker)."""
    if self._worker is None:
      return 0
    parameter = list(self._compiled.type_signature.parameter)[1:]
    clients = {len(a) for a, t in zip(args, parameter) if runtime.is_per_client(t)}
    if len(clients) > 1:
      raise ValueError(f"CLIENTS-placed arguments of different lengths: {sorted(clients)}")
    return clients.pop() if clients else 0

  def cut(self) -> None:
    """Copies the held state on the worker now, cutting its chain (see the class doc)."""
    if self._remote is not None:
      with self._worker_errors():
        self._cut()

  def _cut(self) -> None:
    """Replaces the held state by its copy."""
    self._remote = self._copy(self._remote)
    self._rounds_held = 0

  def _cut_due(self) -> bool:
    """Whether to cut the held state's chain now (see the class doc)."""
    if self._cut_every is not None:
      return self._rounds_held >= self._cut_every
    if self._worker.process is None:
      self._cut_every = 1
      return True
    try:
      rss = _resident_bytes(self._worker.local.pid)
    except OSError:  # The worker is gone; the next call reports it.
      return False
    if self._first_rss is None:
      self._first_rss = rss
    elif rss - self._first_rss > self._max_growth_bytes:
      # The rounds since round 1 outgrew the budget: copy after one round fewer, so that
      # the worker stays within it (every round if one round outgrows it).
      self._cut_every = max(1, self._rounds_held - 1)
      return True
    return False

  def _use_executor(self, clients: int) -> None:
    """An executor for `clients` clients; the state moves if the count changes."""
    if self._executor is not None and clients == self._clients:
      return
    if self._executor is not None:
      _ = self.value  # Downloaded (and let go) before the executor frees it.
      self._worker.executors.remove(self._executor)
      self._executor.close()
    worker_process.wait_until_serving(self._worker.stub, self._worker.address, self._worker.process)
    # Values are disposed on the worker as soon as Python drops them, so
    # a replaced state does not wait there for a batch of 20.
    self._executor = _CopyingExecutor(self._worker.stub, self._worker.channel, dispose_batch_size=1)
    self._executor.set_cardinalities({tff.CLIENTS: clients})
    self._worker.executors.append(self._executor)
    self._clients = clients
    self._comp, self._split, self._join, self._save, self._load = (
      self._run(self._executor.create_value(c, c.type_signature))
      for c in (self._compiled, *self._split_and_join, *self._save_and_load)
    )

  def _tensors(self, remote) -> Iterator:
    """The held state `remote`'s tensors on the worker, each at the server, one at a time."""
    parts = self._run(self._executor.create_call(self._split, remote))
    for i in range(len(parts.type_signature)):
      yield self._run(self._executor.create_selection(parts, i))

  def _upload(self, state):
    """`state` (Python) created on the worker one tensor at a time."""
    flat = tff.structure.from_container(tff.tensorflow.transform_args(state), recursive=True)
    parts = [
      self._run(
        self._executor.create_value(
          _at(flat, path), tff.FederatedType(_at(self._state_member, path), tff.SERVER)
        )
      )
      for path in self._paths
    ]
    return self._join_parts(parts)

  def _join_parts(self, parts: list):
    """The state on the worker from its tensors on the worker, each at the server."""
    return self._run(
      self._executor.create_call(self._join, self._run(self._executor.create_struct(parts)))
    )

  def _copy(self, remote):
    """`remote` made again on the worker: by a local worker from a file it writes and reads
    back (`_save_and_load`), in memory if there is room (`_MEMORY_DIRECTORY`); else from
    its tensors' bytes, one at a time, through this process."""
    if not (self.copy_in_files and self._worker.process is not None and self._paths):
      return self._join_parts([self._run(self._executor.copy(t)) for t in self._tensors(remote)])
    parent = _copy_directory(self._state_bytes) or tempfile.gettempdir()
    _remove_stale_copies(parent)
    with tempfile.TemporaryDirectory(prefix=_COPY_PREFIX, dir=parent) as directory:
      prefix = self._run(
        self._executor.create_value(
          os.path.join(directory, "state"), tff.FederatedType(np.str_, tff.SERVER)
        )
      )
      saved = self._run(
        self._executor.create_call(
          self._save, self._run(self._executor.create_struct([remote, prefix]))
        )
      )
      self._run(saved.compute())
      del saved  # Disposed on the worker: it held `remote`.
      copy = self._run(self._executor.create_call(self._load, prefix))
      # Its files are removed only once it is read.
      parts = self._run(self._executor.create_call(self._split, copy))
      self._run(self._run(self._executor.create_selection(parts, self._smallest)).compute())
    return copy

  def _download(self, remote, index: int):
    """Result `index` of the computation, held in `remote`, as a Python structure; the state
    tensor by tensor, so that this process never holds all of its bytes beside it."""
    with self._worker_errors():
      if index == 0:
        tensors = [self._run(t.compute()) for t in self._tensors(remote)]
        value = _packed(self._state_member, iter(tensors))
      else:
        value = self._run(remote.compute())
    return tff.tensorflow.transform_result(
      tff.types.type_to_py_container(value, self._next.type_signature.result[index])
    )

  @contextlib.contextmanager
  def _worker_errors(self):
    """A gRPC error from a dead or unreachable worker becomes a `WorkerError`."""
    try:
      yield
    except grpc.RpcError:
      if self._worker.process is not None:
        # A killed worker may still be exiting when its connection drops.
        with contextlib.suppress(subprocess.TimeoutExpired):
          self._worker.process.wait(timeout=worker_process.STOP_GRACE_S)
      worker_process.wait_until_serving(
        self._worker.stub, self._worker.address, self._worker.process
      )
      raise

  @staticmethod
  def _run(coroutine):
    # RemoteExecutor's coroutines make blocking gRPC calls and never wait on
    # each other, so each runs to completion on its own event loop.
    return asyncio.run(coroutine)


def _copy_directory(state_bytes: int) -> str | None:
  """Where a copy of a held state of `state_bytes` is written: memory if it has room for
  twice the state, else None (the system's temporary directory)."""
  if os.path.isdir(_MEMORY_DIRECTORY) and _free_bytes(_MEMORY_DIRECTORY) > 2 * state_bytes:
    return _MEMORY_DIRECTORY
  return None


def _remove_stale_copies(parent: str) -> None:
  """Removes the copy directories in `parent` older than `_STALE_COPY_SECONDS`: a process
  killed during a copy (SIGKILL, the out-of-memory killer) leaves its directory, in
  `/dev/shm` the memory of a whole state until the machine restarts."""
  with os.scandir(parent) as entries:
    for entry in entries:
      if not entry.name.startswith(_COPY_PREFIX):
        continue
      try:
        modified = entry.stat(follow_symlinks=False).st_mtime
      except FileNotFoundError:  # Another process's copy, just removed.
        continue
      if time.time() - modified > _STALE_COPY_SECONDS:
        shutil.rmtree(entry.path, ignore_errors=True)


def _free_bytes(directory: str) -> int:
  """Bytes free to an unprivileged user in the file system of `directory`."""
  stats = os.statvfs(directory)
  return stats.f_bavail * stats.f_frsize


def _resident_bytes(pid: int) -> int:
  """Resident memory of a local process (Linux, as TFF's worker binary)."""
  with open(f"/proc/{pid}/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def state_first(output) -> tuple:
  """The results of a process's `next`, the state first."""
  if hasattr(output, "state"):  # tff.learning's LearningProcessOutput.
    return output.state, output.metrics
  return tuple(output)
