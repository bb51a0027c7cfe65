"""The placement search: where each leaf's optimizer state lives, and
whether the plan fits.

`make_plan` places the state: `offload=False` keeps it on the devices,
`True` puts all of it on the host, a fraction f in [0, 1] puts about f of
every leaf on the host, and "auto" keeps as many whole leaves on the devices
as fit in their memory, then part of one more (a device update costs milliseconds where the host
kernel needs about 28 bytes of host memory traffic per parameter, so the
host then has the least work possible) and offloads the rest.

`check_fits` raises PlacementError with the numbers where a plan does not
fit the device or the host.
"""

from __future__ import annotations

import dataclasses

import jax

from jzo.parallel import partition
from jzo.options import EngineOptions
from jzo.parallel.partition import LeafLayout, is_layout
from jzo.plan.machine import (BUILD_CHUNK_BYTES, HOST_RUNTIME_BYTES, PINNED_POOL_LIMIT_VAR,
                              pinned_pool_limit, pool_share)
from jzo.plan.draws import DRAW_GROUP_FLOOR
from jzo.plan.plan import GiB, STREAM_LANDING_BYTES, Plan, shard_rows

# Share of the device memory the planner leaves free for what it does not
# model (XLA's fragmentation, cuDNN and cuBLAS workspaces).
DEVICE_HEADROOM = 0.06
# Host part of a large split leaf: a multiple of this many elements (a cache
# line of float32), so that the split falls on a cache-line boundary.
_ALIGN = 16
# Host RAM a checkpoint's save holds beside the state, past what the spans in
# flight and their copies take: orbax's and tensorstore's own (`save_bytes`).
SAVE_FIXED_BYTES = 64 * 2**20


def save_bytes(state: int) -> int:
  """Host RAM a checkpoint's save of `state` bytes (one process's masters
  and moments) can hold at most, within whatever cap the caller counts
  (jzo.checkpoint.SAVE_HOST_BYTES, measured on large states): its spans in
  flight and their copies are at most the state twice. (Measured on a CPU:
  the peak rose 8.6 MiB over the save of a 5.0 MiB state, 0.68-0.83 GiB over
  one of 0.64 GiB.)"""
  return 2 * state + SAVE_FIXED_BYTES


class PlacementError(MemoryError):
  """A configuration does not fit the memory there is; the message has the
  numbers, and `plan` is the plan they are of (None where none was made)."""

  def __init__(self, message: str, plan: Plan | None = None):
    super().__init__(message)
    self.plan = plan


def place(layouts, offload, *, stage: int, n_devices: int):
  """Layouts with every leaf's state placed: offload is False, True or a
  fraction f of each leaf's shard to put on the host.

  Stages 1-2 on several devices gather the new weights of a split leaf into
  full replicated params in place, which needs a leaf without padding; a
  padded leaf goes whole to the side that holds most of it.
  """
  if offload is False:
    return jax.tree.map(lambda l: l.place(None), layouts, is_leaf=is_layout)
  f = 1.0 if offload is True else float(offload)

  def one(l: LeafLayout) -> LeafLayout:
    k = l.shard_size
    host = round(f * k)
    if k >= 64 * _ALIGN:  # large shards: keep the host part's start aligned
      host = min(k, _ALIGN * round(f * k / _ALIGN))
    whole_only = stage in (1, 2) and n_devices > 1 and l.padded
    if whole_only and 0 < host < k:
      host = k if f >= 0.5 else 0
    return l.place(k - host)
  return jax.tree.map(one, layouts, is_leaf=is_layout)


def _fits(plan: Plan, device_memory: int, activations: int) -> bool:
  """The plan's step and its build fit in `device_memory` less the headroom."""
  budget = device_memory * (1 - DEVICE_HEADROOM)
  return (sum(plan.device_peak(activations).values()) <= budget
          and sum(plan.device_bytes().values()) + plan.build_bytes() <= budget)


