r"""Command line: a TFF worker service that `--workers` runs computations on.

  python -m tff_ens.worker --port=8000 --credentials=DIR [--max_concurrent_clients=N]
  python -m tff_ens.worker --port=8000 --insecure_loopback   # one machine, plaintext

Runs the `worker_binary` shipped in the TFF wheel isolated as a local run's is
(`worker_process.start_worker`: a network namespace of its own, reached through a socket
only this user can open), and in front of it the service's one door, `tls.serve` on
`--port`: mutual TLS, serving only drivers whose certificate the CA of `--credentials`
signed (`python -m tff_ens.credentials` makes them), over which the driver sends each
computation and its clients' data. With `--insecure_loopback` instead, plaintext on
127.0.0.1 only, for tests on one machine. Prints one line once it serves, and stops on
SIGINT or SIGTERM (the worker is also killed if this process dies).
"""

import os
import signal
import sys

from tff_ens.execution import cpp_log

cpp_log.quiet_unless_verbose(sys.argv)
# Before gRPC is imported: as in tff_ens/main.py, no gRPC fork handlers.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from absl import app
from absl import flags

# Installs tff_ens.execution.runtime's default context in place of TFF's, whose teardown at exit
# prints an AttributeError.
from tff_ens.execution import runtime  # noqa: F401
from tff_ens.execution import tls
from tff_ens.execution import worker_process
from tff_ens.execution import worker_service

FLAGS = flags.FLAGS


def define_flags():
  """The worker's flags, defined only when it runs as a program.

  `tff_ens.main` defines a `--max_concurrent_clients` of its own; both
  modules import in one process (tests/test_imports.py).
  """
  flags.DEFINE_integer(
    "port", None, "TCP port to serve on (all interfaces).", lower_bound=1, upper_bound=65535
  )
  flags.DEFINE_string(
    "credentials",
    None,
    f"Directory with ca.pem, worker.pem and worker.key (`{tls.MAKE_COMMAND}`): serve mutual "
    "TLS to drivers whose certificate that CA signed.",
  )
  flags.DEFINE_bool(
    "insecure_loopback",
    False,
    "Serve without TLS or credentials, on 127.0.0.1 only (every local user can then run "
    "code in the worker): for tests on one machine.",
  )
  flags.DEFINE_integer(
    "max_concurrent_clients",
    worker_process.NO_CLIENT_LIMIT,
    "Clients this worker trains at once (<= 0: no limit; see benchmarks/RESULTS.md).",
  )
  flags.DEFINE_string("log_file", None, "Append the worker's own output here (default: discard).")
  flags.mark_flag_as_required("port")


def _raise_keyboard_interrupt(signum, frame):
  del signum, frame
  raise KeyboardInterrupt


def _door() -> tuple[str | None, str]:
  """The credentials directory (None: plaintext on 127.0.0.1) and how drivers connect.

  Raises:
    ValueError: one line, for neither or both of --credentials and --insecure_loopback, or
      bad credentials (`tls.CredentialsError`).
  """
  if FLAGS.credentials and FLAGS.insecure_loopback:
    raise ValueError("--credentials and --insecure_loopback exclude each other: pass one")
  if FLAGS.insecure_loopback:
    return None, f"--workers=127.0.0.1:{FLAGS.port}"
  if not FLAGS.credentials:
    raise ValueError(
      "a worker service serves only drivers it can verify: pass --credentials=DIR (made by "
      f"`{tls.MAKE_COMMAND}`), or --insecure_loopback for plaintext on 127.0.0.1 only"
    )
  try:
    tls.server_credentials(FLAGS.credentials)  # One line now for bad files.
  except tls.CredentialsError as e:
    raise ValueError(f"--credentials={FLAGS.credentials}: {e}") from None
  return (
    FLAGS.credentials,
    f"--workers=THIS_HOST:{FLAGS.port} --worker_credentials=DIR_WITH_THE_DRIVER_FILES",
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    credentials_dir, connect = _door()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  # SIGTERM stops the worker like Ctrl-C; both end in `stop`.
  signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
  signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
  service = None
  try:
    service = worker_service.WorkerService(
      FLAGS.port,
      credentials_dir,
      max_concurrent_computation_calls=FLAGS.max_concurrent_clients,
      log_path=FLAGS.log_file,
    )
    how = "plaintext on 127.0.0.1" if credentials_dir is None else "all interfaces, mutual TLS"
    print(
      f"TFF worker (pid {service.worker.pid}) serving on port {FLAGS.port} of {how}: pass "
      f"{connect} to python -m tff_ens.main",
      flush=True,
    )
    code = service.wait()
    print(f"error: TFF worker exited with code {code}", file=sys.stderr)
    return 1
  except worker_process.WorkerError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except OSError as e:  # The port is in use.
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 0
  finally:
    # A second signal must not cut the stop short (it waits for the worker).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if service is not None:
      service.stop()


if __name__ == "__main__":
  define_flags()
  app.run(main)
