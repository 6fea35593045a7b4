"""Tests of `tff_ens.math.personalization` (Shi et al., arXiv:2107.10663, eq. 3-4)."""

import math
import types

import numpy as np
import pytest
import tensorflow_federated as tff

from tasks.data import ClientArrays
from tasks.data import ExamplesOnDisk
from tff_ens import run_files
from tff_ens.math import ensemble_math
from tff_ens.math import personalization
from tff_ens.program import reporting
from tiny import tiny_model


class TestPersonalizationWeights:
  def test_hand_example(self):
    # softmax(-[1, 2, 3] / 1) = [1, e^-1, e^-2] / (1 + e^-1 + e^-2).
    z = 1 + math.exp(-1) + math.exp(-2)
    np.testing.assert_allclose(
      personalization.personalization_weights(np.array([1.0, 2.0, 3.0]), 1.0),
      [1 / z, math.exp(-1) / z, math.exp(-2) / z],
      rtol=1e-12,
    )
    np.testing.assert_allclose(
      personalization.personalization_weights(np.array([1.0, 2.0, 3.0]), 1.0),
      [0.66524096, 0.24472847, 0.09003057],
      rtol=1e-7,
    )
    # tau = 2 halves the loss gaps: [1, e^-0.5, e^-1] / sum.
    z2 = 1 + math.exp(-0.5) + math.exp(-1)
    np.testing.assert_allclose(
      personalization.personalization_weights([1.0, 2.0, 3.0], 2.0),
      [1 / z2, math.exp(-0.5) / z2, math.exp(-1) / z2],
      rtol=1e-12,
    )

  def test_rows_sum_to_one_and_lower_loss_weighs_more(self):
    losses = np.array([[0.3, 2.0, 1.1], [5.0, 4.0, 4.5], [1.0, 1.0, 1.0]])
    for tau in (0.01, 0.3, 1.0, 10.0, float("inf")):
      alpha = personalization.personalization_weights(losses, tau)
      assert alpha.shape == (3, 3)
      np.testing.assert_allclose(alpha.sum(-1), 1.0, rtol=1e-12)
      assert (alpha >= 0).all()
    alpha = personalization.personalization_weights(losses, 1.0)
    assert alpha[0].argmax() == 0 and alpha[1].argmax() == 1
    np.testing.assert_allclose(alpha[2], [1 / 3] * 3)

  def test_infinite_temperature_is_uniform(self):
    alpha = personalization.personalization_weights(np.array([0.1, 7.0, 3.0, 1e9]), float("inf"))
    np.testing.assert_array_equal(alpha, [0.25] * 4)

  def test_small_temperature_picks_the_argmin(self):
    losses = np.array([[2.0, 0.5, 0.6], [900.0, 1000.0, 950.0]])
    alpha = personalization.personalization_weights(losses, 1e-4)
    np.testing.assert_allclose(alpha, [[0, 1, 0], [1, 0, 0]], atol=1e-12)
    assert np.isfinite(alpha).all()  # No overflow for large losses.

  @pytest.mark.parametrize("tau", [0.0, -1.0, -1e-9])
  def test_nonpositive_temperature_raises(self, tau):
    with pytest.raises(ValueError, match="positive"):
      personalization.personalization_weights(np.array([1.0, 2.0]), tau)

  def test_negative_infinite_temperature_raises(self):
    with pytest.raises(ValueError):
      personalization.personalization_weights(np.array([1.0, 2.0]), float("-inf"))

  def test_nan_temperature_raises(self):
    with pytest.raises(ValueError):
      personalization.personalization_weights(np.array([1.0, 2.0]), float("nan"))


def test_member_losses_hand():
  # K = 2 members, n = 2 examples, 3 classes; labels 0 and 2.
  member_probs = np.array(
    [
      [[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]],
      [[0.2, 0.4, 0.4], [0.0, 1.0, 0.0]],  # Probability 0: clipped to 1e-12.
    ]
  )
  y = np.array([0, 2])
  np.testing.assert_allclose(
    ensemble_math.member_losses(member_probs, y),
    [-(math.log(0.5) + math.log(0.8)) / 2, -(math.log(0.2) + math.log(1e-12)) / 2],
    rtol=1e-12,
  )


def test_weighted_probabilities():
  member_probs = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])
  np.testing.assert_allclose(
    ensemble_math.mixture(member_probs, np.array([0.25, 0.75])), [[0.25, 0.75]]
  )


