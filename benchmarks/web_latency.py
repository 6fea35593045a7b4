r"""The page's speed: a prediction in the browser (LiteRT.js, WASM) against LiteRT Python.

  uv run python benchmarks/web_latency.py --run_dir=RUN --tflite=FLOAT.tflite,INT8.tflite

For each `--static_batch=1` file of RUN: the page's load (navigation to `tffEns.ready`:
LiteRT.js, its WASM and the model fetched, compiled and run once) and the model's own part
of it, in headless Chromium through `python -m export.web`; the median ms of one
drawn-image prediction (`tffEns.predict` of one FEMNIST test image, uniform alpha) over
`--repeats` calls after 5 warm-up calls, in the page and in the device environment's LiteRT
(`export.on_device`, one thread, XNNPACK), side by side in one run; and the load of the file
there.
"""

import json
import os
import subprocess
import sys

from absl import app
from absl import flags
import numpy as np

from export.web import drive
import report
from tasks import leaf

report.define_flags()
flags.DEFINE_string("run_dir", None, "The run the files were exported from.")
flags.DEFINE_list("tflite", None, "Files exported with --static_batch=1.")
flags.DEFINE_integer("repeats", 50, "Timed predictions per file and runtime.")
flags.DEFINE_string("section", "## The web page (LiteRT.js)", "The RESULTS.md section written.")
FLAGS = flags.FLAGS
DEVICE_PYTHON = os.path.join(report.REPO_ROOT, "device", ".venv", "bin", "python")

DEVICE_LATENCY = """
import json, sys, time
import numpy as np
from export import on_device
path, repeats = sys.argv[1], int(sys.argv[2])
image = np.load(sys.argv[3])
started = time.perf_counter()
exported = on_device.load(path)
load_ms = 1000 * (time.perf_counter() - started)
ms = on_device.latency_ms(lambda: exported.predict(image), repeats=repeats)
print(json.dumps({"load_ms": load_ms, "predict_ms": ms}))
"""

PAGE_LATENCY = """async ([image, repeats]) => {
  for (let i = 0; i < 5; i++) await window.tffEns.predict([image]);
  const times = [];
  for (let i = 0; i < repeats; i++) {
    const start = performance.now();
    await window.tffEns.predict([image]);
    times.push(performance.now() - start);
  }
  times.sort((a, b) => a - b);
  return times[Math.floor(times.length / 2)];
}"""


def device_latency(path: str, image_path: str) -> dict:
  result = subprocess.run(
    [DEVICE_PYTHON, "-c", DEVICE_LATENCY, path, str(FLAGS.repeats), image_path],
    cwd=report.REPO_ROOT,
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(result.stdout.strip().splitlines()[-1])


def page_latency(chromium, url: str, name: str, image: np.ndarray) -> dict:
  page = chromium.new_page(viewport={"width": 390, "height": 844})
  try:
    page.goto(f"{url}?file={name}")
    page.evaluate("window.tffEns.ready")
    ready_ms = page.evaluate("performance.now()")
    model_ms = page.evaluate("window.tffEns.loadMs")
    predict_ms = page.evaluate(PAGE_LATENCY, [image.ravel().tolist(), FLAGS.repeats])
    return {"ready_ms": ready_ms, "model_ms": model_ms, "predict_ms": predict_ms}
  finally:
    page.close()


def main(argv):
  started = report.start(argv)
  image = leaf.load_leaf(FLAGS.data_dir).test.concatenated()[0][:1]
  image_path = os.path.join(os.path.dirname(os.path.abspath(FLAGS.tflite[0])), "web_image.npy")
  np.save(image_path, image)
  served = drive.Served(FLAGS.run_dir, FLAGS.tflite)
  rows = []
  try:
    with drive.browser() as chromium:
      for path in FLAGS.tflite:
        name = os.path.basename(path)
        with open(path, "rb") as f:
          size = len(f.read())
        rows.append(
          (
            name,
            size,
            page_latency(chromium, served.url, name, image),
            device_latency(path, image_path),
          )
        )
  finally:
    served.close()
  version = json.load(open(os.path.join(report.REPO_ROOT, "export", "web", "package.json")))
  lines = [
    f"{FLAGS.section}",
    "",
    "One drawn image's prediction (`tffEns.predict`, uniform alpha) in headless Chromium "
    f"({drive.CHROMIUM}, LiteRT.js {version['dependencies']['@litertjs/core']}, WASM, one "
    "thread) against LiteRT Python (device environment, `export.on_device`, one thread), "
    f"medians of {FLAGS.repeats} calls after 5 warm-up calls, side by side in one run. Page "
    "ready: navigation to `tffEns.ready` (LiteRT.js, its WASM and the model); model: its "
    "fetch, compilation and first prediction in the page; LiteRT load: `on_device.load`.",
    "",
    *report.run_facts(started, "benchmarks/web_latency.py"),
    "",
    "| file | size bytes | browser ms / prediction | LiteRT Python ms / prediction | browser "
    "/ Python | page ready ms | model fetch, compile, first run ms | LiteRT Python load ms |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for name, size, page, device in rows:
    lines.append(
      f"| {name} | {size:,} | {page['predict_ms']:.2f} | {device['predict_ms']:.2f} | "
      f"{page['predict_ms'] / device['predict_ms']:.2f} | {page['ready_ms']:.0f} | "
      f"{page['model_ms']:.0f} | {device['load_ms']:.0f} |"
    )
  report.publish(FLAGS.section, lines)


if __name__ == "__main__":
  sys.exit(app.run(main))
