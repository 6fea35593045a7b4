r"""Command line: the mutual-TLS credentials of TFF worker services and their drivers.

  python -m tff_ens.credentials --dir=DIR --hosts=10.0.0.2,10.0.0.3,worker-a.lan

Writes, in a new DIR, a certificate authority of its own (`ca.pem`; its key is not kept),
a worker certificate valid for `--hosts` and for loopback (`worker.pem`, `worker.key`) and a
driver certificate (`driver.pem`, `driver.key`), made with the `cryptography` package
(`tff_ens.execution.tls`). Copy `ca.pem` and the worker pair to each worker machine
(`python -m tff_ens.worker --credentials=DIR`) and `ca.pem` and the driver pair to the
driving one (`python -m tff_ens.main --workers=... --worker_credentials=DIR`); the keys are
readable by their owner only: keep them so (docs/security.md).
"""

import sys

from absl import app
from absl import flags

from tff_ens.execution import tls

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("dir", None, "New directory for the credentials.")
  flags.DEFINE_list(
    "hosts",
    [],
    "Names and addresses the drivers use for the workers (--workers=HOST:PORT); "
    f"{', '.join(tls.LOOPBACK_NAMES)} are always included.",
  )
  flags.mark_flag_as_required("dir")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    paths = tls.make(FLAGS.dir, FLAGS.hosts)
  except (tls.CredentialsError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  hosts = ", ".join([*FLAGS.hosts, *tls.LOOPBACK_NAMES])
  print(f"wrote {', '.join(paths)} (the worker certificate is valid for {hosts})")
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
