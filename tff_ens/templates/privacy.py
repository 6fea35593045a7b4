"""Client-level differential privacy: DP-FedAvg aggregation and accounting.

DP-FedAvg (McMahan, Ramage, Talwar, Zhang: "Learning Differentially Private
Recurrent Language Models", ICLR 2018, Algorithm 1): every sampled client's
update is clipped to L2 norm C, the server adds Gaussian noise of standard
deviation z C to the sum of the clipped updates and divides by the fixed
cohort size m (not by the clients who reported, which would depend on the
data). The clip is fixed, or adapted each round to a private estimate of the
median update norm (Andrew, Thakkar, McMahan, Ramaswamy: "Differentially
Private Learning with Adaptive Clipping", NeurIPS 2021). Both are TFF's
`tff.aggregators.DifferentiallyPrivateFactory`; `clip_update` and
`add_gaussian_noise` are the same two steps for aggregators TFF's factories
do not fit (Fed-ensemble's K slots).

The guarantee is for the released models, with clients (writers) as the
privacy unit: a model sequence is (epsilon, delta)-indistinguishable between
two populations that differ in one client's whole data set. It does not cover
the training metrics (loss, accuracy, example counts) the loop logs in the
clear.
"""

import dataclasses

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import settings
from tff_ens.settings import setting

# TFF's adaptive clipping noises the count of clipped clients with standard
# deviation 0.05 m, which must exceed z / 2 (`adaptive_clip_noise_params`).
_CLIPPED_COUNT_STDDEV_PER_CLIENT = 0.05


@dataclasses.dataclass(frozen=True)
class DPConfig:
  """DP-FedAvg's aggregation and accounting (the `--dp_*` flags).

  Attributes:
    noise_multiplier: z, the noise standard deviation over the clip norm; 0
      clips without noise (no privacy guarantee).
    clip_norm: C, the fixed L2 clip of each client's update; 0 adapts it
      (TFF's `gaussian_adaptive`: starts at 0.1, geometric steps of rate 0.2
      towards the median update norm), which needs z > 0.
    target_delta: delta of the reported epsilon; 0: `default_target_delta`.
    clients_per_round: m, the sampled cohort; the noised sum is divided by m.
  """

  noise_multiplier: float = setting(
    0.0,
    "DP-FedAvg: Gaussian noise z times the clip norm on the sum of clipped client updates (0:"
    " no noise).",
    flag="dp_noise_multiplier",
    at_least=0,
  )
  clip_norm: float = setting(
    0.0,
    "DP-FedAvg: clip each client's update to this L2 norm; 0 with --dp_noise_multiplier > 0: "
    "adaptive clip (to the median norm).",
    flag="dp_clip_norm",
    at_least=0,
  )
  target_delta: float = setting(
    0.0,
    "DP-FedAvg: delta of the reported epsilon (0: 1/N^1.1 for N training clients).",
    flag="dp_target_delta",
    at_least=0,
    below=1,
  )
  clients_per_round: int = setting(uses="clients_per_round", above=0)

  def delta(self, num_clients: int) -> float:
    """`target_delta`, or `default_target_delta` of `num_clients` clients."""
    return self.target_delta or default_target_delta(num_clients)

  def __post_init__(self):
    settings.check(self)
    if self.adaptive and not self.noise_multiplier:
      raise settings.SettingError(
        "clip_norm",
        self.clip_norm,
        "adaptive clipping needs a noise multiplier > 0: set a fixed clip norm",
      )
    limit = 2 * _CLIPPED_COUNT_STDDEV_PER_CLIENT * self.clients_per_round
    if self.adaptive and self.noise_multiplier >= limit:
      raise settings.SettingError(
        "noise_multiplier",
        self.noise_multiplier,
        f"must be below {limit:g} for adaptive clipping with {self.clients_per_round} clients "
        "per round: set a fixed clip norm or sample more clients per round",
      )

  @property
  def adaptive(self) -> bool:
    return self.clip_norm == 0

  def aggregator_factory(self) -> tff.aggregators.WeightedAggregationFactory:
    """The DP mean as the weighted factory a `LearningProcess` takes.

    Clients are weighted uniformly (a weight by example count would give a
    client unbounded influence): `tff.aggregators.as_weighted_aggregator`
    ignores the weights.
    """
    dp = tff.aggregators.DifferentiallyPrivateFactory
    z, m = float(self.noise_multiplier), float(self.clients_per_round)
    if self.adaptive:
      factory = dp.gaussian_adaptive(z, m)
    else:
      factory = dp.gaussian_fixed(z, m, float(self.clip_norm))
    return tff.aggregators.as_weighted_aggregator(factory)


