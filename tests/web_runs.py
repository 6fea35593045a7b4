"""One small, real FEMNIST digits run exported for the web, shared by the web tests (made
once per session by the `web_run` and `served` fixtures of tests/chromium.py).

Three small CNNs trained briefly with Keras on the slice's digit writers (a run directory as
`tff_ens.program.training` writes it, `exported_runs.write_run`), exported as the float and
int8 ensembles and the single models, each with a dynamic (or batch-1) file and a
`--static_batch` one; a few files LiteRT.js cannot run; and the outputs the device
environment's LiteRT (Python, `export.on_device`) gives for every file on the digit test
inputs, the letters (out of distribution) and a few writers' personalization.
"""

import dataclasses
import os

import larq as lq
import numpy as np
import tensorflow as tf
from tensorflow.lite.tools import flatbuffer_utils

from export import convert
from export import metadata
from tasks import femnist
from tests.exported_runs import DATA_DIR
from tests.exported_runs import run_in_device_env
from tests.exported_runs import small_femnist_model
from tests.exported_runs import write_run

ENSEMBLE_SIZE = 3
TEMPERATURE = 0.5
PERSONALIZED_WRITERS = 4
# name -> (run, --format, --quantization, --static_batch): "ensemble" is the Fed-ensemble
# run, "one" a FedAvg run of its first member.
FILES = {
  "ens_float.tflite": ("ensemble", "ensemble", "float", None),
  "ens_float_b8.tflite": ("ensemble", "ensemble", "float", 8),
  "ens_int8.tflite": ("ensemble", "ensemble", "int8", None),
  "ens_int8_b1.tflite": ("ensemble", "ensemble", "int8", 1),
  "one_float.tflite": ("one", "float", "float", None),
  "one_float_b4.tflite": ("one", "float", "float", 4),
  "one_dynamic.tflite": ("one", "dynamic", "float", None),
  "one_int8.tflite": ("one", "int8", "float", None),
  "one_int8_b1.tflite": ("one", "int8", "float", 1),
}
# The files LiteRT.js runs, and for each the file whose outputs it must equal.
WEB_FILES = {
  "ens_float_b8.tflite": "ens_float.tflite",
  "ens_int8_b1.tflite": "ens_int8.tflite",
  "one_float.tflite": "one_float.tflite",
  "one_float_b4.tflite": "one_float.tflite",
  "one_dynamic.tflite": "one_dynamic.tflite",
  "one_int8_b1.tflite": "one_int8.tflite",
}

# The files the page refuses (besides the dynamic ensemble and the int8-input model).
BAD_FILES = (
  "ens_float.tflite",
  "one_int8.tflite",
  "lce.tflite",
  "lce_as_tflite.tflite",
  "not_tff_ens.tflite",
  "truncated.tflite",
  "random.tflite",
)

# Runs in the device environment: every file's outputs on the saved inputs.
DEVICE_OUTPUTS = """
import json, sys
import numpy as np
from export import on_device
directory, names = sys.argv[1], sys.argv[2].split(",")
inputs = np.load(f"{directory}/inputs.npz")
writers = [k for k in inputs.files if k.startswith("writer_x_")]
out = {}
for name in names:
  exported = on_device.load(f"{directory}/{name}")
  for split in ("test", "ood"):
    x = inputs[f"{split}_x"]
    if isinstance(exported, on_device.Ensemble):
      for key, value in exported.predict(x).items():
        out[f"{name}/{split}/{key}"] = value
    else:
      logits = exported.logits(x).astype(np.float64)
      p = np.exp(logits - logits.max(-1, keepdims=True))
      out[f"{name}/{split}/probabilities"] = p / p.sum(-1, keepdims=True)
  if isinstance(exported, on_device.Ensemble):
    out[f"{name}/alpha"] = np.stack([
      exported.personalize(inputs[w], inputs[w.replace("_x_", "_y_")], %(temperature)r)
      for w in sorted(writers)])
np.savez(f"{directory}/device_outputs.npz", **out)
print(json.dumps({"files": len(names)}))
""" % {"temperature": TEMPERATURE}


@dataclasses.dataclass(frozen=True)
class WebRun:
  """The exported run: `directory` holds the files, `run_dir` the ensemble run."""

  directory: str
  run_dir: str
  test_x: np.ndarray
  ood_x: np.ndarray
  writers: list[tuple[np.ndarray, np.ndarray]]
  device: dict[str, np.ndarray]

  def path(self, name: str) -> str:
    return os.path.join(self.directory, name)

  def metadata(self, name: str) -> dict:
    with open(self.path(name), "rb") as f:
      return metadata.read(f.read())


