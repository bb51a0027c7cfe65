"""ZeRO-Offload: the host part of every shard's optimizer state, and the
pipeline that updates it once per step.

`HostAdam` owns, per parameter leaf, the float32 master weights and Adam
moments of the host part (`LeafLayout.on_host` elements of each shard's last
axis) of this process's devices' shards (all of them with one process) as
page-aligned numpy arrays. One step of it is one
pass of the fused C++ kernel over each shard (unscale and clip, AdamW, the
new low-precision weights written over the gradient they came from),
multi-threaded with the GIL released.

`HostUpdate` is what the engine calls once per step, after the device step:

  1. the update in flight (the previous step's, with the delayed update),
     leaf by leaf as the kernel finishes it: its landing buffer goes up and
     is written into the params; the new gradient of that leaf comes down
     into the memory just freed;
  2. the update of this step's gradients starts, on the update thread.

Uploads wait for the device step to finish, so the new weights never sit
beside the step's activations, and the device keeps the host parts'
gradients only until they are down, before the next step starts. The host
holds one set of landing buffers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import time
from typing import Callable, Iterator

import jax
import numpy as np

from jzo import kernels
from jzo.cpu_adam import AdamHyperparams
from jzo.partition import is_layout
from jzo.plan import Plan
from jzo.transfer import ShardTransfer


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
    self.count = 0  # updates applied
    self._decay = jax.tree.leaves(decay)
    self._lowp_dtype = np.dtype(plan.compute_dtype)
    shape = lambda l: (len(shards),) + l.host_shape[1:]

    def zeros(l, dtype):
      out = kernels.aligned_empty(shape(l), dtype)
      out.fill(0)
      return out
    on = lambda f: jax.tree.map(f, plan.layouts, is_leaf=is_layout)
    self.master = on(lambda l: kernels.aligned_empty(shape(l), np.float32))
    self.mu = on(lambda l: zeros(l, hyper.mu_dtype))
    self.nu = on(lambda l: zeros(l, hyper.nu_dtype))

  def arrays(self) -> list:
    """Every host array this owns (masters and moments)."""
    return [x for t in (self.master, self.mu, self.nu) for x in jax.tree.leaves(t)]

  def update_leaves(self, grads_of: Callable[[int], list], grad_scale: float) -> Iterator[int]:
    """One AdamW step of every shard, leaf by leaf, largest first; yields
    each leaf's index (jax.tree.leaves order) once it is done, so its upload
    can overlap the update of the rest. Leaves without a host part are
    skipped. The step counts once all leaves are done.

    Args:
      grads_of: grads_of(i)[d] is the gradient of leaf i's host part on
        this process's d-th device, a writable numpy array (float32/bf16/fp16); the new weights in
        the compute dtype are written over it.
      grad_scale: multiplies the gradients first (1 / loss scale * clip).
    """
    step = self.count
    h = self.hyper
    lr = float(h.learning_rate(step)) if callable(h.learning_rate) else float(h.learning_rate)
    wd = float(h.weight_decay(step)) if callable(h.weight_decay) else float(h.weight_decay)
    masters, mus, nus = (jax.tree.leaves(t) for t in (self.master, self.mu, self.nu))
    for i in sorted(range(len(masters)), key=lambda i: -masters[i].size):
      if masters[i].size == 0:
        continue
      grads = grads_of(i)
      for d, grad in enumerate(grads):
        if grad.dtype != self._lowp_dtype:
          raise TypeError(f"leaf {i}: gradients land in {grad.dtype}, the weights go back "
                          f"in {self._lowp_dtype}; the landing buffer must carry both")
        in_place = grad if self._lowp_dtype != np.float32 else None
        kernels.adam_step_(masters[i][d], grad, mus[i][d], nus[i][d], learning_rate=lr,
                           count=step + 1, b1=h.b1, b2=h.b2, eps=h.eps, eps_root=h.eps_root,
                           weight_decay=wd if self._decay[i] else 0.0, nesterov=h.nesterov,
                           grad_scale=grad_scale, lowp_out=in_place)
        if in_place is None:  # float32 compute: the masters themselves go up
          kernels.parallel_copy(grad, masters[i][d])
      yield i
    self.count += 1


class HostUpdate:
  """The host side of an offloading engine, called once per step.

  Args:
    adam: the host state and kernel.
    transfer: moves gradients down and weights up.

  Attributes:
    timings: seconds of the last update: `wait_grads` (waiting for the
      device step), `update` (the C++ kernel, on the update thread) and
      `upload` (the exchange of weights and gradients left after the kernel
      finished its last leaf).
  """

  def __init__(self, adam: HostAdam, transfer: ShardTransfer):
    self.adam, self.transfer = adam, transfer
    self.timings = {"wait_grads": 0.0, "update": 0.0, "upload": 0.0}
    self._executor = concurrent.futures.ThreadPoolExecutor(1, "jzo-host-update")
    self._pending: _Update | None = None
    # The first exception of an update: the host state may then be half
    # updated, so every later call refuses to go on (see `_guard`).
    self.failure: BaseException | None = None
    self.landing_peak = 0  # bytes: the most landing buffers held at once so far
    self._host_leaves = [i for i, l in enumerate(transfer.layouts) if l.on_host]

  @property
  def in_flight(self) -> bool:
    return self._pending is not None

  def landing_buffers(self) -> dict[int, jax.Array]:
    """The landing buffers of the update in flight, by leaf index (empty if none)."""
    return dict(self._pending.landing) if self._pending is not None else {}

  def landing_bytes(self) -> int:
    """Bytes of pinned host memory the landing buffers in use hold now."""
    return sum(x.nbytes for x in self.landing_buffers().values())

  def exchange(self, grads: list, skipped, grad_scale, *, delayed: bool,
               install: Callable[[int, jax.Array], jax.Array]) -> None:
    """The host side of one step.

    Args:
      grads: per leaf (jax.tree.leaves order), the step's local flat
        gradients on the devices (leaves without a host part: ignored).
        Each entry is set to None once its copy down is under way, so its
        device memory is freed as soon as the copy is done: the caller
        must keep no other reference.
      skipped, grad_scale: the step's device scalars.
      delayed: leave this step's update in flight (the delayed update);
        otherwise it is applied before this returns.
      install: install(i, uploaded) writes leaf i's new host parts (on the
        devices, flat `part_shape(k - c)`) into the params and returns the
        new params leaf.
    """
    with self._guard():
      self._exchange(grads, skipped, grad_scale, delayed, install)

  def _exchange(self, grads, skipped, grad_scale, delayed, install) -> None:
    start = time.perf_counter()
    jax.block_until_ready(grads)  # the step is done: its peak has passed
    waited = time.perf_counter()
    skip = bool(skipped)
    landing = self._finish(install, None if skip else grads)
    if skip:
      return
    for i in self._host_leaves:
      if i not in landing:
        landing[i] = self.transfer.download(i, grads[i])
        grads[i] = None
    # The gradients leave the devices before the next step allocates its memory.
    jax.block_until_ready(list(landing.values()))
    self.landing_peak = max(self.landing_peak, sum(x.nbytes for x in landing.values()))
    self._pending = _Update(landing, float(grad_scale))
    self._pending.future = self._executor.submit(self._run, self._pending)
    self.timings["wait_grads"] = waited - start
    if not delayed:
      self._finish(install, None)

  def finish(self, install: Callable[[int, jax.Array], jax.Array]) -> None:
    """Applies the update in flight, if any (see `exchange`)."""
    with self._guard():
      self._finish(install, None)

  @contextlib.contextmanager
  def _guard(self):
    """Refuses to start once an update has failed, and records a failure:
    the host state (masters, moments, the params' host parts) may then be
    half updated, and only a checkpoint can restore a consistent state."""
    if self.failure is not None:
      raise RuntimeError(
          "an earlier host update failed, so the host part of the optimizer state may be "
          f"half updated ({type(self.failure).__name__}: {self.failure}); restore the last "
          "checkpoint into a new engine") from self.failure
    try:
      yield
    except BaseException as e:
      self.failure = e
      raise

  def _finish(self, install, next_grads) -> dict:
    """Uploads and installs the update in flight leaf by leaf; with
    next_grads, downloads each leaf's new gradient into the memory its
    landing buffer freed. Returns the new landing buffers by leaf."""
    if self._pending is None:
      return {}
    pending, self._pending = self._pending, None
    landing = {}
    while (i := pending.done.get()) is not None:
      if isinstance(i, BaseException):
        pending.future.result()  # re-raises with the update thread's traceback
      # One leaf at a time: its new weights are in the params, and the
      # uploaded copy freed, before the next leaf's come up.
      jax.block_until_ready(install(i, self.transfer.upload(i, pending.landing.pop(i))))
      if next_grads is not None:
        landing[i] = self.transfer.download(i, next_grads[i])
        next_grads[i] = None
        if self.transfer.layouts[i].on_device:  # its host part was sliced out into a copy
          jax.block_until_ready(landing[i])
    pending.future.result()
    self.timings["update"] = pending.kernel_s
    self.timings["upload"] = time.perf_counter() - pending.kernel_done
    return landing

  def _run(self, update: "_Update") -> None:
    start = time.perf_counter()
    try:
      views = lambda i: self.transfer.views(i, update.landing[i])
      for i in self.adam.update_leaves(views, update.grad_scale):
        update.done.put(i)
    except BaseException as e:
      update.done.put(e)
      raise
    finally:
      update.kernel_done = time.perf_counter()
      update.kernel_s = update.kernel_done - start
      update.done.put(None)

  def close(self) -> None:
    """Stops the update thread (call `finish` first to apply an update in flight)."""
    self._executor.shutdown()


class _Update:
  """One step's host update: its landing buffers (by leaf index) and the
  leaves the kernel has finished, in order (None: all done)."""

  def __init__(self, landing: dict, grad_scale: float):
    self.landing, self.grad_scale = landing, grad_scale
    self.done: queue.Queue = queue.Queue()
    self.future: concurrent.futures.Future | None = None
    self.kernel_s = 0.0
    self.kernel_done = 0.0
