"""Clients whose local training runs in browsers: LiteRT.js pages, phones' or headless ones.

With `--client_runtime=browser`, each sampled client trains as with `--client_runtime=litert`
(`device_clients`: the same order, batches, learning rate and momentum, from the weights the
server sent), but in a browser page (`export/web/static/client.html`, LiteRT.js in
WebAssembly) that the run's server (`export.web.client_server`) sends the task to. The file
is the run's `--format=trainable` file with a fixed batch of `--batch_size` (LiteRT.js runs
only declared shapes), whose steps equal the dynamic file's (`export.trainable`).

`--browser_clients=headless` opens `--device_processes` pages of headless Chromium (the
system's, through Playwright); `--browser_clients=HOST:PORT` listens there, prints the page's
URL (with the run's token) and a QR code, and waits until that many browsers, phones on the
same network say, have opened it. A page that goes away (closed, reloaded, offline) is a
dropout: its client is left out of the round with a one-line warning naming both, and the
next idle page takes the next task; a page that joins later is used too.
"""

import concurrent.futures
import importlib.util
import ipaddress
import logging
import os
import queue
import threading
import time

import numpy as np

from export.web import client_server
from export.web import drive
from export.web import server
from tff_ens.program import device_clients

HEADLESS = "headless"
_PAGE_NAME = "headless-"  # A headless page's name: this, then its opening index.
# How long headless pages may take to load LiteRT.js and the file and connect.
HEADLESS_START_SECONDS = 120.0


def address(browser_clients: str) -> tuple[str, int] | None:
  """None for headless pages, or the (host, port) of `--browser_clients=HOST:PORT`;
  ValueError with the one line that says what is wrong."""
  if browser_clients == HEADLESS:
    return None
  host, _, port = browser_clients.rpartition(":")
  try:
    ipaddress.ip_address(host.strip("[]"))
    if not 0 <= int(port) < 65536:
      raise ValueError
  except ValueError:
    raise ValueError(
      f"--browser_clients={browser_clients} is neither headless nor HOST:PORT (an IP address "
      "and a port): use e.g. --browser_clients=0.0.0.0:8765 for phones on this network"
    ) from None
  return host.strip("[]"), int(port)


def missing(browser_clients: str) -> str | None:
  """What `--client_runtime=browser` lacks on this machine, as a one-line fix, or None."""
  if not os.path.isfile(os.path.join(server.LITERT_DIR, "core", "dist", "index.js")):
    return "--client_runtime=browser needs LiteRT.js: run `npm ci --prefix export/web`"
  if browser_clients != HEADLESS:
    return None
  if not os.path.exists(drive.CHROMIUM):
    return (
      f"--browser_clients=headless needs Chromium ({drive.CHROMIUM} is missing): "
      "apt-get install chromium, or pass --browser_clients=HOST:PORT and open the URL elsewhere"
    )
  if importlib.util.find_spec("playwright") is None:
    return "--browser_clients=headless needs Playwright: uv sync --locked (its dev group)"
  return None


class _Headless:
  """Headless Chromium pages on a URL, in a thread of their own (Playwright's sync API
  stays in the thread that started it)."""

  def __init__(self, url: str):
    self._url = url
    self._commands = queue.Queue()
    self.pages = 0
    self._thread = threading.Thread(target=self._serve, daemon=True)
    self._thread.start()

  def _serve(self):
    try:
      with drive.browser() as chromium:
        self._run_commands(chromium)
    except Exception as e:  # Chromium did not start: each command says so.
      while (command := self._commands.get()) is not None:
        command[2].set_exception(e)

  def _run_commands(self, chromium):
    pages = []
    while (command := self._commands.get()) is not None:
      kind, index, done = command
      try:
        if kind == "open":
          page = chromium.new_context().new_page()
          page.goto(f"{self._url}?name={_PAGE_NAME}{len(pages)}")
          pages.append(page)
        else:
          pages[index].context.close()
        done.set_result(None)
      except Exception as e:  # Reported to the caller.
        done.set_exception(e)

  def open(self) -> concurrent.futures.Future:
    done = concurrent.futures.Future()
    self._commands.put(("open", None, done))
    self.pages += 1
    return done

  def close_page(self, index: int):
    """Closes page `index` (in opening order), as a user closing the tab."""
    done = concurrent.futures.Future()
    self._commands.put(("close", index, done))
    done.result()

  def close(self):
    self._commands.put(None)
    self._thread.join(timeout=30)


