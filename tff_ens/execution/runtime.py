"""TFF execution contexts whose C++ worker processes have a bounded lifetime.

Importing `tensorflow_federated` installs `set_sync_local_cpp_execution_context()`
as the default context. We do not use it (nor its constructor
`tff.backends.native.create_sync_local_cpp_execution_context`): on the first
computation call it starts `worker_binary` with the caller's stdout/stderr (so
the child holds pytest's or a parent's pipes open) and only stops it in a
`__del__`, so the worker can outlive Python, e.g. when the parent is SIGKILLed.

Here `execution_context()` starts its own worker (or connects to running ones,
see `worker_process.start_worker` and `python -m tff_ens.worker`), installs a context built
from public `tff.framework` pieces for the duration of a `with` block, and
stops the worker on exit. Workers are started with their output away from the
parent's pipes and with `PR_SET_PDEATHSIG=SIGKILL`, so they die with the
thread that started them even if Python is killed.

Note: TFF's context stack is thread-local; the context is current only in the
thread that entered the block.
"""

import asyncio
from collections.abc import Iterator, Sequence
import contextlib
import dataclasses
import os
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any, Optional

import grpc
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.proto.v0 import executor_pb2

from tff_ens.execution import tls
from tff_ens.execution import worker_process


@dataclasses.dataclass(frozen=True)
class _Worker:
  """The one worker of the installed context, for `ResidentState`."""

  stub: tff.framework.RemoteExecutorGrpcStub
  channel: grpc.Channel
  address: str
  local: Optional[worker_process.LocalWorker]  # None for a worker given by address.
  executors: list  # Closed when the context exits.

  @property
  def process(self) -> Optional[subprocess.Popen]:
    return None if self.local is None else self.local.process


# Per thread (as TFF's context stack): the single worker of each installed
# `execution_context`, innermost last; None for a several-worker context.
_installed = threading.local()


def _current_worker() -> Optional[_Worker]:
  stack = getattr(_installed, "workers", [])
  return stack[-1] if stack else None


class _NoExecutionContext(tff.framework.SyncContext):
  """Default context outside `execution_context()`: refuses to run.

  Replaces the one TFF installs at import, which would start a
  `worker_binary` that outlives Python (see the module docstring).
  """

  def invoke(self, comp, arg):
    raise RuntimeError(
      "TFF computations run inside tff_ens.execution.runtime.execution_context(): "
      "wrap the call in `with execution_context():`"
    )


tff.framework.set_default_context(_NoExecutionContext())


class _LatestExecutorFactory(tff.framework.ExecutorFactory):
  """Holds one executor, for the cardinalities of the latest computation.

  TFF's `ResourceManagingExecutorFactory` keeps an executor per distinct
  cardinality (up to 10) and drops old ones without closing them. On the C++
  worker every executor keeps its own copy of the computations it ran: with
  Fed-ensemble's five LEAF CNNs the worker grew by ~1.2 GB for every new
  cohort size and never shrank, so client dropouts (a different cohort size
  most rounds) ran it out of memory (measured in benchmarks/RESULTS.md,
  "Worker memory"). Closing the previous executor when the cardinalities
  change frees it on the worker. Computations run one at a time per worker,
  so no value of the closed executor is still in use.
  """

  def __init__(self, stack_fn):
    self._stack_fn = stack_fn
    self._key = None
    self._executor = None

  def create_executor(self, cardinalities):
    key = sorted((str(placement), n) for placement, n in cardinalities.items())
    if key != self._key:
      self.clean_up_executor(cardinalities)
      self._executor = self._stack_fn(cardinalities)
      self._key = key
    return self._executor

  def clean_up_executor(self, cardinalities):
    del cardinalities  # There is only one executor.
    if self._executor is not None:
      self._executor.close()
    self._executor = self._key = None


