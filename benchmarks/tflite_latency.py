r"""Size, latency and accuracy of every TFLite export of trained runs (issues 5, 25 and 36).

  uv run python benchmarks/tflite_latency.py --cnn_run=RUN --resnet8_run=RUN \
      --binary_runs=RUN[,RUN] --ensemble_run=RUN --lstm_run=RUN --lstm_ensemble_run=RUN \
      [--work_dir=/tmp/tflite_latency] [--section="## ..."]

Exports each run in its formats with `export.convert` (the CLI's code): the LEAF CNN and
ResNet-8 as float, dynamic, int8 and qat; a binarized ResNet-8 as binary and lce; a
Fed-ensemble run as one ensemble file with float, dynamic and int8 members; Shakespeare's
LSTM as float, dynamic and int8, and its Fed-ensemble with float and dynamic members (tfmot
has no quantization-aware LSTM, and an int8 LSTM ensemble cannot keep its mixture float: the
CLI refuses both). Then evaluates
each file with `export.evaluate`, here (tflite-runtime, or LCE's interpreter for lce; the
run's Keras model(s) for the agreement) and, when the device environment is installed, in
it (LiteRT, no TensorFlow; `uv sync --locked --project device`): size, the median latency
of one image (one thread), accuracy on the test writers, and for the ensemble personalize +
predict per writer. A run flag left empty skips its variants. Writes `--section` of
`--results`.
"""

import json
import os
import subprocess
import time

from absl import app
from absl import flags

from export import convert
from export import evaluate
from export import runs
import report

_SINGLE = ("float", "dynamic", "int8", "qat")
# The (format, quantization) pairs each kind of run is exported in; the first is the size
# baseline of its row group, except that binarized ResNet-8 files compare to the float
# ResNet-8 file.
VARIANTS = {
  "cnn": tuple((f, "float") for f in _SINGLE),
  "resnet8": tuple((f, "float") for f in _SINGLE),
  "binary": (("binary", "float"), ("lce", "float")),
  "ensemble": tuple(("ensemble", q) for q in convert.QUANTIZATIONS),
  "lstm": tuple((f, "float") for f in _SINGLE[:3]),
  "lstm_ensemble": (("ensemble", "float"), ("ensemble", "dynamic")),
}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_PYTHON = os.path.join(REPO_ROOT, "device", ".venv", "bin", "python")

report.define_flags()
flags.DEFINE_string("cnn_run", None, "A LEAF CNN run (tff_ens.main --model=cnn).")
flags.DEFINE_string("resnet8_run", None, "A ResNet-8 run (--model=resnet8).")
flags.DEFINE_list("binary_runs", [], "Binarized ResNet-8 runs (--model=resnet8_binary).")
flags.DEFINE_string("ensemble_run", None, "A Fed-ensemble run (--algorithm=fedensemble).")
flags.DEFINE_string("lstm_run", None, "A Shakespeare LSTM run (--task=shakespeare).")
flags.DEFINE_string("lstm_ensemble_run", None, "A Shakespeare Fed-ensemble run.")
flags.DEFINE_string("work_dir", "/tmp/tflite_latency", "Where the .tflite files go.")
flags.DEFINE_integer("latency_repeats", 100, "Timed single-image calls per file.")
flags.DEFINE_string("section", "## TFLite export", "The RESULTS.md section written.")

FLAGS = flags.FLAGS


def data_dir_of(run: runs.Run) -> str | None:
  """--data_dir for a FEMNIST run; None (the run's own) for the others, Shakespeare's."""
  return FLAGS.data_dir if run.task_name == "femnist" else None


def evaluate_on_device(run: runs.Run, path: str) -> dict | None:
  """`export.evaluate`'s report of the file at `path` in the device environment (LiteRT),
  or None if that environment is not installed."""
  if not os.path.exists(DEVICE_PYTHON):
    return None
  output = path + ".device.json"
  data_dir = data_dir_of(run)
  subprocess.run(
    [
      DEVICE_PYTHON,
      "-m",
      "export.evaluate",
      f"--run_dir={run.run_dir}",
      f"--tflite={path}",
      *([f"--data_dir={data_dir}"] if data_dir else []),
      f"--output={output}",
      f"--latency_repeats={FLAGS.latency_repeats}",
    ],
    cwd=REPO_ROOT,
    check=True,
    capture_output=True,
  )
  with open(output) as f:
    return json.load(f)


