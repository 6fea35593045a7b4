"""The round loop shared by every algorithm: sample, train, evaluate, save.

Everything a run needs to continue lives in the checkpointed process state and, for clients
that keep a state between their rounds, in the run's client-state store; client sampling and
data shuffling are pure functions of `(seed, round)` (`simulation`), so a resumed run samples
the same clients and ends in the same state as an uninterrupted one.
"""

import contextlib
import dataclasses
import functools
import os
import time
from typing import Any

import numpy as np

from tff_ens.algorithms import algorithm as algorithm_lib
from tff_ens.execution import client_values
from tff_ens.execution import resident_state
from tff_ens.program import active_learning
from tff_ens.program import browser_clients
from tff_ens.program import client_states as client_states_lib
from tff_ens.program import device_clients
from tff_ens.program import experiment
from tff_ens.program import reporting
from tff_ens.program import run_outputs
from tff_ens.program import simulation
from tff_ens.program import stopping
from tff_ens.templates import privacy


@dataclasses.dataclass
class _Round:
  """What one round leaves for the next and for the end of the run."""

  key_state: Any  # The distributor's state, which says which model each client trains.
  teachers: Any = None  # The last round's teachers (`server_step.RoundTeachers`), or None.
  teacher_test: Any = None  # Their predictions on every evaluation split, at the last round.
  # The last round's model(s)' predictions on the test split
  # (`reporting.Evaluator.member_probabilities`), which the summary reports again.
  member_test: dict | None = None


@dataclasses.dataclass
class Trained:
  """What the loop leaves for the run's summary (`reporting.write_summary`), which needs no
  TFF worker."""

  state: Any  # The final state, in Python.
  models: list  # Its model(s) (`FederatedAlgorithm.models_fn`, which may run on the worker).
  last: _Round
  pool: active_learning.Pool | None
  store: client_states_lib.ClientStateStore | None


def train(
  run: experiment.Run,
  data,
  algorithm: algorithm_lib.FederatedAlgorithm,
  outputs: run_outputs.RunOutputs,
  evaluator: reporting.Evaluator,
) -> Trained:
  """The round loop of `training.run_experiment`, from the round and state `outputs` start
  from (the checkpoint `--resume` continues from)."""
  schedule = run.schedule
  start_round, state = outputs.take_start()
  active = run.active
  sizes = {c: data.train.num_examples(c) for c in data.train.client_ids}
  pool = active_learning.pool_at_round(active, run.seed, sizes, outputs.dir, start_round)
  train_split = active_learning.labeled(data.train, pool, sizes)
  num_clients = len(data.train.client_ids)
  dp_epsilons = _dp_epsilons(run, num_clients)
  speeds = simulation.client_speeds(num_clients, run.seed)
  store = _client_state_store(algorithm, outputs.dir, start_round)
  last = _Round(key_state=state["distributor"] if algorithm.keyed else None)
  # The state waits on the TFF worker between rounds; `held.value` downloads
  # it for evaluation and checkpoints.
  held = resident_state.ResidentState(
    algorithm.process.next, state, max_growth_bytes=schedule.worker_growth_mib * 2**20
  )
  del state  # Held from here on by `held` alone, until the worker has it.
  stopper = stopping.Stopper(schedule.stop_grace_seconds)
  with contextlib.ExitStack() as stack:
    report = stack.enter_context(reporting.progress(schedule.rounds, start_round))
    stack.enter_context(stopper.installed())
    devices = stack.enter_context(_devices(run, outputs))
    for round_num in range(start_round + 1, schedule.rounds + 1):
      try:
        row, curves = _round(
          run, data, algorithm, held, store, devices, train_split, speeds, last, round_num
        )
      except stopping.StopNow as e:
        raise experiment.Stopped(
          f"stopped by {e} in round {round_num}: {outputs.resume_hint()}", e.signum
        ) from None
      if dp_epsilons is not None:
        row["dp_epsilon"] = float(dp_epsilons[round_num - 1])
      is_last = round_num == schedule.rounds
      phase_end = pool is not None and round_num in active.phase_ends()
      if round_num % schedule.eval_every == 0 or is_last or phase_end:
        models = algorithm.models_fn(held.value)
        member_test = evaluator.member_probabilities(models, data.test)
        row.update(evaluator.summary(models, data.test, member_probs=member_test))
        if is_last:
          last.member_test = member_test
        del models, member_test
        if last.teachers is not None and last.teachers.predict is not None and row["clients_used"]:
          predictions = _teacher_predictions(data, last.teachers, every_split=is_last)
          row.update(reporting.teacher_round_accuracies(data, predictions))
          if is_last:
            last.teacher_test = predictions
      with stopper.writing():
        if curves is not None:
          outputs.release_curves(round_num, curves)
        if phase_end:
          train_split = _end_phase(
            run, data, algorithm, held, evaluator, pool, train_split, row, round_num
          )
          # The pool is saved before the checkpoint of this round: a run killed
          # in between resumes from an earlier checkpoint and rewinds the pool.
          pool.save(outputs.dir)
        outputs.release_metrics(round_num, row)
        stop = stopper.requested
        if round_num % schedule.checkpoint_every == 0 or is_last or phase_end or stop:
          outputs.save_checkpoint(round_num, held.value)
          if store is not None:
            store.prune(outputs.checkpoint_rounds())
      report(round_num, row)
      if stop and not is_last:
        raise experiment.Stopped(
          f"stopped by {stopper.signal_name} after round {round_num}, which is checkpointed in "
          f"{outputs.dir}: continue with --resume",
          stopper.signum,
        )
  return Trained(held.value, algorithm.models_fn(held.value), last, pool, store)


