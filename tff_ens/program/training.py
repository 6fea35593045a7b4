"""The training loop shared by every algorithm: sample, train, evaluate, save.

Everything a run needs to continue lives in the checkpointed process state;
client sampling and data shuffling are pure functions of `(seed, round)`
(`simulation`), so a resumed run samples the same clients and ends in the same
state as an uninterrupted one.

Outputs in `output_dir` (`run_outputs`, `reporting`; names in `run_files`):
`config.json`, `metrics.csv` (one row per round), TensorBoard events under
`tensorboard/`, checkpoints under `checkpoints/`, FedDyn's client states under
`client_states/` (`client_states.ClientStateStore`, rewound to the checkpoint
on resume), the final model(s) in Keras format and `summary.json`.
"""

import contextlib
import functools
import logging
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import tensorflow as tf

from tff_ens import algorithms
from tff_ens.execution import runtime
from tff_ens.execution import worker_process
from tff_ens.program import active_learning
from tff_ens.program import client_states
from tff_ens.program import device_clients
from tff_ens.program import experiment
from tff_ens.program import reporting
from tff_ens.program import run_outputs
from tff_ens.program import simulation
from tff_ens.server import server_data as server_data_lib
from tff_ens.templates import privacy


@contextlib.contextmanager
def _stop_on_sigterm():
  """Yields an event that SIGTERM sets instead of killing the process.

  The loop finishes the round in flight, checkpoints it and raises `Stopped`
  (a scheduler's SIGTERM, e.g. on preemption, ends the run resumable). Only
  the main thread can handle signals; elsewhere SIGTERM keeps its default.
  """
  requested = threading.Event()
  if threading.current_thread() is not threading.main_thread():
    yield requested
    return
  previous = signal.signal(signal.SIGTERM, lambda *_: requested.set())
  try:
    yield requested
  finally:
    signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _execution_context(config: experiment.ExperimentConfig):
  """The run's TFF context: a local worker, or the workers of --workers."""
  workers = config.worker_addresses()
  with contextlib.ExitStack() as stack:
    try:
      stack.enter_context(
        runtime.execution_context(
          workers=workers, max_concurrent_computation_calls=config.max_concurrent_clients
        )
      )
    except worker_process.WorkerError as e:
      if not workers:
        raise
      raise experiment.UsageError(
        f"--workers={config.workers}: {e} Start it there with `python -m "
        "tff_ens.worker --port=PORT`, or fix the address"
      ) from None
    yield


def run_experiment(config: experiment.ExperimentConfig) -> dict:
  """Runs (or resumes) one experiment and returns its summary.

  Raises:
    UsageError: for a bad flag or output directory.
    worker_process.WorkerError: if a TFF worker dies or stops answering during the
      run; the message says from which round `--resume` continues.
  """
  config.validate()
  task = config.task_module()
  data = task.load_data(config.data_dir, partition=config.partition_config(), seed=config.seed)
  train_ids = data.train.client_ids
  if config.clients_per_round > len(train_ids):
    raise experiment.UsageError(
      f"--clients_per_round={config.clients_per_round} exceeds the "
      f"{len(train_ids)} training writers in the data: use at most "
      f"{len(train_ids)}"
    )
  server_data = server_config = None
  if config.algorithm in algorithms.SERVER_DATA_ALGORITHMS or config.recalibrate_batch_norm:
    server_data = server_data_lib.server_split(
      data, task, seed=config.seed, unlabeled_path=config.server_data
    )
    logging.info(
      "server data: %d unlabeled (%s), %d validation",
      len(server_data.unlabeled),
      server_data.source,
      len(server_data.validation_y),
    )
  if config.algorithm in algorithms.SERVER_DATA_ALGORITHMS:
    server_config = config.server_distillation_config()
  tf.keras.utils.set_random_seed(config.seed)
  # Member k of an ensemble starts from its own seed; k = 0 for one model.
  model_fn = lambda k=0: task.build_model(
    config.model, seed=config.seed + 1009 * k, norm=config.norm
  )
  recalibration_images = _recalibration_images(config, model_fn, server_data)
  with _execution_context(config):
    algorithm = algorithms.build_algorithm(
      config.algorithm,
      model_fn,
      simulation.batch_element_spec(task),
      config.local_training_config(),
      proximal_mu=config.proximal_mu,
      local_objective=config.local_objective,
      feddyn_alpha=config.feddyn_alpha,
      num_clients=len(train_ids),
      server_learning_rate=config.server_lr,
      server_momentum=config.server_momentum,
      server_epsilon=config.server_epsilon,
      ensemble_size=config.ensemble_size,
      assignment=config.assignment,
      member_average=config.member_average,
      seed=config.seed,
      distill_fedppd_teachers=config.distill_fedppd_teachers,
      server_data=server_data,
      server_config=server_config,
      clients_per_round=config.clients_per_round,
      student_fn=lambda: task.build_model(
        config.resolved_student_model(), seed=config.seed + 7919, norm=config.norm
      ),
      posterior_config=(
        config.posterior_config() if config.algorithm in algorithms.FEDPPD_METHODS else None
      ),
      dp=config.dp_config(),
      on_device=config.client_runtime == "litert",
      recalibration_images=recalibration_images,
      prototypes=[
        (
          name,
          functools.partial(task.build_model, name, seed=config.seed + 1009 * p, norm=config.norm),
        )
        for p, name in enumerate(config.prototype_names())
      ],
    )
    state = algorithm.process.initialize()
    outputs = run_outputs.RunOutputs(config, state)
    try:
      return _train(
        config,
        data,
        algorithm,
        state,
        outputs,
        reporting.Evaluator(algorithm.evaluation_model_fn or model_fn),
      )
    except worker_process.WorkerError as e:
      raise worker_process.WorkerError(f"{e} {outputs.resume_hint()}") from None
    finally:
      outputs.close()


