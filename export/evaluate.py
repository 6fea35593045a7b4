r"""Command line: run an exported file on a run's test clients in a standalone TFLite runtime.

  python -m export.evaluate --run_dir=RUN --tflite=FILE.tflite --data_dir=DATA \
      --output=tflite_report.json

The file runs in LiteRT in the device environment (`uv run --project device python -m
export.evaluate ...`: no TensorFlow), in tflite-runtime in the main one, and in LCE's
interpreter for `lce` files (`on_device`), never in TensorFlow's. For every test client (a
FEMNIST writer, a Shakespeare role or iid client) that has training data (the run's test
split): a single model predicts the client's test inputs; an ensemble first `personalize`s
on the client's training examples (the run's temperature), then `predict`s its test
inputs with that alpha, and with the uniform alpha, at most `--chunk_size` examples per
signature call (`on_device.Ensemble`). Where TensorFlow is installed (the main
environment), the run's Keras model(s) make the same predictions (`reference`) for the
keras_* keys and `agreement`; the device environment reads the data itself, NumPy only
(FEMNIST's LEAF files, `leaf`; Shakespeare's plays split as the run's, `plays`), and leaves
those keys out. The report's keys:

- size_bytes, runtime, latency_ms_median (one input, `--num_threads`, this CPU);
- accuracy (all test examples; uniform for ensembles) and per_client_accuracy (mean over
  clients); personalized_accuracy (ensembles: mean over clients, as the run's summary);
- reference_accuracy, reference_per_client_accuracy, reference_personalized_accuracy: the
  run's summary.json; keras_accuracy, keras_personalized_accuracy: recomputed here;
- agreement: fraction of test examples on which the file and Keras predict the same class
  (personalized predictions for ensembles; uniform_agreement for the uniform ones);
- for a task with out-of-distribution inputs (`--classes=digits`): ood_auroc_entropy and
  ood_auroc_mutual_information (ensembles) of the file's outputs, keras_ood_auroc_* of the
  Keras model(s) and reference_ood_auroc_* from the run's summary.
"""

import importlib
import importlib.util
import json
import logging as std_logging
import os
import sys

from absl import app
from absl import flags
from absl import logging

from tff_ens.execution import cpp_log

# Before TensorFlow's import (through the modules below) starts its C++ log.
if __name__ == "__main__":
  cpp_log.quiet_unless_verbose(sys.argv)
import numpy as np
import scipy.special

from export import ExportError
from export import on_device
from export import runs
from tasks import leaf
from tasks import plays
from tasks.data import DataError
from tff_ens.math import ensemble_math
from tff_ens.math import metrics
from tff_ens.math import personalization

# The Keras comparison needs TensorFlow: the main environment has it, the device one not.
reference = (
  importlib.import_module("export.reference") if importlib.util.find_spec("tensorflow") else None
)

FLAGS = flags.FLAGS


def _mean_accuracy(predicted: dict, labels: dict) -> tuple[float, float]:
  """(accuracy over all examples, mean per-client accuracy) of client -> classes."""
  hits = [predicted[c] == labels[c] for c in predicted]
  return float(np.concatenate(hits).mean()), float(np.mean([h.mean() for h in hits]))


def _agreement(a: dict, b: dict) -> float:
  return float(np.concatenate([a[c] == b[c] for c in a]).mean())


def evaluate_classifier(exported: on_device.Classifier, models, data, latency_repeats: int) -> dict:
  """The file's accuracies and latency; with Keras `models`, theirs and the agreement."""
  test = data.test
  x, _ = test.concatenated()
  counts = [test.num_examples(c) for c in test.client_ids]
  tflite = dict(zip(test.client_ids, metrics.split_by_client(exported.predict_classes(x), counts)))
  accuracy, per_client = _mean_accuracy(tflite, test.y)
  report = {
    "accuracy": accuracy,
    "per_client_accuracy": per_client,
    "latency_ms_median": on_device.latency_ms(lambda: exported.logits(x[:1]), latency_repeats),
  }
  if models is not None:
    keras = reference.classes(models, test)
    report.update(
      keras_accuracy=_mean_accuracy(keras, test.y)[0], agreement=_agreement(tflite, keras)
    )
  return report


