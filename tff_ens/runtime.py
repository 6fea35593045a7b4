"""TFF execution contexts whose C++ worker processes have a bounded lifetime.

Importing `tensorflow_federated` installs `set_sync_local_cpp_execution_context()`
as the default context. We do not use it (nor its constructor
`tff.backends.native.create_sync_local_cpp_execution_context`): on the first
computation call it starts `worker_binary` with the caller's stdout/stderr (so
the child holds pytest's or a parent's pipes open) and only stops it in a
`__del__`, so the worker can outlive Python, e.g. when the parent is SIGKILLed.

Here `execution_context()` starts its own worker (or connects to running ones,
see `start_worker` and `python -m tff_ens.worker`), installs a context built
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
import ctypes
import os
import signal
import subprocess
import time
from typing import Any, Optional

import grpc
import portpicker
import tensorflow_federated as tff

# The local worker maps a ~300 MB binary and starts serving in well under a
# second; the timeout only matters when something is wrong.
_START_TIMEOUT_S = 60.0
# How long to wait for a gRPC connection to an already-running worker.
_CONNECT_TIMEOUT_S = 10.0
# Grace period between SIGINT and SIGKILL when stopping a worker.
_STOP_GRACE_S = 5.0
# As in TFF's `executor_factory.py`: allow messages up to 2 GB.
_GRPC_MAX_MESSAGE_BYTES = 2 * 1000 * 1000 * 1000
_GRPC_CHANNEL_OPTIONS = [
    ('grpc.max_message_length', _GRPC_MAX_MESSAGE_BYTES),
    ('grpc.max_receive_message_length', _GRPC_MAX_MESSAGE_BYTES),
    ('grpc.max_send_message_length', _GRPC_MAX_MESSAGE_BYTES),
]
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_libc = ctypes.CDLL(None, use_errno=True)


class _NoExecutionContext(tff.framework.SyncContext):
  """Default context outside `execution_context()`: refuses to run.

  Replaces the one TFF installs at import, which would start a
  `worker_binary` that outlives Python (see the module docstring).
  """

  def invoke(self, comp, arg):
    raise RuntimeError(
        'TFF computations run inside tff_ens.runtime.execution_context(): '
        'wrap the call in `with execution_context():`')


tff.framework.set_default_context(_NoExecutionContext())


def worker_binary_path() -> str:
  """Path of the `worker_binary` shipped in the TFF wheel (as TFF finds it)."""
  path = os.path.join(os.path.dirname(tff.__file__), 'data', 'worker_binary')
  if not os.path.isfile(path):
    raise RuntimeError(f'Expected a TFF worker binary at {path}.')
  return path


def _die_with_parent(parent_pid: int):
  """A `preexec_fn` making the child get SIGKILL when its parent dies."""

  def preexec() -> None:
    # Ignored signals stay ignored across exec, and a parent started in the
    # background by a shell ignores SIGINT: `stop_worker` needs it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
      raise OSError(ctypes.get_errno(), 'prctl(PR_SET_PDEATHSIG) failed')
    # The parent may have died between fork() and prctl(): then no signal
    # will ever come.
    if os.getppid() != parent_pid:
      os.kill(os.getpid(), signal.SIGKILL)

  return preexec


def start_worker(
    port: int,
    *,
    max_concurrent_computation_calls: int = -1,
    log_path: Optional[str] = None,
) -> subprocess.Popen:
  """Starts a TFF C++ worker service on `port` (all interfaces).

  The worker's stdout/stderr go to `log_path` (appended) or to /dev/null, never
  to the caller's pipes. It is killed when the calling *thread* exits
  (Linux `PR_SET_PDEATHSIG` follows the thread that forked), so call this from
  a thread that outlives the worker, e.g. the main thread. Stop it with
  `stop_worker`. This does not wait until the worker serves; the first
  `execution_context(workers=...)` that uses it does.

  Args:
    port: TCP port to serve on.
    max_concurrent_computation_calls: Worker flag bounding how many calls of one
      computation (e.g. one per client) run in parallel; nonpositive means no
      limit.
    log_path: Optional file for the worker's output.

  Returns:
    The worker process.
  """
  args = [
      worker_binary_path(),
      f'--port={port}',
      f'--max_concurrent_computation_calls={max_concurrent_computation_calls}',
  ]
  with contextlib.ExitStack() as stack:
    if log_path is None:
      output = subprocess.DEVNULL
    else:
      output = stack.enter_context(open(log_path, 'ab'))
    return subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=output,
        close_fds=True,
        preexec_fn=_die_with_parent(os.getpid()),
    )


def stop_worker(process: subprocess.Popen) -> None:
  """Stops a worker: SIGINT, then SIGKILL after a grace period; reaps it."""
  try:
    if process.poll() is None:
      process.send_signal(signal.SIGINT)
      process.wait(timeout=_STOP_GRACE_S)
  except subprocess.TimeoutExpired:
    pass
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()


def _wait_until_serving(
    stub: tff.framework.RemoteExecutorGrpcStub,
    address: str,
    process: Optional[subprocess.Popen],
) -> None:
  """Blocks until `stub` is connected, or raises a one-line RuntimeError.

  Polls `stub.is_ready` as TFF does. (A `grpc.channel_ready_future` would add a
  second connectivity subscription, which makes grpc's polling thread raise
  "Channel closed!" if the channel is closed soon after.)

  Args:
    stub: Stub of the worker.
    address: The worker's address, for the error message.
    process: The worker process if we started it (its exit ends the wait early
      and the timeout is the start-up one), else None.
  """
  timeout = _CONNECT_TIMEOUT_S if process is None else _START_TIMEOUT_S
  deadline = time.monotonic() + timeout
  while True:
    if process is not None and process.poll() is not None:
      raise RuntimeError(
          f'TFF worker {process.args[0]} for {address} exited with code '
          f'{process.returncode}.'
      )
    if stub.is_ready:
      return
    if time.monotonic() > deadline:
      raise RuntimeError(
          f'TFF worker at {address} is unreachable (no gRPC connection within'
          f' {timeout:g} s).'
      )
    time.sleep(0.05)


def _executor_factory(
    stub: tff.framework.RemoteExecutorGrpcStub,
    address: str,
    process: Optional[subprocess.Popen],
    executors: list[tff.framework.RemoteExecutor],
) -> tff.framework.ResourceManagingExecutorFactory:
  """Executor factory over one worker, as TFF's `local_cpp_executor_factory`."""

  def stack_fn(cardinalities):
    # TFF retries calls that fail with gRPC UNAVAILABLE forever, re-creating
    # the executor each time; checking here turns a dead worker into an error.
    _wait_until_serving(stub, address, process)
    # As TFF: computations with no CLIENTS-placed argument get 0 clients.
    cardinalities.setdefault(tff.CLIENTS, 0)
    # Not `stream_structs=True`: it moves a 132 MB state about twice as fast
    # but its value finalizers then fail ("value not found, cannot dispose").
    executor = tff.framework.RemoteExecutor(stub)
    executor.set_cardinalities(cardinalities)
    executors.append(executor)
    return executor

  return tff.framework.ResourceManagingExecutorFactory(stack_fn)


