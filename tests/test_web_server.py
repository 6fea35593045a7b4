"""`python -m export.web` serves only what it names, under its per-launch token, read-only.

The command runs in a subprocess as a user starts it; requests go over HTTP. No browser is
needed (tests/test_web.py drives the page itself).
"""

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from export import convert
from export.web import files
from export.web.drive import Served
from tests.chromium import needs_litert_js
from tests.exported_runs import REPO_ROOT
from tests.exported_runs import small_femnist_model
from tests.exported_runs import write_run

pytestmark = needs_litert_js


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
  """A FedAvg run of an untrained small CNN, its float file and a file that is not TFLite."""
  directory = tmp_path_factory.mktemp("web_server")
  run = write_run(directory / "run", [small_femnist_model(0)], summary={"test_accuracy": 0.5})
  flatbuffer = convert.export_run(run, "float")
  (directory / "model.tflite").write_bytes(flatbuffer)
  (directory / "notes.tflite").write_bytes(b"not a model\n")
  return directory


@pytest.fixture(scope="module")
def served(small_run):
  page = Served(
    str(small_run / "run"), [str(small_run / "model.tflite"), str(small_run / "notes.tflite")]
  )
  yield page
  page.close()


# A direct client: urlopen's global opener keeps the proxy of the first test that used it
# (tests/test_femnist.py sets one that refuses every connection).
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, method: str = "GET") -> tuple[int, dict, bytes]:
  request = urllib.request.Request(url, method=method)
  try:
    with _DIRECT.open(request, timeout=30) as response:
      return response.status, dict(response.headers), response.read()
  except urllib.error.HTTPError as e:
    return e.code, dict(e.headers), e.read()


def test_serves_the_page_litert_and_the_named_files(served, small_run):
  for path, content_type in [
    ("", "text/html"),
    ("app.js", "text/javascript"),
    ("litert/core.js", "text/javascript"),
    ("litert/wasm/litert_wasm_internal.wasm", "application/wasm"),
    ("files/model.tflite", "application/octet-stream"),
  ]:
    status, headers, body = _get(served.url + path)
    assert status == 200, path
    assert headers["Content-Type"].startswith(content_type)
    assert headers["Cache-Control"] == "no-store"
    assert headers["Referrer-Policy"] == "no-referrer"
    assert "script-src 'self' 'wasm-unsafe-eval' 'sha256-" in headers["Content-Security-Policy"]
  assert _get(served.url + "files/model.tflite")[2] == (small_run / "model.tflite").read_bytes()
  config = json.loads(_get(served.url + "config.json")[2])
  by_name = {f["name"]: f for f in config["files"]}
  assert by_name["model.tflite"]["metadata"]["format"] == "float"
  assert by_name["model.tflite"]["problem"] is None
  assert config["run"]["test_accuracy"] == 0.5


@pytest.mark.parametrize(
  "path",
  [
    "/",
    "/index.html",
    "/{token}",
    "/{other}/",
    "/{token}/../export/web/server.py",
    "/{token}/%2e%2e/pyproject.toml",
    "/{token}/files/",
    "/{token}/files/run/config.json",
    "/{token}/static/index.html",
    "/{token}/litert/",
    "/{token}/litert/wasm/litert_wasm_jspi_internal.wasm",
    "/{token}/node_modules/@litertjs/core/package.json",
    "/{token}x/",
  ],
)
def test_every_other_path_is_404(path, served):
  origin, token = served.url.rstrip("/").rsplit("/", 1)
  other = token[:-1] + ("A" if token[-1] != "A" else "B")
  status, _, body = _get(origin + path.format(token=token, other=other))
  assert status == 404 and body == b"not found\n"


def test_writes_and_listings_are_refused(served):
  assert _get(served.url + "files/model.tflite", method="POST")[0] == 501
  assert _get(served.url + "files/model.tflite", method="PUT")[0] == 501
  status, headers, body = _get(served.url + "config.json", method="HEAD")
  assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_binds_the_loopback_with_a_new_unguessable_token(served, small_run):
  assert served.url.startswith("http://127.0.0.1:")
  token = served.url.rstrip("/").rsplit("/", 1)[1]
  # secrets.token_urlsafe(16): 128 random bits, 22 URL-safe characters.
  assert len(token) == 22 and set(token) <= set(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
  )
  again = Served(str(small_run / "run"), [str(small_run / "model.tflite")])
  try:
    assert again.url.rstrip("/").rsplit("/", 1)[1] != token
  finally:
    again.close()
  port = int(served.url.split(":")[2].split("/")[0])
  lan = _this_machines_address()
  if lan is not None:  # Not reachable from the network.
    with pytest.raises(OSError):
      socket.create_connection((lan, port), timeout=5).close()


