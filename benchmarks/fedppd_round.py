r"""Client work of FedPPD against FedAvg's on the same clients.

  uv run python benchmarks/fedppd_round.py [--clients=3] [--epochs=1] \
      [--batch_size=64] [--passes=2] [--results=]

The first `--clients` FEMNIST writers, each trained once by FedAvg's client
update (`client_work.build_client_work`, LEAF CNN, SGD 0.05) and once by
FedPPD's (`fedppd.build_client_work`, LEAF CNN teacher and student, the default
`PosteriorConfig`, as `--algorithm=fedppd --student_model=cnn`), one client at a
time, in one TFF worker, the two in turn for `--passes` passes after one untimed
call of each (tracing, graph instantiation), so that slow periods of a shared
machine fall on both. Per variant: the median over passes of the summed wall
seconds and of the worker's CPU seconds (user + system) over the clients, and
their ratio to FedAvg's. Per minibatch FedPPD does an SGLD step of the teacher
(forward, backward and a Gaussian draw per weight), the teacher's forward pass on
the student's minibatch and an SGD step of the student.
Writes the section "## FedPPD client work" of `--results`.
"""

import statistics
import time

from absl import app
from absl import flags
import numpy as np
import psutil
import tensorflow as tf
import tensorflow_federated as tff

import report
from tasks import femnist
from tff_ens.algorithms import fedppd
from tff_ens.execution import runtime
from tff_ens.math import fedppd_local
from tff_ens.program import simulation
from tff_ens.templates import client_work

SECTION = "## FedPPD client work"

report.define_flags()
flags.DEFINE_integer("clients", 3, "Writers trained by each variant.")
flags.DEFINE_integer("epochs", 1, "Local epochs.")
flags.DEFINE_integer("batch_size", 64, "Local batch size.")
flags.DEFINE_integer("passes", 2, "Timed passes over the clients, the variants in turn.")

FLAGS = flags.FLAGS

ModelWeights = tff.learning.models.ModelWeights


def worker_cpu_seconds(worker: psutil.Process) -> float:
  """User + system CPU seconds of the TFF worker."""
  times = worker.cpu_times()
  return times.user + times.system


def main(argv):
  run = report.start(argv)
  data = femnist.load_data(FLAGS.data_dir)
  writers = data.train.client_ids[: FLAGS.clients]
  examples = sum(len(data.train.y[c]) for c in writers)

  def datasets():
    return [
      simulation.client_dataset(
        data.train.x[c], data.train.y[c], epochs=FLAGS.epochs, batch_size=FLAGS.batch_size, seed=i
      )
      for i, c in enumerate(writers)
    ]

  element_spec = simulation.batch_element_spec(femnist)
  teacher_fn = lambda: femnist.build_model("cnn", seed=0)
  student_fn = lambda: femnist.build_model("cnn", seed=7919)
  fedavg_update = client_work.build_client_work(
    teacher_fn, element_spec, client_work.LocalTrainingConfig()
  ).client_update
  fedppd_update = fedppd.build_client_work(
    teacher_fn,
    student_fn,
    element_spec,
    fedppd_local.PosteriorConfig(epochs=FLAGS.epochs, max_update_norm=0.0, seed=0),
    fedppd.joint_weights_type(teacher_fn, student_fn),
  ).client_update
  to_numpy = lambda weights: tf.nest.map_structure(lambda v: v.numpy(), weights)
  teacher = ModelWeights.from_model(teacher_fn())
  student = ModelWeights.from_model(student_fn())
  variants = {
    "fedavg": lambda d: fedavg_update(to_numpy(teacher), d, np.float32(0.05)),
    "fedppd": lambda d: fedppd_update(to_numpy(fedppd.join(teacher, student)), d, np.int32(0)),
  }
  wall = {name: [] for name in variants}
  cpu = {name: [] for name in variants}
  with runtime.execution_context(max_concurrent_computation_calls=1):
    worker = report.local_worker()
    for update in variants.values():
      update(datasets()[0])
    for p in range(FLAGS.passes):
      for name, update in variants.items():
        clients = datasets()
        start, start_cpu = time.perf_counter(), worker_cpu_seconds(worker)
        for dataset in clients:
          update(dataset)
        wall[name].append(time.perf_counter() - start)
        cpu[name].append(worker_cpu_seconds(worker) - start_cpu)
        print(f"pass {p + 1}, {name}: {wall[name][-1]:.1f} s, CPU {cpu[name][-1]:.1f} s")
  base_wall = statistics.median(wall["fedavg"])
  base_cpu = statistics.median(cpu["fedavg"])
  lines = [
    SECTION,
    "",
    f"The first {FLAGS.clients} FEMNIST writers ({examples} examples, {FLAGS.epochs} "
    f"epoch(s), batch {FLAGS.batch_size}), one client at a time in one TFF worker: FedAvg's "
    "client update (LEAF CNN) and FedPPD's (LEAF CNN teacher and student, "
    f"`--student_model=cnn`), in turn for {FLAGS.passes} passes after one untimed call; "
    "the median over passes of the seconds summed over the clients, wall and the worker's "
    "CPU (user + system; less disturbed by other load than wall time).",
    "",
    *report.run_facts(run, "benchmarks/fedppd_round.py"),
    "",
    "| client work | wall s | ratio | worker CPU s | CPU ratio |",
    "| --- | ---: | ---: | ---: | ---: |",
  ]
  for name in variants:
    w, c = statistics.median(wall[name]), statistics.median(cpu[name])
    lines.append(f"| {name} | {w:.1f} | {w / base_wall:.2f} | {c:.1f} | {c / base_cpu:.2f} |")
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
