"""The run's server for browser clients: pages that train a trainable file in LiteRT.js.

`ClientServer(trainable_path, host, port)` serves, under `/<token>/` (`server.handler`: the
token new at each run, compared in constant time, 404 for anything else, no listing, the
same headers and Content-Security-Policy), the client page (`static/client.html`), LiteRT.js,
the file (`trainable.tflite`) and these paths:

- `events?name=NAME`: a Server-Sent Events stream, one per page: `hello` {"name"} once, then
  `task` {"id", "model", "batch_size", "steps", "num_examples"} when the page is given one,
  and a comment every second, whose failed write is how a closed page is noticed;
- `tasks/ID/weights|x|y|order`: the task's data, raw little-endian arrays (float32 weights
  of the model the page starts from, concatenated; float32 x; int32 y; int32 order);
- `POST tasks/ID/result`: the trained weights, then each step's loss, then each step's
  correct predictions, float32, exactly that many bytes.

A page is a `Client`; the driver (`tff_ens.program.browser_clients`) hands tasks to idle
clients with `Client.run`, which returns the result, or None if the page went away or kept
the task past its deadline.
"""

import dataclasses
import itertools
import json
import queue
import re
import threading
import time

import numpy as np

from export.web import server

CLIENT_FILES = ("client.html", "client.js", "trainer.js", "tffens.js", "style.css")
OCTETS = "application/octet-stream"
PING_SECONDS = 1.0
LATE = "did not return its task in"  # Why a page that kept its task too long left.
_NAME = re.compile(r"[^A-Za-z0-9_.-]")
_TASK_PATH = re.compile(r"tasks/(\d+)/(weights|x|y|order|result)")


@dataclasses.dataclass
class Task:
  """One client's local training as the page receives it, and its result."""

  id: int
  model: int
  batch_size: int
  weights: bytes
  x: bytes
  y: bytes
  order: bytes
  num_examples: int
  num_weights: int
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  result: np.ndarray | None = None

  @property
  def steps(self) -> int:
    return -(-self.num_examples // self.batch_size)

  def header(self) -> dict:
    return {
      "id": self.id,
      "model": self.model,
      "batch_size": self.batch_size,
      "steps": self.steps,
      "num_examples": self.num_examples,
    }

  def accept(self, body: bytes) -> bool:
    """Takes the page's result if it has the expected size."""
    if len(body) != 4 * (self.num_weights + 2 * self.steps) or self.done.is_set():
      return False
    self.result = np.frombuffer(body, "<f4").astype(np.float32)
    self.done.set()
    return True


class Client:
  """One connected page: its name, the task it trains, whether it is gone."""

  def __init__(self, name: str):
    self.name = name
    self.task: Task | None = None
    self.gone = threading.Event()
    self.why_gone = ""
    self._sends = queue.Queue()

  def run(self, task: Task, seconds: float | None = None) -> np.ndarray | None:
    """`task` trained by this page: its result, or None if the page went away or did not
    return it within `seconds` of receiving it (then it leaves: no more tasks go to it)."""
    self.task = task
    self._sends.put(task)
    deadline = None if seconds is None else time.monotonic() + seconds
    while not task.done.wait(PING_SECONDS):
      if deadline is not None and time.monotonic() >= deadline:
        self.leave(f"{LATE} {seconds:g} s")
      if self.gone.is_set():
        return None
    self.task = None
    return task.result

  @property
  def late(self) -> bool:
    """Whether it left for keeping a task past its deadline."""
    return self.why_gone.startswith(LATE)

  def leave(self, why: str = "went away"):
    if not self.gone.is_set():
      self.why_gone = why
    self.gone.set()
    self._sends.put(None)

  def stream(self, write) -> None:
    """Writes this client's events with `write(bytes)` until it is gone or a write fails."""
    write(_event("hello", {"name": self.name}))
    while not self.gone.is_set():
      try:
        task = self._sends.get(timeout=PING_SECONDS)
      except queue.Empty:
        write(b": ping\n\n")
        continue
      if task is not None:
        write(_event("task", task.header()))


def _event(kind: str, data: dict) -> bytes:
  return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


class ClientServer:
  """The pages' HTTP server (module docstring) on host:port, in a thread."""

  def __init__(self, trainable_path: str, host: str = "127.0.0.1", port: int = 0):
    self.token = server.new_token()
    table = server.page_resources("client.html", CLIENT_FILES)
    table["trainable.tflite"] = server.Resource(OCTETS, trainable_path)
    self.joined = queue.Queue()  # Clients as they connect.
    self.clients: list[Client] = []
    self._tasks: dict[int, Task] = {}
    self._ids = itertools.count()
    self._numbers = itertools.count(1)
    self._lock = threading.Lock()
    self.httpd = server.listen(
      host, port, self._handler(server.handler(self.token, table, "client.html"))
    )
    self.host, self.port = host, self.httpd.server_address[1]
    self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
    self._thread.start()

  def urls(self) -> list[str]:
    """The page's URLs (`server.page_urls`)."""
    return server.page_urls(self.host, self.port, self.token)

  def task(self, **fields) -> Task:
    """A new task, served until `finish`."""
    with self._lock:
      task = Task(id=next(self._ids), **fields)
      self._tasks[task.id] = task
    return task

  def finish(self, task: Task):
    with self._lock:
      self._tasks.pop(task.id, None)

  def _connect(self, name: str) -> Client:
    client = Client(f"{_NAME.sub('', name)[:40] or 'browser'}#{next(self._numbers)}")
    with self._lock:
      self.clients.append(client)
    self.joined.put(client)
    return client

  def _handler(self, base: type) -> type:
    owner = self

    class Handler(base):
      def dynamic(self, rel: str, head: bool) -> bool:
        if rel == "events" and not head:
          return self._events()
        match = _TASK_PATH.fullmatch(rel)
        task = match and owner._tasks.get(int(match.group(1)))
        if task is None or match.group(2) == "result":
          return False
        self.send(200, OCTETS, getattr(task, match.group(2)), head)
        return True

      def do_POST(self):  # noqa: N802 (http.server's name)
        match = _TASK_PATH.fullmatch(self.relative_path() or "")
        task = match and match.group(2) == "result" and owner._tasks.get(int(match.group(1)))
        length = int(self.headers.get("Content-Length") or -1)
        if not task or not 0 <= length <= len(task.weights) + 8 * task.steps:
          return self.not_found()
        if not task.accept(self.rfile.read(length)):
          return self.send(400, "text/plain; charset=utf-8", b"wrong result size\n")
        self.send(204, "text/plain; charset=utf-8", b"")

      def _events(self) -> bool:
        query = self.path.split("?", 1)[1] if "?" in self.path else ""
        name = dict(p.split("=", 1) for p in query.split("&") if "=" in p).get("name", "")
        client = owner._connect(name)
        self.send_head(200, "text/event-stream", None)

        def write(data: bytes):
          self.wfile.write(data)
          self.wfile.flush()

        try:
          client.stream(write)
        except OSError:
          pass
        finally:
          client.leave()
        return True

    return Handler

  def close(self):
    for client in self.clients:
      client.leave()
    self.httpd.shutdown()
    self.httpd.server_close()
