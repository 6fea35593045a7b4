"""FedPPD: Bayesian clients whose posterior predictive is distilled online.

Bhatt, Gupta, Rai: "Federated Learning with Uncertainty via Distilled
Predictive Distributions", ACML 2023 (arXiv:2206.07562), supplement,
Algorithm 1.

Each client keeps two networks. The *teacher* (the baselines' architecture)
draws samples of the client's posterior p(theta | D_k) by stochastic gradient
Langevin dynamics; at every local iteration the *student* (a larger network)
takes one SGD step towards the current teacher's predictive distribution on a
noise-perturbed minibatch, so that over the iterations it distills the
posterior predictive distribution (PPD) sum_s p(y | x, theta_s) / S into one
network. The server averages the clients' students (the global PPD model,
the next round's student initialization) and, as the authors' code does, the
teachers (the next round's chain start).

In the four TFF stages FedPPD swaps only the client work: the model the
process carries is teacher and student joined into one `ModelWeights`
(`join`), so FedAvg's broadcast, weighted mean (with its rejection of
non-finite updates) and finalizer are reused unchanged.

The local iterations (SGLD, its units and schedules, which minibatch each network
takes) are in `fedppd_local`; FedPPD+Distill is `fedppd_distill`.

Where the authors' code departs from the supplement, `fedppd_local.PosteriorConfig` has
an option; its defaults are the paper's where it states the setting and the
code's (trainers/ClientServUpdate.py, train_femnist.py, README commands)
where it does not:
- the student's minibatch (`student_minibatch`): a fresh one after each
  SGLD step (Algorithm 1, default), the teacher's own, or whole teacher and
  student epochs in turn (the code);
- weight decay of the teacher and the student (the code's 1e-4);
- the teacher's step size times 0.85 every 3 local epochs (the code's
  StepLR), and both step sizes times 0.99 a round (train_femnist.py);
  `fedppd_local.scheduled_rate`.
FedPPD+Distill can distill the teachers too, as the code does
(`fedppd_distill.build_fedppd_distill`'s `teacher_server_config`).
"""

import collections
from typing import Callable

import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.math import fedppd_local
from tff_ens.settings import setting
from tff_ens.templates import built as built_lib
from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import server_optimizer

ModelWeights = tff.learning.models.ModelWeights


def join(teacher: ModelWeights, student: ModelWeights) -> ModelWeights:
  """Teacher and student as one `ModelWeights`: teacher tensors first."""
  return ModelWeights(
    list(teacher.trainable) + list(student.trainable),
    list(teacher.non_trainable) + list(student.non_trainable),
  )


def split(
  weights: ModelWeights, teacher_sizes: tuple[int, int]
) -> tuple[ModelWeights, ModelWeights]:
  """Inverse of `join`; `teacher_sizes` = (trainable, non-trainable) counts."""
  t, n = teacher_sizes
  trainable, non_trainable = list(weights.trainable), list(weights.non_trainable)
  return (
    ModelWeights(trainable[:t], non_trainable[:n]),
    ModelWeights(trainable[t:], non_trainable[n:]),
  )


def count_teacher_tensors(teacher_fn) -> tuple[int, int]:
  """(trainable, non-trainable) tensor counts of the teacher, for `split`."""
  with tf.Graph().as_default():
    teacher = teacher_fn()
    return len(teacher.trainable_weights), len(teacher.non_trainable_weights)


def _client_seed(run_seed: int, round_num, dataset: tf.data.Dataset):
  """A stateless seed unique to (run seed, round, client).

  The client is identified by its first batch (its pixel and label sums):
  the training loop shuffles each client's data with a seed of (run seed,
  round, client), so this is reproducible and differs between clients
  without an extra argument to `next` (which `LearningProcess` does not
  allow).
  """
  pixels, labels = dataset.take(1).reduce(
    (tf.constant(0.0), tf.constant(0, tf.int64)),
    lambda acc, batch: (
      acc[0] + tf.reduce_sum(batch[0]),
      acc[1] + tf.reduce_sum(tf.cast(batch[1], tf.int64)),
    ),
  )
  key = tf.stack([tf.constant(run_seed, tf.int64), tf.cast(round_num, tf.int64)])
  key = tf.random.experimental.stateless_fold_in(
    key, tf.cast(tf.bitcast(pixels, tf.int32), tf.int64)
  )
  return tf.random.experimental.stateless_fold_in(key, labels)