def _train(config, data, algorithm, state, outputs, evaluator) -> dict:
  """The round loop of `run_experiment`, from the checkpoint `--resume` continues from."""
  start_round, state = _resumed(config, outputs, state)
  teacher_test = None
  active = config.active_learning_config()
  sizes = {c: data.train.num_examples(c) for c in data.train.client_ids}
  pool = active_learning.pool_at_round(active, config.seed, sizes, outputs.dir, start_round)
  train = active_learning.labeled(data.train, pool, sizes)
  # Labeled examples per client, for the simulated finishing times.
  train_sizes = np.array([len(train.y[c]) for c in train.client_ids])
  augmentation = config.task_module().TRAIN_AUGMENTATION
  num_clients = len(data.train.client_ids)
  dp_epsilons = _dp_epsilons(config, num_clients)
  speeds = simulation.client_speeds(num_clients, config.seed)
  store = _client_state_store(algorithm, outputs.dir, start_round)
  # The distributor's state, which says which model each client trains in the next round.
  key_state = state["distributor"] if algorithm.client_models is not None else None
  # The state waits on the TFF worker between rounds; `held.value` downloads
  # it for evaluation and checkpoints.
  held = runtime.ResidentState(algorithm.process.next, state)
  with (
    reporting.progress(config, start_round) as report,
    _stop_on_sigterm() as stop_requested,
    _devices(config, outputs) as devices,
  ):
    for round_num in range(start_round + 1, config.rounds + 1):
      start = time.perf_counter()
      plan = simulation.plan_round(config, train_sizes, speeds, round_num)
      if devices is not None:
        reports, datasets = _train_on_devices(
          devices, config, train, plan, held, algorithm, key_state
        )
      else:
        reports, datasets = plan.reports, _client_datasets(config, train, plan, augmentation)
      row = {
        "clients_used": float(len(datasets)),
        "stragglers": float(np.sum(reports & (plan.work < 1.0))),
        "late_clients": float(np.sum(plan.late)),
      }
      if datasets:
        cohort = plan.cohort[reports]
        measured, curves, key_state = _next_round(
          held, algorithm, store, datasets, cohort, round_num, key_state
        )
        row.update(measured)
        outputs.release_curves(round_num, curves)
      # else: every sampled client dropped out; no model changes this round.
      if dp_epsilons is not None:
        row["dp_epsilon"] = float(dp_epsilons[round_num - 1])
      row["seconds"] = time.perf_counter() - start
      last = round_num == config.rounds
      phase_end = pool is not None and round_num in active.phase_ends()
      if round_num % config.eval_every == 0 or last or phase_end:
        row.update(evaluator.summary(algorithm.models_fn(held.value), data.test))
        if datasets and algorithm.teacher_fn is not None:
          predictions = _teacher_predictions(data, algorithm, every_split=last)
          row.update(reporting.teacher_round_accuracies(data, predictions))
          if last:
            teacher_test = predictions
      if phase_end:
        train = _end_phase(config, data, algorithm, held, evaluator, pool, train, row, round_num)
        train_sizes = np.array([len(train.y[c]) for c in train.client_ids])
        # The pool is saved before the checkpoint of this round: a run killed
        # in between resumes from an earlier checkpoint and rewinds the pool.
        pool.save(outputs.dir)
      outputs.release_metrics(round_num, row)
      stopping = stop_requested.is_set()
      if round_num % config.checkpoint_every == 0 or last or phase_end or stopping:
        outputs.save_checkpoint(round_num, held.value)
        if store is not None:
          store.prune(round_num)
      report(round_num, row)
      if stopping and not last:
        raise experiment.Stopped(
          f"stopped by SIGTERM after round {round_num}, which is "
          f"checkpointed in {outputs.dir}: continue with --resume"
        )
  return reporting.write_summary(
    config, data, algorithm, held.value, outputs, evaluator, teacher_test, pool
  )


