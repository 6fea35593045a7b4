r"""Command line: serve a page that runs a run's exported files in the browser (LiteRT.js).

  python -m export.web --run_dir=RUN --tflite=FILE[,FILE] [--port=8000] [--host=127.0.0.1]

Prints the page's URL, `http://HOST:PORT/<token>/`, whose token is new at every launch, and
with a --host other than the loopback a QR code of it for a phone on the same network. The
server is read-only and serves only the page, LiteRT.js (installed by `npm ci` in
export/web/) and the named files (`server`); every other path is 404. Ctrl-C stops it.
"""

import json
import os
import sys

from absl import app
from absl import flags

from export import ExportError
from export import runs
from export.web import files
from export.web import server

FLAGS = flags.FLAGS
SUMMARY_KEYS = (
  "test_accuracy",
  "personalized_accuracy",
  "ood_auroc_entropy",
  "ood_auroc_mutual_information",
)


def define_flags():
  flags.DEFINE_string("run_dir", None, "The tff_ens.main run the files were exported from.")
  flags.DEFINE_list("tflite", None, "The .tflite file(s) to serve, comma-separated (required).")
  flags.DEFINE_integer("port", 8000, "The port (0: any free one).")
  flags.DEFINE_string(
    "host",
    server.LOOPBACK,
    "The address to listen on: 127.0.0.1 (this machine only) or, for a phone on the same "
    "network, 0.0.0.0; the page needs the URL's token either way.",
  )


def config(run: runs.Run, paths: list[str]) -> tuple[bytes, dict[str, str]]:
  """config.json's bytes and the URL name -> path of each file; ExportError on a bad one."""
  entries = [files.describe(path) for path in paths]
  names = [e["name"] for e in entries]
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise ExportError(f"two --tflite files are named {twice[0]}: rename one")
  run_info = {
    "algorithm": run.config.get("algorithm"),
    "task": run.task_name,
    "classes": run.classes,
    "rounds": run.config.get("rounds"),
    **{key: run.summary.get(key) for key in SUMMARY_KEYS},
  }
  body = json.dumps({"run": run_info, "files": entries}).encode()
  return body, dict(zip(names, paths))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    if not FLAGS.run_dir or not FLAGS.tflite:
      raise ExportError("--run_dir and --tflite are required (see --help)")
    run = runs.load_run(FLAGS.run_dir)
    body, tflite_files = config(run, FLAGS.tflite)
    token = server.new_token()
    table = server.resources(body, tflite_files)
    httpd = server.listen(FLAGS.host, FLAGS.port, server.handler(token, table))
  except ExportError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  port = httpd.server_address[1]
  for entry in json.loads(body)["files"]:
    if entry["problem"]:
      print(f"warning: {entry['problem']}", file=sys.stderr)
  urls = server.page_urls(FLAGS.host, port, token)
  print(f"serving {len(tflite_files)} file(s) of {os.path.abspath(FLAGS.run_dir)}; open")
  for url in urls:
    print(f"  {url}")
  if not urls[-1].startswith(f"http://{server.LOOPBACK}:"):  # A URL for another machine: a phone's.
    print(server.qr_text(urls[-1]), end="")
  print("only these URLs open the page (the token is new at each launch); Ctrl-C stops", flush=True)
  try:
    httpd.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    httpd.server_close()
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
