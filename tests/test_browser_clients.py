"""Clients that train in browsers (`--client_runtime=browser`): headless Chromium pages
running the trainable file in LiteRT.js against LiteRT Python's device processes on the same
requests, a page closed mid-task, the server's closed doors, and CLI runs of both runtimes."""

import csv
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from export import device_training
from export import trainable
from export.web import client_server
from export.web import drive
from tests.chromium import needs_browser
from tests.exported_runs import DATA_DIR
from tests.exported_runs import REPO_ROOT
from tests.exported_runs import small_femnist_model
from tff_ens.program import browser_clients
from tff_ens.program import device_clients
from tff_ens.program import simulation

pytestmark = needs_browser
BATCH = 4
LEARNING_RATE, MOMENTUM = 0.1, 0.9


def femnist_like(n: int, seed: int):
  """n images as FEMNIST's (a white background, darker strokes), labels of 62 classes."""
  rng = np.random.default_rng(seed)
  x = np.where(rng.random((n, 28, 28, 1)) < 0.3, rng.random((n, 28, 28, 1)), 1.0)
  return x.astype(np.float32), rng.integers(0, 62, n).astype(np.int32)


def requests_of(sizes, models: int = 1):
  """One request per client of `sizes` examples, 2 epochs in batches of BATCH, models in turn."""
  requests = []
  for i, n in enumerate(sizes):
    x, y = femnist_like(n, seed=i)
    order = simulation.client_order(n, epochs=2, batch_size=BATCH, seed=i)
    requests.append({"x": x, "y": y, "order": order, "batch_size": BATCH, "model": i % models})
  return requests


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """The dynamic file (LiteRT Python) and the static one (LiteRT.js) of the same model."""
  root = tmp_path_factory.mktemp("files")
  paths = {}
  for name, static in (("dynamic", None), ("static", BATCH)):
    paths[name] = str(root / f"{name}.tflite")
    with open(paths[name], "wb") as f:
      f.write(
        trainable.convert_trainable(
          small_femnist_model(0),
          learning_rate=LEARNING_RATE,
          momentum=MOMENTUM,
          static_batch=static,
        )
      )
  return paths


@pytest.fixture(scope="module")
def pool(files):
  pool = browser_clients.BrowserPool(files["static"], 2)
  yield pool
  pool.close()


def server_models(count: int):
  return [[w.numpy() for w in small_femnist_model(k + 1).trainable_variables] for k in range(count)]


def test_browser_pages_train_as_litert_python(files, pool):
  models = server_models(2)
  # 7 examples: 14 in batches of 4, 4, 4, 2; 9: a batch spanning both epochs; 2: one batch.
  requests = requests_of([7, 9, 2], models=2)
  names = ["a", "b", "c"]
  in_browsers = pool.train(models, requests, names)
  step_losses = pool.step_losses
  devices = device_clients.DevicePool(files["dynamic"], 2)
  try:
    on_devices = devices.train(models, requests, names)
  finally:
    devices.close()
  for browser, device in zip(in_browsers, on_devices):
    assert browser[3] == device[3]
    assert browser[2] == device[2]  # Correct predictions: counts.
    assert browser[1] == pytest.approx(device[1], rel=1e-5)
    for a, b in zip(browser[0], device[0]):
      assert a.shape == b.shape
      np.testing.assert_allclose(a, b, atol=1e-5)
  # Each step's loss against LiteRT Python's on the same file, client by client.
  trainer = device_training.DeviceTrainer.load(files["static"])
  for request, losses in zip(requests, step_losses):
    trainer.set_weights(models[request["model"]])
    reference = []
    trainer.train_epochs(
      request["x"], request["y"], batch_size=BATCH, order=request["order"], step_losses=reference
    )
    np.testing.assert_allclose(losses, reference, atol=1e-4)
  # The weights moved: the comparison is of training, not of the server's weights.
  assert not np.allclose(in_browsers[0][0][0], models[0][0], atol=1e-3)


