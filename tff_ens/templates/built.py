"""What a process builder returns (`BuiltProcess`): the process, what one client downloads
and uploads in a round, and the models to evaluate."""

import dataclasses
from typing import Any, Callable

import tensorflow_federated as tff

ModelWeights = tff.learning.models.ModelWeights


@dataclasses.dataclass(frozen=True)
class BuiltProcess:
  """What a process builder returns.

  Attributes:
    process: the TFF process (`initialize`, `next`): a `tff.learning` process, a
      `tff.templates.IterativeProcess` or a `templates.server_step.DriverProcess`.
    download_type: what one client receives in a round (a TFF type).
    upload_type: what one client sends in a round.
    models_fn: `state -> list[ModelWeights]`, the model(s) to evaluate (one, or an
      ensemble's K).
    client_state_type: the TFF type of what each client keeps between its rounds (each
      client passes it with its data, `composition.client_inputs`; passed as values, `next`
      returns their new values last), or None.
  """

  process: Any
  download_type: tff.Type
  upload_type: tff.Type
  models_fn: Callable[[Any], list[ModelWeights]]
  client_state_type: tff.Type | None = None


def built_from_client_work(process, client_work, models_fn=None) -> BuiltProcess:
  """The `BuiltProcess` of a process whose clients all train one model with `client_work`
  (a `client_work.ClientWork`): a client receives its computation's parameters but for
  its own data (a sequence, sized 0) and sends back its result; `models_fn` defaults to
  the process's model (`get_model_weights`)."""
  client_update = client_work.client_update.type_signature
  return BuiltProcess(
    process,
    client_update.parameter,
    client_update.result,
    models_fn or (lambda state: [process.get_model_weights(state)]),
  )
