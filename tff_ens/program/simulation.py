"""The simulated federation of a round: who is sampled, who fails, and their data.

Client sampling, dropouts and stragglers (`simulate_faults`), device speeds and FedScale's
over-commitment (`first_to_finish`), all in one `RoundPlan` (`plan_round`), and each
client's local dataset (`client_dataset`, `client_order`). Everything is a pure function of
`(seed, round)`, so a resumed run samples the same clients as an uninterrupted one.
"""

import dataclasses
import math

import numpy as np
import tensorflow as tf


def sample_clients(num_clients: int, cohort_size: int, seed: int, round_num: int) -> np.ndarray:
  """Indices of the clients of round `round_num`: a function of the seed only."""
  rng = np.random.default_rng([seed, round_num])
  return rng.choice(num_clients, size=cohort_size, replace=False)


def simulate_faults(
  cohort_size: int, seed: int, round_num: int, dropout_rate: float, straggler_rate: float
) -> tuple[np.ndarray, np.ndarray]:
  """Which sampled clients report this round, and how much work each does.

  Each client independently drops out (returns nothing) with probability
  `dropout_rate`, and is a straggler with probability `straggler_rate`: as in
  FedBE's systems-heterogeneity experiment (Chen & Chao, ICLR 2021, Sec. 5),
  its local epochs are drawn uniformly from (0, E], i.e. it completes a
  fraction u ~ U(0, 1] of its E epochs. Seeded by (seed, round).

  Returns:
    (reports: bool [cohort_size], work: float [cohort_size] in (0, 1]).
  """
  rng = np.random.default_rng([seed, round_num, 2])
  reports = rng.random(cohort_size) >= dropout_rate
  straggles = rng.random(cohort_size) < straggler_rate
  work = np.where(straggles, 1.0 - rng.random(cohort_size), 1.0)
  return reports, work


def client_speeds(num_clients: int, seed: int) -> np.ndarray:
  """Each client's device speed (local batches per unit of time).

  FedScale (Lai et al., ICML 2022) replays measured device traces; without
  them we assume speeds spread log-normally (sigma 0.5, so the 10% slowest
  are about 2x slower than the median), fixed per client for the run.
  """
  return np.random.default_rng([seed, 3]).lognormal(0.0, 0.5, num_clients)


def first_to_finish(durations: np.ndarray, reports: np.ndarray, m: int) -> np.ndarray:
  """FedScale's over-commitment: the first `m` reporting clients to finish.

  The server selects more clients than it needs (FedScale: 1.3 m) and
  aggregates the `m` whose updates arrive first; the rest are discarded.
  Ties go to the earlier client of the cohort.

  Args:
    durations: each cohort client's simulated training time.
    reports: which cohort clients report at all (not dropped out).
    m: updates to aggregate; 0 keeps every reporting client.

  Returns:
    bool [cohort]: the clients whose updates are aggregated.
  """
  if m <= 0:
    return reports.copy()
  order = np.argsort(np.where(reports, durations, np.inf), kind="stable")
  kept = np.zeros_like(reports)
  kept[order[:m]] = True
  return kept & reports


@dataclasses.dataclass(frozen=True)
class RoundPlan:
  """Who is sampled in a round, who reports and how much each one trains.

  Attributes:
    cohort: indices of the sampled training clients.
    seeds: each sampled client's data-shuffling seed.
    reports: the clients whose updates the server aggregates.
    work: each client's completed share of its local epochs, in (0, 1].
    late: reporting clients left out by --aggregate_first.
    poisoned: reporting clients injected with NaN data
      (--nan_clients_per_round), whose updates must be rejected.
  """

  cohort: np.ndarray
  seeds: np.ndarray
  reports: np.ndarray
  work: np.ndarray
  late: np.ndarray
  poisoned: np.ndarray


