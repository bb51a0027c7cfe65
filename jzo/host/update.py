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

Overlapping the next step (`Plan.overlaps_update`, pinned transfers), the
update leaves the stacked layers' new weights in their landing buffers:
the update thread runs the other leaves first, which go up before the
next step starts, then the stacked leaves a layer at a time, marking each
layer done; the next step's forward waits for each layer's mark
(`wait_for_layer`, a host callback in the step) and fetches its weights
from the landing buffers itself (jzo.parallel.layer_scan). The step takes those
buffers (donated) and hands them back with its gradients of the stacked
leaves' host parts, written in its backward pass: the exchange after it
downloads only the other leaves. Anything else that reads the params
first applies the update as above (`finish`).

Where the host has no room for one set of landing buffers (`plan.streamed`:
a landing limit without host accumulation), the update streams instead:
each leaf's host part goes down in spans of a quarter of the limit, each
span through the kernel on the update thread and back up into the params at
its offset, the next spans going down meanwhile: the landing buffers take
the limit, not 2 bytes a host parameter.

Under host accumulation (`plan.host_accumulation`) the engine calls
`accumulate` after each micro-batch: each leaf's host parts go down into a
landing buffer (at most `plan.landing_limit` bytes of them at once) and the
update thread sums them into the float32 accumulators (the first
micro-batch writes), then frees the buffer. `host_sums` gives the end of
the step its sum of squares and finite check; `exchange_accumulated` runs
AdamW over the accumulators. One thread runs every host pass in order, so
a leaf's next gradient is summed only into an accumulator the update has
finished reading (the delayed update's), and the new weights go up from
buffers made again from the masters when they are installed (a leaf at a
time), not from a second set of landing buffers.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator

import jax
import numpy as np

from jzo.kernels import ops as kernels
from jzo.kernels import quant8
from jzo.kernels.cpu_adam import AdamHyperparams
from jzo.parallel.partition import is_layout
from jzo.plan import STREAM_SPANS, Plan
from jzo.host.transfer import ShardTransfer

if TYPE_CHECKING:
  from jzo.state.build import ZeroState


class HostUpdate:
  """The host side of an offloading engine, called once per step.

  Args:
    state: the engine's state: its host part (`state.host`) is updated,
      its params receive the new weights (`state.install`), and its step
      counter numbers the updates.
    transfer: moves gradients down and weights up.
    overlap: leave the stacked layers' new weights to the next step (see
      the module docstring; needs pinned transfers and
      `Plan.overlaps_update`).

  The plan's landing limit bounds the bytes of landing buffers held at once
  (0: one set, every host part's gradient). Under host accumulation it
  bounds the micro-batches' leaves waiting for their sums; otherwise the
  update streams: spans of at most landing_limit / STREAM_SPANS bytes go
  down, through the kernel and up, and cannot be delayed.

  Attributes:
    timings: seconds of the last update: `wait_grads` (waiting for the
      device step), `update` (the C++ kernel, on the update thread) and
      `upload` (the exchange of weights and gradients left after the kernel
      finished its last leaf); with host accumulation also `accumulate`
      (the step's summing passes, on the update thread) and `wait_micro`
      (the engine waiting for micro-batches' gradients to leave the devices).
  """

  def __init__(self, state: ZeroState, transfer: ShardTransfer, overlap: bool = False):
    self.state, self.adam, self.transfer = state, state.host, transfer
    adam, plan, landing_limit = state.host, state.plan, state.plan.landing_limit
    self.timings = {"wait_grads": 0.0, "update": 0.0, "upload": 0.0}
    if adam.acc is not None:
      self.timings.update(accumulate=0.0, wait_micro=0.0)
    self._host_leaves = [i for i, l in enumerate(plan.leaves) if l.on_host]
    # grads_in_params: leaves whose gradients come down from the params'
    # memory, which the new weights then take back.
    self._in_params = [i for i, l in enumerate(plan.leaves) if plan.grads_over_weights(l)]
    # offload_params: leaves whose weights, and so gradients, are in pinned
    # host memory: the kernel updates them where they are, nothing moves.
    self._host_params = {i for i, l in enumerate(plan.leaves) if plan.params_on_host(l)}
    # Overlapping the next step: the leaves whose new weights the step
    # fetches from their landing buffers, a layer at a time (none: not).
    self._overlapped = plan.overlapped_leaves() if overlap else []
    self._layers = plan.leaves[self._overlapped[0]].shape[0] if self._overlapped else 0
    self._step_update: _Update | None = None  # whose layers the running step waits for
    # The overlapping step's landing buffers as it handed them back, with
    # the overlapped leaves' host parts' gradients (by leaf), until its
    # exchange takes them.
    self._landed: dict[int, jax.Array] = {}
    self._landing_bytes = plan.landing_bytes
    # Without a limit, micro-batches the host has not summed yet would pile
    # up in pinned memory while the device runs ahead (gpt2-10b: 124 GiB of
    # host RSS against a plan of 103).
    self._landing_limit = landing_limit or sum(map(self._landing_bytes, self._host_leaves))
    # A limit without host accumulation streams the update in spans, a
    # few of them under the limit: one going down, one in the kernel, one
    # going up.
    self._streamed = adam.acc is None and bool(landing_limit)
    self._span_bytes = max(1, self._landing_limit // STREAM_SPANS)
    # int8 moments' scales cover blocks of a flat part: a span holds whole ones.
    self._span_block = quant8.QUANT_BLOCK if quant8.is_int8(adam.hyper.mu_dtype) else 1
    self._landing_held = 0  # bytes of landing buffers the accumulation holds now
    self._landing_freed = threading.Condition()
    self._sums: list = []  # futures of this step's accumulation: (leaf, sq, bad)
    self._executor = concurrent.futures.ThreadPoolExecutor(1, "jzo-host-update")
    self._pending: _Update | None = None
    # The first exception of an update: the host state may then be half
    # updated, so every later call refuses to go on (see `_guard`).
    self.failure: BaseException | None = None
    self.landing_peak = 0  # bytes: the most landing buffers held at once so far

  @property
  def in_flight(self) -> bool:
    return self._pending is not None

  def landing_buffers(self) -> dict[int, jax.Array]:
    """The landing buffers of the update in flight, by leaf index (empty if none)."""
    return dict(self._pending.landing) if self._pending is not None else {}

  def landing_bytes(self) -> int:
    """Bytes of pinned host memory the landing buffers in use hold now."""
    return sum(x.nbytes for x in self.landing_buffers().values())

  def exchange(self, grads: list, skipped, grad_scale, *, delayed: bool) -> None:
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
    """
    with self._guard():
      self._exchange(grads, skipped, grad_scale, delayed)

  def _exchange(self, grads, skipped, grad_scale, delayed) -> None:
    start = time.perf_counter()
    jax.block_until_ready(grads)  # the step is done: its peak has passed
    waited = time.perf_counter()
    skip = bool(skipped)
    landed, self._landed = self._landed, {}
    landing = self._finish(None if skip else grads, landed)
    if skip:
      self.restore_weights()
      return
    count = int(self.state.device.step)  # this update's number (the step counted it)
    if self._streamed:
      if delayed:
        raise ValueError("a streamed update (a landing limit below one step's gradients) "
                         "cannot be delayed: the delayed update keeps them all on the host")
      self._exchange_streamed(grads, float(grad_scale), count)
      self.timings["wait_grads"] = waited - start
      return
    for i in self._host_leaves:
      if i not in landing:
        in_place = i in self._host_params
        landing[i] = grads[i] if in_place else self.transfer.download(i, grads[i])
        grads[i] = None
    # The gradients leave the devices before the next step allocates its memory.
    jax.block_until_ready(list(landing.values()))
    self.landing_peak = max(self.landing_peak, sum(x.nbytes for i, x in landing.items()
                                                   if i not in self._host_params))
    self._pending = _Update(landing, float(grad_scale), count, self._layers)
    # The next step takes (donates) the overlapped leaves' buffers while the
    # update writes them: its views of them are made now, from this thread.
    self._pending.views = {i: self.transfer.views(i, landing[i]) for i in self._overlapped}
    self._pending.future = self._executor.submit(self._run, self._pending)
    self.timings["wait_grads"] = waited - start
    if not delayed and not self._overlapped:
      self._finish(None)

  def overlapped_step(self, run: Callable[[list], Any]) -> Any:
    """Runs `run(landing)`, the call of a step that overlaps the host update,
    and returns what it returns: landing is the overlapped leaves' landing
    buffers (`Plan.overlapped_leaves()` order), where the update in flight
    is writing their new weights, once its other leaves are installed in
    the params. With none in flight (the first step, after a skipped one or
    `finish`), buffers of the weights made from the masters. The step's
    `wait_for_layer` waits for this update's layers; an error of the call
    (the update's, through that callback, where the devices run the step
    at once) is the update's failure. run's last output is the landing
    buffers it took, holding the step's gradients of those leaves' host
    parts: the next `exchange` reads them there (run returns the rest)."""
    with self._guard():
      *out, self._landed = run(self._step_landing())
      self._landed = dict(zip(self._overlapped, self._landed))
      return tuple(out)

  def _step_landing(self) -> list:
    """`overlapped_step`'s landing buffers (its docstring says which)."""
    if self._pending is not None and self._pending.consumed:  # a step run alone took it
      self._finish(None)
    pending = self._pending
    if pending is None:  # (kept here, its buffers would outlive the step)
      landing = [self.transfer.new_landing(i) for i in self._overlapped]
      for i, weights in zip(self._overlapped, landing):
        self.adam.lowp_weights(i, self.transfer.views(i, weights))
      self._step_update = _Update({}, 1.0, 0, self._layers)
      for ready in self._step_update.layer_ready:
        ready.set()
      return landing
    # Its other leaves go first on the update thread.
    for _ in range(len(self._host_leaves) - len(self._overlapped)):
      self._install(pending, pending.done.get())
    pending.consumed = True
    self._step_update = pending
    return [pending.landing[i] for i in self._overlapped]

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

  def _exchange_streamed(self, grads: list, grad_scale: float, count: int) -> None:
    """The update a span at a time (see `ShardTransfer.spans`): each span of
    each leaf, largest leaf first, goes down, through the kernel (on the
    update thread, in order) and up into the params, with at most the
    landing limit of spans between its download and its upload; a leaf's
    gradient leaves the devices with its last span. Arguments as
    `exchange`'s; count is the update's number."""
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

    # Offloaded weights first, where they are: the other leaves' spans go
    # down meanwhile.
    in_place = [self._executor.submit(update, i, None, [grads[i]]) for i in self._host_params]
    moving = [i for i in self._host_leaves if i not in self._host_params]
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
    for future in in_place:
      future.result()
    for i in self._host_params:
      grads[i] = None
      self.state.refresh_resident(i)
    self.timings["update"] = kernel["seconds"]
    self.timings["upload"] = time.perf_counter() - kernel["done"]

  def restore_weights(self) -> None:
    """grads_in_params, after a step whose update does not run (skipped, or
    the device step run alone): the layers' weights, overwritten by its
    gradients, are made again from the masters and go up a span at a time
    (offloaded ones are made where they are; their resident layers' copy
    in device memory, which no step writes, holds them still)."""
    with self._guard():
      # A step run alone may have overlapped an update, whose landing
      # buffers it reads until it ends: that update is let go after it,
      # and the gradients it handed back with them.
      jax.block_until_ready(jax.tree.leaves(self.state.device.params))
      self._landed = {}
      self._finish(None)
      params = jax.tree.leaves(self.state.device.params)
      for i in self._in_params:
        if i in self._host_params:  # in place, in pinned host memory
          self.adam.lowp_weights(i, self.transfer.views(i, params[i]))
          continue
        for span in self.transfer.spans(i, self._span_bytes, self._span_block):
          weights = self.transfer.new_landing(i, span)
          self.adam.lowp_weights(i, self.transfer.views(i, weights), span)
          jax.block_until_ready(self.state.install(i, self.transfer.upload(i, weights), span))
          del weights

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
    with self._guard():
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

  def host_sums(self) -> tuple[np.ndarray, np.ndarray]:
    """Waits for the step's accumulation; returns, per device of this
    process (float32, one entry a device), the sum of squares of its host
    parts' sums and 1 where any is not finite (else 0)."""
    with self._guard():
      sums, self._sums = self._sums, []
      last = {i: (sq, bad) for i, sq, bad in (f.result() for f in sums)}  # the whole step's
      n = len(self.adam.shards)
      sq = sum((v[0] for v in last.values()), np.zeros(n, np.float32))
      bad = sum((v[1] for v in last.values()), np.zeros(n, np.float32))
      return sq, np.minimum(bad, 1)

  def exchange_accumulated(self, skipped, grad_scale, *, delayed: bool) -> None:
    """The host side of a host-accumulated step, after its end on the
    devices: installs the update in flight (the delayed update's), then,
    unless the step was skipped, runs AdamW over the accumulators (left in
    flight with `delayed`). Arguments as `exchange`'s."""
    with self._guard():
      self._finish(None)
      if bool(skipped):
        return
      self._pending = _Update({}, float(grad_scale), int(self.state.device.step))
      self._pending.future = self._executor.submit(self._run, self._pending)
      if not delayed:
        self._finish(None)

  def finish(self) -> None:
    """Applies the update in flight, if any (see `exchange`)."""
    with self._guard():
      self._finish(None)

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
      if pending.consumed and i in self._overlapped:  # the step fetched them
        pending.landing.pop(i)
        pending.views.pop(i, None)
      else:
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

  def _install(self, pending: "_Update", i) -> None:
    """Leaf i's new weights (done by the update `pending`), into the params:
    one leaf at a time, so the uploaded copy is freed before the next
    leaf's comes up. i may be the update thread's exception: it is raised."""
    if isinstance(i, BaseException):
      pending.future.result()  # re-raises with the update thread's traceback
    if i in self._host_params:  # written in place: the params are the landing buffer
      pending.landing.pop(i, None)
      self.state.refresh_resident(i)
    elif i in pending.landing:
      weights = pending.landing.pop(i)
      jax.block_until_ready(self.state.install(i, self.transfer.upload(i, weights)))
      del weights
    else:
      self._upload_from_masters(i)

  def _upload_from_masters(self, i: int) -> None:
    """Host accumulation: leaf i's new weights in the compute dtype, made
    from its masters into a landing buffer under the same limit as the
    micro-batches' (whose sums may still be running: without the limit the
    two sets together took pinned memory the plan does not count), go up
    and are installed."""
    nbytes = self._landing_bytes(i)
    self._hold_landing(nbytes)
    try:
      weights = self.transfer.new_landing(i)
      self.adam.lowp_weights(i, self.transfer.views(i, weights))
      jax.block_until_ready(self.state.install(i, self.transfer.upload(i, weights)))
      del weights
    finally:
      self._release_landing(nbytes)

  def _run(self, update: "_Update") -> None:
    start = time.perf_counter()
    try:
      if self.adam.acc is not None:  # host accumulation: the float32 sums
        sums = jax.tree.leaves(self.adam.acc)
        leaves = self.adam.update_leaves(lambda i: sums[i], update.grad_scale, update.count,
                                         lowp=False)
      else:
        views = lambda i: update.views.get(i) or self.transfer.views(i, update.landing[i])
        leaves = self.adam.update_leaves(views, update.grad_scale, update.count,
                                         skip=self._overlapped)
      for i in leaves:
        update.done.put(i)
      if self._overlapped:  # last, a layer at a time, for the next step's forward
        self.adam.update_by_layer(self._overlapped, views, update.grad_scale, update.count,
                                  update.layer_ready)
        for i in self._overlapped:
          update.done.put(i)
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

  def close(self) -> None:
    """Stops the update thread (call `finish` first to apply an update in flight)."""
    self._executor.shutdown()


class _Update:
  """One step's host update (number `count`): its landing buffers (by leaf
  index; the overlapped leaves' also as numpy views, `views`, which the
  update thread uses: the next step takes the arrays themselves), the
  leaves the kernel has finished, in order (None: all done),
  and overlapping the next step, a mark for each of its `layers` layers
  done, whether that step took the overlapped leaves' buffers (`consumed`)
  and the update thread's exception (`error`)."""

  def __init__(self, landing: dict, grad_scale: float, count: int, layers: int = 0):
    self.landing, self.grad_scale, self.count = landing, grad_scale, count
    self.views: dict[int, list] = {}  # of the overlapped leaves' buffers, made beforehand
    self.layer_ready = [threading.Event() for _ in range(layers)]
    self.consumed = False
    self.error: BaseException | None = None
    self.done: queue.Queue = queue.Queue()
    self.future: concurrent.futures.Future | None = None
    self.kernel_s = 0.0
    self.kernel_done = 0.0
