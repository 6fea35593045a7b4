r"""Command line: train a federated model and write its metrics and summary.

  python -m tff_ens.main --task=femnist --algorithm=fedavg --rounds=100 \
      --data_dir=../shared/data/femnist --output_dir=runs/fedavg

Flags map one to one onto `experiment.ExperimentConfig`; see `--help`.
"""

import dataclasses
import logging as std_logging
import os
import signal
import sys

from absl import app
from absl import flags
from absl import logging

from tff_ens import cpp_log

cpp_log.quiet_unless_verbose(sys.argv)

# TensorFlow must be imported before absl parses flags: Keras 2.14 imported
# inside `main` builds broken Sequential models ("Output tensors of a
# Sequential model must be the output of a TensorFlow `Layer`").
import tasks
from tasks import resnet
from tff_ens import active_learning
from tff_ens import algorithms
from tff_ens import client_states
from tff_ens import client_work
from tff_ens import device_clients
from tff_ens import distillation
from tff_ens import drop_worst
from tff_ens import experiment
from tff_ens import fed_ensemble
from tff_ens import fedadam
from tff_ens import fedppd_local
from tff_ens import run_files
from tff_ens import runtime
from tff_ens import server_distillation
from tff_ens import training
from tff_ens import weight_posterior

flags.DEFINE_string("task", "femnist", f"Task: {', '.join(tasks.TASKS)}.")
flags.DEFINE_enum(
  "classes",
  "all",
  list(tasks.CLASSES),
  "all: every class of the task; digits (femnist): train and test on the "
  "digits, with the test writers' letters as out-of-distribution inputs "
  "(summary.json's ood_* keys).",
)
flags.DEFINE_string(
  "data_dir",
  None,
  "Task data directory (FEMNIST: a LEAF directory with train/ and test/; "
  "CIFAR: the directory holding cifar-10-batches-py/ or cifar-100-python/)."
  " Defaults to $TFF_ENS_DATA_DIR, then TFF's (FEMNIST) or Keras' (CIFAR) "
  "cache or download.",
)
flags.DEFINE_enum(
  "partition",
  None,
  list(tasks.partition.PARTITIONS),
  "How the labeled training examples are split over clients "
  "(tasks/partition.py). Unset: the task's own clients (FEMNIST's writers; "
  "CIFAR: iid). FEMNIST with a value pools its training writers' examples "
  "and splits them by label, as CIFAR's are.",
)
flags.DEFINE_integer("num_clients", 10, "Clients sharing a --partition split.")
flags.DEFINE_float(
  "partition_alpha", 1.0, "Dirichlet alpha of --partition=dirichlet (FedDF: 1 and 0.1)."
)
flags.DEFINE_integer(
  "classes_per_client",
  2,
  "Labels per client of --partition=classes, major classes of --partition=step.",
)
flags.DEFINE_integer(
  "step_minor_examples", 10, "--partition=step examples of every class per client."
)
flags.DEFINE_integer(
  "server_unlabeled_examples",
  None,
  "Training examples of a --partition split set aside as the server's "
  "unlabeled data (default: CIFAR 10,000, FEMNIST 2,000). FEMNIST with "
  "this and --server_validation_examples at 0 distills on its test-only "
  "writers instead.",
)
flags.DEFINE_integer(
  "server_validation_examples",
  None,
  "Training examples of a --partition split set aside as the server's "
  "labeled validation set (default: CIFAR 1,000, FEMNIST 500).",
)
flags.DEFINE_string(
  "algorithm",
  "fedavg",
  "; ".join(f"{name}: {spec.summary}" for name, spec in algorithms.REGISTRY.items())
  + " (docs/algorithms.md).",
)
flags.DEFINE_string(
  "model",
  "cnn",
  "Model: cnn (FEMNIST: LEAF CNN; CIFAR: FedBE's ConvNet), resnet8, resnet20, resnet32 (CIFAR).",
)
flags.DEFINE_enum("norm", "batch", list(resnet.NORMS), "Normalization layers of ResNets.")
flags.DEFINE_integer("rounds", 100, "Communication rounds.")
flags.DEFINE_integer("clients_per_round", 10, "Clients sampled per round.")
flags.DEFINE_integer("client_epochs", 1, "Local epochs per round.")
flags.DEFINE_integer("batch_size", 20, "Local batch size.")
flags.DEFINE_float("client_lr", 0.05, "Client learning rate.")
flags.DEFINE_enum(
  "client_optimizer",
  "sgd",
  list(client_work.OPTIMIZERS),
  "Client optimizer: SGD (with --client_momentum) or Adam (moments restarted every round; "
  "the recipe of binarized models).",
)
flags.DEFINE_float("client_momentum", 0.0, "Client SGD momentum.")
flags.DEFINE_float("weight_decay", 0.0, "Client (coupled L2) weight decay.")
flags.DEFINE_enum(
  "lr_schedule",
  "constant",
  list(client_work.LR_SCHEDULES),
  "Client learning rate: constant, or x0.1 at 30% and 60% of the rounds (step).",
)
flags.DEFINE_float("proximal_mu", 0.01, "FedProx mu (--algorithm=fedprox).")
flags.DEFINE_float(
  "server_lr",
  None,
  "The server optimizer's step size on the averaged update. Default: the algorithm's, "
  + ", ".join(
    f"{name} {spec.server_learning_rate:g}"
    for name, spec in algorithms.REGISTRY.items()
    if spec.server_learning_rate is not None
  )
  + ".",
)
flags.DEFINE_float("server_momentum", 0.9, "Server momentum (--algorithm=fedavgm).")
flags.DEFINE_float(
  "server_epsilon",
  fedadam.EPSILON,
  "FedAdam's epsilon, the paper's adaptivity tau (--algorithm=fedadam; Reddi et al. tune it "
  "per task, as --server_lr).",
)
flags.DEFINE_integer(
  "recalibrate_batch_norm",
  0,
  "FedAvg/FedProx/FedAvgM: measure the new model's batch-norm statistics each round on this "
  "many of the server's unlabeled images (--server_data) instead of averaging the clients'; "
  "0 averages. Part of the binarized ResNets' recipe (docs/algorithms.md).",
)
flags.DEFINE_integer("ensemble_size", 5, "K, the models of --algorithm=fedensemble.")
flags.DEFINE_enum(
  "assignment",
  "permutation",
  list(fed_ensemble.ASSIGNMENTS),
  "Fed-ensemble: which model a client trains; random is the paper's Table VII ablation.",
)
flags.DEFINE_enum(
  "member_average",
  "clients",
  list(fed_ensemble.MEMBER_AVERAGES),
  "Fed-ensemble: each model's average over its clients, each client once "
  "(the paper's Remark 1 and the authors' code) or by examples (FedAvg's).",
)
flags.DEFINE_enum(
  "local_objective",
  "sgd",
  list(algorithms.LOCAL_OBJECTIVES),
  "Fed-ensemble clients' objective (fedprox uses --proximal_mu, feddyn --feddyn_alpha).",
)
flags.DEFINE_float(
  "feddyn_alpha",
  0.01,
  "FedDyn's alpha (--local_objective=feddyn); its clients' states go to OUTPUT_DIR/client_states.",
)
flags.DEFINE_float(
  "personalization_temperature",
  0.0,
  "tau of personalized ensemble weights softmax(-loss/tau); 0 chooses it from training data.",
)
flags.DEFINE_string(
  "server_data",
  None,
  "FedBE/FedDF unlabeled server data: a LEAF directory, a .npz with x, or a .npy of "
  "images (streamed from disk, not loaded: for sets larger than memory). "
  "Default: the task's (FEMNIST: writers with test data only; CIFAR: "
  "--server_unlabeled_examples set aside; see tff_ens/server_data.py).",
)
flags.DEFINE_integer("distill_steps", 200, "Server distillation steps per round (FedDF: at most).")
flags.DEFINE_integer("distill_batch_size", 64, "Server distillation batch.")
flags.DEFINE_bool("swa", True, "FedBE: distill with SWA (False: plain SGD, the paper's 'w/o SWA').")
flags.DEFINE_enum(
  "fedbe_distribution",
  "gaussian",
  list(server_distillation.DISTRIBUTIONS),
  "FedBE: distribution over global models (eq. 5 / eq. 7).",
)
flags.DEFINE_integer("fedbe_samples", 10, "FedBE: M, models sampled.")
flags.DEFINE_enum(
  "fedbe_targets",
  "S+A+C",
  list(weight_posterior.TARGETS),
  "FedBE: teachers (A average, C clients, S samples; Table 3).",
)
flags.DEFINE_float("dirichlet_alpha", 1.0, "FedBE: Dirichlet alpha (eq. 7).")
flags.DEFINE_enum(
  "fedbe_gaussian",
  "paper",
  list(weight_posterior.GAUSSIANS),
  "FedBE's Gaussian: paper (eq. 5, moments of the client models) or code "
  "(the authors' swag.py: unit-norm updates, std x var_scale x mean norm).",
)
flags.DEFINE_float(
  "fedbe_var_scale",
  0.1,
  "FedBE, --fedbe_gaussian=code: std scale (the authors' code's 0.1; not in the paper).",
)
flags.DEFINE_float(
  "fedbe_var_clamp",
  1e-5,
  "FedBE, --fedbe_gaussian=code: least variance of the unit updates (the authors' code's 1e-5).",
)
flags.DEFINE_enum(
  "fedbe_dirichlet",
  "paper",
  list(weight_posterior.DIRICHLETS),
  "FedBE's Dirichlet: paper (eq. 7, Dir(alpha) reweighted by |D_i|), code "
  "(the authors' symmetric Dir(alpha)) or proportional (Dir(alpha N p)).",
)
flags.DEFINE_float(
  "sharpen_temperature",
  None,
  "FedBE/v-Distillation: targets sharpened to p^(1/T)/sum p^(1/T); 1 keeps "
  "them. Unset: the papers' (FedBE 1, v-Distillation 0.5); authors' code 0.5.",
)
flags.DEFINE_float(
  "swa_warmup_fraction",
  distillation.FEDBE_SWA_WARMUP_FRACTION,
  "FedBE: SWA collects after this fraction of --distill_steps (default: the "
  "paper's 250 of the authors' 1,580 steps; their code's 500 is 0.316).",
)
flags.DEFINE_bool(
  "drop_worst", True, "FedDF: leave out client models at chance level on server validation."
)
flags.DEFINE_enum(
  "drop_worst_rule",
  "guess_or_outliers",
  list(drop_worst.DROP_WORST_RULES),
  "FedDF's drop-worst: below 1.2/C, else low outliers (mean - 1.5 std; the "
  "authors' code), or at most the majority-class rate (majority).",
)
flags.DEFINE_bool(
  "distill_keep_initial",
  False,
  "FedDF: return the initial student when no evaluated one beats it on "
  "validation (False: the best evaluated one, as the authors' code).",
)
flags.DEFINE_float(
  "distill_clip_norm",
  distillation.FEDDF_CLIP_NORM,
  "FedDF: clip the student's gradient to this global norm (0: none; 5 is the authors' code's).",
)
flags.DEFINE_string(
  "prototypes",
  "",
  "FedDF over model prototypes: comma-separated models, "
  "e.g. cnn,resnet8; client i runs the (i mod P)-th, the first is --model "
  "(summary.json: prototype_test_accuracy). Empty: one model.",
)
flags.DEFINE_float(
  "distill_min_improvement",
  0.0,
  "FedDF: a student replaces the best one "
  "only if its server validation accuracy is higher by more than this (0: "
  "any improvement, the paper's).",
)
flags.DEFINE_integer(
  "distill_curve_every",
  25,
  "FedBE/v-Distillation/FedPPD+Distill: measure the distilling student on server validation "
  "every N steps, for distillation_curves.json only (0: never; FedDF's curve is its "
  "early-stopping evaluations).",
)
flags.DEFINE_integer("distill_patience", 100, "FedDF: early-stopping patience in steps.")
flags.DEFINE_integer("distill_eval_every", 20, "FedDF: validation every N distillation steps.")
flags.DEFINE_string(
  "server_device",
  "auto",
  "Device of the server step (FedBE/FedDF/FedPPD+Distill distillation, run in this "
  "process's TensorFlow): auto (GPU if TensorFlow sees one), cpu, gpu or e.g. /GPU:1. "
  "summary.json's server_device says where its ops ran. Client training stays on the "
  "CPU: TFF 0.87's worker uses no GPU.",
)
flags.DEFINE_string(
  "student_model",
  "",
  "FedPPD: the student (default: the task's for --model, FEMNIST's "
  "cnn_ppd_student for cnn; else --model).",
)
flags.DEFINE_float(
  "teacher_lr",
  4e-4,
  "FedPPD: SGLD step size eps of the teacher (noise variance "
  "eps * --sgld_temperature; like SGD at rate eps*N/2).",
)
flags.DEFINE_float(
  "sgld_temperature",
  1.0,
  "FedPPD: posterior temperature T of SGLD (1: exact; the "
  "authors' code adds noise as T = 4/N would, about 0.03 "
  "for a FEMNIST writer).",
)
flags.DEFINE_float(
  "prior_precision",
  0.0,
  "FedPPD: precision of the teacher's Gaussian weight prior "
  "beyond --teacher_weight_decay (0: that only, as the "
  "authors' code).",
)
flags.DEFINE_enum(
  "sgld_scaling",
  "posterior",
  list(fedppd_local.SGLD_SCALINGS),
  "FedPPD: units of --teacher_lr/--sgld_temperature: posterior (eps, T; the "
  "paper) or authors (lr on the mean loss; T=1 is their noise 2 sqrt(lr)/N).",
)
flags.DEFINE_float(
  "teacher_weight_decay",
  1e-4,
  "FedPPD: wd*w added to the teacher's mean-loss gradient (prior precision "
  "N*wd; the authors' code, the paper gives none).",
)
flags.DEFINE_float(
  "teacher_step_decay",
  0.85,
  "FedPPD: teacher step size times this every --teacher_step_decay_epochs "
  "local epochs (the authors' StepLR; 1: off).",
)
flags.DEFINE_integer(
  "teacher_step_decay_epochs",
  3,
  "FedPPD: local epochs between teacher step decays (the authors' code: 3).",
)
flags.DEFINE_float(
  "teacher_round_decay",
  0.99,
  "FedPPD: teacher step size times this each round (the authors' FEMNIST script; 1: off).",
)
flags.DEFINE_float(
  "student_round_decay",
  0.99,
  "FedPPD: student learning rate times this each round (the authors' code; 1: off).",
)
flags.DEFINE_enum(
  "student_minibatch",
  "fresh",
  list(fedppd_local.STUDENT_MINIBATCHES),
  "FedPPD: the student's minibatch: fresh after each SGLD step (the "
  "supplement's Alg. 1), the teacher's (same), or alternate_epochs (authors).",
)
flags.DEFINE_bool(
  "distill_fedppd_teachers",
  True,
  "FedPPD+Distill: distill the clients' teachers too, as the authors' code "
  "does (about twice the server step); False averages them.",
)
flags.DEFINE_float("student_lr", 0.05, "FedPPD: student SGD learning rate.")
flags.DEFINE_float("student_momentum", 0.0, "FedPPD: student SGD momentum.")
flags.DEFINE_float("student_weight_decay", 1e-4, "FedPPD: the student's L2 prior term.")
flags.DEFINE_integer(
  "active_learning_rounds",
  0,
  "Active learning: A acquisitions after A+1 equal phases of --rounds (0: off).",
)
flags.DEFINE_integer(
  "active_budget", 10, "Active learning: inputs each client annotates per acquisition."
)
flags.DEFINE_float(
  "active_initial_fraction",
  0.1,
  "Active learning: labeled part of each client's data at the start.",
)
flags.DEFINE_enum(
  "active_selection",
  "entropy",
  list(active_learning.SELECTIONS),
  "Active learning: annotate the highest predictive entropy, or at random (the baseline).",
)
flags.DEFINE_float(
  "max_update_norm",
  0.0,
  "Reject a client update whose trainable weights moved by a larger L2 "
  "norm (counted in rejected_updates); 0: no limit. NaN/Inf updates are "
  "always rejected.",
)
flags.DEFINE_integer(
  "aggregate_first",
  0,
  "FedScale's over-commitment: aggregate only the first M reporting "
  "clients to finish (simulated device speeds; select e.g. 1.3 M with "
  "--clients_per_round); 0: all.",
)
flags.DEFINE_integer(
  "nan_clients_per_round",
  0,
  "Fault injection: this many reporting clients a round train on NaN "
  "inputs and so send NaN updates (which are rejected).",
)
flags.DEFINE_float(
  "dropout_rate", 0.0, "Fault simulation: a sampled client returns nothing with this probability."
)
flags.DEFINE_float(
  "straggler_rate",
  0.0,
  "Fault simulation: a sampled client is a straggler with "
  "this probability and completes a U(0, 1] fraction of its "
  "local epochs (FedBE's systems heterogeneity).",
)
flags.DEFINE_float(
  "dp_noise_multiplier",
  0.0,
  "DP-FedAvg: Gaussian noise z times the clip norm on the sum of clipped "
  "client updates (0: no noise; fedavg, fedprox, fedavgm, fedensemble, "
  "fedppd).",
)
flags.DEFINE_float(
  "dp_clip_norm",
  0.0,
  "DP-FedAvg: clip each client's update to this L2 norm; 0 with "
  "--dp_noise_multiplier > 0: adaptive clip (to the median norm).",
)
flags.DEFINE_float(
  "dp_target_delta",
  0.0,
  "DP-FedAvg: delta of the reported epsilon (0: 1/N^1.1 for N training clients).",
)
flags.DEFINE_integer("seed", 0, "Seed of models, client sampling and data.")
flags.DEFINE_string("output_dir", "runs/femnist", "Where outputs go.")
flags.DEFINE_integer("eval_every", 10, "Evaluate on test data every N rounds.")
flags.DEFINE_integer("checkpoint_every", 10, "Checkpoint every N rounds.")
flags.DEFINE_integer(
  "max_concurrent_clients",
  0,
  "Clients trained at once by the TFF runtime (<= 0: no limit; see benchmarks/RESULTS.md).",
)
flags.DEFINE_string(
  "workers",
  "",
  "Run on TFF worker services at host:port,host:port (each started with "
  "`python -m tff_ens.worker --port=PORT`), clients split across them; "
  "empty: a local worker.",
)
flags.DEFINE_enum(
  "client_runtime",
  "tff",
  list(device_clients.CLIENT_RUNTIMES),
  "Where clients train: tff (TFF's runtime), or litert: each sampled client's local epochs "
  "run in LiteRT, as on a phone, in processes of the device environment (`uv sync --locked "
  "--project device`), from a --format=trainable file of the run's model; "
  f"{', '.join(algorithms.ON_DEVICE_ALGORITHMS)} only (tff_ens/device_clients.py).",
)
flags.DEFINE_integer(
  "device_processes",
  2,
  "--client_runtime=litert: device processes (phones) training clients at once.",
)
flags.DEFINE_bool("resume", False, "Continue the run in --output_dir from its last checkpoint.")