class ResidentValue:
  """A computation result kept in the TFF worker instead of moved to Python.

  Moving a value between Python and the worker costs about 0.3 s per 26 MB
  each way (gRPC and protocol buffers), so a process whose state holds K
  models would spend most of a round moving it. `call_keeping_state` keeps the
  state here between rounds; `materialize` brings it to Python when needed
  (checkpoints, evaluation).
  """

  def __init__(self, value, type_spec: tff.types.Type, executor):
    self.value = value
    self.type_spec = type_spec
    self.executor = executor


class _WorkerContext(tff.framework.SyncExecutionContext):
  """TFF's sync context over one worker, able to keep a state in the worker.

  `invoke` is TFF's. `invoke_keeping_state` and `materialize` follow
  `AsyncExecutionContext.invoke` (compile, ingest, call, compute) but leave
  element 0 of the result (the state) in the worker; TFF 0.87's contexts
  always compute the whole result, and have no API for this.
  """

  def __init__(self, factory, compiler_fn, *, transform_args,
               transform_result):
    super().__init__(factory, compiler_fn, transform_args=transform_args,
                     transform_result=transform_result)
    self._factory = factory
    self._compiler_fn = compiler_fn
    self._transform_args = transform_args
    self._transform_result = transform_result
    self._compiled = {}
    self._loop = asyncio.new_event_loop()

  def close(self):
    self._loop.close()

  def _compile(self, comp):
    if id(comp) not in self._compiled:
      self._compiled[id(comp)] = (comp, self._compiler_fn(comp))
    return self._compiled[id(comp)][1]

  def _to_python(self, value, type_spec):
    return self._transform_result(tff.types.type_to_py_container(
        value, type_spec))

  async def _state_in(self, executor, state, type_spec):
    if isinstance(state, ResidentValue):
      if state.executor is executor:
        return state.value
      # A cohort of another size runs on another executor of the worker.
      state = self._to_python(await state.value.compute(), state.type_spec)
    return await executor.create_value(self._transform_args(state), type_spec)

  async def _invoke_keeping_state(self, comp, state, args):
    parameter = comp.type_signature.parameter
    num_clients = [len(a) for a, t in zip(args, list(parameter)[1:])
                   if isinstance(t, tff.FederatedType)
                   and t.placement is tff.CLIENTS and not t.all_equal]
    executor = self._factory.create_executor(
        {tff.CLIENTS: num_clients[0] if num_clients else 0})
    compiled = self._compile(comp)
    values = [await self._state_in(executor, state, parameter[0])]
    for arg, type_spec in zip(args, list(parameter)[1:]):
      values.append(await executor.create_value(
          self._transform_args(arg), type_spec))
    call = await executor.create_call(
        await executor.create_value(compiled, compiled.type_signature),
        await executor.create_struct(values))
    new_state = await executor.create_selection(call, 0)
    metrics = await (await executor.create_selection(call, 1)).compute()
    result = comp.type_signature.result
    return (ResidentValue(new_state, result[0], executor),
            self._to_python(metrics, result[1]))

  def invoke_keeping_state(self, comp, state, args):
    return self._loop.run_until_complete(
        self._invoke_keeping_state(comp, state, args))

  def materialize(self, resident: ResidentValue):
    return self._loop.run_until_complete(self._materialize(resident))

  async def _materialize(self, resident):
    return self._to_python(await resident.value.compute(), resident.type_spec)


