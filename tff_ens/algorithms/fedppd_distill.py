"""FedPPD+Distill (Bhatt et al., ACML 2023, Sec. 3.2): FedPPD's clients, FedBE's server step.

The clients are FedPPD's (`fedppd.build_client_work`); the server distills their
students, and optionally their teachers, as FedBE does, in the driver
(`server_step.DriverProcess`).
"""

import dataclasses
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.algorithms import fedbe
from tff_ens.algorithms import fedppd
from tff_ens.math import fedppd_local
from tff_ens.math import weight_posterior
from tff_ens.server import server_data as server_data_lib
from tff_ens.settings import setting
from tff_ens.templates import built as built_lib
from tff_ens.templates import server_distillation
from tff_ens.templates import server_step
from tff_ens.templates import transport as transport_lib


class FedPPDDistillStep:
  """FedPPD+Distill's server step in the driver (`server_step.ServerStep`).

  The clients' students are distilled into the global student by FedBE's
  step (`server_distillation.DistillationStep`); the teachers are averaged
  or, with a teacher step, distilled the same way (measurements prefixed
  `teacher_`).
  """

  def __init__(self, teacher_sizes, student_step, teacher_step=None):
    self._teacher_sizes = teacher_sizes
    self._student_step = student_step
    self._teacher_step = teacher_step

  def __call__(self, global_weights, collected, round_num: int):
    updates, weights = collected
    global_teacher, global_student = fedppd.split(global_weights, self._teacher_sizes)
    teacher_updates, student_updates = fedppd.split(updates, self._teacher_sizes)
    student, measurements = self._student_step(
      global_student, (student_updates, weights), round_num
    )
    if self._teacher_step is None:
      teacher = global_teacher
      if np.any(np.asarray(weights) > 0):
        teacher = server_distillation.weighted_average(
          server_distillation.models_of_clients(global_teacher, teacher_updates), weights
        )
    else:
      teacher, teacher_measurements = self._teacher_step(
        global_teacher, (teacher_updates, weights), round_num
      )
      measurements.update(
        (f"teacher_{k}", v) for k, v in teacher_measurements.items() if k != "server_device"
      )
    return fedppd.join(teacher, student), measurements


def build_fedppd_distill(
  teacher_fn: Callable[[], tf.keras.Model],
  student_fn: Callable[[], tf.keras.Model],
  element_spec,
  config: fedppd_local.PosteriorConfig,
  data: server_data_lib.ServerData,
  server_config: server_distillation.ServerDistillationConfig,
  *,
  clients_per_round: int,
  teacher_server_config: (server_distillation.ServerDistillationConfig | None) = None,
  transport: transport_lib.Transport = transport_lib.VALUES,
) -> built_lib.BuiltProcess:
  """Builds FedPPD+Distill (Bhatt et al., Sec. 3.2, "FedPPD+Distill").

  The clients' students are distilled into the global student on the
  server's unlabeled data by FedBE's server step
  (`server_distillation.DistillationStep` with `server_config`: teachers
  from the average, the clients' students and samples around them, SWA),
  instead of averaged. The clients' teachers are averaged as in FedPPD or,
  with `teacher_server_config`, distilled the same way into the global
  teacher as the authors' code does (train_femnist.py); that step's
  measurements are prefixed `teacher_`. Aggregator FedBE's, client work
  FedPPD's; the step runs in the driver (`server_step.DriverProcess`), to which
  `transport` moves the clients' models (`transport.Transport.collect`).
  """
  teacher_sizes = fedppd.count_teacher_tensors(teacher_fn)
  weights_type = fedppd.joint_weights_type(teacher_fn, student_fn)
  client_work = fedppd.build_client_work(teacher_fn, student_fn, element_spec, config, weights_type)
  initialize_fn, collect, update_specs = transport.collect(
    fedppd.build_initial_weights_fn(teacher_fn, student_fn),
    tff.learning.templates.build_broadcast_process(weights_type),
    client_work.process,
    clients_per_round,
  )
  step = FedPPDDistillStep(
    teacher_sizes,
    server_distillation.DistillationStep(student_fn, data, server_config),
    (
      server_distillation.DistillationStep(teacher_fn, data, teacher_server_config)
      if teacher_server_config is not None
      else None
    ),
  )
  return fedppd.built_fedppd(
    server_step.DriverProcess(
      initialize_fn,
      collect,
      step,
      update_specs=update_specs,
    ),
    client_work,
    teacher_fn,
  )


@settings.group
class Settings:
  """What FedPPD+Distill's server distills."""

  distill_fedppd_teachers: bool = setting(
    True,
    "FedPPD+Distill: distill the clients' teachers too, as the authors' code does (about "
    "twice the server step); False averages them.",
    before=False,
  )


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  server_config = fedbe.server_config(context)
  teacher_config = None
  if context.group(Settings).distill_fedppd_teachers:
    # The teachers' step draws its own samples.
    teacher_config = dataclasses.replace(server_config, seed=server_config.seed + 1)
  student = fedppd.student_fn(context)
  built = build_fedppd_distill(
    lambda: context.model_fn(0),
    student,
    context.element_spec,
    context.group(fedppd_local.PosteriorConfig),
    context.server_data,
    server_config,
    clients_per_round=context.clients_per_round,
    teacher_server_config=teacher_config,
    transport=context.transport,
  )
  return algorithm.FederatedAlgorithm.of(
    "fedppd_distill", built, context, evaluation_model_fn=student
  )


def validate(groups, facts: algorithm.RunFacts) -> None:
  """FedPPD's rules (its student) and FedBE's (the student's budget)."""
  fedppd.validate(groups, facts)
  fedbe.validate(groups, facts)


ALGORITHM = algorithm.Algorithm(
  "fedppd_distill",
  "FedPPD+Distill: the clients' students distilled into the global student by FedBE's server step",
  build,
  settings=(
    fedppd_local.PosteriorConfig,
    fedppd.Settings,
    server_distillation.Settings,
    weight_posterior.WeightPosterior,
    fedbe.Settings,
    Settings,
  ),
  validate=validate,
  server_data=True,
)
