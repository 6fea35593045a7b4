"""Tests of `tff_ens.math.weight_posterior` (FedBE, Chen and Chao, ICLR 2021).

Three clients with two-tensor models: the Gaussians (the paper's eq. 5 and
the authors' normalized, scaled one) against NumPy and numbers worked by hand,
their samples' mean and variance, the Dirichlet variants' concentrations and
coefficients (eq. 7, the authors' symmetric one, the proportional one), convex
combinations, and the teachers of each Table 3 variant.
"""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.math import weight_posterior as wp

ModelWeights = tff.learning.models.ModelWeights

SIZES = np.array([1.0, 2.0, 5.0], np.float32)  # |D_i|
KERNELS = np.array(
  [[[1.0, -2.0], [0.5, 3.0]], [[2.0, -1.0], [0.5, 1.0]], [[0.0, 0.0], [1.5, 2.0]]], np.float32
)  # [3, 2, 2]
BIASES = np.array([[0.1, 0.2], [0.3, -0.2], [0.5, 0.0]], np.float32)
BN_MEANS = np.array([[1.0], [2.0], [4.0]], np.float32)  # non-trainable


def client(i):
  return ModelWeights([KERNELS[i], BIASES[i]], [BN_MEANS[i]])


def stacked_clients():
  return ModelWeights([KERNELS, BIASES], [BN_MEANS])


def numpy_weighted_moments(values):
  p = SIZES / SIZES.sum()
  mean = np.tensordot(p, values, axes=1)
  var = np.tensordot(p, (values - mean) ** 2, axes=1)
  return mean, var


def summed_moments():
  terms = [wp.moment_terms(client(i), SIZES[i]) for i in range(3)]
  return tf.nest.map_structure(lambda *t: tf.add_n(t), *terms)


def test_gaussian_moments_match_numpy():
  mean, var = wp.gaussian_from_moments(*summed_moments())
  for got_mean, got_var, values in zip(
    tf.nest.flatten(mean), tf.nest.flatten(var), (KERNELS, BIASES, BN_MEANS)
  ):
    want_mean, want_var = numpy_weighted_moments(values)
    np.testing.assert_allclose(got_mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_var, want_var, rtol=1e-4, atol=1e-6)
  assert isinstance(mean, ModelWeights)


def test_gaussian_variance_of_identical_models_is_zero_not_negative():
  w = tf.constant([0.1, 1e3, -7.3])
  mean, var = wp.gaussian_from_moments(*wp.moment_terms(w, 3.0))
  np.testing.assert_allclose(mean, w)
  assert np.all(var.numpy() >= 0) and np.all(var.numpy() < 1e-1)


def test_gaussian_of_no_client_is_zero():
  mean, var = wp.gaussian_from_moments(tf.ones([2]), tf.ones([2]), 0.0)
  np.testing.assert_array_equal(mean, [0, 0])
  np.testing.assert_array_equal(var, [0, 0])


def test_gaussian_samples_have_the_fitted_mean_and_variance():
  mean, var = wp.gaussian_from_moments(*summed_moments())
  samples = wp.sample_gaussian(mean, var, 20_000, seed=[3, 4])
  for got, m, v in zip(samples.trainable, mean.trainable, var.trainable):
    assert got.shape == (20_000, *m.shape)
    # Standard errors: sqrt(v / n) for the mean, about v * sqrt(2 / n) for
    # the variance; 5 of them.
    np.testing.assert_allclose(got.numpy().mean(0), m, atol=5 * np.sqrt(v.numpy().max() / 20_000))
    np.testing.assert_allclose(got.numpy().var(0), v, rtol=5 * np.sqrt(2 / 20_000), atol=1e-6)
  # Batch-norm statistics are not sampled: every sample has the mean.
  np.testing.assert_array_equal(
    samples.non_trainable[0], np.tile(mean.non_trainable[0][None], [20_000, 1])
  )