@tf.function
def train_teacher_student(
  teacher: tf.keras.Model,
  student: tf.keras.Model,
  initial_weights: ModelWeights,
  dataset: tf.data.Dataset,
  round_num,
  config: fedppd_local.PosteriorConfig,
):
  """FedPPD's client update (Bhatt et al., supplement, Algorithm 1).

  Over the client's minibatches in `fedppd_local.minibatch_stream`'s order: SGLD steps of the
  teacher on its data (`_teacher_step`), and SGD steps of the student towards the teacher's
  predictive distribution on noisy inputs (`_student_step`).

  Args:
    teacher, student: Keras models (logits), the baselines' architecture and usually larger.
    initial_weights: `join(teacher weights, student weights)` to start from.
    dataset: batches `(x, y)`, repeated `config.epochs` times.
    round_num: the 0-based round (seeds the noise with the client's data; step sizes).
    config: `fedppd_local.PosteriorConfig`.

  Returns:
    `(ClientResult(update=initial - final joined weights, update_weight=N), metrics)`,
    metrics as sums over examples: `loss` (teacher NLL), `student_loss` (distillation loss),
    `correct` (the student's correct predictions of its minibatches' labels),
    `num_examples` (the teacher's), `rejected`.
  """
  teacher_weights, student_weights = (
    ModelWeights.from_model(teacher),
    ModelWeights.from_model(student),
  )
  tf.nest.map_structure(
    lambda v, t: v.assign(t), join(teacher_weights, student_weights), initial_weights
  )
  sizes = fedppd_local.batch_sizes(dataset)
  seen = tf.reduce_sum(sizes)
  num_data = tf.cast(seen, tf.float32) / float(config.epochs)
  seed = _client_seed(config.seed, round_num, dataset)
  step_size, temperature = fedppd_local.chain_parameters(
    config.sgld_scaling, config.teacher_step_size, config.temperature, num_data
  )
  student_optimizer = _student_optimizer(config, round_num)
  student_vars = student_weights.trainable
  student_stepper = (teacher, student, student_vars, student_optimizer, config)
  opt_state = student_optimizer.initialize(
    tuple(tf.TensorSpec(v.shape, v.dtype) for v in student_vars)
  )
  nll = tf.keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction=tf.keras.losses.Reduction.SUM
  )
  prior_precision = config.prior_precision + num_data * config.teacher_weight_decay
  chain = (step_size, temperature, num_data, prior_precision, seen, round_num)
  teacher_stepper = (teacher, teacher_weights.trainable, nll, config, chain)

  def step(carry, batch):
    opt_state, counter, taught, nll_sum, student_sum, correct = carry
    x, y, role = batch
    n = tf.shape(y, out_type=tf.int64)[0]
    step_seed = tf.random.experimental.stateless_fold_in(seed, counter)
    teaches = tf.not_equal(role, fedppd_local.STUDENT)
    batch_nll = tf.cond(
      teaches,
      lambda: _teacher_step(*teacher_stepper, x, y, taught, step_seed),
      lambda: tf.constant(0.0),
    )
    opt_state, loss, hits = tf.cond(
      tf.not_equal(role, fedppd_local.TEACHER),
      lambda: _student_step(*student_stepper, x, y, opt_state, step_seed),
      lambda: (opt_state, tf.constant(0.0), tf.constant(0.0)),
    )
    taught += tf.where(teaches, n, tf.constant(0, tf.int64))
    student_sum += loss * tf.cast(n, tf.float32)
    return opt_state, counter + 1, taught, nll_sum + batch_nll, student_sum, correct + hits

  zero = tf.constant(0.0)
  carry = fedppd_local.minibatch_stream(
    dataset, sizes, config.student_minibatch, config.epochs
  ).reduce((opt_state, tf.constant(0, tf.int64), tf.constant(0, tf.int64), zero, zero, zero), step)
  final = tf.nest.map_structure(tf.identity, join(teacher_weights, student_weights))
  return _client_result(initial_weights, final, num_data, carry[2:], config.max_update_norm)


def _student_optimizer(config: fedppd_local.PosteriorConfig, round_num):
  """The student's SGD(M) at its rate for round `round_num` (`fedppd_local.scheduled_rate`)."""
  return tff.learning.optimizers.build_sgdm(
    learning_rate=fedppd_local.scheduled_rate(
      config.student_lr, round_num, 0, config.student_round_decay
    ),
    momentum=config.student_momentum or None,
  )


