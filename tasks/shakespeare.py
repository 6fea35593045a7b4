"""Shakespeare: next-character prediction, one client per speaking role of a play.

Citations:
  Caldas, Duddu, Wu, Li, Konecny, McMahan, Smith and Talwalkar, "LEAF: A Benchmark for
  Federated Settings", arXiv:1812.01097, 2018 (the clients, samples, vocabulary and split,
  and the model: models/shakespeare/stacked_lstm.py).
  McMahan, Moore, Ramage, Hampson and Aguera y Arcas, "Communication-Efficient Learning of
  Deep Networks from Decentralized Data", AISTATS 2017, Sec. 3 (the task and its two-layer
  LSTM).

Load: `tasks.plays` (NumPy only, so that the device environment reads the same clients)
reads Project Gutenberg's plays from `data_dir` and makes each (play, role) with
`min_role_characters` of speech a client (`load_data`, `plays.load_data`). Preprocess: a
sample is the character ids of the 80 characters before a character of the role's text
(uint8 [n, 80], LEAF's vocabulary, left-padded with spaces) and that character's id (int32
label in 0..80); the model reads the ids as int32 (INPUT_DTYPE). `encode` and
`context_ids` turn any text into ids, `decode` back.
"""

import numpy as np
import tensorflow as tf

import tasks
from tasks import plays
from tasks import resnet
from tasks.plays import context_ids  # noqa: F401
from tasks.plays import decode  # noqa: F401
from tasks.plays import encode  # noqa: F401
from tasks.plays import load_data  # noqa: F401

VOCABULARY = plays.VOCABULARY
OOV_ID = plays.OOV_ID
# The classes are the vocabulary's characters and the out-of-vocabulary id.
NUM_CLASSES = plays.NUM_IDS
CLASS_LABELS = (*VOCABULARY, "<oov>")
INPUT_SHAPE = (plays.SEQUENCE_LENGTH,)
# The model's input: character ids (the stored samples are uint8, which fits 0..80).
INPUT_DTYPE = np.int32
# What a model's input is, for an exported file's metadata (`export.convert.describe`).
INPUT_DESCRIPTION = {
  "value_range": [0, OOV_ID],
  "background": None,
  "vocabulary": VOCABULARY,
  "out_of_vocabulary_id": OOV_ID,
  "padding_id": plays.PAD_ID,
  "preprocessing": (
    "the 80 characters before the one to predict, as int32 ids [batch, 80]: a character's "
    f"position in `vocabulary` (LEAF's {len(VOCABULARY)} characters), {OOV_ID} for any "
    f"other; fewer than 80 characters are left-padded with spaces (id {plays.PAD_ID}); the "
    "output's class k is the next character's id"
  ),
}
MODEL_NAMES = ("lstm",)
BINARY_MODEL_NAMES = ()
DEFAULT_PARTITION = plays.DEFAULT_PARTITION
PARTITIONS = plays.PARTITIONS
SERVER_EXAMPLES = plays.SERVER_EXAMPLES
# No augmentation of training examples (see tasks/__init__.py).
TRAIN_AUGMENTATION = None


# The task's own settings (tasks/__init__.py).
SETTINGS = plays.ShakespeareConfig


def lstm(seed: int, units: int = 256) -> tf.keras.Model:
  """LEAF's Shakespeare model (models/shakespeare/stacked_lstm.py; McMahan et al. 2017):
  an 8-dimensional embedding of the ids, two LSTM layers of `units` units (256), logits of
  the next character from the last step.

  The dense layer maps every step's output to logits (the layer `tasks.PER_POSITION_LOGITS`,
  which client training reads to learn from every position of a window); the model's output
  is its last step's, LEAF's logits. Keras' LSTM with its default activations and
  unroll=False converts to TFLite's fused UNIDIRECTIONAL_SEQUENCE_LSTM (for a fixed batch
  size: convert the inference function of one sample, as `export.convert` does)."""
  seeds = resnet.seed_stream(seed)
  glorot = lambda: tf.keras.initializers.GlorotUniform(seed=next(seeds))
  orthogonal = lambda: tf.keras.initializers.Orthogonal(seed=next(seeds))
  layers = tf.keras.layers
  return tf.keras.Sequential(
    [
      tf.keras.Input(shape=INPUT_SHAPE, dtype=tf.int32),
      layers.Embedding(NUM_CLASSES, 8, embeddings_initializer=glorot()),
      layers.LSTM(
        units,
        return_sequences=True,
        kernel_initializer=glorot(),
        recurrent_initializer=orthogonal(),
      ),
      layers.LSTM(
        units,
        return_sequences=True,
        kernel_initializer=glorot(),
        recurrent_initializer=orthogonal(),
      ),
      layers.Dense(NUM_CLASSES, kernel_initializer=glorot(), name=tasks.PER_POSITION_LOGITS),
      layers.Cropping1D((plays.SEQUENCE_LENGTH - 1, 0)),
      layers.Flatten(),
    ],
    name="shakespeare_lstm",
  )


def build_model(name: str, *, seed: int = 0, norm: str = "batch") -> tf.keras.Model:
  """An un-compiled model from int32 ids [batch, 80] to NUM_CLASSES logits (no softmax).

  Args:
    name: one of MODEL_NAMES: "lstm" (LEAF's; it has no normalization layers, so only
      norm="batch", the default, is accepted).
    seed: the weights are a deterministic function of it.
    norm: unused but for that check (the task interface's argument).
  """
  if name not in MODEL_NAMES:
    raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}")
  if norm != "batch":
    raise ValueError(f"model {name!r} has no normalization layers: leave norm at 'batch'")
  return lstm(seed)