def _without_overlap_if_needed(plan: Plan, device_memory: int | None, activations: int) -> Plan:
  """The plan, without the forward overlapping the host update where only
  that keeps it from fitting (its fetched layers; see OVERLAP_FETCH_LAYERS):
  the weights on the device are worth more than the overlap."""
  if (device_memory is None or not plan.overlaps_update
      or _fits(plan, device_memory, activations)):
    return plan
  without = dataclasses.replace(plan, overlap_forward=False)
  return without if _fits(without, device_memory, activations) else plan


def layers_resident(plan_of, layouts, device_memory: int, activations: int):
  """(layouts, r) for offload_params="auto": the layouts as they are and
  r = 0 where the stacked layers' weights fit on the device (nothing is
  offloaded); else every stacked leaf's weights in host memory and the
  most layers r whose weights also stay in device memory that still fits
  (0 if none does: the plan's check then says by how much). Each resident
  layer's weights are not fetched in the step (twice: forward and
  backward), only once after the host update. `plan_of(layouts, r)`
  builds the plan."""
  if _fits(_without_overlap_if_needed(plan_of(layouts, 0), device_memory, activations),
           device_memory, activations):
    return layouts, 0
  layouts = jax.tree.map(lambda l: dataclasses.replace(l, weights_on_host=l.per_layer),
                         layouts, is_leaf=is_layout)
  fits = lambda r: _fits(plan_of(layouts, r), device_memory, activations)
  lo, hi = 0, max(map(shard_rows, jax.tree.leaves(layouts, is_leaf=is_layout)))
  while lo < hi:  # the plan's device bytes grow with r
    mid = (lo + hi + 1) // 2
    if fits(mid):
      lo = mid
    else:
      hi = mid - 1
  return layouts, lo


def auto_layouts(plan_of, base, device_memory: int, activations: int):
  """Layouts that keep as much state on the device as fits in
  `device_memory` (less the headroom): whole leaves first, largest first,
  then the largest part of one more leaf that still fits; the rest on the
  host. `plan_of(layouts)` builds the plan."""

  def fits(leaves) -> bool:
    return _fits(plan_of(jax.tree.unflatten(treedef, leaves)), device_memory, activations)
  leaves, treedef = jax.tree.flatten(base, is_leaf=is_layout)
  on_device = [l.place(None) for l in leaves]
  if fits(on_device):
    return jax.tree.unflatten(treedef, on_device)
  placed = [l.place(0) for l in leaves]
  by_size = sorted(range(len(leaves)), key=lambda i: -leaves[i].shard_size * shard_rows(leaves[i]))
  for i in by_size:
    trial = placed[:i] + [leaves[i].place(None)] + placed[i + 1:]
    if fits(trial):
      placed = trial
  plan = plan_of(jax.tree.unflatten(treedef, placed))
  for i in by_size:  # the first host leaf that can be split: as much of it as fits
    l = placed[i]
    if l.on_device or (plan.stage in (1, 2) and plan.n_devices > 1 and l.padded):
      continue
    lo, hi = 0, l.shard_size // _ALIGN  # units of _ALIGN elements on the device
    while lo < hi:
      mid = (lo + hi + 1) // 2
      if fits(placed[:i] + [l.place(mid * _ALIGN)] + placed[i + 1:]):
        lo = mid
      else:
        hi = mid - 1
    if lo:
      placed[i] = l.place(lo * _ALIGN)
      break
  return jax.tree.unflatten(treedef, placed)


def _total_and_parts(parts: dict[str, int]) -> tuple[int, str]:
  """Bytes in all, and the non-zero parts in GiB for a message."""
  return sum(parts.values()), ", ".join(f"{k} {v / GiB:.2f}" for k, v in parts.items() if v)


