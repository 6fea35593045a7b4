"""Tests of the Shakespeare task on Gutenberg's plays (../shared/data/shakespeare): parsing
real excerpts against speeches written out by hand from the files, the vocabulary, the
samples and split computed by hand, the partitions, each bad-input message, the model (its
per-position logits, its TFLite conversion to the fused LSTM op), local training on every
position against Keras' loss, and a two-round run."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tasks
from tasks import partition as partition_lib
from tasks import plays
from tasks import shakespeare
from tests import numpy_references
from tests.femnist_runs import ROOT
from tests.femnist_runs import read_metrics
from tests.femnist_runs import reference_test_metrics
from tff_ens import run_files
from tff_ens import settings
from tff_ens.templates import client_work

DATA_DIR = pathlib.Path(__file__).resolve().parents[1].parent / "shared/data/shakespeare"
# A few plays for the loading tests (the whole corpus is read once, in `test_corpus_counts`).
SUBSET = ("hamlet", "midsummer_nights_dream", "tempest")
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def _play_lines(name: str) -> list[str]:
  return (DATA_DIR / f"{name}_gut.txt").read_text().splitlines()


@pytest.fixture(scope="module")
def subset_dir(tmp_path_factory):
  """A directory with links to three plays and a poem (which is skipped)."""
  directory = tmp_path_factory.mktemp("shakespeare")
  for name in (*SUBSET, "sonnets"):
    (directory / f"{name}_gut.txt").symlink_to(DATA_DIR / f"{name}_gut.txt")
  return directory


@pytest.fixture(scope="module")
def subset(subset_dir):
  return plays.load_roles(
    str(subset_dir), min_characters=1_000, held_out_fraction=0.1, eval_samples=0, seed=0
  )


# Parsing real excerpts.


def test_midsummer_nights_dream_opening():
  """Its lines 1-85: title, persons, the first scene; names without periods, a speech
  going on after a stage direction."""
  play = plays.parse_play("\n".join(_play_lines("midsummer_nights_dream")[:85]), "mnd")
  assert play.speeches == (
    (
      "THESEUS",
      "Now, fair Hippolyta, our nuptial hour\n"
      "Draws on apace; four happy days bring in\n"
      "Another moon; but, oh, methinks, how slow\n"
      "This old moon wanes! she lingers my desires,\n"
      "Like to a step-dame or a dowager,\n"
      "Long withering out a young man's revenue.\n",
    ),
    (
      "HIPPOLYTA",
      "Four days will quickly steep themselves in nights;\n"
      "Four nights will quickly dream away the time;\n"
      "And then the moon, like to a silver bow\n"
      "New bent in heaven, shall behold the night\n"
      "Of our solemnities.\n",
    ),
    (
      "THESEUS",
      "Go, Philostrate,\n"
      "Stir up the Athenian youth to merriments;\n"
      "Awake the pert and nimble spirit of mirth;\n"
      "Turn melancholy forth to funerals--\n"
      "The pale companion is not for our pomp. --\n"
      "Hippolyta, I woo'd thee with my sword,\n"
      "And won thy love doing thee injuries;\n"
      "But I will wed thee in another key,\n"
      "With pomp, with triumph, and with revelling.\n",
    ),
    ("EGEUS", "Happy be Theseus, our renowned duke!\n"),
    ("THESEUS", "Thanks, good Egeus: what's the news with thee?\n"),
  )
  assert set(play.roles()) == {"THESEUS", "HIPPOLYTA", "EGEUS"}
  assert play.roles()["EGEUS"] == "Happy be Theseus, our renowned duke!\n"


def test_hamlet_abbreviated_speakers():
  """Hamlet's speakers are abbreviations ("Ber.", "Fran."): each is a role, upper-cased."""
  play = plays.read_play(str(DATA_DIR / "hamlet_gut.txt"))
  assert play.speeches[:6] == (
    ("BER", "Who's there?\n"),
    ("FRAN", "Nay, answer me: stand, and unfold yourself.\n"),
    ("BER", "Long live the king!\n"),
    ("FRAN", "Bernardo?\n"),
    ("BER", "He.\n"),
    ("FRAN", "You come most carefully upon your hour.\n"),
  )
  # Its lines 4735-4750: a stage direction on the speaker line, and one inside a speech.
  start = play.speeches.index(("OPH", "Where is the beauteous majesty of Denmark?\n"))
  assert play.speeches[start + 1 : start + 5] == (
    ("QUEEN", "How now, Ophelia?\n"),
    (
      "OPH",
      "How should I your true love know\n"
      "From another one?\n"
      "By his cockle bat and' staff\n"
      "And his sandal shoon.\n",
    ),
    ("QUEEN", "Alas, sweet lady, what imports this song?\n"),
    ("OPH", play.speeches[start + 4][1]),
  )
  assert play.speeches[start + 4][1].startswith("Say you? nay, pray you, mark.\nHe is dead")
  assert {"HAM", "HOR", "KING", "QUEEN", "POL", "OPH"} <= set(play.roles())
  assert not {"CLAUDIUS", "PERSONS REPRESENTED"} & set(play.roles())


