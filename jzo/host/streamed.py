"""The streamed host update, a span at a time under a landing limit (see
jzo.host.update for the modes)."""

from __future__ import annotations

import collections
import time
from typing import Callable

import jax

from jzo.host.update import HostUpdate


class StreamedUpdate(HostUpdate):
  """Where the host has no room for one set of landing buffers (a landing
  limit without host accumulation: `Plan.streamed`): each leaf's host part
  goes down in spans of a quarter of the limit, each span through the
  kernel on the update thread and back up into the params at its offset,
  the next spans going down meanwhile: the landing buffers take the limit,
  not 2 bytes a host parameter. It cannot be delayed."""

  def after_step(self, grads: list, skipped, grad_scale, *, delayed: bool) -> None:
    """The host side of one step, after the engine's device step; arguments
    as `WholeUpdate.after_step`'s.

    Raises:
      ValueError: `delayed`: the delayed update keeps every gradient on the host.
    """
    with self.guard():
      start = time.perf_counter()
      jax.block_until_ready(grads)  # the step is done: its peak has passed
      waited = time.perf_counter()
      if bool(skipped):
        self.restore_weights()
        return
      if delayed:
        raise ValueError("a streamed update (a landing limit below one step's gradients) "
                         "cannot be delayed: the delayed update keeps them all on the host")
      count = int(self.state.device.step)  # this update's number (the step counted it)
      self._stream(grads, float(grad_scale), count)
      self.timings["wait_grads"] = waited - start

  def _stream(self, grads: list, grad_scale: float, count: int) -> None:
    """The update a span at a time (see `ShardTransfer.spans`): each span of
    each leaf, largest leaf first, goes down, through the kernel (on the
    update thread, in order) and up into the params, with at most the
    landing limit of spans between its download and its upload; a leaf's
    gradient leaves the devices with its last span. count is the update's
    number."""
    scalars = self.adam.step_scalars(count)
    kernel = {"seconds": 0.0, "done": time.perf_counter()}

    def update(i: int, span: tuple[int, int] | None, handed: list) -> None:
      begin = time.perf_counter()
      self.adam.update_part(i, self.transfer.views(i, handed[0]), grad_scale, scalars, count,
                            span)
      kernel["done"] = time.perf_counter()
      kernel["seconds"] += kernel["done"] - begin

    in_flight: collections.deque = collections.deque()  # (leaf, span, [landing], future, bytes)
    held = 0

    def upload_oldest() -> None:
      nonlocal held
      i, span, handed, future, nbytes = in_flight.popleft()
      future.result()
      weights = self.state.install(i, self.transfer.upload(i, handed.pop()), span)
      if grads[i] is not None and i in self._in_params:
        grads[i] = weights  # the install took the gradient's array: its other spans are here
      jax.block_until_ready(weights)
      held -= nbytes

    # Leaves updated where they are first: the other leaves' spans go down meanwhile.
    in_place = self._update_in_place(grads, update)
    moving = [i for i in self._host_leaves if i not in in_place]
    for i in sorted(moving, key=lambda i: -grads[i].size):
      for span in self.transfer.spans(i, self._span_bytes, self._span_block):
        nbytes = self.transfer.span_bytes(i, span)
        while in_flight and held + nbytes > self._landing_limit:
          upload_oldest()
        # Handed over in a list emptied at its upload, so that the buffer
        # is freed then, not when the executor's work item is.
        handed = [self.transfer.download(i, grads[i], span)]
        held += nbytes
        self.landing_peak = max(self.landing_peak, held)
        in_flight.append((i, span, handed, self._executor.submit(update, i, span, handed), nbytes))
      grads[i] = None
    while in_flight:
      upload_oldest()
    for future in in_place.values():
      future.result()
    for i in in_place:
      grads[i] = None
      self.state.refresh_resident(i)
    self.timings["update"] = kernel["seconds"]
    self.timings["upload"] = time.perf_counter() - kernel["done"]

  def _update_in_place(self, grads: list, update: Callable) -> dict:
    """Starts the update of the leaves whose gradients the kernel reads
    where they lie (none here): {leaf: its future}; update(i, None, [grad])
    runs one on the update thread."""
    return {}