def test_gaussian_sampling_is_seeded():
  mean, var = wp.gaussian_from_moments(*summed_moments())
  a = wp.sample_gaussian(mean, var, 4, seed=[1, 2])
  b = wp.sample_gaussian(mean, var, 4, seed=[1, 2])
  c = wp.sample_gaussian(mean, var, 4, seed=[1, 3])
  for x, y, z in zip(a.trainable, b.trainable, c.trainable):
    np.testing.assert_array_equal(x, y)
    assert not np.allclose(x, z)
  # Tensors of one structure get different noise (not one shared draw).
  noise = a.trainable[0][:, 0, :] - mean.trainable[0][0]
  scaled = noise / np.sqrt(var.trainable[0][0])
  assert not np.allclose(scaled, (a.trainable[1] - mean.trainable[1]) / np.sqrt(var.trainable[1]))


def test_gaussian_samples_every_tensor_of_a_plain_tuple():
  mean = (tf.zeros([3]), tf.zeros([2]))
  var = (tf.ones([3]), tf.ones([2]))
  samples = wp.sample_gaussian(mean, var, 2, seed=[0, 0])
  assert all(np.all(s.numpy() != 0) for s in samples)


# The clients' updates d_i = w0 - w_i; client 3 is rejected (weight 0) and
# its large update must not count. The biases of clients 0-2 point one way,
# so their unit updates agree and the variance clamp binds.
UPDATE_WEIGHTS = np.array([1.0, 2.0, 5.0, 0.0], np.float32)
UPDATE_KERNELS = np.array(
  [
    [[1.0, -2.0], [0.5, 3.0]],
    [[-2.0, 1.0], [0.0, 1.0]],
    [[0.0, 0.5], [1.5, 2.0]],
    [[90.0, 90.0], [90.0, 90.0]],
  ],
  np.float32,
)
UPDATE_BIASES = np.array([[1.0, 2.0], [2.0, 4.0], [0.5, 1.0], [70.0, 0.0]], np.float32)


def stacked_updates():
  return ModelWeights([UPDATE_KERNELS, UPDATE_BIASES], [])


def numpy_normalized_gaussian(values, var_scale=0.1, var_clamp=1e-5):
  """swag.py's fit, unweighted over the three clients present."""
  values = values[:3].astype(np.float64)
  norms = np.sqrt((values**2).reshape(3, -1).sum(1))
  units = values / norms.reshape([3] + [1] * (values.ndim - 1))
  mean_unit = units.mean(0)
  var_unit = np.maximum((units**2).mean(0) - mean_unit**2, var_clamp)
  return norms.mean() * mean_unit, (var_scale * norms.mean()) ** 2 * var_unit


def test_normalized_gaussian_worked_by_hand():
  # d_1 = [3, 4] (norm 5, unit [0.6, 0.8]), d_2 = [0, 2] (norm 2, unit
  # [0, 1]): mean unit [0.3, 0.9], variance [0.18 - 0.09, 0.82 - 0.81] =
  # [0.09, 0.01], mean norm 3.5; std 0.1 * 3.5 * [0.3, 0.1].
  updates = (tf.constant([[3.0, 4.0], [0.0, 2.0]]),)
  mean, var = wp.fit_gaussian_to_updates(updates, [1.0, 9.0], "code")
  np.testing.assert_allclose(mean[0], [1.05, 3.15], rtol=1e-6)
  np.testing.assert_allclose(np.sqrt(var[0]), [0.105, 0.035], rtol=1e-5)
  # Eq. 5 with these (unequal) weights spreads far more: std [0.9, 0.6].
  _, paper_var = wp.fit_gaussian_to_updates(updates, [1.0, 9.0], "paper")
  np.testing.assert_allclose(np.sqrt(paper_var[0]), [0.9, 0.6], rtol=1e-5)


def test_normalized_gaussian_matches_numpy_and_drops_rejected_clients():
  mean, var = wp.fit_gaussian_to_updates(stacked_updates(), UPDATE_WEIGHTS, "code")
  assert isinstance(mean, ModelWeights)
  for got_mean, got_var, values in zip(
    tf.nest.flatten(mean), tf.nest.flatten(var), (UPDATE_KERNELS, UPDATE_BIASES)
  ):
    want_mean, want_var = numpy_normalized_gaussian(values)
    np.testing.assert_allclose(got_mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_var, want_var, rtol=1e-4)
  # Biases: equal unit updates, so the clamp: (0.1 * mean norm)^2 * 1e-5.
  mean_norm = np.sqrt(5.0) * (1 + 2 + 0.5) / 3
  np.testing.assert_allclose(var.trainable[1], [(0.1 * mean_norm) ** 2 * 1e-5] * 2, rtol=1e-4)


