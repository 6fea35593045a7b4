"""FEMNIST's LEAF files read with NumPy alone (no TensorFlow), split by writer.

Caldas et al., "LEAF: A Benchmark for Federated Settings", arXiv:1812.01097, 2018: a
directory of train/*.json and test/*.json, each {"users", "num_samples", "user_data":
{writer: {"x", "y"}}}. Each writer's examples become float32 images [n, 28, 28, 1] in [0, 1]
(1.0 is the background) and int32 labels in 0..61 (CLASS_LABELS[label]). `tasks.femnist`
builds the task on it; the device environment (`device/`, no TensorFlow) reads the same
splits through it to evaluate exported files.
"""

import collections
import glob
import json
import logging
import os

import numpy as np

from tasks.data import ClientArrays
from tasks.data import DataError
from tasks.data import FederatedData

NUM_CLASSES = 62
NUM_DIGITS = 10
INPUT_SHAPE = (28, 28, 1)
CLASS_LABELS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# The LEAF directory to read when none is given.
DATA_DIR_ENV = "TFF_ENS_DATA_DIR"

_PIXELS = INPUT_SHAPE[0] * INPUT_SHAPE[1]
_LEAF_KEYS = ("users", "num_samples", "user_data")


def _client_arrays(examples: dict[str, tuple[np.ndarray, np.ndarray]]) -> ClientArrays:
  ids = tuple(sorted(examples))
  return ClientArrays(
    ids, {c: examples[c][0] for c in ids}, {c: examples[c][1] for c in ids}, INPUT_SHAPE
  )


def split_by_writer(train, test, source: str) -> FederatedData:
  """FederatedData from writer -> (x, y) dicts of the train and test files."""
  new_clients = _client_arrays({c: v for c, v in test.items() if c not in train})
  return FederatedData(
    train=_client_arrays(train),
    test=_client_arrays({c: v for c, v in test.items() if c in train}),
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


def _load_leaf_split(data_dir: str, split: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """writer -> (x, y) over all JSON files of data_dir/split; a writer may be in one file only."""
  split_dir = os.path.join(data_dir, split)
  if not os.path.isdir(split_dir):
    raise DataError(
      f"{data_dir} has no {split}/ subdirectory: pass a LEAF femnist directory "
      "with train/*.json and test/*.json"
    )
  paths = sorted(glob.glob(os.path.join(split_dir, "*.json")))
  if not paths:
    raise DataError(f"{split_dir} has no *.json files: copy LEAF's {split} files into it")
  examples, file_of = {}, {}
  for path in paths:
    for writer, arrays in _load_leaf_file(path).items():
      if writer in examples:
        raise DataError(
          f"writer {writer!r} appears in two {split} files, {file_of[writer]} and "
          f"{path}: remove one of the copies"
        )
      examples[writer], file_of[writer] = arrays, path
  return examples


def load_leaf(data_dir: str) -> FederatedData:
  """Loads a LEAF femnist directory (data_dir/train/*.json, data_dir/test/*.json).

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
  train = _load_leaf_split(data_dir, "train")
  test = _load_leaf_split(data_dir, "test")
  if not train:
    raise DataError(
      f"{os.path.join(data_dir, 'train')}: no writer in its "
      "*.json files has examples (every num_samples is 0): "
      "copy LEAF's train files into it"
    )
  return split_by_writer(train, test, f"leaf:{data_dir}")


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
