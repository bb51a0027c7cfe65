"""Moving the host parts of the shards between the devices and host memory.

Gradients leave the device step as outputs in pinned host memory (XLA
copies them at PCIe speed as soon as they are ready) and are read here as
zero-copy numpy views. New low-precision weights go back from staging
buffers registered for DMA once, so the copy runs at PCIe speed instead of
through a bounce buffer, leaf by leaf as the host update finishes each one,
into flat device arrays of the host parts (`LeafLayout.part_shape(k - c)`);
the step module writes those into the params.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from typing import Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jzo.partition import LeafLayout, is_layout


class Shards(tuple):
  """The per-device pieces of one leaf (a pytree leaf, not a node)."""


class ShardTransfer:
  """Downloads gradient parts and uploads weight parts for one engine.

  Args:
    mesh: a mesh whose only axis of size > 1 is `axis`.
    axis: the data axis.
    layouts: tree of LeafLayout with placement, one per parameter leaf.
    dtype: dtype of the uploaded weights.
  """

  def __init__(self, mesh: Mesh, axis: str, layouts, dtype):
    self._mesh, self._layouts, self._dtype = mesh, layouts, np.dtype(dtype)
    self._devices = list(mesh.devices.flat)
    self._specs = jax.tree.map(lambda l: l.spec(axis), layouts, is_leaf=is_layout)
    self._mapped: list[np.ndarray] = []
    self._empty: dict[int, jax.Array] = {}  # leaf index -> its empty host part, made once
    self._uploader = concurrent.futures.ThreadPoolExecutor(1, "jzo-upload")

  def download(self, grads):
    """Tree of Shards: each device's gradient part as a host numpy view, in
    device order (blocks until the step has produced them)."""
    def pieces(layout: LeafLayout, array: jax.Array) -> Shards:
      out = [None] * layout.shards
      for shard in array.addressable_shards:
        d = shard.index[-1].start // layout.on_host if layout.shards > 1 and layout.on_host else 0
        out[d] = np.asarray(shard.data)
      return Shards(out)
    return jax.tree.map(pieces, self._layouts, grads, is_leaf=is_layout)

  def upload(self, parts):
    """Device arrays of the host parts from a tree of (S, ..., k - c) host
    arrays; returns once the copies are done, since the staging buffers are
    rewritten next step."""
    return self.upload_as_ready(enumerate(jax.tree.leaves(parts)))

  def upload_as_ready(self, leaves: Iterable[tuple[int, np.ndarray]]):
    """Like `upload`, for leaves that become ready one at a time: each
    (leaf index, (S, ..., k - c) host array) is copied on an upload thread
    while the caller produces the next, so the copies overlap that work.
    Leaves never yielded (empty host parts) come back as empty arrays."""
    on_cpu = self._devices[0].platform == "cpu"
    # A CPU "device" may alias a numpy array, and the staging buffer is reused.
    host_view = lambda x: x.copy() if on_cpu else x
    layouts = jax.tree.leaves(self._layouts, is_leaf=is_layout)
    specs = jax.tree.leaves(self._specs)

    def put(i: int, host: np.ndarray) -> jax.Array:
      layout, sharding = layouts[i], NamedSharding(self._mesh, specs[i])
      pieces = [jax.device_put(host_view(host[d]), self._devices[d])
                for d in range(layout.shards)]
      return jax.block_until_ready(jax.make_array_from_single_device_arrays(
          layout.part_shape(layout.on_host), sharding, pieces))

    futures = [None] * len(layouts)
    for i, host in leaves:
      futures[i] = self._uploader.submit(put, i, host)
    for i, f in enumerate(futures):
      if f is None and i not in self._empty:
        self._empty[i] = jax.device_put(np.zeros(layouts[i].part_shape(0), self._dtype),
                                        NamedSharding(self._mesh, specs[i]))
    arrays = [f.result() if f is not None else self._empty[i] for i, f in enumerate(futures)]
    return jax.tree.unflatten(jax.tree.structure(self._layouts, is_leaf=is_layout), arrays)

  def map_for_dma(self, buffers) -> None:
    """Registers host buffers (a list of numpy arrays) for DMA, once."""
    client = self._devices[0].client
    for buf in buffers:
      if buf.nbytes:
        client.dma_map(buf.ctypes.data, buf.nbytes)
        self._mapped.append(buf)
    # Unmap before the buffers can be freed, also if close() is never called.
    self._unmap = weakref.finalize(self, _unmap_all, client, self._mapped)

  @property
  def mapped(self) -> int:
    """How many buffers are registered for DMA."""
    return len(self._mapped)

  def close(self) -> None:
    """Releases the DMA mappings."""
    if self._mapped:
      self._unmap()
    self._uploader.shutdown()


def _unmap_all(client, buffers: list) -> None:
  while buffers:
    client.dma_unmap(buffers.pop().ctypes.data)
