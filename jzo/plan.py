"""What lives where: one engine's plan, computed once from shapes.

A `Plan` holds the engine's options and, per parameter leaf, its layout over
the data axis and the placement of its optimizer state (`LeafLayout.
device_size`: each device shard's float32 master weights and moments are
split at an element c, [0, c) in device memory, [c, k) in host memory). The
step, the host side, checkpoints and the memory report all read it; nothing
else decides placement.

`make_plan` places the state: `offload=False` keeps it on the devices,
`True` puts all of it on the host, a fraction f in [0, 1] puts about f of
every leaf on the host, and "auto" keeps as many whole leaves on the devices
as fit in their memory (a device update costs milliseconds where the host
kernel needs about 28 bytes of host memory traffic per parameter, so the
host then has the least work possible) and offloads the rest.

Memory is counted in bytes. Per device: low-precision params, the gradient
buffer the step keeps, float32 masters and moments of the device part, and
at the step's peak also the backward pass's gradients, an fp32 accumulator
(grad_accum > 1), activations (given: the model knows them) and, with the
delayed update, the host part's new weights on their way up. Host (all
devices' shards): masters and moments of the host part, the staging buffer
of the new low-precision weights, and the pinned buffers the gradients land
in (two with the delayed update: step t + 1 writes one while the host reads
step t's).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import numpy as np

from jzo import partition
from jzo.partition import LeafLayout, is_layout
from jzo.precision import LossScale

# Host kernel speed assumed for the printed balance: AdamW on the 16-core
# host of the GPU machines, parameters per second (experiments/RESULTS.md).
HOST_UPDATE_PARAMS_PER_S = 4.5e9
# Share of the device memory the planner leaves free for what it does not
# model (XLA's fragmentation, cuDNN and cuBLAS workspaces).
DEVICE_HEADROOM = 0.06
# Host part of a large split leaf: a multiple of this many elements (a cache
# line of float32), so that the split falls on a cache-line boundary.
_ALIGN = 16
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Plan:
  """One engine's options and the placement of every leaf's state."""
  layouts: Any  # tree of LeafLayout, one per parameter leaf, placement included
  stage: int  # ZeRO stage 0-3
  n_devices: int  # S: size of the data axis
  axis: str  # name of the data axis
  compute_dtype: np.dtype  # params of the forward/backward: bf16, fp16 or fp32
  grad_dtype: np.dtype  # the gradient buffer the step keeps or ships to the host
  loss_scale: LossScale | None  # dynamic loss scaling (fp16) or none
  grad_accum: int  # micro-batches per step
  max_grad_norm: float | None  # global-norm clip
  layers: str | None  # stage 3: dotted path of the stacked layers gathered one at a time
  offload: bool  # the optimizer is jzo's Adam: its state may live on the host
  delayed_update: bool  # the host part's update lands one step late
  dpu_warmup: int  # plain steps before delayed updates start
  moment_bytes: int  # optimizer state bytes per parameter besides the master weights

  # ------------------------------------------------------------ structure
  @property
  def leaves(self) -> list[LeafLayout]:
    return jax.tree.leaves(self.layouts, is_leaf=is_layout)

  @property
  def sharded_lowp(self) -> bool:
    """Devices keep low-precision param shards, gathered in the step (stage 3)."""
    return self.stage == 3

  @property
  def host_elements(self) -> int:
    """Parameters (padding included, all shards) whose state is on the host."""
    return sum(l.shards * _rows(l) * l.on_host for l in self.leaves) if self.offload else 0

  @property
  def device_elements(self) -> int:
    """Parameters (padding included) of one device's shard whose state is on the device."""
    return sum(_rows(l) * l.on_device for l in self.leaves)

  @property
  def has_host_state(self) -> bool:
    return self.host_elements > 0

  @property
  def has_device_state(self) -> bool:
    return not self.offload or self.device_elements > 0

  @property
  def n_params(self) -> int:
    return sum(math.prod(l.shape) for l in self.leaves)

  @property
  def offloaded_fraction(self) -> float:
    """Share of the (padded) parameters whose optimizer state is on the host."""
    total = sum(l.shards * _rows(l) * l.shard_size for l in self.leaves)
    return self.host_elements / total

  # --------------------------------------------------------------- memory
  def device_bytes(self) -> dict[str, int]:
    """Bytes one device holds between steps: params, gradient buffer, masters, moments."""
    lowp = np.dtype(self.compute_dtype).itemsize
    full = self.n_params
    local = sum(_rows(l) * l.shard_size for l in self.leaves)  # one shard, padded
    params = lowp * (local if self.sharded_lowp else full)
    if self.offload:
      grads = 0  # the host part lands in pinned host memory, the device part is used at once
    elif self.stage == 0 or self.stage == 1:
      grads = self.grad_dtype.itemsize * full  # full gradients (stage 1: unreduced)
    else:
      grads = self.grad_dtype.itemsize * local
    if self.offload:
      master = 4 * self.device_elements
      moments = self.moment_bytes * self.device_elements
    else:  # every leaf whole on the device (stage 0: one shard, the whole leaf)
      master = 4 * local
      moments = self.moment_bytes * local
    return {"params": params, "grads": grads, "master": master, "moments": moments}

  def device_peak(self, activations: int = 0) -> dict[str, int]:
    """Bytes one device needs at the step's peak: `device_bytes()`, the
    backward pass's gradients (with the fp32 accumulator) and the
    activations (XLA's temporaries of the compiled step on an H100 were
    their sum within 5%: gpt2-10b 24.15 GiB, gpt2-4b 11.41), and, with the
    delayed update, the host part's weights on their way up."""
    lowp = np.dtype(self.compute_dtype).itemsize
    local = sum(_rows(l) * l.shard_size for l in self.leaves)
    # Stages 0-2 differentiate full params; stage 3's per-layer gathers
    # reduce-scatter each layer's gradients inside the scan.
    grads = lowp * (local if self.stage == 3 and self.layers else self.n_params)
    # A split leaf's two parts are slices of its gradient: XLA copies both
    # (measured on an H100: gpt2-10b at fraction 0.7 needed 97 GiB).
    grads += self.grad_dtype.itemsize * sum(
        _rows(l) * l.shard_size for l in self.leaves if 0 < l.on_device < l.shard_size)
    if self.grad_accum > 1:
      grads += 4 * (self.n_params if self.stage < 2 else local)
    upload = 0
    if self.delayed_update and self.has_host_state:
      host_local = sum(_rows(l) * l.on_host for l in self.leaves)
      upload = lowp * host_local * (1 if self.sharded_lowp else self.n_devices)
    return {**self.device_bytes(), "backward grads": grads, "activations": activations,
            "upload": upload}

  def host_bytes(self) -> dict[str, int]:
    """Bytes of host RAM the offloaded state takes (all devices' shards)."""
    n = self.host_elements
    staging = n * np.dtype(self.compute_dtype).itemsize
    if np.dtype(self.compute_dtype) == np.float32:
      staging = 0  # the masters themselves go up
    landing = n * self.grad_dtype.itemsize * (2 if self.delayed_update else 1)
    return {"master": 4 * n, "moments": self.moment_bytes * n, "staging": staging,
            "gradients": landing}

  def build_bytes(self) -> int:
    """Host bytes beside the state while the engine builds it: one leaf
    drawn in float32 and the random bits XLA draws it from (a run of
    gpt2-10b was killed for host memory with 115.6 GiB of state planned on
    a 125 GiB host, where its largest leaf is 3.4B parameters)."""
    return 8 * max(math.prod(l.shape) for l in self.leaves)

  def __str__(self) -> str:
    return format_plan(self)


