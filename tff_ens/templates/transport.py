"""How what clients keep between their rounds and what a server step collects pass between the
program and TFF's worker: as values through TFF's executor, or as files the worker reads and
writes. The program chooses (`--client_transport`) and hands builders a `Transport`, whose
methods build the stages that move them; a builder calls them and never branches on the
choice.
"""

import dataclasses

import tensorflow_federated as tff

from tff_ens.templates import client_work as client_work_lib
from tff_ens.templates import server_step
from tff_ens.templates import stateful_client_work


@dataclasses.dataclass(frozen=True)
class Transport:
  """The stages that move clients' states and collected updates.

  Attributes:
    files: the clients' states stay in files that their computations read and write
      (`stateful_client_work.through_files`) and collected updates reach the driver as files
      (`server_step.build_collect`): TFF's worker must see this machine's files. False:
      values through TFF's executor (any worker).
  """

  files: bool = False

  def stateful_client_work(
    self,
    client_update: tff.Computation,
    config: client_work_lib.LocalTrainingConfig,
    finalize: tff.Computation | None = None,
  ) -> stateful_client_work.StatefulClientWork:
    """`stateful_client_work.build`'s stage of `client_update`, its states moved this way."""
    return stateful_client_work.build(client_update, config, finalize, state_files=self.files)

  def collect(self, initial_model_fn, distributor, client_work, capacity: int, *, keyed=False):
    """`server_step.build_collect`'s stages, the collected updates moved this way."""
    return server_step.build_collect(
      initial_model_fn, distributor, client_work, capacity, keyed=keyed, upload_files=self.files
    )


# Values through TFF's executor: what a library user's process takes by default.
VALUES = Transport(files=False)
FILES = Transport(files=True)
