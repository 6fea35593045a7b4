"""The web page of `python -m export.web`: a run's exported files in the browser's LiteRT.js.

`__main__` is the command, `server` the read-only HTTP server (a per-launch token in every
path), `files` what the page is told about each file; `static/` holds the page (plain ES
modules, no build step) and `package.json` / `package-lock.json` LiteRT.js (`npm ci` here).
"""
