"""Fixed-shape files (`python -m export --static_batch=N`) give the dynamic files' outputs.

In the device environment's LiteRT (Python): each `--static_batch` file against the file of
a dynamic batch (ensembles) or batch 1 (single models) on the same FEMNIST digits test
writers, and the mask of a fixed-size `personalize` against the dynamic signature on the
unpadded examples. The metadata's "not sure" threshold is recomputed from the dynamic file's
own outputs.
"""

import io
import zipfile

import flatbuffers
import numpy as np
import pytest

from export import ExportError
from export import convert
from export import metadata
from export import not_sure
from export import standard_metadata
from tests.exported_runs import needs_device_env
from tests.exported_runs import run_in_device_env
from tests.exported_runs import small_femnist_model
from tests.exported_runs import write_run
from tests.web_runs import FILES
from tff_ens.math import ensemble_math
from tff_ens.math import metrics

pytestmark = needs_device_env

STATIC_AND_REFERENCE = [
  ("ens_float_b8.tflite", "ens_float.tflite"),
  ("ens_int8_b1.tflite", "ens_int8.tflite"),
  ("one_float_b4.tflite", "one_float.tflite"),
  ("one_int8_b1.tflite", "one_int8.tflite"),
]

# The raw signatures in LiteRT, without export.on_device: the static file's `personalize`
# on 5 examples padded to 8 with garbage labels masked out, against the dynamic file's on
# the 5 alone, at temperature 0.5.
RAW_PERSONALIZE = """
import json, sys
import numpy as np
from ai_edge_litert import interpreter
directory = sys.argv[1]
inputs = np.load(f"{directory}/inputs.npz")
x, y = inputs["writer_x_0"][:5], inputs["writer_y_0"][:5].astype(np.int32)
def runner(name):
  file = interpreter.Interpreter(model_path=f"{directory}/{name}")
  return file.get_signature_runner("personalize")
dynamic = runner("ens_float.tflite")(images=x, labels=y, temperature=np.float32(0.5))["alpha"]
padded_x = np.concatenate([x, np.zeros((3, *x.shape[1:]), np.float32)])
padded_y = np.concatenate([y, np.array([9, 9, 9], np.int32)])
mask = np.array([1, 1, 1, 1, 1, 0, 0, 0], np.float32)
static_runner = runner("ens_float_b8.tflite")
static = static_runner(images=padded_x, labels=padded_y, mask=mask,
                       temperature=np.float32(0.5))["alpha"]
unmasked = static_runner(images=padded_x, labels=padded_y, mask=np.ones(8, np.float32),
                         temperature=np.float32(0.5))["alpha"]
print(json.dumps({"dynamic": dynamic.tolist(), "static": static.tolist(),
                  "unmasked": unmasked.tolist()}))
"""


@pytest.mark.timeout_seconds(900)
@pytest.mark.parametrize("static, reference", STATIC_AND_REFERENCE)
def test_static_file_gives_the_dynamic_files_outputs(static, reference, web_run):
  for split in ("test", "ood"):
    for key in ("probabilities", "entropy", "mutual_information", "member_probabilities"):
      if f"{reference}/{split}/{key}" not in web_run.device:
        continue
      got = web_run.device[f"{static}/{split}/{key}"]
      expected = web_run.device[f"{reference}/{split}/{key}"]
      assert got.shape == expected.shape
      np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=f"{static} {split} {key}")
  if static.startswith("ens"):
    # A batch of 1 personalizes in one chunk per example, combined (`on_device`), whose
    # float32 rounding moves alpha by up to 8e-6 here.
    np.testing.assert_allclose(
      web_run.device[f"{static}/alpha"], web_run.device[f"{reference}/alpha"], atol=1e-5
    )
    # Personalization moved alpha away from 1/K on these writers.
    assert np.abs(web_run.device[f"{static}/alpha"] - 1 / 3).max() > 1e-3


def test_fixed_size_personalize_masks_the_padding(web_run):
  alpha = run_in_device_env(RAW_PERSONALIZE, web_run.directory)
  np.testing.assert_allclose(alpha["static"], alpha["dynamic"], atol=1e-6)
  # The padding's (wrong) labels would change alpha if the mask did not drop them.
  assert np.abs(np.subtract(alpha["unmasked"], alpha["dynamic"])).max() > 1e-3


