"""K Keras models as one TFLite file with `predict` and `personalize` signatures.

The on-device half of Fed-ensemble (Shi et al., arXiv:2107.10663): a phone holds all K
models in one file and

- `predict(image, alpha)` returns the alpha-weighted mixture of the members' softmax
  outputs, the members' outputs, and the mixture's uncertainty (the same quantities as
  `tff_ens.evaluation.ensemble_uncertainty`);
- `personalize(images, labels, temperature)` returns alpha = softmax(-loss / temperature)
  from the phone's own labeled examples, loss_k being member k's mean cross-entropy on them
  (Sec. IV-C, eq. 3-4; `tff_ens.personalization`). alpha = 1/K is the uniform ensemble.

The math is plain TensorFlow on probabilities in float32, clipped at 1e-12 before every log
as the NumPy evaluation does, so the two agree to float32 rounding.
"""

import tensorflow as tf

# Probabilities are clipped to [EPSILON, 1] before a log, as in tff_ens.evaluation.
EPSILON = 1e-12
SIGNATURES = ("predict", "personalize")


def _log(p):
  return tf.math.log(tf.clip_by_value(p, EPSILON, 1.0))


def entropy(probs):
  """Shannon entropy (nats) over the last axis."""
  return -tf.reduce_sum(probs * _log(probs), axis=-1)


def mixture_and_uncertainty(member_probs, alpha):
  """The weighted ensemble prediction and its uncertainty.

  Args:
    member_probs: [n, K, classes] softmax outputs of the K members.
    alpha: [K] member weights on the simplex.

  Returns:
    (probabilities [n, classes] = sum_k alpha_k p_k, entropy [n] = H(mixture), mutual
    information [n] = H(mixture) - sum_k alpha_k H(p_k), Depeweg et al., ICML 2018, eq. 4).
  """
  # Broadcast products, not einsum: the TFLite converter lowers these einsums to a
  # batch_matmul it then rejects.
  probabilities = tf.reduce_sum(alpha[:, None] * member_probs, axis=1)
  predictive_entropy = entropy(probabilities)
  expected_entropy = tf.reduce_sum(alpha * entropy(member_probs), axis=1)
  return probabilities, predictive_entropy, predictive_entropy - expected_entropy


def personalization_weights(member_probs, labels, temperature):
  """alpha = softmax(-loss / temperature) (Fed-ensemble eq. 4).

  loss_k = mean over the n examples of -log p_k(label): [n, K, classes], [n], [] -> [K].
  An infinite temperature gives alpha = 1/K.
  """
  true_class = tf.gather(member_probs, labels, axis=2, batch_dims=1)  # [n, K]
  losses = tf.reduce_mean(-_log(true_class), axis=0)
  return tf.nn.softmax(-losses / temperature)


class EnsembleModule(tf.Module):
  """The K members and the two signatures (see the module docstring).

  TFLite names a signature after its Python function, hence the nested `predict` and
  `personalize`, whose alpha length is fixed to K.
  """

  def __init__(self, members: list[tf.keras.Model], input_shape: tuple[int, ...]):
    super().__init__(name="ensemble")
    self.members = members
    image = tf.TensorSpec([None, *input_shape], tf.float32)

    def predict(image, alpha):
      member_probs = self.member_probabilities(image)
      probabilities, predictive_entropy, mutual_information = mixture_and_uncertainty(
          member_probs, alpha)
      return {"probabilities": probabilities, "member_probabilities": member_probs,
              "entropy": predictive_entropy, "mutual_information": mutual_information}

    def personalize(images, labels, temperature):
      return {"alpha": personalization_weights(
          self.member_probabilities(images), labels, temperature)}

    self.predict = tf.function(predict, input_signature=[
        tf.TensorSpec.from_spec(image, name="image"),
        tf.TensorSpec([len(members)], tf.float32, name="alpha")])
    self.personalize = tf.function(personalize, input_signature=[
        tf.TensorSpec.from_spec(image, name="images"),
        tf.TensorSpec([None], tf.int32, name="labels"),
        tf.TensorSpec([], tf.float32, name="temperature")])

  def member_probabilities(self, images):
    """[n, K, classes] softmax outputs of the members (inference mode)."""
    return tf.stack([tf.nn.softmax(m(images, training=False)) for m in self.members],
                    axis=1)


def convert_ensemble(members: list[tf.keras.Model], input_shape: tuple[int, ...]) -> bytes:
  """One float32 TFLite flatbuffer with the `predict` and `personalize` signatures."""
  module = EnsembleModule(members, input_shape)
  converter = tf.lite.TFLiteConverter.from_concrete_functions(
      [module.predict.get_concrete_function(), module.personalize.get_concrete_function()],
      module)
  return converter.convert()
