r"""A LEAF FEMNIST of the real size (3,597 writers, 805,263 examples), resampled from the slice.

  uv run python benchmarks/full_size_femnist.py --output_dir=/work/fullsize/femnist \
      [--writers=3597] [--examples=805263] [--seed=0]

Each new writer copies a writer of the slice drawn at random among those with training data:
its training examples are drawn from the copied writer's training examples, its test examples
from its test examples (so train and test never share a source image), each pool used whole
as often as it fits and the rest drawn without replacement, so the label histograms are the
slice's. Writer sizes are 2 plus a share of the other examples proportional to the copied
writer's size, so that they sum to exactly `--examples` (LEAF's writers average 224 examples,
the slice's 156); a writer's examples are split as LEAF's 90/10 split does (int(0.9 n) for
training, at least one of each). Each image is shifted by up to 2 pixels each way (the border
it uncovers is background, 1.0), its ink pixels (below 1.0) get Gaussian noise, and the result
is clipped to [0, 1] and rounded to LEAF's 1/255 steps, so the background stays exactly 1.0.

The files are LEAF's: train/ and test/ of 100 writers each (all_data_<i>_niid_05_keep_0_
train_9.json and ..._test_9.json, the same writers in file i of both), written writer by
writer, so the generator holds the slice and one writer's text, never the whole data. It
prints the writers, examples, files, bytes and seconds. The same `--seed` writes the same files.
"""

import json
import os
import sys
import time

from absl import app
from absl import flags
import numpy as np

from tasks import leaf
from tasks.data import DataError

# LEAF's FEMNIST (Caldas et al. 2018): writers and examples of its full dataset.
FULL_WRITERS = 3_597
FULL_EXAMPLES = 805_263
# LEAF's files hold 100 writers each.
WRITERS_PER_FILE = 100
# LEAF's per-writer split: int(TRAIN_FRACTION * n) training examples.
TRAIN_FRACTION = 0.9
MAX_SHIFT_PIXELS = 2
INK_NOISE_STDDEV = 0.02
# The JSON text of each pixel value k / 255, as LEAF writes it ("1.0", "0.996078431372549").
_PIXEL_TEXT = np.array([repr(k / 255) for k in range(256)], dtype=object)
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS


class UsageError(ValueError):
  """A one-line problem with the flags (names the flag and the fix)."""


def check_output_dir(output_dir: str):
  """Raises UsageError unless `output_dir` is new or empty and outside the repository."""
  path, repository = os.path.realpath(output_dir), os.path.realpath(_REPO_ROOT)
  if os.path.commonpath([path, repository]) == repository:
    raise UsageError(
      f"--output_dir={output_dir} is inside the repository {_REPO_ROOT}: pass a directory "
      "outside it, e.g. /work/fullsize/femnist"
    )
  if os.path.exists(path) and not os.path.isdir(path):
    raise UsageError(f"--output_dir={output_dir} is a file: pass a new or empty directory")
  if os.path.isdir(path) and os.listdir(path):
    raise UsageError(
      f"--output_dir={output_dir} exists and is not empty: pass a new or empty directory"
    )


def writer_sizes(source_sizes: np.ndarray, examples: int, rng: np.random.Generator) -> np.ndarray:
  """Each writer's examples: 2 plus a share of the rest proportional to `source_sizes`.

  The shares are rounded by largest remainder, so the sizes sum to exactly `examples`.
  """
  rest = examples - 2 * len(source_sizes)
  exact = source_sizes * rest / source_sizes.sum()
  shares = np.floor(exact).astype(np.int64)
  remainders = exact - shares
  # Ties between equal remainders are broken at random, not by writer order.
  order = np.lexsort((rng.random(len(shares)), -remainders))
  shares[order[: rest - shares.sum()]] += 1
  return 2 + shares


def resampled(count: int, pool: int, rng: np.random.Generator) -> np.ndarray:
  """`count` indices into `pool` examples: the whole pool as often as it fits, then a draw
  without replacement, shuffled."""
  whole, part = divmod(count, pool)
  indices = np.concatenate([np.tile(np.arange(pool), whole), rng.choice(pool, part, replace=False)])
  return rng.permutation(indices)


