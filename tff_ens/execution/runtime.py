"""TFF execution contexts whose C++ worker processes have a bounded lifetime.

Importing `tensorflow_federated` installs `set_sync_local_cpp_execution_context()`
as the default context. We do not use it (nor its constructor
`tff.backends.native.create_sync_local_cpp_execution_context`): on the first
computation call it starts `worker_binary` on a port of all interfaces, without
credentials, with the caller's stdout/stderr (so the child holds pytest's or a parent's
pipes open), and only stops it in a `__del__`, so the worker can outlive Python, e.g. when
the parent is SIGKILLed. So importing this module replaces it with one that refuses to run:
the one side effect of an import here, which keeps a computation called outside a block
from opening that door.

Here `execution_context()` starts its own worker, isolated (`worker_process.start_worker`),
or connects to running ones (`python -m tff_ens.worker`, over mutual TLS), installs a
context built from public `tff.framework` pieces for the duration of a `with` block, and
stops the worker on exit. Workers are started with their output away from the
parent's pipes and with `PR_SET_PDEATHSIG=SIGKILL`, so they die with the
thread that started them even if Python is killed. `resident_state` keeps a state on the
block's worker between calls.

Note: TFF's context stack is thread-local; the context is current only in the
thread that entered the block.
"""

import asyncio
from collections.abc import Iterator, Sequence
import contextlib
import dataclasses
import subprocess
import threading
from typing import Optional

import grpc
import tensorflow_federated as tff
from tensorflow_federated.python.common_libs import async_utils
from tensorflow_federated.python.core.impl.execution_contexts import (
  mergeable_comp_execution_context as mergeable_lib,
)
from tensorflow_federated.python.core.impl.executors import cardinalities_utils

from tff_ens.execution import local_merge
from tff_ens.execution import tls
from tff_ens.execution import worker_process


@dataclasses.dataclass(frozen=True)
class InstalledWorker:
  """The one worker of the installed context, for `resident_state.ResidentState`."""

  stub: tff.framework.RemoteExecutorGrpcStub
  channel: grpc.Channel
  address: str
  local: Optional[worker_process.LocalWorker]  # None for a worker given by address.
  executors: list  # Closed when the context exits.
  clients_per_chunk: int  # Calls with more clients run in chunks (0: never).

  @property
  def process(self) -> Optional[subprocess.Popen]:
    return None if self.local is None else self.local.process


# Per thread (as TFF's context stack): the single worker of each installed
# `execution_context`, innermost last; None for a several-worker context.
_installed = threading.local()


def current_worker() -> Optional[InstalledWorker]:
  """The single worker of the innermost installed context (None outside one, or for
  several workers)."""
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


def is_per_client(type_spec: tff.types.Type) -> bool:
  return (
    isinstance(type_spec, tff.FederatedType)
    and type_spec.placement is tff.CLIENTS
    and not type_spec.all_equal
  )


def returns_per_client_values(comp) -> bool:
  """Whether `comp`'s result holds CLIENTS-placed values, which TFF 0.87's mergeable form (a
  round in chunks or on several workers) returns out of client order."""
  return tff.types.contains(comp.type_signature.result, is_per_client)


def _compile_to_mergeable_form(comp):
  """TFF's mergeable-form compiler, refusing computations with per-client results.

  TFF 0.87's `MergeableCompExecutionContext` concatenates CLIENTS-placed results
  in the order the workers finish, not in client order; refuse rather than
  return them silently permuted.
  """
  if returns_per_client_values(comp):
    raise ValueError(
      "Computations returning CLIENTS-placed values cannot run on several "
      "workers (TFF 0.87 returns them out of client order); use one worker."
    )
  return tff.backends.native.compile_to_mergeable_comp_form(comp)


