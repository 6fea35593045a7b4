"""Fed-ensemble's math (Shi et al., IEEE T-ASE 2023, arXiv:2107.10663, Algorithm 1): which of
the K models each client trains in a round, and each model's server update, with FedDyn's
correction (Acar et al., ICLR 2021, Algorithm 1). TensorFlow functions; the TFF stages that
use them are `algorithms.fed_ensemble`'s.
"""

import tensorflow as tf
import tensorflow_federated as tff

ModelWeights = tff.learning.models.ModelWeights

# Which model a client trains: P[i, t mod K] of a permutation drawn every K rounds (the
# paper's), or a uniformly random one every round (its Table VII ablation).
ASSIGNMENTS = ("permutation", "random")


def _client_seed(seed, client_index, stream: int, counter):
  """A stateless-RNG seed unique to (run seed, client, stream, counter)."""
  key = tf.stack([tf.cast(seed, tf.int64), tf.cast(client_index, tf.int64)])
  key = tf.random.experimental.stateless_fold_in(key, stream)
  return tf.random.experimental.stateless_fold_in(key, tf.cast(counter, tf.int64))


def permutation_row(seed, client_index, block, ensemble_size: int):
  """P[i, :] for block `block` = floor(t / K): a random permutation of 0..K-1.

  Shi et al., Algorithm 1, line 4: each client draws an independent
  permutation every K rounds.
  """
  scores = tf.random.stateless_uniform(
    [ensemble_size], seed=_client_seed(seed, client_index, 0, block)
  )
  return tf.argsort(scores)


def assigned_model(
  seed, client_index, round_num, ensemble_size: int, assignment: str = "permutation"
):
  """The model client `client_index` trains in round `round_num` (0-based).

  "permutation": P[i, t mod K] (Shi et al., Algorithm 1, line 6), so every
  client trains every model once in each block of K rounds. "random": a
  uniformly random model per client and round (the paper's Table VII
  ablation).
  """
  if assignment == "permutation":
    row = permutation_row(seed, client_index, round_num // ensemble_size, ensemble_size)
    return row[round_num % ensemble_size]
  if assignment == "random":
    return tf.random.stateless_uniform(
      [], seed=_client_seed(seed, client_index, 1, round_num), maxval=ensemble_size, dtype=tf.int32
    )
  raise ValueError(f"unknown assignment {assignment!r}: choose one of {', '.join(ASSIGNMENTS)}")


def apply_slot_means(members, slots, weights):
  """Model k minus its slot's mean update; untouched if nobody trained it.

  Shi et al., Algorithm 1, line 9: theta_k <- weighted mean of the returned
  models that started from theta_k (as `theta_k - mean delta`).

  Args:
    members: a tuple of K models (structures of tensors).
    slots: a tuple of K summed updates (`keyed_stages.build_slot_aggregator`).
    weights: the K summed weights.
  """

  def apply(member, slot, total):
    # Only a trained member is computed: the others pass through uncopied.
    return tf.cond(
      total > 0,
      lambda: tf.nest.map_structure(lambda w, s: w - s / total, member, slot),
      lambda: tf.nest.map_structure(tf.identity, member),
    )

  return tuple(apply(m, s, weights[k]) for k, (m, s) in enumerate(zip(members, slots)))


def apply_feddyn_correction(members, corrections, slots, weights, alpha: float, num_clients: int):
  """FedDyn's server update for every model (Acar et al., Algorithm 1, 9-10).

  For model k, with u_i = w_k - w_i the updates of the clients that trained
  it (summed in slot k, unweighted) and m = `num_clients` the population:

      h_k <- h_k + (alpha / m) sum_i u_i      (line 9: h - alpha/m sum (w_i - w))
      w_k <- mean_i w_i - h_k / alpha         (line 10)

  Args:
    members: the K models after `apply_slot_means` (mean_i w_i, or w_k
      unchanged when nobody trained it).
    corrections: the K h's, one tensor per trainable weight.
    slots, weights: the K unweighted update sums and client counts.
    alpha: FedDyn's alpha.
    num_clients: m.

  Returns:
    (members, corrections); a model nobody trained keeps both unchanged.
  """

  def corrected(member, h, slot):
    h = tuple(h_t + (alpha / num_clients) * u for h_t, u in zip(h, slot.trainable))
    return tuple(w - h_t / alpha for w, h_t in zip(member.trainable, h)), h

  new_members, new_corrections = [], []
  for member, h, slot, total in zip(members, corrections, slots, tf.unstack(weights)):
    # Only a trained model is computed: the others pass through uncopied.
    trainable, h = tf.cond(
      total > 0,
      lambda member=member, h=h, slot=slot: corrected(member, h, slot),
      lambda member=member, h=h: tf.nest.map_structure(
        tf.identity, (tuple(member.trainable), tuple(h))
      ),
    )
    new_members.append(ModelWeights(list(trainable), list(member.non_trainable)))
    new_corrections.append(tuple(h))
  return tuple(new_members), tuple(new_corrections)
