"""Server-side ensemble distillation shared by FedBE and FedDF.

Chen and Chao, "FedBE: Making Bayesian Model Ensemble Applicable to Federated
Learning", ICLR 2021 (arXiv:2009.01974): the ensemble's mean probabilities
pseudo-label unlabeled server data, and the student is trained on them with
SWA (Izmailov, Podoprikhin, Garipov, Vetrov and Wilson, "Averaging Weights
Leads to Wider Optima and Better Generalization", UAI 2018).

Lin, Kong, Stich and Jaggi, "Ensemble Distillation for Robust Model Fusion in
Federated Learning", NeurIPS 2020 (arXiv:2006.07242), Algorithm 1: the student
matches softmax(mean of the teachers' logits) (AVGLOGITS) with Adam and early
stopping on server validation data; the worst models are dropped.

The pieces are plain TensorFlow; the Keras models' variables are assigned
from tensors (as `client_work.train_locally` does):

* `ensemble_predictions` and `member_accuracies` run a stack of teacher
  weights through one Keras model, once over all unlabeled images (no
  augmentation when labeling);
* the targets (`avg_logits_targets`, `mean_probability_targets`, `sharpen`)
  and losses (`distillation_loss`, `avg_logits_kl`);
* the student's training, `student.distill`, is in `tff_ens/server/student.py`;
* `choose_device`; FedDF's drop-worst is in `tff_ens/math/drop_worst.py`.

Where the authors' released code (hongyouc/FedBE; epfml/federated-learning-
public-code, `codes/FedDF-code`) differs from its paper, the difference is an
option whose docstring says which default it takes.
"""

import collections
import dataclasses
from typing import Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import settings
from tff_ens.server import server_data
from tff_ens.settings import setting

ModelWeights = tff.learning.models.ModelWeights

OPTIMIZERS = ("sgd", "adam")
LOSSES = ("kl", "cross_entropy")
LR_SCHEDULES = ("constant", "cyclical", "cosine")
# Batch size of inference (teachers, validation): no gradients, so larger.
EVAL_BATCH_SIZE = 512


