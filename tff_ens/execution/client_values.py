"""A CLIENTS-placed argument whose values are made when TFF sends them: `ClientValues`.

TFF's contexts take a CLIENTS-placed argument as a Python list. A round in chunks
(`runtime.execution_context(clients_per_chunk=...)`, TFF's mergeable form) slices it into
the chunks' arguments first and converts each chunk's when its call starts, so a list whose
elements are made on access holds one chunk's values at a time, not the cohort's: a round's
client data then cost the driver a chunk's memory whatever the cohort's size. It is a
`list` for TFF's type checks (`infer_cardinalities` asks for one); a slice is another such
list, and a list rebuilt from values (dm-tree's map over a sequence) holds them.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any


class ClientValues(list):
  """`make(i)` for each i of `indices`, made each time it is read (module docstring)."""

  def __init__(self, make: Callable[[int], Any] | Iterable, indices: Sequence[int] | None = None):
    super().__init__()
    if indices is None:  # Rebuilt from its values.
      values = list(make)
      make, indices = values.__getitem__, range(len(values))
    self._make, self._indices = make, list(indices)

  def __len__(self) -> int:
    return len(self._indices)

  def __iter__(self):
    return (self._make(i) for i in self._indices)

  def __getitem__(self, key):
    if isinstance(key, slice):
      return ClientValues(self._make, self._indices[key])
    return self._make(self._indices[key])

  def __bool__(self) -> bool:
    return bool(self._indices)

  def __repr__(self) -> str:
    return f"ClientValues({len(self)} values)"

  def mapped(self, function: Callable[[int, Any], Any]) -> "ClientValues":
    """`function(k, value k)` for each of its values, made when read."""
    return ClientValues(lambda k: function(k, self[k]), range(len(self)))
