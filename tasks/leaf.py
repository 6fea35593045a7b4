"""FEMNIST's LEAF files read with NumPy alone (no TensorFlow), split by writer.

Caldas et al., "LEAF: A Benchmark for Federated Settings", arXiv:1812.01097, 2018: a
directory of train/*.json and test/*.json, each {"users", "num_samples", "user_data":
{writer: {"x", "y"}}}. Each writer's examples become float32 images [n, 28, 28, 1] in [0, 1]
(1.0 is the background) and int32 labels in 0..61 (CLASS_LABELS[label]). `tasks.femnist`
builds the task on it; the device environment (`device/`, no TensorFlow) reads the same
splits through it to evaluate exported files.

A directory is parsed once, file by file, into a cache (`$TFF_ENS_CACHE_DIR`, else
~/.cache/tff_ens): each split's images as one file of float32 rows, read a writer at a time
when a round or an evaluation asks for them (`data.ExamplesOnDisk`), and its labels. A
process then holds the labels and one file's text at most, whatever the number of writers,
and later loads read only the labels. A changed file (size or time) is parsed again.
"""

import collections
import glob
import hashlib
import json
import logging
import os
import shutil

import numpy as np

from tasks.data import ClientArrays
from tasks.data import DataError
from tasks.data import ExamplesOnDisk
from tasks.data import FederatedData

NUM_CLASSES = 62
NUM_DIGITS = 10
INPUT_SHAPE = (28, 28, 1)
CLASS_LABELS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# The LEAF directory to read when none is given.
DATA_DIR_ENV = "TFF_ENS_DATA_DIR"

# Where parsed directories are kept (module docstring).
CACHE_DIR_ENV = "TFF_ENS_CACHE_DIR"

_PIXELS = INPUT_SHAPE[0] * INPUT_SHAPE[1]
_LEAF_KEYS = ("users", "num_samples", "user_data")
_SPLITS = ("train", "test")
# A cached directory's files: per split, its images' rows and its labels; and the index.
_IMAGES, _LABELS, _INDEX = "{}_images.f32", "{}_labels.i32", "index.json"
_CACHE_FORMAT = 1  # Bumped when the cache's layout changes.


def _client_arrays(examples: dict[str, tuple[np.ndarray, np.ndarray]]) -> ClientArrays:
  ids = tuple(sorted(examples))
  return ClientArrays(
    ids, {c: examples[c][0] for c in ids}, {c: examples[c][1] for c in ids}, INPUT_SHAPE
  )


def split_by_writer(train, test, source: str) -> FederatedData:
  """FederatedData from writer -> (x, y) dicts of the train and test files."""
  return _by_writer(_client_arrays(train), _client_arrays(test), source)


def _by_writer(train: ClientArrays, test: ClientArrays, source: str) -> FederatedData:
  """FederatedData of the train and test files' writers: the test writers who train are
  the test split, the others new clients."""
  new_clients = test.subset(c for c in test.client_ids if c not in train.y)
  return FederatedData(
    train=train,
    test=test.subset(c for c in test.client_ids if c in train.y),
    new_clients=new_clients,
    source=source,
    shift=new_clients,
  )


def _leaf_writer(path: str, writer: str, count, data) -> tuple[np.ndarray, np.ndarray]:
  """One writer's (x, y) from a LEAF file, checked; raises DataError naming file and writer."""
  where = f"{path}: writer {writer!r}"
  fix = "regenerate the file with LEAF"
  if not isinstance(data, dict) or "x" not in data or "y" not in data:
    raise DataError(f"{where}: user_data entry needs keys x and y; {fix}")
  if not isinstance(data["x"], list) or not isinstance(data["y"], list):
    raise DataError(
      f"{where}: x and y must be lists, found "
      f"{type(data['x']).__name__} and "
      f"{type(data['y']).__name__}; {fix}"
    )
  if isinstance(count, bool) or not isinstance(count, int):
    raise DataError(f"{where}: num_samples entry {repr(count)[:20]} is not an integer; {fix}")
  try:
    x = np.asarray(data["x"])
  except (ValueError, TypeError):
    lengths = sorted({len(r) if isinstance(r, list) else 1 for r in data["x"]})
    raise DataError(
      f"{where}: each x row must be a list of {_PIXELS} numbers (28x28 pixels), "
      f"found row lengths {lengths[:5]}; {fix}"
    ) from None
  if x.size and x.dtype.kind not in "fiu":  # Strings, null, booleans.
    value = next(
      v
      for row in data["x"]
      for v in (row if isinstance(row, list) else [row])
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1
    )
    raise DataError(
      f"{where}: pixel values must be numbers in [0, 1], found {repr(value)[:20]}; {fix}"
    )
  labels = data["y"]
  if not all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
    raise DataError(
      f"{where}: labels must be integers in 0..{NUM_CLASSES - 1}, found {str(labels)[:40]}; {fix}"
    )
  if count != len(labels):
    raise DataError(f"{where}: num_samples says {count} but y has {len(labels)} labels; {fix}")
  if len(x) != len(labels):
    raise DataError(f"{where}: {len(x)} images but {len(labels)} labels; {fix}")
  if not labels:
    return np.zeros((0, *INPUT_SHAPE), np.float32), np.zeros((0,), np.int32)
  if x.ndim != 2 or x.shape[1] != _PIXELS:
    raise DataError(
      f"{where}: each x row must have {_PIXELS} values (28x28 pixels), "
      f"got shape {list(x.shape)}; {fix}"
    )
  # Checked as Python ints: a label beyond int64 must not overflow first.
  bad = [v for v in labels if not 0 <= v < NUM_CLASSES]
  if bad:
    raise DataError(
      f"{where}: labels must be integers in 0..{NUM_CLASSES - 1}, found {bad[:3]}; {fix}"
    )
  x = x.astype(np.float32)
  if np.isnan(x).any():
    raise DataError(f"{where}: NaN pixel values; {fix}")
  if x.min() < 0 or x.max() > 1:
    raise DataError(f"{where}: pixel values must be in [0, 1], found {x.min()}..{x.max()}; {fix}")
  return x.reshape(-1, *INPUT_SHAPE), np.asarray(labels, np.int32)


