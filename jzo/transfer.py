"""Moving offloaded shards between the devices and host memory.

Gradients leave the device step as outputs in pinned host memory (XLA
copies them at PCIe speed as soon as they are ready) and are read here as
zero-copy numpy views. New low-precision weights go back from staging
buffers registered for DMA once, so the copy runs at PCIe speed instead of
through a bounce buffer; stages 1-2 then all-gather them on the devices (on
one device, the full leaves are uploaded as they are).
"""

from __future__ import annotations

import math
import weakref

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jzo.offload import Shards
from jzo.partition import LeafLayout, is_layout


class ShardTransfer:
  """Downloads gradient shards and uploads weight shards for one engine.

  Args:
    mesh: a mesh whose only axis of size > 1 is `axis`.
    axis: the data axis.
    layouts: tree of LeafLayout, one per parameter leaf.
    full_specs: PartitionSpecs of the full params on the devices, or None to
      keep the uploaded shards (stage 3).
  """

  def __init__(self, mesh: Mesh, axis: str, layouts, full_specs=None):
    self._mesh, self._layouts = mesh, layouts
    self._devices = list(mesh.devices.flat)
    self._shard_specs = jax.tree.map(lambda l: l.spec(axis), layouts, is_leaf=is_layout)
    self._mapped: list[np.ndarray] = []
    self._gather = None
    self._full_specs = full_specs
    if full_specs is not None and len(self._devices) > 1:
      def gather(shards):
        return jax.tree.map(lambda l, x: l.unflatten(jax.lax.all_gather(x, axis, tiled=True)),
                            layouts, shards, is_leaf=is_layout)
      self._gather = jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=(self._shard_specs,),
                                           out_specs=full_specs, check_vma=False))

  def download(self, grads):
    """Tree of Shards: each device's gradient shard as a host numpy view, in
    device order (blocks until the step has produced them)."""
    def pieces(layout: LeafLayout, array: jax.Array) -> Shards:
      out = [None] * layout.shards
      for shard in array.addressable_shards:
        d = shard.index[-1].start // layout.shard_size if layout.shards > 1 else 0
        out[d] = np.asarray(shard.data)
      return Shards(out)
    return jax.tree.map(pieces, self._layouts, grads, is_leaf=is_layout)

  def upload(self, lowp):
    """Device params from a tree of (S, ...) host shards; returns once the
    copies are done, since the staging buffers are rewritten next step."""
    on_cpu = self._devices[0].platform == "cpu"
    # A CPU "device" may alias a numpy array, and the staging buffer is reused.
    host_view = lambda x: x.copy() if on_cpu else x

    def put(layout: LeafLayout, host: np.ndarray, spec) -> jax.Array:
      pieces = [jax.device_put(host_view(host[d]), self._devices[d])
                for d in range(layout.shards)]
      return jax.make_array_from_single_device_arrays(
          layout.flat_shape, NamedSharding(self._mesh, spec), pieces)

    def put_whole(layout: LeafLayout, host: np.ndarray, spec) -> jax.Array:
      # One device holds the whole leaf: reshape on the host, so no device
      # op waits behind the next step's compute.
      whole = host[0][:math.prod(layout.shape)].reshape(layout.shape)
      return jax.device_put(host_view(whole), NamedSharding(self._mesh, spec))

    if self._full_specs is not None and self._gather is None:
      params = jax.tree.map(put_whole, self._layouts, lowp, self._full_specs, is_leaf=is_layout)
    else:
      params = jax.tree.map(put, self._layouts, lowp, self._shard_specs, is_leaf=is_layout)
      if self._gather is not None:
        params = self._gather(params)
    return jax.block_until_ready(params)

  def map_for_dma(self, buffers) -> None:
    """Registers host buffers (a tree of numpy arrays) for DMA, once."""
    client = self._devices[0].client
    for buf in jax.tree.leaves(buffers):
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


def _unmap_all(client, buffers: list) -> None:
  while buffers:
    client.dma_unmap(buffers.pop().ctypes.data)
