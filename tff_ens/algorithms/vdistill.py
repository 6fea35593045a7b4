"""v-Distillation, FedBE's baseline (Chen and Chao, ICLR 2021, Sec. 5): the clients' models
are the teachers, their mean probabilities sharpened with T = 0.5 the targets, and the student
trains with plain SGD (FedBE's distillation without SWA, `fedbe.distillation_config`)."""

from tff_ens.algorithms import algorithm
from tff_ens.algorithms import fedbe
from tff_ens.templates import server_distillation

SHARPEN_TEMPERATURE = 0.5  # Sec. 5's targets.


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  shared = context.group(server_distillation.Settings)
  config = server_distillation.ServerDistillationConfig.of(
    shared,
    fedbe.distillation_config(shared, swa=False),
    paper_temperature=SHARPEN_TEMPERATURE,
    seed=context.seed,
  )
  built = server_distillation.build_server_distillation(
    lambda: context.model_fn(0),
    context.element_spec,
    context.local,
    context.server_data,
    config,
    clients_per_round=context.clients_per_round,
    recalibration_images=context.recalibration_images,
    transport=context.transport,
  )
  return algorithm.FederatedAlgorithm.of("vdistill", built, context)


ALGORITHM = algorithm.Algorithm(
  "vdistill",
  "FedBE's v-Distillation baseline: the clients' sharpened mean probabilities, plain SGD",
  build,
  settings=(server_distillation.Settings,),
  server_data=True,
  recalibrates=True,
)