def _load_leaf_file(path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """writer -> (x, y) of one LEAF JSON file, skipping writers without examples."""
  try:
    with open(path, "rb") as f:
      content = json.load(f)
  except json.JSONDecodeError as e:
    problem = "empty" if not e.doc.strip() else f"not valid JSON ({e.msg} at char {e.pos})"
    raise DataError(
      f"{path}: {problem}; the file may be truncated: copy it again or regenerate it with LEAF"
    ) from None
  except UnicodeDecodeError as e:
    raise DataError(
      f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); "
      "the file may be damaged: copy it again or regenerate it "
      "with LEAF"
    ) from None
  except OSError as e:
    raise DataError(
      f"{path}: cannot be read ({e.strerror}): make it a "
      "readable LEAF JSON file, or move it out of the "
      "directory"
    ) from None
  missing = [k for k in _LEAF_KEYS if not isinstance(content, dict) or k not in content]
  if missing:
    raise DataError(
      f"{path}: missing key(s) {', '.join(missing)}: a LEAF file is a JSON object "
      "with users, num_samples and user_data; regenerate it with LEAF"
    )
  users, counts, user_data = (content[k] for k in _LEAF_KEYS)
  fix = "regenerate the file with LEAF"
  if not (isinstance(users, list) and isinstance(counts, list) and isinstance(user_data, dict)):
    raise DataError(
      f"{path}: users and num_samples must be lists and user_data an "
      f"object, found {type(users).__name__}, {type(counts).__name__} and "
      f"{type(user_data).__name__}; {fix}"
    )
  if len(users) != len(counts):
    raise DataError(f"{path}: {len(users)} users but {len(counts)} num_samples entries; {fix}")
  odd = [w for w in users if not isinstance(w, str)]
  if odd:
    raise DataError(f"{path}: users must be writer id strings, found {repr(odd[0])[:20]}; {fix}")
  repeated = [w for w, n in collections.Counter(users).items() if n > 1]
  if repeated:
    raise DataError(f"{path}: writer {repeated[0]!r} is listed more than once in users; {fix}")
  unlisted = sorted(set(user_data) - set(users))
  if unlisted:
    raise DataError(
      f"{path}: user_data holds writer(s) missing from users "
      f"({', '.join(map(repr, unlisted[:3]))}); {fix}"
    )
  examples, empty = {}, []
  for writer, count in zip(users, counts):
    if writer not in user_data:
      raise DataError(f"{path}: writer {writer!r} is in users but not in user_data; {fix}")
    x, y = _leaf_writer(path, writer, count, user_data[writer])
    if len(y):
      examples[writer] = (x, y)
    else:
      empty.append(writer)
  if empty:
    # A writer without examples is harmless (it is never sampled), so it is
    # skipped rather than refused; the log says which.
    logging.warning(
      "%s: skipping %d writer(s) without examples (%s)",
      path,
      len(empty),
      ", ".join(empty[:3]) + (", ..." if len(empty) > 3 else ""),
    )
  return examples


def _split_paths(data_dir: str, split: str) -> list[str]:
  """The JSON files of data_dir/split; DataError if there are none."""
  split_dir = os.path.join(data_dir, split)
  if not os.path.isdir(split_dir):
    raise DataError(
      f"{data_dir} has no {split}/ subdirectory: pass a LEAF femnist directory "
      "with train/*.json and test/*.json"
    )
  paths = sorted(glob.glob(os.path.join(split_dir, "*.json")))
  if not paths:
    raise DataError(f"{split_dir} has no *.json files: copy LEAF's {split} files into it")
  return paths


