"""What a run reports: evaluation of its model(s), progress lines and `summary.json`.

`Evaluator` predicts with the process' model(s) on a task split; `progress` reports each
round on a terminal or in the log; `write_summary` evaluates the final model(s), saves them
and writes `summary.json`, `per_client_accuracy.json` and, for personalized models,
`personalized_per_client_accuracy.json`, with the keys of uncertainty, privacy and the
algorithm's own (`FederatedAlgorithm.summary`).
"""

import contextlib
import logging
import os
import statistics
import sys

import numpy as np

from tff_ens import run_files
from tff_ens.algorithms import algorithm as algorithm_lib
from tff_ens.math import ensemble_math
from tff_ens.math import evaluation
from tff_ens.math import metrics
from tff_ens.math import personalization
from tff_ens.program import plots
from tff_ens.program import run_outputs
from tff_ens.program import run_settings
from tff_ens.templates import privacy

# Examples an evaluation predicts at once (`Evaluator.member_probabilities`): FEMNIST's
# slice's test split (1,685) in one group.
PREDICTED_AT_ONCE = 16_384


def _client_groups(split, examples: int) -> list[list[str]]:
  """The split's clients in order, in consecutive groups of at most `examples` examples
  (a larger client alone)."""
  groups, size = [[]], 0
  for c in split.client_ids:
    n = split.num_examples(c)
    if groups[-1] and size + n > examples:
      groups.append([])
      size = 0
    groups[-1].append(c)
    size += n
  return groups if groups[-1] else []


class Evaluator:
  """Evaluates the process' model(s) on a task split with one Keras model."""

  def __init__(self, model_fn):
    self.model = model_fn()

  def member_probabilities(self, models: list, split) -> dict[str, np.ndarray]:
    """{client: [K, n, classes]} for the K models on each client's examples, predicted a
    group of clients of about `PREDICTED_AT_ONCE` examples at a time (a split read from
    disk is then never in memory whole)."""
    probabilities = {}
    for clients in _client_groups(split, PREDICTED_AT_ONCE):
      x = np.concatenate([split.x[c] for c in clients])
      counts = [split.num_examples(c) for c in clients]
      member_probs = []
      for weights in models:
        evaluation.assign_weights(self.model, weights)
        member_probs.append(evaluation.predict_probabilities(self.model, x))
      stacked = np.stack(member_probs, axis=1)  # [n, K, classes]
      for c, p in zip(clients, metrics.split_by_client(stacked, counts)):
        probabilities[c] = np.moveaxis(p, 1, 0)
    return probabilities

  def summary(
    self, models: list, split, prefix: str = "test", member_probs: dict | None = None
  ) -> dict:
    """Metrics of the uniform average of `models` on `split`."""
    member_probs = member_probs or self.member_probabilities(models, split)
    probs = {c: p.mean(0) for c, p in member_probs.items()}
    return metrics.classification_summary(probs, split.y, prefix)

  def ensemble_summary(
    self, models: list, data, member_test: dict, config: run_settings.Evaluation
  ) -> dict:
    """Fed-ensemble's metrics: members, personalized weights, uncertainty."""
    clients = [c for c in data.test.client_ids if c in data.train.x]
    temperature = config.personalization_temperature
    # tau is chosen on every training client's examples; a given tau needs only the
    # evaluated clients' (the same subsamples: each is drawn by its client).
    weighting = data.train.subset(clients) if temperature else data.train
    train = personalization.weighting_examples(
      weighting, config.personalization_samples, config.seed
    )
    member_train = self.member_probabilities(models, train)
    if not temperature:
      temperature = personalization.choose_temperature(member_train, train.y, seed=config.seed)
    all_members = np.concatenate([member_test[c] for c in clients], axis=1)
    y = np.concatenate([data.test.y[c] for c in clients])
    personalized, personalized_nll = {}, []
    for c in clients:
      alpha = personalization.personalization_weights(
        ensemble_math.member_losses(member_train[c], train.y[c]), temperature
      )
      probs = ensemble_math.mixture(member_test[c], alpha)
      personalized[c] = metrics.accuracy(probs, data.test.y[c])
      personalized_nll.append(metrics.negative_log_likelihood(probs, data.test.y[c]))
    uncertainty = metrics.ensemble_uncertainty(all_members)
    wrong = uncertainty["probabilities"].argmax(-1) != y
    return {
      "ensemble_size": len(models),
      "member_test_accuracy": [metrics.accuracy(p, y) for p in all_members],
      run_files.PERSONALIZED_PER_CLIENT: personalized,
      "personalized_test_loss": float(np.mean(personalized_nll)),
      "personalization_temperature": temperature,
      "entropy_error_auroc": metrics.auroc(uncertainty["entropy"], wrong),
      "mean_mutual_information": float(uncertainty["mutual_information"].mean()),
    }