def _executor_factory(
  stub: tff.framework.RemoteExecutorGrpcStub,
  address: str,
  process: Optional[subprocess.Popen],
  executors: list[tff.framework.RemoteExecutor],
) -> tff.framework.ExecutorFactory:
  """Executor factory over one worker, as TFF's `local_cpp_executor_factory`."""

  def stack_fn(cardinalities):
    # TFF retries calls that fail with gRPC UNAVAILABLE forever, re-creating
    # the executor each time; checking here turns a dead worker into an error.
    worker_process.wait_until_serving(stub, address, process)
    # As TFF: computations with no CLIENTS-placed argument get 0 clients.
    cardinalities.setdefault(tff.CLIENTS, 0)
    # Not `stream_structs=True`: it moves a 132 MB state about twice as fast
    # but its value finalizers then fail ("value not found, cannot dispose").
    # Values are disposed on the worker as soon as Python drops them: with TFF's
    # default batch of 20 disposals, the worker held the values of the last few
    # calls, and with them those calls' per-client values (a server step's collect:
    # every client's update of those rounds). Measured with the collect of 4 clients'
    # 50 MB updates, 4 calls: the worker peaked at 4.5 GB, with a batch of 1 at 2.6 GB.
    executor = tff.framework.RemoteExecutor(stub, dispose_batch_size=1)
    executor.set_cardinalities(cardinalities)
    executors.append(executor)
    return executor

  return _LatestExecutorFactory(stack_fn)


def _is_per_client(type_spec: tff.types.Type) -> bool:
  return (
    isinstance(type_spec, tff.FederatedType)
    and type_spec.placement is tff.CLIENTS
    and not type_spec.all_equal
  )


def _compile_to_mergeable_form(comp):
  """TFF's mergeable-form compiler, refusing computations with per-client results.

  TFF 0.87's `MergeableCompExecutionContext` concatenates CLIENTS-placed results
  in the order the workers finish, not in client order; refuse rather than
  return them silently permuted.
  """
  if tff.types.contains(comp.type_signature.result, _is_per_client):
    raise ValueError(
      "Computations returning CLIENTS-placed values cannot run on several "
      "workers (TFF 0.87 returns them out of client order); use one worker."
    )
  return tff.backends.native.compile_to_mergeable_comp_form(comp)


def _channel(address: str, credentials_dir: Optional[str]) -> grpc.Channel:
  """A gRPC channel to a worker: mutual TLS with `credentials_dir`; else plaintext, which
  only a Unix-domain socket or a loopback address may take."""
  if credentials_dir is not None:
    return grpc.secure_channel(address, tls.channel_credentials(credentials_dir), tls.GRPC_OPTIONS)
  if not tls.is_local(address):
    raise tls.CredentialsError(
      f"{address} is reached over the network: pass the driver's credentials (a directory "
      f"made by `{tls.MAKE_COMMAND}`) to verify the worker and be verified by it"
    )
  return grpc.insecure_channel(address, tls.GRPC_OPTIONS)


def _context(factories: list) -> tff.framework.SyncContext:
  """TFF's context over the workers' executor factories: one directly, several through the
  mergeable form, with the compiler and transforms of TFF's
  `create_sync_local_cpp_execution_context`."""
  transforms = dict(
    transform_args=tff.tensorflow.transform_args,
    transform_result=tff.tensorflow.transform_result,
  )
  compiler_fn = tff.backends.native.desugar_and_transform_to_native
  if len(factories) == 1:
    return tff.framework.SyncExecutionContext(factories[0], compiler_fn, **transforms)
  return tff.framework.MergeableCompExecutionContext(
    async_contexts=[
      tff.framework.AsyncExecutionContext(f, compiler_fn, **transforms) for f in factories
    ],
    compiler_fn=_compile_to_mergeable_form,
    **transforms,
  )


