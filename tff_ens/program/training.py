"""A whole run: its settings resolved once, its data, its algorithm built, then the round loop.

Outputs in `output_dir` (`run_outputs`, `reporting`; names in `run_files`): `config.json`,
`metrics.csv` (one row per round), TensorBoard events under `tensorboard/`, checkpoints
under `checkpoints/`, the clients' own states under `client_states/` for algorithms whose
clients keep one (`client_states.ClientStateStore`, rewound to the checkpoint on resume), the
final model(s) in Keras format and `summary.json`.
"""

import contextlib
import logging

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import algorithms
from tff_ens.algorithms import algorithm as algorithm_lib
from tff_ens.execution import runtime
from tff_ens.execution import worker_process
from tff_ens.program import experiment
from tff_ens.program import loop
from tff_ens.program import reporting
from tff_ens.program import run_outputs
from tff_ens.program import simulation
from tff_ens.server import server_data as server_data_lib


@contextlib.contextmanager
def _execution_context(run: experiment.Run):
  """The run's TFF context: a local worker, or the workers of --workers."""
  execution = run.execution
  with contextlib.ExitStack() as stack:
    try:
      stack.enter_context(
        runtime.execution_context(
          workers=list(execution.workers),
          credentials_dir=execution.credentials_dir,
          local_worker=execution.local_worker,
          max_concurrent_computation_calls=execution.max_concurrent_clients,
          clients_per_chunk=execution.clients_per_chunk,
        )
      )
    except worker_process.IsolationError as e:
      raise experiment.UsageError(
        f"{e}; or pass --local_worker=open for a worker that every local user and host that "
        "reaches its port can run code in"
      ) from None
    except worker_process.WorkerError as e:
      if not run.execution.workers:
        raise
      raise experiment.UsageError(
        f"--workers={','.join(execution.workers)}: {e} Start it there with `python -m "
        "tff_ens.worker --port=PORT --credentials=DIR`, or fix the address"
      ) from None
    yield


def run_experiment(config) -> dict:
  """Runs (or resumes) one experiment (an `experiment.ExperimentConfig`) and returns its
  summary.

  Raises:
    UsageError: for a bad flag or output directory.
    worker_process.WorkerError: if a TFF worker dies or stops answering during the
      run; the message says from which round `--resume` continues.
    Stopped: a signal stopped the run; the message says from which round it continues.
  """
  run = experiment.resolve(config)
  task, model, cohort = run.task, run.model, run.schedule.clients_per_round
  data = run.load_data()
  num_clients = len(data.train.client_ids)
  if cohort > num_clients:
    raise experiment.UsageError(
      f"--clients_per_round={cohort} exceeds the {num_clients} training "
      f"writers in the data: use at most {num_clients}"
    )
  server_data = None
  if run.algorithm.server_data or run.recalibrate_batch_norm:
    server_data = server_data_lib.server_split(
      data, task, seed=run.seed, unlabeled_path=run.server_data
    )
    logging.info(
      "server data: %d unlabeled (%s), %d validation",
      len(server_data.unlabeled),
      server_data.source,
      len(server_data.validation_y),
    )
  tf.keras.utils.set_random_seed(run.seed)
  build_model = lambda name, seed: task.build_model(name, seed=seed, norm=model.norm)
  # Member k of an ensemble starts from its own seed; k = 0 for one model.
  model_fn = lambda k=0: build_model(model.name, model.seed + 1009 * k)
  context = algorithm_lib.BuildContext(
    model_fn=model_fn,
    element_spec=simulation.batch_element_spec(task),
    local=run.local,
    groups=run.groups,
    seed=run.seed,
    num_clients=num_clients,
    clients_per_round=cohort,
    server_data=server_data if run.algorithm.server_data else None,
    dp=run.dp,
    on_device=run.devices is not None,
    recalibration_images=_recalibration_images(run, model_fn, server_data),
    build_model=build_model,
    task=task,
    model=model.name,
    transport=run.transport,
  )
  with contextlib.ExitStack() as stack:
    with _execution_context(run):
      algorithm = algorithms.build(run.algorithm.name, context)
      _check_mergeable(run, algorithm)
      outputs = run_outputs.RunOutputs(run.outputs, algorithm.process.initialize())
      stack.callback(outputs.close)
      evaluator = reporting.Evaluator(algorithm.evaluation_model_fn)
      try:
        trained = loop.train(run, data, algorithm, outputs, evaluator)
      except worker_process.WorkerError as e:
        raise worker_process.WorkerError(f"{e} {outputs.resume_hint()}") from None
    # After the worker has stopped: the final evaluation does not add to its memory.
    return reporting.write_summary(run, data, algorithm, outputs, evaluator, trained)


def _check_mergeable(run: experiment.Run, algorithm) -> None:
  """A round in chunks or on several workers (TFF's mergeable form) cannot return
  CLIENTS-placed values: UsageError before the first round if this one's would."""
  chunked = 0 < run.execution.clients_per_chunk < run.schedule.clients_per_round
  next_fn = algorithm.process.next
  if not (chunked or len(run.execution.workers) > 1) or not isinstance(next_fn, tff.Computation):
    return
  if runtime.returns_per_client_values(next_fn):
    where = (
      "on several --workers"
      if len(run.execution.workers) > 1
      else "in chunks (--clients_per_chunk)"
    )
    raise experiment.UsageError(
      f"--client_transport=values returns the clients' states from the worker, which a round "
      f"{where} cannot (TFF 0.87 merges them out of client order): use "
      "--client_transport=files, or one worker and --clients_per_chunk=0"
    )


def _recalibration_images(run, model_fn, server_data) -> np.ndarray | None:
  """The server images of `--recalibrate_batch_norm` (a seeded draw), or None."""
  count, model = run.recalibrate_batch_norm, run.model
  if not count:
    return None
  with tf.Graph().as_default():
    layers = model_fn(0).submodules
  if not any(isinstance(layer, tf.keras.layers.BatchNormalization) for layer in layers):
    raise experiment.UsageError(
      f"--recalibrate_batch_norm: --model={model.name} --norm={model.norm} has no batch "
      "norm to recalibrate: drop the flag, or use a ResNet with --norm=batch"
    )
  unlabeled = server_data.unlabeled
  if count > len(unlabeled):
    raise experiment.UsageError(
      f"--recalibrate_batch_norm={count} exceeds the server's "
      f"{len(unlabeled)} unlabeled images ({server_data.source}): use at most {len(unlabeled)}"
    )
  rng = np.random.default_rng(run.seed)
  return unlabeled[rng.choice(len(unlabeled), count, replace=False)]