def _round(run, data, algorithm, held, store, devices, train_split, speeds, last, round_num):
  """Plans, trains and measures round `round_num`: its metrics.csv row and the server step's
  learning curves (None if no client reported)."""
  seed, clients = run.seed, run.clients
  start = time.perf_counter()
  train_sizes = np.array([len(train_split.y[c]) for c in train_split.client_ids])
  cohort = algorithm.cohort(
    len(train_sizes),
    seed,
    round_num,
    lambda: simulation.sample_clients(
      len(train_sizes), run.schedule.clients_per_round, seed, round_num
    ),
  )
  plan = simulation.plan_round(
    cohort,
    train_sizes,
    speeds,
    round_num,
    seed=seed,
    epochs=clients.epochs,
    batch_size=clients.batch_size,
    dropout_rate=clients.dropout_rate,
    straggler_rate=clients.straggler_rate,
    aggregate_first=clients.aggregate_first,
    nan_clients=clients.nan_clients,
    max_steps=clients.max_steps,
  )
  if devices is not None:
    reports, datasets = _train_on_devices(
      devices, clients, train_split, plan, held, algorithm, last.key_state
    )
  else:
    reports = plan.reports
    datasets = _client_datasets(clients, train_split, plan, run.task, algorithm)
  row = {
    "clients_used": float(len(datasets)),
    "stragglers": float(np.sum(reports & (plan.work < 1.0))),
    "late_clients": float(np.sum(plan.late)),
  }
  curves = None
  if datasets:
    slots = np.flatnonzero(reports)
    measured, curves = _next_round(
      held, algorithm, store, datasets, plan.cohort[slots], slots, round_num, last
    )
    row.update(measured)
  # else: every sampled client dropped out; no model changes this round.
  row["seconds"] = time.perf_counter() - start
  return row, curves


def _dp_epsilons(run, num_clients: int) -> np.ndarray | None:
  """With DP noise, the epsilon spent after each round (for metrics.csv); else None."""
  if run.dp is None or not run.dp.noise_multiplier:
    return None
  return privacy.epsilons(
    run.dp.noise_multiplier,
    run.schedule.clients_per_round,
    num_clients,
    run.schedule.rounds,
    run.dp.delta(num_clients),
  )


def _client_state_store(algorithm, output_dir: str, start_round: int):
  """The clients' own states as of `start_round` (a `ClientStateStore`), else None."""
  if algorithm.client_states is None:
    return None
  store = client_states_lib.ClientStateStore(
    os.path.join(output_dir, client_states_lib.DIRECTORY), algorithm.client_states
  )
  store.rewind(start_round)
  return store


def _client_datasets(clients, train, plan, task, algorithm) -> client_values.ClientValues:
  """The reporting clients' local datasets of the round (`simulation.client_dataset`, as
  the algorithm's `client_data` takes them), their inputs as the task's models take them
  (`INPUT_DTYPE`), each made when TFF sends its chunk (`client_values`)."""
  reports = plan.reports
  chosen = list(
    zip(plan.cohort[reports], plan.seeds[reports], plan.work[reports], plan.poisoned[reports])
  )

  def dataset(k: int):
    i, s, w, p = chosen[k]
    return algorithm.client_data(
      int(i),
      np.asarray(train.x[train.client_ids[i]], task.INPUT_DTYPE),
      train.y[train.client_ids[i]],
      functools.partial(
        simulation.client_dataset,
        epochs=clients.epochs,
        batch_size=clients.batch_size,
        seed=int(s),
        augmentation=task.TRAIN_AUGMENTATION,
        work=w,
        poisoned=p,
        max_steps=clients.max_steps,
      ),
    )

  return client_values.ClientValues(dataset, range(len(chosen)))


