r"""Command line: export a trained run to a TFLite file.

  python -m export --run_dir=RUN \
      --format=float|dynamic|int8|qat|lce|binary|trainable|ensemble \
      [--quantization=float|dynamic|int8] [--client=WRITER] [--static_batch=N] \
      --output=FILE.tflite

RUN is a `python -m tff_ens.main` output directory; `ensemble` needs a Fed-ensemble run
(`--quantization` quantizes its members), `lce` and `binary` a run of a binarized model,
`trainable` a run of a model `export.trainable` supports (the LEAF CNN); an LSTM run
(Shakespeare) exports as float, dynamic, int8 or a float or dynamic ensemble. `--client` exports
a client's own model (Ditto's personal model, LG-FedAvg's local layers under the global ones)
instead of the global one.
`int8`, `qat` and the int8 ensemble read the run's training clients (`--data_dir`, default
the run's), `--static_batch` (a file for the web, `export.web`) its test clients. See
`export.convert`.
"""

import logging as std_logging
import sys

from absl import app
from absl import flags
from absl import logging

from tff_ens.execution import cpp_log

# Before TensorFlow's import (through the modules below) starts its C++ log.
if __name__ == "__main__":
  cpp_log.quiet_unless_verbose(sys.argv)

# TensorFlow before absl parses flags (see tff_ens/main.py).
from export import ExportError
from export import convert
from export import runs
import tasks

# Replaces the default TFF context that importing TFF (through tasks) installs, whose
# clean-up at interpreter exit fails once tensorflow-datasets is imported too.
from tff_ens.execution import runtime  # noqa: F401

FLAGS = flags.FLAGS


def define_flags():
  """The command's flags, defined only when it runs: importing this module (tests, the
  benchmark) defines none, so they cannot clash with other modules' flags of one name."""
  flags.DEFINE_string("run_dir", None, "A tff_ens.main output directory (required).")
  flags.DEFINE_enum(
    "format", "float", list(convert.FORMATS), "What to export (see export/convert.py)."
  )
  flags.DEFINE_enum(
    "quantization",
    "float",
    list(convert.QUANTIZATIONS),
    "--format=ensemble: float32, dynamic-range (int8 weights) or int8 "
    "members (weights and activations; the ensemble math stays float32). "
    "Single models are quantized by --format.",
  )
  flags.DEFINE_string("output", None, "The .tflite file to write (required).")
  flags.DEFINE_string(
    "client",
    None,
    "Export this client's own model (a Ditto or LG-FedAvg run's, e.g. a FEMNIST writer id) "
    "instead of the global one.",
  )
  flags.DEFINE_string(
    "data_dir",
    None,
    "The run's task data (FEMNIST: a LEAF directory; CIFAR: the archive's directory; "
    "Shakespeare: the plays) for int8 calibration and QAT fine-tuning; defaults to the run's "
    "--data_dir.",
  )
  flags.DEFINE_integer(
    "representative_examples",
    convert.Options.representative_examples,
    "int8 and the int8 ensemble: training inputs calibrating the activation ranges.",
  )
  flags.DEFINE_integer(
    "qat_steps", convert.Options.qat_steps, "qat: SGD steps of quantization-aware fine-tuning."
  )
  flags.DEFINE_float(
    "qat_learning_rate", convert.Options.qat_learning_rate, "qat: learning rate of the fine-tuning."
  )
  flags.DEFINE_integer(
    "static_batch",
    None,
    "Every signature takes exactly this many inputs (personalize: up to it, with a mask), "
    "for runtimes that run only declared shapes: LiteRT.js, the web page of `python -m "
    "export.web`, or browser clients (trainable: `train` takes a mask of the padding). int8 "
    "keeps float32 input and output, LSTMs are unrolled, and a predicting file's metadata "
    "gets the run's 'not sure' threshold (reads the run's test data).",
  )
  flags.DEFINE_string(
    "license",
    convert.UNSET_LICENSE,
    "The terms of the exported weights, written into the file's standard TFLite metadata.",
  )
  flags.DEFINE_integer("seed", 0, "Seeds the draws of training examples.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  std_logging.getLogger("tensorflow").setLevel(std_logging.ERROR)
  logging.set_verbosity(logging.WARNING)
  options = convert.Options(
    representative_examples=FLAGS.representative_examples,
    qat_steps=FLAGS.qat_steps,
    qat_learning_rate=FLAGS.qat_learning_rate,
    seed=FLAGS.seed,
  )
  try:
    for name in ("run_dir", "output"):
      if not FLAGS[name].value:
        raise ExportError(f"--{name} is required (see --help)")
    if options.representative_examples <= 0 or options.qat_steps <= 0:
      raise ExportError("--representative_examples and --qat_steps must be positive")
    flatbuffer = convert.export_run(
      runs.load_run(FLAGS.run_dir, FLAGS.client),
      FLAGS.format,
      FLAGS.data_dir,
      options,
      FLAGS.quantization,
      FLAGS.static_batch,
      FLAGS.license,
    )
    try:
      with open(FLAGS.output, "wb") as f:
        f.write(flatbuffer)
    except OSError as e:
      raise ExportError(
        f"cannot write --output={FLAGS.output} ({e.strerror}): choose a writable path"
      ) from None
  except (ExportError, tasks.DataError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  quantized = f" --quantization={FLAGS.quantization}" if FLAGS.format == "ensemble" else ""
  static = f" --static_batch={FLAGS.static_batch}" if FLAGS.static_batch else ""
  print(
    f"wrote {FLAGS.output} ({len(flatbuffer):,} bytes, --format={FLAGS.format}{quantized}{static})"
  )
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
