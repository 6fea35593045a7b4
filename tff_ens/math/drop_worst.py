"""FedDF's drop-worst: which client models are left out of the ensemble and the average.

Lin, Kong, Stich and Jaggi, NeurIPS 2020, Sec. 4 ("drop-worst"): models that are dummy
predictors on the server's validation data are dropped. The paper names no threshold; the
rules are the authors' code's (`_get_client_weights`) and this library's (`DROP_WORST_RULES`).
The validation accuracies come from `distillation.member_accuracies`.
"""

import dataclasses
import functools

import tensorflow as tf

from tff_ens import settings
from tff_ens.settings import setting

DROP_WORST_RULES = ("guess_or_outliers", "majority")
# FedDF's code: a model below this many times 1/C is worse than guessing, and
# one below mean - OUTLIER_STDS std of the others' accuracies is an outlier.
RANDOM_GUESS_FACTOR = 1.2
OUTLIER_STDS = 1.5


@dataclasses.dataclass(frozen=True)
class DropWorst:
  """FedDF's drop-worst (the `--drop_worst*` flags).

  Attributes:
    enabled: leave out the client models that are dummy predictors on server validation.
    rule: which are, one of DROP_WORST_RULES (`drop_worst_mask`).
  """

  enabled: bool = setting(
    True,
    "FedDF: leave out client models at chance level on server validation.",
    flag="drop_worst",
  )
  rule: str = setting(
    "guess_or_outliers",
    "FedDF's drop-worst: below 1.2/C, else low outliers (mean - 1.5 std; the authors' code), "
    "or at most the majority-class rate (majority).",
    flag="drop_worst_rule",
    before="majority",
    choices=DROP_WORST_RULES,
  )

  def __post_init__(self):
    settings.check(self)


def client_filter(options: DropWorst):
  """`drop_worst_mask` with these options' rule, or None when drop-worst is off: the
  server step's `keep_clients`."""
  return functools.partial(drop_worst_mask, options.rule) if options.enabled else None


def chance_accuracy(y, num_classes: int):
  """The accuracy of the best input-independent guess on labels `y`.

  The larger of 1/num_classes (uniform guessing) and the frequency of the
  majority class (always predicting it): a collapsed model that outputs one
  class reaches exactly that class's frequency, so anything up to the
  majority frequency is possible without looking at the input.
  """
  counts = tf.math.bincount(tf.cast(y, tf.int32), minlength=num_classes, dtype=tf.float32)
  majority = tf.reduce_max(counts) / tf.maximum(tf.reduce_sum(counts), 1.0)
  return tf.maximum(majority, 1.0 / num_classes)


def outlier_mask(accuracies, members):
  """The members that are not low outliers (FedDF's code, drop-worst).

  As Lin et al.'s `detect_outlier_and_remain_v1`: one best member is set
  aside, and the members whose accuracy is at least mean - 1.5 std of the
  other members' accuracies (population std) are kept; the best always is.
  With fewer than two members, all are kept. `members` [M] bool marks the
  models to consider; the result is a bool mask [M] within it.
  """
  members = tf.cast(members, tf.bool)
  accuracies = tf.cast(accuracies, tf.float32)
  best = tf.argmax(tf.where(members, accuracies, -1.0), output_type=tf.int32)
  others = tf.logical_and(
    members, tf.logical_not(tf.cast(tf.one_hot(best, tf.size(accuracies)), tf.bool))
  )
  count = tf.reduce_sum(tf.cast(others, tf.float32))
  mean = tf.math.divide_no_nan(tf.reduce_sum(tf.where(others, accuracies, 0.0)), count)
  variance = tf.math.divide_no_nan(
    tf.reduce_sum(tf.where(others, tf.square(accuracies - mean), 0.0)), count
  )
  # Accuracies are multiples of 1/n: the margin absorbs the mean's rounding.
  lower = mean - OUTLIER_STDS * tf.sqrt(variance) - 1e-6
  return tf.logical_and(members, accuracies >= lower)


def drop_worst_mask(rule: str, accuracies, y, num_classes: int, members=None):
  """FedDF's drop-worst: the models kept for averaging and distillation.

  Lin et al., Sec. 4 ("drop-worst"): models that are dummy predictors on
  the validation data are left out. The paper names no threshold; `rule`:

  * "guess_or_outliers" (the authors' code, `_get_client_weights`): drop
    the models below 1.2 / num_classes; if there is none, drop the low
    outliers instead (`outlier_mask`);
  * "majority" (this library's): keep the models strictly above
    `chance_accuracy(y)`, the majority-class rate, which a model ignoring
    its input reaches.

  Args:
    rule: one of DROP_WORST_RULES.
    accuracies: [M] validation accuracies (`distillation.member_accuracies`).
    y: the validation labels.
    num_classes: C.
    members: optional [M] bool, the models to consider (default: all);
      the others are never kept.

  Returns:
    `(keep, informative)`: bool [M] and a bool scalar, False if no member
    passes; `keep` is then every member (an empty ensemble has no average
    to fall back on).
  """
  accuracies = tf.cast(accuracies, tf.float32)
  if members is None:
    members = tf.ones_like(accuracies, tf.bool)
  members = tf.cast(members, tf.bool)
  if rule == "majority":
    keep = accuracies > chance_accuracy(y, num_classes)
  elif rule == "guess_or_outliers":
    above_guess = accuracies >= RANDOM_GUESS_FACTOR / num_classes
    any_below = tf.reduce_any(tf.logical_and(members, tf.logical_not(above_guess)))
    keep = tf.cond(any_below, lambda: above_guess, lambda: outlier_mask(accuracies, members))
  else:
    raise ValueError(
      f"unknown drop-worst rule {rule!r}: choose one of {', '.join(DROP_WORST_RULES)}"
    )
  keep = tf.logical_and(members, keep)
  informative = tf.reduce_any(keep)
  return tf.where(informative, keep, members), informative