@contextlib.contextmanager
def execution_context(
  *,
  workers: Sequence[str] = (),
  credentials_dir: Optional[str] = None,
  local_worker: str = "isolated",
  max_concurrent_computation_calls: int = -1,
) -> Iterator[None]:
  """Installs a TFF C++ execution context for the duration of the block and shuts it down on exit.

  With no `workers`, starts a local `worker_binary` (`worker_process.start_worker`, isolated
  as `local_worker` says) and stops it on exit. With `workers` (gRPC targets of running TFF
  worker services: "host:port" of `python -m tff_ens.worker`, or the "unix:PATH" address of a
  `worker_process.start_worker`), connects to them: one worker is used directly; with
  several, each computation is compiled to TFF's mergeable form and its clients are split
  across the workers. That needs computations with no aggregation depending on another
  (`tff.learning` processes are fine) and without CLIENTS-placed results. Workers on other
  hosts are reached over mutual TLS with `credentials_dir` (`tls`); plaintext only reaches a
  Unix-domain socket or a loopback address.

  On exit, normal or by exception (KeyboardInterrupt included), the previous
  context is current again, the workers' executors are released and a worker
  started here is stopped and reaped. While the block runs, our context is on
  top of the (thread-local) context stack, so the default context TFF
  installed at import is never invoked and never starts its own worker.

  Args:
    workers: Addresses of running worker services; empty to start a local one.
    credentials_dir: A `tls` credentials directory, for `workers` over TLS.
    local_worker: The local worker's isolation, one of `worker_process.ISOLATIONS`.
    max_concurrent_computation_calls: For the local worker: how many calls of
      one computation (e.g. one per client) run in parallel; nonpositive means
      no limit. On 2 cores all clients in parallel can be slower than a small
      limit, so the training code picks it. Workers given in `workers` were
      configured when they were started.

  Raises:
    worker_process.WorkerError: If a worker does not come up or is unreachable, on entry or
      when a computation finds it gone.
    tls.CredentialsError: For a network address without credentials, or bad credentials.
    ValueError: If `max_concurrent_computation_calls` is set with `workers`.
  """
  if workers and max_concurrent_computation_calls > 0:
    raise ValueError(
      "max_concurrent_computation_calls is a flag of the worker process; "
      "pass it to start_worker for workers given by address."
    )
  local = None
  channels = []
  executors = []
  try:
    if not workers:
      local = worker_process.start_worker(
        isolation=local_worker, max_concurrent_computation_calls=max_concurrent_computation_calls
      )
    process = None if local is None else local.process
    addresses = list(workers) or [local.address]
    factories = []
    for address in addresses:
      channels.append(_channel(address, None if local else credentials_dir))
      stub = tff.framework.RemoteExecutorGrpcStub(channels[-1])
      worker_process.wait_until_serving(stub, address, process)
      factories.append(_executor_factory(stub, address, process, executors))
    if not hasattr(_installed, "workers"):
      _installed.workers = []
    _installed.workers.append(
      _Worker(stub, channels[0], addresses[0], local, executors) if len(factories) == 1 else None
    )
    try:
      with tff.framework.get_context_stack().install(_context(factories)):
        yield
    finally:
      _installed.workers.pop()
  finally:
    try:
      for executor in executors:
        executor.close()  # Frees its state on the worker; never raises on RPC.
      for channel in channels:
        channel.close()
    finally:
      if local is not None:
        worker_process.stop_worker(local)


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
    self._worker = _current_worker() if isinstance(next_computation, tff.Computation) else None
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
    if self._worker is None:
      self._state, *results = state_first(self._next(self.value, *args))
      return results[0] if len(results) == 1 else tuple(results)
    parameter = self._compiled.type_signature.parameter
    clients = {len(a) for a, t in zip(args, list(parameter)[1:]) if _is_per_client(t)}
    if len(clients) > 1:
      raise ValueError(f"CLIENTS-placed arguments of different lengths: {sorted(clients)}")
    with self._worker_errors():
      self._use_executor(clients.pop() if clients else 0)
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


def state_and_metrics(output) -> tuple[Any, Any]:
  """`(state, metrics)` of an `IterativeProcess.next` or `LearningProcess.next`."""
  return tuple(state_first(output)[:2])


def state_first(output) -> tuple:
  """The results of a process's `next`, the state first."""
  if hasattr(output, "state"):  # tff.learning's LearningProcessOutput.
    return output.state, output.metrics
  return tuple(output)
