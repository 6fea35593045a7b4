"""What every benchmark writes: the machine, and its section of RESULTS.md."""

import dataclasses
import datetime
import os
import platform
import re
import shlex
import sys
import threading

from absl import app
from absl import flags
import psutil

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define_flags():
  """`--data_dir` (the FEMNIST slice) and `--results` (RESULTS.md)."""
  flags.DEFINE_string(
    "data_dir",
    os.path.join(REPO_ROOT, "..", "shared", "data", "femnist"),
    "LEAF FEMNIST directory.",
  )
  flags.DEFINE_string(
    "results",
    os.path.join(REPO_ROOT, "benchmarks", "RESULTS.md"),
    "Markdown file to write the section to; empty to only print.",
  )


def machine_description() -> dict[str, str]:
  """nproc, the CPU model (first CPU of /proc/cpuinfo) and the RAM."""
  cpuinfo = {}
  with open("/proc/cpuinfo") as f:
    for line in f:
      if not line.strip():
        break  # The first CPU only.
      key, _, value = line.partition(":")
      cpuinfo[key.strip()] = value.strip()
  cpu = cpuinfo.get("model name", platform.processor() or "unknown")
  if "cpu family" in cpuinfo and "model" in cpuinfo:
    cpu += f" (family {cpuinfo['cpu family']}, model {cpuinfo['model']})"
  ram = "unknown"
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemTotal:"):
        ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
        break
  return {"nproc": str(len(os.sched_getaffinity(0))), "cpu": cpu, "ram": ram}


def write_section(path: str, section: str, text: str):
  """Replaces (or appends) the section headed `section` of `path` by `text`."""
  if os.path.exists(path):
    with open(path) as f:
      content = f.read()
  else:
    content = "# Benchmarks\n"
  pattern = re.compile(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
  text = text.rstrip("\n") + "\n\n"
  if pattern.search(content):
    content = pattern.sub(lambda _: text, content, count=1)
  else:
    content = content.rstrip("\n") + "\n\n" + text
  with open(path, "w") as f:
    f.write(content.rstrip("\n") + "\n")


@dataclasses.dataclass(frozen=True)
class RunStart:
  """When a benchmark started (aware `datetime`) and the load average then."""

  started: datetime.datetime
  load: tuple[float, float, float]


def start(argv) -> RunStart:
  """A benchmark's `main` preamble: no positional arguments; the start."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  return RunStart(datetime.datetime.now().astimezone(), os.getloadavg())


def run_facts(run: RunStart, script: str, machine_note: str = ""):
  """The date, machine, command and load lines every results section has.

  Args:
    run: the run's `start`.
    script: the benchmark's path from the repository root.
    machine_note: appended to the machine line (e.g. ", no GPU").
  """
  machine = machine_description()
  return [
    f"- date: {run.started:%Y-%m-%d %H:%M %Z}",
    f"- machine: nproc={machine['nproc']}, {machine['cpu']}, RAM {machine['ram']}{machine_note}",
    f"- command (from the repository root): `uv run python {shlex.join([script, *sys.argv[1:]])}`",
    f"- load average at start: {', '.join(f'{x:.2f}' for x in run.load)}"
    f"; at end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
  ]


def cpu_seconds() -> float:
  """User + system CPU seconds of this process and its children (the TFF
  worker): less disturbed by other load on the machine than wall time."""
  me = psutil.Process()
  total = 0.0
  for process in [me] + me.children(recursive=True):
    try:
      times = process.cpu_times()
    except psutil.Error:  # A child that just exited.
      continue
    total += times.user + times.system
  return total


def publish(section: str, lines: list[str]) -> None:
  """Prints a results section and writes it into `--results` (if set)."""
  text = "\n".join(lines)
  print(text)
  if flags.FLAGS.results:
    write_section(flags.FLAGS.results, section, text)


def local_worker(parent: psutil.Process | None = None) -> psutil.Process:
  """The TFF `worker_binary` that `parent` (default: this process) started, below its
  launcher (`worker_process.start_worker`)."""
  parent = parent or psutil.Process()
  (worker,) = [c for c in parent.children(recursive=True) if c.name() == "worker_binary"]
  return worker


class PeakMemory:
  """The peak resident memory, sampled every `interval` seconds while entered, of this process
  or (with `children`) of its child processes together (TFF's worker)."""

  def __init__(self, children: bool = False, interval: float = 0.2):
    self.peak = 0
    self._children = children
    self._interval = interval
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)

  def _sample(self):
    me = psutil.Process()
    while not self._stop.wait(self._interval):
      try:
        processes = me.children(recursive=True) if self._children else [me]
        rss = sum(p.memory_info().rss for p in processes)
      except psutil.Error:
        continue
      self.peak = max(self.peak, rss)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def cli_command(variant: str, rounds: int, output_dir: str, *more_flags: str) -> list[str]:
  """The command of a CLI run of `variant` on the FEMNIST slice of `--data_dir`."""
  return [
    sys.executable,
    "-m",
    "tff_ens.main",
    "--task=femnist",
    f"--data_dir={flags.FLAGS.data_dir}",
    f"--rounds={rounds}",
    f"--output_dir={output_dir}",
    *variant_flags(variant),
    *more_flags,
  ]


def variant_flags(variant: str) -> list[str]:
  """The CLI flags of a variant `ALGORITHM[:K[:OBJECTIVE]]` (e.g. `fedensemble:5:feddyn`)."""
  algorithm, *rest = variant.split(":")
  args = [f"--algorithm={algorithm}"]
  if rest:
    args.append(f"--ensemble_size={rest[0]}")
  if len(rest) > 1:
    args.append(f"--local_objective={rest[1]}")
  return args


def peak_windows(start: int, rounds: int) -> tuple[range, range]:
  """The w rounds after round `start` and the last w of `rounds`, w = (rounds - start) // 2
  (both empty if w is 0)."""
  w = max(rounds - start, 0) // 2
  return range(start + 1, start + 1 + w), range(rounds + 1 - w, rounds + 1)


def peak_growth(during: dict[int, int], start: int, rounds: int) -> str:
  """The growth of the peak over the last rounds of `peak_windows` against the peak over
  the first, `during[r]` a process's peak during round r: with the held state copied every
  few rounds (`--worker_growth_mib`), a sample after a round reads where that round fell
  between two copies; a window's peak does not, for copies at most a window apart."""
  first, last = (
    max((during.get(r, 0) for r in window), default=0) for window in peak_windows(start, rounds)
  )
  return f"{100 * (last / first - 1):+.0f}%" if first and last else "-"
