"""The settings every run has, declared once: `RunSettings`.

Each field is a flag of `python -m tff_ens.main` and a key of a run's `config.json`, declared
with its default, its help, and its choices (the modules' own constants) or bounds
(`settings.setting`). The settings of the clients' training, the split, DP and active learning
are declared by the library configs that read them, and an algorithm's by its module
(`experiment.ExperimentConfig` composes them all).
"""

import dataclasses

import tasks
from tasks import resnet
from tff_ens import algorithms
from tff_ens.algorithms import algorithm as algorithm_lib
from tff_ens.execution import resident_state
from tff_ens.execution import tls
from tff_ens.execution import worker_process
from tff_ens.settings import setting

# --client_runtime: TFF's runtime, or devices' (LiteRT in Python, or LiteRT.js in browsers)
# for the clients' local training.
TFF_RUNTIME, DEVICE_RUNTIME, BROWSER_RUNTIME = "tff", "litert", "browser"
# --client_transport: clients' states and collected updates as files or values.
FILES, VALUES = "files", "values"


def on_devices(client_runtime: str) -> bool:
  """Whether `--client_runtime` trains the clients on devices (`device_clients`, or
  `browser_clients` in browsers)."""
  return client_runtime in (DEVICE_RUNTIME, BROWSER_RUNTIME)


def in_browsers(client_runtime: str) -> bool:
  """Whether `--client_runtime`'s devices are browser pages (`browser_clients`)."""
  return client_runtime == BROWSER_RUNTIME


