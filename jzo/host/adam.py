"""`HostAdam`: the optimizer state of offload in host RAM and its update.

It owns, per parameter leaf, the float32 master weights and Adam moments of
the host part (`LeafLayout.on_host` elements of each shard's last axis) of
this process's devices' shards (all of them with one process) as
page-aligned numpy arrays, and with host accumulation the float32 sums of
the micro-batches' gradients. One step of it is one pass of the fused C++
kernel over each shard (unscale and clip, AdamW, the new low-precision
weights written over the gradient they came from), multi-threaded with the
GIL released. The update's modes (jzo.host.update) decide when each leaf
goes through it.
"""

from __future__ import annotations

from typing import Callable, Collection, Iterator

import jax
import numpy as np

from jzo.kernels import ops as kernels
from jzo.kernels import quant8
from jzo.kernels.cpu_adam import AdamHyperparams
from jzo.parallel.partition import is_layout
from jzo.plan import Plan


class HostAdam:
  """AdamW over the host parts of this process's shards.

  Args:
    plan: the engine's plan (layouts with placement, dtypes).
    hyper: cpu_adamw's hyperparameters.
    decay: tree of bools, weight decay on or off per leaf.
    shards: the data-axis positions of this process's devices (a range;
      default all, as with one process). Each array's leading axis runs
      over them: (len(shards), ..., k - c).

  The masters start uninitialised: the engine copies each leaf's host part
  into `master` as it draws the leaf, so no second float32 copy of the
  model is ever whole.
  """

  def __init__(self, plan: Plan, hyper: AdamHyperparams, decay, shards: range | None = None):
    shards = shards if shards is not None else range(plan.n_devices)
    self.hyper, self.shards = hyper, shards
    self._decay = jax.tree.leaves(decay)
    self._lowp_dtype = np.dtype(plan.compute_dtype)
    shape = lambda l: (len(shards),) + l.host_shape[1:]

    def zeros(l, dtype):
      if quant8.is_int8(dtype):  # codes and scales, both zero: a moment of zeros
        return quant8.Int8Moment(zeros_like(shape(l), np.uint8),
                                 zeros_like(quant8.scale_shape(shape(l)), np.float32))
      return zeros_like(shape(l), dtype)

    def zeros_like(array_shape, dtype):
      out = kernels.aligned_empty(array_shape, dtype)
      out.fill(0)
      return out
    on = lambda f: jax.tree.map(f, plan.layouts, is_leaf=is_layout)
    self.master = on(lambda l: kernels.aligned_empty(shape(l), np.float32))
    self.mu = on(lambda l: zeros(l, hyper.mu_dtype))
    self.nu = on(lambda l: zeros(l, hyper.nu_dtype))
    # Host accumulation: the float32 sums of the micro-batches' host parts,
    # written by each step's first micro-batch (never zeroed).
    self.acc = (on(lambda l: kernels.aligned_empty(shape(l), np.float32))
                if plan.host_accumulation else None)

  def arrays(self) -> list:
    """Every host array this owns (masters, moments (an int8 one's codes and
    scales), accumulators)."""
    trees = (self.master, self.mu, self.nu) + ((self.acc,) if self.acc is not None else ())
    return [x for t in trees for x in jax.tree.leaves(t)]

  def accumulate(self, i: int, grads: list, first: bool) -> tuple[np.ndarray, np.ndarray]:
    """Sums one micro-batch's gradients of leaf i's host parts (grads[d]: this
    process's d-th device's, any dtype the kernel takes) into its float32
    accumulators; the first micro-batch of a step writes them. Returns, as
    float32 arrays with one entry per device, the sum of squares of the new
    sums and 1 where any of them is not finite (else 0)."""
    acc = jax.tree.leaves(self.acc)[i]
    sq, bad = np.zeros(len(grads), np.float32), np.zeros(len(grads), np.float32)
    for d, grad in enumerate(grads):
      total, finite = kernels.accumulate_(acc[d], grad, add=not first)
      sq[d], bad[d] = total, not finite
    return sq, bad

  def lowp_weights(self, i: int, out: list, span: tuple[int, int] | None = None) -> None:
    """Writes leaf i's host parts' weights in the compute dtype into out[d]
    (this process's devices' pieces of a landing buffer), from the masters,
    or their elements [lo, hi) along the first axis (span)."""
    master = jax.tree.leaves(self.master)[i]
    for d, piece in enumerate(out):
      source = master[d] if span is None else master[d][span[0]:span[1]]
      if self._lowp_dtype == np.float32:
        kernels.parallel_copy(piece, source)
      else:
        kernels.cast_(piece, source)

  def update_leaves(self, grads_of: Callable[[int], list], grad_scale: float, count: int,
                    lowp: bool = True, skip: Collection[int] = ()) -> Iterator[int]:
    """One AdamW step of every shard, leaf by leaf, largest first; yields
    each leaf's index (jax.tree.leaves order) once it is done, so its upload
    can overlap the update of the rest. Leaves without a host part are
    skipped.

    Args:
      grads_of: grads_of(i)[d] is the gradient of leaf i's host part on
        this process's d-th device, a writable numpy array (float32/bf16/fp16); the new weights in
        the compute dtype are written over it (unless lowp is False).
      grad_scale: multiplies the gradients first (1 / loss scale * clip).
      count: this update's number, 1 for the first (the engine's step
        counter after the step: Adam's bias corrections and schedules).
      lowp: write the new weights over the gradients (host accumulation's
        float32 sums instead leave them to `lowp_weights`).
      skip: leaves not to update here.
    """
    scalars = self.step_scalars(count)
    masters = jax.tree.leaves(self.master)
    for i in sorted(range(len(masters)), key=lambda i: -masters[i].size):
      if masters[i].size == 0 or i in skip:
        continue
      self.update_part(i, grads_of(i), grad_scale, scalars, count, lowp=lowp)
      yield i

  def update_by_layer(self, leaves: list[int], grads_of: Callable[[int], list],
                      grad_scale: float, count: int, layer_done: list) -> None:
    """One AdamW step of stacked leaves (each (L, ...) a device), layer by
    layer: every leaf's row 0, then row 1, ...; layer_done[l] (a
    threading.Event) is set once layer l's new weights are written over its
    gradients. Arguments as `update_leaves`'s."""
    scalars = self.step_scalars(count)
    pieces = {i: grads_of(i) for i in leaves}
    for layer, done in enumerate(layer_done):
      for i in leaves:
        self.update_part(i, [p[layer:layer + 1] for p in pieces[i]], grad_scale, scalars, count,
                         (layer, layer + 1))
      done.set()

  def step_scalars(self, count: int) -> tuple[float, float]:
    """(learning rate, weight decay) of update number `count` (1-based), as
    optax evaluates its schedules: at the updates applied before it."""
    h, step = self.hyper, count - 1
    lr = float(h.learning_rate(step)) if callable(h.learning_rate) else float(h.learning_rate)
    wd = float(h.weight_decay(step)) if callable(h.weight_decay) else float(h.weight_decay)
    return lr, wd

  def update_part(self, i: int, grads: list, grad_scale: float, scalars: tuple[float, float],
                  count: int, span: tuple[int, int] | None = None, lowp: bool = True) -> None:
    """AdamW of leaf i's host parts, or of their elements [lo, hi) along the
    first axis (span; see `ShardTransfer.spans`), with the step's `scalars`.
    grads[d]: this process's d-th device's gradients of those elements;
    count and lowp as in `update_leaves`."""
    h, (lr, wd) = self.hyper, scalars
    part = (lambda a: a) if span is None else (lambda a: a[span[0]:span[1]])
    master = jax.tree.leaves(self.master)[i]
    mu, nu = (quant8.leaves(t)[i] for t in (self.mu, self.nu))
    for d, grad in enumerate(grads):
      if lowp and grad.dtype != self._lowp_dtype:
        raise TypeError(f"leaf {i}: gradients land in {grad.dtype}, the weights go back "
                        f"in {self._lowp_dtype}; the landing buffer must carry both")
      in_place = grad if lowp and self._lowp_dtype != np.float32 else None
      kernels.adam_step_(part(master[d]), grad, _moment_part(mu, d, span),
                         _moment_part(nu, d, span), learning_rate=lr,
                         count=count, b1=h.b1, b2=h.b2, eps=h.eps, eps_root=h.eps_root,
                         weight_decay=wd if self._decay[i] else 0.0, nesterov=h.nesterov,
                         grad_scale=grad_scale, lowp_out=in_place)
      if lowp and in_place is None:  # float32 compute: the masters themselves go up
        kernels.parallel_copy(grad, part(master[d]))


def _moment_part(moment, d: int, span: tuple[int, int] | None):
  """Device d's part of a host moment (an array or an Int8Moment, leading
  axis over devices), or its elements [lo, hi) along the part's first axis.
  An int8 moment's scales run along the last axis: a flat part's span must
  start on a block (`ShardTransfer.spans` cuts them so)."""
  if not isinstance(moment, quant8.Int8Moment):
    return moment[d] if span is None else moment[d][span[0]:span[1]]
  codes, scales = moment.codes[d], moment.scales[d]
  if span is None:
    return quant8.Int8Moment(codes, scales)
  lo, hi = span
  if codes.ndim > 1:  # rows: each has its own blocks
    return quant8.Int8Moment(codes[lo:hi], scales[lo:hi])
  if lo % quant8.QUANT_BLOCK:
    raise ValueError(f"a span of an int8 moment starts at {lo}, inside a block of "
                     f"{quant8.QUANT_BLOCK}")
  return quant8.Int8Moment(codes[lo:hi], scales[lo // quant8.QUANT_BLOCK:quant8.blocks(hi)])
