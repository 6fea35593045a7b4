"""Tests of benchmarks/full_size_femnist.py: a small resampled FEMNIST from real slice files,
read back through the task's LEAF loader, and the generator's refusals."""

import filecmp
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import full_size_femnist
from tasks import femnist
from tasks import leaf

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT.parent / "shared/data/femnist"
SCRIPT = REPO_ROOT / "benchmarks/full_size_femnist.py"
# Two train files of the slice and their test files: 10 writers with train and test data.
SLICE_FILES = ("all_data_0_niid_05_keep_0", "all_data_10_niid_05_keep_0")


@pytest.fixture(scope="module")
def small_slice(tmp_path_factory) -> pathlib.Path:
  """Two of the slice's file pairs as a LEAF directory (it loads in a second, the slice in ~10)."""
  root = tmp_path_factory.mktemp("slice")
  for split in ("train", "test"):
    (root / split).mkdir()
    for name in SLICE_FILES:
      shutil.copy(DATA_DIR / split / f"{name}_{split}_9.json", root / split)
  return root


def _generate(small_slice, output, seed: int) -> dict:
  """12 writers and 2,000 examples from `small_slice`, 5 writers a file."""
  return full_size_femnist.generate(
    str(small_slice), str(output), writers=12, examples=2_000, writers_per_file=5, seed=seed
  )


@pytest.fixture(scope="module")
def generated(small_slice, tmp_path_factory) -> pathlib.Path:
  output = tmp_path_factory.mktemp("generated") / "femnist"
  written = _generate(small_slice, output, seed=3)
  assert written["writers"] == 12 and written["examples"] == 2_000 and written["files"] == 6
  return output


def _run(*args) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
  )


def test_generated_files_load_through_the_leaf_path(small_slice, generated):
  data = femnist.load_data(str(generated))
  assert len(data.train.client_ids) == 12 and data.test.client_ids == data.train.client_ids
  assert data.new_clients.client_ids == ()
  assert data.train.num_examples() + data.test.num_examples() == 2_000
  for c in data.train.client_ids:
    n = data.train.num_examples(c) + data.test.num_examples(c)
    assert data.train.num_examples(c) == int(0.9 * n)  # LEAF's per-writer split.
  assert sorted(p.name for p in (generated / "train").iterdir()) == [
    f"all_data_{i}_niid_05_keep_0_train_9.json" for i in range(3)
  ]
  source = leaf.load_leaf(str(small_slice))
  for split, source_split in ((data.train, source.train), (data.test, source.test)):
    x, _ = split.concatenated()
    assert x.dtype == np.float32 and x.min() >= 0 and x.max() <= 1
    assert (x == 1).mean() > 0.8  # White background, as in the slice.
    np.testing.assert_allclose(x * 255, np.rint(x * 255), atol=1e-4)  # LEAF's 1/255 steps.
    for c in split.client_ids:
      copied = c.split("_", 1)[1]  # r0007_f3313_11 copies f3313_11.
      assert set(split.y[c]) <= set(source_split.y[copied])


def test_an_image_is_shifted_with_noise_on_its_ink(small_slice):
  images = leaf.load_leaf(str(small_slice)).train.concatenated()[0][:50]
  levels = full_size_femnist.perturbed(images, np.random.default_rng(0)).reshape(-1, 28, 28)
  m = full_size_femnist.MAX_SHIFT_PIXELS
  padded = np.pad(images[..., 0], ((0, 0), (m, m), (m, m)), constant_values=1.0)
  shifts = [(r, c) for r in range(2 * m + 1) for c in range(2 * m + 1)]
  moved = np.stack([padded[:, r : r + 28, c : c + 28] for r, c in shifts], axis=1)
  error = np.abs(levels[:, None] / 255 - moved).max(axis=(2, 3))
  best = moved[np.arange(len(images)), error.argmin(axis=1)]
  # Some shift of the slice's image matches within the noise; its background stays white.
  assert error.min(axis=1).max() < 6 * full_size_femnist.INK_NOISE_STDDEV
  assert (levels[best == 1.0] == 255).all()
  assert (levels[best < 1.0] != np.rint(best[best < 1.0] * 255)).mean() > 0.5
  assert len(set(error.argmin(axis=1))) > 5  # Not all the same shift.


def test_same_seed_writes_the_same_files(small_slice, generated, tmp_path):
  _generate(small_slice, tmp_path / "again", seed=3)
  for split in ("train", "test"):
    names = sorted(p.name for p in (generated / split).iterdir())
    _, mismatch, errors = filecmp.cmpfiles(
      generated / split, tmp_path / "again" / split, names, False
    )
    assert mismatch == errors == []
  _generate(small_slice, tmp_path / "other", seed=4)
  name = "train/all_data_0_niid_05_keep_0_train_9.json"
  assert not filecmp.cmp(generated / name, tmp_path / "other" / name, shallow=False)


def test_the_script_prints_what_it_wrote(small_slice, tmp_path):
  result = _run(
    f"--data_dir={small_slice}", f"--output_dir={tmp_path / 'out'}", "--writers=3", "--examples=60"
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith(f"wrote {tmp_path / 'out'}: 3 writers, 60 examples (")
  assert " 2 files, " in result.stdout and " bytes (" in result.stdout
  assert result.stdout.rstrip().endswith(" s")


@pytest.mark.parametrize(
  "args, expected",
  [
    (("--output_dir=REPO/generated",), "is inside the repository"),
    (("--output_dir=NONEMPTY",), "exists and is not empty: pass a new or empty directory"),
    (("--output_dir=OUT", "--data_dir=MISSING"), "MISSING does not exist"),
    (("--output_dir=OUT", "--writers=10", "--examples=19"), "pass at least 20"),
  ],
)
def test_refusals_are_one_line(tmp_path, args, expected):
  (tmp_path / "nonempty").mkdir()
  (tmp_path / "nonempty/file").write_text("x")
  places = {
    "REPO": str(REPO_ROOT),
    "NONEMPTY": str(tmp_path / "nonempty"),
    "MISSING": str(tmp_path / "missing"),
    "OUT": str(tmp_path / "out"),
  }
  for word, place in places.items():
    args = tuple(a.replace(word, place) for a in args)
    expected = expected.replace(word, place)
  result = _run(*args)
  assert result.returncode == 2 and result.stdout == ""
  assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
  assert expected in result.stderr
  assert not (REPO_ROOT / "generated").exists() and not (tmp_path / "out").exists()
