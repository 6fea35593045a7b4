"""The server's student: distillation training in the driver's TensorFlow.

FedBE (Chen and Chao, ICLR 2021, Sec. 4) and FedDF (Lin et al., NeurIPS 2020,
Algorithm 1) train a student on the teachers' targets for the server's
unlabeled images (`distillation` has the configs, targets and losses). Here:
the step sizes (`learning_rate_at`: SWA's cyclical schedule, cosine), SWA
(Izmailov et al., UAI 2018: `is_swa_collection_step`, `swa_average`,
`recompute_batch_norm`) and the loop (`Student`, `distill`): a `tf.data`
pipeline streams the images and targets of minibatches drawn in advance
(`server_data.student_draws`, `batches_of`;
arrays or `server_data.ImageFile`s) into one compiled step with stateless
shuffles, TFF's SGD with momentum or TF's fused Adam (`Student._apply_adam`).
It runs in the driver (TFF 0.87's worker uses no GPU).
"""

import collections
import contextlib
from typing import Optional

from keras.src.engine import base_layer
from keras.src.engine import base_layer_v1
from keras.src.engine import training
from keras.src.engine import training_v1
from keras.src.utils import version_utils
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.server import distillation
from tff_ens.server import server_data
from tff_ens.server.distillation import DistillationConfig

ModelWeights = tff.learning.models.ModelWeights


def learning_rate_at(step, config: DistillationConfig):
  """Step size of 0-based `step` under `config.lr_schedule`.

  "cyclical": SWA's schedule (Izmailov et al., eq. 2 with i = step + 1):
  t = (step mod c + 1) / c, lr = (1 - t) * learning_rate + t *
  min_learning_rate, falling linearly within each cycle of c steps to
  `min_learning_rate` at its last step, where SWA collects the model (Keras'
  schedules have restarts only for cosine shapes, hence written here).
  "cosine": Keras' `CosineDecay` from `learning_rate` to 0 over `num_steps`.
  """
  base = tf.constant(config.learning_rate, tf.float32)
  if config.lr_schedule == "constant":
    return base
  if config.lr_schedule == "cosine":
    return tf.keras.optimizers.schedules.CosineDecay(config.learning_rate, config.num_steps)(step)
  c = config.cycle_steps
  t = tf.cast(step % c + 1, tf.float32) / c
  return (1.0 - t) * base + t * config.min_learning_rate


def is_swa_collection_step(step, config: DistillationConfig):
  """Whether SWA collects the model after 0-based `step` (Izmailov, Alg. 1).

  At the end of every cycle (step + 1 a multiple of c) past the warm-up.
  """
  # tf.equal, not ==: in TF1 graphs (as TFF traces) == compares identity.
  done = step + 1
  return tf.logical_and(tf.equal(done % config.cycle_steps, 0), done > config.swa_warmup_steps)


def swa_average(average, weights, num_averaged):
  """SWA's running mean (Izmailov et al., Algorithm 1).

  w_SWA <- (w_SWA * n + w) / (n + 1), for every tensor of the structures;
  `num_averaged` is n (float). Non-trainable weights (batch-norm statistics)
  are averaged too and should then be recomputed (`recompute_batch_norm`).
  """
  n = tf.cast(num_averaged, tf.float32)
  return tf.nest.map_structure(lambda a, w: (a * n + w) / (n + 1.0), average, weights)


def _batch_norm_layers(model: tf.keras.Model):
  return [
    layer for layer in model.submodules if isinstance(layer, tf.keras.layers.BatchNormalization)
  ]


@contextlib.contextmanager
def _zero_momentum(layers):
  """Batch-norm layers whose moving statistics become the batch statistics.

  Keras reads `momentum` when a layer is called (traced); with 0 a training
  call sets the moving mean and variance to those of the batch.
  """
  saved = [layer.momentum for layer in layers]
  try:
    for layer in layers:
      layer.momentum = 0.0
    yield
  finally:
    for layer, momentum in zip(layers, saved):
      layer.momentum = momentum