def _trained_member(seed: int, x: np.ndarray, y: np.ndarray) -> tf.keras.Model:
  """A small CNN of the digits' shape after 150 SGD steps of 32 training examples."""
  tf.keras.utils.set_random_seed(seed)
  model = small_femnist_model(seed, femnist.DIGITS)
  model.compile(
    optimizer=tf.keras.optimizers.SGD(0.1),
    loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  order = np.random.default_rng(seed).permutation(len(y))[: 150 * 32]
  model.fit(x[order], y[order], batch_size=32, epochs=1, verbose=0)
  return model


def _bad_files(directory, good_flatbuffer: bytes):
  """An lce file (larq's 1-bit convolution), a TFLite file without tff-ens metadata, a
  truncated one and one of random bytes."""
  binary = tf.keras.Sequential(
    [
      tf.keras.Input(femnist.INPUT_SHAPE),
      lq.layers.QuantConv2D(
        8, 3, input_quantizer="ste_sign", kernel_quantizer="ste_sign", use_bias=False
      ),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(femnist.DIGITS.NUM_CLASSES),
    ]
  )
  run = write_run(
    directory / "binary_run", [binary], {"classes": "digits", "model": "resnet8_binary"}
  )
  lce_file = convert.export_run(run, "lce")
  with open(os.path.join(directory, "lce.tflite"), "wb") as f:
    f.write(lce_file)
  # The same file claiming the stock runtime: LiteRT.js itself must refuse its custom ops.
  model = flatbuffer_utils.convert_bytearray_to_object(bytearray(lce_file))
  metadata.add(model, {**metadata.read(lce_file), "runtime": metadata.RUNTIME_TFLITE})
  with open(os.path.join(directory, "lce_as_tflite.tflite"), "wb") as f:
    f.write(flatbuffer_utils.convert_object_to_bytearray(model))
  model = small_femnist_model(7, femnist.DIGITS)
  plain = tf.lite.TFLiteConverter.from_keras_model(model).convert()
  with open(os.path.join(directory, "not_tff_ens.tflite"), "wb") as f:
    f.write(plain)
  with open(os.path.join(directory, "truncated.tflite"), "wb") as f:
    f.write(good_flatbuffer[: len(good_flatbuffer) // 2])
  with open(os.path.join(directory, "random.tflite"), "wb") as f:
    f.write(np.random.default_rng(0).bytes(4096))


def make_web_run(directory) -> WebRun:
  """The run, its files and the device environment's outputs, in `directory`."""
  data = femnist.DIGITS.load_data(DATA_DIR)
  x, y = data.train.concatenated()
  members = [_trained_member(seed, x, y) for seed in range(ENSEMBLE_SIZE)]
  # A digits run's summary: the members' mutual information detected letters better.
  summary = {
    "personalization_temperature": TEMPERATURE,
    "ood_auroc_entropy": 0.71,
    "ood_auroc_mutual_information": 0.74,
  }
  config = {"classes": "digits"}
  runs_ = {
    "ensemble": write_run(
      directory / "ensemble_run", members, {**config, "algorithm": "fedensemble"}, summary
    ),
    "one": write_run(
      directory / "one_run",
      members[:1],
      config,
      {"ood_auroc_entropy": 0.7, "ood_auroc_mutual_information": None},
    ),
  }
  options = convert.Options(representative_examples=60)
  for name, (run, output_format, quantization, static_batch) in FILES.items():
    flatbuffer = convert.export_run(
      runs_[run],
      output_format,
      options=options,
      quantization=quantization,
      static_batch=static_batch,
    )
    (directory / name).write_bytes(flatbuffer)
  _bad_files(directory, (directory / "ens_float_b8.tflite").read_bytes())
  test_x, _ = data.test.concatenated()
  ood_x, _ = data.ood.concatenated()
  clients = [c for c in data.test.client_ids if c in data.train.x][:PERSONALIZED_WRITERS]
  writers = [(data.train.x[c], data.train.y[c]) for c in clients]
  np.savez(
    directory / "inputs.npz",
    test_x=test_x,
    ood_x=ood_x,
    **{f"writer_x_{i}": w[0] for i, w in enumerate(writers)},
    **{f"writer_y_{i}": w[1] for i, w in enumerate(writers)},
  )
  run_in_device_env(DEVICE_OUTPUTS, str(directory), ",".join(FILES))
  with np.load(directory / "device_outputs.npz") as outputs:
    device = dict(outputs)
  return WebRun(str(directory), str(directory / "ensemble_run"), test_x, ood_x, writers, device)
