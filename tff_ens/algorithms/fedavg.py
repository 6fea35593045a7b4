"""FedAvg (McMahan et al., AISTATS 2017): the clients' updates averaged, weighted by their
examples.

The four stages of `tff.learning.templates.compose_learning_process`: the model broadcast, the
shared client work (`client_work.build_client_work`), the weighted mean (or DP-FedAvg's,
`templates.privacy`) and the finalizer applying a server optimizer to the mean update
(`templates.server_optimizer`; SGD with step size 1 is FedAvg's). FedProx, FedAvgM and FedAdam
are this builder with one change each (`fedprox`, `fedavgm`, `fedadam`).
"""

from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import settings
from tff_ens.algorithms import algorithm
from tff_ens.settings import setting
from tff_ens.templates import built as built_lib
from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import device_client_work
from tff_ens.templates import server_optimizer as server_optimizer_lib

# FedAvg's server step: the model moves by the whole mean update.
LEARNING_RATE = 1.0
# What the FedAvg family's stages take: DP-FedAvg's mean, batch-norm recalibration in the
# finalizer, and plain local SGD(M) that devices can run.
FAMILY = dict(dp=True, recalibrates=True, on_device=True)


@settings.group
class ServerSettings:
  """The FedAvg family's server optimizer."""

  server_lr: float | None = setting(
    None,
    "The server optimizer's step size on the averaged update (the FedAvg family). Unset: the "
    "algorithm's own (FedAvg's 1; FedAdam's in tff_ens/algorithms/fedadam.py).",
    above=0,
  )

  @staticmethod
  def upgrade_saved(saved: dict) -> dict:
    """Before FedAdam (`--server_epsilon`) every run wrote `server_lr`, FedAvg's 1 by default,
    whatever its algorithm: there it becomes unset (the algorithm's own)."""
    if "server_epsilon" not in saved and saved.get("server_lr") == LEARNING_RATE:
      return {"server_lr": None}
    return {}


def server_learning_rate(context: algorithm.BuildContext, default: float) -> float:
  """`--server_lr`, else the algorithm's `default`."""
  given = context.group(ServerSettings).server_lr
  return default if given is None else given


def build_family(
  context: algorithm.BuildContext,
  name: str,
  server_optimizer,
  local: client_work_lib.LocalTrainingConfig | None = None,
) -> algorithm.FederatedAlgorithm:
  """The FedAvg-family algorithm `name` of `context`, with the finalizer's `server_optimizer`
  and the clients' training `local` (default: the run's)."""
  built = build_fedavg(
    lambda: context.model_fn(0),
    context.element_spec,
    local or context.local,
    server_optimizer=server_optimizer,
    aggregator_factory=context.dp.aggregator_factory() if context.dp else None,
    on_device=context.on_device,
    recalibration_images=context.recalibration_images,
  )
  return algorithm.FederatedAlgorithm.of(name, built, context)


def build(context: algorithm.BuildContext) -> algorithm.FederatedAlgorithm:
  """FedAvg: SGD on the mean update at `--server_lr` (default 1)."""
  rate = server_learning_rate(context, LEARNING_RATE)
  return build_family(context, "fedavg", server_optimizer_lib.build_server_optimizer(rate))


ALGORITHM = algorithm.Algorithm(
  "fedavg", "FedAvg (McMahan et al. 2017)", build, settings=(ServerSettings,), **FAMILY
)


def build_fedavg(
  model_fn: Callable[[], tf.keras.Model],
  element_spec,
  local_config: client_work_lib.LocalTrainingConfig,
  *,
  server_optimizer: tff.learning.optimizers.Optimizer | None = None,
  aggregator_factory: Optional[tff.aggregators.WeightedAggregationFactory] = None,
  on_device: bool = False,
  recalibration_images: np.ndarray | None = None,
) -> built_lib.BuiltProcess:
  """Builds FedAvg (McMahan et al. 2017), FedProx, FedAvgM or FedAdam.

  Args:
    model_fn: builds a fresh Keras model with logits output.
    element_spec: `tf.TensorSpec`s of one client batch `(x, y)`.
    local_config: client training; `proximal_mu > 0` makes it FedProx.
    server_optimizer: the finalizer's optimizer, applied to the averaged update (FedOpt);
      None: SGD with step size 1, FedAvg's. Server momentum makes it FedAvgM
      (`fedavgm`), Adam FedAdam (`fedadam`).
    aggregator_factory: a weighted `tff.aggregators` factory for the updates
      (DP, clipping, compression); the weighted mean by default.
    on_device: the clients train on their devices (`tff_ens.program.device_clients`), and their
      data are the results (`device_client_work.build_device_client_work`).
    recalibration_images: server images on which the new model's batch-norm statistics
      are measured each round (`server_optimizer.build_finalizer`); None averages the clients'.

  Returns:
    The `tff.learning` process, with what a client downloads and uploads.
  """
  weights_type = client_work_lib.weights_type_of(model_fn)
  client_work = (
    device_client_work.build_device_client_work(weights_type, local_config)
    if on_device
    else client_work_lib.build_client_work(model_fn, element_spec, local_config)
  )
  distributor, aggregator, finalizer = server_optimizer_lib.fedavg_stages(
    weights_type,
    server_optimizer,
    aggregator_factory,
    None if recalibration_images is None else (model_fn, recalibration_images),
  )
  process = tff.learning.templates.compose_learning_process(
    server_optimizer_lib.build_initial_weights_fn(model_fn),
    distributor,
    client_work.process,
    aggregator,
    finalizer,
  )
  return built_lib.built_from_client_work(process, client_work)
