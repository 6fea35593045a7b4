"""Clients with a model of their own (`ClientStates.model`, built from the state each keeps):
their summary keys, and their models saved for export (`run_files.CLIENTS_DIR`)."""

import os

from tff_ens import run_files
from tff_ens.algorithms import algorithm
from tff_ens.math import evaluation
from tff_ens.math import metrics


def summary(states: algorithm.ClientStates):
  """The `FederatedAlgorithm.summary` hook of clients whose own model is `states.model`.

  Each training writer's own model on its own test examples, saved as
  `clients/<writer>.keras` (for `python -m export --client=WRITER`); a writer that never
  trained has none and is predicted by the global model. Keys:
  `run_files.PERSONALIZED_PER_CLIENT` (each writer's accuracy), `personalized_test_accuracy`
  and `personalized_test_loss` (over the examples), `clients_with_own_model` and
  `clients_without_own_model`.
  """

  def own_models(finished: algorithm.FinishedRun) -> dict:
    data, models = finished.data, finished.models
    model = finished.evaluator(None).model
    index = {c: i for i, c in enumerate(data.train.client_ids)}
    probabilities, own = {}, 0
    for c in data.test.client_ids:
      weights = models[0]
      state = finished.client_state(index[c]) if c in index else None
      if state is not None:
        weights = states.model(state, models)
        own += 1
        finished.save_model(os.path.join(run_files.CLIENTS_DIR, f"{c}.keras"), model, weights)
      evaluation.assign_weights(model, weights)
      probabilities[c] = evaluation.predict_probabilities(model, data.test.x[c])
    pooled = metrics.classification_summary(probabilities, data.test.y, "personalized_test")
    accuracies = {
      c: metrics.accuracy(probabilities[c], data.test.y[c])
      for c in probabilities
      if len(data.test.y[c])
    }
    return {
      run_files.PERSONALIZED_PER_CLIENT: accuracies,
      "personalized_test_accuracy": pooled["personalized_test_accuracy"],
      "personalized_test_loss": pooled["personalized_test_loss"],
      "clients_with_own_model": own,
      "clients_without_own_model": len(data.test.client_ids) - own,
    }

  return own_models
