"""A mergeable form's `merge` run in this process (`LocalMerge`), not on a worker.

A chunked round merges two partial aggregates after each chunk. On a worker, each merge
sends both there and the sum back, for an elementwise sum; for Fed-ensemble's K members
that was half of a chunked round's time (benchmarks/RESULTS.md, "Where a chunk's time
goes"). The merge is local processing alone, so TFF's MapReduce compiler consolidates it
into one TensorFlow computation (`consolidate_and_extract_local_processing`), imported
once into a graph of this process (`tensorflow_utils.deserialize_and_call_tf_computation`).
"""

from collections.abc import Mapping

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.core.backends.mapreduce import compiler as mapreduce_compiler
from tensorflow_federated.python.core.impl.utils import tensorflow_utils


def _placeholders(type_spec):
  """A `tff.structure.Struct` of placeholders with `type_spec`'s names, dtypes and shapes."""
  if isinstance(type_spec, tff.TensorType):
    return tf.compat.v1.placeholder(type_spec.dtype, type_spec.shape)
  return tff.structure.Struct(
    [(name, _placeholders(t)) for name, t in tff.structure.iter_elements(type_spec)]
  )


def _leaves(value, type_spec) -> list:
  """`value`'s arrays in `type_spec`'s order, whatever containers hold them (a `Struct`, a
  list or tuple, a mapping, an attrs class)."""
  if isinstance(type_spec, tff.TensorType):
    return [np.asarray(value)]
  leaves = []
  for i, (name, element_type) in enumerate(tff.structure.iter_elements(type_spec)):
    if isinstance(value, Mapping):
      element = value[name]
    elif isinstance(value, (tff.structure.Struct, list, tuple)):
      element = value[i]
    else:
      element = getattr(value, name)
    leaves += _leaves(element, element_type)
  return leaves


class LocalMerge:
  """`merge(a, b)`: the mergeable form's `merge` of two partial aggregates, computed in this
  process's TensorFlow and returned as a `tff.structure.Struct` of NumPy arrays."""

  def __init__(self, merge: tff.Computation):
    proto = mapreduce_compiler.consolidate_and_extract_local_processing(
      merge.to_building_block(), tf.compat.v1.ConfigProto()
    ).proto
    self._type = merge.type_signature.parameter
    self._graph = tf.Graph()
    with self._graph.as_default():
      self._parameter = _placeholders(self._type)
      self._token = tf.compat.v1.placeholder(tf.string, [])
      init_op, self._result = tensorflow_utils.deserialize_and_call_tf_computation(
        proto, self._parameter, self._graph, "", self._token
      )
    self._session = tf.compat.v1.Session(graph=self._graph)
    if init_op:
      self._session.run(init_op, {self._token: "local_merge"})

  def __call__(self, a, b) -> tff.structure.Struct:
    values = _leaves(tff.structure.Struct.unnamed(a, b), self._type)
    feed = dict(zip(tff.structure.flatten(self._parameter), values))
    feed[self._token] = "local_merge"
    merged = self._session.run(tff.structure.flatten(self._result), feed)
    return tff.structure.pack_sequence_as(self._result, merged)
