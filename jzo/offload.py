"""ZeRO-Offload: the host part of every shard's optimizer state, and the
pipeline that updates it once per step.

`HostAdam` owns, per parameter leaf, the float32 master weights and Adam
moments of every device shard's host part (`LeafLayout.on_host` elements of
each shard's last axis) as page-aligned numpy arrays, and a staging buffer
for the low-precision weights that go back to the devices. One step of it is
one pass of the fused C++ kernel over each shard (unscale and clip, AdamW,
low-precision copy), multi-threaded with the GIL released.

`HostUpdate` is what the engine calls once per step: `start` runs the update
of one step's gradients (now, or on a background thread for the delayed
update), `result` waits for it and returns the new weights on the devices.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
import numpy as np

from jzo import kernels
from jzo.cpu_adam import AdamHyperparams
from jzo.partition import is_layout
from jzo.plan import Plan
from jzo.transfer import ShardTransfer


class HostAdam:
  """AdamW over the host parts of all shards.

  Args:
    plan: the engine's plan (layouts with placement, dtypes).
    hyper: cpu_adamw's hyperparameters.
    decay: tree of bools, weight decay on or off per leaf.

  The masters start uninitialised: the engine copies each leaf's host part
  into `master` as it draws the leaf, so no second float32 copy of the
  model is ever whole.
  """

  def __init__(self, plan: Plan, hyper: AdamHyperparams, decay):
    self.hyper = hyper
    self.count = 0  # updates applied
    self._decay = decay
    self._lowp_dtype = np.dtype(plan.compute_dtype)

    def empty(l, dtype):
      return kernels.aligned_empty(l.host_shape, dtype)

    def zeros(l, dtype):
      out = empty(l, dtype)
      out.fill(0)
      return out
    on = lambda f: jax.tree.map(f, plan.layouts, is_leaf=is_layout)
    self.master = on(lambda l: empty(l, np.float32))
    self.mu = on(lambda l: zeros(l, hyper.mu_dtype))
    self.nu = on(lambda l: zeros(l, hyper.nu_dtype))
    self.lowp = (self.master if self._lowp_dtype == np.float32 else
                 on(lambda l: empty(l, self._lowp_dtype)))

  def arrays(self) -> list:
    """Every host array this owns (masters, moments and staging)."""
    trees = [self.master, self.mu, self.nu] + ([] if self.lowp is self.master else [self.lowp])
    return [x for t in trees for x in jax.tree.leaves(t)]

  def update(self, grads, grad_scale: float):
    """One AdamW step of every shard; returns the tree of (S, ...) low-precision weights.

    Args:
      grads: tree of Shards: grads[leaf][d] is device d's gradient for its
        host part (numpy, float32/bf16/fp16).
      grad_scale: multiplies the gradients first (1 / loss scale * clip).
    """
    for _ in self.update_leaves(grads, grad_scale):
      pass
    return self.lowp

  def update_leaves(self, grads, grad_scale: float):
    """Like `update`, but yields (leaf index, (S, ...) low-precision weights)
    as each leaf is done, largest first, so its upload can overlap the update
    of the rest and only the smallest leaves' uploads remain at the end.
    Leaf indices are in jax.tree.leaves order; empty host parts are skipped.
    The step counts once all leaves are done."""
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
      if master.size == 0:
        continue
      for d in range(master.shape[0]):
        kernels.adam_step_(master[d], grad[d], mu[d], nu[d], learning_rate=lr, count=step + 1,
                           b1=h.b1, b2=h.b2, eps=h.eps, eps_root=h.eps_root,
                           weight_decay=wd if decay else 0.0, nesterov=h.nesterov,
                           grad_scale=grad_scale, lowp_out=lowp[d] if lowp_out else None)
      yield i, lowp
    self.count += 1


class HostUpdate:
  """The host side of an offloading engine, called once per step.

  Args:
    adam: the host state and kernel.
    transfer: moves gradients down and weights up.

  Attributes:
    timings: seconds of the last update: `wait_grads` (device compute and
      the device-to-host copy), `update` (the C++ kernel; uploads overlap
      it leaf by leaf) and `upload` (the copies still left after it).
  """

  def __init__(self, adam: HostAdam, transfer: ShardTransfer):
    self.adam, self.transfer = adam, transfer
    self.timings = {"wait_grads": 0.0, "update": 0.0, "upload": 0.0}
    self._executor = concurrent.futures.ThreadPoolExecutor(1, "jzo-host-update")
    self._pending: concurrent.futures.Future | None = None

  def start(self, grads, skipped, grad_scale, *, delayed: bool) -> None:
    """Starts the update of one step: grads (the step's pinned host parts),
    skipped and grad_scale (device scalars) are read once they are ready.
    Delayed: on a background thread, so the next device step overlaps it."""
    if self._pending is not None:
      raise RuntimeError("an update is already in flight: call result() first")
    if delayed:
      self._pending = self._executor.submit(self._run, grads, skipped, grad_scale)
    else:
      future = concurrent.futures.Future()
      future.set_result(self._run(grads, skipped, grad_scale))
      self._pending = future

  @property
  def in_flight(self) -> bool:
    return self._pending is not None

  def result(self):
    """Waits for the update started last; returns the new host parts on the
    devices (flat, `part_shape(k - c)` per leaf), or None if there was none
    or the step was skipped."""
    if self._pending is None:
      return None
    pending, self._pending = self._pending, None
    return pending.result()

  def _run(self, grads, skipped, grad_scale):
    start = time.perf_counter()
    if bool(skipped):
      return None
    pieces = self.transfer.download(grads)
    waited = time.perf_counter()
    done = [waited]  # when the last leaf's update finished

    def leaves():
      yield from self.adam.update_leaves(pieces, float(grad_scale))
      done[0] = time.perf_counter()
    params = self.transfer.upload_as_ready(leaves())
    self.timings = {"wait_grads": waited - start, "update": done[0] - waited,
                    "upload": time.perf_counter() - done[0]}
    return params

  def close(self) -> None:
    """Stops the update thread and releases the transfers (call `result`
    first to keep an update in flight)."""
    self._executor.shutdown()
    self.transfer.close()