def test_typos_and_inline_speech():
  """All's Well's "FIRST LORD. {Aside.]" (a brace for a bracket) and Coriolanus'
  "ALL. Farewell." (a speech on the speaker's line)."""
  alls_well = plays.read_play(str(DATA_DIR / "alls_well_that_ends_well_gut.txt"))
  start = alls_well.speeches.index(("FIRST SOLDIER", "E'en such as you speak to me.\n"))
  assert alls_well.speeches[start + 2][0] == "PAROLLES"
  assert alls_well.speeches[start + 2][1].startswith("Ten o'clock. Within these three hours")
  assert alls_well.speeches[start + 3] == (
    "FIRST LORD",
    "This is the first truth that e'er thine own tongue was guilty of.\n",
  )
  coriolanus = plays.read_play(str(DATA_DIR / "coriolanus_gut.txt"))
  start = coriolanus.speeches.index(("AUFIDIUS", "And keep your honours safe!\n"))
  assert coriolanus.speeches[start + 1 : start + 4] == (
    ("FIRST SENATOR", "Farewell.\n"),
    ("SECOND SENATOR", "Farewell.\n"),
    ("ALL", "Farewell.\n"),
  )


def test_speaker_lines_without_blank_lines_and_stanza_numbers():
  """Coriolanus' "CITIZENS." and Henry IV's "GLEND." end a paragraph's speech; A
  Midsummer Night's Dream's indented "II." numbers a song's stanza, The Taming of the
  Shrew's "I." is Peter's answer."""
  coriolanus = plays.read_play(str(DATA_DIR / "coriolanus_gut.txt"))
  start = coriolanus.speeches.index(("SICINIUS", "What is the city but the people?\n"))
  assert coriolanus.speeches[start + 1] == ("CITIZENS", "True,\nThe people are the city.\n")
  henry = plays.read_play(str(DATA_DIR / "henry_iv_part_1_gut.txt"))
  (start,) = [k for k, (_, text) in enumerate(henry.speeches) if text.startswith("The Moon shi")]
  assert henry.speeches[start - 1][0] == "HOT"
  assert henry.speeches[start - 1][1].endswith("Are the indentures drawn? shall we be gone?\n")
  assert henry.speeches[start][0] == "GLEND"
  assert henry.speeches[start][1].startswith("The Moon shines fair; you may away by night:\n")
  dream = plays.read_play(str(DATA_DIR / "midsummer_nights_dream_gut.txt"))
  assert (
    "SECOND FAIRY",
    "Weaving spiders, come not here;\n"
    "Hence, you long-legg'd spinners, hence;\n"
    "Beetles black, approach not near;\n"
    "Worm nor snail do no offence.\n",
  ) in dream.speeches
  shrew = plays.read_play(str(DATA_DIR / "taming_of_the_shrew_gut.txt"))
  start = shrew.speeches.index(("PETRUCHIO", "Who brought it?\n"))
  assert shrew.speeches[start + 1] == ("PETER", "I.\n")


def test_front_matter_and_stage_directions_are_not_speech():
  tempest = plays.read_play(str(DATA_DIR / "tempest_gut.txt"))
  assert tempest.speeches[:3] == (
    ("MASTER", "Boatswain!\n"),
    ("BOATSWAIN", "Here, master: what cheer?\n"),
    (
      "MASTER",
      "Good! Speak to the mariners: fall to't yarely, or\n"
      "we run ourselves aground: bestir, bestir.\n",
    ),
  )
  text = "".join(tempest.roles().values())
  for not_speech in ("DRAMATIS PERSONAE", "by William Shakespeare", "[", "]", "Exeunt", "SCENE"):
    assert not_speech not in text
  assert set(tempest.roles()) >= {"PROSPERO", "MIRANDA", "ARIEL", "CALIBAN"}


