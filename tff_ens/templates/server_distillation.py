"""FedBE, FedDF and v-Distillation: weight averaging replaced by server-side
ensemble distillation, the server step in the driver (`server_step`).

Chen and Chao, "FedBE: Making Bayesian Model Ensemble Applicable to Federated
Learning", ICLR 2021, Algorithm 1; Lin, Kong, Stich and Jaggi, "Ensemble
Distillation for Robust Model Fusion in Federated Learning", NeurIPS 2020,
Algorithm 1.

FedAvg's four stages with two swapped, composed by `server_step.build_collect`:

* distributor and client work: FedAvg's (`client_work.build_client_work`);
* aggregator (`server_step.build_collect_aggregator`): the server needs every
  client's model, not only their mean, so the result is the cohort's updates
  and weights;
* finalizer (`DistillationStep`): the driver's TensorFlow (on the GPU when
  there is one; TFF 0.87's worker uses none) rebuilds the client models (global - update),
  forms the teachers, labels with them the server's unlabeled images the
  student will read this round (`rows_read`; all of them with
  `teacher_labels="all"`) and distills into the student, which starts from the
  weight average:
  - FedBE (teachers="posterior"): {average, clients, M samples of a Gaussian (eq. 5) or
    Dirichlet (eq. 7) over the client models} (`weight_posterior`), targets
    the ensemble's mean probabilities (optionally sharpened), SGD with SWA
    (`student_lib.distill`);
  - FedDF (targets="avg_logits"): teachers the clients drop-worst keeps on the server's
    validation data, targets softmax(mean logits) (AVGLOGITS), Adam with
    cosine decay and early stopping on validation accuracy;
  - v-Distillation, FedBE's baseline: teachers the clients, sharpened mean
    probabilities, plain SGD.

The server's data (`server_data.ServerData`) reaches the step through
`tf.data` pipelines, never the clients.
"""

import collections
import dataclasses
import time
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import settings
from tff_ens.math import weight_posterior
from tff_ens.server import distillation
from tff_ens.server import server_data as server_data_lib
from tff_ens.server import student as student_lib
from tff_ens.settings import setting
from tff_ens.templates import built as built_lib
from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import server_optimizer
from tff_ens.templates import server_step
from tff_ens.templates import transport as transport_lib

ModelWeights = tff.learning.models.ModelWeights

# The ensemble that teaches the student (`ServerDistillationConfig.teachers`).
TEACHERS = ("clients", "posterior")
# What the student learns from the teachers' predictions (`ServerDistillationConfig.targets`).
TARGETS = ("avg_logits", "probabilities")
# Which unlabeled images the teachers label each round (`ServerDistillationConfig`).
TEACHER_LABELS = ("read", "all")


@settings.group
class Settings:
  """What every server-distillation algorithm's step takes: its budget and device."""

  distill_steps: int = setting(
    200, "Server distillation steps per round (FedDF: at most).", above=0
  )
  distill_batch_size: int = setting(64, "Server distillation batch.", above=0)
  distill_curve_every: int = setting(
    25,
    "FedBE/v-Distillation/FedPPD+Distill: measure the distilling student on server validation"
    " every N steps, for distillation_curves.json only (0: never; FedDF's curve is its "
    "early-stopping evaluations).",
    at_least=0,
  )
  sharpen_temperature: float | None = setting(
    None,
    "FedBE/v-Distillation: targets sharpened to p^(1/T)/sum p^(1/T); 1 keeps them. Unset: the"
    " papers' (FedBE 1, v-Distillation 0.5); authors' code 0.5.",
    above=0,
  )
  teacher_labels: str = setting(
    "read",
    "Unlabeled images the teachers label each round: read (those the student's "
    "--distill_steps x --distill_batch_size minibatches read, drawn before it reads them: the "
    "cost is the budget's) or all (the whole set, as FedBE's code: the cost grows with the "
    "set). The same targets for the rows read, to float32 rounding.",
    choices=TEACHER_LABELS,
    before="all",
  )
  server_device: str = setting(
    "auto",
    "Device of the server step (FedBE/FedDF/FedPPD+Distill distillation, run in this "
    "process's TensorFlow): auto (GPU if TensorFlow sees one), cpu, gpu or e.g. /GPU:1. "
    "summary.json's server_device says where its ops ran. Client training stays on the CPU: "
    "TFF 0.87's worker uses no GPU.",
  )

  def __post_init__(self):
    distillation.choose_device(self.server_device)  # A one-line ValueError for a bad one.