def _client(n, label, wrong, other, right_member, k=2):
  """n examples of class `label`; member `right_member` puts 0.6 on it and
  0.3 on `wrong`, every other member 0.05 on it and 0.9 on `wrong`."""
  probs = np.zeros((k, n, 3))
  for member in range(k):
    p = (0.6, 0.3, 0.1) if member == right_member else (0.05, 0.9, 0.05)
    probs[member, :, label], probs[member, :, wrong], probs[member, :, other] = p
  return probs, np.full(n, label)


class TestChooseTemperature:
  def test_small_temperature_when_each_client_has_its_own_best_member(self):
    # Member 0 is right only on client "a", member 1 only on client "b".
    a_probs, a_y = _client(6, label=0, wrong=1, other=2, right_member=0)
    b_probs, b_y = _client(6, label=2, wrong=0, other=1, right_member=1)
    # Hand check: losses -ln 0.6 and -ln 0.05 differ by ln 12 = 2.4849; the
    # right member gets a = sigmoid(2.4849 / tau), and the ensemble is right
    # iff 0.6a + 0.05(1-a) > 0.3a + 0.9(1-a), i.e. a > 0.85 / 1.15, i.e.
    # tau < 2.4849 / ln(0.85 / 0.30) = 2.386. So 0.01 ... 1.0 all score 1 on
    # both clients, 3, 10 and inf score 0, and ties go to the largest: 1.0.
    assert math.log(12) / math.log(0.85 / 0.30) == pytest.approx(2.386, abs=1e-3)
    tau = personalization.choose_temperature({"a": a_probs, "b": b_probs}, {"a": a_y, "b": b_y})
    assert tau == 1.0
    # The uniform ensemble would be wrong everywhere here.
    uniform = ensemble_math.mixture(a_probs, np.array([0.5, 0.5]))
    assert (uniform.argmax(-1) != a_y).all()

  def test_infinite_temperature_when_members_are_identical(self):
    probs, y = _client(6, label=1, wrong=0, other=2, right_member=0, k=1)
    same = np.concatenate([probs] * 3)  # K = 3 identical members.
    mixed_y = y.copy()
    mixed_y[::2] = 0  # Some examples right, some wrong: scores below 1.
    tau = personalization.choose_temperature({"a": same}, {"a": mixed_y})
    assert tau == float("inf")

  def test_clients_with_fewer_than_two_examples_are_ignored(self):
    probs, y = _client(1, label=0, wrong=1, other=2, right_member=0)
    assert personalization.choose_temperature({"a": probs}, {"a": y}) == float("inf")

  def test_is_deterministic_for_a_seed(self):
    rng = np.random.default_rng(3)
    probs = {c: rng.dirichlet(np.ones(4), size=(3, 10)) for c in "abc"}
    labels = {c: rng.integers(0, 4, 10) for c in "abc"}
    first = personalization.choose_temperature(probs, labels, seed=5)
    assert personalization.choose_temperature(probs, labels, seed=5) == first
    assert first in personalization.TEMPERATURE_GRID


def _clients(sizes, seed):
  rng = np.random.default_rng(seed)
  ids = tuple(f"c{i}" for i in range(len(sizes)))
  return ClientArrays(
    ids,
    {c: rng.random((n, 2, 2, 1), dtype=np.float32) for c, n in zip(ids, sizes)},
    {c: rng.integers(0, 3, n).astype(np.int32) for c, n in zip(ids, sizes)},
    (2, 2, 1),
  )


def test_weighting_examples_are_at_most_the_limit_of_each_clients_own_in_order():
  train = _clients([5, 50, 200], seed=0)
  kept = personalization.weighting_examples(train, 20, seed=3)
  assert [kept.num_examples(c) for c in kept.client_ids] == [5, 20, 20]
  for c in train.client_ids:
    rows = [np.flatnonzero((train.x[c] == row).all((1, 2, 3)))[0] for row in kept.x[c]]
    assert rows == sorted(set(rows))  # Distinct rows of the client's own, in order.
    np.testing.assert_array_equal(kept.y[c], train.y[c][rows])
  again = personalization.weighting_examples(train, 20, seed=3)
  other = personalization.weighting_examples(train, 20, seed=4)
  np.testing.assert_array_equal(kept.y["c2"], again.y["c2"])
  assert not np.array_equal(kept.x["c2"], other.x["c2"])
  everything = personalization.weighting_examples(train, 0, seed=3)
  assert all(everything.x[c] is train.x[c] for c in train.client_ids)


