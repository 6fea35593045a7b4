"""Tests of the TFLite export of Shakespeare's LSTM: int32 character ids in every format,
the files run in tflite-runtime as Keras does on windows of a real play, the metadata an app
encodes text with, the LSTM's state reset between invocations, and the device environment's
Shakespeare data.

The models have the task's layers (embedding 8, two LSTM layers, dense over 81 classes) with
16 units instead of 256, trained for a few steps on a real role so that their predictions are
not ties; the data are two plays linked from ../shared/data/shakespeare.
"""

import json
import pathlib

import numpy as np
import pytest
import scipy.special
import tensorflow as tf
from tflite_runtime import interpreter as tflite

from export import ExportError
from export import convert
from export import evaluate
from export import metadata
from export import on_device
from export import runs
from tasks import plays
from tasks import shakespeare
from tests.exported_runs import EVALUATE_AND_LIST_MODULES
from tests.exported_runs import REPO_ROOT
from tests.exported_runs import needs_device_env
from tests.exported_runs import run_in_device_env
from tests.exported_runs import write_run
from tff_ens.math import ensemble_math
from tff_ens.math import personalization

DATA_DIR = pathlib.Path(REPO_ROOT).parent / "shared" / "data" / "shakespeare"
PLAYS = ("tempest", "hamlet")
UNITS = 16
# Calibration inputs of the int8 conversions.
OPTIONS = convert.Options(representative_examples=200)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp("plays")
  for name in PLAYS:
    (directory / f"{name}_gut.txt").symlink_to(DATA_DIR / f"{name}_gut.txt")
  return str(directory)


@pytest.fixture(scope="module")
def prospero():
  """(x uint8 [n, 80], y) of the Tempest's PROSPERO, as the task makes samples."""
  text = plays.read_play(str(DATA_DIR / "tempest_gut.txt")).roles()["PROSPERO"]
  return plays.windows(plays.encode(text))


@pytest.fixture(scope="module")
def windows(prospero):
  """40 windows spread over the role (uint8, as the task stores them)."""
  x, _ = prospero
  return x[np.linspace(0, len(x) - 1, 40).astype(int)]


def small_lstm(seed: int) -> tf.keras.Model:
  """The task's model with UNITS units per LSTM layer."""
  return shakespeare.lstm(seed, units=UNITS)


def trained_lstm(seed: int, prospero) -> tf.keras.Model:
  """`small_lstm(seed)` after 30 Adam steps on PROSPERO's first 1,500 samples."""
  x, y = prospero
  tf.keras.utils.set_random_seed(seed)
  model = small_lstm(seed)
  model.compile(
    tf.keras.optimizers.Adam(0.01),
    tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  model.fit(x[:1500].astype(np.int32), y[:1500], batch_size=50, epochs=1, verbose=0)
  return model


def long_memory_lstm() -> tf.keras.Model:
  """`small_lstm(0)` with its forget gates open (bias 30): its state at the first step
  still sets its output after 80, so an LSTM state kept from the previous invocation
  would show."""
  model = small_lstm(0)
  for layer in model.layers:
    if isinstance(layer, tf.keras.layers.LSTM):
      kernel, recurrent, bias = layer.get_weights()
      bias[UNITS : 2 * UNITS] = 30.0  # Keras' gate order: input, forget, cell, output.
      layer.set_weights([kernel, recurrent, bias])
  return model


def shakespeare_run(path, models, data_dir, **config) -> runs.Run:
  return write_run(
    path,
    models,
    config={"task": "shakespeare", "model": "lstm", "data_dir": data_dir, **config},
    summary={"personalization_temperature": 0.5},
  )


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, prospero, data_dir):
  return shakespeare_run(tmp_path_factory.mktemp("single"), [trained_lstm(0, prospero)], data_dir)


@pytest.fixture(scope="module")
def float_file(single_run):
  return on_device.load_bytes(convert.export_run(single_run, "float"))


def keras_probabilities(models, x) -> np.ndarray:
  """[K, n, classes] softmax outputs of the Keras models on ids `x`."""
  return np.stack([scipy.special.softmax(m(x.astype(np.int32)).numpy(), -1) for m in models])


