r"""Browser clients against LiteRT and TFF clients: round time, and one training step.

  uv run python benchmarks/browser_clients.py [--rounds=5] [--clients_per_round=10]

1. Three CLI runs of FedAvg on the FEMNIST slice, one after the other in this run, the same
   but for `--client_runtime=tff|litert|browser` (two device processes or headless Chromium
   pages): each round's time (metrics.csv's `seconds`), median over rounds 2 and on.
2. One local step of the LEAF CNN's trainable file (batch `--batch_size`), in LiteRT Python
   (`device_clients.DevicePool`, the device environment) and in LiteRT.js
   (`browser_clients.BrowserPool`, a headless page): a task of 1 + `--steps` steps less one
   of 1 step on the same data, divided by `--steps`, the best of 3 pairs, so that moving
   the data and the weights cancels out.
3. A page's upload of a result as large as the LEAF CNN's weights: the POST that
   `static/client.js` sends, its body a Blob (what it sends) or the Float32Array itself, in
   one page one after the other, the best of 3 each.

Writes the section "## Browser clients" of `--results`.
"""

import csv
import os
import statistics
import subprocess
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

from export import trainable
from export.web import client_server
from export.web import drive
import report
from tasks import femnist

# Replaces the default TFF context that importing TFF (through tasks) installs, whose
# clean-up at interpreter exit fails.
from tff_ens.execution import runtime  # noqa: F401
from tff_ens.program import browser_clients
from tff_ens.program import device_clients

SECTION = "## Browser clients (issue 65)"
RUNTIMES = ("tff", "litert", "browser")
LEARNING_RATE = 0.05

report.define_flags()
flags.DEFINE_integer("rounds", 5, "Rounds of each CLI run.")
flags.DEFINE_integer("clients_per_round", 10, "Clients a round.")
flags.DEFINE_integer("batch_size", 20, "Examples per step.")
flags.DEFINE_integer("steps", 20, "Steps timed per task.")
FLAGS = flags.FLAGS


def round_times(work: str) -> list[tuple[str, float, float, float]]:
  """(runtime, round 1 s, median round s from round 2, last test accuracy) per runtime."""
  rows = []
  for runtime_name in RUNTIMES:
    output_dir = os.path.join(work, runtime_name)
    command = report.cli_command(
      "fedavg",
      FLAGS.rounds,
      output_dir,
      f"--clients_per_round={FLAGS.clients_per_round}",
      f"--batch_size={FLAGS.batch_size}",
      f"--eval_every={FLAGS.rounds}",
      f"--checkpoint_every={FLAGS.rounds}",
      f"--client_runtime={runtime_name}",
    )
    subprocess.run(command, cwd=report.REPO_ROOT, check=True, capture_output=True)
    with open(os.path.join(output_dir, "metrics.csv")) as f:
      metrics = list(csv.DictReader(f))
    seconds = [float(r["seconds"]) for r in metrics]
    accuracy = float(metrics[-1]["test_accuracy"])
    rows.append((runtime_name, seconds[0], statistics.median(seconds[1:]), accuracy))
  return rows


def step_ms(pool, weights, x, y) -> float:
  """ms per step of `pool`: a task of 1 + --steps steps less one of 1 step, best of 3."""
  batch = FLAGS.batch_size

  def timed(steps: int) -> float:
    order = np.arange(steps * batch) % len(x)
    request = {"x": x, "y": y, "order": order, "batch_size": batch, "model": 0}
    start = time.perf_counter()
    (result,) = pool.train([weights], [request], ["timing"])
    assert result is not None
    return time.perf_counter() - start

  timed(1)  # Untimed: the first steps are the slow ones.
  return min(1000 * (timed(1 + FLAGS.steps) - timed(1)) / FLAGS.steps for _ in range(3))