def _channel(address: str, credentials_dir: Optional[str]) -> grpc.Channel:
  """A gRPC channel to a worker: plaintext to a Unix-domain socket (its permissions are the
  door); else mutual TLS with `credentials_dir`, or plaintext to a loopback address."""
  if credentials_dir is not None and not address.startswith("unix:"):
    return grpc.secure_channel(address, tls.channel_credentials(credentials_dir), tls.GRPC_OPTIONS)
  if not tls.is_local(address):
    raise tls.CredentialsError(
      f"{address} is reached over the network: pass the driver's credentials (a directory "
      f"made by `{tls.MAKE_COMMAND}`) to verify the worker and be verified by it"
    )
  return grpc.insecure_channel(address, tls.GRPC_OPTIONS)


_COMPILER = tff.backends.native.desugar_and_transform_to_native
_TRANSFORMS = dict(
  transform_args=tff.tensorflow.transform_args,
  transform_result=tff.tensorflow.transform_result,
)


def _mergeable(factories: list):
  """TFF's mergeable-form context over the workers' factories: one call per worker, each on
  a share of the clients, merged as they finish."""
  return tff.framework.MergeableCompExecutionContext(
    async_contexts=[
      tff.framework.AsyncExecutionContext(f, _COMPILER, **_TRANSFORMS) for f in factories
    ],
    compiler_fn=_compile_to_mergeable_form,
    **_TRANSFORMS,
  )


def _context(factories: list) -> tff.framework.SyncContext:
  """TFF's context over the workers' executor factories: one directly, several through the
  mergeable form, with the compiler and transforms of TFF's
  `create_sync_local_cpp_execution_context`."""
  if len(factories) == 1:
    return tff.framework.SyncExecutionContext(factories[0], _COMPILER, **_TRANSFORMS)
  return _mergeable(factories)


def clients_of(comp, arg) -> int:
  """The clients of a call: the cardinality of its CLIENTS-placed arguments (0 without)."""
  parameter = comp.type_signature.parameter
  if arg is None or parameter is None:
    return 0
  return cardinalities_utils.infer_cardinalities(arg, parameter).get(tff.CLIENTS, 0)