def test_float_file_takes_int32_ids_and_gives_keras_logits(float_file, single_run, windows):
  (model,) = single_run.load_models()
  np.testing.assert_allclose(
    float_file.logits(windows), model(windows.astype(np.int32)).numpy(), atol=1e-5
  )
  interpreter = tflite.Interpreter(model_content=float_file.flatbuffer)
  assert interpreter.get_input_details()[0]["dtype"] == np.int32
  ops = {op["op_name"] for op in interpreter._get_ops_details()}
  assert "UNIDIRECTIONAL_SEQUENCE_LSTM" in ops


def test_metadata_has_int32_ids_and_the_vocabulary(float_file):
  description = metadata.read(float_file.flatbuffer)
  assert description["task"] == "shakespeare"
  assert description["input"]["shape"] == [None, 80]
  assert description["input"]["dtype"] == "int32"
  assert description["input"]["vocabulary"] == plays.VOCABULARY
  assert description["input"]["out_of_vocabulary_id"] == plays.OOV_ID
  assert description["input"]["value_range"] == [0, plays.OOV_ID]
  assert description["class_labels"] == list(shakespeare.CLASS_LABELS)
  assert "resetVariableTensors" in description["reset_variables"]
  # An app encodes text with the metadata alone, as the task does.
  text = "Now my charms are all o'erthrown, ~"
  ids = [description["input"]["vocabulary"].find(c) for c in text[-80:]]
  ids = [description["input"]["out_of_vocabulary_id"] if i < 0 else i for i in ids]
  padding = [description["input"]["padding_id"]] * (80 - len(ids))
  np.testing.assert_array_equal(padding + ids, plays.context_ids(text))


def test_lstm_state_is_reset_between_invocations(tmp_path, data_dir, windows):
  # The fused LSTM's state tensors are TFLite variables that keep the last invocation's
  # state: without a reset, a long-memory LSTM's output depends on the previous input.
  model = long_memory_lstm()
  run = shakespeare_run(tmp_path / "run", [model], data_dir)
  exported = on_device.load_bytes(convert.export_run(run, "float"))
  forward = exported.logits(windows)
  backward = exported.logits(windows[::-1])[::-1]
  np.testing.assert_array_equal(forward, backward)
  np.testing.assert_allclose(forward, model(windows.astype(np.int32)).numpy(), atol=1e-5)
  interpreter = tflite.Interpreter(model_content=exported.flatbuffer)
  interpreter.allocate_tensors()
  (given,), (output,) = interpreter.get_input_details(), interpreter.get_output_details()
  without_reset = []
  for window in (windows[1], windows[0], windows[1]):
    interpreter.set_tensor(given["index"], window[None].astype(np.int32))
    interpreter.invoke()
    without_reset.append(interpreter.get_tensor(output["index"]))
  assert np.abs(without_reset[0] - without_reset[2]).max() > 0.1


@pytest.mark.parametrize(
  "ids, message",
  [
    (np.zeros((2, 80), np.float32), r"ids must be integer ids \[n, 80\] in 0..80 .*, got float32"),
    (np.zeros((2, 79), np.int32), r"ids must be integer ids \[n, 80\].*got int32 \[2, 79\]"),
    (np.full((1, 80), 81), r"ids must be ids in 0..80 \(80: any character outside"),
    (np.full((1, 80), -1), r"ids must be ids in 0..80 .*got -1..-1"),
    (np.zeros((0, 80), np.int32), "ids is empty: pass at least one sample"),
    ([[0] * 80], "ids must be a NumPy array of integer ids"),
  ],
)
def test_ids_are_checked(float_file, ids, message):
  with pytest.raises(ExportError, match=message) as raised:
    float_file.logits(ids)
  assert "\n" not in str(raised.value)