def test_normalized_gaussian_var_scale_and_clamp():
  _, var = wp.fit_gaussian_to_updates(stacked_updates(), UPDATE_WEIGHTS, "code")
  _, doubled = wp.fit_gaussian_to_updates(stacked_updates(), UPDATE_WEIGHTS, "code", var_scale=0.2)
  np.testing.assert_allclose(doubled.trainable[0], 4 * var.trainable[0], rtol=1e-5)
  _, clamped = wp.fit_gaussian_to_updates(stacked_updates(), UPDATE_WEIGHTS, "code", var_clamp=10.0)
  want = numpy_normalized_gaussian(UPDATE_KERNELS, var_clamp=10.0)[1]
  np.testing.assert_allclose(clamped.trainable[0], want, rtol=1e-5)
  # Unit updates' variances are at most 1: a clamp of 10 binds everywhere.
  mean_norm = np.sqrt((UPDATE_KERNELS[:3] ** 2).sum((1, 2))).mean()
  np.testing.assert_allclose(want, (0.1 * mean_norm) ** 2 * 10.0)


def test_normalized_gaussian_of_a_zero_update_and_of_no_client():
  updates = (tf.constant([[0.0, 0.0], [0.0, 2.0]]),)
  mean, var = wp.fit_gaussian_to_updates(updates, [1.0, 1.0], "code", var_clamp=0.0)
  # Units [0, 0] and [0, 1]; mean norm 1.
  np.testing.assert_allclose(mean[0], [0.0, 0.5])
  np.testing.assert_allclose(var[0], [0.0, 0.01 * 0.25], rtol=1e-5)
  mean, var = wp.fit_gaussian_to_updates(updates, [0.0, 0.0], "code")
  np.testing.assert_array_equal(mean[0], [0, 0])
  np.testing.assert_array_equal(var[0], [0, 0])


def test_paper_gaussian_of_updates_is_eq_5_of_the_client_models():
  w0 = [np.full([2, 2], 0.5, np.float32), np.array([1.0, -1.0], np.float32)]
  mean_update, var = wp.fit_gaussian_to_updates(stacked_updates(), UPDATE_WEIGHTS)
  p = UPDATE_WEIGHTS / UPDATE_WEIGHTS.sum()
  for start, got_mean, got_var, updates in zip(
    w0, mean_update.trainable, var.trainable, (UPDATE_KERNELS, UPDATE_BIASES)
  ):
    models = start[None] - updates
    want_mean = np.tensordot(p, models, axes=1)
    np.testing.assert_allclose(start - got_mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
      got_var, np.tensordot(p, (models - want_mean) ** 2, axes=1), rtol=1e-4, atol=1e-6
    )


def test_normalized_gaussian_samples_have_its_mean_and_std_and_are_seeded():
  w0 = ModelWeights([np.full([2, 2], 0.5, np.float32), np.array([1.0, -1.0], np.float32)], [])
  mean_update, var = wp.fit_gaussian_to_updates(stacked_updates(), UPDATE_WEIGHTS, "code")
  mean = tf.nest.map_structure(tf.subtract, w0, mean_update)
  samples = wp.sample_gaussian(mean, var, 20_000, seed=[4, 4])
  want_mean, want_var = numpy_normalized_gaussian(UPDATE_KERNELS)
  got = samples.trainable[0].numpy()
  np.testing.assert_allclose(
    got.mean(0), 0.5 - want_mean, atol=5 * np.sqrt(want_var.max() / 20_000)
  )
  np.testing.assert_allclose(got.std(0), np.sqrt(want_var), rtol=0.03)
  again = wp.sample_gaussian(mean, var, 20_000, seed=[4, 4])
  np.testing.assert_array_equal(again.trainable[0], got)