def _student_step(teacher, student, variables, optimizer, config, x, y, opt_state, step_seed):
  """One SGD step of the student's `variables` towards the teacher's predictive distribution
  on noisy x (`fedppd_local.distillation_loss`); returns (optimizer state, loss, correct
  predictions of y)."""
  noisy = x + config.input_noise_std * tf.random.stateless_normal(
    tf.shape(x), seed=tf.random.experimental.stateless_fold_in(step_seed, 1)
  )
  targets = tf.nn.softmax(teacher(noisy, training=False))
  with tf.GradientTape() as tape:
    logits = student(noisy, training=True)
    loss = fedppd_local.distillation_loss(targets, logits)
  grads = tape.gradient(loss, variables)
  grads = [g + config.student_weight_decay * w for g, w in zip(grads, variables)]
  opt_state, new_student = optimizer.next(opt_state, tuple(variables), tuple(grads))
  for v, t in zip(variables, new_student):
    v.assign(t)
  return opt_state, loss, client_work_lib.count_correct(logits, y)


def _teacher_step(model, variables, nll, config, chain, x, y, taught, step_seed):
  """One SGLD step of the teacher's trainable `variables` on the batch (x, y) (Welling and
  Teh 2011; `fedppd_local.sgld_step`): the potential's gradient is N times the mean NLL's
  plus the prior precision times w, the step size scheduled by the epoch `taught` examples
  into the `seen` of the round (`fedppd_local.scheduled_rate`); returns the batch's summed
  NLL. `chain`: (base step size, temperature, N, prior precision, seen, round)."""
  step_size, temperature, num_data, prior_precision, seen, round_num = chain
  epoch = taught * config.epochs // tf.maximum(seen, 1)
  eps = fedppd_local.scheduled_rate(
    step_size,
    round_num,
    epoch,
    config.teacher_round_decay,
    config.teacher_step_decay,
    config.teacher_step_decay_epochs,
  )
  with tf.GradientTape() as tape:
    batch_nll = nll(y, model(x, training=True))
    mean_nll = batch_nll / tf.cast(tf.shape(y)[0], tf.float32)
  grads = tape.gradient(mean_nll, variables)
  potential = [num_data * g + prior_precision * w for g, w in zip(grads, variables)]
  new_weights = fedppd_local.sgld_step(
    variables, potential, eps, temperature, tf.random.experimental.stateless_fold_in(step_seed, 0)
  )
  for v, t in zip(variables, new_weights):
    v.assign(v.constraint(t) if v.constraint is not None else t)
  return batch_nll


def _client_result(initial_weights, final, num_data, sums, max_update_norm):
  """`train_teacher_student`'s `(ClientResult, metrics)` of its final weights and its sums
  `(examples taught, teacher NLL, student loss, student's correct predictions)`."""
  taught, nll_sum, student_sum, correct = sums
  count = tf.cast(taught, tf.float32)
  update, weight, rejected = client_work_lib.reject_bad_update(
    client_work_lib.weights_delta(initial_weights, final), num_data, max_update_norm
  )
  accepted = 1.0 - rejected
  metrics = collections.OrderedDict(
    loss=tf.where(accepted > 0, nll_sum, 0.0),
    student_loss=tf.where(accepted > 0, student_sum, 0.0),
    correct=correct * accepted,
    num_examples=count * accepted,
    rejected=rejected,
  )
  return tff.learning.templates.ClientResult(update, weight), metrics


def joint_weights_type(teacher_fn, student_fn) -> tff.Type:
  """TFF type of `join(teacher weights, student weights)`."""
  with tf.Graph().as_default():
    weights = join(ModelWeights.from_model(teacher_fn()), ModelWeights.from_model(student_fn()))
    return tff.types.tensorflow_to_type(
      tf.nest.map_structure(lambda v: tf.TensorSpec(v.shape, v.dtype), weights)
    )


def build_client_work(
  teacher_fn: Callable[[], tf.keras.Model],
  student_fn: Callable[[], tf.keras.Model],
  element_spec,
  config: fedppd_local.PosteriorConfig,
  weights_type: tff.Type,
) -> client_work_lib.ClientWork:
  """FedPPD's client-work stage: `train_teacher_student` at every client.

  Its state is the 0-based round number, broadcast to seed the clients'
  noise. `weights_type` is `joint_weights_type(teacher_fn, student_fn)`.
  """
  for model_fn in (teacher_fn, student_fn):
    client_work_lib.check_data_fits_model(model_fn, element_spec)
  data_type = tff.SequenceType(tff.types.tensorflow_to_type(element_spec))

  @tff.tensorflow.computation(weights_type, data_type, tf.int32)
  def client_update(initial_weights, dataset, round_num):
    teacher, student = (client_work_lib.model_to_overwrite(fn) for fn in (teacher_fn, student_fn))
    return train_teacher_student(teacher, student, initial_weights, dataset, round_num, config)

  @tff.tensorflow.computation(tf.int32)
  def round_number(round_num):
    return round_num

  @tff.tensorflow.computation(client_update.type_signature.result[1])
  def finalize(sums):
    metrics = client_work_lib.finalize_train_metrics(sums)
    metrics["student_loss"] = sums["student_loss"] / tf.maximum(sums["num_examples"], 1.0)
    return metrics

  return client_work_lib.build_round_client_work(client_update, round_number, finalize)