def _resumed(config, outputs, state) -> tuple[int, Any]:
  """(round, state) the run starts from: its last checkpoint with --resume, else (0, state)."""
  if config.resume:
    checkpoint = outputs.latest_checkpoint()
    if checkpoint is not None:
      logging.info("resuming from round %d", checkpoint[0])
      return checkpoint
  return 0, state


def _dp_epsilons(config, num_clients: int) -> np.ndarray | None:
  """With DP noise, the epsilon spent after each round (for metrics.csv); else None."""
  if not config.dp_noise_multiplier:
    return None
  return privacy.epsilons(
    config.dp_noise_multiplier,
    config.clients_per_round,
    num_clients,
    config.rounds,
    config.dp_delta(num_clients),
  )


def _client_state_store(algorithm, output_dir: str, start_round: int):
  """FedDyn's clients' own states as of `start_round` (a `ClientStateStore`), else None."""
  if algorithm.client_state is None:
    return None
  store = client_states.ClientStateStore(
    os.path.join(output_dir, client_states.DIRECTORY), algorithm.client_state
  )
  store.rewind(start_round)
  return store


def _client_datasets(config, train, plan, augmentation) -> list:
  """The reporting clients' local datasets of the round (`simulation.client_dataset`)."""
  reports = plan.reports
  return [
    simulation.client_dataset(
      train.x[train.client_ids[i]],
      train.y[train.client_ids[i]],
      epochs=config.client_epochs,
      batch_size=config.batch_size,
      seed=int(s),
      augmentation=augmentation,
      work=w,
      poisoned=p,
    )
    for i, s, w, p in zip(
      plan.cohort[reports], plan.seeds[reports], plan.work[reports], plan.poisoned[reports]
    )
  ]


def _teacher_predictions(data, algorithm, every_split: bool):
  """The last round's teacher ensemble on the test split (`teachers_test_accuracy`) or on
  every evaluation split, the test split's first (`ensemble_test_accuracy` and the
  teachers' uncertainty)."""
  splits = reporting.evaluation_splits(data).values() if every_split else [data.test]
  return algorithm.teacher_fn(np.concatenate([s.concatenated()[0] for s in splits]))


def _next_round(held, algorithm, store, datasets, cohort, round_num, key_state):
  """Runs the round on the reporting clients' datasets; returns the metrics.csv keys it
  measured, the server step's learning curves (its measurements that are arrays) and the
  distributor's key state for the next round (`key_state` stays when it reports none)."""
  if store is None:
    round_metrics = held.next(*algorithm.next_args(datasets, cohort))
  else:
    models = algorithm.client_models(cohort, key_state)
    round_metrics, new_states = held.next(
      *algorithm.next_args(
        datasets, cohort, [store.load(int(c), m) for c, m in zip(cohort, models)]
      )
    )
    for c, m, client_state in zip(cohort, models, new_states):
      store.save(round_num, int(c), m, client_state)
  # train_loss, train_accuracy, num_examples, rejected_updates (and
  # FedPPD's student_loss).
  row = {k: float(v) for k, v in round_metrics["client_work"].items()}
  server = round_metrics.get("finalizer")
  curves = {}
  if isinstance(server, dict):  # FedAvg's finalizer measures nothing.
    for k, v in server.items():
      if np.ndim(v):
        curves[k] = np.asarray(v).tolist()
      else:
        row[k] = float(v)
  row.update(privacy.aggregator_metrics(round_metrics.get("aggregator")))
  if key_state is not None:
    key_state = round_metrics["distributor"]
  return row, curves, key_state