def recompute_batch_norm(model: tf.keras.Model, x, batch_size: int) -> None:
  """Sets batch-norm moving statistics to their mean over batches of `x`.

  SWA's last step (Izmailov et al., Algorithm 1, and FedBE's code,
  `bn_update`): the averaged weights never produced the averaged statistics,
  so one pass over the data in training mode recomputes them; as PyTorch's
  `bn_update` (momentum None), each layer's statistics are the plain mean of
  its per-batch statistics, as Keras' training mode computes them. Keras has
  no cumulative-average mode, hence written here. `x`: images (an array or a
  `server_data.ImageFile`), streamed in order (`ordered_batches`). A model
  without batch normalization is left unchanged.
  """
  layers = _batch_norm_layers(model)
  if not layers:
    return
  variables = [v for layer in layers for v in (layer.moving_mean, layer.moving_variance)]
  with _zero_momentum(layers):
    # Traced here: Keras reads the momentum when the layers are called.
    @tf.function
    def batch_statistics(images):
      model(images, training=True)
      return [tf.identity(v) for v in variables]

    sums = [tf.zeros_like(v) for v in variables]
    count = 0
    for _, images in server_data.ordered_batches(x, batch_size):
      sums = [s + v for s, v in zip(sums, batch_statistics(images))]
      count += 1
  for v, s in zip(variables, sums):
    v.assign(s / float(count))


# Adam's constants: TFF's `build_adam` defaults, the student's Adam before the fused kernel.
ADAM_BETA_1 = 0.9
ADAM_BETA_2 = 0.999
ADAM_EPSILON = 1e-7


def restore_eager_classes(*models: tf.keras.Model) -> None:
  """Gives the classes of `models` and of their layers Keras' eager (v2) bases again.

  Keras 2 swaps a layer class's bases to their graph (v1) versions whenever an
  instance is built in a `tf.compat.v1.Graph` (keras/src/utils/version_utils.py),
  as when TFF traces the clients' models; a model the driver built eagerly before
  then fails ("Your Layer or Model is in an invalid state") until an eager instance
  of its classes is built again. Steps call this before running their models.
  """
  for model in models:
    for layer in (model, *model.submodules):
      if isinstance(layer, tf.keras.layers.Layer):
        version_utils.swap_class(type(layer), training.Model, training_v1.Model, use_v2=True)
        version_utils.swap_class(type(layer), base_layer.Layer, base_layer_v1.Layer, use_v2=True)


def _snapshot(model_weights: ModelWeights) -> ModelWeights:
  return tf.nest.map_structure(tf.identity, model_weights)