@dataclasses.dataclass(frozen=True)
class ServerDistillationConfig:
  """What the server does with the round's client models.

  Attributes:
    distill: the student's training (`distillation.DistillationConfig`).
    teachers: one of TEACHERS: "clients", the clients' models (FedDF, v-Distillation); or
      "posterior", FedBE's `posterior.targets` of {average, clients, M samples of a
      Gaussian (eq. 5) or Dirichlet (eq. 7) over the client models}.
    targets: one of TARGETS: "avg_logits", softmax of the teachers' mean logits (FedDF's
      AVGLOGITS); or "probabilities", their mean probabilities sharpened to
      p^(1/T) / sum p^(1/T) with T = `sharpen_temperature` (`distillation.sharpen`; 1 keeps
      them).
    posterior: the distribution of teachers="posterior" (`weight_posterior.WeightPosterior`).
    sharpen_temperature: T > 0 of targets="probabilities".
    keep_clients: `(accuracies on server validation, labels, num_classes, members=received)
      -> (keep, informative)`: which clients the teachers and the average keep (FedDF's
      drop-worst, `drop_worst.client_filter`); None keeps every client.
    distill_student: False leaves the student out: the round's model is the clients' weight
      average, and the teachers only predict (FedBE's `--fedbe_distill=False`).
    teacher_labels: which unlabeled images the teachers label each round, one of
      TEACHER_LABELS: "read", the rows the student's minibatches will read (drawn from the
      round's seed before it reads them, `server_data.read_rows`), at most its budget
      `distill.num_steps * distill.batch_size` however large the set, as FedDF's code
      labels each batch the student reads; "all", the whole set, as FedBE's code labels
      its 10,000 images once a round. The student reads the same minibatches either way,
      with the same targets to float32 rounding (bit for bit when every row is read).
    device: where the server computation runs (`distillation.choose_device`).
    seed: seeds the samples and the distillation's shuffles (with the round).
  """

  distill: distillation.DistillationConfig
  teachers: str = setting("clients", choices=TEACHERS)
  targets: str = setting("probabilities", choices=TARGETS)
  posterior: weight_posterior.WeightPosterior = weight_posterior.WeightPosterior()
  sharpen_temperature: float = setting(1.0, above=0)
  keep_clients: Callable | None = None
  distill_student: bool = True
  teacher_labels: str = setting("read", choices=TEACHER_LABELS)
  device: str = "/CPU:0"
  seed: int = 0

  def __post_init__(self):
    settings.check(self)

  @classmethod
  def of(
    cls,
    shared: Settings,
    distill: distillation.DistillationConfig,
    *,
    paper_temperature: float | None = None,
    **fields,
  ) -> "ServerDistillationConfig":
    """The config with the `shared` settings' targets and device, `--sharpen_temperature`
    or else the algorithm's `paper_temperature` (if any), and `fields` (the teachers,
    targets and seed, FedBE's posterior, FedDF's `keep_clients`)."""
    temperature = shared.sharpen_temperature
    if temperature is None:
      temperature = paper_temperature
    if temperature is not None:
      fields["sharpen_temperature"] = temperature
    return cls(
      distill=distill,
      teacher_labels=shared.teacher_labels,
      device=distillation.choose_device(shared.server_device),
      **fields,
    )


def models_of_clients(global_weights, updates):
  """The clients' models w_i = w - update_i, stacked like `updates`."""
  return tf.nest.map_structure(lambda w, u: w[None] - u, global_weights, updates)


def weighted_average(stacked, weights):
  """sum_i p_i w_i with p_i = weights_i / sum(weights) (FedAvg's average)."""
  weights = tf.cast(weights, tf.float32)
  p = tf.math.divide_no_nan(weights, tf.reduce_sum(weights))
  return tf.nest.map_structure(lambda t: tf.tensordot(p, t, axes=1), stacked)