def test_a_page_closed_mid_task_is_a_dropout_and_the_next_tasks_go_on(pool, caplog):
  models = server_models(1)
  # 2 epochs of 3000 examples one at a time: 6000 steps, seconds in a page.
  long, short = requests_of([3000, 5])
  long["batch_size"] = 1
  task_of = {}

  def close_the_long_tasks_page():
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      for client in pool.server.clients:
        task = client.task
        if task is not None and task.num_examples == len(long["order"]):
          time.sleep(0.5)  # Training.
          task_of["name"] = client.name
          pool.headless.close_page(int(client.name.split("-")[1].split("#")[0]))
          return
      time.sleep(0.05)

  closer = threading.Thread(target=close_the_long_tasks_page)
  closer.start()
  with caplog.at_level("WARNING"):
    results = pool.train(models, [long, short], ["writer_long", "writer_short"])
  closer.join()
  assert results[0] is None and results[1] is not None and results[1][3] == 10
  assert f"browser client {task_of['name']} went away: client writer_long dropped" in caplog.text
  # The next round trains both, one of them on the page opened in the closed one's place.
  again = pool.train(models, [short, short], ["writer_a", "writer_b"])
  assert [r[3] for r in again] == [10, 10]
  assert again[0][1] == again[1][1] == results[1][1]
  live = [c.name for c in pool.server.clients if not c.gone.is_set()]
  assert len(live) == 2 and any(name.startswith("headless-2#") for name in live)


def test_the_client_server_answers_only_its_token(files):
  server = client_server.ClientServer(files["static"])
  try:
    url = server.urls()[0]
    page = urllib.request.urlopen(url)
    assert page.status == 200 and "client.js" in page.read().decode()
    assert "default-src 'none'" in page.headers["Content-Security-Policy"]
    with urllib.request.urlopen(url + "trainable.tflite") as f:
      assert f.read() == open(files["static"], "rb").read()
    task = server.task(
      model=0,
      batch_size=2,
      weights=b"\0" * 8,
      x=b"x" * 4,
      y=b"",
      order=b"",
      num_examples=3,
      num_weights=2,
    )
    with urllib.request.urlopen(url + f"tasks/{task.id}/x") as f:
      assert f.read() == b"x" * 4
    wrong = url.replace(server.token, server.token[:-1] + ("A" if server.token[-1] != "A" else "B"))
    root = url.rsplit("/", 2)[0] + "/"
    for bad in (
      wrong,
      wrong + "events",
      wrong + "trainable.tflite",
      wrong + f"tasks/{task.id}/x",
      root,
      root + "client.html",
      url + "tasks/",
      url + "tasks/99/x",
      url + "../",
    ):
      with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad)
      assert e.value.code == 404, bad
    result = url + f"tasks/{task.id}/result"
    for target, body, code in (
      (wrong + f"tasks/{task.id}/result", b"\0" * 24, 404),
      (result, b"\0" * 20, 400),
      (url + "tasks/99/result", b"", 404),
    ):
      with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(target, data=body, method="POST"))
      assert e.value.code == code, target
    # 2 weights and 2 steps' losses and correct counts.
    posted = urllib.request.urlopen(urllib.request.Request(result, data=b"\0" * 24, method="POST"))
    assert posted.status == 204 and task.done.is_set() and len(task.result) == 6
  finally:
    server.close()


def test_a_page_that_keeps_its_task_past_the_deadline_is_a_dropout_and_is_replaced(files, caplog):
  slow = browser_clients.BrowserPool(files["static"], 1, task_seconds=1)
  try:
    models = server_models(1)
    # 2 epochs of 20,000 examples one at a time: 40,000 steps, far more than a second.
    (long,) = requests_of([20_000])
    long["batch_size"] = 1
    (stuck,) = slow.server.clients
    started = time.monotonic()
    with caplog.at_level("WARNING"):
      assert slow.train(models, [long], ["writer_slow"]) == [None]
    assert time.monotonic() - started < 20
    assert (
      f"browser client {stuck.name} did not return its task in 1 s: client writer_slow dropped"
      in caplog.text
    )
    # The stuck page was closed and another opened: the next round trains on it.
    (result,) = slow.train(models, requests_of([5]), ["writer_next"])
    assert result[3] == 10 and slow.headless.pages == 2  # 2 epochs of 5.
    assert stuck.gone.is_set() and [c for c in slow.server.clients if not c.gone.is_set()] != []
  finally:
    slow.close()