@dataclasses.dataclass(frozen=True)
class DistillationConfig:
  """Hyperparameters of the server's distillation (`student.distill`).

  `algorithms.fedbe.distillation_config` and `algorithms.feddf.distillation_config` give the
  papers' settings.

  Attributes:
    num_steps: maximum number of mini-batch steps.
    batch_size: unlabeled examples per step (the whole set if it is smaller).
    optimizer: "sgd" (heavy-ball momentum) or "adam".
    learning_rate: the step size; the cycle's maximum with "cyclical", the
      initial one with "cosine".
    min_learning_rate: the step size at the end of each cycle ("cyclical").
    lr_schedule: "constant", "cyclical" (SWA's, `learning_rate_at`) or
      "cosine" (annealed to 0 over `num_steps`).
    cycle_steps: length c of a cycle of the "cyclical" schedule and of SWA.
    momentum: SGD momentum (0 is plain SGD); unused by Adam.
    loss: "cross_entropy" to the targets (FedBE) or "kl" (FedDF, KL from the
      targets to the student); both have the same gradient.
    swa: average the models at the end of the cycles after the warm-up, then
      recompute the batch-norm statistics (FedBE); False is "w/o SWA".
    swa_warmup_steps: steps before the first model is collected.
    eval_every: with > 0, early stopping (FedDF): the student's accuracy on
      the server validation data is measured every `eval_every` steps;
      training stops after `patience` steps without a strict improvement and
      the best student is returned.
    patience: see `eval_every`.
    min_improvement: with early stopping, a student replaces the best one
      only if its validation accuracy is higher by more than this. 0 (FedDF)
      takes any improvement, which on a small validation set often is noise:
      the best of many noisy measurements overstates the student.
    keep_initial_student: with early stopping, whether the initial student
      (measured at step 0) competes with the evaluated ones, so that it is
      returned if none beats it. False (FedDF's code, `NoiseKTSolver` with
      its default `return_best_model_on_val=False`; the paper is silent)
      returns the best evaluated student even if it is worse than the
      initial one; a budget shorter than `eval_every` evaluates none and
      returns the initial student.
    clip_norm: with > 0, each step's gradient is scaled to a global norm of
      at most this (`tf.clip_by_global_norm`; FedDF's code clips at 5).
    curve_every: without early stopping, the student's validation accuracy
      is measured every this many steps for its learning curve only (0:
      never); early stopping's evaluations are its curve.
  """

  num_steps: int = setting(above=0)
  batch_size: int = setting(64, above=0)
  optimizer: str = setting("sgd", choices=OPTIMIZERS)
  learning_rate: float = setting(1e-3, above=0)
  min_learning_rate: float = setting(4e-4, at_least=0)
  lr_schedule: str = setting("cyclical", choices=LR_SCHEDULES)
  cycle_steps: int = setting(25, above=0)
  momentum: float = setting(0.9, at_least=0)
  loss: str = setting("cross_entropy", choices=LOSSES)
  swa: bool = True
  swa_warmup_steps: int = setting(0, at_least=0)
  eval_every: int = setting(0, at_least=0)
  patience: int = setting(0, at_least=0)
  min_improvement: float = setting(0.0, at_least=0)
  keep_initial_student: bool = False
  clip_norm: float = setting(0.0, at_least=0)
  curve_every: int = setting(0, at_least=0)

  def __post_init__(self):
    settings.check(self)
    if self.swa and self.eval_every:
      raise ValueError(
        "swa and early stopping (eval_every > 0) exclude each "
        "other: the result would be the SWA average or the "
        "best student"
      )
    if self.eval_every and self.patience <= 0:
      raise ValueError("early stopping (eval_every > 0) needs patience > 0")
    # SWA collects a model at the end of each cycle after the warm-up: at least one.
    needed = (self.swa_warmup_steps // self.cycle_steps + 1) * self.cycle_steps
    if self.swa and self.num_steps < needed:
      raise settings.SettingError(
        "num_steps",
        self.num_steps,
        f"must be >= {needed} for SWA, which averages the models at the end of each "
        f"{self.cycle_steps}-step cycle after {self.swa_warmup_steps} warm-up steps",
      )


# Targets and losses ----------------------------------------------------------


def avg_logits_targets(mean_logits):
  """FedDF's AVGLOGITS teacher: softmax of the teachers' mean logits.

  Lin et al., Algorithm 1 (server distillation step):
  sigma(1/|S_t| sum_k f(x; x_k)) over the round's client models x_k.
  """
  return tf.nn.softmax(mean_logits)


def mean_probability_targets(teacher_logits):
  """FedBE's pseudo-labels: the ensemble's mean probabilities.

  Chen and Chao, Sec. 4 (Bayesian model ensemble, the Monte Carlo
  approximation of the posterior predictive): p(y|x) = 1/M sum_m p(y|x; w_m),
  from teacher logits [M, n, C].
  """
  return tf.reduce_mean(tf.nn.softmax(teacher_logits), axis=0)


def sharpen(probabilities, temperature: float = 0.5):
  """Temperature sharpening p^(1/T) / sum_c p_c^(1/T) of each row [n, C].

  T = 0.5 gives p^2 / sum p^2, v-Distillation's targets (Chen and Chao,
  Sec. 5), and the targets of both FedBE and v-Distillation in the authors'
  code (`temp_sharpen` with `--temp` 0.5); T = 1 returns p. Computed as
  softmax(log p / T), which does not underflow for small T.
  """
  return tf.nn.softmax(tf.math.log(probabilities) / temperature)


def distillation_loss(kind: str, targets, student_logits):
  """Mean over the batch of the distillation loss of `student_logits`.

  "kl": KL(targets || softmax(student)), FedDF's Algorithm 1 (AVGLOGITS);
  "cross_entropy": -sum targets * log softmax(student), FedBE's Sec. 4.
  They differ by the targets' entropy, a constant for the student.
  """
  if kind == "kl":
    return tf.keras.losses.KLDivergence()(targets, tf.nn.softmax(student_logits))
  if kind == "cross_entropy":
    return tf.keras.losses.CategoricalCrossentropy(from_logits=True)(targets, student_logits)
  raise ValueError(f"unknown loss {kind!r}: choose one of {', '.join(LOSSES)}")


def avg_logits_kl(teacher_logits, student_logits):
  """FedDF's AVGLOGITS loss on one batch (Lin et al., Algorithm 1).

  KL(softmax(mean_k teacher_logits[k]) || softmax(student_logits)), averaged
  over the batch; `teacher_logits` [K, n, C], `student_logits` [n, C].
  """
  return distillation_loss(
    "kl", avg_logits_targets(tf.reduce_mean(teacher_logits, axis=0)), student_logits
  )


# Running models: teachers, validation ---------------------------------------


def assign_variables(model: tf.keras.Model, weights: ModelWeights) -> None:
  """Assigns `ModelWeights` of tensors to the model's variables, in a graph (unlike
  `math.evaluation.assign_weights`, which loads arrays into a Keras model eagerly).

  Only inside a `tf.function` are later reads of the variables ordered after
  the assignment (automatic control dependencies): the graph a
  `tff.tensorflow.computation` traces has none, so there, assign and use the
  weights within one `tf.function` (as every function of this module does).
  """
  tf.nest.map_structure(lambda v, t: v.assign(t), ModelWeights.from_model(model), weights)


def predict_logits(model: tf.keras.Model, x, batch_size: int):
  """Logits [n, C] of `model` (inference mode) on `x`, in batches."""
  n = tf.shape(x)[0]
  num_batches = (n + batch_size - 1) // batch_size
  outputs = tf.TensorArray(tf.float32, size=num_batches, infer_shape=False)

  def body(i, outputs):
    logits = model(x[i * batch_size : (i + 1) * batch_size], training=False)
    return i + 1, outputs.write(i, tf.cast(logits, tf.float32))

  _, outputs = tf.while_loop(lambda i, _: i < num_batches, body, (tf.constant(0), outputs))
  num_classes = model.output_shape[-1]
  return tf.reshape(outputs.concat(), [n, num_classes])


def _member(stacked_weights, index):
  return tf.nest.map_structure(lambda t: t[index], stacked_weights)


def _num_members(stacked_weights):
  return tf.shape(tf.nest.flatten(stacked_weights)[0])[0]


@tf.function
def ensemble_predictions(
  model: tf.keras.Model, stacked_weights, x, member_weights=None, batch_size: int = EVAL_BATCH_SIZE
):
  """Mean logits and mean probabilities of a stack of teachers on `x`.

  Each teacher is assigned to `model` in turn and run once over `x` (no
  augmentation). `mean_logits` gives FedDF's AVGLOGITS targets
  (`avg_logits_targets`), `mean_probabilities` FedBE's pseudo-labels
  (`mean_probability_targets`), without keeping [M, n, C] in memory.
  Overwrites the model's weights.

  Args:
    model: a Keras model with logits output, of the teachers' architecture.
    stacked_weights: `ModelWeights` with tensors [M, ...].
    x: images [n, ...].
    member_weights: optional [M] weights >= 0 of the teachers in the means
      (uniform by default). Teachers of weight 0 are skipped (not run): in a
      TFF computation the stack has a fixed size, and this drops clients
      (drop-worst, rejected updates) from it.
    batch_size: inference batch size.

  Returns:
    `OrderedDict(mean_logits=[n, C], mean_probabilities=[n, C],
    mean_entropy=[n])`, the last the teachers' mean predictive entropy (nats;
    the expected entropy of the mutual information, Depeweg et al. 2018,
    eq. 4); zeros if every weight is 0.
  """
  num_members = _num_members(stacked_weights)
  if member_weights is None:
    member_weights = tf.ones([num_members])
  member_weights = tf.cast(member_weights, tf.float32)
  zeros = tf.zeros([tf.shape(x)[0], model.output_shape[-1]])

  def body(m, logit_sum, probability_sum, entropy_sum):
    weight = member_weights[m]

    def add():
      assign_variables(model, _member(stacked_weights, m))
      logits = predict_logits(model, x, batch_size)
      probabilities = tf.nn.softmax(logits)
      entropy = -tf.reduce_sum(probabilities * tf.nn.log_softmax(logits), -1)
      return (
        logit_sum + weight * logits,
        probability_sum + weight * probabilities,
        entropy_sum + weight * entropy,
      )

    sums = tf.cond(weight > 0, add, lambda: (logit_sum, probability_sum, entropy_sum))
    return (m + 1, *sums)

  _, logit_sum, probability_sum, entropy_sum = tf.while_loop(
    lambda m, *_: m < num_members, body, (tf.constant(0), zeros, zeros, zeros[:, 0])
  )
  total = tf.reduce_sum(member_weights)
  return collections.OrderedDict(
    mean_logits=tf.math.divide_no_nan(logit_sum, total),
    mean_probabilities=tf.math.divide_no_nan(probability_sum, total),
    mean_entropy=tf.math.divide_no_nan(entropy_sum, total),
  )


def streamed_ensemble_predictions(
  model: tf.keras.Model, stacked_weights, x, member_weights=None, batch_size: int = EVAL_BATCH_SIZE
):
  """`ensemble_predictions` over `x` one batch at a time: yields `(start, predictions)`.

  `x` is an array or a `server_data.ImageFile` (`ordered_batches`); the
  batches are those `ensemble_predictions` would take over all of `x`, so
  the predictions are the same.
  """
  stacked_weights = tf.nest.map_structure(tf.convert_to_tensor, stacked_weights)
  for start, images in server_data.ordered_batches(x, batch_size):
    yield (
      int(start),
      ensemble_predictions(model, stacked_weights, images, member_weights, batch_size),
    )


def accuracy(logits, y):
  """Fraction of rows of `logits` whose argmax is `y`."""
  hits = tf.equal(tf.argmax(logits, -1, output_type=tf.int32), tf.cast(y, tf.int32))
  return tf.reduce_mean(tf.cast(hits, tf.float32))


@tf.function
def member_accuracies(
  model: tf.keras.Model, stacked_weights, x, y, batch_size: int = EVAL_BATCH_SIZE
):
  """Accuracy [M] of each model of the stack on labeled data `(x, y)`.

  For FedDF's drop-worst (Lin et al., Sec. 4) on server validation data.
  Overwrites the model's weights.
  """
  num_members = _num_members(stacked_weights)

  def body(m, accuracies):
    assign_variables(model, _member(stacked_weights, m))
    return m + 1, accuracies.write(m, accuracy(predict_logits(model, x, batch_size), y))

  _, accuracies = tf.while_loop(
    lambda m, _: m < num_members,
    body,
    (tf.constant(0), tf.TensorArray(tf.float32, size=num_members)),
  )
  return accuracies.stack()


def choose_device(requested: Optional[str] = None) -> str:
  """The device for server distillation: "/GPU:0" if TF sees a GPU, else CPU.

  Args:
    requested: None, "" or "auto" to choose; "cpu", "gpu" or a device such as
      "/GPU:1" to force one (the value of `--server_device`).

  Raises:
    ValueError: (one line) for an unknown value, or a GPU TF does not see.
  """
  gpus = tf.config.list_logical_devices("GPU")
  if requested is None or requested.strip().lower() in ("", "auto"):
    device = "/GPU:0" if gpus else "/CPU:0"
  else:
    kind, _, index = requested.strip().upper().lstrip("/").removeprefix("DEVICE:").partition(":")
    if kind not in ("CPU", "GPU") or not (index or "0").isdigit():
      raise ValueError(
        f"--server_device={requested!r}: use auto, cpu, gpu or a device such as /GPU:0"
      )
    device = f"/{kind}:{int(index or 0)}"
    if kind == "GPU" and int(index or 0) >= len(gpus):
      raise ValueError(
        f"--server_device={requested!r}: TensorFlow sees {len(gpus)} "
        "GPU(s) here; use --server_device=cpu or auto"
      )
  return device
