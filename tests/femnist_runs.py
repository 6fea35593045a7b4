"""Short, real training runs on the FEMNIST slice, shared by the run tests."""

import csv
import os
import pathlib

import numpy as np

from tests import numpy_references
from tff_ens import run_files
from tff_ens.program import experiment

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA_DIR = str(ROOT.parent / "shared" / "data" / "femnist")

# Small but real: 4 writers a round, batch 20, a few rounds.
QUICK = experiment.ExperimentConfig(
  data_dir=DATA_DIR,
  rounds=4,
  clients_per_round=4,
  eval_every=2,
  checkpoint_every=2,
  client_lr=0.1,
  seed=3,
)


def client_state_values(output_dir) -> dict:
  """{state file prefix: its array} of a run's stored client states (none: {})."""
  import tensorflow as tf

  from tff_ens.program import client_states

  directory = os.path.join(output_dir, client_states.DIRECTORY)
  if not os.path.isdir(directory):
    return {}
  prefixes = {name.split(".")[0] for name in os.listdir(directory)}
  return {
    p: tf.raw_ops.RestoreV2(
      prefix=os.path.join(directory, p),
      tensor_names=["state"],
      shape_and_slices=[""],
      dtypes=[tf.float32],
    )[0].numpy()
    for p in prefixes
  }


# The keys of metrics.csv and summary.json that time the run, and differ between equal runs.
TIMINGS = ("seconds", "seconds_per_round", "server_seconds", "server_seconds_per_round")


def without_timings(row: dict) -> dict:
  return {k: v for k, v in row.items() if k not in TIMINGS}


def read_metrics(output_dir):
  """The rows of a run's metrics.csv."""
  with open(os.path.join(output_dir, run_files.METRICS_FILE)) as f:
    return list(csv.DictReader(f))


def reference_test_metrics(models, x, y) -> tuple[float, float]:
  """(accuracy, mean negative log-likelihood) of the Keras `models`' uniform mixture on
  `(x, y)`, computed apart from the program's evaluator: logits softmaxed and averaged in
  NumPy, float64."""
  probs = numpy_references.member_probabilities(models, x).mean(0)
  return numpy_references.accuracy(probs, y), float(-np.mean(np.log(probs[np.arange(len(y)), y])))


def record_teachers(monkeypatch, step_class) -> list:
  """Records, for each call of a server step's `_teachers` (`step_class`:
  `server_distillation.DistillationStep` or `model_prototypes.PrototypeStep`), what it
  returned, as NumPy (`returned`), and the step's `validation` (x, y)."""
  import tensorflow as tf

  calls = []
  teachers = step_class._teachers

  def recording(self, *args):
    returned = teachers.__get__(self, step_class)(*args)
    calls.append(
      dict(
        returned=tf.nest.map_structure(np.asarray, returned),
        validation=(self.data.validation_x, self.data.validation_y),
      )
    )
    return returned

  monkeypatch.setattr(step_class, "_teachers", recording)
  return calls


def logits_of(model, weights, x):
  """`model`'s logits on `x` with `weights` (a `ModelWeights` of arrays) assigned."""
  import tensorflow_federated as tff

  tff.learning.models.ModelWeights(*weights).assign_weights_to(model)
  return model(x, training=False).numpy()


def stacked_logits(model, stack, x):
  """[M, n, classes]: the logits of each of a stack's M teachers on `x`."""
  import tensorflow as tf

  members = len(tf.nest.flatten(stack)[0])
  return [logits_of(model, tf.nest.map_structure(lambda w: w[m], stack), x) for m in range(members)]
