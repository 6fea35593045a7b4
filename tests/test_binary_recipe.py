"""The binarized ResNets' recipe (`tasks.resnet.BINARY_RECIPE`): the CLI's defaults for a
binarized model, given flags kept, and only what the run's algorithm and runtime use; and
the CLI's choices, which come from the modules' constants."""

import dataclasses

from absl.testing import flagsaver
import pytest

from tasks import resnet
from tests.femnist_runs import QUICK
from tff_ens import algorithms
from tff_ens import main as cli
from tff_ens import run_files
from tff_ens.algorithms import fed_ensemble
from tff_ens.math import weight_posterior
from tff_ens.program import active_learning
from tff_ens.program import experiment
from tff_ens.program import training
from tff_ens.templates import client_work


def recipe(**flags):
  cli.FLAGS.mark_as_parsed()
  with flagsaver.as_parsed(**flags):
    fields = {f.name for f in dataclasses.fields(experiment.ExperimentConfig)}
    return cli._binary_recipe({name: cli.FLAGS[name].value for name in fields})


@pytest.mark.parametrize("model", ["resnet8_binary", "resnet20_binary"])
@pytest.mark.parametrize("algorithm", ["fedavg", "feddf", "fedbe"])
def test_a_binarized_run_takes_the_whole_recipe(model, algorithm):
  expected = {**resnet.BINARY_RECIPE, **algorithms.REGISTRY[algorithm].binary_recipe({})}
  assert recipe(model=model, algorithm=algorithm) == expected


def test_feddf_keeps_the_weight_average_for_binarized_models_only():
  assert recipe(model="resnet8_binary", algorithm="feddf")["distill_keep_initial"] is True
  assert "distill_keep_initial" not in recipe(model="resnet8_binary", algorithm="fedbe")
  assert recipe(model="resnet8", algorithm="feddf") == {}


def test_a_flag_given_is_kept():
  got = recipe(model="resnet8_binary", client_lr="0.01", recalibrate_batch_norm="0")
  assert got == {"client_optimizer": "adam"}
  got = recipe(model="resnet8_binary", algorithm="feddf", distill_keep_initial="false")
  assert "distill_keep_initial" not in got


@pytest.mark.parametrize(
  "flags, expected",
  [
    (
      {"algorithm": "feddf", "prototypes": "resnet8_binary,cnn"},
      ["client_optimizer", "client_lr", "distill_keep_initial"],
    ),
    ({"algorithm": "fedppd"}, ["client_optimizer", "client_lr"]),
    ({"norm": "group"}, ["client_optimizer", "client_lr"]),
    ({"client_runtime": "litert"}, ["recalibrate_batch_norm"]),
  ],
)
def test_only_what_the_run_uses(flags, expected):
  whole = {**resnet.BINARY_RECIPE, **algorithms.REGISTRY["feddf"].binary_recipe({})}
  assert recipe(model="resnet8_binary", **flags) == {name: whole[name] for name in expected}


@pytest.mark.parametrize("model", ["cnn", "resnet8"])
def test_float_models_keep_the_flags_defaults(model):
  assert recipe(model=model) == {}


def test_the_recipe_trains_a_valid_config():
  config = experiment.ExperimentConfig(model="resnet8_binary", **resnet.BINARY_RECIPE)
  config.validate()


@pytest.mark.parametrize(
  "flags, message",
  [
    ({"recalibrate_batch_norm": -1}, r"--recalibrate_batch_norm must be >= 0"),
    (
      {"recalibrate_batch_norm": 5, "algorithm": "fedppd"},
      r"--recalibrate_batch_norm=5: fedppd does not measure batch-norm statistics on server "
      r"images: use one of fedavg, fedprox, fedavgm, fedadam, .*fedbe, feddf, vdistill",
    ),
    (
      {"client_optimizer": "adam", "client_momentum": 0.9},
      r"--client_momentum must be 0 with the adam optimizer, which keeps its own moments, "
      r"got 0.9",
    ),
    ({"client_optimizer": "lamb"}, r"unknown --client_optimizer=lamb: choose one of sgd, adam"),
  ],
)
def test_bad_recipe_flags_are_one_line_usage_errors(flags, message):
  with pytest.raises(experiment.UsageError, match=message):
    dataclasses.replace(QUICK, **flags).validate()


@pytest.mark.parametrize(
  "flags, message",
  [
    (
      {"recalibrate_batch_norm": 5},
      r"--model=cnn --norm=batch has no batch norm to recalibrate: drop the flag",
    ),
    (
      {"recalibrate_batch_norm": 10**6, "model": "resnet8_binary"},
      r"--recalibrate_batch_norm=1000000 exceeds the server's \d+ unlabeled images "
      r"\(.*test-only writers.*\): use at most \d+$",
    ),
  ],
)
def test_recalibration_the_run_cannot_do_is_a_usage_error(tmp_path, flags, message):
  config = dataclasses.replace(QUICK, output_dir=str(tmp_path / "run"), **flags)
  with pytest.raises(experiment.UsageError, match=message):
    training.run_experiment(config)
  assert not (tmp_path / "run" / run_files.METRICS_FILE).exists()


def test_cli_choices_are_the_modules_own_constants():
  # --help lists every algorithm and each enum's choices from the module that defines them.
  assert all(name in cli.FLAGS["algorithm"].help for name in algorithms.ALGORITHMS)
  for flag, choices in (
    ("norm", resnet.NORMS),
    ("lr_schedule", client_work.LR_SCHEDULES),
    ("client_optimizer", client_work.OPTIMIZERS),
    ("assignment", fed_ensemble.ASSIGNMENTS),
    ("member_average", fed_ensemble.MEMBER_AVERAGES),
    ("local_objective", fed_ensemble.LOCAL_OBJECTIVES),
    ("fedbe_distribution", weight_posterior.DISTRIBUTIONS),
    ("fedbe_targets", weight_posterior.TARGETS),
    ("active_selection", active_learning.SELECTIONS),
  ):
    assert cli.FLAGS[flag].parser.enum_values == list(choices), flag