def _rows(layout: LeafLayout) -> int:
  """Rows of a shard: L for per-layer shards, else 1."""
  return layout.shape[0] if layout.per_layer else 1


def format_plan(plan: Plan, activations: int | None = None,
                device_memory: int | None = None, host_memory: int | None = None) -> str:
  """A table of what lives where, in GiB, for a person to read at a glance."""
  gib = lambda b: f"{b / GiB:8.2f}"
  rows = [f"ZeRO stage {plan.stage} on {plan.n_devices} device(s), {plan.n_params / 1e9:.3f}B "
          f"params, {np.dtype(plan.compute_dtype).name} compute, optimizer state "
          f"{100 * (1 - plan.offloaded_fraction):.1f}% on the device, "
          f"{100 * plan.offloaded_fraction:.1f}% on the host"
          + (", delayed update" if plan.delayed_update else "")]
  peak = plan.device_peak(activations or 0)
  rows.append(f"  {'per device':<22}{'GiB':>8}")
  for name, b in peak.items():
    if b or name in ("params", "activations"):
      rows.append(f"  {name:<22}{gib(b)}")
  rows.append(f"  {'total (peak)':<22}{gib(sum(peak.values()))}"
              + (f"  of {device_memory / GiB:.2f} available" if device_memory else ""))
  if plan.offload:
    host = plan.host_bytes()
    rows.append(f"  {'host':<22}{'GiB':>8}")
    for name, b in host.items():
      rows.append(f"  {name:<22}{gib(b)}")
    rows.append(f"  {'building (at start)':<22}{gib(plan.build_bytes())}")
    rows.append(f"  {'total':<22}{gib(sum(host.values()) + plan.build_bytes())}"
                + (f"  of {host_memory / GiB:.2f} available" if host_memory else ""))
    seconds = plan.host_elements / HOST_UPDATE_PARAMS_PER_S
    rows.append(f"  host update about {seconds:.2f} s a step at "
                f"{HOST_UPDATE_PARAMS_PER_S / 1e9:.1f} Gparam/s")
  return "\n".join(rows)


