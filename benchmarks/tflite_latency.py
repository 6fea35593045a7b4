r"""Size, latency and accuracy of every TFLite export of trained runs (issue 5).

  uv run python benchmarks/tflite_latency.py --cnn_run=RUN --resnet8_run=RUN \
      --binary_runs=RUN[,RUN] --ensemble_run=RUN [--work_dir=/tmp/tflite_latency]

Exports each run in its formats with `export.convert` (the CLI's code): the LEAF CNN and
ResNet-8 as float, dynamic, int8 and qat; a binarized ResNet-8 as binary and lce; a
Fed-ensemble run as one ensemble file. Then evaluates each file with `export.evaluate`
(tflite-runtime, or LCE's interpreter for lce; one thread): size, the median latency of one
image, accuracy on the FEMNIST slice's test writers against the run's Keras model, and for
the ensemble personalize + predict per writer. A run flag left empty skips its variants.
Writes the section "## TFLite export (issue 5)" of `--results`.
"""

import os
import time

from absl import app
from absl import flags

from export import convert
from export import evaluate
from export import runs
from tasks import femnist
import report

SECTION = "## TFLite export (issue 5)"
# The formats each kind of run is exported in; the first is the size baseline of its row
# group, except that binarized ResNet-8 files compare to the float ResNet-8 file.
FORMATS = {"cnn": ("float", "dynamic", "int8", "qat"),
           "resnet8": ("float", "dynamic", "int8", "qat"),
           "binary": ("binary", "lce"),
           "ensemble": ("ensemble",)}

report.define_flags()
flags.DEFINE_string("cnn_run", None, "A LEAF CNN run (tff_ens.main --model=cnn).")
flags.DEFINE_string("resnet8_run", None, "A ResNet-8 run (--model=resnet8).")
flags.DEFINE_list("binary_runs", [], "Binarized ResNet-8 runs (--model=resnet8_binary).")
flags.DEFINE_string("ensemble_run", None, "A Fed-ensemble run (--algorithm=fedensemble).")
flags.DEFINE_string("work_dir", "/tmp/tflite_latency", "Where the .tflite files go.")
flags.DEFINE_integer("latency_repeats", 100, "Timed single-image calls per file.")

FLAGS = flags.FLAGS


def main(argv):
  run = report.start(argv)
  os.makedirs(FLAGS.work_dir, exist_ok=True)
  data = femnist.load_data(FLAGS.data_dir)
  rows, float_sizes = [], {}
  variants = ([("cnn", FLAGS.cnn_run), ("resnet8", FLAGS.resnet8_run)] +
              [("binary", run_dir) for run_dir in FLAGS.binary_runs] +
              [("ensemble", FLAGS.ensemble_run)])
  for i, (kind, run_dir) in enumerate(variants):
    if not run_dir:
      continue
    run = runs.load_run(run_dir)
    for output_format in FORMATS[kind]:
      path = os.path.join(FLAGS.work_dir, f"{i}_{kind}_{output_format}.tflite")
      start = time.perf_counter()
      flatbuffer = convert.export_run(run, output_format, FLAGS.data_dir)
      seconds = time.perf_counter() - start
      with open(path, "wb") as f:
        f.write(flatbuffer)
      result = evaluate.build_report(run, path, data,
                                     latency_repeats=FLAGS.latency_repeats)
      if output_format == "float":
        float_sizes[kind] = result["size_bytes"]
      baseline = float_sizes.get("resnet8" if kind == "binary" else kind)
      config = run.config
      norm = f", {config['norm']} norm" if config["model"].startswith("resnet") else ""
      name = f"{config['model']}{norm} ({config['algorithm']}, {config['rounds']} rounds)"
      rows.append((name, output_format, result, baseline, seconds))
      print(f"{kind} {output_format}: {result['size_bytes']:,} bytes, "
            f"{result['latency_ms_median']:.2f} ms, accuracy {result['accuracy']:.4f}",
            flush=True)
  lines = [
      SECTION, "",
      "Each run exported by `python -m export` (int8: 500 calibration images from training "
      "writers; qat: 200 SGD steps at 0.005, batch 20, on training writers' examples) and "
      "run by `python -m export.evaluate` on the 1,685 test examples of the slice's 105 "
      "writers: tflite-runtime 2.14 (XNNPACK for float ops), LCE's interpreter for lce, "
      "one thread. Latency is the median of "
      f"{FLAGS.latency_repeats} single-image calls (ensemble: `predict` with uniform alpha). "
      "Accuracy is over all test examples (uniform weights for the ensemble); Keras is the "
      "run's model(s) on the same examples; agreement is the fraction of examples where the "
      "file and Keras predict the same class (personalized predictions for the ensemble).",
      "",
      *report.run_facts(run, "benchmarks/tflite_latency.py"),
      "",
      "| model (algorithm) | format | size bytes | size / float | latency ms | accuracy | "
      "Keras accuracy | difference (points) | agreement | personalized accuracy "
      "(TFLite / run) | runtime | export s |",
      "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |",
  ]
  for name, output_format, r, baseline, seconds in rows:
    personalized = "-"
    if r.get("personalized_accuracy") is not None:
      personalized = (f"{r['personalized_accuracy']:.4f} / "
                      f"{r['reference_personalized_accuracy']:.4f}")
    ratio = f"{r['size_bytes'] / baseline:.3f}" if baseline else "-"
    lines.append(
        f"| {name} | {output_format} | {r['size_bytes']:,} | {ratio} | "
        f"{r['latency_ms_median']:.2f} | {r['accuracy']:.4f} | {r['keras_accuracy']:.4f} | "
        f"{100 * (r['accuracy'] - r['keras_accuracy']):+.2f} | {r['agreement']:.4f} | "
        f"{personalized} | {r['runtime'].split(' (')[0]} | {seconds:.0f} |")
  report.publish(SECTION, lines)


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  app.run(main)
