"""How an engine cuts a batch: the checks of its leading (example) axis,
this process's rows of a global batch, the rows of each micro-batch, and
with several processes, each one's rows as one global array."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def check(batch, devices: int, n_devices: int, grad_accum: int) -> None:
  """Raises ValueError unless the batch's arrays share a leading axis that
  splits into this process's `devices` x grad_accum micro-batches (of
  n_devices in all)."""
  leaves = jax.tree.leaves(batch)
  if not leaves:
    raise ValueError("batch has no arrays")
  sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(f"every batch array needs the same leading (example) axis, got {sizes}")
  (size,) = sizes
  if size % (devices * grad_accum):
    whose = "" if devices == n_devices else "this process's "
    raise ValueError(f"{whose}batch of {size} examples does not split into {devices} "
                     f"devices x {grad_accum} micro-batches")


def micro_batches(batch, devices: int, k: int) -> list:
  """This process's batch as k micro-batches: micro-batch j holds rows
  [j m, (j + 1) m) of every device's block of m k rows, the rows the
  device accumulation's scan gives its j-th iteration."""
  def take(x, j):
    xp = np if isinstance(x, np.ndarray) else jnp
    blocks = xp.reshape(x, (devices, k, -1) + x.shape[1:])
    return xp.reshape(blocks[:, j], (-1,) + x.shape[1:])
  return [jax.tree.map(lambda x: take(x, j), batch) for j in range(k)]


def local_rows(batch, n_devices: int, positions: range):
  """This process's rows of a global batch: the block of its devices (the
  data-axis `positions` of n_devices; with one process, the whole batch)."""
  if jax.process_count() == 1:
    return batch

  def mine(x):
    if x.shape[0] % n_devices:
      raise ValueError(f"global batch of {x.shape[0]} examples does not split over "
                       f"{n_devices} devices")
    per_device = x.shape[0] // n_devices
    return x[positions.start * per_device:positions.stop * per_device]
  return jax.tree.map(mine, batch)


def on_mesh(batch, mesh: Mesh, axis: str):
  """With several processes, each one's rows as one global array per leaf,
  sharded over the data axis (one process: the batch as it is)."""
  if jax.process_count() == 1:
    return batch
  rows = NamedSharding(mesh, P(axis))
  global_or_local = lambda x: x if isinstance(x, jax.Array) and not x.is_fully_addressable \
      else jax.make_array_from_process_local_data(rows, np.asarray(x))
  return jax.tree.map(global_or_local, batch)