def teachers(
  model: tf.keras.Model,
  global_weights,
  collected,
  seed,
  config: ServerDistillationConfig,
  validation,
  recalibration=None,
):
  """The round's teachers, their weights and the student's start.

  Returns `(teacher_stack, teacher_weights, average, num_dropped,
  informative)`; the teacher weights are 0 for teachers to leave out
  (rejected or dropped clients). The average is over the clients kept.
  `informative` is False when `keep_clients` drops every client: there is then
  nothing to distill from, and the round's model is the average of
  all received clients (a FedAvg step), as in the first rounds of training.
  With `recalibration = (a model, server images)` every model (each client before
  `keep_clients` evaluates it, the average, each sample) carries the batch-norm statistics
  it measures on those images instead of its own
  (`server_optimizer.each_with_batch_norm_statistics`).
  """
  updates, weights = collected
  clients = models_of_clients(global_weights, updates)
  if recalibration is not None:
    recalibration_model, images = recalibration
    clients = server_optimizer.each_with_batch_norm_statistics(recalibration_model, clients, images)
  weights = tf.cast(weights, tf.float32)
  received = weights > 0
  keep = received
  informative = tf.constant(True)
  if config.keep_clients is not None:
    val_x, val_y = validation
    accuracies = distillation.member_accuracies(model, clients, val_x, val_y)
    keep, informative = config.keep_clients(
      accuracies, val_y, model.output_shape[-1], members=received
    )
  weights = weights * tf.cast(keep, tf.float32)
  num_dropped = tf.reduce_sum(tf.cast(received, tf.int32)) - tf.reduce_sum(tf.cast(keep, tf.int32))
  average = weighted_average(clients, weights)
  if recalibration is not None:
    average = server_optimizer.batch_norm_statistics(recalibration_model, average, images)
  if config.teachers == "clients":
    return (clients, tf.cast(weights > 0, tf.float32), average, num_dropped, informative)
  posterior = config.posterior
  samples = None
  if "S" in posterior.targets:
    if posterior.distribution == "gaussian":
      # Fitted to the updates (better conditioned than the models, and the
      # variance is the same); the mean model is then w - mean update.
      mean_update, variance = weight_posterior.fit_gaussian_to_updates(
        updates,
        weights,
        posterior.gaussian,
        posterior.gaussian_var_scale,
        posterior.gaussian_var_clamp,
      )
      mean = tf.nest.map_structure(tf.subtract, global_weights, mean_update)
      samples = weight_posterior.sample_gaussian(mean, variance, posterior.num_samples, seed)
    else:
      coefficients = weight_posterior.sample_dirichlet_coefficients(
        weights, posterior.dirichlet_alpha, posterior.num_samples, seed, posterior.dirichlet
      )
      samples = weight_posterior.combine_models(clients, coefficients)
    if recalibration is not None:
      samples = server_optimizer.each_with_batch_norm_statistics(
        recalibration_model, samples, images
      )
  stack = weight_posterior.teacher_stack(
    posterior.targets, average, clients if "C" in posterior.targets else None, samples
  )
  return (
    stack,
    weight_posterior.teacher_weights(posterior.targets, weights, posterior.num_samples),
    average,
    num_dropped,
    informative,
  )


def distillation_targets(config: ServerDistillationConfig, predictions):
  """The student's targets from the teachers' `ensemble_predictions`.

  "avg_logits": AVGLOGITS (`distillation.avg_logits_targets`); "probabilities": the mean
  probabilities, `distillation.sharpen`ed with `config.sharpen_temperature`.
  """
  if config.targets == "avg_logits":
    return distillation.avg_logits_targets(predictions["mean_logits"])
  return distillation.sharpen(predictions["mean_probabilities"], config.sharpen_temperature)


def rows_read(config: ServerDistillationConfig, unlabeled, seeds) -> server_data_lib.ReadRows:
  """The unlabeled images the teachers label this round (`config.teacher_labels`): the
  rows the students seeded by `seeds` (one each) will read in their `config.distill`
  budget (`server_data.read_rows`), or every row with "all"; and each student's
  minibatches among them."""
  distill = config.distill
  draws = [
    server_data_lib.drawn_rows(len(unlabeled), distill.batch_size, distill.num_steps, seed)
    for seed in seeds
  ]
  return server_data_lib.read_rows(unlabeled, draws, whole=config.teacher_labels == "all")


