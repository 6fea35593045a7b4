"""The read-only HTTP server of `python -m export.web`.

It serves a table of URL paths fixed at launch, each under `/<token>/`: the page
(`static/`), LiteRT.js and the two WASM builds it picks from (`node_modules/@litertjs`,
installed by `npm ci` in this directory), `config.json` (the files' metadata and problems,
`files.describe`) and the named .tflite files. The token is `secrets.token_urlsafe(16)`,
new at every launch, compared in constant time. Any other path, any other method, and a
path with the wrong token get 404; nothing else on the disk is reachable, and there is no
directory listing. Every response forbids caching, referrers (the token is in the URL),
framing and scripts from anywhere but the page itself (a Content-Security-Policy).
"""

import base64
import dataclasses
import hashlib
import hmac
import http.server
import io
import ipaddress
import os
import re
import secrets
import socket

from export import ExportError

PAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
LITERT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_modules", "@litertjs")
# The page's files, LiteRT.js's and the WASM builds it loads without threads or JSPI
# (relaxed SIMD, or the compat build where the browser has none).
PAGE_FILES = ("index.html", "app.js", "tffens.js", "drawing.js", "style.css")
LITERT_FILES = {
  "litert/core.js": "core/dist/index.js",
  "litert/wasm-utils.js": "wasm-utils/dist/index.js",
  **{
    f"litert/wasm/{name}": f"core/wasm/{name}"
    for build in ("litert_wasm_internal", "litert_wasm_compat_internal")
    for name in (f"{build}.js", f"{build}.wasm")
  },
}
CONTENT_TYPES = {
  ".html": "text/html; charset=utf-8",
  ".js": "text/javascript; charset=utf-8",
  ".css": "text/css; charset=utf-8",
  ".json": "application/json",
  ".wasm": "application/wasm",
  ".tflite": "application/octet-stream",
}
TOKEN_BYTES = 16
LOOPBACK = "127.0.0.1"
_IMPORT_MAP = re.compile(r'<script type="importmap">(.*?)</script>', re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Resource:
  """What one URL path serves: a file on disk or bytes made at launch."""

  content_type: str
  path: str | None = None
  body: bytes | None = None

  def read(self) -> bytes:
    if self.body is not None:
      return self.body
    with open(self.path, "rb") as f:
      return f.read()


def resources(config: bytes, tflite_files: dict[str, str]) -> dict[str, Resource]:
  """The table: relative URL path -> Resource, for `config` (config.json's bytes) and
  `tflite_files` (URL name -> path). ExportError if LiteRT.js is not installed."""
  table = page_resources("index.html", PAGE_FILES)
  table["config.json"] = Resource(CONTENT_TYPES[".json"], body=config)
  for name, path in tflite_files.items():
    table[f"files/{name}"] = Resource(CONTENT_TYPES[".tflite"], path)
  return table


def page_resources(page: str, names: tuple[str, ...]) -> dict[str, Resource]:
  """`page` at the root, the `static/` files `names` and LiteRT.js's; ExportError if
  LiteRT.js is not installed."""
  missing = [rel for rel in LITERT_FILES.values() if not os.path.isfile(_litert(rel))]
  if missing:
    raise ExportError(
      f"LiteRT.js is not installed ({_litert(missing[0])} is missing): run `npm ci` in "
      f"{os.path.dirname(PAGE_DIR)}"
    )
  table = {"": Resource(CONTENT_TYPES[".html"], os.path.join(PAGE_DIR, page))}
  for name in names:
    table[name] = Resource(_content_type(name), os.path.join(PAGE_DIR, name))
  for url, rel in LITERT_FILES.items():
    table[url] = Resource(_content_type(url), _litert(rel))
  return table


def _litert(rel: str) -> str:
  return os.path.join(LITERT_DIR, *rel.split("/"))


def _content_type(name: str) -> str:
  return CONTENT_TYPES[os.path.splitext(name)[1]]


def content_security_policy(page: str = "index.html") -> str:
  """Scripts from the page's origin only, plus its inline import map (by hash) and WASM
  compilation; no plugins, frames, forms or other origins."""
  with open(os.path.join(PAGE_DIR, page), encoding="utf-8") as f:
    (import_map,) = _IMPORT_MAP.findall(f.read())
  digest = base64.b64encode(hashlib.sha256(import_map.encode()).digest()).decode()
  return (
    "default-src 'none'; "
    f"script-src 'self' 'wasm-unsafe-eval' 'sha256-{digest}'; "
    "connect-src 'self'; img-src 'self' data:; style-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
  )


def new_token() -> str:
  return secrets.token_urlsafe(TOKEN_BYTES)


def handler(token: str, table: dict[str, Resource], page: str = "index.html") -> type:
  """A request handler class serving `table` under `/<token>/`, 404 for anything else.

  A subclass adds paths by overriding `dynamic(rel, head)` (True if it answered) and methods
  by calling `relative_path()`, which is None for a wrong token."""
  prefix = f"/{token}/"
  policy = content_security_policy(page)

  class Handler(http.server.BaseHTTPRequestHandler):
    server_version = "tff-ens-web"
    sys_version = ""

    def do_GET(self):  # noqa: N802 (http.server's name)
      self._respond(head=False)

    def do_HEAD(self):  # noqa: N802
      self._respond(head=True)

    def relative_path(self) -> str | None:
      """The request's path after `/<token>/` (no query), or None for a wrong token."""
      path = self.path.split("?", 1)[0].split("#", 1)[0]
      given = path[: len(prefix)]
      if len(given) == len(prefix) and hmac.compare_digest(given.encode(), prefix.encode()):
        return path[len(prefix) :]
      return None

    def dynamic(self, rel: str, head: bool) -> bool:
      """Answers a path that is not in the table (a subclass's); False if it is not one."""
      return False

    def _respond(self, head: bool):
      rel = self.relative_path()
      if rel is not None and rel not in table and self.dynamic(rel, head):
        return
      resource = None if rel is None else table.get(rel)
      if resource is None:
        return self.not_found(head)
      try:
        body = resource.read()
      except OSError:
        return self.not_found(head)
      self.send(200, resource.content_type, body, head)

    def not_found(self, head: bool = False):
      self.send(404, "text/plain; charset=utf-8", b"not found\n", head)

    def send_head(self, status: int, content_type: str, length: int | None):
      """The status line and headers (no Content-Length for a stream)."""
      self.send_response(status)
      for name, value in (
        ("Content-Type", content_type),
        *([("Content-Length", str(length))] if length is not None else []),
        ("Cache-Control", "no-store"),
        ("Referrer-Policy", "no-referrer"),
        ("X-Content-Type-Options", "nosniff"),
        ("Cross-Origin-Resource-Policy", "same-origin"),
        ("Content-Security-Policy", policy),
      ):
        self.send_header(name, value)
      self.end_headers()

    def send(self, status: int, content_type: str, body: bytes, head: bool = False):
      self.send_head(status, content_type, len(body))
      if not head:
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 (http.server's name)
      """Quiet: a request line would print the token to the log."""

  return Handler


def listen(host: str, port: int, handler: type) -> http.server.ThreadingHTTPServer:
  """A threading server of `handler` (a `server.handler` class) on host:port; ExportError
  naming the fix if it cannot listen there."""
  try:
    address = ipaddress.ip_address(host)
  except ValueError:
    raise ExportError(f"--host={host} is not an IP address: use 127.0.0.1 or 0.0.0.0") from None

  class Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    daemon_threads = True

  try:
    return Server((host, port), handler)
  except OSError as e:
    raise ExportError(
      f"cannot listen on {host}:{port} ({e.strerror}): pass another --port (0: any free one)"
    ) from None


def page_urls(host: str, port: int, token: str) -> list[str]:
  """The URLs to open: the loopback's, and with a wildcard host this machine's address on
  the network it routes through (found without sending anything)."""
  hosts = [host] if host not in ("0.0.0.0", "::") else [LOOPBACK]
  if host in ("0.0.0.0", "::"):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
      try:
        probe.connect(("10.255.255.255", 1))  # UDP: sets a route, sends no packet.
        hosts.append(probe.getsockname()[0])
      except OSError:
        pass
  return [f"http://{h if ':' not in h else f'[{h}]'}:{port}/{token}/" for h in hosts]


def qr_text(url: str) -> str:
  """`url` as a QR code drawn with terminal block characters."""
  import segno

  drawn = io.StringIO()
  segno.make(url, error="m").terminal(out=drawn, compact=True)
  return drawn.getvalue()