def evaluate_ensemble(
  exported: on_device.Ensemble,
  models,
  data,
  latency_repeats: int,
  chunk_size: int,
  personalization_samples: int,
  seed: int,
) -> dict:
  """The file's uniform and personalized accuracies and latency, `chunk_size` examples per
  signature call; each client personalizes on the run's examples of its own
  (`personalization.weighting_examples`); with Keras `models`, theirs and the agreements."""
  train = personalization.weighting_examples(data.train, personalization_samples, seed)
  test = data.test
  writers = [c for c in test.client_ids if c in train.x]
  tflite, tflite_uniform = {}, {}
  for c in writers:
    alpha = exported.personalize(train.x[c], train.y[c], chunk_size=chunk_size)
    tflite[c] = exported.predict(test.x[c], alpha, chunk_size)["probabilities"].argmax(-1)
    tflite_uniform[c] = exported.predict(test.x[c], chunk_size=chunk_size)["probabilities"].argmax(
      -1
    )
  labels = {c: test.y[c] for c in writers}
  accuracy, per_client = _mean_accuracy(tflite_uniform, labels)
  one_input = test.x[writers[0]][:1]
  report = {
    "accuracy": accuracy,
    "per_client_accuracy": per_client,
    "personalized_accuracy": _mean_accuracy(tflite, labels)[1],
    "personalization_temperature": exported.temperature,
    "latency_ms_median": on_device.latency_ms(lambda: exported.predict(one_input), latency_repeats),
  }
  if models is not None:
    keras, keras_uniform = reference.ensemble_classes(
      models, train, test, writers, exported.temperature
    )
    report.update(
      keras_accuracy=_mean_accuracy(keras_uniform, labels)[0],
      keras_personalized_accuracy=_mean_accuracy(keras, labels)[1],
      agreement=_agreement(tflite, keras),
      uniform_agreement=_agreement(tflite_uniform, keras_uniform),
    )
  return report


OOD_KEYS = ("ood_auroc_entropy", "ood_auroc_mutual_information")


def evaluate_ood(exported, models, data) -> dict:
  """OOD AUROCs of the file's uncertainty on the test inputs against the task's
  out-of-distribution ones (the ensemble's uniform `entropy` and
  `mutual_information` outputs; a single model's predictive entropy), and with Keras
  `models` theirs as the run's summary computes them (`keras_` keys)."""

  def file_predictions(x):
    if isinstance(exported, on_device.Ensemble):
      return exported.predict(x)
    probabilities = scipy.special.softmax(exported.logits(x).astype(np.float64), axis=-1)
    return {"probabilities": probabilities, "entropy": ensemble_math.entropy(probabilities)}

  predictions = {"": file_predictions}
  if models is not None:
    predictions["keras_"] = lambda x: reference.uncertainty(models, x)
  (test_x, test_y), (ood_x, _) = data.test.concatenated(), data.ood.concatenated()
  report = {}
  for prefix, predict in predictions.items():
    summary = metrics.uncertainty_summary(predict(test_x), test_y, predict(ood_x))
    report.update({prefix + k: summary[k] for k in OOD_KEYS})
  return report


def load_data(run: runs.Run, data_dir: str | None):
  """The run's data: by its task where TensorFlow is installed, else with NumPy alone:
  Shakespeare's plays split as the run's (`plays.load_data`, `runs.Run.data_options`),
  FEMNIST's LEAF files by writer."""
  if reference is not None:
    return reference.load_data(run, data_dir)
  task = run.task_name
  in_main = "evaluate it in the main environment (uv run python -m export.evaluate ...)"
  if task not in ("femnist", "shakespeare"):
    raise ExportError(
      f"{run.run_dir} is a {task} run: the device environment reads FEMNIST's LEAF files "
      f"and Shakespeare's plays only; {in_main}"
    )
  if task == "femnist" and run.config.get("partition") is not None:
    raise ExportError(
      f"{run.run_dir} split FEMNIST by --partition={run.config['partition']}: the device "
      f"environment reads FEMNIST's writers only; {in_main}"
    )
  data_dir = data_dir or run.config.get("data_dir")
  try:
    if task == "shakespeare":
      return plays.load_data(data_dir, **run.data_options(plays))
    data = leaf.load_leaf(data_dir or os.environ.get(leaf.DATA_DIR_ENV, ""))
  except DataError as e:
    raise ExportError(str(e)) from None
  return leaf.digits_only(data) if run.config.get("classes") == "digits" else data


