"""Every setting of a run, declared once: `RunSettings`.

Each field is a flag of `python -m tff_ens.main` (`settings.define_flags`) and a key of a
run's `config.json`, declared with its default, its help, and its choices (the modules' own
constants) or bounds (`settings.setting`). Bounds appear here only for the settings no
library config checks; the others are checked where they are used, by the library config
`experiment.ExperimentConfig` builds from them.
"""

import dataclasses

import tasks
from tasks import resnet
from tff_ens import algorithms
from tff_ens.algorithms import fed_ensemble
from tff_ens.algorithms import fedadam
from tff_ens.algorithms import server_distillation
from tff_ens.math import drop_worst
from tff_ens.math import fedppd_local
from tff_ens.math import weight_posterior
from tff_ens.program import active_learning
from tff_ens.program import device_clients
from tff_ens.server import distillation
from tff_ens.settings import setting
from tff_ens.templates import client_work as client_work_lib

ALGORITHM_HELP = (
  "; ".join(f"{name}: {spec.summary}" for name, spec in algorithms.REGISTRY.items())
  + " (docs/algorithms.md)."
)
SERVER_LR_HELP = (
  "The server optimizer's step size on the averaged update. Default: the algorithm's, "
  + ", ".join(
    f"{name} {spec.server_learning_rate:g}"
    for name, spec in algorithms.REGISTRY.items()
    if spec.server_learning_rate is not None
  )
  + "."
)


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """The settings of a run, one field per flag (`experiment.ExperimentConfig` checks them)."""

  # The task and its clients.
  task: str = setting("femnist", "The task (docs/tasks.md).", choices=tasks.TASKS)
  classes: str = setting(
    "all",
    "all: every class of the task; digits (femnist): train and test on the digits, with the "
    "test writers' letters as out-of-distribution inputs (summary.json's ood_* keys).",
    choices=tasks.CLASSES,
  )
  data_dir: str | None = setting(
    None,
    "Task data directory (FEMNIST: a LEAF directory with train/ and test/; CIFAR: the "
    "directory holding cifar-10-batches-py/ or cifar-100-python/). Defaults to "
    "$TFF_ENS_DATA_DIR, then TFF's (FEMNIST) or Keras' (CIFAR) cache or download.",
  )
  num_clients: int = setting(10, "Clients sharing a --partition split.")
  partition: str | None = setting(
    None,
    "How the labeled training examples are split over clients (tasks/partition.py). Unset: "
    "the task's own clients (FEMNIST's writers; CIFAR: iid). FEMNIST with a value pools its "
    "training writers' examples and splits them by label, as CIFAR's are.",
    choices=tasks.partition.PARTITIONS,
  )
  partition_alpha: float = setting(
    1.0,
    "Dirichlet alpha of --partition=dirichlet (FedDF: 1 and 0.1).",
  )
  classes_per_client: int = setting(
    2,
    "Labels per client of --partition=classes, major classes of --partition=step.",
  )
  step_minor_examples: int = setting(10, "--partition=step examples of every class per client.")
  server_unlabeled_examples: int | None = setting(
    None,
    "Training examples of a --partition split set aside as the server's unlabeled data "
    "(default: CIFAR 10,000, FEMNIST 2,000). FEMNIST with this and "
    "--server_validation_examples at 0 distills on its test-only writers instead.",
  )
  server_validation_examples: int | None = setting(
    None,
    "Training examples of a --partition split set aside as the server's labeled validation "
    "set (default: CIFAR 1,000, FEMNIST 500).",
  )

  # The algorithm, the model and the clients' training.
  algorithm: str = setting("fedavg", ALGORITHM_HELP, choices=algorithms.ALGORITHMS)
  model: str = setting(
    "cnn",
    "Model: cnn (FEMNIST: LEAF CNN; CIFAR: FedBE's ConvNet), resnet8, resnet20, resnet32 (CIFAR).",
  )
  norm: str = setting("batch", "Normalization layers of ResNets.", choices=resnet.NORMS)
  rounds: int = setting(100, "Communication rounds.", above=0)
  clients_per_round: int = setting(10, "Clients sampled per round.", above=0)
  client_epochs: int = setting(1, "Local epochs per round.", above=0)
  batch_size: int = setting(20, "Local batch size.", above=0)
  client_lr: float = setting(0.05, "Client learning rate.")
  client_optimizer: str = setting(
    "sgd",
    "Client optimizer: SGD (with --client_momentum) or Adam (moments restarted every round; "
    "the recipe of binarized models).",
    choices=client_work_lib.OPTIMIZERS,
  )
  client_momentum: float = setting(0.0, "Client SGD momentum.")
  weight_decay: float = setting(0.0, "Client (coupled L2) weight decay.")
  lr_schedule: str = setting(
    "constant",
    "Client learning rate: constant, or x0.1 at 30% and 60% of the rounds (step).",
    choices=client_work_lib.LR_SCHEDULES,
  )
  proximal_mu: float = setting(0.01, "FedProx mu (--algorithm=fedprox).", at_least=0)

  # The server optimizer (the FedAvg family).
  server_lr: float | None = setting(None, SERVER_LR_HELP, above=0)
  server_momentum: float = setting(0.9, "Server momentum (--algorithm=fedavgm).", at_least=0)
  server_epsilon: float = setting(
    fedadam.EPSILON,
    "FedAdam's epsilon, the paper's adaptivity tau (--algorithm=fedadam; Reddi et al. tune it"
    " per task, as --server_lr).",
    at_least=0,
  )
  recalibrate_batch_norm: int = setting(
    0,
    "FedAvg/FedProx/FedAvgM: measure the new model's batch-norm statistics each round on this"
    " many of the server's unlabeled images (--server_data) instead of averaging the "
    "clients'; 0 averages. Part of the binarized ResNets' recipe (docs/algorithms.md).",
    at_least=0,
  )

  # Fed-ensemble.
  ensemble_size: int = setting(5, "K, the models of --algorithm=fedensemble.", above=0)
  assignment: str = setting(
    "permutation",
    "Fed-ensemble: which model a client trains; random is the paper's Table VII ablation.",
    choices=fed_ensemble.ASSIGNMENTS,
  )
  member_average: str = setting(
    "clients",
    "Fed-ensemble: each model's average over its clients, each client once (the paper's "
    "Remark 1 and the authors' code) or by examples (FedAvg's).",
    choices=fed_ensemble.MEMBER_AVERAGES,
  )
  local_objective: str = setting(
    "sgd",
    "Fed-ensemble clients' objective (fedprox uses --proximal_mu, feddyn --feddyn_alpha).",
    choices=algorithms.LOCAL_OBJECTIVES,
  )
  feddyn_alpha: float = setting(
    0.01,
    "FedDyn's alpha (--local_objective=feddyn); its clients' states go to "
    "OUTPUT_DIR/client_states.",
    above=0,
  )
  personalization_temperature: float = setting(
    0.0,
    "tau of personalized ensemble weights softmax(-loss/tau); 0 chooses it from training data.",
    at_least=0,
  )

  # Server distillation: FedBE, FedDF, v-Distillation, FedPPD+Distill.
  server_data: str | None = setting(
    None,
    "FedBE/FedDF unlabeled server data: a LEAF directory, a .npz with x, or a .npy of images "
    "(streamed from disk, not loaded: for sets larger than memory). Default: the task's "
    "(FEMNIST: writers with test data only; CIFAR: --server_unlabeled_examples set aside; see"
    " tff_ens/server/server_data.py).",
  )
  distill_steps: int = setting(200, "Server distillation steps per round (FedDF: at most).")
  distill_batch_size: int = setting(64, "Server distillation batch.")
  swa: bool = setting(True, "FedBE: distill with SWA (False: plain SGD, the paper's 'w/o SWA').")
  fedbe_distribution: str = setting(
    "gaussian",
    "FedBE: distribution over global models (eq. 5 / eq. 7).",
    choices=server_distillation.DISTRIBUTIONS,
  )
  fedbe_samples: int = setting(10, "FedBE: M, models sampled.")
  fedbe_targets: str = setting(
    "S+A+C",
    "FedBE: teachers (A average, C clients, S samples; Table 3).",
    choices=weight_posterior.TARGETS,
  )
  dirichlet_alpha: float = setting(1.0, "FedBE: Dirichlet alpha (eq. 7).")
  fedbe_gaussian: str = setting(
    "paper",
    "FedBE's Gaussian: paper (eq. 5, moments of the client models) or code (the authors' "
    "swag.py: unit-norm updates, std x var_scale x mean norm).",
    choices=weight_posterior.GAUSSIANS,
  )
  fedbe_var_scale: float = setting(
    0.1,
    "FedBE, --fedbe_gaussian=code: std scale (the authors' code's 0.1; not in the paper).",
  )
  fedbe_var_clamp: float = setting(
    1e-05,
    "FedBE, --fedbe_gaussian=code: least variance of the unit updates (the authors' code's 1e-5).",
  )
  fedbe_dirichlet: str = setting(
    "paper",
    "FedBE's Dirichlet: paper (eq. 7, Dir(alpha) reweighted by |D_i|), code (the authors' "
    "symmetric Dir(alpha)) or proportional (Dir(alpha N p)).",
    choices=weight_posterior.DIRICHLETS,
  )
  sharpen_temperature: float | None = setting(
    None,
    "FedBE/v-Distillation: targets sharpened to p^(1/T)/sum p^(1/T); 1 keeps them. Unset: the"
    " papers' (FedBE 1, v-Distillation 0.5); authors' code 0.5.",
  )
  swa_warmup_fraction: float = setting(
    distillation.FEDBE_SWA_WARMUP_FRACTION,
    "FedBE: SWA collects after this fraction of --distill_steps (default: the paper's 250 of "
    "the authors' 1,580 steps; their code's 500 is 0.316).",
  )
  distill_keep_initial: bool = setting(
    False,
    "FedDF: return the initial student when no evaluated one beats it on validation (False: "
    "the best evaluated one, as the authors' code).",
  )
  distill_clip_norm: float = setting(
    distillation.FEDDF_CLIP_NORM,
    "FedDF: clip the student's gradient to this global norm (0: none; 5 is the authors' code's).",
  )
  drop_worst_rule: str = setting(
    "guess_or_outliers",
    "FedDF's drop-worst: below 1.2/C, else low outliers (mean - 1.5 std; the authors' code), "
    "or at most the majority-class rate (majority).",
    choices=drop_worst.DROP_WORST_RULES,
  )
  drop_worst: bool = setting(
    True,
    "FedDF: leave out client models at chance level on server validation.",
  )
  prototypes: str = setting(
    "",
    "FedDF over model prototypes: comma-separated models, e.g. cnn,resnet8; client i runs the"
    " (i mod P)-th, the first is --model (summary.json: prototype_test_accuracy). Empty: one "
    "model.",
  )
  distill_patience: int = setting(100, "FedDF: early-stopping patience in steps.", above=0)
  distill_eval_every: int = setting(20, "FedDF: validation every N distillation steps.", above=0)
  distill_curve_every: int = setting(
    25,
    "FedBE/v-Distillation/FedPPD+Distill: measure the distilling student on server validation"
    " every N steps, for distillation_curves.json only (0: never; FedDF's curve is its "
    "early-stopping evaluations).",
  )
  distill_min_improvement: float = setting(
    0.0,
    "FedDF: a student replaces the best one only if its server validation accuracy is higher "
    "by more than this (0: any improvement, the paper's).",
  )
  server_device: str = setting(
    "auto",
    "Device of the server step (FedBE/FedDF/FedPPD+Distill distillation, run in this "
    "process's TensorFlow): auto (GPU if TensorFlow sees one), cpu, gpu or e.g. /GPU:1. "
    "summary.json's server_device says where its ops ran. Client training stays on the CPU: "
    "TFF 0.87's worker uses no GPU.",
  )

  # FedPPD.
  student_model: str = setting(
    "",
    "FedPPD: the student (default: the task's for --model, FEMNIST's cnn_ppd_student for cnn;"
    " else --model).",
  )
  teacher_lr: float = setting(
    0.0004,
    "FedPPD: SGLD step size eps of the teacher (noise variance eps * --sgld_temperature; like"
    " SGD at rate eps*N/2).",
  )
  sgld_temperature: float = setting(
    1.0,
    "FedPPD: posterior temperature T of SGLD (1: exact; the authors' code adds noise as T = "
    "4/N would, about 0.03 for a FEMNIST writer).",
  )
  prior_precision: float = setting(
    0.0,
    "FedPPD: precision of the teacher's Gaussian weight prior beyond --teacher_weight_decay "
    "(0: that only, as the authors' code).",
  )
  student_lr: float = setting(0.05, "FedPPD: student SGD learning rate.")
  student_momentum: float = setting(0.0, "FedPPD: student SGD momentum.")
  student_weight_decay: float = setting(0.0001, "FedPPD: the student's L2 prior term.")
  sgld_scaling: str = setting(
    "posterior",
    "FedPPD: units of --teacher_lr/--sgld_temperature: posterior (eps, T; the paper) or "
    "authors (lr on the mean loss; T=1 is their noise 2 sqrt(lr)/N).",
    choices=fedppd_local.SGLD_SCALINGS,
  )
  teacher_weight_decay: float = setting(
    0.0001,
    "FedPPD: wd*w added to the teacher's mean-loss gradient (prior precision N*wd; the "
    "authors' code, the paper gives none).",
  )
  teacher_step_decay: float = setting(
    0.85,
    "FedPPD: teacher step size times this every --teacher_step_decay_epochs local epochs (the"
    " authors' StepLR; 1: off).",
  )
  teacher_step_decay_epochs: int = setting(
    3,
    "FedPPD: local epochs between teacher step decays (the authors' code: 3).",
  )
  teacher_round_decay: float = setting(
    0.99,
    "FedPPD: teacher step size times this each round (the authors' FEMNIST script; 1: off).",
  )
  student_round_decay: float = setting(
    0.99,
    "FedPPD: student learning rate times this each round (the authors' code; 1: off).",
  )
  student_minibatch: str = setting(
    "fresh",
    "FedPPD: the student's minibatch: fresh after each SGLD step (the supplement's Alg. 1), "
    "the teacher's (same), or alternate_epochs (authors).",
    choices=fedppd_local.STUDENT_MINIBATCHES,
  )
  distill_fedppd_teachers: bool = setting(
    True,
    "FedPPD+Distill: distill the clients' teachers too, as the authors' code does (about "
    "twice the server step); False averages them.",
  )

  # Active learning.
  active_learning_rounds: int = setting(
    0,
    "Active learning: A acquisitions after A+1 equal phases of --rounds (0: off).",
  )
  active_budget: int = setting(10, "Active learning: inputs each client annotates per acquisition.")
  active_initial_fraction: float = setting(
    0.1,
    "Active learning: labeled part of each client's data at the start.",
  )
  active_selection: str = setting(
    "entropy",
    "Active learning: annotate the highest predictive entropy, or at random (the baseline).",
    choices=active_learning.SELECTIONS,
  )

  # Faults and update checks.
  max_update_norm: float = setting(
    0.0,
    "Reject a client update whose trainable weights moved by a larger L2 norm (counted in "
    "rejected_updates); 0: no limit. NaN/Inf updates are always rejected.",
  )
  aggregate_first: int = setting(
    0,
    "FedScale's over-commitment: aggregate only the first M reporting clients to finish "
    "(simulated device speeds; select e.g. 1.3 M with --clients_per_round); 0: all.",
    at_least=0,
  )
  nan_clients_per_round: int = setting(
    0,
    "Fault injection: this many reporting clients a round train on NaN inputs and so send NaN"
    " updates (which are rejected).",
    at_least=0,
  )
  dropout_rate: float = setting(
    0.0,
    "Fault simulation: a sampled client returns nothing with this probability.",
    at_least=0,
    at_most=1,
  )
  straggler_rate: float = setting(
    0.0,
    "Fault simulation: a sampled client is a straggler with this probability and completes a "
    "U(0, 1] fraction of its local epochs (FedBE's systems heterogeneity).",
    at_least=0,
    at_most=1,
  )

  # Differential privacy.
  dp_noise_multiplier: float = setting(
    0.0,
    "DP-FedAvg: Gaussian noise z times the clip norm on the sum of clipped client updates (0:"
    " no noise; fedavg, fedprox, fedavgm, fedensemble, fedppd).",
  )
  dp_clip_norm: float = setting(
    0.0,
    "DP-FedAvg: clip each client's update to this L2 norm; 0 with --dp_noise_multiplier > 0: "
    "adaptive clip (to the median norm).",
  )
  dp_target_delta: float = setting(
    0.0,
    "DP-FedAvg: delta of the reported epsilon (0: 1/N^1.1 for N training clients).",
    at_least=0,
    below=1,
  )

  # The run.
  seed: int = setting(0, "Seed of models, client sampling and data.")
  output_dir: str = setting("runs/femnist", "Where outputs go.")
  eval_every: int = setting(10, "Evaluate on test data every N rounds.", above=0)
  checkpoint_every: int = setting(10, "Checkpoint every N rounds.", above=0)
  max_concurrent_clients: int = setting(
    0,
    "Clients trained at once by the TFF runtime (<= 0: no limit; see benchmarks/RESULTS.md).",
  )
  workers: str = setting(
    "",
    "Run on TFF worker services at host:port,host:port (each started with `python -m "
    "tff_ens.worker --port=PORT`), clients split across them; empty: a local worker.",
  )
  client_runtime: str = setting(
    "tff",
    "Where clients train: tff (TFF's runtime), or litert: each sampled client's local epochs "
    "run in LiteRT, as on a phone, in processes of the device environment (`uv sync --locked "
    "--project device`), from a --format=trainable file of the run's model; "
    f"{', '.join(algorithms.ON_DEVICE_ALGORITHMS)} only (tff_ens/program/device_clients.py).",
    choices=device_clients.CLIENT_RUNTIMES,
  )
  device_processes: int = setting(
    2,
    "--client_runtime=litert: device processes (phones) training clients at once.",
    above=0,
  )
  resume: bool = setting(False, "Continue the run in --output_dir from its last checkpoint.")
