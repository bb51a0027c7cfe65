"""The host update: what an offloading engine does on the host each step,
after its device step. It has several modes, each a strategy (a subclass of
`HostUpdate`) that the engine picks once, when it is built:

  WholeUpdate (jzo.host.whole): one set of landing buffers. Each leaf's
    host part goes down, the update thread runs the kernel over it, its new
    weights go up into the params. With the delayed update the kernel pass
    stays in flight until the next step's exchange, which installs it leaf
    by leaf, each new gradient coming down into the memory just freed.
  OverlappedUpdate (jzo.host.overlapped): the whole update whose stacked
    layers' new weights the next step's forward fetches itself, a layer at
    a time, as the kernel finishes each.
  StreamedUpdate (jzo.host.streamed): spans of each leaf go down, through
    the kernel and up, overlapped, under a landing limit: for hosts without
    room for one set of landing buffers.
  AccumulatedUpdate (jzo.host.accumulated): each micro-batch's host parts
    go down after its device call and are summed on the host; the kernel
    runs over the sums.

  ParamsOnHostUpdate, StreamedParamsOnHostUpdate (jzo.host.params_on_host):
    parameters offloaded: the stacked layers' weights, and so their
    gradients, live in pinned host memory, where the kernel updates them in
    place; the other leaves go whole or streamed, as above.

Uploads wait for the device step to finish, so the new weights never sit
beside the step's activations, and the device keeps the host parts'
gradients only until they are down. One thread runs every kernel pass in
order. The engine drives the step: it calls the device step itself, then
the strategy; no device step runs inside a host object.

This module holds what every mode shares: the update thread, the update in
flight and its installation, the failure guard, the weights remade from the
masters after a step whose update does not run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import time
from typing import Protocol

import jax

from jzo.host.adam import HostAdam
from jzo.host.transfer import ShardTransfer
from jzo.kernels import quant8
from jzo.plan import STREAM_SPANS, Plan


class TrainedState(Protocol):
  """What the host update reads and writes of the engine's state
  (jzo.state.build.ZeroState)."""
  plan: Plan
  host: HostAdam
  device: object  # the device state: its `step` counter numbers the updates; `params`

  def install(self, i: int, uploaded: jax.Array, span: tuple[int, int] | None = None
              ) -> jax.Array: ...

  def refresh_resident(self, i: int | None = None) -> None: ...


class HostUpdate:
  """What every mode of the host update shares (see the module docstring).

  Args:
    state: the engine's state: its host part (`state.host`) is updated,
      its params receive the new weights (`state.install`), and its step
      counter numbers the updates.
    transfer: moves gradients down and weights up.

  Attributes:
    timings: seconds of the last update: `wait_grads` (waiting for the
      device step), `update` (the C++ kernel, on the update thread) and
      `upload` (the exchange of weights and gradients left after the kernel
      finished its last leaf); host accumulation adds its own.
    landing_peak: bytes: the most landing buffers held at once so far.
    failure: the first exception of an update, after which every call
      refuses to go on (see `guard`).
    transfer: the transfer given.
  """

  def __init__(self, state: TrainedState, transfer: ShardTransfer):
    self.state, self.adam, self.transfer = state, state.host, transfer
    plan = state.plan
    self.timings = {"wait_grads": 0.0, "update": 0.0, "upload": 0.0}
    self._host_leaves = [i for i, l in enumerate(plan.leaves) if l.on_host]
    # grads_in_params: leaves whose gradients come down from the params'
    # memory, which the new weights then take back.
    self._in_params = [i for i, l in enumerate(plan.leaves) if plan.grads_over_weights(l)]
    self._landing_bytes = plan.landing_bytes
    # Without a limit, micro-batches the host has not summed yet would pile
    # up in pinned memory while the device runs ahead (gpt2-10b: 124 GiB of
    # host RSS against a plan of 103).
    self._landing_limit = (plan.landing_limit
                           or sum(map(self._landing_bytes, self._host_leaves)))
    # Spans a few of which fit under the limit: one going down, one in the
    # kernel, one going up (the streamed update, and weights remade from
    # the masters).
    self._span_bytes = max(1, self._landing_limit // STREAM_SPANS)
    # int8 moments' scales cover blocks of a flat part: a span holds whole ones.
    self._span_block = quant8.QUANT_BLOCK if quant8.is_int8(self.adam.hyper.mu_dtype) else 1
    self._executor = concurrent.futures.ThreadPoolExecutor(1, "jzo-host-update")
    self._pending: PendingUpdate | None = None
    self.failure: BaseException | None = None
    self.landing_peak = 0

  @property
  def in_flight(self) -> bool:
    """An update is in flight (the delayed update's, or one the next step's
    forward overlaps)."""
    return self._pending is not None

  def landing_buffers(self) -> dict[int, jax.Array]:
    """The landing buffers of the update in flight, by leaf index (empty if none)."""
    return dict(self._pending.landing) if self._pending is not None else {}

  def landing_bytes(self) -> int:
    """Bytes of pinned host memory the landing buffers in use hold now."""
    return sum(x.nbytes for x in self.landing_buffers().values())

  def finish(self) -> None:
    """Applies the update in flight, if any."""
    with self.guard():
      self._finish(None)

  def close(self) -> None:
    """Stops the update thread (call `finish` first to apply an update in flight)."""
    self._executor.shutdown()

  @contextlib.contextmanager
  def guard(self):
    """Refuses to start once an update has failed, and records a failure
    inside: the host state (masters, moments, the params' host parts) may
    then be half updated, and only a checkpoint can restore a consistent
    state. The engine runs a step that overlaps the update inside it too."""
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

  def restore_weights(self) -> None:
    """grads_in_params, after a step whose update does not run (skipped, or
    the device step run alone): the layers' weights, overwritten by its
    gradients, are made again from the masters and go up a span at a time
    (offloaded ones are made where they are; their resident layers' copy
    in device memory, which no step writes, holds them still)."""
    with self.guard():
      # A step run alone may have overlapped an update, whose landing
      # buffers it reads until it ends: that update is let go after it.
      jax.block_until_ready(jax.tree.leaves(self.state.device.params))
      self._let_go_of_step_landing()
      self._finish(None)
      params = jax.tree.leaves(self.state.device.params)
      for i in self._in_params:
        self._remake_weights(i, params[i])

  def _remake_weights(self, i: int, weights_leaf: jax.Array) -> None:
    """Leaf i's weights made again from its masters and installed, a span
    at a time (weights_leaf: the params' leaf they replace)."""
    for span in self.transfer.spans(i, self._span_bytes, self._span_block):
      weights = self.transfer.new_landing(i, span)
      self.adam.lowp_weights(i, self.transfer.views(i, weights), span)
      jax.block_until_ready(self.state.install(i, self.transfer.upload(i, weights), span))
      del weights

  def _let_go_of_step_landing(self) -> None:
    """Drops landing buffers a step handed back (only an overlapped step does)."""

  def _start(self, update: PendingUpdate) -> None:
    """Puts `update` in flight: its kernel pass starts on the update thread."""
    self._pending = update
    update.future = self._executor.submit(self._run, update)

  def _run(self, update: PendingUpdate) -> None:
    """On the update thread: the kernel pass (`_kernel_pass`), with its
    failure and time recorded in the update."""
    start = time.perf_counter()
    try:
      self._kernel_pass(update)
    except BaseException as e:
      update.error = e
      for ready in update.layer_ready:  # a step waiting on them fails, not hangs
        ready.set()
      update.done.put(e)
      raise
    finally:
      update.kernel_done = time.perf_counter()
      update.kernel_s = update.kernel_done - start
      update.done.put(None)

  def _kernel_pass(self, update: PendingUpdate) -> None:
    """AdamW over the update's landing buffers, leaf by leaf, each leaf's
    index put in `update.done` as the kernel finishes it."""
    views = lambda i: update.views.get(i) or self.transfer.views(i, update.landing[i])
    for i in self.adam.update_leaves(views, update.grad_scale, update.count):
      update.done.put(i)

  def _finish(self, next_grads, landed: dict | None = None) -> dict:
    """Uploads and installs the update in flight leaf by leaf; with
    next_grads, downloads each leaf's new gradient into the memory its
    landing buffer freed, but for those the step already put in `landed`
    (by leaf). Returns the new landing buffers by leaf."""
    landed = landed or {}
    if self._pending is None:
      return dict(landed) if next_grads is not None else {}
    pending, self._pending = self._pending, None
    landing = dict(landed) if next_grads is not None else {}
    while (i := pending.done.get()) is not None:
      self._install(pending, i)
      if next_grads is not None:
        if i not in landed:
          landing[i] = self.transfer.download(i, next_grads[i])
        next_grads[i] = None
        if self.transfer.layouts[i].on_device:  # its host part was sliced out into a copy
          jax.block_until_ready(landing[i])
    pending.future.result()
    self.timings["update"] = pending.kernel_s
    self.timings["upload"] = time.perf_counter() - pending.kernel_done
    return landing

  def _install(self, pending: PendingUpdate, i) -> None:
    """Leaf i's new weights (done by the update `pending`), into the params:
    one leaf at a time, so the uploaded copy is freed before the next
    leaf's comes up. i may be the update thread's exception: it is raised."""
    if isinstance(i, BaseException):
      pending.future.result()  # re-raises with the update thread's traceback
    weights = pending.landing.pop(i)
    jax.block_until_ready(self.state.install(i, self.transfer.upload(i, weights)))
    del weights


class PendingUpdate:
  """One step's host update (number `count`): its landing buffers (by leaf
  index; an overlapped step's leaves also as numpy views, `views`, which the
  update thread uses: the next step takes the arrays themselves), the
  leaves the kernel has finished, in order (None: all done), and, when the
  next step overlaps it, a mark for each of its `layers` layers done,
  whether that step took the overlapped leaves' buffers (`consumed`) and
  the update thread's exception (`error`)."""

  def __init__(self, landing: dict, grad_scale: float, count: int, layers: int = 0):
    self.landing, self.grad_scale, self.count = landing, grad_scale, count
    self.views: dict[int, list] = {}
    self.layer_ready = [threading.Event() for _ in range(layers)]
    self.consumed = False
    self.error: BaseException | None = None
    self.done: queue.Queue = queue.Queue()
    self.future: concurrent.futures.Future | None = None
    self.kernel_s = 0.0
    self.kernel_done = 0.0