@pytest.mark.parametrize("output_format", ["trainable", "qat", "lce", "binary"])
def test_image_formats_refuse_lstm_runs(single_run, output_format):
  with pytest.raises(ExportError) as raised:
    convert.export_run(single_run, output_format)
  assert str(raised.value) == (
    f"--format={output_format} takes image models (float inputs), and {single_run.run_dir} "
    "is a shakespeare run of int32 ids: use --format=float, dynamic or int8"
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "output_format, max_error, min_agreement", [("dynamic", 0.01, 0.95), ("int8", 0.02, 0.95)]
)
def test_quantized_files_keep_int32_ids_and_follow_keras(
  single_run, windows, output_format, max_error, min_agreement
):
  # Quantized: the probabilities within max_error of Keras', the same class on at least
  # min_agreement of the windows; state reset as in float.
  exported = on_device.load_bytes(convert.export_run(single_run, output_format, options=OPTIONS))
  interpreter = tflite.Interpreter(model_content=exported.flatbuffer)
  assert interpreter.get_input_details()[0]["dtype"] == np.int32
  output_dtype = interpreter.get_output_details()[0]["dtype"]
  assert output_dtype == (np.int8 if output_format == "int8" else np.float32)
  assert exported.metadata["input"]["dtype"] == "int32"
  assert ("int8, dequantize" in exported.metadata["output"]) == (output_format == "int8")
  probabilities = scipy.special.softmax(exported.logits(windows), -1)
  (keras,) = keras_probabilities(single_run.load_models(), windows)
  assert np.abs(probabilities - keras).max() < max_error
  assert (probabilities.argmax(-1) == keras.argmax(-1)).mean() >= min_agreement
  np.testing.assert_array_equal(exported.logits(windows), exported.logits(windows[::-1])[::-1])


@pytest.fixture(scope="module")
def ensemble_run(tmp_path_factory, prospero, data_dir):
  return shakespeare_run(
    tmp_path_factory.mktemp("ensemble"),
    [trained_lstm(0, prospero), trained_lstm(1, prospero), long_memory_lstm()],
    data_dir,
    algorithm="fedensemble",
  )


@pytest.mark.slow
@pytest.mark.timeout_seconds(900)
@pytest.mark.parametrize("quantization, atol", [("float", 1e-5), ("dynamic", 0.01)])
def test_ensemble_signatures_take_ids_and_follow_keras(
  ensemble_run, prospero, windows, quantization, atol
):
  exported = on_device.load_bytes(
    convert.export_run(ensemble_run, "ensemble", quantization=quantization)
  )
  assert exported.metadata["input"]["dtype"] == "int32"
  assert exported.metadata["signatures"]["predict"].startswith("ids [n, 80] int32, alpha")
  assert exported.metadata["signatures"]["personalize"].startswith("ids [n, 80] int32, labels")
  assert "reset_variables" not in exported.metadata  # Unrolled: no state between calls.
  members = keras_probabilities(ensemble_run.load_models(), windows)
  alpha = np.array([0.5, 0.3, 0.2], np.float32)
  predicted = exported.predict(windows, alpha)
  np.testing.assert_allclose(
    predicted["member_probabilities"], np.moveaxis(members, 0, 1), atol=atol
  )
  np.testing.assert_allclose(
    predicted["probabilities"], ensemble_math.mixture(members, alpha), atol=atol
  )
  # In any order and batch size, the same outputs: the members keep no state.
  one_by_one = np.concatenate([exported.predict(w[None], alpha)["probabilities"] for w in windows])
  np.testing.assert_allclose(one_by_one, predicted["probabilities"], atol=1e-6)
  reversed_ = exported.predict(windows[::-1], alpha)["probabilities"][::-1]
  np.testing.assert_allclose(reversed_, predicted["probabilities"], atol=1e-6)
  x, y = prospero
  labeled = slice(2000, 2100)
  expected = personalization.personalization_weights(
    ensemble_math.member_losses(
      keras_probabilities(ensemble_run.load_models(), x[labeled]), y[labeled]
    ),
    0.5,
  )
  np.testing.assert_allclose(exported.personalize(x[labeled], y[labeled]), expected, atol=atol)
  # In chunks of 30 (the last of 10), the same alpha (`on_device.Ensemble.personalize`).
  np.testing.assert_allclose(
    exported.personalize(x[labeled], y[labeled], chunk_size=30), expected, atol=atol
  )