class Student:
  """A student model and its compiled training step, for `distill`.

  Built once per model: each `distill` call reuses the traced step, so a
  server step that distills every round traces it once per run.
  """

  def __init__(self, model: tf.keras.Model, config: DistillationConfig):
    self.model = model
    self.config = config
    self._weights = ModelWeights.from_model(model)
    trainable = self._weights.trainable
    if config.optimizer == "adam":
      self._optimizer = None
      self._adam_moments = [
        (
          tf.Variable(tf.zeros_like(v), trainable=False),
          tf.Variable(tf.zeros_like(v), trainable=False),
        )
        for v in trainable
      ]
    else:
      self._optimizer = tff.learning.optimizers.build_sgdm(
        config.learning_rate, momentum=config.momentum or None
      )
      self._adam_moments = None

  @tf.function
  def validation_accuracy(self, x, y):
    """The student's accuracy on labeled data `(x, y)`."""
    return distillation.accuracy(
      distillation.predict_logits(self.model, x, distillation.EVAL_BATCH_SIZE), y
    )

  @tf.function
  def _train_step(self, x, targets, step, opt_state):
    """One minibatch step of the distillation loss; returns the optimizer state."""
    trainable = self._weights.trainable
    with tf.GradientTape() as tape:
      logits = self.model(x, training=True)
      loss = distillation.distillation_loss(self.config.loss, targets, logits)
    gradients = tape.gradient(loss, trainable)
    if self.config.clip_norm:
      gradients, _ = tf.clip_by_global_norm(gradients, self.config.clip_norm)
    learning_rate = learning_rate_at(step, self.config)
    if self._adam_moments is not None:
      self._apply_adam(gradients, learning_rate, step)
      return opt_state
    opt_state = self._optimizer.set_hparams(opt_state, {"learning_rate": learning_rate})
    opt_state, new_weights = self._optimizer.next(opt_state, tuple(trainable), tuple(gradients))
    for v, t in zip(trainable, new_weights):
      # As `client_work.train_locally`: Keras' kernel constraints.
      v.assign(v.constraint(t) if v.constraint is not None else t)
    return opt_state

  def _apply_adam(self, gradients, learning_rate, step):
    """Adam's update of 0-based `step`: TFF's `build_adam` (bit for bit at a constant step
    size, tested; within 1e-8 after 120 cosine-scheduled steps, where graph rewrites order
    TFF's step-size arithmetic differently), by TF's fused ApplyAdam kernel: one pass over
    each variable where TFF's functional form makes about ten, which halved the student's
    speed."""
    t = tf.cast(step + 1, tf.float32)
    beta_1, beta_2 = tf.constant(ADAM_BETA_1), tf.constant(ADAM_BETA_2)
    for v, (m, u), g in zip(self._weights.trainable, self._adam_moments, gradients):
      tf.raw_ops.ResourceApplyAdam(
        var=v.handle,
        m=m.handle,
        v=u.handle,
        beta1_power=tf.math.pow(beta_1, t),
        beta2_power=tf.math.pow(beta_2, t),
        lr=learning_rate,
        beta1=beta_1,
        beta2=beta_2,
        epsilon=tf.constant(ADAM_EPSILON),
        grad=g,
      )
      if v.constraint is not None:  # As `client_work.train_locally`: Keras' constraints.
        v.assign(v.constraint(v))

  def distill(self, initial_weights, x, targets, seed, validation=None, batches=None):
    """`distill` with this student's model and config."""
    config = self.config
    if config.eval_every and validation is None:
      raise ValueError("early stopping (eval_every > 0) needs validation data")
    # Once: the pipelines below read these rows without converting them again.
    x, targets = server_data.as_rows(x), server_data.as_rows(targets)
    distillation.assign_variables(self.model, initial_weights)
    trainable = self._weights.trainable
    opt_state = ()  # Adam's moments are variables, restarted here.
    if self._adam_moments is not None:
      for moments in self._adam_moments:
        for moment in moments:
          moment.assign(tf.zeros_like(moment))
    else:
      opt_state = self._optimizer.initialize(
        tuple(tf.TensorSpec(v.shape, v.dtype) for v in trainable)
      )
      opt_state = tf.nest.map_structure(tf.convert_to_tensor, opt_state)
    if validation is not None:
      validation = tuple(tf.convert_to_tensor(t) for t in validation)

    def validation_accuracy():
      return self.validation_accuracy(*validation)

    average, num_averaged = _snapshot(self._weights), 0  # SWA.
    best, best_step = _snapshot(self._weights), 0  # Early stopping.
    best_accuracy = tf.constant(-float("inf"))
    # (step, validation accuracy) of every measurement, the start's first.
    curve = []
    if validation is not None and (config.eval_every or config.curve_every):
      curve.append((0, float(validation_accuracy())))
      if config.eval_every and config.keep_initial_student:
        best_accuracy = tf.constant(curve[0][1])
    steps = 0
    if batches is None:
      batches = server_data.drawn_rows(len(x), config.batch_size, config.num_steps, seed)
    batches = np.asarray(batches)
    for images, batch_targets in server_data.batches_of(x, targets, batches):
      opt_state = self._train_step(images, batch_targets, tf.constant(steps), opt_state)
      step, steps = steps, steps + 1
      if config.swa:
        if bool(is_swa_collection_step(step, config)):
          average = swa_average(average, _snapshot(self._weights), num_averaged)
          num_averaged += 1
      if config.eval_every:
        if steps % config.eval_every == 0:
          current = validation_accuracy()
          curve.append((steps, float(current)))
          if bool(current > best_accuracy + config.min_improvement):
            best, best_accuracy, best_step = _snapshot(self._weights), current, steps
        if steps - best_step >= config.patience:
          break
      elif config.curve_every and validation is not None and steps % config.curve_every == 0:
        curve.append((steps, float(validation_accuracy())))
    validation_out = tf.constant(-1.0)
    if config.swa:
      distillation.assign_variables(self.model, average)
      recompute_batch_norm(self.model, x, config.batch_size)
    elif config.eval_every:
      validation_out = tf.maximum(best_accuracy, -1.0)
      distillation.assign_variables(self.model, best)
    stats = collections.OrderedDict(
      steps=tf.constant(steps),
      examples=tf.constant(steps * batches.shape[1]),
      swa_models=tf.constant(num_averaged),
      validation_accuracy=validation_out,
      validation_curve=np.array(curve, np.float32).reshape([-1, 2]),
    )
    return _snapshot(self._weights), stats