def round_seed(config: ServerDistillationConfig, round_num):
  """The server step's stateless seed for 0-based `round_num`."""
  return tf.random.experimental.stateless_fold_in(
    tf.constant([config.seed, 3], tf.int64), tf.cast(round_num, tf.int64)
  )


class DistillationStep:
  """FedBE's, FedDF's or v-Distillation's server step, in the driver's TensorFlow.

  FedBE Algorithm 1 lines 7-10 / FedDF Algorithm 1 lines 6-9 (see the module
  docstring): `step(global weights, collected, round) -> (new weights,
  measurements)`, a `server_step.ServerStep`. The student's minibatches are drawn
  from the round's seed first (`server_data.student_draws`); the teachers label
  the unlabeled images they read (`read_rows`; all of them with
  `config.teacher_labels="all"`) batch by batch
  (`distillation.streamed_ensemble_predictions`) into a target store as large as
  those images' (an array, or a temporary `server_data.ImageFile` when the images
  stream from a file), and the student (`student_lib.Student`, traced once per
  run) starts from the weight average and reads those minibatches. Everything runs
  on `config.device`.

  Labelling the rows read ahead of the student rather than each minibatch as the
  student reads it (FedDF's code) labels each row once although the budget revisits
  rows (FedBE's 200 x 64 reads of FEMNIST's 1,875 images: 6.8 times fewer teacher
  passes), in the same 512-image inference batches as the whole set, so that when
  every row is read (the default budget on FEMNIST) the targets are those of the
  whole set, bit for bit (with fewer rows the inference batches hold other rows, and
  the targets differ in float32 rounding, about 1e-7); and the teachers run on the
  student's Keras model before it trains, with no second model.
  """

  def __init__(
    self,
    model_fn: Callable[[], tf.keras.Model],
    data: server_data_lib.ServerData,
    config: ServerDistillationConfig,
    recalibration_images: np.ndarray | None = None,
  ):
    self.config = config
    self.data = data
    with tf.device(config.device):
      self._model = model_fn()
      self._student = student_lib.Student(self._model, config.distill)
      self._validation = (tf.constant(data.validation_x), tf.constant(data.validation_y))
      self._recalibration = None
      if recalibration_images is not None:  # A model of its own: it sets momentum 0.
        self._recalibration = (model_fn(), tf.constant(recalibration_images))

  @tf.function
  def _teachers(self, global_weights, collected, seed):
    return teachers(
      self._model,
      global_weights,
      collected,
      seed,
      self.config,
      self._validation,
      self._recalibration,
    )

  def __call__(self, global_weights, collected, round_num: int):
    start = time.perf_counter()
    config = self.config
    student_lib.restore_eager_classes(self._model)  # The recalibration model's too.
    received = bool(np.any(np.asarray(collected[1]) > 0))
    with tf.device(config.device):
      seed = round_seed(config, round_num)
      stack, teacher_weights, average, num_dropped, informative = self._teachers(
        global_weights, collected, seed
      )
      stats = collections.OrderedDict(
        steps=0, examples=0, validation_curve=np.zeros([0, 2], np.float32)
      )
      average_accuracy = teachers_accuracy = tf.constant(-1.0)
      if received:
        average_accuracy, teachers_accuracy = self.validation_baselines(
          stack, teacher_weights, average
        )
      if not received:  # No client this round: the model stays as it was.
        new_weights = global_weights
      elif not bool(informative) or not config.distill_student:
        # Drop-worst dropped every client, or no student: their average.
        new_weights = average
      else:
        read = rows_read(config, self.data.unlabeled, [seed])
        new_weights, stats = self._student.distill(
          average,
          read.images,
          self.targets(stack, teacher_weights, read.images),
          seed,
          self._validation,
          read.batches[0],
        )
      distillation.assign_variables(self._model, new_weights)
      student_accuracy = self._student.validation_accuracy(*self._validation)
    return new_weights, collections.OrderedDict(
      server_device=server_step.placed_device(student_accuracy),
      student_validation_accuracy=student_accuracy,
      average_validation_accuracy=average_accuracy,
      teachers_validation_accuracy=teachers_accuracy,
      dropped_clients=num_dropped,
      distilled=int(received and bool(informative) and config.distill_student),
      distill_steps=stats["steps"],
      distill_examples=stats["examples"],
      server_seconds=time.perf_counter() - start,
      validation_curve=stats["validation_curve"],
    )

  def validation_baselines(self, stack, teacher_weights, average):
    """What the student competes with, on the server's validation data: the accuracy of
    the clients' weight average (FedAvg's model, the student's start) and of the
    teachers' predictive distribution (`distillation_targets`'s argmax)."""
    x, y = self._validation
    distillation.assign_variables(self._model, average)
    average_accuracy = self._student.validation_accuracy(x, y)
    predictions = distillation.ensemble_predictions(self._model, stack, x, teacher_weights)
    return average_accuracy, distillation.accuracy(
      distillation_targets(self.config, predictions), y
    )

  def targets(self, stack, teacher_weights, images):
    """The student's targets on `images` (`distillation_targets`), stored as they are."""
    targets = server_data_lib.rows_like(images, self._model.output_shape[-1:])
    for start, predictions in distillation.streamed_ensemble_predictions(
      self._model, stack, images, teacher_weights
    ):
      batch = distillation_targets(self.config, predictions).numpy()
      targets[start : start + len(batch)] = batch
    return targets

  def teacher_probabilities(self, global_weights, collected, round_num: int, images):
    """The round's teacher ensemble on `images`: `OrderedDict(probabilities,
    mean_entropy, average_probabilities)`, its predictive distribution (FedDF: the
    softmax of AVGLOGITS), its members' mean entropy and the predictions of the
    clients' weight average (the student's start); the same teachers as the step
    distills from, for `ensemble_test_accuracy` and the teachers' uncertainty."""
    student_lib.restore_eager_classes(self._model)
    with tf.device(self.config.device):
      stack, teacher_weights, average, _, _ = self._teachers(
        global_weights, collected, round_seed(self.config, round_num)
      )
      batches = [
        p
        for _, p in distillation.streamed_ensemble_predictions(
          self._model, stack, images, teacher_weights
        )
      ]
      distillation.assign_variables(self._model, average)
      average_logits = distillation.predict_logits(
        self._model, images, distillation.EVAL_BATCH_SIZE
      )
    probabilities = [
      tf.nn.softmax(p["mean_logits"])
      if self.config.targets == "avg_logits"
      else p["mean_probabilities"]
      for p in batches
    ]
    return collections.OrderedDict(
      probabilities=np.concatenate(probabilities),
      mean_entropy=np.concatenate([p["mean_entropy"] for p in batches]),
      average_probabilities=tf.nn.softmax(average_logits).numpy(),
    )


