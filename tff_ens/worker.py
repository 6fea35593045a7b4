r"""Command line: a TFF worker service that `--workers` runs computations on.

  python -m tff_ens.worker --port=8000 [--max_concurrent_clients=N]

Runs the `worker_binary` shipped in the TFF wheel (`worker_process.start_worker`) in
the foreground, prints one line once it serves, and stops it on SIGINT or
SIGTERM (it is also killed if this process dies). The worker needs no data:
the driver (`python -m tff_ens.main --workers=host:8000,...`) sends each
computation and its clients' datasets over gRPC, unencrypted and
unauthenticated, so serve on a private network only.
"""

import os
import signal
import socket
import sys
import time

# Before gRPC is imported: as in tff_ens/main.py, no gRPC fork handlers.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from absl import app
from absl import flags
import grpc
import portpicker

# Installs tff_ens.execution.runtime's default context in place of TFF's, whose teardown at exit
# prints an AttributeError.
from tff_ens.execution import runtime  # noqa: F401
from tff_ens.execution import worker_process

FLAGS = flags.FLAGS

# The worker maps a ~300 MB binary; it serves well within this.
_START_TIMEOUT_S = 60.0


def define_flags():
  """The worker's flags, defined only when it runs as a program.

  `tff_ens.main` defines a `--max_concurrent_clients` of its own; both
  modules import in one process (tests/test_imports.py).
  """
  flags.DEFINE_integer(
    "port", None, "TCP port to serve on (all interfaces).", lower_bound=1, upper_bound=65535
  )
  flags.DEFINE_integer(
    "max_concurrent_clients",
    0,
    "Clients this worker trains at once (<= 0: no limit; see benchmarks/RESULTS.md).",
  )
  flags.DEFINE_string("log_file", None, "Append the worker's own output here (default: discard).")
  flags.mark_flag_as_required("port")


def _raise_keyboard_interrupt(signum, frame):
  del signum, frame
  raise KeyboardInterrupt


def _wait_until_serving(process, port: int, timeout_s: float) -> None:
  """Blocks until the worker on `port` accepts gRPC connections.

  Raises:
    worker_process.WorkerError: if it exits or does not serve within `timeout_s`.
  """
  with grpc.insecure_channel(f"localhost:{port}") as channel:
    ready = grpc.channel_ready_future(channel)
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        ready.result(timeout=0.1)
        return
      except grpc.FutureTimeoutError:
        pass
      if process.poll() is not None:
        raise worker_process.WorkerError(
          f"TFF worker on port {port} exited with code {process.returncode}"
        )
      if time.monotonic() > deadline:
        raise worker_process.WorkerError(
          f"TFF worker on port {port} does not serve after {timeout_s:g} s"
        )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  # SIGTERM stops the worker like Ctrl-C; both end in `stop_worker`.
  signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
  signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
  # The worker's gRPC server binds with SO_REUSEPORT: on a busy port it would
  # serve alongside the other process instead of failing.
  if portpicker.bind(FLAGS.port, socket.SOCK_STREAM, socket.IPPROTO_TCP) is None:
    print(f"error: port {FLAGS.port} is in use: choose another --port", file=sys.stderr)
    return 2
  process = worker_process.start_worker(
    FLAGS.port,
    max_concurrent_computation_calls=FLAGS.max_concurrent_clients,
    log_path=FLAGS.log_file,
  )
  try:
    _wait_until_serving(process, FLAGS.port, _START_TIMEOUT_S)
    print(
      f"TFF worker (pid {process.pid}) serving on port {FLAGS.port} of "
      f"all interfaces: pass --workers=THIS_HOST:{FLAGS.port} to "
      "python -m tff_ens.main",
      flush=True,
    )
    code = process.wait()
    print(f"error: TFF worker exited with code {code}", file=sys.stderr)
    return 1
  except worker_process.WorkerError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    return 0
  finally:
    # A second signal must not cut the stop short (it waits for the worker).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker_process.stop_worker(process)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  define_flags()
  app.run(main)
