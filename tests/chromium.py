"""The web tests' pytest plugin (tests/conftest.py): what they need, their shared run, and
the one line that says how to get what is missing.

A test module marked `needs_browser` is skipped on a machine without Chromium (driven by
Playwright, never its own browser download) or without LiteRT.js (`npm ci` in export/web/);
nothing is installed by a test, and the run's summary ends with one line naming what to
install when such tests were skipped. The `web_run` and `served` fixtures make the exported
run of `tests.web_runs` (imported only when a test asks for it) and serve it, once per
session.
"""

import os

import pytest

from export.web.drive import CHROMIUM

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LITERT_JS = os.path.join(REPO_ROOT, "export", "web", "node_modules", "@litertjs", "core")
MISSING_PREFIX = "web tests need"


CHROMIUM_MISSING = "Chromium (apt-get install -y chromium, as root)"
LITERT_JS_MISSING = "LiteRT.js (npm ci --prefix export/web)"


def missing() -> str | None:
  """What the browser tests lack, as the line to print, or None."""
  lacking = [
    what
    for what, there in (
      (CHROMIUM_MISSING, os.path.exists(CHROMIUM)),
      (LITERT_JS_MISSING, os.path.isdir(LITERT_JS)),
    )
    if not there
  ]
  return f"{MISSING_PREFIX} {' and '.join(lacking)}" if lacking else None


needs_browser = pytest.mark.skipif(missing() is not None, reason=str(missing()))
# The server's tests need LiteRT.js only (it serves its files).
needs_litert_js = pytest.mark.skipif(
  not os.path.isdir(LITERT_JS), reason=f"{MISSING_PREFIX} {LITERT_JS_MISSING}"
)


@pytest.fixture(scope="session")
def web_run(tmp_path_factory):
  from tests import web_runs

  return web_runs.make_web_run(tmp_path_factory.mktemp("web_run"))


@pytest.fixture(scope="session")
def served(web_run):
  """The web run's files served by `python -m export.web` for the session."""
  from export.web.drive import Served
  from tests import web_runs

  names = [*web_runs.WEB_FILES, *web_runs.BAD_FILES]
  server = Served(web_run.run_dir, [web_run.path(n) for n in names])
  yield server
  server.close()


def pytest_terminal_summary(terminalreporter):
  skipped = [
    r
    for r in terminalreporter.stats.get("skipped", [])
    if isinstance(r.longrepr, tuple) and MISSING_PREFIX in str(r.longrepr[2])
  ]
  if skipped:  # The longest reason names everything missing.
    reason = max((str(r.longrepr[2]) for r in skipped), key=len).removeprefix("Skipped: ")
    terminalreporter.write_line(f"{len(skipped)} skipped: {reason}")
