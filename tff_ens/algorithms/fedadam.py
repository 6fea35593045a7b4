"""FedAdam (Reddi et al., ICLR 2021, Algorithm 2): FedAvg with Adam on the server.

FedAvg's distributor, client work and aggregator are unchanged. The finalizer
(`server_optimizer.build_finalizer`) takes the averaged update as a pseudo-gradient and
applies Adam to it instead of SGD. That is the only stage the paper changes, so this module
only builds the optimizer (`tff.learning.optimizers.build_adam`).

TFF's Adam corrects the moments' bias, which Algorithm 2 leaves out. In the first round
both steps are close to `learning_rate * sign(update)` (where the update is well above
`epsilon`); the correction only shortens the steps of the first ~1/(1 - beta_2) rounds.
"""

import tensorflow_federated as tff

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.algorithms import fedavg
from tff_ens.settings import setting

# Section 5 of the paper fixes the moments' decays at these values for every task.
BETA_1 = 0.9
BETA_2 = 0.99
# The paper tunes the server step size and the adaptivity tau (Adam's epsilon) per task,
# on grids of powers of ten. These defaults are in those grids; tune them for a new task.
LEARNING_RATE = 0.01


@settings.group
class Settings:
  """FedAdam's adaptivity."""

  server_epsilon: float = setting(
    1e-3,
    "FedAdam's epsilon, the paper's adaptivity tau (Reddi et al. tune it per task, as "
    "--server_lr).",
    at_least=0,
  )


def server_optimizer(learning_rate: float, epsilon: float):
  """Algorithm 2's server update, lines 10-12: Adam on the averaged client update."""
  return tff.learning.optimizers.build_adam(
    learning_rate=learning_rate, beta_1=BETA_1, beta_2=BETA_2, epsilon=epsilon
  )


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  rate = fedavg.server_learning_rate(context, LEARNING_RATE)
  epsilon = context.group(Settings).server_epsilon
  return fedavg.build_family(context, "fedadam", server_optimizer(rate, epsilon))


ALGORITHM = algorithm.Algorithm(
  "fedadam",
  "FedAvg with Adam on the server (Reddi et al. 2021)",
  build,
  settings=(fedavg.ServerSettings, Settings),
  **fedavg.FAMILY,
)