ALGORITHM_HELP = (
  "; ".join(f"{name}: {spec.summary}" for name, spec in algorithms.REGISTRY.items())
  + " (docs/algorithms.md)."
)


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """The settings every run has, whatever its algorithm: its task, model, clients, faults and
  files (`experiment.ExperimentConfig` adds the other groups' and checks them)."""

  # The task and its clients.
  task: str = setting(tasks.DEFAULT_TASK, "The task (docs/tasks.md).", choices=tasks.TASKS)
  classes: str = setting(
    tasks.DEFAULT_CLASSES,
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

  # The algorithm, the model and the clients' rounds.
  # The registry's first algorithm is the default (FedAvg).
  algorithm: str = setting(algorithms.ALGORITHMS[0], ALGORITHM_HELP, choices=algorithms.ALGORITHMS)
  model: str | None = setting(
    None,
    "Model: cnn (FEMNIST: LEAF CNN; CIFAR: FedBE's ConvNet), resnet8, resnet20, resnet32 "
    "(CIFAR), lstm (Shakespeare). Unset: the task's first (cnn; Shakespeare: lstm).",
  )
  norm: str = setting("batch", "Normalization layers of ResNets.", choices=resnet.NORMS)
  rounds: int = setting(100, "Communication rounds.", above=0)
  # The library's defaults (`algorithm.BuildContext`), which a library user's build takes.
  clients_per_round: int = setting(
    algorithm_lib.BuildContext.clients_per_round, "Clients sampled per round.", above=0
  )
  client_epochs: int = setting(1, "Local epochs per round.", above=0)
  batch_size: int = setting(20, "Local batch size.", above=0)
  client_steps: int = setting(
    0,
    "At most this many local steps (batches) a round, of --client_epochs epochs (0: all of "
    "them); for clients with much data, such as Shakespeare's.",
    at_least=0,
  )

  # The server's data and evaluation.
  recalibrate_batch_norm: int = setting(
    0,
    "Measure batch-norm statistics on this many of the server's unlabeled images "
    "(--server_data), drawn once: the FedAvg family the new model's each round instead of "
    "the clients' average; FedBE, FedDF and v-Distillation each teacher's and the weight "
    "average's before they label or start the student. 0: the clients' own. Part of the "
    "binarized ResNets' recipe (docs/algorithms.md).",
    at_least=0,
  )
  personalization_temperature: float = setting(
    0.0,
    "Ensembles: tau of personalized weights softmax(-loss/tau) (Fed-ensemble eq. 4); 0 chooses "
    "it from training data.",
    at_least=0,
  )
  personalization_samples: int = setting(
    200,
    "Ensembles: personalized weights (and tau) from at most N of each client's training "
    "examples, a seeded subsample (0: all); it bounds the summary's cost on clients with much "
    "data, such as Shakespeare's.",
    at_least=0,
  )
  server_data: str | None = setting(
    None,
    "The server's unlabeled data (FedBE, FedDF, batch-norm recalibration): a LEAF directory, a "
    ".npz with x, or a .npy of images "
    "(streamed from disk, not loaded: for sets larger than memory). Default: the task's "
    "(FEMNIST: writers with test data only; CIFAR: --server_unlabeled_examples set aside; see"
    " tff_ens/server/server_data.py).",
  )

  # Faults.
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

  # The run.
  seed: int = setting(algorithm_lib.BuildContext.seed, "Seed of models, client sampling and data.")
  output_dir: str = setting("runs/femnist", "Where outputs go.")
  eval_every: int = setting(10, "Evaluate on test data every N rounds.", above=0)
  checkpoint_every: int = setting(10, "Checkpoint every N rounds.", above=0)
  max_concurrent_clients: int = setting(
    worker_process.NO_CLIENT_LIMIT,
    "Clients trained at once by the TFF runtime (<= 0: no limit; see benchmarks/RESULTS.md).",
  )
  clients_per_chunk: int = setting(
    10,
    "A round of more clients than this trains and aggregates them in chunks of at most this "
    "many, one after another on each worker, each chunk's partial aggregate merged before the "
    "next (TFF's mergeable form), so that a worker holds one chunk's client values: memory "
    "set by the chunk, not the cohort; the same numbers up to float summation order "
    "(benchmarks/RESULTS.md); 0: every round in one call.",
    at_least=0,
  )
  worker_growth_mib: int = setting(
    resident_state.MAX_GROWTH_BYTES // 2**20,
    "The state waiting on the local TFF worker between rounds is copied there afresh (which "
    "frees what earlier rounds left behind it) every N rounds, N the most rounds the worker "
    "grew within this many MiB (at least 1), or every round (0): less memory, slower rounds "
    "(benchmarks/RESULTS.md).",
    at_least=0,
  )
  workers: str = setting(
    "",
    "Run on TFF worker services at host:port,host:port (each started with `python -m "
    "tff_ens.worker --port=PORT --credentials=DIR`), clients split across them, over mutual "
    "TLS (--worker_credentials); empty: a local worker.",
  )
  worker_credentials: str = setting(
    "",
    "Directory of the driver's TLS credentials for --workers (ca.pem, driver.pem, driver.key: "
    f"`{tls.MAKE_COMMAND}`); workers on loopback addresses may also be reached without, "
    "when they were started with --insecure_loopback (docs/security.md).",
  )
  local_worker: str = setting(
    "isolated",
    "The local TFF worker (without --workers): isolated, in a network namespace of its own "
    "that only this run reaches, through a socket only its user can open; or open, listening "
    "on a TCP port of all interfaces without credentials, as TFF starts it: any local user "
    "or host that reaches the port runs code as you (docs/security.md).",
    choices=worker_process.ISOLATIONS,
  )
  client_transport: str = setting(
    FILES,
    "How what clients keep between rounds (FedDyn's g, personal models, clients' own layers) "
    "and the models a server step collects (server distillation) pass "
    "between this program and TFF's worker: files (the worker reads and writes them in "
    "OUTPUT_DIR/client_states and this machine's temporary directory, so it must run on this "
    "machine), or values through TFF's executor (any worker; slower for states, and a "
    "collect holds about ten copies of each client's model in the worker).",
    choices=(FILES, VALUES),
  )
  client_runtime: str = setting(
    TFF_RUNTIME,
    "Where clients train: tff (TFF's runtime), or litert: each sampled client's local epochs "
    "run in LiteRT, as on a phone, in processes of the device environment (`uv sync --locked "
    "--project device`), from a --format=trainable file of the run's model; or browser: the "
    "same in LiteRT.js, in browser pages (--browser_clients); "
    f"{', '.join(algorithms.having('on_device'))} only (tff_ens/program/device_clients.py, "
    "browser_clients.py).",
    choices=(TFF_RUNTIME, DEVICE_RUNTIME, BROWSER_RUNTIME),
  )
  device_processes: int = setting(
    2,
    "--client_runtime=litert: device processes (phones) training clients at once; "
    "--client_runtime=browser: browser pages.",
    above=0,
  )
  browser_clients: str = setting(
    "headless",
    "--client_runtime=browser: headless (--device_processes pages of this machine's "
    "headless Chromium), or HOST:PORT: listen there (0.0.0.0:PORT for phones on this "
    "network), print the page's URL with the run's secret token and a QR code, and wait "
    "until --device_processes browsers have opened it (docs/export.md).",
  )
  browser_task_seconds: float = setting(
    600.0,
    "--client_runtime=browser: a page that has not returned its client's training this many "
    "seconds after receiving it is dropped from the round, as a closed page is (0: no limit).",
    at_least=0,
  )
  resume: bool = setting(False, "Continue the run in --output_dir from its last checkpoint.")
  stop_grace_seconds: float = setting(
    0.0,
    "The first SIGTERM or Ctrl-C stops the run after its round; a second one, or this many "
    "seconds after the first (0: never), stops it at once. Either way it continues from its "
    "last checkpoint with --resume.",
    at_least=0,
  )


# The parts of `RunSettings` each program module reads, built once by `experiment.resolve`.


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The loop's: the rounds, the cohort, when it evaluates and saves, how it stops."""

  rounds: int
  clients_per_round: int
  seed: int
  eval_every: int
  checkpoint_every: int
  stop_grace_seconds: float
  worker_growth_mib: int


@dataclasses.dataclass(frozen=True)
class ClientRounds:
  """How a round's clients train and fail (`simulation.plan_round`, `client_dataset`)."""

  epochs: int
  batch_size: int
  max_steps: int
  dropout_rate: float
  straggler_rate: float
  aggregate_first: int
  nan_clients: int


@dataclasses.dataclass(frozen=True)
class Execution:
  """Where the clients' computations run (`runtime.execution_context`)."""

  workers: tuple[str, ...]
  credentials_dir: str | None
  local_worker: str
  max_concurrent_clients: int
  clients_per_chunk: int


@dataclasses.dataclass(frozen=True)
class Devices:
  """Clients trained on devices (`device_clients`, `browser_clients`): how many at once, in
  which `--client_runtime`, and where browsers connect (`--browser_clients`)."""

  processes: int
  runtime: str
  browser_clients: str
  task_seconds: float | None  # A browser page's deadline for a task; None: no limit.

  @property
  def in_browsers(self) -> bool:
    return in_browsers(self.runtime)


@dataclasses.dataclass(frozen=True)
class Model:
  """The run's model: its name, its ResNets' normalization, the seed of its weights."""

  name: str
  norm: str
  seed: int


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """The summary's: personalized weights (Fed-ensemble eq. 4) and the run's title."""

  personalization_samples: int
  personalization_temperature: float
  seed: int
  title: str


@dataclasses.dataclass(frozen=True)
class Outputs:
  """The output directory's (`run_outputs`): where, whether to resume, what config.json holds
  (`flags`), and why a resume may not change `rounds` (None: it may)."""

  directory: str
  resume: bool
  rounds: int
  flags: dict
  fixed_rounds_reason: str | None
  algorithm: str
  model: str


def fixed_rounds_reason(config) -> str | None:
  """Why `--rounds` must stay as the run started it on `--resume`, or None.

  Client sampling, data order and every algorithm's state depend on the seed and the
  round only, so a resumed run may end at another round (a finished run continues to more
  rounds) unless a schedule spans the rounds.
  """
  if config.lr_schedule != "constant":
    return f"--lr_schedule={config.lr_schedule} spans them"
  if config.active_learning_rounds:
    return "--active_learning_rounds divides them into phases"
  return None


def parts_of(config) -> dict:
  """The parts of `RunSettings` each program module reads, from the flat config (`config`,
  an `experiment.ExperimentConfig`): `experiment.Run`'s attributes, built by
  `experiment.resolve` alone."""
  return dict(
    data_dir=config.data_dir,
    model=Model(config.model, config.norm, config.seed),
    schedule=Schedule(
      rounds=config.rounds,
      clients_per_round=config.clients_per_round,
      seed=config.seed,
      eval_every=config.eval_every,
      checkpoint_every=config.checkpoint_every,
      stop_grace_seconds=config.stop_grace_seconds,
      worker_growth_mib=config.worker_growth_mib,
    ),
    clients=ClientRounds(
      epochs=config.client_epochs,
      batch_size=config.batch_size,
      max_steps=config.client_steps,
      dropout_rate=config.dropout_rate,
      straggler_rate=config.straggler_rate,
      aggregate_first=config.aggregate_first,
      nan_clients=config.nan_clients_per_round,
    ),
    execution=Execution(
      workers=tuple(config.worker_addresses()),
      credentials_dir=config.worker_credentials or None,
      local_worker=config.local_worker,
      max_concurrent_clients=config.max_concurrent_clients,
      clients_per_chunk=config.clients_per_chunk,
    ),
    devices=(
      Devices(
        config.device_processes,
        config.client_runtime,
        config.browser_clients,
        config.browser_task_seconds or None,
      )
      if config.on_devices
      else None
    ),
    transport=config.transport,
    server_data=config.server_data,
    recalibrate_batch_norm=config.recalibrate_batch_norm,
    evaluation=Evaluation(
      personalization_samples=config.personalization_samples,
      personalization_temperature=config.personalization_temperature,
      seed=config.seed,
      title=(
        f"{config.algorithm}, {config.task} ({config.classes} classes), "
        f"seed {config.seed}, {config.rounds} rounds"
      ),
    ),
    outputs=Outputs(
      directory=config.output_dir,
      resume=config.resume,
      rounds=config.rounds,
      flags=dataclasses.asdict(config),
      fixed_rounds_reason=fixed_rounds_reason(config),
      algorithm=config.algorithm,
      model=config.model,
    ),
  )
