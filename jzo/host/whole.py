"""The whole host update: one set of landing buffers a step (see
jzo.host.update for the modes)."""

from __future__ import annotations

import time

import jax

from jzo.host.update import HostUpdate, PendingUpdate


class WholeUpdate(HostUpdate):
  """Every host part's gradient lands at once; the update thread runs the
  kernel over them, largest leaf first, and each leaf's new weights go up
  as soon as the kernel has them. With `delayed`, the pass stays in flight
  until the next step's `after_step` (or `finish`) installs it, each leaf's
  new gradient coming down into the memory its landing buffer freed."""

  def after_step(self, grads: list, skipped, grad_scale, *, delayed: bool) -> None:
    """The host side of one step, after the engine's device step.

    Args:
      grads: per leaf (jax.tree.leaves order), the step's local flat
        gradients on the devices (leaves without a host part: ignored).
        Each entry is set to None once its copy down is under way, so its
        device memory is freed as soon as the copy is done: the caller
        must keep no other reference.
      skipped, grad_scale: the step's device scalars.
      delayed: leave this step's update in flight (the delayed update);
        otherwise it is applied before this returns.
    """
    with self.guard():
      start = time.perf_counter()
      jax.block_until_ready(grads)  # the step is done: its peak has passed
      waited = time.perf_counter()
      skip = bool(skipped)
      landing = self._finish(None if skip else grads, self._take_step_landing())
      if skip:
        self.restore_weights()
        return
      count = int(self.state.device.step)  # this update's number (the step counted it)
      for i in self._host_leaves:
        if i not in landing:
          landing[i] = self._land(i, grads[i])
          grads[i] = None
      # The gradients leave the devices before the next step allocates its memory.
      jax.block_until_ready(list(landing.values()))
      self.landing_peak = max(self.landing_peak, self._moved_bytes(landing))
      self._start(self._new_update(landing, float(grad_scale), count))
      self.timings["wait_grads"] = waited - start
      if not delayed and not self._next_step_installs():
        self._finish(None)

  def _land(self, i: int, grad: jax.Array) -> jax.Array:
    """Leaf i's host part's gradient in its landing buffer (on its way down)."""
    return self.transfer.download(i, grad)

  def _moved_bytes(self, landing: dict) -> int:
    """Bytes that moved into the landing buffers `landing` (by leaf)."""
    return sum(x.nbytes for x in landing.values())

  def _take_step_landing(self) -> dict:
    """The landing buffers the step handed back, by leaf (none here)."""
    return {}

  def _new_update(self, landing: dict, grad_scale: float, count: int) -> PendingUpdate:
    return PendingUpdate(landing, grad_scale, count)

  def _next_step_installs(self) -> bool:
    """Whether the next step's forward installs this update (it does not here)."""
    return False
