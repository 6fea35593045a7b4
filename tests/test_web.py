"""The page of `python -m export.web` in headless Chromium: LiteRT.js (WASM) runs the files.

Against the device environment's LiteRT (Python) on the FEMNIST digits test writers and the
letters: the float files' probabilities within 1e-5, the int8 files' argmax on at least
99.9% of the inputs, personalization's alpha within 1e-5. A mouse stroke gives a prediction
from an input shaped as the training images; letters show the "not sure" state; the page's
personalization is kept across a reload and reset; every file it cannot run gets one line.
Skipped without Chromium (`apt-get install chromium`) or LiteRT.js (`npm ci` in
export/web/); nothing is installed here.
"""

import base64
import os

import numpy as np
import pytest

from export.web.drive import browser
from tests.chromium import needs_browser
from tests.exported_runs import needs_device_env
from tests.web_runs import BAD_FILES
from tests.web_runs import TEMPERATURE
from tests.web_runs import WEB_FILES

pytestmark = [needs_browser, needs_device_env, pytest.mark.timeout_seconds(900)]

FLOAT_FILES = [n for n in WEB_FILES if "int8" not in n]
INT8_FILES = [n for n in WEB_FILES if "int8" in n]
ENSEMBLES = [n for n in WEB_FILES if n.startswith("ens")]
PREDICT = """async ([data, n]) => {
  const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
  return await window.tffEns.predict(new Float32Array(bytes.buffer));
}"""
PERSONALIZE = """async ([data, labels, temperature]) => {
  const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
  return await window.tffEns.personalize(new Float32Array(bytes.buffer), labels, temperature);
}"""


@pytest.fixture(scope="module")
def chromium():
  with browser() as chromium:
    yield chromium


class Page:
  """A page of the served run at a phone's viewport, with its console's errors."""

  def __init__(self, chromium, url: str, name: str):
    self.page = chromium.new_page(viewport={"width": 390, "height": 844})
    self.errors = []
    self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
    self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
    self.page.goto(f"{url}?file={name}")
    self.ready = self.page.evaluate(
      "window.tffEns.ready.then((info) => ({info}), (e) => ({error: e.message}))"
    )

  def predict(self, x: np.ndarray) -> dict:
    out = self.page.evaluate(PREDICT, [_base64(x), len(x)])
    return {
      k: np.array(v, dtype=float if k != "mutual_information" else object) for k, v in out.items()
    }

  def close(self):
    self.page.close()


def _base64(x: np.ndarray) -> str:
  return base64.b64encode(np.ascontiguousarray(x, np.float32).tobytes()).decode()


@pytest.fixture
def open_page(chromium, served):
  pages = []

  def opened(name: str) -> Page:
    pages.append(Page(chromium, served.url, name))
    return pages[-1]

  yield opened
  for page in pages:
    page.close()


@pytest.mark.parametrize("name", list(WEB_FILES))
def test_page_loads_every_web_file_without_console_errors(name, open_page):
  page = open_page(name)
  assert "info" in page.ready, page.ready
  assert page.page.inner_text("#status").startswith(f"{name} loaded in ")
  assert page.errors == []


@pytest.mark.parametrize("name", FLOAT_FILES)
def test_float_files_give_litert_pythons_probabilities(name, open_page, web_run):
  page = open_page(name)
  for split, x in (("test", web_run.test_x), ("ood", web_run.ood_x)):
    out = page.predict(x)
    expected = web_run.device[f"{name}/{split}/probabilities"]
    np.testing.assert_allclose(out["probabilities"], expected, atol=1e-5, err_msg=split)
    if name.startswith("ens"):
      for key in ("member_probabilities", "entropy"):
        np.testing.assert_allclose(out[key], web_run.device[f"{name}/{split}/{key}"], atol=1e-5)
      np.testing.assert_allclose(
        out["mutual_information"].astype(float),
        web_run.device[f"{name}/{split}/mutual_information"],
        atol=1e-5,
      )
  assert page.errors == []


@pytest.mark.parametrize("name", INT8_FILES)
def test_int8_files_agree_with_litert_python_on_the_class(name, open_page, web_run):
  page = open_page(name)
  x = np.concatenate([web_run.test_x, web_run.ood_x])
  got = page.predict(x)["probabilities"].argmax(-1)
  expected = np.concatenate(
    [web_run.device[f"{name}/{split}/probabilities"] for split in ("test", "ood")]
  ).argmax(-1)
  assert np.mean(got == expected) >= 0.999