def call_keeping_state(comp, state, *args) -> tuple[Any, Any]:
  """`comp(state, *args)` -> (new state, metrics), the state left in the worker.

  For a process `next` returning `(state, metrics)` (an `IterativeProcess`) or
  a `LearningProcessOutput`. `state` may be a Python value or a
  `ResidentValue` from an earlier call. With one worker the new state is a
  `ResidentValue`; with several (mergeable context) it is a Python value.
  """
  context = tff.framework.get_context_stack().current
  if isinstance(context, _WorkerContext):
    return context.invoke_keeping_state(comp, state, args)
  output = comp(materialize(state), *args)
  return output[0], output[1]


def materialize(value):
  """The Python value of a `ResidentValue` (other values are returned as is)."""
  if not isinstance(value, ResidentValue):
    return value
  context = tff.framework.get_context_stack().current
  if not isinstance(context, _WorkerContext):
    raise RuntimeError(
        'a value kept in a TFF worker can only be read inside the '
        'execution_context() that made it')
  return context.materialize(value)


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
        'Computations returning CLIENTS-placed values cannot run on several '
        'workers (TFF 0.87 returns them out of client order); use one worker.'
    )
  return tff.backends.native.compile_to_mergeable_comp_form(comp)


@contextlib.contextmanager
def execution_context(
    *,
    workers: Sequence[str] = (),
    max_concurrent_computation_calls: int = -1,
) -> Iterator[None]:
  """Installs a TFF C++ execution context for the duration of the block and shuts it down on exit.

  With no `workers`, starts a local `worker_binary` (see `start_worker`) on a
  free port and stops it on exit. With `workers` ("host:port" of running TFF
  worker services, e.g. `start_worker` or `python -m tff_ens.worker`), connects
  to them: one worker is used directly; with several, each computation is
  compiled to TFF's mergeable form and its clients are split across the
  workers. That needs computations with no aggregation depending on another
  (`tff.learning` processes are fine) and without CLIENTS-placed results.

  On exit, normal or by exception (KeyboardInterrupt included), the previous
  context is current again, the workers' executors are released and a worker
  started here is stopped and reaped. While the block runs, our context is on
  top of the (thread-local) context stack, so the default context TFF
  installed at import is never invoked and never starts its own worker.

  Args:
    workers: Addresses of running worker services; empty to start a local one.
    max_concurrent_computation_calls: For the local worker: how many calls of
      one computation (e.g. one per client) run in parallel; nonpositive means
      no limit. On 2 cores all clients in parallel can be slower than a small
      limit, so the training code picks it. Workers given in `workers` were
      configured when they were started.

  Raises:
    RuntimeError: If a worker does not come up or is unreachable.
    ValueError: If `max_concurrent_computation_calls` is set with `workers`.
  """
  if workers and max_concurrent_computation_calls > 0:
    raise ValueError(
        'max_concurrent_computation_calls is a flag of the worker process; '
        'pass it to start_worker for workers given by address.'
    )
  process = None
  context = None
  channels = []
  executors = []
  try:
    if workers:
      addresses = list(workers)
    else:
      port = portpicker.pick_unused_port()
      process = start_worker(
          port,
          max_concurrent_computation_calls=max_concurrent_computation_calls,
      )
      addresses = [f'localhost:{port}']
    factories = []
    for address in addresses:
      channel = grpc.insecure_channel(address, _GRPC_CHANNEL_OPTIONS)
      channels.append(channel)
      stub = tff.framework.RemoteExecutorGrpcStub(channel)
      _wait_until_serving(stub, address, process)
      factories.append(_executor_factory(stub, address, process, executors))

    transforms = dict(
        transform_args=tff.tensorflow.transform_args,
        transform_result=tff.tensorflow.transform_result,
    )
    # The same compiler and transforms as TFF's
    # `create_sync_local_cpp_execution_context`.
    compiler_fn = tff.backends.native.desugar_and_transform_to_native
    if len(factories) == 1:
      context = _WorkerContext(factories[0], compiler_fn, **transforms)
    else:
      context = tff.framework.MergeableCompExecutionContext(
          async_contexts=[
              tff.framework.AsyncExecutionContext(f, compiler_fn, **transforms)
              for f in factories
          ],
          compiler_fn=_compile_to_mergeable_form,
          **transforms,
      )
    with tff.framework.get_context_stack().install(context):
      yield
  finally:
    if isinstance(context, _WorkerContext):
      context.close()
    try:
      for executor in executors:
        executor.close()  # Frees its state on the worker; never raises on RPC.
      for channel in channels:
        channel.close()
    finally:
      if process is not None:
        stop_worker(process)
