"""FedDF (Lin, Kong, Stich and Jaggi, "Ensemble Distillation for Robust Model Fusion in
Federated Learning", NeurIPS 2020, Algorithm 1): the clients' models, less the worst, are
the teachers; the weight average is distilled towards their averaged logits (AVGLOGITS) on
the server's unlabeled data, with early stopping on its validation data.

FedAvg's distributor and client work; the collect aggregator and the server step of
`templates.server_distillation` with FedDF's teachers, targets and student
(`distillation_config`). With `--prototypes` the clients run different architectures
(`model_prototypes`).
"""

import functools

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.algorithms import model_prototypes
from tff_ens.math import drop_worst
from tff_ens.server import distillation
from tff_ens.settings import setting
from tff_ens.templates import server_distillation


@settings.group
class Settings:
  """FedDF's student (early stopping, gradient clip) and its model prototypes."""

  distill_patience: int = setting(
    100,
    "FedDF: early-stopping patience in steps (the paper's 1,000 of at most 10,000 steps would "
    "take about 17 minutes a round on 2 cores).",
    above=0,
  )
  distill_eval_every: int = setting(20, "FedDF: validation every N distillation steps.", above=0)
  distill_min_improvement: float = setting(
    0.0,
    "FedDF: a student replaces the best one only if its server validation accuracy is higher "
    "by more than this (0: any improvement, the paper's).",
    at_least=0,
  )
  distill_keep_initial: bool = setting(
    False,
    "FedDF: return the initial student when no evaluated one beats it on validation (False: "
    "the best evaluated one, as the authors' code).",
    before=True,
  )
  distill_clip_norm: float = setting(
    5.0,
    "FedDF: clip the student's gradient to this global norm (0: none; 5 is the authors' code's).",
    at_least=0,
    before=0.0,
  )
  prototypes: str = setting(
    "",
    "FedDF over model prototypes: comma-separated models, e.g. cnn,resnet8; client i runs the"
    " (i mod P)-th, the first is --model (summary.json: prototype_test_accuracy). Empty: one "
    "model.",
  )

  def prototype_names(self) -> list[str]:
    """The architectures of `prototypes` (empty: every client runs the run's model)."""
    return [n.strip() for n in self.prototypes.split(",")] if self.prototypes else []


def distillation_config(
  shared: server_distillation.Settings, own: Settings = Settings()
) -> distillation.DistillationConfig:
  """FedDF's distillation (Lin et al., Sec. 4, experimental setup).

  Adam with step size 1e-3 annealed by a cosine schedule, AVGLOGITS KL, early stopping on
  server validation accuracy. Where the paper is silent, the authors' code
  (`noise_knowledge_transfer.py`): the best evaluated student returned
  (`distill_keep_initial` False), gradients clipped to norm 5. `distill_min_improvement` > 0
  is this library's option.
  """
  with settings.named_by(
    {
      "num_steps": "distill_steps",
      "batch_size": "distill_batch_size",
      "eval_every": "distill_eval_every",
      "patience": "distill_patience",
      "min_improvement": "distill_min_improvement",
      "clip_norm": "distill_clip_norm",
    }
  ):
    return distillation.DistillationConfig(
      num_steps=shared.distill_steps,
      batch_size=shared.distill_batch_size,
      optimizer="adam",
      learning_rate=1e-3,
      lr_schedule="cosine",
      momentum=0.0,
      loss="kl",
      swa=False,
      eval_every=own.distill_eval_every,
      patience=own.distill_patience,
      min_improvement=own.distill_min_improvement,
      keep_initial_student=own.distill_keep_initial,
      clip_norm=own.distill_clip_norm,
    )


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  shared, own = context.group(server_distillation.Settings), context.group(Settings)
  config = server_distillation.ServerDistillationConfig.of(
    shared,
    distillation_config(shared, own),
    targets="avg_logits",
    keep_clients=drop_worst.client_filter(context.group(drop_worst.DropWorst)),
    seed=context.seed,
  )
  names = own.prototype_names()
  if not names:
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
    return algorithm.FederatedAlgorithm.of("feddf", built, context)
  # Prototype p starts from its own seed, as ensemble member p does.
  model_fns = [
    functools.partial(context.build_model, name, context.seed + 1009 * p)
    for p, name in enumerate(names)
  ]
  built = model_prototypes.build_heterogeneous_feddf(
    model_fns,
    names,
    context.element_spec,
    context.local,
    context.server_data,
    config,
    clients_per_round=context.clients_per_round,
    transport=context.transport,
  )
  return algorithm.FederatedAlgorithm.of(
    "feddf",
    built,
    context,
    client_keys=lambda clients, slots: clients,
    summary=model_prototypes.summary(names, model_fns),
  )


def validate(groups, facts: algorithm.RunFacts) -> None:
  """Two or more different prototypes of the task, the first the run's model; the student's
  budget (`DistillationConfig`'s check, named by its flags)."""
  own = groups[Settings]
  distillation_config(groups[server_distillation.Settings], own)
  names = own.prototype_names()
  if not names:
    return
  problem = None
  models, model = facts.task.MODEL_NAMES, facts.model
  if facts.recalibrate_batch_norm:
    problem = "not with --recalibrate_batch_norm (one model's statistics): drop one of them"
  elif len(names) < 2 or len(set(names)) < len(names):
    problem = "list two or more different models, e.g. --prototypes=cnn,resnet8"
  elif unknown := [n for n in names if n not in models]:
    problem = (
      f"unknown model {unknown[0]} for task {facts.task_name}: choose from {', '.join(models)}"
    )
  elif names[0] != model:
    problem = (
      f"starts with {names[0]} but --model={model}: the first prototype is the run's "
      f"model (test_accuracy, model.keras); pass --model={names[0]} or list {model} first"
    )
  if problem:
    raise settings.SettingError("prototypes", own.prototypes, problem)


ALGORITHM = algorithm.Algorithm(
  "feddf",
  "FedDF (Lin et al. 2020): AVGLOGITS distillation from the client models, optionally across "
  "architectures",
  build,
  settings=(server_distillation.Settings, drop_worst.DropWorst, Settings),
  validate=validate,
  server_data=True,
  recalibrates=True,
  # Binarized students beat their weight average by a few validation images at most, and
  # were then often worse on the test set (benchmarks/RESULTS.md, "FedDF on the binarized
  # ResNet-8 with its teachers' batch norm measured on server images").
  # Prototypes have no one model's statistics to measure.
  binary_recipe=lambda values: {
    "distill_keep_initial": True,
    **({"recalibrate_batch_norm": None} if values.get("prototypes") else {}),
  },
)