def built_fedppd(process, client_work, teacher_fn) -> built_lib.BuiltProcess:
  """The `BuiltProcess` of FedPPD or FedPPD+Distill, whose model is `join(teacher, student)`:
  the model it evaluates is the student, the global PPD model."""
  sizes = count_teacher_tensors(teacher_fn)
  return built_lib.built_from_client_work(
    process, client_work, lambda state: [split(process.get_model_weights(state), sizes)[1]]
  )


def build_fedppd(
  teacher_fn: Callable[[], tf.keras.Model],
  student_fn: Callable[[], tf.keras.Model],
  element_spec,
  config: fedppd_local.PosteriorConfig,
  *,
  aggregator_factory: (tff.aggregators.WeightedAggregationFactory | None) = None,
) -> built_lib.BuiltProcess:
  """Builds FedPPD: FedAvg's stages with `build_client_work`'s client work.

  The server averages the clients' students and teachers (weighted by their
  number of examples), the mean of Bhatt et al., Sec. 3.2. Clients upload
  the change of the joined weights, so a weighted `tff.aggregators`
  `aggregator_factory` (e.g. DP-FedAvg's, `privacy.DPConfig`) can replace
  the mean.
  """
  weights_type = joint_weights_type(teacher_fn, student_fn)
  client_work = build_client_work(teacher_fn, student_fn, element_spec, config, weights_type)
  distributor, aggregator, finalizer = server_optimizer.fedavg_stages(
    weights_type, aggregator_factory=aggregator_factory
  )
  process = tff.learning.templates.compose_learning_process(
    build_initial_weights_fn(teacher_fn, student_fn),
    distributor,
    client_work.process,
    aggregator,
    finalizer,
  )
  return built_fedppd(process, client_work, teacher_fn)


def build_initial_weights_fn(teacher_fn, student_fn) -> tff.Computation:
  """A TFF computation returning the initial `join(teacher, student)`."""

  @tff.tensorflow.computation
  def initial_weights():
    return join(ModelWeights.from_model(teacher_fn()), ModelWeights.from_model(student_fn()))

  return initial_weights


@settings.group
class Settings:
  """FedPPD's student network."""

  student_model: str = setting(
    "",
    "FedPPD: the student (default: the task's for --model, FEMNIST's cnn_ppd_student for cnn;"
    " else --model).",
  )


def student_name(task, model: str, own: Settings) -> str:
  """The student's architecture: `own.student_model`, else the task's for `model`."""
  return own.student_model or getattr(task, "STUDENT_MODELS", {}).get(model, model)


def student_fn(context: algorithm.BuildContext):
  """Builds FedPPD's student for the run of `context`, from its own seed."""
  name = student_name(context.task, context.model, context.group(Settings))
  return lambda: context.build_model(name, context.seed + 7919)


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  student = student_fn(context)
  built = build_fedppd(
    lambda: context.model_fn(0),
    student,
    context.element_spec,
    context.group(fedppd_local.PosteriorConfig),
    aggregator_factory=context.dp.aggregator_factory() if context.dp else None,
  )
  return algorithm.FederatedAlgorithm.of("fedppd", built, context, evaluation_model_fn=student)


def validate(groups, facts: algorithm.RunFacts) -> None:
  """The student is one of the task's models."""
  own = groups[Settings]
  name = student_name(facts.task, facts.model, own)
  if name not in facts.task.MODEL_NAMES:
    raise settings.SettingError(
      "student_model",
      own.student_model,
      f"choose one of {', '.join(facts.task.MODEL_NAMES)} (the models of task {facts.task_name})",
    )


ALGORITHM = algorithm.Algorithm(
  "fedppd",
  "FedPPD (Bhatt et al. 2023): SGLD teachers, a student learns their predictive distribution "
  "online",
  build,
  settings=(fedppd_local.PosteriorConfig, Settings),
  validate=validate,
  dp=True,
)