def perturbed(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """`images` [n, 28, 28, 1] shifted up to MAX_SHIFT_PIXELS each way with noise on the ink,
  as pixel levels k (uint8 [n, 784]) of LEAF's values k / 255."""
  n, height, width = images.shape[:3]
  m = MAX_SHIFT_PIXELS
  padded = np.pad(images[..., 0], ((0, 0), (m, m), (m, m)), constant_values=1.0)
  rows = rng.integers(0, 2 * m + 1, n)[:, None, None] + np.arange(height)[None, :, None]
  cols = rng.integers(0, 2 * m + 1, n)[:, None, None] + np.arange(width)[None, None, :]
  shifted = padded[np.arange(n)[:, None, None], rows, cols]
  noise = rng.normal(0.0, INK_NOISE_STDDEV, shifted.shape).astype(np.float32)
  noisy = np.where(shifted < 1.0, np.clip(shifted + noise, 0.0, 1.0), shifted)
  return np.rint(noisy * 255).astype(np.uint8).reshape(n, -1)


def _writer_json(images: np.ndarray, labels: np.ndarray, count: int, rng) -> str:
  """The JSON text of a writer of `count` examples resampled from `images` and `labels`."""
  take = resampled(count, len(labels), rng)
  rows = ", ".join("[" + ", ".join(row) + "]" for row in _PIXEL_TEXT[perturbed(images[take], rng)])
  return f'{{"x": [{rows}], "y": {json.dumps(labels[take].tolist())}}}'


def _write_file(path: str, num_samples: dict[str, int], texts) -> int:
  """Writes a LEAF file of the writers `num_samples` names, whose JSON texts `texts` yields in
  order (one at a time); its bytes."""
  with open(path, "w") as f:
    f.write(f'{{"users": {json.dumps(list(num_samples))}, ')
    f.write(f'"num_samples": {json.dumps(list(num_samples.values()))}, "user_data": {{')
    for i, (writer, text) in enumerate(zip(num_samples, texts)):
      f.write(("" if i == 0 else ", ") + f"{json.dumps(writer)}: {text}")
    f.write("}}")
  return os.path.getsize(path)


def generate(
  data_dir: str,
  output_dir: str,
  *,
  writers: int = FULL_WRITERS,
  examples: int = FULL_EXAMPLES,
  writers_per_file: int = WRITERS_PER_FILE,
  seed: int = 0,
) -> dict[str, int]:
  """Writes the resampled FEMNIST (see the module docstring) to `output_dir`.

  Returns its writers, examples, train and test examples, files and bytes. Raises UsageError
  for bad sizes or output directory, DataError (`tasks.leaf`) for a missing or bad slice.
  """
  if writers < 1 or writers_per_file < 1:
    raise UsageError(
      f"--writers={writers}, --writers_per_file={writers_per_file}: both must be at least 1"
    )
  if examples < 2 * writers:
    raise UsageError(
      f"--examples={examples} is less than 2 per writer (--writers={writers}): every writer "
      f"needs a training and a test example; pass at least {2 * writers}"
    )
  check_output_dir(output_dir)
  slice_data = leaf.load_leaf(data_dir)
  sources = slice_data.test.client_ids  # The writers with training and test examples.
  rng = np.random.default_rng(seed)
  copied = rng.integers(0, len(sources), writers)
  source_sizes = np.array(
    [slice_data.train.num_examples(c) + slice_data.test.num_examples(c) for c in sources]
  )
  sizes = writer_sizes(source_sizes[copied], examples, rng)
  train_sizes = np.maximum(1, (TRAIN_FRACTION * sizes).astype(np.int64))
  names = [f"r{i:04d}_{sources[c]}" for i, c in enumerate(copied)]

  os.makedirs(output_dir, exist_ok=True)
  total_bytes = files = 0
  for split_number, (name, split, counts) in enumerate(
    (("train", slice_data.train, train_sizes), ("test", slice_data.test, sizes - train_sizes))
  ):
    os.makedirs(os.path.join(output_dir, name))
    for number, first in enumerate(range(0, writers, writers_per_file)):
      chosen = range(first, min(first + writers_per_file, writers))
      # A generator per writer and split: a writer's examples do not depend on the others'.
      texts = (
        _writer_json(
          split.x[sources[copied[i]]],
          split.y[sources[copied[i]]],
          int(counts[i]),
          np.random.default_rng([seed, i, split_number]),
        )
        for i in chosen
      )
      path = os.path.join(output_dir, name, f"all_data_{number}_niid_05_keep_0_{name}_9.json")
      total_bytes += _write_file(path, {names[i]: int(counts[i]) for i in chosen}, texts)
      files += 1
  return {
    "writers": writers,
    "examples": int(sizes.sum()),
    "train_examples": int(train_sizes.sum()),
    "test_examples": int((sizes - train_sizes).sum()),
    "files": files,
    "bytes": total_bytes,
  }


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not FLAGS.output_dir:
    print(
      "error: --output_dir is required: pass a new directory outside the repository",
      file=sys.stderr,
    )
    return 2
  started = time.perf_counter()
  try:
    written = generate(
      FLAGS.data_dir,
      FLAGS.output_dir,
      writers=FLAGS.writers,
      examples=FLAGS.examples,
      writers_per_file=FLAGS.writers_per_file,
      seed=FLAGS.seed,
    )
  except (UsageError, DataError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(
    f"wrote {FLAGS.output_dir}: {written['writers']:,} writers, {written['examples']:,} "
    f"examples ({written['train_examples']:,} train, {written['test_examples']:,} test), "
    f"{written['files']} files, {written['bytes']:,} bytes ({written['bytes'] / 2**30:.2f} "
    f"GiB) in {time.perf_counter() - started:.1f} s"
  )
  return 0


def define_flags():
  """The flags of `main` (defined when run as a script, so that tests can import `generate`
  beside other modules' flags)."""
  flags.DEFINE_string(
    "data_dir",
    os.path.join(_REPO_ROOT, "..", "shared", "data", "femnist"),
    "The FEMNIST slice (LEAF directory) to resample.",
  )
  flags.DEFINE_string("output_dir", None, "New or empty directory to write train/ and test/ into.")
  flags.DEFINE_integer("writers", FULL_WRITERS, "Writers to write (LEAF's FEMNIST has 3,597).")
  flags.DEFINE_integer("examples", FULL_EXAMPLES, "Examples to write (LEAF's has 805,263).")
  flags.DEFINE_integer("writers_per_file", WRITERS_PER_FILE, "Writers in each JSON file.")
  flags.DEFINE_integer("seed", 0, "Seed of the draws: the same seed writes the same files.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
