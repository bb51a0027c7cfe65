"""The host-accumulated update: micro-batches summed on the host (see
jzo.host.update for the modes)."""

from __future__ import annotations

import threading
import time
import weakref

import jax
import numpy as np

from jzo.host.update import HostUpdate, PendingUpdate, TrainedState
from jzo.host.transfer import ShardTransfer


class AccumulatedUpdate(HostUpdate):
  """Host accumulation (`Plan.host_accumulation`): the engine calls
  `accumulate` after each micro-batch's device call: each leaf's host parts
  go down into a landing buffer (at most the plan's landing limit of them
  at once) and the update thread sums them into HostAdam's float32
  accumulators (the first micro-batch writes), then frees the buffer.
  `host_sums` gives the end of the step its sum of squares and finite
  check; `after_step` runs AdamW over the accumulators, or leaves it in
  flight (the delayed update). One thread runs every host pass in order,
  so a leaf's next gradient is summed only into an accumulator the update
  has finished reading, and the new weights go up from buffers made again
  from the masters when they are installed (a leaf at a time), not from a
  second set of landing buffers.

  Attributes (besides HostUpdate's):
    timings: also `accumulate` (the step's summing passes, on the update
      thread) and `wait_micro` (the engine waiting for micro-batches'
      gradients to leave the devices).
  """

  def __init__(self, state: TrainedState, transfer: ShardTransfer):
    super().__init__(state, transfer)
    self.timings.update(accumulate=0.0, wait_micro=0.0)
    self._landing_held = 0  # bytes of landing buffers held now
    self._landing_freed = threading.Condition()
    self._sums: list = []  # futures of this step's accumulation: (leaf, sq, bad)

  def accumulate(self, grads: list, *, first: bool) -> None:
    """Host accumulation of one micro-batch: its host parts go down leaf by
    leaf, largest first (each waits for room under the landing limit), and
    the update thread sums each into the accumulators, after any host pass
    queued before it. Returns once every gradient is off the devices.

    Args:
      grads: per leaf (jax.tree.leaves order), the micro-batch's local flat
        gradients on the devices; entries are set to None once their copy
        down is under way (the caller keeps no other reference).
      first: the step's first micro-batch (it writes the sums).
    """
    with self.guard():
      start = time.perf_counter()
      if first:
        self.timings.update(accumulate=0.0, wait_micro=0.0)
      # Weak references: a buffer whose sum is done (and its room given
      # back) must be freed, not kept here while later leaves wait for room.
      landed = []
      for i in sorted(self._host_leaves, key=lambda i: -grads[i].size):
        nbytes = self._landing_bytes(i)
        self._hold_landing(nbytes)
        landing = self.transfer.download(i, grads[i])
        grads[i] = None
        if isinstance(landing, jax.Array):
          landed.append(weakref.ref(landing))
        # Handed over in a list the update thread empties: an argument would
        # stay referenced by the executor's work item after the sum.
        self._sums.append(self._executor.submit(self._sum_leaf, i, [landing], nbytes, first))
        del landing
      jax.block_until_ready([x for x in (ref() for ref in landed) if x is not None])
      self.timings["wait_micro"] += time.perf_counter() - start

  def host_sums(self) -> tuple[np.ndarray, np.ndarray]:
    """Waits for the step's accumulation; returns, per device of this
    process (float32, one entry a device), the sum of squares of its host
    parts' sums and 1 where any is not finite (else 0)."""
    with self.guard():
      sums, self._sums = self._sums, []
      last = {i: (sq, bad) for i, sq, bad in (f.result() for f in sums)}  # the whole step's
      n = len(self.adam.shards)
      sq = sum((v[0] for v in last.values()), np.zeros(n, np.float32))
      bad = sum((v[1] for v in last.values()), np.zeros(n, np.float32))
      return sq, np.minimum(bad, 1)

  def after_step(self, skipped, grad_scale, *, delayed: bool) -> None:
    """The host side of a host-accumulated step, after its end on the
    devices: installs the update in flight (the delayed update's), then,
    unless the step was skipped, runs AdamW over the accumulators (left in
    flight with `delayed`). skipped, grad_scale: the step's device scalars."""
    with self.guard():
      self._finish(None)
      if bool(skipped):
        return
      self._start(PendingUpdate({}, float(grad_scale), int(self.state.device.step)))
      if not delayed:
        self._finish(None)

  def _kernel_pass(self, update: PendingUpdate) -> None:
    """AdamW over the float32 sums (the new weights are made from the
    masters when installed)."""
    sums = jax.tree.leaves(self.adam.acc)
    for i in self.adam.update_leaves(lambda i: sums[i], update.grad_scale, update.count,
                                     lowp=False):
      update.done.put(i)

  def _install(self, pending: PendingUpdate, i) -> None:
    """Leaf i's new weights in the compute dtype, made from its masters into
    a landing buffer under the same limit as the micro-batches' (whose sums
    may still be running: without the limit the two sets together took
    pinned memory the plan does not count), go up and are installed. i may
    be the update thread's exception: it is raised."""
    if isinstance(i, BaseException):
      pending.future.result()  # re-raises with the update thread's traceback
    nbytes = self._landing_bytes(i)
    self._hold_landing(nbytes)
    try:
      weights = self.transfer.new_landing(i)
      self.adam.lowp_weights(i, self.transfer.views(i, weights))
      jax.block_until_ready(self.state.install(i, self.transfer.upload(i, weights)))
      del weights
    finally:
      self._release_landing(nbytes)

  def _hold_landing(self, nbytes: int) -> None:
    """Waits until a landing buffer of nbytes fits under the limit (one
    always may land when none is held), then counts it as held."""
    with self._landing_freed:
      self._landing_freed.wait_for(
          lambda: not self._landing_held or self._landing_held + nbytes <= self._landing_limit)
      self._landing_held += nbytes
      self.landing_peak = max(self.landing_peak, self._landing_held)

  def _release_landing(self, nbytes: int) -> None:
    with self._landing_freed:
      self._landing_held -= nbytes
      self._landing_freed.notify_all()

  def _sum_leaf(self, i: int, handed: list, nbytes: int, first: bool):
    """On the update thread: sums a landed leaf (handed: [its landing
    buffer]), then lets its buffer go."""
    start = time.perf_counter()
    landing = handed.pop()
    try:
      sq, bad = self.adam.accumulate(i, self.transfer.views(i, landing), first)
    finally:
      del landing
      self._release_landing(nbytes)
      self.timings["accumulate"] += time.perf_counter() - start
    return i, sq, bad