def test_gaussian_unknown_variant_and_bad_scale():
  with pytest.raises(ValueError, match="unknown gaussian 'swag'"):
    wp.fit_gaussian_to_updates(stacked_updates(), UPDATE_WEIGHTS, "swag")
  with pytest.raises(ValueError, match="var_scale > 0"):
    wp.fit_gaussian_to_updates(stacked_updates(), UPDATE_WEIGHTS, "code", var_scale=0.0)


def test_dirichlet_concentration_of_each_variant():
  # |D| = [1, 2, 5, 0], alpha = 0.5, N = 3 clients present.
  sizes = [1.0, 2.0, 5.0, 0.0]
  np.testing.assert_allclose(
    wp.dirichlet_concentration(sizes, 0.5, symmetric=True), [0.5, 0.5, 0.5, 0.0]
  )
  # alpha * N * p_i = 0.5 * 3 * [1, 2, 5, 0] / 8.
  np.testing.assert_allclose(
    wp.dirichlet_concentration(sizes, 0.5), [0.1875, 0.375, 0.9375, 0.0], rtol=1e-6
  )


def test_reweight_by_size_by_hand():
  gamma = tf.constant([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
  np.testing.assert_allclose(
    wp.reweight_by_size(gamma, SIZES),
    # [0.5 * 1, 0.5 * 2, 0] / 1.5 and [0.2 * 1, 0.3 * 2, 0.5 * 5] / 3.3.
    [[1 / 3, 2 / 3, 0.0], [0.2 / 3.3, 0.6 / 3.3, 2.5 / 3.3]],
    rtol=1e-6,
  )


def test_dirichlet_default_is_the_papers_reweighting_of_the_codes_draws():
  code = wp.sample_dirichlet_coefficients(SIZES, 0.7, 6, seed=[2, 9], dirichlet="code")
  paper = wp.sample_dirichlet_coefficients(SIZES, 0.7, 6, seed=[2, 9])
  np.testing.assert_array_equal(
    paper, wp.sample_dirichlet_coefficients(SIZES, 0.7, 6, seed=[2, 9], dirichlet="paper")
  )
  # Same Gamma draws; eq. 7 multiplies by |D_i| and renormalizes.
  weighted = code.numpy() * SIZES
  np.testing.assert_allclose(paper, weighted / weighted.sum(1, keepdims=True), rtol=1e-5)
  assert not np.allclose(paper, code)


def test_dirichlet_code_is_symmetric_whatever_the_sizes():
  gamma = wp.sample_dirichlet_coefficients(
    SIZES, 1.0, 20_000, seed=[5, 6], dirichlet="code"
  ).numpy()
  # Dir(1, 1, 1): mean 1/3, variance (1/3)(2/3) / (3 + 1) = 1/18.
  np.testing.assert_allclose(gamma.mean(0), [1 / 3] * 3, atol=0.01)
  np.testing.assert_allclose(gamma.var(0), [1 / 18] * 3, rtol=0.1)


def test_dirichlet_paper_mean_matches_numpy_monte_carlo():
  gamma = wp.sample_dirichlet_coefficients(SIZES, 1.0, 20_000, seed=[5, 6]).numpy()
  draws = np.random.default_rng(0).dirichlet([1.0] * 3, size=200_000) * SIZES
  want = (draws / draws.sum(1, keepdims=True)).mean(0)
  np.testing.assert_allclose(gamma.mean(0), want, atol=0.01)
  # The largest client's mean share lies between the symmetric Dirichlet's
  # 1/3 and its FedAvg weight 5/8.
  assert 0.4 < gamma.mean(0)[2] < 0.6


def test_dirichlet_proportional_has_mean_p():
  gamma = wp.sample_dirichlet_coefficients(
    SIZES, 1.0, 20_000, seed=[5, 6], dirichlet="proportional"
  ).numpy()
  # E[gamma] = p = |D_i| / |D| (alpha_i = alpha * N * p_i).
  p = SIZES / SIZES.sum()
  np.testing.assert_allclose(gamma.mean(0), p, atol=0.01)
  # Var[gamma_i] = p_i (1 - p_i) / (alpha_0 + 1), alpha_0 = alpha * N = 3.
  np.testing.assert_allclose(gamma.var(0), p * (1 - p) / 4, rtol=0.1)


@pytest.mark.parametrize("dirichlet", wp.DIRICHLETS)
def test_dirichlet_rows_on_the_simplex_and_zero_for_absent(dirichlet):
  gamma = wp.sample_dirichlet_coefficients(
    [4.0, 1.0, 0.0], 0.5, 100, seed=[0, 1], dirichlet=dirichlet
  ).numpy()
  assert np.all(gamma[:, 2] == 0) and np.all(gamma >= 0)
  np.testing.assert_allclose(gamma.sum(1), 1.0, atol=1e-5)


@pytest.mark.parametrize("dirichlet", wp.DIRICHLETS)
def test_dirichlet_tiny_alpha_gives_valid_rows(dirichlet):
  gamma = wp.sample_dirichlet_coefficients(
    SIZES, 1e-4, 50, seed=[7, 7], dirichlet=dirichlet
  ).numpy()
  assert np.all(np.isfinite(gamma)) and np.all(gamma >= 0)
  np.testing.assert_allclose(gamma.sum(1), 1.0, atol=1e-5)


@pytest.mark.parametrize("dirichlet", wp.DIRICHLETS)
def test_dirichlet_is_seeded(dirichlet):
  a, b, c = (
    wp.sample_dirichlet_coefficients(SIZES, 1.0, 5, seed=seed, dirichlet=dirichlet)
    for seed in ([1, 1], [1, 1], [1, 2])
  )
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)


def test_dirichlet_unknown_variant():
  with pytest.raises(ValueError, match="unknown dirichlet 'eq7'"):
    wp.sample_dirichlet_coefficients(SIZES, 1.0, 2, [0, 0], dirichlet="eq7")


def test_combine_models_is_the_convex_combination():
  gamma = np.array([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]], np.float32)
  combined = wp.combine_models(stacked_clients(), gamma)
  np.testing.assert_allclose(combined.trainable[0][0], KERNELS[0])
  np.testing.assert_allclose(
    combined.trainable[0][1], 0.2 * KERNELS[0] + 0.3 * KERNELS[1] + 0.5 * KERNELS[2], rtol=1e-6
  )
  np.testing.assert_allclose(combined.non_trainable[0][1], [0.2 * 1 + 0.3 * 2 + 0.5 * 4], rtol=1e-6)