# ------------------------------------------------------------------ memory
def available_host_memory() -> int:
  """Bytes this process may still allocate: MemAvailable, capped by a cgroup limit."""
  available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          available = int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    with open("/sys/fs/cgroup/memory.max") as f:
      limit = f.read().strip()
    with open("/sys/fs/cgroup/memory.current") as f:
      used = int(f.read())
    if limit != "max":
      available = min(available, int(limit) - used)
  except (OSError, ValueError):
    pass
  return available


def device_memory_limit(device) -> int | None:
  """Bytes the allocator of `device` may hand out (None where it reports none, as on CPU)."""
  return (device.memory_stats() or {}).get("bytes_limit")


class PlacementError(MemoryError):
  """A configuration does not fit the memory there is; the message has the numbers."""


# -------------------------------------------------------------- placement
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
      host = _ALIGN * round(f * k / _ALIGN)
    whole_only = stage in (1, 2) and n_devices > 1 and l.padded
    if whole_only and 0 < host < k:
      host = k if f >= 0.5 else 0
    return l.place(k - host)
  return jax.tree.map(one, layouts, is_leaf=is_layout)


def auto_layouts(plan_of, base, device_memory: int, activations: int):
  """Layouts that keep as many whole leaves' state on the device as fit in
  `device_memory` (less the headroom), largest leaves first, the rest on the
  host; `plan_of(layouts)` builds the plan. Whole leaves: a split leaf costs
  a copy of its gradient (see Plan.device_peak)."""
  budget = device_memory * (1 - DEVICE_HEADROOM)
  fits = lambda layouts: sum(plan_of(layouts).device_peak(activations).values()) <= budget
  leaves, treedef = jax.tree.flatten(base, is_leaf=is_layout)
  on_device = [l.place(None) for l in leaves]
  if fits(jax.tree.unflatten(treedef, on_device)):
    return jax.tree.unflatten(treedef, on_device)
  placed = [l.place(0) for l in leaves]
  for i in sorted(range(len(leaves)), key=lambda i: -leaves[i].shard_size * _rows(leaves[i])):
    trial = placed[:i] + [leaves[i].place(None)] + placed[i + 1:]
    if fits(jax.tree.unflatten(treedef, trial)):
      placed = trial
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
             if plan.offload and plan.offloaded_fraction < 1 else ""))
  if plan.offload and host_memory is not None:
    need, parts = _total_and_parts({**plan.host_bytes(), "building": plan.build_bytes()})
    if need > host_memory:
      raise PlacementError(
          f"offloaded optimizer state needs {need / GiB:.2f} GiB of host RAM "
          f"({plan.host_elements:,} parameters incl. padding: {parts} GiB), "
          f"{host_memory / GiB:.2f} GiB available")


def make_plan(shapes, tx_state_bytes: int, *, stage: int, n_devices: int, axis: str,
              compute_dtype, grad_dtype, loss_scale, grad_accum: int, max_grad_norm,
              layers: str | None, offload, delayed_update: bool, dpu_warmup: int,
              device_memory: int | None = None,
              host_memory: int | None = None, activations: int = 0) -> Plan:
  """The plan of an engine over params of `shapes` (a tree of arrays or
  ShapeDtypeStructs). `offload`: False, True, a fraction in [0, 1] or "auto"
  (needs `device_memory`). Checks that the plan fits the memory given
  (None: not checked) before anything is allocated.

  Raises:
    ValueError: a bad offload value.
    PlacementError: the plan does not fit.
  """
  auto = isinstance(offload, str)
  if auto and offload != "auto":
    raise ValueError(f"offload must be True, False, a fraction in [0, 1] or 'auto', "
                     f"got {offload!r}")
  if not auto and not isinstance(offload, bool):
    if not isinstance(offload, (int, float)) or not 0.0 <= float(offload) <= 1.0:
      raise ValueError(f"offload fraction must be in [0, 1], got {offload!r}")
  if auto and device_memory is None:
    raise ValueError("offload='auto' needs the device memory: pass device_memory= (bytes); "
                     "this device reports no limit")
  shards = 1 if stage == 0 else n_devices
  base = partition.make_layouts(shapes, shards, layers)
  if layers is not None:
    partition.subtree(base, layers)  # names a subtree of the params, or raises

  def plan_of(layouts) -> Plan:
    return Plan(
        layouts=layouts, stage=stage,
        n_devices=n_devices, axis=axis, compute_dtype=np.dtype(compute_dtype),
        grad_dtype=np.dtype(grad_dtype), loss_scale=loss_scale, grad_accum=grad_accum,
        max_grad_norm=max_grad_norm, layers=layers, offload=offload is not False,
        delayed_update=delayed_update, dpu_warmup=dpu_warmup,
        moment_bytes=tx_state_bytes)
  if auto:
    plan = plan_of(auto_layouts(plan_of, base, device_memory, activations))
  else:
    plan = plan_of(place(base, offload, stage=stage, n_devices=n_devices))
  check_fits(plan, activations=activations, device_memory=device_memory,
             host_memory=host_memory)
  return plan
