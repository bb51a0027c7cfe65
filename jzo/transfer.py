"""Moving offloaded shards between the devices and host memory.

Gradients leave the device step as outputs in pinned host memory (XLA
copies them at PCIe speed as soon as they are ready) and are read here as
zero-copy numpy views. New low-precision weights go back from staging
buffers registered for DMA once, so the copy runs at PCIe speed instead of
through a bounce buffer, leaf by leaf as the host update finishes each one;
stages 1-2 then all-gather them on the devices (on one device, the full
leaves are uploaded as they are).
"""

from __future__ import annotations

import concurrent.futures
import math
import weakref
from typing import Iterable

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
    self._uploader = concurrent.futures.ThreadPoolExecutor(1, "jzo-upload")
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
    return self.upload_as_ready(enumerate(jax.tree.leaves(lowp)))

  def upload_as_ready(self, leaves: Iterable[tuple[int, np.ndarray]]):
    """Like `upload`, for leaves that become ready one at a time: each
    (leaf index, (S, ...) host shards) is copied on an upload thread while
    the caller produces the next, so the copies overlap that work."""
    on_cpu = self._devices[0].platform == "cpu"
    # A CPU "device" may alias a numpy array, and the staging buffer is reused.
    host_view = lambda x: x.copy() if on_cpu else x
    layouts = jax.tree.leaves(self._layouts, is_leaf=is_layout)
    whole = self._full_specs is not None and self._gather is None
    specs = jax.tree.leaves(self._full_specs if whole else self._shard_specs)

    def put(i: int, host: np.ndarray) -> jax.Array:
      layout, sharding = layouts[i], NamedSharding(self._mesh, specs[i])
      if whole:  # one device holds the whole leaf: reshape on the host, so
        # that no device op waits behind the next step's compute.
        full = host[0][:math.prod(layout.shape)].reshape(layout.shape)
        return jax.block_until_ready(jax.device_put(host_view(full), sharding))
      pieces = [jax.device_put(host_view(host[d]), self._devices[d])
                for d in range(layout.shards)]
      return jax.block_until_ready(
          jax.make_array_from_single_device_arrays(layout.flat_shape, sharding, pieces))

    futures = [None] * len(layouts)
    for i, host in leaves:
      futures[i] = self._uploader.submit(put, i, host)
    params = jax.tree.unflatten(jax.tree.structure(self._layouts, is_leaf=is_layout),
                                [f.result() for f in futures])
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
