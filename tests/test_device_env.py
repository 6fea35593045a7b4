"""The device environment (`device/`, LiteRT without TensorFlow) runs `export.evaluate`.

Files are exported here, in the main environment, then evaluated by the device
environment's Python in a process that must never import TensorFlow, with the accuracies
the main environment's interpreter gives. Skipped when the device environment is not
installed (`uv sync --locked --project device`).
"""

import json
import subprocess
import sys

import larq as lq
import numpy as np
import pytest
import tensorflow as tf

from export import convert
from export import evaluate
from export import metadata
from export import on_device
from tasks import femnist
from tests.exported_runs import DATA_DIR
from tests.exported_runs import EVALUATE_AND_LIST_MODULES
from tests.exported_runs import REPO_ROOT
from tests.exported_runs import needs_device_env
from tests.exported_runs import run_in_device_env
from tests.exported_runs import small_femnist_model
from tests.exported_runs import write_run

ENSEMBLE_SIZE = 3


@pytest.fixture(scope="module")
def femnist_data():
  return femnist.load_data(DATA_DIR)


def test_leaf_reader_runs_without_tensorflow():
  # The device environment reads FEMNIST through tasks.leaf, as tasks.femnist does.
  result = subprocess.run(
    [
      sys.executable,
      "-c",
      "import sys, tasks.leaf as leaf; "
      f"data = leaf.digits_only(leaf.load_leaf({str(DATA_DIR)!r})); "
      "print(data.test.num_examples(), data.ood.num_examples(), "
      "sorted(m for m in sys.modules if m.split('.')[0] in "
      "('tensorflow', 'tensorflow_federated', 'keras')))",
    ],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    check=True,
  )
  expected = femnist.digits_only(femnist.load_data(DATA_DIR))
  assert result.stdout.split() == [
    str(expected.test.num_examples()),
    str(expected.ood.num_examples()),
    "[]",
  ]


@needs_device_env
@pytest.mark.parametrize(
  "output_format, quantization", [("float", "float"), ("ensemble", "float"), ("ensemble", "int8")]
)
def test_device_env_evaluates_without_tensorflow(
  output_format, quantization, femnist_data, tmp_path
):
  k = ENSEMBLE_SIZE if output_format == "ensemble" else 1
  run = write_run(
    tmp_path / "run",
    [small_femnist_model(seed) for seed in range(k)],
    config={"algorithm": "fedensemble" if k > 1 else "fedavg"},
    summary={"personalization_temperature": 0.5},
  )
  path = tmp_path / "model.tflite"
  path.write_bytes(
    convert.export_run(
      run,
      output_format,
      options=convert.Options(representative_examples=64),
      quantization=quantization,
    )
  )
  main = evaluate.build_report(run, str(path), femnist_data, latency_repeats=1)
  report_path = tmp_path / "device_report.json"
  process = run_in_device_env(
    EVALUATE_AND_LIST_MODULES,
    f"--run_dir={run.run_dir}",
    f"--tflite={path}",
    f"--data_dir={DATA_DIR}",
    f"--output={report_path}",
    "--latency_repeats=1",
  )
  assert process["status"] == 0
  assert not process["tensorflow"], process["modules"]
  assert process["modules"] == []
  device = json.loads(report_path.read_text())
  assert device["runtime"].startswith("ai_edge_litert")
  assert main["runtime"].startswith("tflite_runtime")
  assert "keras_accuracy" not in device and "agreement" not in device
  keys = ["accuracy", "per_client_accuracy", "num_test_examples"]
  if k > 1:
    keys.append("personalized_accuracy")
  assert {key: device[key] for key in keys} == {key: main[key] for key in keys}


@needs_device_env
def test_device_env_runs_lce_files(tmp_path):
  init = tf.keras.initializers.GlorotUniform(seed=0)
  model = tf.keras.Sequential(
    [
      tf.keras.Input(femnist.INPUT_SHAPE),
      tf.keras.layers.Conv2D(8, 3, strides=2, kernel_initializer=init),
      lq.layers.QuantConv2D(
        8,
        3,
        input_quantizer="ste_sign",
        kernel_quantizer="ste_sign",
        kernel_constraint="weight_clip",
        kernel_initializer=init,
      ),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(femnist.NUM_CLASSES, kernel_initializer=init),
    ]
  )
  description = {
    "format": "lce",
    "runtime": metadata.RUNTIME_LCE,
    "class_labels": list(femnist.CLASS_LABELS),
    "input": {
      "shape": [None, *femnist.INPUT_SHAPE],
      "dtype": "float32",
      "value_range": [0.0, 1.0],
      "preprocessing": "",
    },
  }
  path = tmp_path / "model.tflite"
  path.write_bytes(convert.finalize(convert.convert_model(model, "lce"), description))
  x = np.random.default_rng(0).random((4, *femnist.INPUT_SHAPE), dtype=np.float32)
  np.save(tmp_path / "x.npy", x)
  main = on_device.load(str(path)).logits(x)
  process = run_in_device_env(f"""
import json, sys
import numpy as np
from export import on_device
exported = on_device.load({str(path)!r})
logits = exported.logits(np.load({str(tmp_path / "x.npy")!r}))
print(json.dumps({{"runtime": exported.runtime, "logits": logits.tolist(),
                  "tensorflow": "tensorflow" in sys.modules}}))
""")
  assert process["runtime"].startswith("larq_compute_engine")
  assert not process["tensorflow"]
  np.testing.assert_array_equal(np.asarray(process["logits"], np.float32), main)
