"""Tests of `tff_ens.algorithms.lg_fedavg` (Liang et al. 2020, Algorithm 1): which layers are
global, a round's partial average by hand, and a client's own model."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import algorithms
from tff_ens.algorithms import lg_fedavg
from tff_ens.templates import client_work
from tff_ens.templates import composition
from tff_ens.templates import stateful_client_work
from tiny import CLIENT_DATA
from tiny import SPEC
from tiny import one_batch

ModelWeights = tff.learning.models.ModelWeights
Config = client_work.LocalTrainingConfig
LR = 0.5


def two_layers(seed=0):
  """Flatten(2x2x1) -> Dense(4) (the local representation) -> Dense(3) (the global top)."""
  init = lambda s: tf.keras.initializers.RandomNormal(stddev=0.5, seed=seed + s)
  return tf.keras.Sequential(
    [
      tf.keras.layers.Input((2, 2, 1)),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(4, activation="relu", kernel_initializer=init(0)),
      tf.keras.layers.Dense(3, kernel_initializer=init(1), bias_initializer=init(2)),
    ]
  )


def test_the_top_layers_are_global():
  assert lg_fedavg.split_layers(two_layers(), 1) == ([False, False, True, True], [])
  with pytest.raises(ValueError, match="lg_global_layers=2: the model has 2 layers"):
    lg_fedavg.split_layers(two_layers(), 2)


def _local_training(start, x, y):
  """What one client trains from `start` (FedAvg's local SGD, one batch)."""
  config = Config(learning_rate=LR)
  result, _ = client_work.train_locally(
    two_layers(), client_work.local_optimizer(config), start, one_batch(x, y), LR, config
  )
  return tf.nest.map_structure(lambda s, u: np.asarray(s - u), start, result.update)


def test_a_round_averages_the_top_layers_and_each_client_keeps_its_own_lower_ones():
  built = algorithms.build_algorithm(
    "lg_fedavg", lambda k=0: two_layers(), SPEC, Config(learning_rate=LR), lg_global_layers=1
  )
  masks = lg_fedavg.split_layers(two_layers(), 1)
  state = built.process.initialize()
  initial = ModelWeights.from_model(two_layers())
  # Two clients with different lower layers of their own.
  lower = [lg_fedavg.part(initial, masks, False) for _ in range(2)]
  lower[1] = tf.nest.map_structure(lambda t: np.asarray(t) + 0.2, lower[1])
  states = [stateful_client_work.flatten(w).numpy() for w in lower]
  data = CLIENT_DATA[:2]
  new_state, _, new_states = built.process.next(
    state, composition.client_inputs([one_batch(x, y) for x, y in data], states=states)
  )
  trained = [
    _local_training(lg_fedavg.join(state["model"], own, masks), x, y)
    for own, (x, y) in zip(lower, data)
  ]
  # The top layer: the example-weighted mean (2 and 3 examples) of the clients' trained ones.
  for k in range(2):
    want = (2 * trained[0].trainable[2 + k] + 3 * trained[1].trainable[2 + k]) / 5
    np.testing.assert_allclose(new_state["model"].trainable[k], want, rtol=1e-5, atol=1e-6)
  # Each client keeps its trained lower layers, which never left it.
  for got, want in zip(new_states, trained):
    np.testing.assert_allclose(
      got, stateful_client_work.flatten(lg_fedavg.part(want, masks, False)), rtol=1e-5, atol=1e-6
    )
  # Only the top layer travels: 4 x 3 + 3 values down and up.
  down, up = built.bytes_per_client_round()
  assert down == 4 * (4 * 3 + 3) + 4  # and the learning rate
  assert up == 4 * (4 * 3 + 3) + 4 + 4 * 4  # and its weight and metric sums
  # A client's own model: its lower layers under the global top.
  own = built.client_states.model(new_states[1], built.models_fn(new_state))
  np.testing.assert_allclose(own.trainable[0], trained[1].trainable[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(own.trainable[2], new_state["model"].trainable[0])
