"""What `export.evaluate` compares a file against, in the main environment (TensorFlow):
the run's task data (any task and source) and its Keras model(s)' predictions on the
file's inputs, computed as the run's summary was (`tff_ens.math.evaluation`,
`tff_ens.math.personalization`)."""

import numpy as np

from export import ExportError
import tasks

# Replaces the default TFF context that importing TFF (through tasks) installs, whose
# clean-up at interpreter exit fails once tensorflow-datasets is imported too.
from tff_ens.execution import runtime  # noqa: F401
from tff_ens.math import ensemble_math
from tff_ens.math import evaluation
from tff_ens.math import metrics
from tff_ens.math import personalization


def load_data(run, data_dir: str | None):
  """The run's data (`FederatedData`) from `data_dir`, else the run's, by its task, split as
  the run split it (`runs.Run.data_options`)."""
  try:
    return run.task.load_data(data_dir or run.config.get("data_dir"), **run.data_options(run.task))
  except tasks.DataError as e:
    raise ExportError(str(e)) from None


def _member_probabilities(models, split) -> dict[str, np.ndarray]:
  """client -> [K, n, classes] probabilities of the K models."""
  x, _ = split.concatenated()
  stacked = np.stack([evaluation.predict_probabilities(m, x) for m in models], axis=1)
  counts = [split.num_examples(c) for c in split.client_ids]
  return {
    c: np.moveaxis(p, 1, 0)
    for c, p in zip(split.client_ids, metrics.split_by_client(stacked, counts))
  }


def classes(models, test) -> dict[str, np.ndarray]:
  """client -> the single model's predicted classes on its test inputs."""
  return {c: p[0].argmax(-1) for c, p in _member_probabilities(models, test).items()}


def ensemble_classes(models, train, test, writers, temperature: float) -> tuple[dict, dict]:
  """(personalized, uniform) client -> predicted classes of the ensemble on the test inputs
  of `writers` (clients), alpha from each one's training examples at `temperature`."""
  member_train = _member_probabilities(models, train)
  member_test = _member_probabilities(models, test)
  personalized, uniform = {}, {}
  for c in writers:
    alpha = personalization.personalization_weights(
      ensemble_math.member_losses(member_train[c], train.y[c]), temperature
    )
    personalized[c] = ensemble_math.mixture(member_test[c], alpha).argmax(-1)
    uniform[c] = member_test[c].mean(0).argmax(-1)
  return personalized, uniform


def uncertainty(models, x: np.ndarray) -> dict[str, np.ndarray]:
  """The models' `predictive_uncertainty` on `x`, as the run's summary computes it."""
  return metrics.predictive_uncertainty(
    np.stack([evaluation.predict_probabilities(m, x) for m in models])
  )
