"""When an exported file should say "not sure": a threshold on its own uncertainty.

The run's out-of-distribution evaluation (`tff_ens.math.metrics.uncertainty_summary`,
docs/uncertainty.md) ranks two scores by their AUROC for OOD against in-distribution inputs
in summary.json: `ood_auroc_entropy` (the predictive entropy) and, for ensembles,
`ood_auroc_mutual_information`. The threshold takes the score with the higher of the two
(entropy where the run has no OOD set or one model) and sets it at its `QUANTILE` on the
run's own in-distribution test inputs, computed with the exported file's outputs: a page
that flags inputs above it flags 1 - QUANTILE of the test inputs it knows. On a
`--classes=digits` run it also reports the share of the OOD letters flagged and the file's
own AUROC beside the run's.
"""

import numpy as np
import scipy.special

from export import on_device
from tff_ens.math import ensemble_math
from tff_ens.math import metrics

QUANTILE = 0.95
# At most this many inputs of each split (a seeded subsample): a Shakespeare test split
# holds tens of thousands of samples.
MAX_EXAMPLES = 5_000
SCORES = ("entropy", "mutual_information")


def chosen_score(summary: dict, is_ensemble: bool) -> str:
  """The score of the run's better OOD AUROC: mutual information only if the run measured
  it above the entropy's."""
  entropy, mutual_information = (summary.get(f"ood_auroc_{score}") for score in SCORES)
  if is_ensemble and mutual_information is not None and entropy is not None:
    return "mutual_information" if mutual_information > entropy else "entropy"
  return "entropy"


def scores(exported, inputs: np.ndarray) -> dict[str, np.ndarray]:
  """The file's entropy (and an ensemble's mutual information) on `inputs`, uniform alpha."""
  if isinstance(exported, on_device.Ensemble):
    outputs = exported.predict(inputs)
    return {score: outputs[score] for score in SCORES}
  probabilities = scipy.special.softmax(exported.logits(inputs).astype(np.float64), axis=-1)
  return {"entropy": ensemble_math.entropy(probabilities)}


def _subsample(split, seed: int) -> np.ndarray:
  x, _ = split.concatenated()
  chosen = np.sort(np.random.default_rng(seed).permutation(len(x))[:MAX_EXAMPLES])
  return x[chosen]


def threshold(exported, data, summary: dict, input_dtype, seed: int = 0) -> dict:
  """The metadata's `not_sure` entry of `exported` (an `export.on_device` Classifier or
  Ensemble) from the run's `data` (its test and, if any, ood splits) and `summary`."""
  score = chosen_score(summary, isinstance(exported, on_device.Ensemble))
  test = scores(exported, _subsample(data.test, seed).astype(input_dtype))[score]
  value = float(np.quantile(test, QUANTILE))
  entry = {
    "score": score,
    "threshold": value,
    "quantile": QUANTILE,
    "test_examples": len(test),
    "source": (
      f"the {QUANTILE:.0%} quantile of the file's {score.replace('_', ' ')} on {len(test):,} "
      "of the run's in-distribution test inputs"
      + (
        f"; {score.replace('_', ' ')} is the score of summary.json's higher OOD AUROC"
        if data.ood is not None
        else "; the run has no out-of-distribution set"
      )
    ),
  }
  if data.ood is not None:
    ood = scores(exported, _subsample(data.ood, seed).astype(input_dtype))[score]
    entry.update(
      ood_examples=len(ood),
      ood_flagged=float(np.mean(ood > value)),
      ood_auroc=metrics.ood_auroc(test, ood),
      run_ood_auroc=summary.get(f"ood_auroc_{score}"),
    )
  return entry