def test_int8_ensemble_of_lstms_is_refused(tmp_path, data_dir):
  # Measured: its personalize gave alpha = 1/K exactly where float gives (0.523, 0.477).
  run = shakespeare_run(
    tmp_path / "run", [small_lstm(0), small_lstm(1)], data_dir, algorithm="fedensemble"
  )
  with pytest.raises(ExportError) as raised:
    convert.export_run(run, "ensemble", options=OPTIONS, quantization="int8")
  assert str(raised.value).startswith("--quantization=int8 cannot keep an LSTM ensemble's")
  assert str(raised.value).endswith("use --quantization=dynamic")


def test_device_env_loads_the_runs_shakespeare_split(tmp_path, data_dir):
  # A pooled split with the task's settings changed from their defaults: the device
  # environment (no TensorFlow) reads the clients the main one does, array for array.
  config = {
    "partition": "iid",
    "num_clients": 4,
    "seed": 3,
    "min_role_characters": 3_000,
    "held_out_role_fraction": 0.25,
    "eval_samples_per_role": 20,
  }
  run = shakespeare_run(tmp_path / "run", [small_lstm(0)], data_dir, **config)
  main = evaluate.load_data(run, None)
  assert main.train.client_ids == ("client_0", "client_1", "client_2", "client_3")
  device = _load_in_device_env(str(run.run_dir), tmp_path / "device.npz")
  assert device.pop("tensorflow") == "False"
  for split in ("train", "test", "new_clients"):
    arrays = getattr(main, split)
    assert device.pop(f"{split}_ids") == ",".join(arrays.client_ids)
    for c in arrays.client_ids:
      np.testing.assert_array_equal(device.pop(f"{split}/{c}/x"), arrays.x[c])
      np.testing.assert_array_equal(device.pop(f"{split}/{c}/y"), arrays.y[c])
  assert not device


def _load_in_device_env(run_dir: str, path) -> dict:
  """The device environment's `evaluate.load_data` of the run, as arrays by split."""
  run_in_device_env(f"""
import json, sys
import numpy as np
from export import evaluate, runs
data = evaluate.load_data(runs.load_run({run_dir!r}), None)
arrays = {{"tensorflow": str("tensorflow" in sys.modules)}}
for split in ("train", "test", "new_clients"):
  clients = getattr(data, split)
  arrays[f"{{split}}_ids"] = ",".join(clients.client_ids)
  for c in clients.client_ids:
    arrays[f"{{split}}/{{c}}/x"], arrays[f"{{split}}/{{c}}/y"] = clients.x[c], clients.y[c]
np.savez({str(path)!r}, **arrays)
print(json.dumps({{}}))
""")
  with np.load(path) as loaded:
    return {k: (str(v) if v.dtype.kind == "U" else v) for k, v in loaded.items()}


@needs_device_env
@pytest.mark.slow
def test_device_env_evaluates_a_shakespeare_file(tmp_path, single_run, float_file):
  # export.evaluate in the device environment gives the main environment's accuracy,
  # which the Keras reference (int32 ids) confirms.
  path = tmp_path / "model.tflite"
  path.write_bytes(float_file.flatbuffer)
  data = evaluate.load_data(single_run, None)
  main = evaluate.build_report(single_run, str(path), data, latency_repeats=1)
  assert main["agreement"] == 1.0
  assert main["keras_accuracy"] == main["accuracy"] > 1 / shakespeare.NUM_CLASSES
  report_path = tmp_path / "device_report.json"
  process = run_in_device_env(
    EVALUATE_AND_LIST_MODULES,
    f"--run_dir={single_run.run_dir}",
    f"--tflite={path}",
    f"--output={report_path}",
    "--latency_repeats=1",
  )
  assert process["status"] == 0
  assert process["modules"] == []
  device = json.loads(report_path.read_text())
  keys = ["accuracy", "per_client_accuracy", "num_test_examples", "num_writers"]
  assert {k: device[k] for k in keys} == {k: main[k] for k in keys}
