"""FedBE (Chen and Chao, "FedBE: Making Bayesian Model Ensemble Applicable to Federated
Learning", ICLR 2021, Algorithm 1): a Bayesian ensemble of the round's models pseudo-labels
the server's unlabeled data, and the global model is distilled from it with SWA.

FedAvg's distributor and client work; the collect aggregator and the server step of
`templates.server_distillation`, with FedBE's teachers (the weight average, the clients and M
samples of a Gaussian or Dirichlet over their models, `math.weight_posterior`) and its
student (`distillation_config`).
"""

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.math import weight_posterior
from tff_ens.server import distillation
from tff_ens.settings import setting
from tff_ens.templates import server_distillation

# SWA's cycle and the distance between the models it averages (the paper's and the authors'
# code's 25 steps).
SWA_CYCLE_STEPS = 25
# Chen and Chao, Sec. 4: the targets are the ensemble's mean probabilities, unsharpened.
SHARPEN_TEMPERATURE = 1.0


@settings.group
class Settings:
  """FedBE's student: whether there is one, SWA and its warm-up."""

  distill: bool = setting(
    True,
    "FedBE: distill the teachers into the global model (False: the global model is the "
    "clients' weight average and the teachers only predict, ensemble_test_accuracy: the "
    "Fed-ensemble paper's 'FedBE without distillation', Table II).",
    flag="fedbe_distill",
  )
  swa: bool = setting(True, "FedBE: distill with SWA (False: plain SGD, the paper's 'w/o SWA').")
  # The paper's 250 steps of the authors' code's budget, 20 epochs of 10,000 images in batches
  # of 128 (1,580 steps); their code itself starts after 500 steps. A fraction, not steps, so
  # that shorter budgets keep the paper's proportion of warm-up and still collect models.
  swa_warmup_fraction: float = setting(
    250 / 1_580,
    "FedBE: SWA collects after this fraction of --distill_steps (default: the paper's 250 of "
    "the authors' 1,580 steps; their code's 500 is 0.316).",
    at_least=0,
    below=1,
    before=0.0,
  )


def distillation_config(
  shared: server_distillation.Settings, own: Settings = Settings(), *, swa: bool | None = None
) -> distillation.DistillationConfig:
  """FedBE's distillation (Chen and Chao, Sec. 4, "distillation with SWA").

  SGD with momentum 0.9 (the authors' code, `models/Update.py`), cross-entropy to the
  pseudo-labels, SWA with a cyclical step size from 1e-3 down to 4e-4 per cycle, collecting
  after `own.swa_warmup_fraction` of the budget. Without SWA (`swa` False, or `own.swa`; the
  paper's "w/o SWA" ablation and v-Distillation): SGD at a constant 1e-3, as the authors'
  code without SWA.
  """
  swa = own.swa if swa is None else swa
  with settings.named_by(
    {
      "num_steps": "distill_steps",
      "batch_size": "distill_batch_size",
      "curve_every": "distill_curve_every",
    }
  ):
    return distillation.DistillationConfig(
      num_steps=shared.distill_steps,
      batch_size=shared.distill_batch_size,
      optimizer="sgd",
      learning_rate=1e-3,
      min_learning_rate=4e-4,
      lr_schedule="cyclical" if swa else "constant",
      cycle_steps=SWA_CYCLE_STEPS,
      momentum=0.9,
      loss="cross_entropy",
      swa=swa,
      swa_warmup_steps=round(own.swa_warmup_fraction * shared.distill_steps),
      curve_every=shared.distill_curve_every,
    )


def server_config(context: algorithm.BuildContext) -> server_distillation.ServerDistillationConfig:
  """FedBE's server step for the run of `context` (FedPPD+Distill's too)."""
  shared, own = context.group(server_distillation.Settings), context.group(Settings)
  return server_distillation.ServerDistillationConfig.of(
    shared,
    distillation_config(shared, own),
    teachers="posterior",
    paper_temperature=SHARPEN_TEMPERATURE,
    posterior=context.group(weight_posterior.WeightPosterior),
    distill_student=own.distill,
    seed=context.seed,
  )


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  built = server_distillation.build_server_distillation(
    lambda: context.model_fn(0),
    context.element_spec,
    context.local,
    context.server_data,
    server_config(context),
    clients_per_round=context.clients_per_round,
    recalibration_images=context.recalibration_images,
    transport=context.transport,
  )
  return algorithm.FederatedAlgorithm.of("fedbe", built, context)


def validate(groups, facts: algorithm.RunFacts) -> None:
  """The student's budget fits SWA (`DistillationConfig`'s check, named by its flags)."""
  distillation_config(groups[server_distillation.Settings], groups[Settings])


ALGORITHM = algorithm.Algorithm(
  "fedbe",
  "FedBE (Chen & Chao 2021): the average, the clients and samples over their models pseudo-label "
  "server data; SWA student",
  build,
  settings=(server_distillation.Settings, weight_posterior.WeightPosterior, Settings),
  validate=validate,
  server_data=True,
  recalibrates=True,
  variant_flags=("fedbe_targets",),
)