def plan_round(
  cohort: np.ndarray,
  sizes: np.ndarray,
  speeds: np.ndarray,
  round_num: int,
  *,
  seed: int,
  epochs: int,
  batch_size: int,
  dropout_rate: float = 0.0,
  straggler_rate: float = 0.0,
  aggregate_first: int = 0,
  nan_clients: int = 0,
  max_steps: int = 0,
) -> RoundPlan:
  """The round's faults for its sampled `cohort`: a function of (seed, round) only.

  Args:
    cohort: the clients of the round (`sample_clients`, or the algorithm's own).
    sizes: labeled training examples of every client.
    speeds: `client_speeds` of every client.
    round_num: the round, from 1.
    seed: the run's seed.
    epochs, batch_size: the clients' local training (their simulated durations).
    dropout_rate, straggler_rate: `simulate_faults`.
    aggregate_first: FedScale's over-commitment (`first_to_finish`); 0: every client.
    nan_clients: this many reporting clients train on NaN inputs (fault injection).
    max_steps: the clients' local steps are at most this many (0: no limit).
  """
  cohort = np.asarray(cohort)
  seeds = np.random.default_rng([seed, round_num, 1]).integers(2**31, size=len(cohort))
  reports, work = simulate_faults(len(cohort), seed, round_num, dropout_rate, straggler_rate)
  batches = np.ceil(sizes[cohort] * epochs / batch_size)
  if max_steps:
    batches = np.minimum(batches, max_steps)
  kept = first_to_finish(work * batches / speeds[cohort], reports, aggregate_first)
  poisoned = np.zeros_like(kept)
  poisoned[np.flatnonzero(kept)[:nan_clients]] = True
  return RoundPlan(
    cohort=cohort, seeds=seeds, reports=kept, work=work, late=reports & ~kept, poisoned=poisoned
  )


def client_dataset(
  x: np.ndarray,
  y: np.ndarray,
  *,
  epochs: int,
  batch_size: int,
  seed: int,
  augmentation=None,
  work: float = 1.0,
  poisoned: bool = False,
  max_steps: int = 0,
) -> tf.data.Dataset:
  """One client's local training data: shuffled (seeded), repeated, batched.

  `augmentation` is the task's TRAIN_AUGMENTATION, `(x, y, seed) -> (x, y)`;
  the i-th example of the stream gets the stateless seed (seed, i). A
  straggler (`work` < 1) stops after that fraction of its batches (at least
  one). A `poisoned` client (fault injection) has NaN inputs, so its local
  training ends in NaN weights, as a broken device's would. With `max_steps` > 0 it
  stops after that many batches (before a straggler's share of them).
  """
  if poisoned:
    x = np.full_like(x, np.nan)
  dataset = (
    tf.data.Dataset.from_tensor_slices((x, y))
    .shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    .repeat(epochs)
  )
  if augmentation is not None:
    dataset = dataset.enumerate().map(
      lambda i, example: augmentation(*example, tf.stack([tf.constant(seed, tf.int64), i]))
    )
  dataset = dataset.batch(batch_size)
  batches = math.ceil(len(x) * epochs / batch_size)
  if max_steps and max_steps < batches:
    batches = max_steps
    dataset = dataset.take(batches)
  if work < 1.0:
    dataset = dataset.take(max(1, math.ceil(work * batches)))
  return dataset


def client_order(
  num_examples: int,
  *,
  epochs: int,
  batch_size: int,
  seed: int,
  work: float = 1.0,
  max_steps: int = 0,
) -> np.ndarray:
  """The indices of a client's examples in the order `client_dataset` trains on them."""
  indices = np.arange(num_examples, dtype=np.int32)
  batches = client_dataset(
    indices,
    indices,
    epochs=epochs,
    batch_size=batch_size,
    seed=seed,
    work=work,
    max_steps=max_steps,
  )
  return np.concatenate([y for _, y in batches.as_numpy_iterator()] or [indices[:0]])


def batch_element_spec(task) -> tuple[tf.TensorSpec, tf.TensorSpec]:
  """The `tf.TensorSpec`s of one batch `(x, y)` of the task's clients."""
  return (
    tf.TensorSpec((None,) + tuple(task.INPUT_SHAPE), tf.as_dtype(task.INPUT_DTYPE)),
    tf.TensorSpec((None,), tf.int32),
  )