def test_a_browser_that_opens_the_printed_url_joins_and_trains(files, pool, capsys):
  # --browser_clients=HOST:PORT: the run prints the URL and a QR code, and waits for a page.
  joined = {}
  starting = threading.Thread(
    target=lambda: joined.update(
      pool=browser_clients.BrowserPool(files["static"], 1, "127.0.0.1:0")
    )
  )
  starting.start()
  printed = ""
  deadline = time.monotonic() + 30
  while "http://" not in printed and time.monotonic() < deadline:
    time.sleep(0.1)
    printed += capsys.readouterr().out
  (url,) = [w for w in printed.split() if w.startswith("http://127.0.0.1:")]
  assert "\u2580" in printed or "\u2584" in printed or "\u2588" in printed  # The QR code.
  with drive.browser() as chromium:
    page = chromium.new_page()
    page.goto(url + "?name=phone")
    starting.join(timeout=60)
    phone = joined["pool"]
    try:
      models, requests = server_models(1), requests_of([6])
      (result,) = phone.train(models, requests, ["writer"])
      page.locator("#step", has_text="3/3").wait_for(timeout=10000)
      assert "phone#1" in page.inner_text("#name")
    finally:
      phone.close()
  (headless,) = pool.train(models, requests, ["writer"])
  assert result[1:] == headless[1:]
  for a, b in zip(result[0], headless[0]):
    np.testing.assert_array_equal(a, b)


CLI = [
  sys.executable,
  "-m",
  "tff_ens.main",
  "--task=femnist",
  f"--data_dir={DATA_DIR}",
  "--clients_per_round=3",
  "--rounds=3",
  "--eval_every=1",
  "--checkpoint_every=3",
  "--device_processes=2",
]


def cli_metrics(output_dir, *flags) -> list[dict]:
  run = subprocess.run(
    [*CLI, f"--output_dir={output_dir}", *flags],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert run.returncode == 0, run.stderr[-2000:]
  with open(output_dir / "metrics.csv") as f:
    return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


@pytest.mark.slow
@pytest.mark.parametrize(
  "algorithm", [["--algorithm=fedavg"], ["--algorithm=fedensemble", "--ensemble_size=2"]]
)
def test_cli_browser_run_ends_as_the_litert_run(tmp_path, algorithm):
  litert = cli_metrics(tmp_path / "litert", *algorithm, "--client_runtime=litert")
  browser = cli_metrics(tmp_path / "browser", *algorithm, "--client_runtime=browser")
  assert [r["clients_used"] for r in browser] == [r["clients_used"] for r in litert] == [3.0] * 3
  # Round 1 starts from the same weights, the clients' updates 1e-8 apart; a near tie (a
  # max-pool's or a ReLU's) that rounding flips in a client's steps moves more (measured:
  # FedAvg's test loss 2e-8 apart, relative; Fed-ensemble's 6e-5).
  for key in ("num_examples", "train_loss", "test_loss"):
    assert browser[0][key] == pytest.approx(litert[0][key], rel=2e-4), key
  assert browser[0]["test_accuracy"] == pytest.approx(litert[0]["test_accuracy"], abs=0.005)
  # The flat start of training amplifies it, as between TFF's and LiteRT's kernels (measured
  # at round 3: train loss 1.5e-3 and 1.8e-3 apart, test loss 1.1e-2 and 2.7e-3, test
  # accuracy equal).
  assert browser[-1]["train_loss"] == pytest.approx(litert[-1]["train_loss"], abs=5e-3)
  assert browser[-1]["test_loss"] == pytest.approx(litert[-1]["test_loss"], abs=3e-2)
  assert browser[-1]["test_accuracy"] == pytest.approx(litert[-1]["test_accuracy"], abs=0.01)