FLAGS = flags.FLAGS


def _binary_recipe(values: dict) -> dict:
  """`resnet.BINARY_RECIPE`'s flags that a run of a binarized model takes by default: those
  it did not give, and that its algorithm and client runtime use."""
  try:
    task = tasks.get_task(values["task"], values["classes"])
  except ValueError:  # The config's validation says so.
    return {}
  if values["model"] not in task.BINARY_MODEL_NAMES:
    return {}
  recipe = dict(resnet.BINARY_RECIPE)
  if values["client_runtime"] != "tff":  # The device file trains with SGD.
    del recipe["client_optimizer"], recipe["client_lr"]
  if values["algorithm"] not in algorithms.FEDAVG_ALGORITHMS or values["norm"] != "batch":
    del recipe["recalibrate_batch_norm"]
  recipe = {name: value for name, value in recipe.items() if not FLAGS[name].present}
  if recipe:
    logging.warning(
      "--model=%s trains with its recipe (docs/algorithms.md): %s; a flag you pass overrides it",
      values["model"],
      " ".join(f"--{name}={value}" for name, value in recipe.items()),
    )
  return recipe


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not FLAGS["verbosity"].present:
    std_logging.getLogger("tensorflow").setLevel(std_logging.ERROR)
    # On a terminal the progress bar reports; log lines would break it.
    logging.set_verbosity(logging.WARNING if sys.stderr.isatty() else logging.INFO)
  fields = {f.name for f in dataclasses.fields(experiment.ExperimentConfig)}
  values = {name: FLAGS[name].value for name in fields}
  config = experiment.ExperimentConfig(**{**values, **_binary_recipe(values)})
  try:
    summary = training.run_experiment(config)
  except (experiment.UsageError, tasks.DataError, client_states.ClientStateError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except runtime.WorkerError as e:  # Lost mid-run; the message says resume.
    print(f"error: {e}", file=sys.stderr)
    return 1
  except experiment.Stopped as e:
    print(str(e), file=sys.stderr)
    return 128 + signal.SIGTERM
  print(
    f"test_accuracy={summary['test_accuracy']:.4f} "
    f"summary={os.path.join(config.output_dir, run_files.SUMMARY_FILE)}"
  )
  return 0


if __name__ == "__main__":
  app.run(main)