def check_fits(plan: Plan, *, activations: int, device_memory: int | None,
               host_memory: int | None) -> None:
  """Raises PlacementError with the numbers when the plan does not fit."""
  if device_memory is not None:
    need, parts = _total_and_parts(plan.device_peak(activations))
    if need > device_memory:
      raise PlacementError(
          f"does not fit a device: needs {need / GiB:.2f} GiB per device ({parts} GiB), "
          f"{device_memory / GiB:.2f} GiB available"
          + ("; offload more of the optimizer state (offload=... or 'auto')"
             if plan.cpu_adam and plan.offloaded_fraction < 1 else ""), plan=plan)
    state = sum(plan.device_bytes().values())
    if state + plan.build_bytes() > device_memory:
      raise PlacementError(
          f"cannot draw the weights on a device beside the state: needs "
          f"{(state + plan.build_bytes()) / GiB:.2f} GiB (state {state / GiB:.2f}, the leaves "
          f"drawn {plan.build_bytes() / GiB:.2f}), {device_memory / GiB:.2f} GiB available"
          + ("" if plan.sliced_draws else "; an initializer computes each leaf whole, while "
             "weights from arrays or files are drawn a slice of layers at a time"), plan=plan)
  if plan.cpu_adam and host_memory is not None:
    # Without a device memory the devices are the host's (CPU): the draw is in host RAM.
    building = plan.build_bytes() if device_memory is None else BUILD_CHUNK_BYTES
    host, pinned = plan.host_bytes(), plan.pinned_bytes()
    what = "the landing buffers and offloaded weights" if plan.offload_params else \
        "the landing buffers"
    share = pool_share(pinned, plan.local_devices)
    if device_memory is not None and share + BUILD_CHUNK_BYTES > pinned_pool_limit():
      per_device = f" ({share / GiB:.2f} a device)" if plan.local_devices > 1 else ""
      raise PlacementError(
          f"{what} need {pinned / GiB:.2f} GiB of pinned host memory{per_device} "
          f"(and {BUILD_CHUNK_BYTES / GiB:.2f} to build the state), XLA's pinned pool "
          f"of a device is capped at {pinned_pool_limit() / GiB:.0f} GiB: set "
          f"{PINNED_POOL_LIMIT_VAR} higher before JAX starts (jzo.plan.limit_pinned_pool)",
          plan=plan)
    need, parts = _total_and_parts({**host, "building": building,
                                    "pinned pool overhead": plan.pool_overhead(),
                                    "runtime": plan.runtime_bytes,
                                    "checkpoint writes": plan.checkpoint_bytes})
    if need > host_memory:
      without = ""
      if need - plan.checkpoint_bytes <= host_memory:
        without = (f"; it fits without the {plan.checkpoint_bytes / GiB:.2f} GiB a checkpoint's "
                   "save takes while it writes: save none (jzo.train: --checkpoint-every 0), "
                   "or keep more of the state on the devices")
      raise PlacementError(
          f"offloaded optimizer state needs {need / GiB:.2f} GiB of host RAM "
          f"({plan.host_elements:,} parameters incl. padding: {parts} GiB), "
          f"{host_memory / GiB:.2f} GiB available{without}", plan=plan)