def _this_machines_address() -> str | None:
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    try:
      probe.connect(("10.255.255.255", 1))
      address = probe.getsockname()[0]
    except OSError:
      return None
  return None if address.startswith("127.") else address


def test_all_interfaces_print_the_network_url_and_a_qr_code(small_run):
  page = Served(str(small_run / "run"), [str(small_run / "model.tflite")], "--host=0.0.0.0")
  try:
    text = "\n".join(page.lines)
    assert "http://127.0.0.1:" in text
    if _this_machines_address():
      assert f"http://{_this_machines_address()}:" in text
      # segno's compact terminal QR code: rows of half-block characters.
      assert sum("\u2580" in line or "\u2584" in line for line in page.lines) >= 10
    status, _, _ = _get(page.url)
    assert status == 200
  finally:
    page.close()


@pytest.mark.parametrize(
  "arguments, message",
  [
    (["--tflite=x.tflite"], "error: --run_dir and --tflite are required"),
    (["--run_dir={dir}/nowhere", "--tflite=x"], "is not a directory: pass the --output_dir"),
    (["--run_dir={dir}/run", "--tflite={dir}/missing.tflite"], "error: cannot read --tflite="),
    (
      ["--run_dir={dir}/run", "--tflite={dir}/model.tflite,{dir}/model.tflite"],
      "error: two --tflite files are named model.tflite: rename one",
    ),
    (["--run_dir={dir}/run", "--tflite={dir}/model.tflite", "--host=phone"], "is not an IP"),
  ],
)
def test_bad_arguments_are_one_line(arguments, message, small_run):
  result = subprocess.run(
    [sys.executable, "-m", "export.web", *(a.format(dir=small_run) for a in arguments)],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_port_in_use_is_one_line(small_run):
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    result = subprocess.run(
      [
        sys.executable,
        "-m",
        "export.web",
        f"--run_dir={small_run / 'run'}",
        f"--tflite={small_run / 'model.tflite'}",
        f"--port={port}",
      ],
      cwd=REPO_ROOT,
      capture_output=True,
      text=True,
      timeout=120,
    )
  assert result.returncode == 2
  assert result.stderr.strip() == (
    f"error: cannot listen on 127.0.0.1:{port} (Address already in use): pass another --port "
    "(0: any free one)"
  )


def test_files_litert_js_cannot_run_are_named_with_their_fix(small_run, tmp_path):
  run = write_run(
    tmp_path / "ensemble", [small_femnist_model(0), small_femnist_model(1)], {"client_lr": 0.1}
  )
  cases = {
    "dynamic ensemble": (convert.describe(run, "ensemble"), "declares a dynamic batch"),
    "trainable": (convert.describe(run, "trainable"), "export --format=float for the web"),
    "int8 tensors": (
      convert.describe(run, "int8", quantized_io=True),
      "takes and returns int8 tensors, which LiteRT.js cannot feed",
    ),
    "lce": (convert.describe(run, "lce"), "larq-compute-engine's custom ops"),
    "LSTM state": (
      {**convert.describe(run, "float"), "reset_variables": convert.RESET_VARIABLES},
      "cannot reset between predictions",
    ),
  }
  for kind, (description, expected) in cases.items():
    line = files.problem(description, "f.tflite")
    assert line.startswith("f.tflite ") and expected in line and "\n" not in line, kind
  for runnable in (
    convert.describe(run, "float"),
    convert.describe(run, "dynamic"),
    convert.describe(run, "ensemble", static_batch=1),
    convert.describe(run, "int8", static_batch=1),
  ):
    assert files.problem(runnable, "f.tflite") is None
  assert "not a TFLite flatbuffer" in files.describe(str(small_run / "notes.tflite"))["problem"]
  truncated = tmp_path / "half.tflite"
  truncated.write_bytes((small_run / "model.tflite").read_bytes()[:300])
  assert "corrupted or truncated" in files.describe(str(truncated))["problem"]