def test_corpus_counts():
  """The counts of docs/tasks.md (LEAF: 1,129 roles, 4,226,158 samples)."""
  corpus = plays.read_plays(str(DATA_DIR))
  assert len(corpus) == 37
  assert "sonnets" not in [p.name for p in corpus]
  sizes = [len(text) for play in corpus for text in play.roles().values()]
  assert len(sizes) == 1_379
  assert sum(sizes) == 4_256_152
  assert sum(size >= 1_000 for size in sizes) == 631


# Vocabulary and samples, by hand.


def test_vocabulary_is_leafs_with_an_oov_id():
  assert plays.VOCABULARY == LEAF_LETTERS
  assert shakespeare.NUM_CLASSES == len(shakespeare.CLASS_LABELS) == 81
  assert shakespeare.OOV_ID == 80
  assert "".join(shakespeare.CLASS_LABELS[:80]) == LEAF_LETTERS
  # T=25+19, o=53+14, space 1, b=53+1, e=53+4, comma 8, newline 0; "{" and "é" are OOV.
  ids = shakespeare.encode("To be,\n{\N{LATIN SMALL LETTER E WITH ACUTE}")
  assert ids.dtype == np.uint8
  assert ids.tolist() == [44, 67, 1, 54, 57, 8, 0, 80, 80]
  assert shakespeare.decode(ids) == "To be,\n\N{REPLACEMENT CHARACTER}\N{REPLACEMENT CHARACTER}"
  assert shakespeare.decode(shakespeare.encode(LEAF_LETTERS)) == LEAF_LETTERS
  with pytest.raises(ValueError, match="0..80"):
    shakespeare.decode([81])


def test_windows_by_hand():
  ids = shakespeare.encode("ab\n")  # 53, 54, 0
  x, y = plays.windows(ids)
  assert x.shape == (3, 80) and x.dtype == np.uint8 and y.dtype == np.int32
  assert y.tolist() == [53, 54, 0]
  assert x[0].tolist() == [1] * 80  # Left-padded with spaces.
  assert x[1].tolist() == [1] * 79 + [53]
  assert x[2].tolist() == [1] * 78 + [53, 54]
  long = np.arange(100, dtype=np.uint8) % 80
  x, y = plays.windows(long)
  assert x[80].tolist() == long[:80].tolist() and y[80] == long[80]
  assert x[99].tolist() == long[19:99].tolist() and y[99] == long[99]
  assert plays.windows(long[:0])[0].shape == (0, 80)


def test_context_ids():
  # H=25+7, i=53+8.
  assert shakespeare.context_ids("Hi").tolist() == [1] * 78 + [32, 61]
  text = "x" * 100 + "Hi"
  assert shakespeare.context_ids(text).tolist() == [76] * 78 + [32, 61]
  assert shakespeare.context_ids(text).dtype == np.int32


def test_split_by_position():
  assert plays.split_role(1_000) == (800, 880)
  assert plays.split_role(401) == (320, 400)  # One test sample.
  assert plays.split_role(400) == (320, 400)  # None.
  assert plays.split_role(0) == (0, 0)


# Loading.


def test_roles(subset):
  train, test, new = subset.train, subset.test, subset.new_clients
  assert subset.source.startswith("gutenberg:")
  assert len(train.client_ids) + len(new.client_ids) == 46  # Roles with 1,000+ characters.
  assert len(new.client_ids) == 5  # round(0.1 * 46)
  assert not set(train.client_ids) & set(new.client_ids)
  assert set(test.client_ids) == set(train.client_ids)  # 1,000+ characters: 120+ test.
  assert "tempest/PROSPERO" in train.client_ids + new.client_ids
  assert subset.shift is new
  # A client's samples: its text's windows, split by position with 80 left out.
  client = train.client_ids[0]
  play, role = client.split("/")
  ids = shakespeare.encode(
    plays.read_play(str(DATA_DIR / f"{play}_gut.txt")).roles()[role.replace("_", " ")]
  )
  stop, start = plays.split_role(len(ids))
  assert np.array_equal(train.y[client], ids[:stop])
  assert np.array_equal(test.y[client], ids[start:])
  assert np.array_equal(test.x[client][0], ids[start - 80 : start])
  assert train.x[client].shape == (stop, 80) and train.x[client].dtype == np.uint8


