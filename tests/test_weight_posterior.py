"""Tests of `tff_ens.weight_posterior` (FedBE, Chen and Chao, ICLR 2021).

Three clients with two-tensor models: the Gaussian's moments (eq. 5) against
NumPy, its samples' mean and variance, Dirichlet coefficients (eq. 7) on the
simplex, convex combinations, and the teachers of each Table 3 variant.
"""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import weight_posterior as wp

ModelWeights = tff.learning.models.ModelWeights

SIZES = np.array([1.0, 2.0, 5.0], np.float32)  # |D_i|
KERNELS = np.array([[[1.0, -2.0], [0.5, 3.0]],
                    [[2.0, -1.0], [0.5, 1.0]],
                    [[0.0, 0.0], [1.5, 2.0]]], np.float32)  # [3, 2, 2]
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
      tf.nest.flatten(mean), tf.nest.flatten(var),
      (KERNELS, BIASES, BN_MEANS)):
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
    np.testing.assert_allclose(got.numpy().mean(0), m,
                               atol=5 * np.sqrt(v.numpy().max() / 20_000))
    np.testing.assert_allclose(got.numpy().var(0), v,
                               rtol=5 * np.sqrt(2 / 20_000), atol=1e-6)
  # Batch-norm statistics are not sampled: every sample has the mean.
  np.testing.assert_array_equal(
      samples.non_trainable[0], np.tile(mean.non_trainable[0][None],
                                        [20_000, 1]))


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
  assert not np.allclose(scaled, (a.trainable[1] - mean.trainable[1]) /
                         np.sqrt(var.trainable[1]))


def test_gaussian_samples_every_tensor_of_a_plain_tuple():
  mean = (tf.zeros([3]), tf.zeros([2]))
  var = (tf.ones([3]), tf.ones([2]))
  samples = wp.sample_gaussian(mean, var, 2, seed=[0, 0])
  assert all(np.all(s.numpy() != 0) for s in samples)


def test_dirichlet_coefficients_are_on_the_simplex_with_mean_p():
  gamma = wp.sample_dirichlet_coefficients(SIZES, 1.0, 20_000, seed=[5, 6])
  gamma = gamma.numpy()
  assert gamma.shape == (20_000, 3)
  assert np.all(gamma >= 0)
  np.testing.assert_allclose(gamma.sum(1), 1.0, atol=1e-5)
  # E[gamma] = p = |D_i| / |D| (alpha_i = alpha * N * p_i).
  np.testing.assert_allclose(gamma.mean(0), SIZES / SIZES.sum(), atol=0.01)
  # Var[gamma_i] = p_i (1 - p_i) / (alpha_0 + 1), alpha_0 = alpha * N = 3.
  p = SIZES / SIZES.sum()
  np.testing.assert_allclose(gamma.var(0), p * (1 - p) / 4, rtol=0.1)


def test_dirichlet_symmetric_for_equal_clients_and_zero_for_absent():
  np.testing.assert_allclose(
      wp.dirichlet_concentration([4.0, 4.0, 0.0], 0.5), [0.5, 0.5, 0.0])
  gamma = wp.sample_dirichlet_coefficients([4.0, 4.0, 0.0], 0.5, 100,
                                           seed=[0, 1]).numpy()
  assert np.all(gamma[:, 2] == 0)
  np.testing.assert_allclose(gamma.sum(1), 1.0, atol=1e-5)


def test_dirichlet_tiny_alpha_gives_valid_rows():
  gamma = wp.sample_dirichlet_coefficients(SIZES, 1e-4, 50,
                                           seed=[7, 7]).numpy()
  assert np.all(np.isfinite(gamma)) and np.all(gamma >= 0)
  np.testing.assert_allclose(gamma.sum(1), 1.0, atol=1e-5)


def test_dirichlet_is_seeded():
  a = wp.sample_dirichlet_coefficients(SIZES, 1.0, 5, seed=[1, 1])
  b = wp.sample_dirichlet_coefficients(SIZES, 1.0, 5, seed=[1, 1])
  c = wp.sample_dirichlet_coefficients(SIZES, 1.0, 5, seed=[1, 2])
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)


def test_combine_models_is_the_convex_combination():
  gamma = np.array([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]], np.float32)
  combined = wp.combine_models(stacked_clients(), gamma)
  np.testing.assert_allclose(combined.trainable[0][0], KERNELS[0])
  np.testing.assert_allclose(
      combined.trainable[0][1],
      0.2 * KERNELS[0] + 0.3 * KERNELS[1] + 0.5 * KERNELS[2], rtol=1e-6)
  np.testing.assert_allclose(
      combined.non_trainable[0][1], [0.2 * 1 + 0.3 * 2 + 0.5 * 4], rtol=1e-6)


@pytest.mark.parametrize("targets,expected", [
    ("A", ["A"]), ("S", ["S0", "S1"]), ("S+A", ["A", "S0", "S1"]),
    ("A+C", ["A", "C0", "C1", "C2"]), ("S+C", ["C0", "C1", "C2", "S0", "S1"]),
    ("S+A+C", ["A", "C0", "C1", "C2", "S0", "S1"])])
def test_teacher_stack_of_each_table_3_variant(targets, expected):
  # Tag each model by the value of its single weight.
  tags = {"A": 100.0, "C0": 0.0, "C1": 1.0, "C2": 2.0, "S0": 10.0, "S1": 11.0}
  average = (tf.constant([100.0]),)
  clients = (tf.constant([[0.0], [1.0], [2.0]]),)
  samples = (tf.constant([[10.0], [11.0]]),)
  teachers = wp.teacher_stack(targets, average, clients, samples)
  np.testing.assert_array_equal(teachers[0][:, 0],
                                [tags[name] for name in expected])
  assert wp.num_teachers(targets, 3, 2) == len(expected)


def test_teacher_weights_drop_rejected_clients():
  np.testing.assert_array_equal(
      wp.teacher_weights("S+A+C", [3.0, 0.0, 1.0], 2), [1, 1, 0, 1, 1, 1])
  np.testing.assert_array_equal(wp.teacher_weights("A+C", [0.0, 2.0], 5),
                                [1, 0, 1])
  np.testing.assert_array_equal(wp.teacher_weights("S", [1.0], 3), [1, 1, 1])


def test_teacher_stack_errors():
  with pytest.raises(ValueError, match="unknown targets 'X'"):
    wp.teacher_stack("X", (tf.zeros([1]),))
  with pytest.raises(ValueError, match="pass the samples"):
    wp.teacher_stack("S+A", (tf.zeros([1]),))