def _parse_split(paths: list[str], split: str, images, labels) -> dict[str, list[int]]:
  """Appends each writer's images and labels of `paths` (a split's files) to the open files
  `images` and `labels`; returns writer -> [first row, rows]. A writer may be in one file
  only."""
  spans, file_of, rows = {}, {}, 0
  for path in paths:
    for writer, (x, y) in _load_leaf_file(path).items():
      if writer in spans:
        raise DataError(
          f"writer {writer!r} appears in two {split} files, {file_of[writer]} and "
          f"{path}: remove one of the copies"
        )
      images.write(np.ascontiguousarray(x, np.float32).tobytes())
      labels.write(np.asarray(y, np.int32).tobytes())
      spans[writer], file_of[writer] = [rows, len(y)], path
      rows += len(y)
  return spans


def _cache_dir(data_dir: str, paths: list[str]) -> str:
  """The cache directory of `data_dir` as its files now are (their names, sizes, times)."""
  digest = hashlib.sha256(f"{_CACHE_FORMAT}\0{data_dir}".encode())
  for path in paths:
    stat = os.stat(path)
    digest.update(f"\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
  root = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "tff_ens")
  return os.path.join(root, "leaf", digest.hexdigest()[:32])


def _write_cache(directory: str, paths: dict[str, list[str]]) -> None:
  """Parses the splits' files into `directory`, whole or not at all (written beside it,
  then renamed: a failed or concurrent parse leaves no partial cache)."""
  partial = f"{directory}.partial{os.getpid()}"
  try:
    os.makedirs(partial)
    index = {}
    for split in _SPLITS:
      with (
        open(os.path.join(partial, _IMAGES.format(split)), "wb") as images,
        open(os.path.join(partial, _LABELS.format(split)), "wb") as labels,
      ):
        index[split] = _parse_split(paths[split], split, images, labels)
    with open(os.path.join(partial, _INDEX), "w") as f:
      json.dump(index, f)
    os.rename(partial, directory)
  except OSError as e:
    if os.path.isdir(directory):  # Another process cached the same files first.
      return
    raise DataError(
      f"cannot write the parsed FEMNIST files to {os.path.dirname(directory)} ({e.strerror}): "
      f"set {CACHE_DIR_ENV} to a writable directory"
    ) from None
  finally:
    shutil.rmtree(partial, ignore_errors=True)


def _cached_split(directory: str, split: str, spans: dict) -> ClientArrays:
  """A cached split: its labels in memory, its images read when asked for."""
  labels = np.fromfile(os.path.join(directory, _LABELS.format(split)), np.int32)
  ids = tuple(sorted(spans))
  return ClientArrays(
    ids,
    ExamplesOnDisk(os.path.join(directory, _IMAGES.format(split)), INPUT_SHAPE, spans),
    {c: labels[spans[c][0] : spans[c][0] + spans[c][1]].copy() for c in ids},
    INPUT_SHAPE,
  )


def load_leaf(data_dir: str) -> FederatedData:
  """Loads a LEAF femnist directory (data_dir/train/*.json, data_dir/test/*.json), through
  its cache (module docstring).

  Raises DataError, with a one-line message that names the file or directory, if the data
  is missing or malformed.
  """
  data_dir = os.path.abspath(os.path.expanduser(data_dir))
  if not os.path.exists(data_dir):
    raise DataError(
      f"FEMNIST data directory {data_dir} does not exist: pass a LEAF femnist "
      "directory with train/ and test/"
    )
  if not os.path.isdir(data_dir):
    raise DataError(
      f"FEMNIST data directory {data_dir} is not a directory: pass a LEAF "
      "femnist directory with train/ and test/"
    )
  paths = {split: _split_paths(data_dir, split) for split in _SPLITS}
  directory = _cache_dir(data_dir, paths["train"] + paths["test"])
  if not os.path.isfile(os.path.join(directory, _INDEX)):
    _write_cache(directory, paths)
  with open(os.path.join(directory, _INDEX)) as f:
    index = json.load(f)
  if not index["train"]:
    raise DataError(
      f"{os.path.join(data_dir, 'train')}: no writer in its "
      "*.json files has examples (every num_samples is 0): "
      "copy LEAF's train files into it"
    )
  train, test = (_cached_split(directory, split, index[split]) for split in _SPLITS)
  return _by_writer(train, test, f"leaf:{data_dir}")


def _digits(arrays: ClientArrays, letters: bool = False) -> ClientArrays:
  """The clients' digit examples (or, with `letters`, the others); clients left empty go."""
  keep = {c: (arrays.y[c] >= NUM_DIGITS) == letters for c in arrays.client_ids}
  return _client_arrays({c: (arrays.x[c][k], arrays.y[c][k]) for c, k in keep.items() if k.any()})


def digits_only(data: FederatedData) -> FederatedData:
  """FEMNIST's digits as the task, its letters as out-of-distribution inputs.

  Training, test and new writers keep their digits (labels 0..9 as before); the letters of
  the test writers (the same writers as the in-distribution test set, so only the classes
  change) become `ood`, and the new writers' digits are the covariate `shift`.
  """
  new_clients = _digits(data.new_clients)
  return FederatedData(
    train=_digits(data.train),
    test=_digits(data.test),
    new_clients=new_clients,
    source=data.source,
    shift=new_clients,
    ood=_digits(data.test, letters=True),
  )
