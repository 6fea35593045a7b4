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
import os
import re
import secrets

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
  missing = [rel for rel in LITERT_FILES.values() if not os.path.isfile(_litert(rel))]
  if missing:
    raise ExportError(
      f"LiteRT.js is not installed ({_litert(missing[0])} is missing): run `npm ci` in "
      f"{os.path.dirname(PAGE_DIR)}"
    )
  table = {"": Resource(CONTENT_TYPES[".html"], os.path.join(PAGE_DIR, "index.html"))}
  for name in PAGE_FILES:
    table[name] = Resource(_content_type(name), os.path.join(PAGE_DIR, name))
  for url, rel in LITERT_FILES.items():
    table[url] = Resource(_content_type(url), _litert(rel))
  table["config.json"] = Resource(CONTENT_TYPES[".json"], body=config)
  for name, path in tflite_files.items():
    table[f"files/{name}"] = Resource(CONTENT_TYPES[".tflite"], path)
  return table


def _litert(rel: str) -> str:
  return os.path.join(LITERT_DIR, *rel.split("/"))


def _content_type(name: str) -> str:
  return CONTENT_TYPES[os.path.splitext(name)[1]]


def content_security_policy() -> str:
  """Scripts from the page's origin only, plus its inline import map (by hash) and WASM
  compilation; no plugins, frames, forms or other origins."""
  with open(os.path.join(PAGE_DIR, "index.html"), encoding="utf-8") as f:
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


def handler(token: str, table: dict[str, Resource]) -> type:
  """A request handler class serving `table` under `/<token>/`, 404 for anything else."""
  prefix = f"/{token}/"
  policy = content_security_policy()

  class Handler(http.server.BaseHTTPRequestHandler):
    server_version = "tff-ens-web"
    sys_version = ""

    def do_GET(self):  # noqa: N802 (http.server's name)
      self._respond(head=False)

    def do_HEAD(self):  # noqa: N802
      self._respond(head=True)

    def _respond(self, head: bool):
      path = self.path.split("?", 1)[0].split("#", 1)[0]
      given = path[: len(prefix)]
      resource = None
      if len(given) == len(prefix) and hmac.compare_digest(given.encode(), prefix.encode()):
        resource = table.get(path[len(prefix) :])
      if resource is None:
        return self._send(404, "text/plain; charset=utf-8", b"not found\n", head)
      try:
        body = resource.read()
      except OSError:
        return self._send(404, "text/plain; charset=utf-8", b"not found\n", head)
      self._send(200, resource.content_type, body, head)

    def _send(self, status: int, content_type: str, body: bytes, head: bool):
      self.send_response(status)
      for name, value in (
        ("Content-Type", content_type),
        ("Content-Length", str(len(body))),
        ("Cache-Control", "no-store"),
        ("Referrer-Policy", "no-referrer"),
        ("X-Content-Type-Options", "nosniff"),
        ("Cross-Origin-Resource-Policy", "same-origin"),
        ("Content-Security-Policy", policy),
      ):
        self.send_header(name, value)
      self.end_headers()
      if not head:
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 (http.server's name)
      """Quiet: a request line would print the token to the log."""

  return Handler