# The metrics a terminal's evaluation line shows.
EVALUATION_KEYS = ("test_accuracy", "test_loss", "ece", "per_client_accuracy")


@contextlib.contextmanager
def progress(rounds: int, start_round: int):
  """A tqdm bar of `rounds` on a terminal; plain log lines otherwise."""
  if sys.stderr.isatty():
    from tqdm import tqdm

    bar = tqdm(total=rounds, initial=start_round, unit="round", dynamic_ncols=True)
    last = {}  # The latest value of each shown metric.

    def report(round_num, row):
      last.update({k: f"{row[k]:.4f}" for k in ("train_loss", "test_accuracy") if k in row})
      if "test_accuracy" in row:  # One line per evaluation, above the bar.
        bar.write(
          f"round {round_num}: "
          + " ".join(f"{k}={row[k]:.4f}" for k in EVALUATION_KEYS if k in row)
        )
      bar.set_postfix(last, refresh=False)
      bar.update(1)

    try:
      yield report
    finally:
      bar.close()
  else:
    yield lambda r, row: logging.info(
      "round %d/%d %s",
      r,
      rounds,
      " ".join(f"{k}={v:.4f}" for k, v in row.items() if isinstance(v, float)),
    )


def write_summary(run, data, algorithm, outputs, evaluator, trained):
  """The run's summary of its final state (`trained`, a `loop.Trained`): saves the model(s),
  `per_client_accuracy.json` and `summary.json`, and returns the summary: the model(s)'
  metrics, then the algorithm's own keys (`FederatedAlgorithm.summary`).

  `trained.last` is the loop's record of the last round (its teachers and their
  predictions); `trained.store` the clients' own states, if they keep any.
  """
  models, last, pool = trained.models, trained.last, trained.pool
  flags = run.outputs.flags  # What config.json holds, which the summary repeats.
  teacher_test = last.teacher_test
  # Each split predicted once (FEMNIST's shift split is its new clients), the test split
  # by the loop's evaluation of the last round.
  predicted = {} if last.member_test is None else {id(data.test): last.member_test}

  def member_probabilities(split) -> dict[str, np.ndarray]:
    if id(split) not in predicted:
      predicted[id(split)] = evaluator.member_probabilities(models, split)
    return predicted[id(split)]

  member_test = member_probabilities(data.test)
  summary = evaluator.summary(models, data.test, member_probs=member_test)
  if len(models) > 1:
    summary.update(evaluator.ensemble_summary(models, data, member_test, run.evaluation))
  rows = outputs.metrics_rows()
  if run.dp is not None:
    summary.update(privacy_summary(run, rows, len(data.train.client_ids)))
  summary.update(algorithm.summary(_finished_run(data, outputs, evaluator, trained, summary, rows)))
  summary.update(
    uncertainty_summary(run.evaluation.title, data, member_probabilities, outputs.dir, teacher_test)
  )
  new_clients = evaluator.summary(
    models, data.new_clients, prefix="new", member_probs=member_probabilities(data.new_clients)
  )
  down, up = algorithm.bytes_per_client_round()
  seconds = [float(r["seconds"]) for r in rows if r.get("seconds")]
  summary.update(
    task=flags["task"],
    algorithm=flags["algorithm"],
    rounds=run.schedule.rounds,
    seed=run.seed,
    new_client_accuracy=new_clients.get("new_accuracy"),
    bytes_down_per_client_round=down,
    bytes_up_per_client_round=up,
    seconds_per_round=statistics.median(seconds) if seconds else None,
    config=flags,
  )
  if pool is not None:
    summary["active_learning_curve"] = [[p["labeled"], p["test_accuracy"]] for p in pool.curve]
  run_outputs.save_models(outputs.dir, evaluator.model, models)
  run_files.write_json_atomically(
    os.path.join(outputs.dir, run_files.PER_CLIENT_ACCURACY_FILE),
    {c: metrics.accuracy(member_test[c].mean(0), data.test.y[c]) for c in data.test.client_ids},
  )
  if run_files.PERSONALIZED_PER_CLIENT in summary:
    personalized = summary.pop(run_files.PERSONALIZED_PER_CLIENT)
    summary["personalized_accuracy"] = float(np.mean(list(personalized.values())))
    run_files.write_json_atomically(
      os.path.join(outputs.dir, run_files.PERSONALIZED_PER_CLIENT_ACCURACY_FILE), personalized
    )
  run_files.write_json_atomically(os.path.join(outputs.dir, run_files.SUMMARY_FILE), summary)
  return summary


