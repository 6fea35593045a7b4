"""Shakespeare's plays as federated text, read with NumPy alone: one client per (play, role).

Citations:
  Caldas, Duddu, Wu, Li, Konecny, McMahan, Smith and Talwalkar, "LEAF: A Benchmark for
  Federated Settings", arXiv:1812.01097, 2018 (data/shakespeare: each speaking role of each
  play is a client; a sample is a character predicted from the 80 before it, over
  `VOCABULARY`; each role's samples split 80/20 by position).
  McMahan, Moore, Ramage, Hampson and Aguera y Arcas, "Communication-Efficient Learning of
  Deep Networks from Decentralized Data", AISTATS 2017, Sec. 3 (the task).

Load: `read_plays` reads Project Gutenberg's plays, one `<work>_gut.txt` per work (the
poems, which have no roles, are skipped). Preprocess: `parse_play` keeps each role's
speeches, `encode` maps characters to ids, `windows` makes a role's samples and `split_role`
splits them. `load_roles` puts it together as a `FederatedData`, and `load_data` splits it as
a run does (by role, or iid); `tasks.shakespeare` builds the task on it, and the device
environment (no TensorFlow) reads the same clients.

Parsing (docs/tasks.md has the counts):
  - A play starts at its first ACT, PROLOGUE or INDUCTION heading: the title, the list of
    persons and the setting before it are not speech.
  - Paragraphs are separated by blank lines. Stage directions, in brackets (the texts' few
    braces count as brackets; nested ones go with their outer one; one left open ends with
    its line, or with its paragraph if it opens it), are removed first; then lines without
    a letter or digit, and song stanza numbers (an indented "II."), are dropped.
  - A paragraph whose first line is a speaker line (a name in capitals, or in capitalized
    words ending with a period, alone on the line) starts a speech of that role; so does
    "NAME. words" with a NAME that starts speeches elsewhere in the play, and, inside a
    paragraph, a line "NAME." in capitals with such a NAME (its blank line missing).
  - A paragraph without a speaker line continues the current speech (a speech goes on
    after a stage direction); after a heading (ACT, SCENE, PROLOGUE, EPILOGUE, INDUCTION)
    or a song's label there is none, and such paragraphs (scene locations) are dropped.
  - A role is its speaker label, upper-cased with every run of other characters than
    letters and digits made one space ("Ham." is HAM, "Ros. and Guil." ROS AND GUIL): the
    texts' abbreviations are kept, as LEAF keeps its source's.
  - A role's text is its speeches' lines in order, each stripped, its runs of white space
    made one space (as LEAF does), and ended by "\\n".
"""

import collections
import dataclasses
import glob
import logging
import os
import re

import numpy as np

from tasks import data as data_lib
from tasks.data import ClientArrays
from tasks.data import DataError
from tasks.data import FederatedData
from tasks.partition import PartitionConfig
from tff_ens import settings
from tff_ens.settings import setting

# LEAF's characters (models/utils/language_utils.py, ALL_LETTERS): a character's id is its
# position; every other character is OOV_ID.
VOCABULARY = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
OOV_ID = len(VOCABULARY)
NUM_IDS = OOV_ID + 1
# What `decode` writes for OOV_ID.
OOV_CHARACTER = "\N{REPLACEMENT CHARACTER}"
# A sample's input: the characters before its label, left-padded with spaces (LEAF's padding).
SEQUENCE_LENGTH = 80
PAD_ID = VOCABULARY.index(" ")
# LEAF's split of a role's samples (utils/split_data.py): the first 80% train, the rest test.
TRAIN_FRACTION = 0.8
# Gutenberg's poems: no roles.
POEMS = (
  "lovers_complaint",
  "passionate_pilgrim",
  "phoenix_and_the_turtle",
  "rape_of_lucrece",
  "sonnets",
)
PLAY_SUFFIX = "_gut.txt"
# The clients are the roles unless --partition=iid pools their samples (see `load_data`).
DEFAULT_PARTITION = None
PARTITIONS = ("iid",)
# A pooled split sets nothing aside for the server: its text is the held-out roles'
# (`new_clients`), as with the roles.
SERVER_EXAMPLES = (0, 0)
# Labels of speaker-line form that name no role: what follows them is not a role's speech.
NOT_ROLES = ("SONG", "DUMB SHOW", "THE ORDER OF THE CORONATION")

