"""A TFF worker service: an isolated local worker behind one door, its TLS end.

`WorkerService` starts a worker as a local run does (`worker_process.start_worker`: in a
network namespace of its own, reached through a socket only this user can open) and, on
`host:port`, a gRPC server that forwards TFF's executor calls to it
(`tls.forwarding_server`): mutual TLS with credentials, plaintext only on a loopback host.
When the worker exits, the server stops with it, so a driver finds the worker gone within
`worker_process`'s connect timeout instead of a door that answers UNAVAILABLE, which TFF
retries forever. `python -m tff_ens.worker` runs one.
"""

import threading
from typing import Optional

import grpc
import tensorflow_federated as tff

from tff_ens.execution import tls
from tff_ens.execution import worker_process


class WorkerService:
  """A running worker service; `stop` it (or use it as a context manager).

  Attributes:
    worker: the isolated local worker behind the door.
    port: the door's TCP port.
  """

  def __init__(
    self,
    port: int,
    credentials_dir: Optional[str],
    *,
    host: Optional[str] = None,
    max_concurrent_computation_calls: int = worker_process.NO_CLIENT_LIMIT,
    log_path: Optional[str] = None,
  ):
    """Starts the worker and its door on `host` (default: every interface with TLS,
    127.0.0.1 without) and `port`.

    Raises:
      worker_process.WorkerError: if the worker does not come up (IsolationError: its
        namespace cannot be made).
      tls.CredentialsError, ValueError, OSError: as `tls.forwarding_server`.
    """
    if host is None:
      host = "127.0.0.1" if credentials_dir is None else "[::]"
    self.port = port
    self.worker = worker_process.start_worker(
      max_concurrent_computation_calls=max_concurrent_computation_calls, log_path=log_path
    )
    try:
      with grpc.insecure_channel(self.worker.address, tls.GRPC_OPTIONS) as channel:
        stub = tff.framework.RemoteExecutorGrpcStub(channel)
        worker_process.wait_until_serving(stub, self.worker.address, self.worker.process)
      self._server, self._upstream = tls.forwarding_server(
        self.worker.address, port, credentials_dir, host=host
      )
    except BaseException:
      worker_process.stop_worker(self.worker)
      raise
    threading.Thread(target=self._close_with_worker, daemon=True).start()

  def _close_with_worker(self) -> None:
    self.worker.process.wait()
    self._server.stop(grace=None)

  def wait(self) -> int:
    """Blocks until the worker exits; its exit code."""
    return self.worker.process.wait()

  def stop(self) -> None:
    """Closes the door, then stops the worker."""
    self._server.stop(grace=None)
    self._upstream.close()
    worker_process.stop_worker(self.worker)

  def __enter__(self) -> "WorkerService":
    return self

  def __exit__(self, *exc) -> None:
    self.stop()
