"""FedAvgM (Hsu, Qi and Brown, arXiv:1909.06335, 2019): FedAvg with momentum on the server.

The server treats the mean update as a gradient and applies SGD with momentum to it
(`server_optimizer.build_server_optimizer`): the finalizer is the only stage that changes.
"""

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.algorithms import fedavg
from tff_ens.settings import setting
from tff_ens.templates import server_optimizer


@settings.group
class Settings:
  """FedAvgM's server momentum."""

  server_momentum: float = setting(0.9, "Server momentum (Hsu et al. 2019).", at_least=0)


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  rate = fedavg.server_learning_rate(context, fedavg.LEARNING_RATE)
  momentum = context.group(Settings).server_momentum
  return fedavg.build_family(
    context, "fedavgm", server_optimizer.build_server_optimizer(rate, momentum)
  )


ALGORITHM = algorithm.Algorithm(
  "fedavgm",
  "FedAvg with server momentum (Hsu et al. 2019)",
  build,
  settings=(fedavg.ServerSettings, Settings),
  **fedavg.FAMILY,
)