@pytest.mark.parametrize("name", ENSEMBLES)
def test_personalization_gives_litert_pythons_alpha(name, open_page, web_run):
  page = open_page(name)
  alpha = [
    page.page.evaluate(PERSONALIZE, [_base64(x), y.tolist(), TEMPERATURE])
    for x, y in web_run.writers
  ]
  np.testing.assert_allclose(alpha, web_run.device[f"{name}/alpha"], atol=1e-5)


def _draw_one(page):
  """A slightly slanted vertical stroke, top to bottom, in the middle of the pad."""
  box = page.locator("#pad").bounding_box()
  x, y, side = box["x"], box["y"], box["width"]
  page.mouse.move(x + 0.52 * side, y + 0.3 * side)
  page.mouse.down()
  for step in range(1, 21):
    page.mouse.move(x + (0.52 - 0.004 * step) * side, y + (0.3 + 0.02 * step) * side)
  page.mouse.up()


def test_a_drawn_stroke_is_predicted_from_a_leaf_shaped_input(open_page):
  page = open_page("ens_float_b8.tflite")
  assert "info" in page.ready
  _draw_one(page.page)
  page.page.wait_for_function("document.querySelectorAll('#top5 li').length === 5")
  verdict = page.page.inner_text("#verdict")
  assert verdict and "Draw a character" not in verdict
  image = np.array(page.page.evaluate("window.tffEns.input()")).reshape(28, 28)
  # As the training images: 1.0 background, ink down to 0, the ink's centre of mass at the
  # centre, its bounding box's longer side within the 10th-90th percentiles (8-13 px).
  assert image.max() == 1.0 and image.min() < 0.2 and np.mean(image == 1.0) > 0.8
  ink = 1 - image
  rows, cols = np.mgrid[0:28, 0:28]
  assert abs((ink * rows).sum() / ink.sum() - 13.5) < 0.3
  assert abs((ink * cols).sum() / ink.sum() - 13.5) < 0.3
  dark_rows = np.flatnonzero((ink > 0.5).any(axis=1))
  assert 8 <= dark_rows[-1] - dark_rows[0] + 1 <= 13
  assert page.errors == []


def test_letters_show_the_not_sure_state(open_page, web_run):
  name = "ens_int8_b1.tflite"
  page = open_page(name)
  rule = page.ready["info"]["not_sure"]
  out = page.predict(web_run.ood_x)
  flagged = out["mutual_information"].astype(float) > rule["threshold"]
  assert np.mean(flagged) == pytest.approx(rule["ood_flagged"], abs=2 / len(flagged))
  most_uncertain = int(np.argmax(out["mutual_information"].astype(float)))
  page.page.evaluate(
    "(image) => window.tffEns.show(image)", web_run.ood_x[most_uncertain].ravel().tolist()
  )
  assert page.page.inner_text("#verdict").startswith("Not sure")
  test = page.predict(web_run.test_x)
  surest = int(np.argmin(test["mutual_information"].astype(float)))
  page.page.evaluate(
    "(image) => window.tffEns.show(image)", web_run.test_x[surest].ravel().tolist()
  )
  assert not page.page.inner_text("#verdict").startswith("Not sure")


def test_personalization_in_the_page_is_kept_and_reset(open_page, web_run):
  page = open_page("ens_float_b8.tflite").page
  x, y = web_run.writers[0]
  for image, label in zip(x[:3], y[:3]):
    page.evaluate("(image) => window.tffEns.show(image)", image.ravel().tolist())
    page.select_option("#label", str(label))
    page.click("#add")
  page.fill("#temperature", str(TEMPERATURE))
  page.click("#personalize")
  page.wait_for_function("window.tffEns.alpha !== null")
  alpha = page.evaluate("window.tffEns.alpha")
  expected = page.evaluate(PERSONALIZE, [_base64(x[:3]), y[:3].tolist(), TEMPERATURE])
  np.testing.assert_allclose(alpha, expected, atol=1e-12)
  assert abs(alpha[0] - 1 / 3) > 1e-3
  bars = page.locator("#alpha li .value").all_inner_texts()
  assert bars == [f"{a:.3f}" for a in alpha]
  page.reload()
  page.evaluate("window.tffEns.ready")
  assert page.evaluate("window.tffEns.alpha") == pytest.approx(alpha, abs=1e-12)
  assert "3 examples" in page.inner_text("#examples")
  page.click("#reset")
  assert page.evaluate("window.tffEns.alpha") is None
  assert page.evaluate("Object.keys(localStorage).length") == 0


