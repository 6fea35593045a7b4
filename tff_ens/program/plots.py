"""Figures of a run's uncertainty, drawn with matplotlib (Agg) into PNG files."""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

UNCERTAINTY_FIGURE = "uncertainty.png"


def save_figure(figure, path: str) -> None:
  """Writes `figure` to `path` (PNG) atomically and closes it."""
  tmp = f"{path}.tmp.png"
  figure.savefig(tmp, dpi=120, bbox_inches="tight")
  plt.close(figure)
  os.replace(tmp, path)


def uncertainty_figure(
  path: str, reliability: dict, entropies: dict[str, np.ndarray], title: str
) -> None:
  """A reliability diagram beside histograms of predictive entropy.

  Args:
    path: the PNG to write.
    reliability: `metrics.reliability_bins` of the in-distribution test set.
    entropies: label -> predictive entropies (nats) of a set of inputs (in-distribution,
      out-of-distribution, shifted), one histogram each.
    title: the figure's title (the run).
  """
  figure, (diagram, histogram) = plt.subplots(1, 2, figsize=(10, 4))
  num_bins = len(reliability["count"])
  edges = np.linspace(0, 1, num_bins + 1)
  accuracy = [np.nan if a is None else a for a in reliability["accuracy"]]
  diagram.bar(
    edges[:-1], accuracy, width=1 / num_bins, align="edge", edgecolor="black", label="accuracy"
  )
  diagram.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
  diagram.set(
    xlabel="confidence (top-class probability)",
    ylabel="accuracy",
    xlim=(0, 1),
    ylim=(0, 1),
    title="reliability (in-distribution test)",
  )
  diagram.legend(loc="upper left")
  top = max((e.max() for e in entropies.values() if len(e)), default=1.0)
  for label, values in entropies.items():
    histogram.hist(
      values, bins=30, range=(0, top), density=True, alpha=0.5, label=f"{label} ({len(values)})"
    )
  histogram.set(xlabel="predictive entropy (nats)", ylabel="density", title="predictive entropy")
  histogram.legend()
  figure.suptitle(title)
  save_figure(figure, path)