@pytest.mark.parametrize(
  "targets,expected",
  [
    ("A", ["A"]),
    ("S", ["S0", "S1"]),
    ("S+A", ["A", "S0", "S1"]),
    ("A+C", ["A", "C0", "C1", "C2"]),
    ("S+C", ["C0", "C1", "C2", "S0", "S1"]),
    ("S+A+C", ["A", "C0", "C1", "C2", "S0", "S1"]),
  ],
)
def test_teacher_stack_of_each_table_3_variant(targets, expected):
  # Tag each model by the value of its single weight.
  tags = {"A": 100.0, "C0": 0.0, "C1": 1.0, "C2": 2.0, "S0": 10.0, "S1": 11.0}
  average = (tf.constant([100.0]),)
  clients = (tf.constant([[0.0], [1.0], [2.0]]),)
  samples = (tf.constant([[10.0], [11.0]]),)
  teachers = wp.teacher_stack(targets, average, clients, samples)
  np.testing.assert_array_equal(teachers[0][:, 0], [tags[name] for name in expected])
  assert wp.num_teachers(targets, 3, 2) == len(expected)


def test_teacher_weights_drop_rejected_clients():
  np.testing.assert_array_equal(wp.teacher_weights("S+A+C", [3.0, 0.0, 1.0], 2), [1, 1, 0, 1, 1, 1])
  np.testing.assert_array_equal(wp.teacher_weights("A+C", [0.0, 2.0], 5), [1, 0, 1])
  np.testing.assert_array_equal(wp.teacher_weights("S", [1.0], 3), [1, 1, 1])


def test_teacher_stack_errors():
  with pytest.raises(ValueError, match="unknown targets 'X'"):
    wp.teacher_stack("X", (tf.zeros([1]),))
  with pytest.raises(ValueError, match="pass the samples"):
    wp.teacher_stack("S+A", (tf.zeros([1]),))
