"""FedPPD's local iterations: the SGLD step, its units and schedules, and the minibatches.

Bhatt, Gupta, Rai, ACML 2023, supplement, Algorithm 1 (`fedppd` builds the client work
and the process from these).

SGLD (Welling & Teh, ICML 2011, eq. 4), with U(theta) = -log p(theta) -
(N/n) sum_{i in batch} log p(y_i | x_i, theta) and a N(0, 1/lambda) prior:

    theta <- theta - (eps/2) grad U(theta) + xi,   xi ~ N(0, eps * T),

T = 1 being exact SGLD and T < 1 a tempered ("cold") posterior. In terms of
the minibatch's mean loss, grad U = N grad mean_nll + lambda theta, so the
step is SGD with learning rate eps N / 2 plus noise of standard deviation
sqrt(eps T).

The authors' SGLD optimizer (github.com/aishgupta/fedppd, lib/sgld_optim.py)
steps by lr/2 on the mean loss and adds noise of standard deviation
2 sqrt(lr) / N: with eps = lr / N that is T = 4 / N, a tempered posterior
whose temperature falls with the client's data (about 0.03 for a FEMNIST
writer). `PosteriorConfig.sgld_scaling="authors"` takes the step size and
temperature in their units (`chain_parameters`). With five local epochs on
FEMNIST, T = 0.1 kept the teacher on the initial plateau five rounds longer
than FedAvg, T = 0.01 did not (benchmarks/RESULTS.md, FedPPD).
"""

import tensorflow as tf

# What the student learns on (`minibatch_stream`).
STUDENT_MINIBATCHES = ("fresh", "same", "alternate_epochs")
# The units of the teacher's step size and temperature (`chain_parameters`).
SGLD_SCALINGS = ("posterior", "authors")
# The role of a minibatch in `minibatch_stream`: the teacher takes an SGLD
# step on it, the student an SGD step, or the teacher and then the student.
TEACHER, STUDENT, BOTH = 0, 1, 2
# The authors' noise is that of T = AUTHORS_NOISE / N (lib/sgld_optim.py).
AUTHORS_NOISE = 4.0


def sgld_step(weights, gradients, step_size, temperature, seed):
  """One SGLD step, Welling & Teh eq. 4: w - (eps/2) g + N(0, eps T).

  Args:
    weights: tensors theta.
    gradients: grad U(theta) for each tensor (potential energy, i.e. minus
      the log prior minus the rescaled minibatch log-likelihood).
    step_size: eps.
    temperature: T (1: exact SGLD).
    seed: a stateless-RNG seed `int64[2]`; tensor i draws from fold_in(seed,
      i).

  Returns:
    The new tensors.
  """
  noise_std = tf.sqrt(step_size * temperature)
  return [
    w
    - 0.5 * step_size * g
    + noise_std
    * tf.random.stateless_normal(
      tf.shape(w), seed=tf.random.experimental.stateless_fold_in(seed, i), dtype=w.dtype
    )
    for i, (w, g) in enumerate(zip(weights, gradients))
  ]


def chain_parameters(sgld_scaling: str, step_size, temperature, num_data):
  """(eps, T) of `sgld_step` from the configured step size and temperature.

  "posterior": they are eps and T. "authors": `step_size` is lr, the step on
  the minibatch's mean loss, and the noise is the authors' (std 2 sqrt(lr) /
  N, lib/sgld_optim.py) times sqrt(temperature): eps = lr / N and
  T = temperature * 4 / N.
  """
  if sgld_scaling == "posterior":
    return step_size, temperature
  return (step_size / num_data, temperature * AUTHORS_NOISE / num_data)


def scheduled_rate(rate, round_num, epoch, round_decay, step_decay=1.0, step_epochs=1):
  """rate * round_decay^round * step_decay^floor(epoch / step_epochs).

  The authors' schedules: a per-round decay (train_femnist.py) and, within
  the round, a step decay every `step_epochs` local epochs (StepLR in
  trainers/ClientServUpdate.py). `round_num` and `epoch` are 0-based.
  """
  steps = tf.math.floordiv(tf.cast(epoch, tf.int64), tf.cast(step_epochs, tf.int64))
  return (
    rate
    * tf.pow(round_decay, tf.cast(round_num, tf.float32))
    * tf.pow(step_decay, tf.cast(steps, tf.float32))
  )


def batch_sizes(dataset: tf.data.Dataset):
  """The number of examples of each batch of `dataset`, `int64[batches]`."""
  return dataset.reduce(
    tf.zeros([0], tf.int64),
    lambda sizes, batch: tf.concat([sizes, tf.shape(batch[1], out_type=tf.int64)[:1]], 0),
  )


def batch_epochs(sizes, epochs: int):
  """The 0-based local epoch of each batch: that of its first example.

  The stream holds `epochs` passes over the client's data, so example i is
  in epoch floor(i * epochs / examples).
  """
  starts = tf.cumsum(sizes, exclusive=True)
  return starts * epochs // tf.maximum(tf.reduce_sum(sizes), 1)


def minibatch_stream(
  dataset: tf.data.Dataset, sizes, student_minibatch: str, epochs: int
) -> tf.data.Dataset:
  """The client's minibatches `(x, y, role)` in the order they are learned.

  `sizes` is `batch_sizes(dataset)`.

  The teacher takes an SGLD step on a TEACHER batch, the student an SGD
  step on a STUDENT one, and on a BOTH batch the teacher, then the student:
    "same": each batch of `dataset` is BOTH.
    "fresh" (supplement, Algorithm 1): each batch of `dataset` (TEACHER) is
      followed by one of another pass over it (STUDENT), started one batch
      later (its first batch last) so that the two differ also if `dataset`
      is not reshuffled.
    "alternate_epochs" (the authors' code): the TEACHER batches of a local
      epoch (`batch_epochs`), then as many STUDENT batches of another pass.
  A reshuffling `dataset` orders each pass differently.
  """

  def role(value):
    return lambda x, y: (x, y, tf.constant(value))

  if student_minibatch == "same":
    return dataset.map(role(BOTH))
  if student_minibatch == "fresh":
    student = dataset.skip(1).concatenate(dataset.take(1))
    choices = tf.data.Dataset.from_tensor_slices(tf.constant([TEACHER, STUDENT], tf.int64)).repeat(
      tf.size(sizes, out_type=tf.int64)
    )
  else:
    student = dataset
    per_epoch = tf.math.bincount(
      tf.cast(batch_epochs(sizes, epochs), tf.int32), minlength=epochs, dtype=tf.int64
    )
    choices = tf.data.Dataset.range(epochs).flat_map(
      lambda e: tf.data.Dataset.from_tensors(tf.constant(TEACHER, tf.int64))
      .repeat(per_epoch[e])
      .concatenate(
        tf.data.Dataset.from_tensors(tf.constant(STUDENT, tf.int64)).repeat(per_epoch[e])
      )
    )
  return tf.data.Dataset.choose_from_datasets(
    [dataset.map(role(TEACHER)), student.map(role(STUDENT))], choices
  )


def distillation_loss(teacher_probabilities, student_logits):
  """Mean cross-entropy -sum_c p_T(c|x) log p_S(c|x) over the minibatch.

  The student's objective of Algorithm 1 (its KL to the teacher's predictive
  distribution up to the teacher's entropy, which has no student gradient).
  """
  return -tf.reduce_mean(
    tf.reduce_sum(teacher_probabilities * tf.nn.log_softmax(student_logits), axis=-1)
  )