def test_static_files_declare_their_shapes(web_run):
  for name, (_, output_format, _, static_batch) in FILES.items():
    description = web_run.metadata(name)
    assert description["input"]["shape"] == [static_batch, 28, 28, 1]
    assert description.get("static_batch") == static_batch
    # LiteRT.js feeds float32: a fixed-batch int8 file takes float32 images.
    assert description["input"]["dtype"] == (
      "int8" if output_format == "int8" and not static_batch else "float32"
    )
  assert "mask [n] float32" in web_run.metadata("ens_int8_b1.tflite")["signatures"]["personalize"]


@pytest.mark.parametrize("name, reference", [("ens_int8_b1.tflite", "ens_int8.tflite")])
def test_not_sure_threshold_is_the_quantile_of_the_files_test_scores(
  name,
  reference,
  web_run,
):
  rule = web_run.metadata(name)["not_sure"]
  # The summary's mutual information AUROC (0.74) beat the entropy's (0.71).
  assert rule["score"] == "mutual_information"
  test = web_run.device[f"{reference}/test/mutual_information"]
  ood = web_run.device[f"{reference}/ood/mutual_information"]
  assert rule["test_examples"] == len(test) and rule["ood_examples"] == len(ood)
  assert rule["threshold"] == pytest.approx(np.quantile(test, not_sure.QUANTILE), abs=1e-6)
  assert rule["ood_flagged"] == pytest.approx(np.mean(ood > rule["threshold"]), abs=2 / len(ood))
  assert rule["ood_auroc"] == pytest.approx(metrics.ood_auroc(test, ood), abs=1e-3)
  assert rule["run_ood_auroc"] == 0.74


def test_single_model_threshold_uses_entropy(web_run):
  rule = web_run.metadata("one_float_b4.tflite")["not_sure"]
  p = web_run.device["one_float.tflite/test/probabilities"]
  entropy = -np.sum(p * np.log(np.clip(p, 1e-12, 1)), axis=-1)
  assert rule["score"] == "entropy"
  assert rule["threshold"] == pytest.approx(np.quantile(entropy, not_sure.QUANTILE), abs=1e-5)


def test_chosen_score_follows_the_runs_auroc():
  both = {"ood_auroc_entropy": 0.8, "ood_auroc_mutual_information": 0.7}
  assert not_sure.chosen_score(both, is_ensemble=True) == "entropy"
  assert not_sure.chosen_score({**both, "ood_auroc_entropy": 0.6}, True) == "mutual_information"
  assert not_sure.chosen_score({**both, "ood_auroc_entropy": 0.6}, False) == "entropy"
  assert not_sure.chosen_score({}, True) == "entropy"


@pytest.mark.parametrize(
  "output_format, static_batch, message",
  [
    ("float", 0, "--static_batch must be a positive number of examples, got 0"),
  ],
)
def test_static_batch_refusals_are_one_line(output_format, static_batch, message, tmp_path):
  run = write_run(tmp_path / "run", [small_femnist_model(0)], {"client_lr": 0.1})
  with pytest.raises(ExportError) as error:
    convert.check_format(run, output_format, static_batch=static_batch)
  assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_static_trainable_export_trains_as_the_dynamic_export(tmp_path):
  """`python -m export --format=trainable --static_batch=4`, the browser clients' file: 2
  epochs of 11 examples (the last batch of each padded and masked) step as the dynamic
  export's."""
  from export import device_training

  run = write_run(tmp_path / "run", [small_femnist_model(0)], {"client_lr": 0.1})
  rng = np.random.default_rng(0)
  x = rng.random((11, 28, 28, 1), dtype=np.float32)
  y = rng.integers(0, 62, 11).astype(np.int32)
  results = []
  for static_batch in (None, 4):
    flatbuffer = convert.export_run(run, "trainable", static_batch=static_batch)
    trainer, losses = device_training.DeviceTrainer(flatbuffer), []
    trained = trainer.train_epochs(x, y, epochs=2, batch_size=4, seed=1, step_losses=losses)
    results.append((trained, losses, metadata.read(flatbuffer)))
  (dynamic, dynamic_losses, _), (static, static_losses, description) = results
  assert len(static_losses) == 6
  np.testing.assert_allclose(static_losses, dynamic_losses, rtol=1e-6)
  for a, b in zip(static.weights, dynamic.weights):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert not np.allclose(static.weights[0], small_femnist_model(0).get_weights()[0], atol=1e-4)
  assert description["input"]["shape"] == [4, 28, 28, 1]
  assert "mask [n] float32" in description["signatures"]["train"]


def test_static_batch_refuses_lce(tmp_path):
  run = write_run(tmp_path / "run", [small_femnist_model(0)], {"model": "resnet8_binary"})
  with pytest.raises(ExportError, match="lce files run only in LCE's interpreter"):
    convert.check_format(run, "lce", static_batch=1)


