"""ZeRO-Offload: the optimizer state of every device's shard lives in host RAM.

`HostAdam` owns, per parameter leaf and per device shard, the float32 master
weights and the Adam moments as page-aligned numpy arrays, and a staging
buffer for the low-precision weights that go back to the device. One step of
it is one pass of the fused C++ kernel over each shard (unscale and clip,
AdamW, low-precision copy), multi-threaded with the GIL released.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from jzo import kernels
from jzo.cpu_adam import AdamHyperparams
from jzo.partition import LeafLayout, is_layout


def available_host_memory() -> int:
  """Bytes this process may still allocate: MemAvailable, capped by a cgroup limit."""
  available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          available = int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    with open("/sys/fs/cgroup/memory.max") as f:
      limit = f.read().strip()
    with open("/sys/fs/cgroup/memory.current") as f:
      used = int(f.read())
    if limit != "max":
      available = min(available, int(limit) - used)
  except (OSError, ValueError):
    pass
  return available


def host_bytes_per_param(hyper: AdamHyperparams, lowp_dtype, grad_dtype) -> int:
  """Host bytes per (padded) parameter: master, moments, staging, gradients."""
  size = lambda d: np.dtype(d).itemsize
  return 4 + size(hyper.mu_dtype) + size(hyper.nu_dtype) + size(lowp_dtype) + size(grad_dtype)


def split_shards(layout: LeafLayout, flat: np.ndarray) -> np.ndarray:
  """Flat padded leaf (global) -> (S, *local_shape), device d's shard at [d]."""
  S, k = layout.shards, layout.shard_size
  if layout.per_layer:  # (L, S*k) -> (S, L, k)
    return np.ascontiguousarray(flat.reshape(flat.shape[0], S, k).transpose(1, 0, 2))
  return flat.reshape(S, k)


def join_shards(layout: LeafLayout, shards: np.ndarray) -> np.ndarray:
  """Inverse of split_shards."""
  if layout.per_layer:
    return shards.transpose(1, 0, 2).reshape(layout.flat_shape)
  return shards.reshape(layout.flat_shape)


def _host_copy(x: np.ndarray, dtype) -> np.ndarray:
  out = kernels.aligned_empty(x.shape, dtype)
  out[...] = x
  return out


class Shards(tuple):
  """The per-device pieces of one leaf (a pytree leaf, not a node)."""


class HostAdam:
  """AdamW over host-resident float32 masters and moments of all shards.

  Args:
    layouts: tree of LeafLayout (jzo.partition), one per parameter leaf.
    flat_params: tree of float32 flat padded leaves (numpy), the initial weights.
    hyper: cpu_adamw's hyperparameters.
    decay: tree of bools, weight decay on or off per leaf.
    lowp_dtype: dtype of the weights sent to the devices (bf16/fp16), or
      float32 to send the masters themselves.
    grad_dtype: dtype of the gradients that come back (for the memory check).
    host_memory: bytes available (default: available_host_memory()).

  Raises:
    MemoryError: the state does not fit, before anything is allocated.
  """

  def __init__(self, layouts, flat_params, hyper: AdamHyperparams, decay, lowp_dtype,
               grad_dtype, host_memory: int | None = None):
    leaves = jax.tree.leaves(layouts, is_leaf=is_layout)
    n = sum(l.shards * math.prod(l.local_shape) for l in leaves)
    need = n * host_bytes_per_param(hyper, lowp_dtype, grad_dtype)
    have = available_host_memory() if host_memory is None else host_memory
    if need > have:
      raise MemoryError(f"offloaded optimizer state needs {need / 2**30:.2f} GiB of host RAM "
                        f"({n:,} parameters incl. padding), {have / 2**30:.2f} GiB available")
    self.hyper = hyper
    self.count = 0  # updates applied
    self._layouts, self._decay = layouts, decay
    self._lowp_dtype = np.dtype(lowp_dtype)

    def zeros(layout, dtype):
      out = kernels.aligned_empty((layout.shards,) + layout.local_shape, dtype)
      out.fill(0)
      return out
    self.master = jax.tree.map(lambda l, x: _host_copy(split_shards(l, np.asarray(x)),
                                                       np.float32),
                               layouts, flat_params, is_leaf=is_layout)
    self.mu = jax.tree.map(lambda l: zeros(l, hyper.mu_dtype), layouts, is_leaf=is_layout)
    self.nu = jax.tree.map(lambda l: zeros(l, hyper.nu_dtype), layouts, is_leaf=is_layout)
    self.lowp = (self.master if self._lowp_dtype == np.float32 else
                 jax.tree.map(lambda m: _host_copy(m, self._lowp_dtype), self.master))

  def update(self, grads, grad_scale: float):
    """One AdamW step of every shard; returns the tree of (S, ...) low-precision weights.

    Args:
      grads: tree of Shards: grads[leaf][d] is device d's gradient shard
        (numpy, float32/bf16/fp16, local shape).
      grad_scale: multiplies the gradients first (1 / loss scale * clip).
    """
    for _ in self.update_leaves(grads, grad_scale):
      pass
    return self.lowp

  def update_leaves(self, grads, grad_scale: float):
    """Like `update`, but yields (leaf index, (S, ...) low-precision weights)
    as each leaf is done, largest first, so its upload can overlap the update
    of the rest and only the smallest leaves' uploads remain at the end.
    Leaf indices are in jax.tree.leaves order. The step counts once all
    leaves are done."""
    step = self.count
    h = self.hyper
    lr = float(h.learning_rate(step)) if callable(h.learning_rate) else float(h.learning_rate)
    wd = float(h.weight_decay(step)) if callable(h.weight_decay) else float(h.weight_decay)
    lowp_out = self._lowp_dtype != np.float32
    leaves = list(zip(*(jax.tree.leaves(t) for t in (self.master, self.mu, self.nu, self.lowp)),
                      jax.tree.leaves(grads),
                      jax.tree.leaves(self._decay)))
    for i in sorted(range(len(leaves)), key=lambda i: -leaves[i][0].size):
      master, mu, nu, lowp, grad, decay = leaves[i]
      for d in range(master.shape[0]):
        kernels.adam_step_(master[d], grad[d], mu[d], nu[d], learning_rate=lr, count=step + 1,
                           b1=h.b1, b2=h.b2, eps=h.eps, eps_root=h.eps_root,
                           weight_decay=wd if decay else 0.0, nesterov=h.nesterov,
                           grad_scale=grad_scale, lowp_out=lowp[d] if lowp_out else None)
      yield i, lowp
    self.count += 1

  def full_params(self):
    """Tree of flat padded float32 leaves (global layout), copies."""
    return jax.tree.map(lambda l, m: join_shards(l, m).copy(), self._layouts, self.master,
                        is_leaf=is_layout)
