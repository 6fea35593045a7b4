"""The reference pages list what the code has: every algorithm, every module."""

import pathlib
import re

import pytest

from tff_ens import algorithms

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _algorithm_table(page: str) -> list[str]:
  """The first cells of the rows of a page's table headed `--algorithm`."""
  table = re.search(
    r"^\| `--algorithm` \|.*\n\|[- |]+\n((?:\|.*\n)+)", (ROOT / page).read_text(), re.M
  )
  return re.findall(r"^\| `([^`]+)` \|", table.group(1), re.MULTILINE)


@pytest.mark.parametrize("page", ["README.md", "docs/algorithms.md"])
def test_the_algorithm_tables_list_the_registry(page):
  assert _algorithm_table(page) == list(algorithms.ALGORITHMS)


def test_the_layout_names_every_module():
  text = (ROOT / "docs/layout.md").read_text()
  sections = dict(re.findall(r"^## `([a-z_/]+)/`[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S))
  packages = ["tasks", "export", "tff_ens"]
  packages += [str(p.parent.relative_to(ROOT)) for p in ROOT.glob("tff_ens/*/__init__.py")]
  for package in packages:
    listed = set(re.findall(r"^\| `([^`]+\.py)` \|", sections[package], re.MULTILINE))
    modules = {path.name for path in (ROOT / package).glob("*.py")}
    assert modules == listed, package