def build_report(
  run: runs.Run,
  tflite_path: str,
  data,
  num_threads: int = 1,
  latency_repeats: int = 50,
  chunk_size: int = on_device.CHUNK_SIZE,
) -> dict:
  """The report (see the module docstring) of the file at `tflite_path` exported from `run`;
  an ensemble's signatures take `chunk_size` examples per call."""
  exported = on_device.load(tflite_path, num_threads)
  if isinstance(exported, on_device.Ensemble):
    if len(run.model_paths) != exported.ensemble_size:
      raise ExportError(
        f"{tflite_path} holds K={exported.ensemble_size} models but "
        f"{run.run_dir} has {len(run.model_paths)}: pass the run it was "
        "exported from"
      )
  elif run.is_ensemble:
    raise ExportError(
      f"{tflite_path} holds one model but {run.run_dir} is an ensemble "
      "run: pass the run it was exported from"
    )
  models = run.load_models() if reference is not None else None
  if isinstance(exported, on_device.Ensemble):
    measured = evaluate_ensemble(
      exported,
      models,
      data,
      latency_repeats,
      chunk_size,
      # A run written before the setting personalized on all of its clients' examples.
      run.config.get("personalization_samples", 0),
      run.config.get("seed", 0),
    )
  else:
    measured = evaluate_classifier(exported, models, data, latency_repeats)
  if data.ood is not None and data.ood.num_examples():
    measured.update(evaluate_ood(exported, models, data))
    measured.update({f"reference_{k}": run.summary.get(k) for k in OOD_KEYS})
  summary = run.summary
  return {
    "tflite": os.path.abspath(tflite_path),
    "run_dir": os.path.abspath(run.run_dir),
    "format": exported.metadata["format"],
    "model": exported.metadata.get("model"),
    "quantization": exported.metadata.get("quantization"),
    "size_bytes": exported.size_bytes,
    "runtime": exported.runtime,
    "num_threads": num_threads,
    "num_test_examples": data.test.num_examples(),
    "num_writers": len(data.test.client_ids),
    "reference_accuracy": summary.get("test_accuracy"),
    "reference_per_client_accuracy": summary.get("per_client_accuracy"),
    "reference_personalized_accuracy": summary.get("personalized_accuracy"),
    **measured,
  }


def define_flags():
  """The command's flags, defined only when it runs: importing this module (tests, the
  benchmark) defines none, so they cannot clash with other modules' flags of one name."""
  flags.DEFINE_string("run_dir", None, "The tff_ens.main run the file was exported from.")
  flags.DEFINE_string("tflite", None, "The .tflite file (from python -m export).")
  flags.DEFINE_string(
    "data_dir", None, "The run's data (FEMNIST: LEAF; Shakespeare: the plays); default the run's."
  )
  flags.DEFINE_string("output", "tflite_report.json", "Where the JSON report goes.")
  flags.DEFINE_integer("num_threads", 1, "Interpreter threads.")
  flags.DEFINE_integer("latency_repeats", 50, "Timed single-input calls (median over).")
  flags.DEFINE_integer(
    "chunk_size",
    on_device.CHUNK_SIZE,
    "Ensembles: examples per predict or personalize signature call (its memory grows with them).",
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  std_logging.getLogger("tensorflow").setLevel(std_logging.ERROR)
  logging.set_verbosity(logging.WARNING)
  try:
    for name in ("run_dir", "tflite"):
      if not FLAGS[name].value:
        raise ExportError(f"--{name} is required (see --help)")
    run = runs.load_run(FLAGS.run_dir)
    data = load_data(run, FLAGS.data_dir)
    report = build_report(
      run,
      FLAGS.tflite,
      data,
      FLAGS.num_threads,
      FLAGS.latency_repeats,
      FLAGS.chunk_size,
    )
    try:
      with open(FLAGS.output, "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    except OSError as e:
      raise ExportError(
        f"cannot write --output={FLAGS.output} ({e.strerror}): choose a writable path"
      ) from None
  except ExportError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  keys = (
    "accuracy",
    "reference_accuracy",
    "personalized_accuracy",
    "reference_personalized_accuracy",
    "agreement",
    "latency_ms_median",
    "size_bytes",
  )
  print(
    " ".join(f"{k}={report[k]:.4g}" for k in keys if report.get(k) is not None)
    + f" report={FLAGS.output}"
  )
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