def test_held_out_roles_and_test_samples_follow_the_seed(subset_dir):
  def load(seed, eval_samples=50):
    return plays.load_roles(
      str(subset_dir),
      min_characters=1_000,
      held_out_fraction=0.1,
      eval_samples=eval_samples,
      seed=seed,
    )

  first, again, other = load(0), load(0), load(1)
  assert first.new_clients.client_ids == again.new_clients.client_ids
  assert first.new_clients.client_ids != other.new_clients.client_ids
  for split in ("train", "test", "new_clients"):
    for client in getattr(first, split).client_ids:
      assert np.array_equal(getattr(first, split).x[client], getattr(again, split).x[client])
  common = sorted(set(first.test.client_ids) & set(other.test.client_ids))
  assert all(first.test.num_examples(c) == 50 for c in first.test.client_ids)
  assert any(not np.array_equal(first.test.y[c], other.test.y[c]) for c in common)
  # The split itself is by position: the same for every seed, train before test.
  for client in common:
    assert np.array_equal(first.train.y[client], other.train.y[client])
  everything = load(0, eval_samples=0)
  for client in first.test.client_ids:
    full = everything.test.x[client]
    rows = {row.tobytes(): k for k, row in enumerate(full)}
    assert all(row.tobytes() in rows for row in first.test.x[client])


def test_iid_partition(subset_dir, subset):
  config = partition_lib.PartitionConfig(
    partition="iid", num_clients=10, server_unlabeled_examples=0, server_validation_examples=0
  )
  everything = plays.ShakespeareConfig(eval_samples_per_role=0)  # As `subset`.
  data = shakespeare.load_data(str(subset_dir), partition=config, seed=0, config=everything)
  sizes = [data.train.num_examples(c) for c in data.train.client_ids]
  assert len(sizes) == 10 and max(sizes) - min(sizes) <= 1
  assert sum(sizes) == subset.train.num_examples()
  assert data.test.num_examples() == subset.test.num_examples()
  assert data.new_clients.client_ids == subset.new_clients.client_ids
  assert data.server is None  # The server's text is the held-out roles'.
  assert data.source.endswith("(iid split)")
  again = shakespeare.load_data(str(subset_dir), partition=config, seed=0, config=everything)
  other = shakespeare.load_data(str(subset_dir), partition=config, seed=1, config=everything)
  client = data.train.client_ids[0]
  assert np.array_equal(data.train.y[client], again.train.y[client])
  assert not np.array_equal(data.train.y[client][:100], other.train.y[client][:100])


def test_task_interface():
  task = tasks.get_task("shakespeare")
  assert task is shakespeare
  assert task.INPUT_SHAPE == (80,) and task.INPUT_DTYPE == np.int32
  assert task.DEFAULT_PARTITION is None and task.TRAIN_AUGMENTATION is None
  assert task.BINARY_MODEL_NAMES == () and task.MODEL_NAMES == ("lstm",)
  assert task.INPUT_DESCRIPTION["vocabulary"] == LEAF_LETTERS
  for name in ("femnist", "cifar10"):
    assert tasks.get_task(name).INPUT_DTYPE == np.float32
  with pytest.raises(settings.SettingError, match="held_out_role_fraction"):
    plays.ShakespeareConfig(held_out_role_fraction=1.0)


# Bad input: one line naming the file or directory and the fix.


def _error(load) -> str:
  with pytest.raises(tasks.DataError) as raised:
    load()
  message = str(raised.value)
  assert "\n" not in message
  return message


def test_no_data_dir():
  message = _error(lambda: shakespeare.load_data())
  assert "--data_dir=../shared/data/shakespeare" in message


def test_missing_or_empty_directory(tmp_path):
  message = _error(lambda: shakespeare.load_data(str(tmp_path / "nowhere")))
  assert str(tmp_path / "nowhere") in message and "does not exist" in message
  (tmp_path / "a_file").write_text("text")
  assert "is not a directory" in _error(lambda: shakespeare.load_data(str(tmp_path / "a_file")))
  (tmp_path / "sonnets_gut.txt").symlink_to(DATA_DIR / "sonnets_gut.txt")
  message = _error(lambda: shakespeare.load_data(str(tmp_path)))
  assert f"{tmp_path} has no plays (<work>_gut.txt files)" in message
  assert "--data_dir=" in message


