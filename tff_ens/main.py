r"""Command line: train a federated model and write its metrics and summary.

  python -m tff_ens.main --task=femnist --algorithm=fedavg --rounds=100 \
      --data_dir=../shared/data/femnist --output_dir=runs/fedavg

Its flags are the fields of `experiment.ExperimentConfig`, made by `settings.define_flags`:
those of every run, then each settings group's, which `--help` lists under the algorithms that
read it (`--helpfull`: absl's list).
"""

import dataclasses
import logging as std_logging
import os
import sys

from absl import app
from absl import flags
from absl import logging

from tff_ens.execution import cpp_log

cpp_log.quiet_unless_verbose(sys.argv)
# Before gRPC is imported: with fork support on (its core's default), gRPC registers
# pthread_atfork handlers, and a fork() of a process holding channels can wait forever in
# them. This process starts its own with vfork() (tff_ens/execution/worker_process.py), which runs
# none; this covers a fork() by other code.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

# TensorFlow must be imported before absl parses flags: Keras 2.14 imported
# inside `main` builds broken Sequential models ("Output tensors of a
# Sequential model must be the output of a TensorFlow `Layer`").
import tasks
from tasks import resnet
from tff_ens import algorithms
from tff_ens import run_files
from tff_ens import settings
from tff_ens.execution import worker_process
from tff_ens.program import client_states
from tff_ens.program import experiment
from tff_ens.program import run_settings
from tff_ens.program import training

settings.define_flags(experiment.ExperimentConfig)

FLAGS = flags.FLAGS
_HELP = ("--help", "-h", "-?", "--helpshort")


def usage() -> str:
  """`--help`: the flags every run has, then one section per settings group, headed by the
  algorithms that read it."""
  fields = {f.name: f for f in dataclasses.fields(experiment.ExperimentConfig)}
  lines = [__doc__.strip(), ""]
  tasks_of = {group: name for name, group in experiment.TASK_GROUPS.items()}
  groups = experiment.COMMON_GROUPS + tuple(tasks_of) + algorithms.SETTINGS_GROUPS
  for group in groups:
    if group in experiment.COMMON_GROUPS:
      title = "every run" if group is experiment.COMMON_GROUPS[0] else "every run, cont."
    elif group in tasks_of:
      title = f"--task={tasks_of[group]}"
    else:
      readers = [n for n, s in algorithms.REGISTRY.items() if group in s.settings]
      title = "--algorithm=" + ", ".join(readers)
    doc = (group.__doc__ or "").strip().splitlines()[0]
    lines.append(f"{title} ({doc.rstrip('.')}):")
    for name, field in fields.items():
      if settings.group_of(field) is group:
        spec = settings.declared(field)
        choices = f"; one of {', '.join(map(str, spec.choices))}" if spec.choices else ""
        lines.append(f"  --{name}: {spec.help} (default: {field.default!r}{choices})")
    lines.append("")
  return "\n".join(lines)


def _binary_recipe(values: dict) -> dict:
  """`resnet.BINARY_RECIPE`'s flags and its algorithm's (`Algorithm.binary_recipe`) that a
  run of a binarized model takes by default: those it did not give, and that its algorithm
  and client runtime use."""
  try:
    task = tasks.get_task(values["task"], values["classes"])
  except ValueError:  # The config's validation says so.
    return {}
  if values["model"] not in task.BINARY_MODEL_NAMES:
    return {}
  spec = algorithms.REGISTRY[values["algorithm"]]
  recipe = {**resnet.BINARY_RECIPE, **spec.binary_recipe(values)}
  if run_settings.on_devices(values["client_runtime"]):  # The device file trains with SGD.
    del recipe["client_optimizer"], recipe["client_lr"]
  # A distillation step measures each teacher's statistics (FedDF's on the Dirichlet split:
  # benchmarks/RESULTS.md).
  if not spec.recalibrates or values["norm"] != "batch":
    recipe["recalibrate_batch_norm"] = None
  recipe = {
    name: value for name, value in recipe.items() if value is not None and not FLAGS[name].present
  }
  if recipe:
    logging.warning(
      "--model=%s trains with its recipe (docs/algorithms.md): %s; a flag you pass overrides it",
      values["model"],
      " ".join(f"--{name}={value}" for name, value in recipe.items()),
    )
  return recipe


def config_of_flags() -> experiment.ExperimentConfig:
  """The run's config: the flags' values, with a binarized model's recipe (`_binary_recipe`)
  for the flags not given."""
  fields = {f.name for f in dataclasses.fields(experiment.ExperimentConfig)}
  config = experiment.ExperimentConfig(**{name: FLAGS[name].value for name in fields})
  return dataclasses.replace(config, **_binary_recipe(dataclasses.asdict(config)))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not FLAGS["verbosity"].present:
    std_logging.getLogger("tensorflow").setLevel(std_logging.ERROR)
    # On a terminal the progress bar reports; log lines would break it.
    logging.set_verbosity(logging.WARNING if sys.stderr.isatty() else logging.INFO)
  config = config_of_flags()
  try:
    summary = training.run_experiment(config)
  except (experiment.UsageError, tasks.DataError, client_states.ClientStateError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except worker_process.WorkerError as e:  # Lost mid-run; the message says resume.
    print(f"error: {e}", file=sys.stderr)
    return 1
  except experiment.Stopped as e:
    print(str(e), file=sys.stderr)
    return 128 + e.signum
  print(
    f"test_accuracy={summary['test_accuracy']:.4f} "
    f"summary={os.path.join(config.output_dir, run_files.SUMMARY_FILE)}"
  )
  return 0


if __name__ == "__main__":
  if any(arg in _HELP for arg in sys.argv[1:]):
    print(usage())
    sys.exit(0)
  app.run(main)