def distill(
  model: tf.keras.Model,
  initial_weights: ModelWeights,
  x,
  targets,
  config: DistillationConfig,
  seed,
  validation=None,
  device: Optional[str] = None,
  batches=None,
):
  """Trains the student `model` on (x, targets); returns its weights.

  Mini-batch training on unlabeled images `x` [N, ...] and fixed teacher
  targets [N, C] (probabilities: `mean_probability_targets` for FedBE,
  `avg_logits_targets` for FedDF, `sharpen`ed for v-Distillation), from
  `initial_weights` (the weight average in both papers), in the minibatches
  `batches` (rows of `x`), by default those `server_data.student_draws` draws from
  `seed`. Then:

  * with `config.swa` (FedBE, Sec. 4; Izmailov et al., Algorithm 1): the
    models at the end of each cycle after the warm-up are averaged
    (`swa_average`) and batch-norm statistics recomputed on `x`
    (`recompute_batch_norm`, one pass over `x`: the rows the student read when
    the server step passes only those); the average is the result;
  * with `config.eval_every` (FedDF, Algorithm 1 and Sec. 4): early
    stopping on `validation` accuracy; the best evaluated student is the
    result (with `config.keep_initial_student`, the initial one if none
    beat it);
  * otherwise the last student.

  It runs in the driver's TensorFlow: a Python loop over a `tf.data`
  pipeline and one compiled step (`Student`; reuse a `Student` to trace it
  once). The model's variables are overwritten.

  Args:
    model: a Keras model with logits output (the student's architecture).
    initial_weights: `ModelWeights` of tensors to start from.
    x: unlabeled images [N, ...]: an array, tensor or `server_data.ImageFile`.
    targets: teacher probabilities [N, C], the same kinds.
    config: a `DistillationConfig`.
    seed: int, int scalar or shape [2] integer tensor.
    validation: `(x_val, y_val)` labeled server data; needed for early
      stopping.
    device: a device to run on (`choose_device`), or None to let TF place.
    batches: [num_steps, b] row indices of `x`, the minibatches in order (the server
      step's `server_data.read_rows`), or None to draw them from `seed`.

  Returns:
    `(weights, stats)`: the student's `ModelWeights` and an `OrderedDict` of
    `steps` (steps run, int32), `examples` (examples seen, int32),
    `swa_models` (models averaged, int32; 0 without SWA),
    `validation_accuracy` (the returned student's, float32; -1 without early
    stopping or without an evaluated student) and `validation_curve`, the
    student's validation accuracy as it trains: float32 rows (step,
    accuracy) from step 0 (the initial weights), at each early-stopping
    evaluation or, without early stopping, every `config.curve_every` steps
    (none without `validation` or with neither set).
  """
  with tf.device(device) if device else contextlib.nullcontext():
    return Student(model, config).distill(initial_weights, x, targets, seed, validation, batches)