def make_plan(shapes, tx_state_bytes: int, options: EngineOptions, *, n_devices: int,
              axis: str = "data", device_memory: int | None = None,
              host_memory: int | None = None, activations: int = 0,
              processes: int = 1, checkpoint_memory: int = 0,
              runtime_bytes: int = HOST_RUNTIME_BYTES, sliced_draws: bool = False,
              checked: bool = True) -> Plan:
  """The plan of an engine with `options` over params of `shapes` (a tree
  of arrays or ShapeDtypeStructs) on a data axis of `n_devices`, keeping
  `tx_state_bytes` of optimizer state per parameter besides the masters.
  `processes`: how many share the data axis, each with its own host memory
  (`host_memory` is one process's). `device_memory` None: the devices are
  CPUs (no pinned pools; the weights are drawn in host RAM). Checks that
  the plan fits the memory given (None: not checked; `checked=False`:
  neither, to show where a refused plan's memory would go) before anything
  is allocated, on the host with `checkpoint_memory` bytes for a
  checkpoint's save beside the state (see `Plan.checkpoint_bytes`) and
  `runtime_bytes` for the process's runtime (`host_runtime_bytes`);
  offload="auto" needs `device_memory`. `sliced_draws`: the params' source
  gives a stacked leaf's layers apart (`Plan.sliced_draws`).

  `options.accumulation` (grad_accum > 1 with offload): "device" sums the
  micro-batches' gradients in float32 on the device, "host" sums the host
  parts' on the host (one micro-batch's gradients on the device; landing
  buffers for one micro-batch if the host has room, else a ring), "auto"
  the device where its plan fits, else the host; with grads_in_params the
  layers run first ("layers", and "auto": `Plan.layers_first`) or sum in
  their backward pass ("device"). `options.landing_limit`:
  bytes of landing buffers one process holds at once (`Plan.landing_limit`);
  None: a streamed update through STREAM_LANDING_BYTES where one step's host
  parts are more (unless the step overlaps the update and the host has room
  for them: `Plan.overlaps_update`); under host accumulation one set where the host has room,
  else a ring of two leaves; the delayed update needs one set.

  Raises:
    ValueError: offload="auto" without device_memory, a landing limit with
      the delayed update, layers that name no subtree.
    PlacementError: the plan does not fit.
  """
  kw = dict(n_devices=n_devices, axis=axis, device_memory=device_memory,
            host_memory=host_memory, activations=activations, processes=processes,
            checkpoint_memory=checkpoint_memory, runtime_bytes=runtime_bytes,
            sliced_draws=sliced_draws, checked=checked)
  if (options.grad_accum == 1 or not options.offloading or options.accumulation == "device"
      or options.grads_in_params):  # the layers first, or their sums in the backward
    return _plan_with_landing(shapes, tx_state_bytes, options, host_accumulation=False, **kw)
  if options.accumulation == "auto":
    try:  # the device's sums need no host pass and no download per micro-batch
      return _plan_with_landing(shapes, tx_state_bytes, options, host_accumulation=False, **kw)
    except PlacementError:
      pass
  return _plan_with_landing(shapes, tx_state_bytes, options, host_accumulation=True, **kw)


def _plan_with_landing(shapes, tx_state_bytes: int, options: EngineOptions, *,
                       host_accumulation: bool, device_memory: int | None,
                       host_memory: int | None, activations: int, checked: bool,
                       **kw) -> Plan:
  """make_plan with the accumulation decided and the landing limit given
  or chosen (see make_plan)."""
  kw.update(device_memory=device_memory, activations=activations,
            host_accumulation=host_accumulation, checked=checked)
  landing_limit = options.landing_limit
  if not host_accumulation and landing_limit and options.delayed_update:
    raise ValueError("landing_limit streams the host update in spans, which cannot be "
                     "delayed: the delayed update keeps a whole step's gradients on the host "
                     "(set delayed_update=False, or no landing_limit)")
  if landing_limit is not None:
    return _make_plan(shapes, tx_state_bytes, options, landing_limit=landing_limit,
                      host_memory=host_memory, **kw)
  # Checked below, once the landing buffers are chosen: a whole set's exchange
  # may not fit the device where the streamed update's spans do.
  plan = _make_plan(shapes, tx_state_bytes, options, landing_limit=0, host_memory=None,
                    **{**kw, "checked": False})

  def check(plan: Plan) -> None:
    if checked:
      check_fits(plan, activations=activations, device_memory=device_memory,
                 host_memory=host_memory)

  if not host_accumulation:
    if not plan.delayed_update and plan.host_bytes()["landing"] > STREAM_LANDING_BYTES:
      if plan.overlaps_update:
        try:  # one set where the host has room: the next step's forward can then
          check(plan)  # overlap the update (jzo.step.plain), which a streamed one cannot
          return plan
        except PlacementError:
          pass
      # Streamed, the update overlaps its transfers with the kernel: as fast
      # or faster, in 2 B a parameter less host memory (docs/performance.md).
      plan = dataclasses.replace(plan, landing_limit=STREAM_LANDING_BYTES)
    check(plan)
    return plan
  if not plan.has_host_state:  # nothing on the host: the device alone is checked
    plan = dataclasses.replace(plan, host_accumulation=False)
    if checked:
      check_fits(plan, activations=activations, device_memory=device_memory, host_memory=None)
    return plan
  try:  # one micro-batch's landing buffers, so the device never waits for the host's sums
    check(plan)
    return plan
  except PlacementError:
    plan = dataclasses.replace(plan, landing_limit=plan.landing_ring())
  check(plan)
  return plan


