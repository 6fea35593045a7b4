r"""The driver's memory and time to load a LEAF FEMNIST: images read from disk or held.

  uv run python benchmarks/leaf_loading.py --data_dir=/work/fullsize/femnist [--writers=1000]

Each variant runs in a fresh process of its own (NumPy and `tasks.leaf` only), one after
the other: the first load with an empty cache (the JSON files parsed into it), a later load
from the cache (`data.ExamplesOnDisk`: the images read when asked for), and that load with
every image then held in memory as dicts (what the driver held before the cache: the same
arrays). After the load, each reads the images of the first `--writers` training writers,
as a round's cohorts do. It prints, per variant, the load's seconds, the resident memory
after the load and after the reads, and the process's peak. Writes the section
"## Loading FEMNIST: images read from disk" of `--results`.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

import report

SECTION = "## Loading FEMNIST: images read from disk"
report.define_flags()
flags.DEFINE_integer("writers", 1000, "Training writers whose images each variant reads.")
FLAGS = flags.FLAGS

# One variant in its own process: argv data_dir, writers, hold ("1" keeps every image).
_LOAD = """
import json, resource, sys, time
from tasks import leaf

def resident_gib():
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 2**20

data_dir, writers, hold = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
start = time.perf_counter()
data = leaf.load_leaf(data_dir)
if hold:
  held = [{c: split.x[c] for c in split.client_ids} for split in (data.train, data.test)]
seconds = time.perf_counter() - start
after_load = resident_gib()
examples = sum(len(data.train.x[c]) for c in data.train.client_ids[:writers])
print(json.dumps({
  "seconds": seconds, "after_load": after_load, "after_reads": resident_gib(),
  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
  "writers": len(data.train.client_ids), "examples_read": examples,
}))
"""

VARIANTS = (
  ("first load: the JSON parsed into the cache", "0"),
  ("later load: images read from the cache when asked for", "0"),
  ("later load, every image then held in memory (as before the cache)", "1"),
)


def _measure(cache_dir: str, hold: str) -> dict:
  done = subprocess.run(
    [sys.executable, "-c", _LOAD, FLAGS.data_dir, str(FLAGS.writers), hold],
    cwd=report.REPO_ROOT,
    env={**os.environ, "TFF_ENS_CACHE_DIR": cache_dir},
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(done.stdout.splitlines()[-1])


def main(argv):
  run = report.start(argv)
  with tempfile.TemporaryDirectory(prefix="tff_ens_leaf_cache_") as cache_dir:
    rows = [(name, _measure(cache_dir, hold)) for name, hold in VARIANTS]
  writers, examples = rows[0][1]["writers"], rows[0][1]["examples_read"]
  lines = [
    SECTION,
    "",
    *report.run_facts(run, "benchmarks/leaf_loading.py"),
    f"- data: {FLAGS.data_dir}, {writers:,} training writers; each variant reads the images "
    f"of the first {FLAGS.writers:,} ({examples:,} examples) after its load",
    "",
    "| variant | load s | resident GiB after the load | after the reads | peak GiB |",
    "| --- | ---: | ---: | ---: | ---: |",
    *(
      f"| {name} | {m['seconds']:.1f} | {m['after_load']:.2f} | {m['after_reads']:.2f} | "
      f"{m['peak']:.2f} |"
      for name, m in rows
    ),
  ]
  report.publish(SECTION, lines)


if __name__ == "__main__":
  app.run(main)