def build_server_distillation(
  model_fn: Callable[[], tf.keras.Model],
  element_spec,
  local_config: client_work_lib.LocalTrainingConfig,
  data: server_data_lib.ServerData,
  config: ServerDistillationConfig,
  *,
  clients_per_round: int,
  recalibration_images: np.ndarray | None = None,
  transport: transport_lib.Transport = transport_lib.VALUES,
) -> built_lib.BuiltProcess:
  """Builds FedBE, FedDF or v-Distillation (`config`'s teachers and targets) as a
  `server_step.DriverProcess`, whose rounds give their teachers.

  Args:
    model_fn: no-arg function building the (global and client) model.
    element_spec: `tf.TensorSpec`s of one client batch `(x, y)`.
    local_config: the clients' training (FedAvg's).
    data: the server's unlabeled and validation data.
    config: the server step.
    clients_per_round: the largest cohort (slots of the collect aggregator).
    recalibration_images: server images on which every teacher and the weight average
      measure their batch-norm statistics (`teachers`), or None to keep the clients'.
    transport: what moves the clients' updates to the driver (`transport.Transport.collect`).
  """
  weights_type = client_work_lib.weights_type_of(model_fn)
  client_work = client_work_lib.build_client_work(model_fn, element_spec, local_config)
  initialize_fn, collect, update_specs = transport.collect(
    server_optimizer.build_initial_weights_fn(model_fn),
    tff.learning.templates.build_broadcast_process(weights_type),
    client_work.process,
    clients_per_round,
  )
  step = DistillationStep(model_fn, data, config, recalibration_images)
  process = server_step.DriverProcess(
    initialize_fn,
    collect,
    step,
    step.teacher_probabilities,
    update_specs,
  )
  return built_lib.built_from_client_work(process, client_work)