def _teacher_predictions(data, teachers, every_split: bool):
  """The last round's teacher ensemble on the test split (`teachers_test_accuracy`) or on
  every evaluation split, the test split's first (`ensemble_test_accuracy` and the
  teachers' uncertainty)."""
  splits = reporting.evaluation_splits(data).values() if every_split else [data.test]
  return teachers.predict(np.concatenate([s.concatenated()[0] for s in splits]))


def _next_round(held, algorithm, store, datasets, cohort, slots, round_num, last):
  """Runs the round on the reporting clients' datasets; returns the metrics.csv keys it
  measured and the server step's learning curves (its measurements that are arrays), and
  keeps in `last` the distributor's key state for the next round and the round's teachers."""
  states = keys = None
  if store is not None:
    keys = algorithm.client_states.keys_of(cohort, last.key_state)
    states = store.round_inputs(round_num, cohort, keys)
  result = algorithm.result(held.next(*algorithm.next_args(datasets, cohort, slots, states)))
  if store is not None:
    store.round_outputs(round_num, cohort, keys, result.client_states)
  metrics = result.metrics
  # train_loss, train_accuracy, num_examples, rejected_updates (and
  # FedPPD's student_loss).
  row = {k: float(v) for k, v in metrics["client_work"].items()}
  server = metrics.get("finalizer")
  curves = {}
  if isinstance(server, dict):  # FedAvg's finalizer measures nothing.
    for k, v in server.items():
      if np.ndim(v):
        curves[k] = np.asarray(v).tolist()
      else:
        row[k] = float(v)
  row.update(privacy.aggregator_metrics(metrics.get("aggregator")))
  if last.key_state is not None:
    last.key_state = metrics["distributor"]
  last.teachers = result.output
  return row, curves


def _end_phase(run, data, algorithm, held, evaluator, pool, train, row, round_num):
  """The end of an active-learning phase: records the learning curve and, unless the run
  ends, annotates each client's most uncertain examples (`row` gets `labeled_examples` and
  `annotated`); the training split labeled from then on."""
  sizes = {c: data.train.num_examples(c) for c in data.train.client_ids}
  row["labeled_examples"] = float(train.num_examples())
  pool.curve.append(
    {"round": round_num, "labeled": train.num_examples(), "test_accuracy": row["test_accuracy"]}
  )
  if round_num == run.schedule.rounds:
    return train
  probs = evaluator.member_probabilities(algorithm.models_fn(held.value), data.train)
  row["annotated"] = float(
    pool.acquire(round_num, {c: p.mean(0) for c, p in probs.items()}, sizes, run.active, run.seed)
  )
  return active_learning.labeled(data.train, pool, sizes)


def _train_on_devices(devices, rounds, train, plan, held, algorithm, key_state):
  """The round's reporting clients trained on devices (`device_clients`), each from the
  model it is assigned, as `rounds` (`run_settings.ClientRounds`) says: the reports left
  after device failures, and their results as the clients' datasets."""
  models = [[np.asarray(w) for w in m.trainable] for m in algorithm.models_fn(held.value)]
  clients = np.flatnonzero(plan.reports)
  names = [train.client_ids[plan.cohort[k]] for k in clients]
  assigned = algorithm.models_assigned(plan.cohort[clients], key_state)
  requests = []
  for k, name, model in zip(clients, names, assigned):
    x = train.x[name]
    requests.append(
      {
        "x": np.full_like(x, np.nan) if plan.poisoned[k] else x,
        "y": train.y[name],
        "order": simulation.client_order(
          len(x),
          epochs=rounds.epochs,
          batch_size=rounds.batch_size,
          seed=int(plan.seeds[k]),
          work=float(plan.work[k]),
          max_steps=rounds.max_steps,
        ),
        "batch_size": rounds.batch_size,
        "model": model,
      }
    )
  results = devices.train(models, requests, names)
  reports = plan.reports.copy()
  reports[clients[[r is None for r in results]]] = False
  return reports, [device_clients.result_dataset(*r) for r in results if r is not None]


@contextlib.contextmanager
def _devices(run, outputs):
  """The run's `device_clients.DevicePool` with `--client_runtime=litert`, its
  `browser_clients.BrowserPool` with `--client_runtime=browser`, else None."""
  devices = run.devices
  if devices is None:
    yield None
    return
  if devices.in_browsers:  # LiteRT.js runs a fixed batch.
    path = device_clients.write_trainable_file(run, outputs.dir, run.clients.batch_size)
    pool = browser_clients.BrowserPool(
      path, devices.processes, devices.browser_clients, devices.task_seconds
    )
  else:
    path = device_clients.write_trainable_file(run, outputs.dir)
    pool = device_clients.DevicePool(path, devices.processes)
  try:
    yield pool
  finally:
    pool.close()
