"""FedProx (Li et al., MLSys 2020): FedAvg whose clients minimize their loss plus the proximal
term mu/2 ||w - w_t||^2 towards the round's model (eq. 2).

The only stage the paper changes is the client work, whose local objective takes mu as a
parameter (`client_work.LocalTrainingConfig.proximal_mu`), not a second copy.
"""

import dataclasses

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.algorithms import fedavg
from tff_ens.settings import setting
from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import server_optimizer


@settings.group
class Settings:
  """FedProx's proximal term."""

  proximal_mu: float = setting(
    0.01,
    "FedProx's mu (Li et al., eq. 2), also of --algorithm=fedensemble --local_objective=fedprox.",
    at_least=0,
  )


def local_config(context: algorithm.BuildContext) -> client_work_lib.LocalTrainingConfig:
  """The run's local training with FedProx's proximal term."""
  return dataclasses.replace(context.local, proximal_mu=context.group(Settings).proximal_mu)


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  rate = fedavg.server_learning_rate(context, fedavg.LEARNING_RATE)
  return fedavg.build_family(
    context, "fedprox", server_optimizer.build_server_optimizer(rate), local_config(context)
  )


ALGORITHM = algorithm.Algorithm(
  "fedprox",
  "FedAvg with the proximal local objective (Li et al. 2020)",
  build,
  settings=(fedavg.ServerSettings, Settings),
  # The device file trains without the proximal term.
  **{**fedavg.FAMILY, "on_device": False},
)
