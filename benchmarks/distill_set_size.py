r"""FedBE's round time and driver memory as the unlabeled set grows: 3,000 against 600,000.

  uv run python benchmarks/distill_set_size.py [--rounds=2] [--work_dir=/tmp/distill_set_size]

FedBE (Chen and Chao, ICLR 2021, Algorithm 1) with 5 writers of the FEMNIST slice as the
cohort, the LEAF CNN, its default 16 teachers (the average, the 5 clients, 10 Gaussian
samples) and `--distill_steps=40` of 64 images, the slice's server validation images (FedBE's
defaults otherwise). The unlabeled set is the slice's unlabeled server images tiled to
`--small` and to `--large` rows, written once to `.npy` files in `--work_dir` (outside the
repository; 1.9 GB for 600,000) and streamed from them (`server_data.ImageFile`), as a
`--server_data=FILE.npy` run reads them.

Each set runs in a process of its own (a fresh driver and TFF worker): `--rounds` rounds,
the first of which traces the step. The table gives the last round's wall seconds and its
server step's (`server_seconds`), the CPU seconds of the round (driver and worker: less
disturbed by other jobs on a shared machine), the images the teachers labelled, and the
driver's peak resident memory over the whole run (VmHWM; the TFF worker is another process);
then the ratios large/small. With `--teacher_labels=read` (the default) the teachers label
only the rows the student reads, so the ratios should stay near 1; `all` labels the whole
set each round (16 teachers over 600,000 images: minutes a round). Writes the section
"## Server step and the unlabeled set's size" of `--results`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np

import report

SECTION = "## Server step and the unlabeled set's size"

report.define_flags()
flags.DEFINE_integer("small", 3_000, "Rows of the small unlabeled set.")
flags.DEFINE_integer("large", 600_000, "Rows of the large unlabeled set.")
flags.DEFINE_integer("rounds", 2, "FedBE rounds per set (the first traces the step).")
flags.DEFINE_integer("distill_steps", 40, "Distillation steps per round.")
flags.DEFINE_integer("clients", 5, "Clients per round (the slice's first writers).")
flags.DEFINE_enum("teacher_labels", "read", ["read", "all"], "--teacher_labels of the runs.")
flags.DEFINE_string(
  "work_dir", "/tmp/distill_set_size", "Where the .npy sets are written (outside the repo)."
)
flags.DEFINE_string("measure", None, "Internal: measure one set, this .npy file, and print JSON.")

FLAGS = flags.FLAGS


def unlabeled_file(images: np.ndarray, rows: int) -> str:
  """A .npy file of `rows` images, `images` tiled, written in chunks (kept if present)."""
  path = os.path.join(FLAGS.work_dir, f"unlabeled_{rows}.npy")
  if os.path.exists(path) and np.load(path, mmap_mode="r").shape == (rows, *images.shape[1:]):
    return path
  os.makedirs(FLAGS.work_dir, exist_ok=True)
  shape = (rows, *images.shape[1:])
  out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)
  for start in range(0, rows, 50_000):
    stop = min(rows, start + 50_000)
    out[start:stop] = images[np.arange(start, stop) % len(images)]
  out.flush()
  del out
  return path


def peak_resident_bytes() -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def measure(path: str) -> dict:
  """`--rounds` FedBE rounds with the unlabeled images of `path`; what the table shows."""
  from tasks import femnist
  from tff_ens import algorithms
  from tff_ens.execution import runtime
  from tff_ens.program import simulation
  from tff_ens.server import server_data
  from tff_ens.templates import client_work

  data = femnist.load_data(FLAGS.data_dir)
  split = server_data.server_split(data, femnist, seed=0)
  unlabeled = server_data.ImageFile.npy(path)
  server = server_data.ServerData(unlabeled, split.validation_x, split.validation_y, path)
  writers = data.train.client_ids[: FLAGS.clients]
  datasets = [
    simulation.client_dataset(data.train.x[c], data.train.y[c], epochs=1, batch_size=20, seed=0)
    for c in writers
  ]
  labelled = []
  read_rows = server_data.read_rows

  def counting(x, draws, **kwargs):
    read = read_rows(x, draws, **kwargs)
    labelled.append(len(read.images))
    return read

  server_data.read_rows = counting
  rounds = []
  with runtime.execution_context():
    fedbe = algorithms.build_algorithm(
      "fedbe",
      lambda k=0: femnist.build_model("cnn", seed=k),
      simulation.batch_element_spec(femnist),
      client_work.LocalTrainingConfig(),
      server_data=server,
      clients_per_round=len(datasets),
      distill_steps=FLAGS.distill_steps,
      distill_curve_every=0,
      teacher_labels=FLAGS.teacher_labels,
      seed=0,
    )
    state = fedbe.process.initialize()
    for _ in range(FLAGS.rounds):
      start, cpu = time.perf_counter(), report.cpu_seconds()
      state, metrics, _ = fedbe.process.next(state, datasets)
      finalizer = metrics["finalizer"]
      assert int(finalizer["distilled"]) == 1
      rounds.append(
        dict(
          seconds=time.perf_counter() - start,
          cpu_seconds=report.cpu_seconds() - cpu,
          server_seconds=float(finalizer["server_seconds"]),
        )
      )
      print(f"{len(unlabeled):,} images: round {rounds[-1]}", file=sys.stderr, flush=True)
  return dict(
    images=len(unlabeled), labelled=labelled[-1], rounds=rounds, peak=peak_resident_bytes()
  )


def main(argv):
  if FLAGS.measure:
    print(json.dumps(measure(FLAGS.measure)), flush=True)
    return
  run = report.start(argv)
  from tasks import femnist
  from tff_ens.server import server_data

  data = femnist.load_data(FLAGS.data_dir)
  images = server_data.server_split(data, femnist, seed=0).unlabeled
  results = []
  for rows in (FLAGS.small, FLAGS.large):
    path = unlabeled_file(images, rows)
    child = subprocess.run(
      [sys.executable, os.path.abspath(__file__), f"--measure={path}"]
      + [a for a in sys.argv[1:] if not a.startswith("--results")],
      capture_output=True,
      text=True,
      check=False,
    )
    if child.returncode:
      raise SystemExit(f"measuring {path} failed:\n{child.stderr[-3000:]}")
    results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(results[-1], flush=True)
  small, large = results
  last = [r["rounds"][-1] for r in results]
  lines = [
    SECTION,
    "",
    f"FedBE on 5 writers of the FEMNIST slice (LEAF CNN, 16 teachers, `--distill_steps="
    f"{FLAGS.distill_steps}` of 64, `--teacher_labels={FLAGS.teacher_labels}`), its "
    "unlabeled set the slice's unlabeled server images tiled to each size and streamed from a "
    "`.npy` file; each set in a process of its own, "
    f"{FLAGS.rounds} rounds, the last one's times (the first traces the step); peak: the "
    "driver's peak resident memory over the run (VmHWM).",
    "",
    *report.run_facts(run, "benchmarks/distill_set_size.py"),
    "",
    "| unlabeled images | labelled a round | round s | server step s | round CPU s "
    "| driver peak MB |",
    "| ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for result, timing in zip(results, last):
    lines.append(
      f"| {result['images']:,} | {result['labelled']:,} | {timing['seconds']:.1f} | "
      f"{timing['server_seconds']:.1f} | {timing['cpu_seconds']:.1f} | "
      f"{result['peak'] / 2**20:,.0f} |"
    )
  lines.append(
    f"| ratio | {large['labelled'] / small['labelled']:.2f} | "
    f"{last[1]['seconds'] / last[0]['seconds']:.2f} | "
    f"{last[1]['server_seconds'] / last[0]['server_seconds']:.2f} | "
    f"{last[1]['cpu_seconds'] / last[0]['cpu_seconds']:.2f} | "
    f"{large['peak'] / small['peak']:.2f} |"
  )
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
