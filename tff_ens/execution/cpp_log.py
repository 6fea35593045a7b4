"""TensorFlow's C++ log for the command lines, set before TensorFlow is imported.

TensorFlow's C++ log (CUDA factory registration, TensorRT, grappler lines) starts when
TensorFlow is imported, before absl parses flags, so `--verbosity` (absl's own flag) is read
here from `argv`. No TensorFlow import here.
"""

import argparse
import os


def level(argv: list[str]) -> str:
  """TF_CPP_MIN_LOG_LEVEL for a command: "3" (silent) unless `--verbosity` >= 1 asks for "0"."""
  parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
  parser.add_argument("--verbosity", "-v", type=int, default=0)
  try:
    verbosity = parser.parse_known_args(argv[1:])[0].verbosity
  except argparse.ArgumentError:  # absl reports the bad value.
    verbosity = 0
  return "0" if verbosity >= 1 else "3"


def quiet_unless_verbose(argv: list[str]) -> None:
  """Sets `level(argv)` unless the environment sets TF_CPP_MIN_LOG_LEVEL (which wins); the
  TFF workers the process starts inherit it."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", level(argv))