_ASCII_IDS = np.full(128, OOV_ID, np.uint8)
_ASCII_IDS[[ord(c) for c in VOCABULARY]] = np.arange(len(VOCABULARY))
_HEADING = re.compile(
  r"(ACT|SCENE)\b\s*[.:]?\s*([IVXL]+\b|\d+|FIRST|SECOND|THIRD|FOURTH|FIFTH)"
  r"|(THE )?(PROLOGUE|EPILOGUE|INDUCTION)\b\.?\s*$|THE END\s*$",
  re.IGNORECASE,
)
_STARTS_PLAY = re.compile(r"ACT|(THE )?PROLOGUE|INDUCTION", re.IGNORECASE)
_NAME = re.compile(r"([0-9A-Za-z][A-Za-z'&-]*(?:[.,]? +[A-Za-z&][A-Za-z'&-]*)*)(\.?)")
_NAME_WITH_WORDS = re.compile(r"([A-Z][A-Z'&. -]*[A-Z])\.\s+(\S.*)")
_CONNECTIVES = ("and", "of", "de", "la", "le", "du", "the", "&")
_STANZA = re.compile(r"\s+[IVX]+\.\s*")
_DIRECTION = re.compile(r"\[[^\[\]]*\]")
_OPEN_DIRECTION = re.compile(r"\[[^\n]*")
_NOT_NAME = re.compile(r"[^0-9A-Z]+")
_NAME_PUNCTUATION = re.compile(r"[.,]")
_WORD = re.compile(r"[0-9A-Za-z]")


@dataclasses.dataclass(frozen=True)
class Play:
  """A play's speeches in order: `speeches` holds (role, text) pairs (`parse_play`)."""

  name: str
  speeches: tuple[tuple[str, str], ...]

  def roles(self) -> dict[str, str]:
    """Role -> its speeches' text, in order."""
    texts = collections.defaultdict(list)
    for role, text in self.speeches:
      texts[role].append(text)
    return {role: "".join(parts) for role, parts in texts.items()}


@settings.group
class ShakespeareConfig:
  """Which roles are clients and how many samples are evaluated (flags of the same names).

  Attributes:
    min_role_characters: roles with fewer characters of speech are left out. 1,000 keeps
      631 of the 1,379 roles and 95% of the text, and gives every client 800+ training
      and 120+ test samples (LEAF's split leaves 660 of its 1,129 roles a test sample).
    held_out_role_fraction: the share of those roles (seeded) that trains nowhere: new
      clients, and the server's unlabeled and validation text.
    eval_samples_per_role: test samples kept per client, and samples per held-out role
      (a seeded subsample; 0 keeps all): the 2-layer LSTM evaluates ~150 samples/s on 2
      CPU cores, so all 0.7M test samples would take ~75 min.
  """

  min_role_characters: int = setting(
    1_000, "Shakespeare: roles with fewer characters of speech are left out.", at_least=1
  )
  held_out_role_fraction: float = setting(
    0.1,
    "Shakespeare: share of the roles held out of training (seeded): new clients and the "
    "server's text.",
    at_least=0,
    below=1,
  )
  eval_samples_per_role: int = setting(
    100,
    "Shakespeare: test samples per client and samples per held-out role kept (a seeded "
    "subsample; 0 keeps all).",
    at_least=0,
  )


def encode(text: str) -> np.ndarray:
  """uint8 ids [len(text)]: a character's position in VOCABULARY, else OOV_ID."""
  codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
  ids = np.full(len(codes), OOV_ID, np.uint8)
  ascii_ = codes < 128
  ids[ascii_] = _ASCII_IDS[codes[ascii_]]
  return ids


def decode(ids) -> str:
  """The text of ids in 0..OOV_ID (OOV_ID as OOV_CHARACTER); ValueError for other ids."""
  ids = np.asarray(ids).reshape(-1)
  if ids.size and (ids.min() < 0 or ids.max() > OOV_ID):
    raise ValueError(f"character ids must be in 0..{OOV_ID}, got {ids.min()}..{ids.max()}")
  return "".join((VOCABULARY + OOV_CHARACTER)[i] for i in ids)