def test_the_summarys_personalized_weights_come_from_the_weighting_examples():
  data = types.SimpleNamespace(train=_clients([300, 400], seed=1), test=_clients([30, 40], 2))
  evaluator = reporting.Evaluator(tiny_model)
  models = [tff.learning.models.ModelWeights.from_model(tiny_model(s)) for s in (0, 5, 9)]
  member_test = evaluator.member_probabilities(models, data.test)

  def summary(train, samples):
    config = types.SimpleNamespace(
      personalization_samples=samples, personalization_temperature=0.3, seed=7
    )
    split = types.SimpleNamespace(train=train, test=data.test)
    return evaluator.ensemble_summary(models, split, member_test, config)

  capped = summary(data.train, 50)
  by_hand = summary(personalization.weighting_examples(data.train, 50, seed=7), 0)
  assert capped["personalized_test_loss"] == by_hand["personalized_test_loss"]
  assert capped["personalized_test_loss"] != summary(data.train, 0)["personalized_test_loss"]


def test_an_evaluation_in_groups_of_clients_is_the_evaluation_of_the_whole_split(
  monkeypatch, tmp_path
):
  # The split's images on disk (as LEAF's are), predicted a few clients at a time: the
  # probabilities of one prediction of all the examples, from the same file read in memory.
  split = _clients([3, 7, 2, 5], seed=4)
  rows = np.concatenate([split.x[c] for c in split.client_ids])
  rows.tofile(tmp_path / "images.f32")
  starts = np.cumsum([0] + [split.num_examples(c) for c in split.client_ids])
  spans = {c: (int(starts[i]), split.num_examples(c)) for i, c in enumerate(split.client_ids)}
  on_disk = ClientArrays(
    split.client_ids,
    ExamplesOnDisk(str(tmp_path / "images.f32"), (2, 2, 1), spans),
    split.y,
    (2, 2, 1),
  )
  evaluator = reporting.Evaluator(tiny_model)
  models = [tff.learning.models.ModelWeights.from_model(tiny_model(s)) for s in (1, 2)]
  whole = evaluator.member_probabilities(models, split)
  monkeypatch.setattr(reporting, "PREDICTED_AT_ONCE", 8)
  assert reporting._client_groups(on_disk, 8) == [["c0"], ["c1"], ["c2", "c3"]]
  grouped = evaluator.member_probabilities(models, on_disk)
  assert list(grouped) == list(split.client_ids)
  for c in split.client_ids:
    np.testing.assert_allclose(grouped[c], whole[c], rtol=1e-6)
    assert grouped[c].shape == (2, split.num_examples(c), 3)


def test_a_given_temperature_weights_only_the_evaluated_clients_training_examples():
  # c2 trains but has no test examples: with tau given, its training examples are not
  # predicted; each evaluated client's alpha = softmax(-mean NLL / tau), by hand in NumPy.
  data = types.SimpleNamespace(train=_clients([30, 40, 50], seed=1), test=_clients([6, 8], 2))
  evaluator = reporting.Evaluator(tiny_model)
  models = [tff.learning.models.ModelWeights.from_model(tiny_model(s)) for s in (0, 5, 9)]
  member_test = evaluator.member_probabilities(models, data.test)
  member_train = evaluator.member_probabilities(models, data.train)
  predicted, predict, summaries = [], evaluator.member_probabilities, {}

  def recorded(models, split):
    predicted.append(tuple(split.client_ids))
    return predict(models, split)

  evaluator.member_probabilities = recorded
  for temperature, clients in ((0.3, ("c0", "c1")), (0.0, ("c0", "c1", "c2"))):
    config = types.SimpleNamespace(
      personalization_samples=0, personalization_temperature=temperature, seed=7
    )
    predicted.clear()
    summaries[temperature] = evaluator.ensemble_summary(models, data, member_test, config)
    assert predicted == [clients]
  accuracies, losses = {}, []
  for c in ("c0", "c1"):
    y, y_test = data.train.y[c], data.test.y[c]
    nll = -np.log(member_train[c][:, np.arange(len(y)), y]).mean(1)
    alpha = np.exp(-nll / 0.3) / np.exp(-nll / 0.3).sum()
    mixed = np.tensordot(alpha, member_test[c], 1)
    accuracies[c] = np.mean(mixed.argmax(-1) == y_test)
    losses.append(-np.log(mixed[np.arange(len(y_test)), y_test]).mean())
  personalized = summaries[0.3]
  assert personalized["personalized_test_loss"] == pytest.approx(np.mean(losses), rel=1e-5)
  assert personalized[run_files.PERSONALIZED_PER_CLIENT] == pytest.approx(accuracies)