class _ChunkedContext(tff.framework.SyncContext):
  """A context whose calls with more clients than `clients_per_chunk` run in chunks.

  A call of n clients on W workers runs as one call (`_context`) while ceil(n / chunk) <= W;
  else as ceil(n / chunk) chunks of at most `clients_per_chunk` clients (TFF's mergeable
  form: its split of the argument, and each chunk's `up_to_merge`, `merge` and
  `after_merge`), taken by the workers one after another as they become free, each chunk's
  partial aggregate merged into the running one as it finishes (`_merged_chunks`). A worker
  then holds one chunk's client values at a time, and this process one chunk's argument
  (a `client_values.ClientValues` is made chunk by chunk) and two partial aggregates.
  Computations with CLIENTS-placed results cannot run in chunks (`_compile_to_mergeable_form`).
  """

  def __init__(self, factories: list, clients_per_chunk: int):
    self._factories = factories
    self._whole = _context(factories)
    self._clients_per_chunk = clients_per_chunk
    self._contexts = [
      tff.framework.AsyncExecutionContext(f, _COMPILER, **_TRANSFORMS) for f in factories
    ]
    self._forms = {}  # id(computation) -> (computation, its mergeable form), compiled once.
    self._runner = async_utils.AsyncThreadRunner()

  def invoke(self, comp, arg):
    chunks = -(-clients_of(comp, arg) // self._clients_per_chunk)
    if chunks <= len(self._factories):
      return self._whole.invoke(comp, arg)
    if id(comp) not in self._forms:
      form = _compile_to_mergeable_form(comp)
      self._forms[id(comp)] = (comp, form, local_merge.LocalMerge(form.merge))
    _, form, merge = self._forms[id(comp)]
    parts = mergeable_lib._split_value_into_subrounds(  # noqa: SLF001 (TFF's own split)
      arg, form.up_to_merge.type_signature.parameter, chunks
    )
    result = self._runner.run_coro_and_return_result(
      _merged_chunks(form, merge, parts, self._contexts)
    )
    return tff.tensorflow.transform_result(
      tff.types.type_to_py_container(result, form.after_merge.type_signature.result)
    )


async def _merged_chunks(form, merge, parts: list, contexts: list):
  """`form.after_merge` of the first chunk's argument and the merge of every chunk's
  `up_to_merge`: each chunk on the next free context, its partial aggregate merged into the
  running one here (`merge`, a `local_merge.LocalMerge` of `form.merge`) as soon as it
  finishes, none kept once merged (TFF 0.87's pool keeps every finished chunk's until the
  call ends: the cohort's worth of partial aggregates)."""
  remaining = iter(parts)
  running = {}

  def start(context) -> None:
    for part in remaining:
      running[asyncio.ensure_future(context.invoke(form.up_to_merge, part))] = context
      return

  for context in contexts:
    start(context)
  merged, context = None, contexts[0]
  while running:
    done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
    for task in done:
      context = running.pop(task)
      partial = task.result()
      if merged is None:
        merged = partial
      else:
        merged = merge(merged, partial)
      del partial
      start(context)
    del done
  return await context.invoke(form.after_merge, tff.structure.Struct.unnamed(parts[0], merged))


def _connect(addresses, credentials_dir, local, channels: list, executors: list):
  """The stubs and executor factories of the workers at `addresses`, each awaited until it
  serves; their channels are appended to `channels` (closed by the caller)."""
  process = None if local is None else local.process
  stubs, factories = [], []
  for address in addresses:
    channels.append(_channel(address, credentials_dir))
    stubs.append(tff.framework.RemoteExecutorGrpcStub(channels[-1]))
    worker_process.wait_until_serving(stubs[-1], address, process)
    factories.append(_executor_factory(stubs[-1], address, process, executors))
  return stubs, factories


@contextlib.contextmanager
def execution_context(
  *,
  workers: Sequence[str] = (),
  credentials_dir: Optional[str] = None,
  local_worker: str = "isolated",
  max_concurrent_computation_calls: int = -1,
  clients_per_chunk: int = 0,
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
    clients_per_chunk: Calls with more clients than this (and than this many per worker)
      run in chunks of at most this many, merged as they finish (`_ChunkedContext`), so
      that a worker holds one chunk's client values at a time; 0: every call whole.

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
    addresses = list(workers) or [local.address]
    stubs, factories = _connect(addresses, credentials_dir, local, channels, executors)
    with _installed_context(
      stubs, channels, addresses, local, executors, factories, clients_per_chunk
    ):
      yield
  finally:
    try:
      for executor in executors:
        executor.close()  # Frees its state on the worker; never raises on RPC.
      for channel in channels:
        channel.close()
    finally:
      if local is not None:
        worker_process.stop_worker(local)


@contextlib.contextmanager
def _installed_context(stubs, channels, addresses, local, executors, factories, chunk: int):
  """`execution_context`'s context over the connected workers, on top of the context stack
  (and its single worker recorded for `current_worker`) while the block runs."""
  if not hasattr(_installed, "workers"):
    _installed.workers = []
  _installed.workers.append(
    InstalledWorker(stubs[0], channels[0], addresses[0], local, executors, chunk)
    if len(factories) == 1
    else None
  )
  context = _ChunkedContext(factories, chunk) if chunk else _context(factories)
  try:
    with tff.framework.get_context_stack().install(_ProgramContext(context)):
      yield
  finally:
    _installed.workers.pop()


class _ProgramContext(tff.program.FederatedContext):
  """An installed context as TFF's federated programs require one
  (`tff.learning.programs.train_model` checks for a `tff.program.FederatedContext`): its
  results are concrete values, which a program's `materialize_value` keeps as they are."""

  def __init__(self, context: tff.framework.SyncContext):
    self._context = context

  def invoke(self, comp, arg):
    return self._context.invoke(comp, arg)