def context_ids(text: str) -> np.ndarray:
  """The model's input to predict the character after `text`: int32 [SEQUENCE_LENGTH], the
  ids of its last 80 characters, left-padded with PAD_ID."""
  ids = encode(text[-SEQUENCE_LENGTH:])
  return np.concatenate([np.full(SEQUENCE_LENGTH - len(ids), PAD_ID), ids]).astype(np.int32)


def windows(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """A text's samples: x[i] the SEQUENCE_LENGTH ids before ids[i], y[i] = ids[i].

  x is a read-only uint8 view [n, SEQUENCE_LENGTH] of the text left-padded with PAD_ID
  (n + 80 bytes, whatever n); y is int32 [n].
  """
  padded = np.concatenate([np.full(SEQUENCE_LENGTH, PAD_ID, np.uint8), np.asarray(ids, np.uint8)])
  x = np.lib.stride_tricks.sliding_window_view(padded, SEQUENCE_LENGTH)[: len(ids)]
  return x, np.asarray(ids, np.int32)


def split_role(num_samples: int) -> tuple[int, int]:
  """(train_stop, test_start): samples [0, train_stop) train, [test_start, n) test.

  LEAF (utils/split_data.py) trains on the first floor(0.8 n) samples and tests on the
  rest, less the 79 after the training ones; here 80 are left out, so that no test sample
  (input or label) holds a character of a training sample. By position, not seeded: a
  random split of overlapping windows would test on text trained on.
  """
  train_stop = int(TRAIN_FRACTION * num_samples)
  return train_stop, min(num_samples, train_stop + SEQUENCE_LENGTH)


def _without_directions(paragraph: str) -> list[str]:
  """The paragraph's lines without stage directions, normalized (see module doc)."""
  text = paragraph
  if any(c in text for c in "[]{}"):
    text = text.replace("{", "[").replace("}", "]")
    while True:
      text, removed = _DIRECTION.subn("", text)
      if not removed:
        break
    if text.lstrip().startswith("["):
      return []
    text = _OPEN_DIRECTION.sub("", text).replace("]", "")
  lines = (" ".join(line.split()) for line in text.split("\n") if not _STANZA.fullmatch(line))
  return [line for line in lines if _WORD.search(line)]


def _role(line: str) -> tuple[str, bool] | None:
  """(role, ends with a period) if `line` has a speaker line's form, else None."""
  match = _NAME.fullmatch(line)
  if not match or len(line) > 40:
    return None
  name, period = match.groups()
  words = _NAME_PUNCTUATION.sub(" ", name).split()
  capitalized = all(w[0].isupper() or w[0].isdigit() or w in _CONNECTIVES for w in words)
  if len(words) > 5 or not (name.isupper() or (period and capitalized)):
    return None
  return " ".join(_NOT_NAME.sub(" ", name.upper()).split()), bool(period)


def _inline_speech(line: str, known: set[str]) -> tuple[str, str] | None:
  """(role, words) of "NAME. Words" whose NAME starts speeches elsewhere, else None."""
  match = _NAME_WITH_WORDS.fullmatch(line)
  if not match or match.group(2)[0].islower():
    return None
  role = _role(match.group(1) + ".")
  return (role[0], match.group(2)) if role and role[0] in known else None


def _paragraphs(lines: list[str]):
  """None for a heading, else the lines without directions (maybe none), per paragraph
  from the play's first heading on."""
  start = next((i for i, line in enumerate(lines) if _is_heading(line, _STARTS_PLAY)), None)
  if start is None:
    return
  paragraph = []
  for line in lines[start:] + [""]:
    if line.strip():
      paragraph.append(line)
    elif paragraph:
      if _is_heading(paragraph[0], _HEADING):
        yield None
      elif text := _without_directions("\n".join(paragraph)):
        yield text
      paragraph = []


def _is_heading(line: str, start: re.Pattern) -> bool:
  line = line.strip()
  return bool(start.match(line) and _HEADING.match(line))


def _cut_at_speakers(lines: list[str] | None, known: set[str]) -> list:
  """The paragraph cut before each later line that is a known role's name in capitals with
  a period (a speaker line whose blank line is missing)."""
  if lines is None:
    return [None]
  cuts = [
    i
    for i, line in enumerate(lines)
    if i and line.isupper() and (role := _role(line)) and role[1] and role[0] in known
  ]
  return [lines[i:j] for i, j in zip([0, *cuts], [*cuts, len(lines)])]


def parse_play(text: str, name: str) -> Play:
  """A Gutenberg play's speeches, by the rules of the module doc (none if it has no
  ACT, PROLOGUE or INDUCTION heading)."""
  paragraphs = list(_paragraphs(text.splitlines()))
  # Names that start a speech with its words on the next lines.
  known = {
    role[0] for lines in paragraphs if lines and len(lines) > 1 and (role := _role(lines[0]))
  }
  speeches, current, continued = [], None, False
  for lines in (piece for lines in paragraphs for piece in _cut_at_speakers(lines, known)):
    if lines is None:
      current = None
      continue
    role = _role(lines[0])
    inline = _inline_speech(lines[0], known)
    if inline:
      current, lines, continued = inline[0], [inline[1]] + lines[1:], False
    elif role and (len(lines) > 1 or role[0] in known or (role[1] and lines[0].isupper())):
      current, lines, continued = role[0], lines[1:], False
    if current in NOT_ROLES:
      current = None
    if current is None or not lines:
      continue
    text = "".join(line + "\n" for line in lines)
    if continued:
      speeches[-1] = (current, speeches[-1][1] + text)
    else:
      speeches.append((current, text))
    continued = True
  return Play(name, tuple(speeches))


def _read_text(path: str) -> str:
  """The file's text; DataError naming the file if it cannot be read or is not text."""
  try:
    with open(path, "rb") as f:
      content = f.read()
  except OSError as e:
    raise DataError(
      f"{path}: cannot be read ({e.strerror}): make it readable, or move it out of the directory"
    ) from None
  try:
    text = content.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(
      f"{path}: not a text file ({e.reason} at byte {e.start}): pass Gutenberg's plain-text "
      "play, or move it out of the directory"
    ) from None
  if "\x00" in text:
    raise DataError(
      f"{path}: not a text file (NUL byte at {text.index(chr(0))}): pass Gutenberg's "
      "plain-text play, or move it out of the directory"
    )
  return text


def read_play(path: str) -> Play:
  """The play in `path` (a `<work>_gut.txt` file); DataError if it has no speeches."""
  name = os.path.basename(path)[: -len(PLAY_SUFFIX)]
  play = parse_play(_read_text(path), name)
  if not play.speeches:
    raise DataError(
      f"{path}: no speeches found (they follow the first ACT, PROLOGUE or INDUCTION heading, "
      "each after a speaker line such as 'HAMLET.'): pass a Gutenberg play, or move the file "
      "out of the directory"
    )
  return play


def read_plays(data_dir: str) -> list[Play]:
  """The plays of `data_dir` (every `<work>_gut.txt` but the POEMS), by name."""
  usage = "pass Gutenberg's Shakespeare, e.g. --data_dir=../shared/data/shakespeare"
  if not os.path.isdir(data_dir):
    problem = "is not a directory" if os.path.exists(data_dir) else "does not exist"
    raise DataError(f"Shakespeare data directory {data_dir} {problem}: {usage}")
  paths = sorted(glob.glob(os.path.join(glob.escape(data_dir), "*" + PLAY_SUFFIX)))
  paths = [p for p in paths if os.path.basename(p)[: -len(PLAY_SUFFIX)] not in POEMS]
  if not paths:
    raise DataError(f"{data_dir} has no plays (<work>{PLAY_SUFFIX} files): {usage}")
  return [read_play(p) for p in paths]


def client_id(play: str, role: str) -> str:
  """ "hamlet/FIRST_PLAYER": the play's file name and the role, spaces made underscores."""
  return f"{play}/{role.replace(' ', '_')}"


def _client_arrays(samples: dict) -> ClientArrays:
  ids = tuple(sorted(samples))
  return ClientArrays(
    ids, {c: samples[c][0] for c in ids}, {c: samples[c][1] for c in ids}, (SEQUENCE_LENGTH,)
  )


def load_roles(
  data_dir: str,
  *,
  min_characters: int,
  held_out_fraction: float,
  eval_samples: int,
  seed: int,
) -> FederatedData:
  """The plays in `data_dir` as clients, one per (play, role) with `min_characters` of text.

  A seeded `held_out_fraction` of those roles is held out of training (`new_clients`, also
  the `shift`): at most `eval_samples` of each one's samples, drawn by the seed. Each other
  role is a training client: its training samples (`split_role`) are `train`, at most
  `eval_samples` of its test samples, drawn by the seed, `test` (0: all of them).
  """
  data_dir = os.path.abspath(os.path.expanduser(data_dir))
  texts = {
    client_id(play.name, role): text
    for play in read_plays(data_dir)
    for role, text in play.roles().items()
    if len(text) >= min_characters
  }
  ids = sorted(texts)
  if len(ids) < 2:
    raise DataError(
      f"{data_dir}: {len(ids)} role(s) have {min_characters} characters of speech, at least 2 "
      "are needed: lower --min_role_characters"
    )
  rng = np.random.default_rng([seed, 8])
  num_held_out = min(len(ids) - 1, round(held_out_fraction * len(ids)))
  held_out = {ids[i] for i in rng.choice(len(ids), num_held_out, replace=False)}
  train, test, new = {}, {}, {}
  for c in ids:
    x, y = windows(encode(texts[c]))
    if c in held_out:
      new[c] = data_lib.subsample(x, y, eval_samples, (seed, 9), c)
      continue
    train_stop, test_start = split_role(len(y))
    train[c] = x[:train_stop], y[:train_stop]
    if test_start < len(y):
      test[c] = data_lib.subsample(x[test_start:], y[test_start:], eval_samples, (seed, 9), c)
  new_clients = _client_arrays(new)
  logging.info(
    "%s: %d roles with %d+ characters: %d training clients, %d held out",
    data_dir,
    len(ids),
    min_characters,
    len(train),
    len(new),
  )
  return FederatedData(
    train=_client_arrays(train),
    test=_client_arrays(test),
    new_clients=new_clients,
    source=f"gutenberg:{data_dir}",
    shift=new_clients,
  )


def load_data(
  data_dir: str | None = None,
  *,
  partition: PartitionConfig | None = None,
  seed: int = 0,
  config: ShakespeareConfig | None = None,
) -> FederatedData:
  """Loads Gutenberg's plays from `data_dir`: clients by role (partition None) or iid.

  With `partition` None every (play, role) with `config.min_role_characters` of speech is
  a client, except a seeded `config.held_out_role_fraction` of them, held out as
  `new_clients` (`load_roles`). With `partition.partition == "iid"` the training
  roles' training samples are pooled and split uniformly at random over
  `partition.num_clients` clients, seeded (`data.split_pool`, which also sets aside the
  server's examples if the partition asks for any); their test samples are split like the
  clients' labels, so `test_accuracy` is measured on the same samples as with the roles.

  Raises DataError (one line) if `data_dir` is None or its texts are missing or malformed,
  or for another partition than iid.
  """
  if data_dir is None:
    raise DataError(
      "no Shakespeare texts: pass --data_dir=DIR, a directory of Project Gutenberg's plays "
      f"(<work>{PLAY_SUFFIX}), e.g. --data_dir=../shared/data/shakespeare"
    )
  if partition is not None and partition.partition not in PARTITIONS:
    raise DataError(
      f"--partition={partition.partition} splits by label, and Shakespeare's labels are "
      "next characters: use --partition=iid, or leave it unset for the roles"
    )
  config = config or ShakespeareConfig()
  data = load_roles(
    data_dir,
    min_characters=config.min_role_characters,
    held_out_fraction=config.held_out_role_fraction,
    eval_samples=config.eval_samples_per_role,
    seed=seed,
  )
  if partition is None:
    return data
  return data_lib.repartitioned(data, partition, seed, NUM_IDS)