def _end_phase(config, data, algorithm, held, evaluator, pool, train, row, round_num):
  """The end of an active-learning phase: records the learning curve and, unless the run
  ends, annotates each client's most uncertain examples (`row` gets `labeled_examples` and
  `annotated`); the training split labeled from then on."""
  active = config.active_learning_config()
  sizes = {c: data.train.num_examples(c) for c in data.train.client_ids}
  row["labeled_examples"] = float(train.num_examples())
  pool.curve.append(
    {"round": round_num, "labeled": train.num_examples(), "test_accuracy": row["test_accuracy"]}
  )
  if round_num == config.rounds:
    return train
  probs = evaluator.member_probabilities(algorithm.models_fn(held.value), data.train)
  row["annotated"] = float(
    pool.acquire(round_num, {c: p.mean(0) for c, p in probs.items()}, sizes, active, config.seed)
  )
  return active_learning.labeled(data.train, pool, sizes)


def _recalibration_images(config, model_fn, server_data) -> np.ndarray | None:
  """The server images of `--recalibrate_batch_norm` (a seeded draw), or None."""
  if not config.recalibrate_batch_norm:
    return None
  with tf.Graph().as_default():
    layers = model_fn(0).submodules
  if not any(isinstance(layer, tf.keras.layers.BatchNormalization) for layer in layers):
    raise experiment.UsageError(
      f"--recalibrate_batch_norm: --model={config.model} --norm={config.norm} has no batch "
      "norm to recalibrate: drop the flag, or use a ResNet with --norm=batch"
    )
  unlabeled = server_data.unlabeled
  if config.recalibrate_batch_norm > len(unlabeled):
    raise experiment.UsageError(
      f"--recalibrate_batch_norm={config.recalibrate_batch_norm} exceeds the server's "
      f"{len(unlabeled)} unlabeled images ({server_data.source}): use at most {len(unlabeled)}"
    )
  rng = np.random.default_rng(config.seed)
  return unlabeled[rng.choice(len(unlabeled), config.recalibrate_batch_norm, replace=False)]


def _train_on_devices(devices, config, train, plan, held, algorithm, key_state):
  """The round's reporting clients trained on devices (`device_clients`), each from the
  model it is assigned: the reports left after device failures, and their results as the
  clients' datasets."""
  models = [[np.asarray(w) for w in m.trainable] for m in algorithm.models_fn(held.value)]
  clients = np.flatnonzero(plan.reports)
  names = [train.client_ids[plan.cohort[k]] for k in clients]
  assigned = (
    algorithm.client_models(plan.cohort[clients], key_state)
    if algorithm.client_models is not None
    else [0] * len(clients)
  )
  requests = []
  for k, name, model in zip(clients, names, assigned):
    x = train.x[name]
    requests.append(
      {
        "x": np.full_like(x, np.nan) if plan.poisoned[k] else x,
        "y": train.y[name],
        "order": simulation.client_order(
          len(x),
          epochs=config.client_epochs,
          batch_size=config.batch_size,
          seed=int(plan.seeds[k]),
          work=float(plan.work[k]),
        ),
        "batch_size": config.batch_size,
        "model": model,
      }
    )
  results = devices.train(models, requests, names)
  reports = plan.reports.copy()
  reports[clients[[r is None for r in results]]] = False
  return reports, [device_clients.result_dataset(*r) for r in results if r is not None]


@contextlib.contextmanager
def _devices(config, outputs):
  """The run's `device_clients.DevicePool` with `--client_runtime=litert`, else None."""
  if config.client_runtime != "litert":
    yield None
    return
  pool = device_clients.DevicePool(outputs.write_trainable_file(), config.device_processes)
  try:
    yield pool
  finally:
    pool.close()