@pytest.mark.parametrize(
  "content, problem",
  [
    (b"ACT I.\n\nHAMLET.\n\xff\xfe words\n", "not a text file (invalid start byte at byte 16)"),
    (b"ACT I.\n\nHAMLET.\nwords\x00\n", "not a text file (NUL byte at 21)"),
    (b"SONNET I.\n\nFrom fairest creatures we desire increase,\n", "no speeches found"),
  ],
)
def test_bad_play(tmp_path, content, problem):
  (tmp_path / "bad_gut.txt").write_bytes(content)
  message = _error(lambda: shakespeare.load_data(str(tmp_path)))
  assert message.startswith(f"{tmp_path / 'bad_gut.txt'}: {problem}")
  assert "move it out of the directory" in message or "move the file out" in message


def test_unreadable_play(tmp_path):
  (tmp_path / "folder_gut.txt").mkdir()
  message = _error(lambda: shakespeare.load_data(str(tmp_path)))
  assert message.startswith(f"{tmp_path / 'folder_gut.txt'}: cannot be read (Is a directory)")


def test_too_few_roles_and_other_partitions(subset_dir):
  config = plays.ShakespeareConfig(min_role_characters=10**6)
  message = _error(lambda: shakespeare.load_data(str(subset_dir), config=config))
  assert "0 role(s) have 1000000 characters" in message and "--min_role_characters" in message
  dirichlet = partition_lib.PartitionConfig(partition="dirichlet")
  message = _error(lambda: shakespeare.load_data(str(subset_dir), partition=dirichlet))
  assert "--partition=iid" in message


# The model.


def test_model_shape_and_seed():
  model = shakespeare.build_model("lstm", seed=0)
  assert model.input.dtype == tf.int32 and model.input.shape.as_list() == [None, 80]
  assert [type(layer).__name__ for layer in model.layers] == [
    "Embedding",
    "LSTM",
    "LSTM",
    "Dense",
    "Cropping1D",
    "Flatten",
  ]
  # Embedding 81x8; an LSTM has 4 gates of 256 units over its inputs, state and a bias.
  lstms = 4 * 256 * (8 + 256 + 1) + 4 * 256 * (256 + 256 + 1)
  assert model.count_params() == 81 * 8 + lstms + (256 + 1) * 81
  windows = np.random.default_rng(0).integers(0, 81, (2, 80)).astype(np.int32)
  logits = model(windows)
  assert logits.shape == (2, 81)
  # The output is the per-position logits' last position.
  per_position = client_work.per_position_logits(model)(windows)
  assert per_position.shape == (2, 80, 81)
  np.testing.assert_array_equal(per_position[:, -1], logits)
  same, other = shakespeare.build_model("lstm", seed=0), shakespeare.build_model("lstm", seed=1)
  assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), same.get_weights()))
  assert not np.array_equal(model.get_weights()[0], other.get_weights()[0])
  with pytest.raises(ValueError, match="no normalization layers"):
    shakespeare.build_model("lstm", norm="group")
  with pytest.raises(ValueError, match="unknown model 'gru'"):
    shakespeare.build_model("gru")


def _prospero_windows(rows: slice):
  text = plays.read_play(str(DATA_DIR / "tempest_gut.txt")).roles()["PROSPERO"]
  x, y = plays.windows(shakespeare.encode(text))
  return x[rows].astype(np.int32), y[rows]


def test_per_position_targets_are_the_next_characters():
  x, y = _prospero_windows(slice(100, 103))
  targets = client_work.per_position_targets(tf.constant(x), tf.constant(y)).numpy()
  # Window i + 1 is window i moved by one character, so its characters are window i's targets.
  next_x, _ = _prospero_windows(slice(101, 104))
  np.testing.assert_array_equal(targets, next_x)
  np.testing.assert_array_equal(targets[:, -1], y)


@pytest.mark.parametrize("positions", client_work.TRAIN_POSITIONS)
def test_local_training_loss_is_over_every_position_or_the_last(positions):
  """`train_locally`'s summed loss and accuracy on a role's windows, one batch so that the
  weights are the initial ones, against Keras' cross-entropy of the same logits."""
  x, y = _prospero_windows(slice(0, 300, 10))
  model = shakespeare.lstm(seed=0, units=16)
  initial = tf.nest.map_structure(
    lambda v: tf.constant(v.numpy()), client_work.ModelWeights.from_model(model)
  )
  config = client_work.LocalTrainingConfig(learning_rate=0.1, train_positions=positions)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(y))
  _, metrics = client_work.train_locally(
    shakespeare.lstm(seed=0, units=16),
    client_work.local_optimizer(config),
    initial,
    dataset,
    0.1,
    config,
  )
  # [windows, positions] targets and their logits.
  if positions == "every":
    targets = np.concatenate([x[:, 1:], y[:, None]], 1)
    logits = client_work.per_position_logits(model)(x)
  else:
    targets, logits = y[:, None], model(x)[:, None]
  losses = tf.keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True)
  hits = np.argmax(logits, -1) == targets
  # Each window weighs 1: its loss and accuracy are means over its positions.
  assert float(metrics["num_examples"]) == len(y)
  np.testing.assert_allclose(float(metrics["loss"]), np.sum(np.mean(losses, -1)), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["correct"]), np.sum(np.mean(hits, -1)), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout_seconds(900)