def main(argv):
  started = report.start(argv)
  os.makedirs(FLAGS.work_dir, exist_ok=True)
  rows, float_sizes = [], {}
  variants = (
    [("cnn", FLAGS.cnn_run), ("resnet8", FLAGS.resnet8_run)]
    + [("binary", run_dir) for run_dir in FLAGS.binary_runs]
    + [("ensemble", FLAGS.ensemble_run)]
    + [("lstm", FLAGS.lstm_run), ("lstm_ensemble", FLAGS.lstm_ensemble_run)]
  )
  for i, (kind, run_dir) in enumerate(variants):
    if not run_dir:
      continue
    run = runs.load_run(run_dir)
    data = evaluate.load_data(run, data_dir_of(run))
    for output_format, quantization in VARIANTS[kind]:
      path = os.path.join(FLAGS.work_dir, f"{i}_{kind}_{output_format}_{quantization}.tflite")
      start = time.perf_counter()
      flatbuffer = convert.export_run(
        run, output_format, data_dir_of(run), quantization=quantization
      )
      seconds = time.perf_counter() - start
      with open(path, "wb") as f:
        f.write(flatbuffer)
      here = evaluate.build_report(run, path, data, latency_repeats=FLAGS.latency_repeats)
      device = evaluate_on_device(run, path) if output_format != "lce" else None
      if (output_format, quantization) == VARIANTS[kind][0]:
        float_sizes[kind] = here["size_bytes"]
      baseline = float_sizes.get("resnet8" if kind == "binary" else kind)
      config = run.config
      norm = f", {config['norm']} norm" if config["model"].startswith("resnet") else ""
      classes = ", digits" if config.get("classes") == "digits" else ""
      split = f", {config.get('partition') or 'roles'} split" if kind.startswith("lstm") else ""
      name = (
        f"{config['model']}{norm} ({config['algorithm']}, {config['rounds']} rounds"
        f"{classes}{split})"
      )
      label = output_format + (f" ({quantization})" if output_format == "ensemble" else "")
      rows.append((name, label, here, device, baseline, seconds))
      print(
        f"{kind} {label}: {here['size_bytes']:,} bytes, "
        f"{here['latency_ms_median']:.2f} ms, accuracy {here['accuracy']:.4f}"
        + (
          f", LiteRT {device['accuracy']:.4f} {device['latency_ms_median']:.2f} ms"
          if device
          else ""
        ),
        flush=True,
      )
  lines = [
    FLAGS.section,
    "",
    "Each run exported by `python -m export` (int8 and the int8 ensemble: "
    f"{convert.Options.representative_examples} calibration inputs from training clients; "
    "qat: 200 SGD steps at 0.005, batch 20, on training writers' examples) and run by "
    "`python -m export.evaluate` on the test examples of the training writers (Shakespeare: "
    "of the training roles, as the run's `--eval_samples_per_role` drew them), "
    "one thread, in two runtimes: tflite-runtime 2.14 in the main environment (LCE's "
    "interpreter for lce), with the run's Keras model(s) beside it, and LiteRT in the "
    "device environment (no TensorFlow). Latency is the median of "
    f"{FLAGS.latency_repeats} single-input calls (ensemble: `predict` with uniform alpha). "
    "Accuracy is over all test examples (uniform weights for the ensemble); Keras is the "
    "run's model(s) on the same examples; agreement is the fraction of examples where the "
    "file (tflite-runtime) and Keras predict the same class (personalized predictions for "
    "the ensemble). Personalized accuracy is the mean over writers of the ensemble "
    "personalized on each writer's training examples, in LiteRT, and in the run "
    "(Keras, `summary.json`).",
    "",
    *report.run_facts(started, "benchmarks/tflite_latency.py"),
    "",
    "| model (algorithm) | format | size bytes | size / float | latency ms (tflite-runtime "
    "/ LiteRT) | accuracy (tflite-runtime / LiteRT) | Keras accuracy | difference (points) "
    "| agreement | personalized accuracy (LiteRT / run) | export s |",
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
  ]
  for name, label, r, device, baseline, seconds in rows:
    d = device or {}
    personalized = "-"
    if r.get("personalized_accuracy") is not None:
      personalized = (
        f"{d.get('personalized_accuracy', float('nan')):.4f} / "
        f"{r['reference_personalized_accuracy']:.4f}"
      )
    ratio = f"{r['size_bytes'] / baseline:.3f}" if baseline else "-"
    lines.append(
      f"| {name} | {label} | {r['size_bytes']:,} | {ratio} | "
      f"{r['latency_ms_median']:.2f} / {d.get('latency_ms_median', float('nan')):.2f} | "
      f"{r['accuracy']:.4f} / {d.get('accuracy', float('nan')):.4f} | "
      f"{r['keras_accuracy']:.4f} | {100 * (r['accuracy'] - r['keras_accuracy']):+.2f} | "
      f"{r['agreement']:.4f} | {personalized} | {seconds:.0f} |"
    )
  report.publish(FLAGS.section, lines)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  app.run(main)
