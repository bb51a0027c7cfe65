"""How the engine lays parameters out over the data axis (ZeRO partitioning).

Every parameter leaf is flattened and zero-padded to a multiple of the
number of shards S, then split into S equal shards of k = ceil(size / S)
elements; device d holds elements [d*k, (d+1)*k). Padding is at most S - 1
elements a leaf and stays zero (its gradient is zero). Flattening per leaf,
rather than one buffer for the whole model, keeps the optimizer state a tree
shaped like the params, so per-leaf options such as weight-decay masks work.

Stage 3 can also keep the leaves of a stack of layers (leading axis = layer)
sharded per layer, shape (L, S*k): the model then gathers one layer at a time
inside its scan over layers by calling `gather_layer`.

Placement: the optimizer state of each device's shard is split at an element
c of its last axis: [0, c) lives in device memory and is updated inside the
step, [c, k) lives in host memory and is updated by the C++ kernel (offload).
`device_size` is c; the default keeps everything on the device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """Where one parameter leaf lives: its full shape and its shards."""
  shape: tuple[int, ...]  # full shape of the parameter
  shards: int  # S: 1 (replicated) or the data-axis size
  per_layer: bool = False  # (L, S*k) with one flattened layer per row
  device_size: int | None = None  # c: elements of each shard's last axis on the device (None: k)
  # The low-precision weights live in pinned host memory (offload_params; per-layer leaves).
  weights_on_host: bool = False

  def __post_init__(self):
    if self.device_size is not None and not 0 <= self.device_size <= self.shard_size:
      raise ValueError(f"device_size {self.device_size} is outside [0, {self.shard_size}]")

  @property
  def inner_shape(self) -> tuple[int, ...]:
    """Shape of what is flattened: a whole leaf, or one layer of it."""
    return self.shape[1:] if self.per_layer else self.shape

  @property
  def shard_size(self) -> int:
    """k: elements of one shard (of one layer, when per_layer)."""
    return -(-math.prod(self.inner_shape) // self.shards)

  @property
  def local_shape(self) -> tuple[int, ...]:
    """Shape of one device's shard: (k,), or (L, k) per layer."""
    return self.flat_shape[:-1] + (self.shard_size,)

  @property
  def flat_shape(self) -> tuple[int, ...]:
    """Global shape of the flattened, padded leaf."""
    flat = self.shards * self.shard_size
    return (self.shape[0], flat) if self.per_layer else (flat,)

  @property
  def on_device(self) -> int:
    """c: elements of each shard's last axis whose optimizer state is on the device."""
    return self.shard_size if self.device_size is None else self.device_size

  @property
  def on_host(self) -> int:
    """k - c: elements of each shard's last axis whose optimizer state is on the host."""
    return self.shard_size - self.on_device

  @property
  def padded(self) -> bool:
    """The flat leaf carries padding (its size is not a multiple of S)."""
    return math.prod(self.inner_shape) % self.shards != 0

  @property
  def device_local_shape(self) -> tuple[int, ...]:
    """Shape of one device's device part: (c,), or (L, c) per layer."""
    return self.local_shape[:-1] + (self.on_device,)

  @property
  def host_shape(self) -> tuple[int, ...]:
    """Shape of every shard's host part on the host: (S, k - c), or (S, L, k - c)."""
    return (self.shards,) + self.local_shape[:-1] + (self.on_host,)

  def part_shape(self, size: int) -> tuple[int, ...]:
    """Global shape of a part of `size` elements of every shard: (S*size,) or (L, S*size)."""
    return self.flat_shape[:-1] + (self.shards * size,)

  def place(self, device_size: int | None) -> "LeafLayout":
    """This layout with c = device_size."""
    return dataclasses.replace(self, device_size=device_size)

  def split(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat padded leaf (numpy, `flat_shape`, or per layer some of its rows)
    -> (device part, host part): the device part as the global array of
    every shard's [0, c), shape `part_shape(c)` (of those rows); the host
    part as (S, *rows, k - c), device d's at [d]."""
    S, k, c = self.shards, self.shard_size, self.on_device
    lead = flat.shape[:-1]  # () or (rows,)
    rows = flat.reshape(lead + (S, k))  # (S, k) or (rows, S, k)
    device = rows[..., :c].reshape(lead + (S * c,))
    host = rows[..., c:]
    return device, host.transpose(1, 0, 2) if self.per_layer else host

  def join(self, device: np.ndarray, host: np.ndarray) -> np.ndarray:
    """Inverse of `split`: the flat padded leaf (a new array)."""
    S = self.shards
    lead = self.flat_shape[:-1]
    device = np.asarray(device).reshape(lead + (S, self.on_device))
    host = np.asarray(host)
    host = host.transpose(1, 0, 2) if self.per_layer else host.reshape(S, self.on_host)
    return np.concatenate([device, host], axis=-1).reshape(self.flat_shape)

  def spec(self, axis: str) -> P:
    """PartitionSpec of the flat leaf over the data axis."""
    if self.shards == 1:
      return P()
    return P(None, axis) if self.per_layer else P(axis)

  def flatten(self, x: jax.Array) -> jax.Array:
    """Full-shape x (per layer, or some of its layers) -> flat padded
    (`flat_shape`, or those rows of it); numpy in, numpy out."""
    lead = (x.shape[0],) if self.per_layer else ()
    x = x.reshape(lead + (-1,))
    pad = self.flat_shape[-1] - x.shape[-1]
    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.pad(x, [(0, 0)] * len(lead) + [(0, pad)]) if pad else x

  def unflatten(self, flat: jax.Array) -> jax.Array:
    """Flat padded -> full shape, or per layer those rows' layers (drops the padding)."""
    size = math.prod(self.inner_shape)
    return flat[..., :size].reshape(flat.shape[:-1] + self.inner_shape)

  def gather_inner(self, shard: jax.Array, axis: str) -> jax.Array:
    """Inside shard_map: one flat shard (k,) -> the full inner-shape array."""
    full = jax.lax.all_gather(shard, axis, tiled=True) if self.shards > 1 else shard
    return full[:math.prod(self.inner_shape)].reshape(self.inner_shape)


@dataclasses.dataclass(frozen=True)
class SplitPart:
  """flat -> one part of `layout.split(flat)`: side 0 the device part, 1 the
  host part (only the shards at data-axis positions [start, stop) where
  `positions` is given). A hashable function: programs that take it as a
  static argument are shared by every leaf and engine of an equal layout."""
  layout: LeafLayout
  side: int
  positions: tuple[int, int] | None = None  # (start, stop)

  def __call__(self, flat):
    part = self.layout.split(flat)[self.side]
    return part if self.positions is None else part[slice(*self.positions)]


def make_layouts(params, shards: int, per_layer_path: str | None) -> Any:
  """A LeafLayout per leaf; leaves under `per_layer_path` get per-layer shards."""
  def layout(path, x):
    per_layer = per_layer_path is not None and _under(path, per_layer_path)
    if per_layer and jnp.ndim(x) < 1:
      raise ValueError(f"layers={per_layer_path!r}: leaf {jax.tree_util.keystr(path)} has no "
                       "leading layer axis")
    return LeafLayout(tuple(jnp.shape(x)), shards, per_layer)
  return jax.tree_util.tree_map_with_path(layout, params)


def _under(path, prefix: str) -> bool:
  """True if the key path starts with the dotted `prefix` (e.g. 'blocks')."""
  names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  want = prefix.split(".")
  return names[:len(want)] == want


def subtree(tree, path: str):
  """The subtree at dotted key path `path` (dict keys or attributes)."""
  node = tree
  for name in path.split("."):
    if isinstance(node, dict) and name in node:
      node = node[name]
    elif hasattr(node, name):
      node = getattr(node, name)
    else:
      raise ValueError(f"layers={path!r}: no {name!r} in the params tree")
  return node


def is_layout(x) -> bool:
  return isinstance(x, LeafLayout)


# Set while the engine traces a stage-3 step with per-layer shards: maps one
# layer's tree of flat shards to that layer's full parameters.
_LAYER_GATHER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "jzo_layer_gather", default=None)


def gather_layer(layer_params):
  """Returns one layer's full parameters; call it inside a scan over layers.

  Under a stage-3 engine with `layers=...`, each layer's parameters reach the
  scan body as flat shards; this all-gathers them (and its gradient is a
  reduce-scatter), so only one layer is ever whole on a device. Anywhere
  else it returns its argument unchanged, so a model that calls it runs the
  same without jzo.
  """
  gather = _LAYER_GATHER.get()
  return layer_params if gather is None else gather(layer_params)


@contextlib.contextmanager
def layer_gathering(fn: Callable):
  """Makes `gather_layer` call fn while tracing inside the block."""
  token = _LAYER_GATHER.set(fn)
  try:
    yield
  finally:
    _LAYER_GATHER.reset(token)