def clip_update(update, clip_norm: float):
  """`update` scaled to global L2 norm at most `clip_norm`.

  McMahan et al. 2018, Algorithm 1, ClipFn (flat clipping): all tensors of the
  update together, as `tensorflow_privacy`'s GaussianSumQuery does.
  """
  flat = tf.nest.flatten(update)
  clipped, _ = tf.clip_by_global_norm(flat, clip_norm)
  return tf.nest.pack_sequence_as(update, clipped)


def add_gaussian_noise(value, stddev):
  """`value` plus N(0, stddev^2) on every entry (McMahan et al. 2018, Alg. 1).

  Unseeded, as TF Privacy's `GaussianSumQuery` that TFF's factories use: noise
  that `--seed` could regenerate could be subtracted and would protect
  nothing, so DP runs are the one exception to `--seed` reproducibility.

  Args:
    value: a structure of float tensors (a sum of clipped updates).
    stddev: the noise standard deviation, z C.
  """
  return tf.nest.map_structure(
    lambda t: t + tf.random.normal(tf.shape(t), stddev=stddev, dtype=t.dtype), value
  )


def aggregator_metrics(measurements) -> dict[str, float]:
  """{"dp_clip_norm": clip} of an adaptive DP aggregator's measurements.

  The clip TFF reports is the one adapted after the round, used by the next.
  Empty for any other aggregator's.
  """
  if not isinstance(measurements, dict):
    return {}
  query = measurements.get("dp_query_metrics") or {}
  return {"dp_clip_norm": float(query["clip"])} if "clip" in query else {}


def default_target_delta(num_clients: int) -> float:
  """delta = 1 / N^1.1 for N clients.

  A delta above 1/N would allow releasing one client's data outright; the
  exponent 1.1 keeps it below 1/N by a factor N^0.1 (1.6 for the 105 writers
  of the FEMNIST slice) without the epsilon growing as with 1/N^2.
  """
  return 1.0 / num_clients**1.1


def round_event(
  noise_multiplier: float, clients_per_round: int, num_clients: int
) -> dp_accounting.DpEvent:
  """The privacy event of one DP-FedAvg round, for an RDP accountant.

  The training loop samples a cohort of exactly m of the N clients uniformly
  without replacement (`simulation.sample_clients`), so the event is
  `SampledWithoutReplacementDpEvent` (Wang, Balle, Kasiviswanathan,
  AISTATS 2019, Theorem 27), not the Poisson sampling the DP-FedAvg paper
  assumes. Its analysis is for the replace-one relation (N is public), under
  which the sum of clipped updates has sensitivity 2C, so the Gaussian's
  noise multiplier relative to that sensitivity is z / 2. An adaptive clip's
  event is TFF's composition of the update and clipped-count Gaussians, whose
  total multiplier is z by construction (`gaussian_adaptive`), so the same
  event accounts for it.
  """
  return dp_accounting.SampledWithoutReplacementDpEvent(
    source_dataset_size=num_clients,
    sample_size=clients_per_round,
    event=dp_accounting.GaussianDpEvent(noise_multiplier / 2),
  )


def epsilons(
  noise_multiplier: float,
  clients_per_round: int,
  num_clients: int,
  rounds: int,
  target_delta: float,
) -> np.ndarray:
  """epsilon at `target_delta` after rounds 1..`rounds`, by RDP composition.

  Every round counts as a release by its whole sampled cohort: dropouts and
  stragglers only lower a client's privacy loss. Needs z > 0 (without noise
  there is no guarantee).
  """
  if noise_multiplier <= 0:
    raise ValueError(f"epsilon needs a noise multiplier > 0, got {noise_multiplier}")
  orders = rdp_privacy_accountant.DEFAULT_RDP_ORDERS
  accountant = dp_accounting.rdp.RdpAccountant(
    orders, dp_accounting.NeighboringRelation.REPLACE_ONE
  )
  accountant.compose(round_event(noise_multiplier, clients_per_round, num_clients))
  per_round = accountant.rdp
  return np.array(
    [
      dp_accounting.rdp.compute_epsilon(orders, r * per_round, target_delta)[0]
      for r in range(1, rounds + 1)
    ]
  )