def test_two_rounds_on_every_position_learn(tmp_path):
  """The command line on the Tempest's roles pooled over 3 clients: the LSTM's training loss
  over every position falls from round 1 to round 2."""
  (tmp_path / "plays").mkdir()
  (tmp_path / "plays" / "tempest_gut.txt").symlink_to(DATA_DIR / "tempest_gut.txt")
  output_dir = tmp_path / "run"
  command = [
    sys.executable,
    "-m",
    "tff_ens.main",
    "--task=shakespeare",
    "--model=lstm",
    f"--data_dir={tmp_path / 'plays'}",
    "--partition=iid",
    "--num_clients=3",
    "--clients_per_round=3",
    "--client_steps=3",
    "--batch_size=16",
    "--client_optimizer=adam",
    "--client_lr=0.003",
    "--eval_samples_per_role=5",
    "--rounds=2",
    "--eval_every=2",
    f"--output_dir={output_dir}",
  ]
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=850)
  assert done.returncode == 0, done.stderr[-2000:]
  rows = read_metrics(str(output_dir))
  assert float(rows[1]["train_loss"]) < float(rows[0]["train_loss"])
  summary = json.loads((output_dir / run_files.SUMMARY_FILE).read_text())
  assert json.loads((output_dir / run_files.CONFIG_FILE).read_text())["train_positions"] == "every"
  assert summary["rounds"] == 2
  # The summary's accuracy is the saved LSTM's on the roles' test windows (an iid partition
  # tests on the same windows), predicted apart from the run.
  data = shakespeare.load_data(
    str(tmp_path / "plays"),
    seed=summary["seed"],
    config=plays.ShakespeareConfig(eval_samples_per_role=5),
  )
  x, y = data.test.concatenated()
  expected, _ = reference_test_metrics(numpy_references.saved_models(output_dir), x, y)
  assert summary["test_accuracy"] == pytest.approx(expected, abs=1e-9)


@pytest.mark.slow
def test_tflite_fused_lstm():
  """The inference function of one sample converts to builtin ops with TFLite's fused LSTM,
  and gives Keras' logits on real samples. (A batch of any size does not convert: the
  fused op's state has the batch's size, so `from_keras_model` fails on its TensorList.)"""
  model = shakespeare.build_model("lstm", seed=0)
  one = tf.function(lambda x: model(x, training=False)).get_concrete_function(
    tf.TensorSpec([1, 80], tf.int32)
  )
  flatbuffer = tf.lite.TFLiteConverter.from_concrete_functions([one], model).convert()
  interpreter = tf.lite.Interpreter(
    model_content=flatbuffer,
    experimental_op_resolver_type=tf.lite.experimental.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
  )
  interpreter.allocate_tensors()
  ops = {op["op_name"] for op in interpreter._get_ops_details()}
  assert ops == {
    "GATHER",
    "UNIDIRECTIONAL_SEQUENCE_LSTM",
    "FULLY_CONNECTED",
    "STRIDED_SLICE",
    "RESHAPE",
  }
  (given,), (output,) = interpreter.get_input_details(), interpreter.get_output_details()
  assert given["dtype"] == np.int32
  prospero = plays.read_play(str(DATA_DIR / "tempest_gut.txt")).roles()["PROSPERO"]
  x, _ = plays.windows(shakespeare.encode(prospero))
  for row in (0, 40, 1_000, 5_000):
    interpreter.set_tensor(given["index"], x[row : row + 1].astype(np.int32))
    interpreter.invoke()
    expected = model(x[row : row + 1].astype(np.int32)).numpy()
    np.testing.assert_allclose(interpreter.get_tensor(output["index"]), expected, atol=1e-5)