class BrowserPool:
  """`num_clients` browser pages serving a run's clients (module docstring); the contract
  of `device_clients.DevicePool`."""

  def __init__(
    self,
    trainable_path: str,
    num_clients: int,
    browser_clients: str = HEADLESS,
    task_seconds: float | None = None,
  ):
    """`task_seconds`: how long a page may keep a client's task (None: no limit)."""
    where = address(browser_clients)
    host, port = where or (server.LOOPBACK, 0)
    self.server = client_server.ClientServer(trainable_path, host, port)
    self.headless = None
    self._num_clients = num_clients
    self._task_seconds = task_seconds
    self.step_losses: list[list[float] | None] = []  # The last `train`'s, per client.
    try:
      if where is None:
        self.headless = _Headless(self.server.urls()[0])
        self._open_pages(num_clients)
      else:
        _announce(self.server.urls(), num_clients)
      self._wait_for(num_clients, HEADLESS_START_SECONDS if where is None else None)
    except BaseException:
      self.close()
      raise

  def _open_pages(self, count: int):
    try:
      for _ in range(count):
        self.headless.open().result(timeout=HEADLESS_START_SECONDS)
    except Exception as e:
      first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise device_clients.DeviceError(
        f"headless Chromium did not open the client page ({first[:200]}): check that "
        f"{drive.CHROMIUM} --headless --no-sandbox runs here"
      ) from None

  def connected(self) -> int:
    return sum(not c.gone.is_set() for c in self.server.clients)

  def _wait_for(self, count: int, timeout: float | None):
    start, shown = time.monotonic(), None
    while (now := self.connected()) < count:
      if timeout is not None and time.monotonic() - start > timeout:
        raise device_clients.DeviceError(
          f"{count - now} of {count} headless Chromium page(s) did not connect in {timeout:.0f} s"
          f": check that {drive.CHROMIUM} runs (--no-sandbox) and LiteRT.js is installed"
        )
      if now != shown and timeout is None:
        print(f"{now} of {count} browser(s) connected", flush=True)
        shown = now
      time.sleep(0.1)
    if timeout is None:
      print(f"{count} browser(s) connected: training", flush=True)

  def train(self, models: list[list[np.ndarray]], requests: list[dict], names: list[str]) -> list:
    """`device_clients.DevicePool.train`: each request's client trained in a page (headless
    pages opened in place of those that went away first)."""
    if self.headless is not None:
      self._wait_for(self._num_clients, HEADLESS_START_SECONDS)
    weights = [np.concatenate([np.ravel(w) for w in m]).astype("<f4").tobytes() for m in models]
    shapes = [np.shape(w) for w in models[0]]
    self.step_losses = [None] * len(requests)

    def run(i: int):
      request = requests[i]
      task = self.server.task(
        model=request["model"],
        batch_size=request["batch_size"],
        weights=weights[request["model"]],
        x=np.ascontiguousarray(request["x"], "<f4").tobytes(),
        y=np.asarray(request["y"], "<i4").tobytes(),
        order=np.asarray(request["order"], "<i4").tobytes(),
        num_examples=len(request["order"]),
        num_weights=sum(int(np.prod(s)) for s in shapes),
      )
      try:
        return self._train_task(task, names[i], shapes, i)
      finally:
        self.server.finish(task)

    with concurrent.futures.ThreadPoolExecutor(max(1, len(requests))) as executor:
      return list(executor.map(run, range(len(requests))))

  def _train_task(self, task, name: str, shapes, i: int):
    """`task` trained by the next idle page; the client's result, or None if the page left."""
    while True:
      client = self.server.joined.get()
      if not client.gone.is_set():
        break
    result = client.run(task, self._task_seconds)
    if result is None:
      logging.warning(
        "browser client %s %s: client %s dropped from this round",
        client.name,
        client.why_gone,
        name,
      )
      if self.headless is not None:
        if client.late:  # Still open, but stuck: closed in place of being left running.
          self.headless.close_page(_page_index(client.name))
        self.headless.open()
      return None
    self.server.joined.put(client)
    offsets = np.cumsum([0, *(int(np.prod(s)) for s in shapes)])
    trained = [result[a:b].reshape(s) for a, b, s in zip(offsets, offsets[1:], shapes)]
    steps, n, size = task.steps, task.num_examples, task.batch_size
    losses, correct = result[offsets[-1] : offsets[-1] + steps], result[offsets[-1] + steps :]
    sizes = [min(size, n - k * size) for k in range(steps)]
    self.step_losses[i] = [float(v) for v in losses]
    loss = sum(b * float(v) for b, v in zip(sizes, losses))
    return trained, loss, float(sum(float(c) for c in correct)), n

  def close(self):
    if self.headless is not None:
      self.headless.close()
    self.server.close()


def _page_index(client_name: str) -> int:
  """The opening index of a headless page from its client's name ("headless-3#7": 3)."""
  return int(client_name.split("#")[0].removeprefix(_PAGE_NAME))


def _announce(urls: list[str], count: int):
  """The page's URLs and a QR code of the last one, for `count` browsers to open."""
  lines = [
    f"open this URL in {count} browser(s) (phones: scan the QR code); its token is the run's key:",
    *(f"  {url}" for url in urls),
  ]
  print("\n".join(lines) + "\n" + server.qr_text(urls[-1]), end="", flush=True)