def test_personalize_weights_by_hand_with_a_mask():
  probs = np.array([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]], [[0.1, 0.9], [0.3, 0.7], [0.6, 0.4]]])
  labels = np.array([0, 0, 1])
  # Member 0: -(log 0.5 + log 0.9) / 2; member 1: -(log 0.1 + log 0.3) / 2; the third masked.
  expected = [-(np.log(0.5) + np.log(0.9)) / 2, -(np.log(0.1) + np.log(0.3)) / 2]
  got = ensemble_math.member_losses(probs, labels, mask=np.array([1.0, 1.0, 0.0]))
  np.testing.assert_allclose(got, expected)


def _table(buffer: bytes, position: int):
  return flatbuffers.table.Table(bytearray(buffer), position)


def _field(table, slot: int) -> int:
  return table.Offset(4 + 2 * slot)


def _string(table, slot: int) -> str | None:
  offset = _field(table, slot)
  return table.String(offset + table.Pos).decode() if offset else None


def _child(table, slot: int):
  return _table(table.Bytes, table.Indirect(_field(table, slot) + table.Pos))


def _children(table, slot: int) -> list:
  offset = _field(table, slot)
  start = table.Vector(offset)
  return [
    _table(table.Bytes, table.Indirect(start + 4 * i)) for i in range(table.VectorLen(offset))
  ]


def _floats(table, slot: int) -> list[float]:
  offset = _field(table, slot)
  start = table.Vector(offset)
  return [
    flatbuffers.encode.Get(flatbuffers.packer.float32, table.Bytes, start + 4 * i)
    for i in range(table.VectorLen(offset))
  ]


def _byte(table, slot: int) -> int:
  return table.Get(flatbuffers.number_types.Uint8Flags, _field(table, slot) + table.Pos)


@pytest.mark.parametrize("name", ["one_float_b4.tflite", "ens_int8_b1.tflite"])
def test_files_carry_tflites_standard_metadata(name, web_run):
  """Read back by slot with flatbuffers' table accessors (metadata_schema.fbs's field
  order) and zipfile, not by the writer's code."""
  with open(web_run.path(name), "rb") as f:
    flatbuffer = f.read()
  model = metadata.schema.Model.GetRootAs(flatbuffer, 0)
  entries = {
    model.Metadata(i).Name().decode(): model.Metadata(i) for i in range(model.MetadataLength())
  }
  buffer = model.Buffers(entries["TFLITE_METADATA"].Buffer()).DataAsNumpy().tobytes()
  assert buffer[4:8] == b"M001"
  root = _table(buffer, flatbuffers.encode.Get(flatbuffers.packer.uoffset, buffer, 0))
  description = web_run.metadata(name)
  assert _string(root, 0) == f"tff-ens femnist {description['format']}"
  assert _string(root, 2).startswith("tff-ens ") and _string(root, 4) == convert.AUTHOR
  assert _string(root, 5) == convert.UNSET_LICENSE and _string(root, 7) == "1.1.0"
  (subgraph,) = _children(root, 3)
  inputs = {_string(t, 0): t for t in _children(subgraph, 2)}
  (image,) = [inputs[n] for n in ("image", "images", "x") if n in inputs]
  assert _string(image, 1) == description["input"]["preprocessing"]
  # ImageProperties, GRAYSCALE 28x28; (pixel - mean) / std maps 8-bit pixels to [0, 1].
  content = _child(image, 3)
  assert _byte(content, 0) == 2 and _byte(_child(content, 1), 0) == 2
  (unit,) = _children(image, 4)
  mean, std = _floats(_child(unit, 1), 0), _floats(_child(unit, 1), 1)
  assert (np.array([0, 255]) - mean[0]) / std[0] == pytest.approx([0.0, 1.0])
  assert _floats(_child(image, 5), 0) == [1.0] and _floats(_child(image, 5), 1) == [0.0]
  outputs = {_string(t, 0): t for t in _children(subgraph, 3)}
  # A single model's logits and predict's probabilities name their labels file; subgraph 0
  # of an ensemble may be personalize's, whose output is alpha.
  for output in ("logits", "probabilities"):
    if output in outputs:
      (labels,) = _children(outputs[output], 6)
      assert _string(labels, 0) == "labels.txt" and _byte(labels, 2) == 2
  assert set(outputs) in (
    {"logits"},
    {"alpha"},
    set(standard_metadata.OUTPUTS) - {"logits", "alpha"},
  )
  with zipfile.ZipFile(io.BytesIO(flatbuffer)) as archive:
    assert archive.read("labels.txt").decode().splitlines() == description["class_labels"]
