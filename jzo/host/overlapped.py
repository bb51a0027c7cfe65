"""The host update overlapped with the next step's forward (see
jzo.host.update for the modes)."""

from __future__ import annotations

import jax
import numpy as np

from jzo.host.update import PendingUpdate, TrainedState
from jzo.host.transfer import ShardTransfer
from jzo.host.whole import WholeUpdate


class OverlappedUpdate(WholeUpdate):
  """The whole update (`Plan.overlaps_update`, pinned transfers), whose
  stacked layers' new weights the next step fetches itself: the update
  thread runs the other leaves first, which go up before the next step
  starts, then the stacked leaves a layer at a time, marking each layer
  done; the next step's forward waits for each layer's mark
  (`wait_for_layer`, a host callback in the step) and fetches its weights
  from the landing buffers (jzo.parallel.layer_scan). The step takes those
  buffers (donated) and hands them back with its gradients of the stacked
  leaves' host parts, written in its backward pass: the exchange after it
  downloads only the other leaves. Anything else that reads the params
  first applies the update (`finish`).

  The engine runs such a step as:

      with update.guard():
        landing = update.landing_for_step()
        *outputs, landed = step(state, batch, landing)
        update.step_returned(landed)

  so that an error of the step (the update's, through the callback, where
  the devices run the step at once) is the update's failure.
  """

  def __init__(self, state: TrainedState, transfer: ShardTransfer):
    super().__init__(state, transfer)
    self._overlapped = state.plan.overlapped_leaves()
    self._layers = state.plan.leaves[self._overlapped[0]].shape[0]
    self._step_update: PendingUpdate | None = None  # whose layers the running step waits for
    # The overlapping step's landing buffers as it handed them back, with
    # the overlapped leaves' host parts' gradients (by leaf), until the
    # exchange after it takes them.
    self._landed: dict[int, jax.Array] = {}

  def landing_for_step(self) -> list:
    """The overlapped leaves' landing buffers (`Plan.overlapped_leaves()`
    order) for the next step, where the update in flight is writing their
    new weights, once its other leaves are installed in the params. With
    none in flight (the first step, after a skipped one or `finish`),
    buffers of the weights made from the masters."""
    if self._pending is not None and self._pending.consumed:  # a step run alone took it
      self._finish(None)
    pending = self._pending
    if pending is None:  # (kept here, its buffers would outlive the step)
      landing = [self.transfer.new_landing(i) for i in self._overlapped]
      for i, weights in zip(self._overlapped, landing):
        self.adam.lowp_weights(i, self.transfer.views(i, weights))
      self._step_update = PendingUpdate({}, 1.0, 0, self._layers)
      for ready in self._step_update.layer_ready:
        ready.set()
      return landing
    # Its other leaves go first on the update thread.
    for _ in range(len(self._host_leaves) - len(self._overlapped)):
      self._install(pending, pending.done.get())
    pending.consumed = True
    self._step_update = pending
    return [pending.landing[i] for i in self._overlapped]

  def step_returned(self, landed: list) -> None:
    """Takes the landing buffers the step handed back (its last output),
    which hold its gradients of the overlapped leaves' host parts: the next
    `after_step` reads them there."""
    self._landed = dict(zip(self._overlapped, landed))

  def wait_for_layer(self, layer) -> np.ndarray:
    """The overlapping step's host callback: returns `layer` (int32) once
    the update it overlaps has written that layer's new weights.

    Raises:
      RuntimeError: the update failed (the step then fails too).
    """
    update = self._step_update
    update.layer_ready[int(layer)].wait()
    if update.error is not None:
      raise RuntimeError(f"the host update the step overlaps failed: {update.error!r}")
    return np.int32(layer)

  @property
  def running_update_count(self) -> int:
    """The number of the update the running (or last) step overlaps (0: the
    weights it fetched were made from the masters)."""
    return self._step_update.count if self._step_update is not None else 0

  def _take_step_landing(self) -> dict:
    landed, self._landed = self._landed, {}
    return landed

  def _let_go_of_step_landing(self) -> None:
    self._landed = {}

  def _new_update(self, landing: dict, grad_scale: float, count: int) -> PendingUpdate:
    update = PendingUpdate(landing, grad_scale, count, self._layers)
    # The next step takes (donates) the overlapped leaves' buffers while the
    # update writes them: its views of them are made now, from this thread.
    update.views = {i: self.transfer.views(i, landing[i]) for i in self._overlapped}
    return update

  def _next_step_installs(self) -> bool:
    return True

  def _kernel_pass(self, update: PendingUpdate) -> None:
    """The other leaves first, then the stacked ones a layer at a time, for
    the next step's forward."""
    views = lambda i: update.views.get(i) or self.transfer.views(i, update.landing[i])
    for i in self.adam.update_leaves(views, update.grad_scale, update.count,
                                     skip=self._overlapped):
      update.done.put(i)
    self.adam.update_by_layer(self._overlapped, views, update.grad_scale, update.count,
                              update.layer_ready)
    for i in self._overlapped:
      update.done.put(i)

  def _install(self, pending: PendingUpdate, i) -> None:
    if pending.consumed and i in self._overlapped:  # the step fetched them
      pending.landing.pop(i)
      pending.views.pop(i, None)
    else:
      super()._install(pending, i)