def step_times(work: str) -> list[tuple[str, float]]:
  data = femnist.load_data(FLAGS.data_dir)
  x, y = data.train.concatenated()
  n = (1 + FLAGS.steps) * FLAGS.batch_size
  x, y = x[:n].astype(np.float32), y[:n].astype(np.int32)
  model = femnist.build_model("cnn", seed=0)
  weights = [w.numpy() for w in model.trainable_variables]
  rows = []
  for name, static in (("dynamic", None), ("static", FLAGS.batch_size)):
    path = os.path.join(work, f"{name}.tflite")
    with open(path, "wb") as f:
      f.write(trainable.convert_trainable(model, learning_rate=LEARNING_RATE, static_batch=static))
    pool = device_clients.DevicePool(path, 1)
    try:
      rows.append(
        (f"LiteRT Python (device environment), {name}-batch file", step_ms(pool, weights, x, y))
      )
    finally:
      pool.close()
  pool = browser_clients.BrowserPool(path, 1)
  try:
    rows.append(
      (
        "LiteRT.js 2.5.3 in headless Chromium (WASM), static-batch file",
        step_ms(pool, weights, x, y),
      )
    )
  finally:
    pool.close()
  return rows


UPLOAD_JS = """async ([id, size, kind]) => {
  const body = new Float32Array(size);
  const start = performance.now();
  const sent = kind === "Blob" ? new Blob([body]) : body;
  const response = await fetch(`tasks/${id}/result`, {method: "POST", body: sent});
  if (response.status !== 204) throw new Error(`HTTP ${response.status}`);
  return performance.now() - start;
}"""


def upload_times(path: str, size: int) -> list[tuple[str, float]]:
  """ms to POST `size` float32 values from a page, as a Blob and as the typed array."""
  server = client_server.ClientServer(path)
  try:
    with drive.browser() as chromium:
      page = chromium.new_context().new_page()
      page.goto(server.urls()[0])
      times = {"Blob": [], "Float32Array": []}
      for _ in range(3):
        for kind, measured in times.items():
          task = server.task(
            model=0,
            batch_size=1,
            weights=bytes(4 * size),
            x=b"",
            y=b"",
            order=b"",
            num_examples=0,
            num_weights=size,
          )
          measured.append(page.evaluate(UPLOAD_JS, [task.id, size, kind]))
          server.finish(task)
  finally:
    server.close()
  return [(kind, min(measured)) for kind, measured in times.items()]


def main(argv):
  started = report.start(argv)
  size = femnist.build_model("cnn", seed=0).count_params()
  with tempfile.TemporaryDirectory() as work:
    steps = step_times(work)
    uploads = upload_times(os.path.join(work, "static.tflite"), size)
    rounds = round_times(work)
  tff_median = rounds[0][2]
  litert_ms = steps[1][1]
  blob_ms = uploads[0][1]
  lines = [
    SECTION,
    "",
    f"FedAvg on the FEMNIST slice, {FLAGS.rounds} rounds of {FLAGS.clients_per_round} clients "
    f"(1 epoch, batch {FLAGS.batch_size}, learning rate 0.05, seed 0), the three runs one after "
    "the other in one benchmark run, the same but for `--client_runtime` (LiteRT and browser: "
    "two device processes or headless Chromium pages, `--device_processes=2`); round 1 "
    "(the first calls, compiling) apart.",
    "",
    *report.run_facts(started, "benchmarks/browser_clients.py"),
    "",
    "| clients | round 1 s | median round s (rounds 2+) | / TFF | test accuracy |",
    "| --- | ---: | ---: | ---: | ---: |",
    *[f"| {n} | {r1:.1f} | {m:.1f} | {m / tff_median:.2f} | {a:.4f} |" for n, r1, m, a in rounds],
    "",
    f"One step of the LEAF CNN's trainable file on {FLAGS.batch_size} FEMNIST images, one "
    f"thread: a task of {1 + FLAGS.steps} steps less one of 1 step, over {FLAGS.steps}, best of 3.",
    "",
    "| runtime | ms per step | / LiteRT Python (static) |",
    "| --- | ---: | ---: |",
    *[f"| {name} | {ms:.1f} | {ms / litert_ms:.2f} |" for name, ms in steps],
    "",
    f"A page's POST of a result of {size:,} float32 values ({4 * size / 1e6:.1f} MB, the LEAF "
    "CNN's weights) to the run's server, in one page, best of 3.",
    "",
    "| body | ms per upload | / Blob |",
    "| --- | ---: | ---: |",
    *[f"| {kind} | {ms:.0f} | {ms / blob_ms:.2f} |" for kind, ms in uploads],
  ]
  report.publish(SECTION, lines)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  app.run(main)