def _make_plan(shapes, tx_state_bytes: int, options: EngineOptions, *, n_devices: int,
               axis: str, device_memory: int | None, host_memory: int | None,
               activations: int, processes: int, host_accumulation: bool,
               checkpoint_memory: int, runtime_bytes: int, sliced_draws: bool,
               landing_limit: int = 0, checked: bool = True) -> Plan:
  """make_plan with the accumulation decided."""
  stage, layers, offload = options.stage, options.layers, options.offload
  auto = isinstance(offload, str)  # "auto", the one string EngineOptions lets through
  if auto and device_memory is None:
    raise ValueError("offload='auto' needs the device memory: pass device_memory= (bytes); "
                     "this device reports no limit")
  shards = 1 if stage == 0 else n_devices
  base = partition.make_layouts(shapes, shards, layers)
  elements = sum(l.shards * shard_rows(l) * l.shard_size
                 for l in jax.tree.leaves(base, is_leaf=is_layout))
  checkpoint_memory = min(checkpoint_memory,
                          save_bytes((4 + tx_state_bytes) * elements // processes))
  if layers is not None:
    partition.subtree(base, layers)  # names a subtree of the params, or raises

  def plan_of(layouts, resident_layers: int = 0) -> Plan:
    return Plan(
        layouts=layouts, stage=stage, n_devices=n_devices, axis=axis,
        compute_dtype=options.compute_dtype, grad_dtype=options.grad_dtype,
        loss_scale=options.loss_scale, grad_accum=options.grad_accum,
        max_grad_norm=options.max_grad_norm, layers=layers, cpu_adam=options.offloading,
        delayed_update=options.delayed_update, dpu_warmup=options.dpu_warmup,
        moment_bytes=tx_state_bytes, processes=processes,
        host_accumulation=host_accumulation, landing_limit=landing_limit,
        grads_in_params=options.grads_in_params, checkpoint_bytes=checkpoint_memory,
        runtime_bytes=runtime_bytes, resident_layers=resident_layers,
        draw_floor=DRAW_GROUP_FLOOR if device_memory is None else 0, sliced_draws=sliced_draws,
        pinned_pools=device_memory is not None, overlap_forward=options.overlap_forward,
        layers_first=options.layers_first, deterministic=options.deterministic)
  if auto:
    layouts = auto_layouts(plan_of, base, device_memory, activations)
  else:
    layouts = place(base, offload, stage=stage, n_devices=n_devices)
  if options.offload_params == "auto":
    if device_memory is None:
      raise ValueError("offload_params='auto' needs the device memory: pass device_memory= "
                       "(bytes); this device reports no limit")
    layouts, resident = layers_resident(plan_of, layouts, device_memory, activations)
  else:
    resident = options.resident_layers or 0
    if options.offload_params:
      layouts = jax.tree.map(lambda l: dataclasses.replace(l, weights_on_host=l.per_layer),
                             layouts, is_leaf=is_layout)
  plan = _without_overlap_if_needed(plan_of(layouts, resident), device_memory, activations)
  if checked:
    check_fits(plan, activations=activations, device_memory=device_memory,
               host_memory=host_memory)
  return plan