def evaluation_splits(data) -> dict:
  """The splits the final evaluation predicts on: test, and ood and shift when
  the task has them (see `tasks.data.FederatedData`)."""
  splits = {"test": data.test, "ood": data.ood, "shift": data.shift}
  return {
    name: split for name, split in splits.items() if split is not None and split.num_examples()
  }


def uncertainty_summary(title: str, data, member_probabilities, output_dir: str, teacher=None):
  """`metrics.uncertainty_summary` of the run's model(s), whose
  `member_probabilities(split)` are {client: [K, n, classes]}, and of the last
  round's teachers (keys prefixed `teacher_`) for server-distillation
  algorithms; draws `plots.UNCERTAINTY_FIGURE`, headed `title`."""
  splits = evaluation_splits(data)
  members = {}
  for name, split in splits.items():
    probs = member_probabilities(split)
    members[name] = np.concatenate([probs[c] for c in split.client_ids], axis=1)
  predictions = {name: metrics.predictive_uncertainty(p) for name, p in members.items()}
  labels = {name: split.concatenated()[1] for name, split in splits.items()}
  summary = metrics.uncertainty_summary(
    predictions["test"],
    labels["test"],
    predictions.get("ood"),
    predictions.get("shift"),
    labels.get("shift"),
  )
  plots.uncertainty_figure(
    os.path.join(output_dir, plots.UNCERTAINTY_FIGURE),
    summary["reliability"],
    {
      "test (in-distribution)" if name == "test" else name: p["entropy"]
      for name, p in predictions.items()
    },
    title,
  )
  if teacher is not None:
    counts = [splits[name].num_examples() for name in splits]
    teacher_predictions = {}
    for name, probs, mean_entropy in zip(
      splits,
      metrics.split_by_client(teacher["probabilities"], counts),
      metrics.split_by_client(teacher["mean_entropy"], counts),
    ):
      entropy = ensemble_math.entropy(probs)
      teacher_predictions[name] = {
        "probabilities": probs,
        "entropy": entropy,
        "mutual_information": entropy - mean_entropy,
      }
    teachers = metrics.uncertainty_summary(
      teacher_predictions["test"],
      labels["test"],
      teacher_predictions.get("ood"),
      teacher_predictions.get("shift"),
      labels.get("shift"),
    )
    summary.update({f"teacher_{k}": v for k, v in teachers.items()})
  return summary


def privacy_summary(run, rows, num_clients: int) -> dict:
  """DP keys: epsilon at delta after all rounds (None without noise), z, C.

  `dp_clip_norm` is the fixed clip, or the adaptive clip after the last round
  (`dp_clipping` says which).
  """
  dp, schedule = run.dp, run.schedule
  clips = [float(r["dp_clip_norm"]) for r in rows if r.get("dp_clip_norm")]
  noised = dp.noise_multiplier > 0
  delta = dp.delta(num_clients) if noised else None
  return {
    "dp_epsilon": float(
      privacy.epsilons(
        dp.noise_multiplier, schedule.clients_per_round, num_clients, schedule.rounds, delta
      )[-1]
    )
    if noised
    else None,
    "dp_delta": delta,
    "dp_noise_multiplier": dp.noise_multiplier,
    "dp_clip_norm": clips[-1] if dp.adaptive and clips else dp.clip_norm,
    "dp_clipping": "adaptive" if dp.adaptive else "fixed",
  }


def teacher_round_accuracies(data, predictions) -> dict:
  """metrics.csv's view of a round's teachers (`server_step.RoundTeachers.predict`'s
  `predictions` on the test split first): `teachers_test_accuracy` and, where the step
  reports it, `average_test_accuracy` of the clients' weight average."""
  row = {"teachers_test_accuracy": evaluation.test_accuracy(data, predictions["probabilities"])}
  if "average_probabilities" in predictions:
    row["average_test_accuracy"] = evaluation.test_accuracy(
      data, predictions["average_probabilities"]
    )
  return row


def _finished_run(data, outputs, evaluator, trained, summary, rows):
  """What the algorithm's `summary` hook reads of the run (`algorithm.FinishedRun`)."""
  store = trained.store

  def save_model(path, model, weights):
    path = os.path.join(outputs.dir, path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    run_outputs.save_model(path, model, weights)

  def client_state(index):
    return store.load(index, 0) if store is not None and store.stored(index, 0) else None

  return algorithm_lib.FinishedRun(
    state=trained.state,
    models=trained.models,
    data=data,
    summary=dict(summary),
    rows=rows,
    teachers=trained.last.teachers,
    teacher_test=trained.last.teacher_test,
    evaluator=lambda model_fn: evaluator if model_fn is None else Evaluator(model_fn),
    save_model=save_model,
    client_state=client_state,
  )
