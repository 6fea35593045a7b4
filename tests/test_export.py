"""Tests of the TFLite export: conversions run in tflite-runtime, the ensemble's
signatures against the NumPy personalization math, the metadata, and the bad-input errors.

Models are small so that conversions take seconds; the end-to-end commands run on the
FEMNIST slice at ../shared/data/femnist.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.lite.python import schema_py_generated as schema
from tensorflow.lite.tools import flatbuffer_utils

from export import ExportError
from export import convert
from export import device_training
from export import ensemble_module
from export import evaluate
from export import metadata
from export import on_device
from export import runs
import tasks
from tasks import femnist
from tests.exported_runs import DATA_DIR
from tests.exported_runs import REPO_ROOT
from tests.exported_runs import small_femnist_model
from tests.exported_runs import write_run
from tff_ens.math import ensemble_math
from tff_ens.math import evaluation
from tff_ens.math import metrics
from tff_ens.math import personalization
import tiny

K = 3


def images(n, seed=0):
  return np.random.default_rng(seed).random((n, *femnist.INPUT_SHAPE), dtype=np.float32)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
  return write_run(
    tmp_path_factory.mktemp("single"), [small_femnist_model(0)], summary={"test_accuracy": 0.5}
  )


@pytest.fixture(scope="module")
def ensemble_run(tmp_path_factory):
  return write_run(
    tmp_path_factory.mktemp("ensemble"),
    [small_femnist_model(k) for k in range(K)],
    config={"algorithm": "fedensemble"},
    summary={"personalization_temperature": 0.5},
  )


@pytest.fixture(scope="module")
def ensemble(ensemble_run):
  return on_device.load_bytes(convert.export_run(ensemble_run, "ensemble"))


def test_cifar_runs_export_as_their_task_describes(tmp_path):
  # A CIFAR-10-shaped run: its input and labels come from the task, and both the single-model
  # and the ensemble file run in tflite-runtime as the Keras models do.
  cifar10 = tasks.get_task("cifar10")
  low, high = cifar10.INPUT_DESCRIPTION["value_range"]
  x = np.random.default_rng(0).uniform(low / 2, high / 2, (4, *cifar10.INPUT_SHAPE))
  x = x.astype(np.float32)
  config = {"task": "cifar10", "data_dir": None}
  single = write_run(tmp_path / "one", [small_femnist_model(0, cifar10)], config=config)
  exported = on_device.load_bytes(convert.export_run(single, "float"))
  description = exported.metadata
  assert description["input"]["shape"] == [None, 32, 32, 3]
  assert description["class_labels"] == list(cifar10.CLASS_LABELS)
  assert description["input"]["background"] is None
  assert "(x - mean) / std" in description["input"]["preprocessing"]
  low, high = description["input"]["value_range"]
  assert low < -1.5 and high > 1.5  # Standardized, not [0, 1].
  np.testing.assert_allclose(
    exported.logits(x), single.load_models()[0](x, training=False), atol=1e-5
  )
  members = [small_femnist_model(k, cifar10) for k in range(2)]
  ensemble = on_device.load_bytes(
    convert.export_run(write_run(tmp_path / "two", members, config=config), "ensemble")
  )
  assert "image [n, 32, 32, 3] float32" in ensemble.metadata["signatures"]["predict"]
  probabilities = np.stack([tf.nn.softmax(m(x, training=False)) for m in members])
  np.testing.assert_allclose(ensemble.predict(x)["probabilities"], probabilities.mean(0), atol=1e-6)


# The one-file ensemble in tflite-runtime ----------------------------------------------


def test_ensemble_file_has_two_signatures_and_metadata(ensemble):
  assert ensemble.runtime.startswith("tflite_runtime")
  assert ensemble.ensemble_size == K and ensemble.temperature == 0.5
  assert "".join(ensemble.class_labels) == femnist.CLASS_LABELS
  description = ensemble.metadata
  assert set(description["signatures"]) == {"predict", "personalize"}
  assert description["input"]["shape"] == [None, 28, 28, 1]
  assert description["input"]["background"] == 1.0


def test_ensemble_predict_matches_keras(ensemble, ensemble_run):
  x = images(5)
  members = np.stack(
    [evaluation.predict_probabilities(m, x) for m in ensemble_run.load_models()]
  )  # [K, n, classes]
  alpha = np.array([0.2, 0.3, 0.5], np.float32)
  out = ensemble.predict(x, alpha)
  expected = metrics.ensemble_uncertainty(members, alpha)
  np.testing.assert_allclose(out["member_probabilities"], np.moveaxis(members, 0, 1), atol=1e-6)
  np.testing.assert_allclose(out["probabilities"], expected["probabilities"], atol=1e-6)
  np.testing.assert_allclose(out["entropy"], expected["entropy"], atol=1e-5)
  np.testing.assert_allclose(out["mutual_information"], expected["mutual_information"], atol=1e-5)
  uniform = ensemble.predict(x)
  np.testing.assert_allclose(uniform["probabilities"], members.mean(0), atol=1e-6)


def test_ensemble_personalize_matches_numpy(ensemble, ensemble_run):
  x, y = images(7, seed=1), np.array([0, 5, 61, 3, 3, 10, 0])
  members = np.stack([evaluation.predict_probabilities(m, x) for m in ensemble_run.load_models()])
  losses = ensemble_math.member_losses(members, y)
  for temperature in (0.5, 0.05, np.inf):
    np.testing.assert_allclose(
      ensemble.personalize(x, y, temperature),
      personalization.personalization_weights(losses, temperature),
      atol=1e-5,
    )
  np.testing.assert_allclose(ensemble.personalize(x, y), ensemble.personalize(x, y, 0.5))


@pytest.mark.parametrize("chunk_size", [1, 5, 23, 256])
def test_chunked_personalize_equals_one_signature_call(ensemble, chunk_size):
  # 23 examples in chunks of 5: four full chunks and a last one of 3.
  x = images(23, seed=2)
  y = np.random.default_rng(2).integers(0, 62, 23).astype(np.int32)
  signature = on_device.tflite.Interpreter(model_content=ensemble.flatbuffer).get_signature_runner(
    "personalize"
  )
  for temperature in (0.5, 0.05, np.inf):
    one_call = signature(images=x, labels=y, temperature=np.float32(temperature))["alpha"]
    assert one_call.std() > 0 or temperature == np.inf
    # Within the one call's float32 rounding of -loss / temperature (measured: 6e-6 at 0.05).
    np.testing.assert_allclose(
      ensemble.personalize(x, y, temperature, chunk_size=chunk_size), one_call, rtol=2e-5
    )


@pytest.mark.parametrize("chunk_size", [1, 5, 23])
def test_chunked_predict_equals_one_signature_call(ensemble, chunk_size):
  x = images(23, seed=3)
  alpha = np.random.default_rng(3).dirichlet(np.ones(K)).astype(np.float32)
  signature = on_device.tflite.Interpreter(model_content=ensemble.flatbuffer).get_signature_runner(
    "predict"
  )
  one_call = signature(image=x, alpha=alpha)
  chunked = ensemble.predict(x, alpha, chunk_size=chunk_size)
  assert set(chunked) == set(one_call)
  for key, expected in one_call.items():
    # Each input's outputs are its own, to float32 rounding: a batch's kernels block it
    # differently (measured: 1e-6 on a mutual information of 0.03).
    np.testing.assert_allclose(chunked[key], expected, rtol=1e-5, atol=1e-5)


def test_personalize_rejects_a_chunk_size_below_one(ensemble):
  with pytest.raises(ExportError, match="chunk_size must be a positive integer of examples"):
    ensemble.personalize(images(2), np.array([0, 1]), chunk_size=0)


@pytest.mark.parametrize(
  "image, message",
  [
    (images(2)[:, :27], r"image must be float32 \[n, 28, 28, 1\] .* got float32 \[2, 27, 28, 1\]"),
    (images(2)[..., 0], r"got float32 \[2, 28, 28\]"),
    (images(2).astype(np.float64), r"image must be float32 .* got float64"),
    (images(2) * 255, r"values must be in \[0, 1\]"),
    (images(0), "image is empty"),
    ([[0.5]], "must be a NumPy array"),
  ],
)
def test_predict_rejects_bad_images(ensemble, image, message):
  with pytest.raises(ExportError, match=message):
    ensemble.predict(image)


@pytest.mark.parametrize(
  "alpha, message",
  [
    ([0.5, 0.5], r"one weight per member, K=3, got shape \[2\]"),
    ([0.25] * 4, r"K=3, got shape \[4\]"),
    ([0.5, 0.5, 0.5], "summing to 1"),
    ([1.5, -0.5, 0.0], "non-negative"),
  ],
)
def test_predict_rejects_alpha_not_matching_k(ensemble, alpha, message):
  with pytest.raises(ExportError, match=message):
    ensemble.predict(images(1), np.array(alpha))


def test_personalize_rejects_bad_sets(ensemble):
  with pytest.raises(ExportError, match="personalization set is empty"):
    ensemble.personalize(images(0), np.zeros(0, np.int32))
  with pytest.raises(ExportError, match="labels must be 2 integers"):
    ensemble.personalize(images(2), np.array([1]))
  with pytest.raises(ExportError, match=r"class indices in 0..61, got 0..62"):
    ensemble.personalize(images(2), np.array([0, 62]))
  with pytest.raises(ExportError, match="temperature must be > 0"):
    ensemble.personalize(images(2), np.array([0, 1]), temperature=0.0)


# Quantized ensembles ------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized_ensembles(ensemble_run):
  return {
    q: on_device.load_bytes(
      convert.export_run(
        ensemble_run,
        "ensemble",
        options=convert.Options(representative_examples=64),
        quantization=q,
      )
    )
    for q in convert.QUANTIZATIONS
  }


@pytest.mark.parametrize("quantization", ["dynamic", "int8"])
def test_quantized_ensemble_keeps_signatures_and_float_math(
  quantized_ensembles, ensemble_run, quantization
):
  exported = quantized_ensembles[quantization]
  assert exported.metadata["quantization"] == quantization
  assert exported.ensemble_size == K and exported.temperature == 0.5
  real = convert.calibration_data(femnist, DATA_DIR, 100, seed=1)
  x, y = real.x, real.y
  members = np.stack([evaluation.predict_probabilities(m, x) for m in ensemble_run.load_models()])
  alpha = np.array([0.2, 0.3, 0.5], np.float32)
  out = exported.predict(x, alpha)
  keras = metrics.ensemble_uncertainty(members, alpha)
  assert np.abs(out["probabilities"] - keras["probabilities"]).max() < 0.05
  assert np.mean(out["probabilities"].argmax(-1) == keras["probabilities"].argmax(-1)) >= 0.9
  assert np.abs(out["entropy"] - keras["entropy"]).max() < 0.1
  # The mixture and alpha come from float32 math: an int8 softmax would sum to a multiple
  # of 1/256 (see ensemble_module).
  np.testing.assert_allclose(out["probabilities"].sum(-1), 1, atol=1e-5)
  alpha_file = exported.personalize(x[:20], y[:20])
  assert abs(alpha_file.sum() - 1) < 1e-6
  np.testing.assert_allclose(
    alpha_file,
    personalization.personalization_weights(
      ensemble_math.member_losses(members[:, :20], y[:20]), 0.5
    ),
    atol=0.02,
  )


def test_quantized_ensembles_store_int8_weights_once(quantized_ensembles):
  sizes = {q: e.size_bytes for q, e in quantized_ensembles.items()}
  # Three members' weights, each stored once in int8: a quarter of float32 plus the
  # per-channel scales, biases and the graph.
  assert sizes["int8"] < 0.3 * sizes["float"] and sizes["dynamic"] < 0.3 * sizes["float"]
  model = flatbuffer_utils.convert_bytearray_to_object(
    bytearray(quantized_ensembles["int8"].flatbuffer)
  )
  dense_kernels = [
    t
    for g in model.subgraphs
    for t in g.tensors
    if t.type == schema.TensorType.INT8 and list(t.shape) == [femnist.NUM_CLASSES, 13 * 13 * 4]
  ]
  assert len(dense_kernels) == 2 * K  # One per member in each signature...
  assert len({t.buffer for t in dense_kernels}) == K  # ... sharing K buffers.
  assert "SOFTMAX" in ensemble_module.operator_types(quantized_ensembles["int8"].flatbuffer)


def test_quantization_applies_to_ensembles_only(single_run, ensemble_run):
  with pytest.raises(
    ExportError,
    match="--quantization=int8 applies to --format=ensemble; "
    "a single model is quantized by its format: use --format=int8",
  ):
    convert.export_run(single_run, "float", quantization="int8")
  with pytest.raises(
    ExportError, match="unknown --quantization=int4: choose one of float, dynamic, int8"
  ):
    convert.export_run(ensemble_run, "ensemble", quantization="int4")


# The trainable format ----------------------------------------------------------------


def test_trainable_export_predicts_and_trains_with_the_runs_settings(single_run, tmp_path):
  with pytest.raises(ExportError, match="config.json has no client_lr"):
    convert.export_run(single_run, "trainable")
  run = write_run(tmp_path / "run", single_run.load_models(), config={"client_lr": 0.05})
  flatbuffer = convert.export_run(run, "trainable")
  exported = on_device.load_bytes(flatbuffer)
  assert exported.metadata["format"] == "trainable"
  assert exported.metadata["learning_rate"] == 0.05 and exported.metadata["momentum"] == 0.0
  assert set(exported.metadata["signatures"]) == set(device_training.SIGNATURES)
  model = run.load_models()[0]
  x = images(6)
  np.testing.assert_allclose(exported.logits(x), model.predict(x, verbose=0), atol=1e-4)
  # One step at the run's learning rate, as Keras takes it.
  y = np.array([0, 1, 2, 3, 4, 5])
  trainer = device_training.DeviceTrainer(flatbuffer)
  trainer.train_step(x, y)
  model.compile(
    optimizer=tf.keras.optimizers.SGD(0.05),
    loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
  )
  model.train_on_batch(x, y)
  for device, keras in zip(trainer.get_weights(), model.get_weights()):
    np.testing.assert_allclose(device, keras, atol=1e-5)


def test_trainable_export_names_the_unsupported_layer(tmp_path):
  init = tf.keras.initializers.GlorotUniform(seed=0)
  model = tf.keras.Sequential(
    [
      tf.keras.Input(femnist.INPUT_SHAPE),
      tf.keras.layers.Conv2D(4, 3),
      tf.keras.layers.BatchNormalization(),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(femnist.NUM_CLASSES, kernel_initializer=init),
    ]
  )
  run = write_run(tmp_path / "bn", [model], config={"client_lr": 0.1})
  with pytest.raises(ExportError, match=r"^--format=trainable: .*batch_normalization"):
    convert.export_run(run, "trainable")


# Single-model formats -----------------------------------------------------------------


@pytest.fixture(scope="module")
def calibration():
  return convert.calibration_data(femnist, DATA_DIR, 64, seed=0)


@pytest.mark.parametrize(
  "output_format, max_logit_error, min_agreement",
  [("float", 1e-4, 1.0), ("dynamic", 0.2, 0.9), ("int8", 0.5, 0.9), ("qat", None, None)],
)
def test_single_model_formats_run_in_tflite_runtime(
  single_run, calibration, output_format, max_logit_error, min_agreement
):
  model = single_run.load_models()[0]
  flatbuffer = convert.finalize(
    convert.convert_model(model, output_format, calibration, convert.Options(qat_steps=2)),
    convert.describe(single_run, output_format, quantized_io=output_format == "int8"),
  )
  exported = on_device.load_bytes(flatbuffer)
  assert exported.runtime.startswith("tflite_runtime")
  x = calibration.x[:32]
  logits = exported.logits(x)
  assert logits.shape == (32, femnist.NUM_CLASSES) and logits.dtype == np.float32
  if max_logit_error is not None:  # QAT fine-tunes the weights, so it differs from Keras.
    keras = model.predict(x, verbose=0)
    assert np.abs(logits - keras).max() < max_logit_error
    assert np.mean(logits.argmax(-1) == keras.argmax(-1)) >= min_agreement
  if output_format == "int8":
    assert exported.metadata["input"]["dtype"] == "int8"
  with pytest.raises(ExportError, match="must be float32"):
    exported.logits(x.astype(np.float64))


def test_quantized_files_are_smaller(single_run, calibration):
  model = single_run.load_models()[0]
  float_size = len(convert.convert_model(model, "float"))
  assert len(convert.convert_model(model, "int8", calibration)) < 0.5 * float_size


# Metadata and runs --------------------------------------------------------------------


def test_metadata_round_trip_and_missing():
  flatbuffer = tf.lite.TFLiteConverter.from_keras_model(tiny.tiny_model()).convert()
  with pytest.raises(ExportError, match="has no 'tff_ens' metadata"):
    metadata.read(flatbuffer)
  with pytest.raises(ExportError, match="not a TFLite flatbuffer"):
    metadata.read(b"not a model at all")
  attached = convert.finalize(convert.finalize(flatbuffer, {"a": 1}), {"b": [2]})
  assert metadata.read(attached) == {"b": [2]}
  assert len(attached) < len(flatbuffer) + 100  # Tensor names dropped.


def test_run_without_model(tmp_path):
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(ExportError, match="has no model"):
    runs.load_run(str(tmp_path))
  with pytest.raises(ExportError, match="is not a directory"):
    runs.load_run(str(tmp_path / "nope"))


def test_a_client_of_a_run_without_per_client_models(single_run):
  with pytest.raises(ExportError, match="fedavg keeps no per-client models: export it without"):
    runs.load_run(single_run.run_dir, client="f0000_14")


def test_format_must_fit_the_run(single_run, ensemble_run):
  for output_format in ("lce", "binary"):
    with pytest.raises(ExportError, match="needs a run of a binarized model"):
      convert.check_format(single_run, output_format)
  with pytest.raises(ExportError, match="needs an ensemble run"):
    convert.check_format(single_run, "ensemble")
  with pytest.raises(ExportError, match="holds an ensemble of 3 models"):
    convert.check_format(ensemble_run, "float")


# The two commands ---------------------------------------------------------------------


def _run_module(*args):
  return subprocess.run(
    [sys.executable, "-m", *args],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )


@pytest.mark.slow
def test_export_command_reports_run_without_model(tmp_path):
  result = _run_module(
    "export", f"--run_dir={tmp_path}", "--format=float", f"--output={tmp_path / 'm.tflite'}"
  )
  assert result.returncode == 2
  [line] = result.stderr.strip().splitlines()[-1:]
  assert line.startswith("error: ") and "has no model" in line


@pytest.mark.parametrize("k", [1, K])
def test_exported_uncertainty_detects_ood_as_keras_does(k, tmp_path):
  # Digits-only models (10 logits); the digits run's letters are the OOD inputs.
  models = []
  for seed in range(k):
    init = tf.keras.initializers.GlorotUniform(seed=seed)
    models.append(
      tf.keras.Sequential(
        [
          tf.keras.Input(femnist.INPUT_SHAPE),
          tf.keras.layers.Conv2D(4, 3, strides=2, activation="relu", kernel_initializer=init),
          tf.keras.layers.Flatten(),
          tf.keras.layers.Dense(10, kernel_initializer=init),
        ]
      )
    )
  run = write_run(
    tmp_path / "run",
    models,
    config={"classes": "digits", "algorithm": "fedensemble" if k > 1 else "fedavg"},
    summary={"personalization_temperature": 0.5, "ood_auroc_entropy": 0.6},
  )
  path = tmp_path / "model.tflite"
  path.write_bytes(convert.export_run(run, "ensemble" if k > 1 else "float"))
  assert on_device.load(str(path)).class_labels == list("0123456789")
  report = evaluate.build_report(
    run, str(path), femnist.DIGITS.load_data(DATA_DIR), latency_repeats=1
  )
  for key in evaluate.OOD_KEYS:
    if k == 1 and key.endswith("mutual_information"):
      assert report[key] is None and report[f"keras_{key}"] is None
    else:
      assert 0.0 < report[key] < 1.0
      assert report[key] == pytest.approx(report[f"keras_{key}"], abs=2e-3)
  assert report["reference_ood_auroc_entropy"] == 0.6


# Three command lines, each importing TensorFlow: 127 s on a loaded machine (tests/watchdog.py).
@pytest.mark.timeout_seconds(600)
def test_export_and_evaluate_commands(single_run, tmp_path):
  output = tmp_path / "float.tflite"
  result = _run_module(
    "export", f"--run_dir={single_run.run_dir}", "--format=float", f"--output={output}"
  )
  assert result.returncode == 0, result.stderr[-2000:]
  report_path = tmp_path / "report.json"
  result = _run_module(
    "export.evaluate",
    f"--run_dir={single_run.run_dir}",
    f"--tflite={output}",
    f"--data_dir={DATA_DIR}",
    f"--output={report_path}",
    "--latency_repeats=3",
  )
  assert result.returncode == 0, result.stderr[-2000:]
  report = json.loads(report_path.read_text())
  for key in (
    "size_bytes",
    "accuracy",
    "per_client_accuracy",
    "reference_accuracy",
    "reference_personalized_accuracy",
    "agreement",
    "latency_ms_median",
    "runtime",
  ):
    assert key in report
  assert report["size_bytes"] == output.stat().st_size
  assert report["runtime"].startswith("tflite_runtime")
  assert report["agreement"] == 1.0
  assert report["accuracy"] == pytest.approx(report["keras_accuracy"])
  assert report["reference_accuracy"] == 0.5  # From the run's summary.json.
  assert report["num_test_examples"] == 1685
