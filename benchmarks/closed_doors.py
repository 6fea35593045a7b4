r"""While a CLI run trains, other processes try to run a computation in its TFF worker.

  uv run python benchmarks/closed_doors.py [--rounds=6]

Runs `python -m tff_ens.main --task=femnist` (FedAvg, 5 clients a round) with
`--local_worker=open` (TFF's worker on a TCP port of all interfaces, how every run started it
before) and with `--local_worker=isolated` (the default). Once the run trains, it lists the
TCP sockets on which the run's processes listen (psutil, as `ss -ltnp`), and for each one a
separate process with no credential connects (`execution_context(workers=["localhost:PORT"])`)
and runs a `tff.tensorflow.computation` returning `tf.io.read_file` of a file only this user
can read. As root, another user (nobody) also tries to connect to the run's Unix socket.
"""

import os
import subprocess
import sys
import tempfile
import textwrap
import time

from absl import app
from absl import flags
import psutil

import report

SECTION = "## Closed doors: other processes against a run's worker"
ISOLATIONS = ("open", "isolated")
_NOBODY = 65534

report.define_flags()
flags.DEFINE_integer("rounds", 6, "Rounds of each run (the probes run during them).")
FLAGS = flags.FLAGS

_STEAL = textwrap.dedent("""
  import sys
  import tensorflow as tf
  import tensorflow_federated as tff
  from tff_ens.execution import runtime

  @tff.tensorflow.computation
  def steal():
    return tf.io.read_file(sys.argv[2])

  with runtime.execution_context(workers=[sys.argv[1]]):
    print("read:", steal())
""")


def _last_line(completed: subprocess.CompletedProcess) -> str:
  lines = (completed.stdout.strip() or completed.stderr.strip()).splitlines()
  return lines[-1] if lines else f"exit code {completed.returncode}"


def probe(isolation: str, directory: str, secret: str) -> dict:
  """Starts a run with `isolation`; what each probe found while it trained."""
  output_dir = os.path.join(directory, isolation)
  command = report.cli_command(
    "fedavg", FLAGS.rounds, output_dir, "--clients_per_round=5", f"--local_worker={isolation}"
  )
  cli = subprocess.Popen(
    command, cwd=report.REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  try:
    while not os.path.exists(os.path.join(output_dir, "metrics.csv")):  # It trains.
      if cli.poll() is not None:
        raise RuntimeError(f"the {isolation} run exited with code {cli.returncode}")
      time.sleep(0.5)
    tree = [psutil.Process(cli.pid), *psutil.Process(cli.pid).children(recursive=True)]
    pids = {p.pid for p in tree}
    listeners = [
      c.laddr
      for c in psutil.net_connections("inet")
      if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]
    stolen = []
    for address in listeners:
      completed = subprocess.run(
        [sys.executable, "-c", _STEAL, f"localhost:{address.port}", secret],
        cwd=report.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
      )
      stolen.append(f"{address.ip}:{address.port}: {_last_line(completed)}")
    sockets = [a for p in tree for a in p.cmdline() if a.endswith("/socket")]
    other_user = []
    for path in sockets if os.geteuid() == 0 else []:
      connect = (
        f"import socket; socket.socket(socket.AF_UNIX).connect({path!r}); print('connected')"
      )
      completed = subprocess.run(
        [
          "setpriv",
          f"--reuid={_NOBODY}",
          f"--regid={_NOBODY}",
          "--clear-groups",
          sys.executable,
          "-I",
          "-S",
          "-c",
          connect,
        ],
        capture_output=True,
        text=True,
        timeout=60,
      )
      other_user.append(_last_line(completed))
  finally:
    cli.wait()
  return dict(
    listeners=listeners, stolen=stolen, sockets=sockets, other_user=other_user, code=cli.returncode
  )


def main(argv):
  run = report.start(argv)
  found = {}
  with tempfile.TemporaryDirectory() as directory:
    secret = os.path.join(directory, "secret.txt")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
      f.write("only this user reads this")
    for isolation in ISOLATIONS:
      found[isolation] = probe(isolation, directory, secret)
      print(isolation, found[isolation], flush=True)
  lines = [
    SECTION,
    "",
    f"`python -m tff_ens.main --task=femnist --rounds={FLAGS.rounds} --clients_per_round=5` "
    "(FedAvg) with each `--local_worker`; while it trains, the TCP sockets on which the run's "
    "processes listen (psutil, as `ss -ltnp`); at each, a separate process with no credential "
    '(`execution_context(workers=["localhost:PORT"])`) runs `tf.io.read_file` of a file '
    "only this user can read (mode 0600); as root, the user nobody connects to the run's "
    "Unix socket.",
    "",
    *report.run_facts(run, "benchmarks/closed_doors.py"),
    "",
    "| `--local_worker` | the run's TCP listeners | a process with no credential, at each | "
    "the run's Unix sockets | another user at each | the run's exit code |",
    "| --- | --- | --- | --- | --- | ---: |",
  ]
  for isolation, f in found.items():
    listeners = ", ".join(f"`{a.ip}:{a.port}`" for a in f["listeners"]) or "none"
    lines.append(
      f"| {isolation} | {listeners} | {'; '.join(f['stolen']) or '(nothing to try)'} | "
      f"{', '.join(f'`{s}`' for s in f['sockets']) or 'none'} | "
      f"{'; '.join(f['other_user']) or '-'} | {f['code']} |"
    )
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
