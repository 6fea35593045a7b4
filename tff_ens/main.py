r"""Command line: train a federated model and write its metrics and summary.

  python -m tff_ens.main --task=femnist --algorithm=fedavg --rounds=100 \
      --data_dir=../shared/data/femnist --output_dir=runs/fedavg

Flags map one to one onto `training.ExperimentConfig`; see `--help`.
"""

import dataclasses
import logging as std_logging
import os
import sys

from absl import app
from absl import flags
from absl import logging

# TensorFlow must be imported before absl parses flags: Keras 2.14 imported
# inside `main` builds broken Sequential models ("Output tensors of a
# Sequential model must be the output of a TensorFlow `Layer`").
from tff_ens import training
import tasks


flags.DEFINE_string("task", "femnist", "Task: femnist.")
flags.DEFINE_string(
    "data_dir", None,
    "Task data directory (FEMNIST: a LEAF directory with train/ and test/). "
    "Defaults to $TFF_ENS_DATA_DIR, then TFF's own download.")
flags.DEFINE_string(
    "algorithm", "fedavg",
    "fedavg, fedprox, fedavgm, fedensemble, fedbe, feddf or vdistill "
    "(FedBE's v-Distillation baseline).")
flags.DEFINE_string("model", "cnn", "Model: cnn (LEAF CNN), resnet8, resnet20.")
flags.DEFINE_enum("norm", "batch", ["batch", "group"],
                  "Normalization layers of ResNets.")
flags.DEFINE_integer("rounds", 100, "Communication rounds.")
flags.DEFINE_integer("clients_per_round", 10, "Clients sampled per round.")
flags.DEFINE_integer("client_epochs", 1, "Local epochs per round.")
flags.DEFINE_integer("batch_size", 20, "Local batch size.")
flags.DEFINE_float("client_lr", 0.05, "Client learning rate.")
flags.DEFINE_float("client_momentum", 0.0, "Client SGD momentum.")
flags.DEFINE_float("weight_decay", 0.0, "Client (coupled L2) weight decay.")
flags.DEFINE_enum("lr_schedule", "constant", ["constant", "step"],
                  "Client learning rate: constant, or x0.1 at 30% and 60% of "
                  "the rounds (step).")
flags.DEFINE_float("proximal_mu", 0.01, "FedProx mu (--algorithm=fedprox).")
flags.DEFINE_float("server_lr", 1.0, "Server learning rate.")
flags.DEFINE_float("server_momentum", 0.9,
                   "Server momentum (--algorithm=fedavgm).")
flags.DEFINE_integer("ensemble_size", 5, "K, the models of --algorithm="
                     "fedensemble.")
flags.DEFINE_enum("assignment", "permutation", ["permutation", "random"],
                  "Fed-ensemble: which model a client trains; random is the "
                  "paper's Table VII ablation.")
flags.DEFINE_enum("local_objective", "sgd", ["sgd", "fedprox"],
                  "Fed-ensemble clients' objective (fedprox uses "
                  "--proximal_mu).")
flags.DEFINE_float("personalization_temperature", 0.0,
                   "tau of personalized ensemble weights softmax(-loss/tau); "
                   "0 chooses it from training data.")
flags.DEFINE_string(
    "server_data", None,
    "FedBE/FedDF unlabeled server data: a LEAF directory or a .npz with x. "
    "Default: the task's writers with test data only (see "
    "tff_ens/server_data.py).")
flags.DEFINE_integer("distill_steps", 200,
                     "Server distillation steps per round (FedDF: at most).")
flags.DEFINE_integer("distill_batch_size", 64, "Server distillation batch.")
flags.DEFINE_bool("swa", True, "FedBE: distill with SWA (False: plain SGD, "
                  "the paper's 'w/o SWA').")
flags.DEFINE_enum("fedbe_distribution", "gaussian", ["gaussian", "dirichlet"],
                  "FedBE: distribution over global models (eq. 5 / eq. 7).")
flags.DEFINE_integer("fedbe_samples", 10, "FedBE: M, models sampled.")
flags.DEFINE_enum("fedbe_targets", "S+A+C",
                  ["A", "S", "S+A", "A+C", "S+C", "S+A+C"],
                  "FedBE: teachers (A average, C clients, S samples; Table 3).")
flags.DEFINE_float("dirichlet_alpha", 1.0, "FedBE: Dirichlet alpha (eq. 7).")
flags.DEFINE_bool("drop_worst", True, "FedDF: leave out client models at "
                  "chance level on server validation.")
flags.DEFINE_integer("distill_patience", 100,
                     "FedDF: early-stopping patience in steps.")
flags.DEFINE_integer("distill_eval_every", 20,
                     "FedDF: validation every N distillation steps.")
flags.DEFINE_string("server_device", "auto",
                    "Server distillation device: auto (GPU if TensorFlow "
                    "sees one), cpu, gpu or e.g. /GPU:1.")
flags.DEFINE_integer("seed", 0, "Seed of models, client sampling and data.")
flags.DEFINE_string("output_dir", "runs/femnist", "Where outputs go.")
flags.DEFINE_integer("eval_every", 10, "Evaluate on test data every N rounds.")
flags.DEFINE_integer("checkpoint_every", 10, "Checkpoint every N rounds.")
flags.DEFINE_integer(
    "max_concurrent_clients", 0,
    "Clients trained at once by the TFF runtime (<= 0: no limit; see "
    "benchmarks/RESULTS.md).")
flags.DEFINE_bool("resume", False,
                  "Continue the run in --output_dir from its last checkpoint.")

FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  std_logging.getLogger("tensorflow").setLevel(std_logging.ERROR)
  # On a terminal the progress bar reports; log lines would break it.
  logging.set_verbosity(logging.WARNING if sys.stderr.isatty() else
                        logging.INFO)
  fields = {f.name for f in dataclasses.fields(training.ExperimentConfig)}
  config = training.ExperimentConfig(
      **{name: FLAGS[name].value for name in fields})
  try:
    summary = training.run_experiment(config)
  except (training.UsageError, tasks.DataError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"test_accuracy={summary['test_accuracy']:.4f} "
        f"summary={os.path.join(config.output_dir, training.SUMMARY_FILE)}")
  return 0


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  app.run(main)
