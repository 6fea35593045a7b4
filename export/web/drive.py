"""The page driven from Python, by the tests and the benchmark: `python -m export.web` in a
subprocess (`Served`) and the system's Chromium (Debian's `chromium`, `apt-get install
chromium`) through Playwright, never Playwright's own browser download; headless, with a new
empty profile (`browser`)."""

import contextlib
import os
import re
import shutil
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Headless in a container, without reaching out (no sandbox: the container is the sandbox).
FLAGS = (
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
)


@contextlib.contextmanager
def browser():
  """Headless Chromium (Playwright's `chromium.launch` on the system binary), closed after."""
  from playwright.sync_api import sync_playwright

  with sync_playwright() as playwright:
    chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
    try:
      yield chromium
    finally:
      chromium.close()


class Served:
  """`python -m export.web` in a subprocess on a free port: its URL and first lines."""

  def __init__(self, run_dir: str, paths: list[str], *flags: str):
    self.process = subprocess.Popen(
      [
        sys.executable,
        "-m",
        "export.web",
        f"--run_dir={run_dir}",
        f"--tflite={','.join(paths)}",
        "--port=0",
        *flags,
      ],
      cwd=REPO_ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    self.lines = []
    self.url = None
    for line in self.process.stdout:
      self.lines.append(line.rstrip("\n"))
      if match := re.search(r"(http://\S+/)$", line.strip()):
        self.url = match.group(1)
      if line.startswith("only these URLs"):
        break
    if self.url is None:
      self.close()
      raise RuntimeError("export.web did not start:\n" + "\n".join(self.lines))

  def close(self):
    self.process.terminate()
    self.process.wait(timeout=30)
    self.process.stdout.close()