EXPECTED_PROBLEMS = {
  "ens_float.tflite": "declares a dynamic batch",
  "one_int8.tflite": "takes and returns int8 tensors, which LiteRT.js cannot feed",
  "lce.tflite": "larq-compute-engine's custom ops",
  "lce_as_tflite.tflite": "LiteRT.js cannot run lce_as_tflite.tflite",
  "not_tff_ens.tflite": "has no 'tff_ens' metadata",
  "truncated.tflite": "truncated.tflite",
  "random.tflite": "is not a TFLite flatbuffer",
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_a_file_the_browser_cannot_run_gets_one_line(name, open_page):
  page = open_page(name)
  status = page.page.locator("#status")
  message = status.inner_text()
  assert page.ready == {"error": message}
  assert EXPECTED_PROBLEMS[name] in message
  assert "\n" not in message and " at " not in message and "Error" not in message
  assert "problem" in status.get_attribute("class")
  # The rest of the page stays: its title and the run it serves.
  assert page.page.inner_text("h1").startswith("tff-ens")
  assert not [e for e in page.errors if e.startswith("page error")]


@pytest.mark.slow
@pytest.mark.timeout_seconds(1800)
def test_shakespeare_page_gives_the_next_characters_distribution(chromium, tmp_path):
  """A Fed-ensemble of two small trained LSTMs on the Tempest's PROSPERO, exported with
  --static_batch=1 (unrolled: minutes), against LiteRT Python, and its text page."""
  import tensorflow as tf

  from export import convert
  from export import on_device
  from export.web.drive import Served
  from tasks import plays
  from tasks import shakespeare
  from tests.exported_runs import REPO_ROOT
  from tests.exported_runs import write_run

  tempest = os.path.join(REPO_ROOT, "..", "shared", "data", "shakespeare", "tempest_gut.txt")
  (tmp_path / "plays").mkdir()
  (tmp_path / "plays" / "tempest_gut.txt").symlink_to(os.path.abspath(tempest))
  prospero = plays.windows(plays.encode(plays.read_play(tempest).roles()["PROSPERO"]))
  members = []
  for seed in range(2):  # 30 Adam steps of 50 samples each.
    tf.keras.utils.set_random_seed(seed)
    members.append(shakespeare.lstm(seed, units=16))
    members[-1].compile(
      tf.keras.optimizers.Adam(0.01),
      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    members[-1].fit(
      prospero[0][:1500].astype(np.int32), prospero[1][:1500], batch_size=50, verbose=0
    )
  run = write_run(
    tmp_path / "run",
    members,
    {"task": "shakespeare", "model": "lstm", "data_dir": str(tmp_path / "plays")},
    {"personalization_temperature": 0.5},
  )
  path = tmp_path / "run" / "web.tflite"
  path.write_bytes(convert.export_run(run, "ensemble", static_batch=1))
  ids = prospero[0][np.linspace(0, len(prospero[0]) - 1, 20).astype(int)].astype(np.int32)
  expected = on_device.load(str(path)).predict(ids)["probabilities"]
  served = Served(str(tmp_path / "run"), [str(path)])
  page = Page(chromium, served.url, "web.tflite")
  try:
    assert page.ready["info"]["task"] == "shakespeare"
    got = page.page.evaluate(
      "(x) => window.tffEns.predict(x).then((o) => o.probabilities)", ids.tolist()
    )
    np.testing.assert_allclose(got, expected, atol=1e-5)
    page.page.fill("#text", "What is your name, good si")
    page.page.wait_for_function("document.querySelectorAll('#next5 li').length === 5")
    context = plays.context_ids("What is your name, good si")
    best = np.argsort(-on_device.load(str(path)).predict(context[None])["probabilities"][0])[:5]
    labels = page.page.locator("#next5 li .label").all_inner_texts()
    vocabulary = page.ready["info"]["input"]["vocabulary"]
    shown = {"\u2423": " ", "\u23ce": "\n"}
    assert [vocabulary.index(shown.get(c, c)) for c in labels] == best.tolist()
    assert page.errors == []
  finally:
    page.close()
    served.close()
