"""What lives where: one engine's plan, computed once from shapes.

A `Plan` holds the engine's options and, per parameter leaf, its layout over
the data axis and the placement of its optimizer state (`LeafLayout.
device_size`: each device shard's float32 master weights and moments are
split at an element c, [0, c) in device memory, [c, k) in host memory). The
step, the host side, checkpoints and the memory report all read it; nothing
else decides placement.

Memory is counted in bytes. Per device: low-precision params, the gradient
buffer the step keeps, float32 masters and moments of the device part, and
the larger of two moments: the step's peak (the backward pass's gradients,
an fp32 accumulator when grad_accum > 1, activations given by the model)
and, with offload, the exchange after the step (the gradients of the leaves
with a host part wait on the device until they are down while leaves' new
weights come up). Host (all devices' shards): masters and moments of the
host part and one landing buffer per leaf, which carries the gradients down
and the new weights up, in XLA's pinned pools (one per device); the runtime
(more for each more GPU of the process). Building draws
the leaves in float32 on the first device, largest first, a group at a time,
a large stacked leaf a slice of its layers at a time where the source allows
(`jzo.plan.draws`).

Host accumulation (grad_accum > 1, `Plan.host_accumulation`) moves the
float32 sum of the host parts to the host. Bytes per parameter whose state
is on the host: master 4 + moments 8 (4 in bf16) + accumulator 4 + landing
2 (one micro-batch's gradients in the compute dtype; a ring of the two
largest leaves when the host lacks room; the new weights are made again
from the masters a leaf at a time, so none wait in landing buffers). Per
device: params 2 a parameter, one micro-batch's gradients 2 a parameter,
and per device-part parameter master 4 + moments 8 (4) + accumulator 4.
(docs/planner.md reads a plan's table.)

grads_in_params (stage 3) writes the stacked layers' gradients over their
weights (jzo.parallel.layer_scan): the step's peak holds one layer's gradient of
them, and the exchange none beside the weights; the device parts' new
weights go over their gradients in the step. With
grad_accum > 1 it runs the layers first (`Plan.layers_first`): every micro-
batch's forward through the layers, a layer at a time, then each layer's
backward over every micro-batch, its float32 sum written over its weights:
float32 sums of the other leaves and of one layer, and every micro-batch's
layer inputs (in the activations). Otherwise (accumulation "device") it
sums the micro-batches on the device: float32 sums of every leaf (4 B a
parameter) beside the weights, the last micro-batch's gradients written
over them.
offload_params keeps those weights in pinned host memory as well (2 B a
parameter of the layers, in XLA's pinned pool, where the gradients land
and the kernel writes the new weights: no landing buffers for them); the
device holds one layer's weights and gradient at a time. With
offload_params="auto" they are offloaded only where they do not fit on the
device, and the first layers that still fit keep a copy of their weights
in device memory as well (`layers_resident`; 2 B a parameter of them): the
step fetches only the other layers' weights, and the resident layers' new
weights come up once after the host update.

The placement search is jzo.plan.placement (`make_plan`); what the machine
offers, jzo.plan.machine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jzo.parallel import partition
from jzo.parallel.partition import LeafLayout, is_layout
from jzo.plan.draws import draw_pieces
from jzo.plan.machine import HOST_RUNTIME_BYTES, pinned_pool_bytes
from jzo.precision import LossScale

# Host kernel speed assumed for the printed balance: AdamW on the 16-core
# host of the GPU machines, parameters per second (docs/results.md).
HOST_UPDATE_PARAMS_PER_S = 4.5e9
# Layers' weights (compute dtype, one device's shard) that a step overlapping
# the host update holds beyond one that does not (Plan.overlaps_update), as
# its forward copies each layer's fetched host part in: measured, not
# derived, on one H100 at micro-batch 32 (XLA's temporaries of the compiled
# step: gpt2-10b 1.40 GiB more, 3.7 layers; gpt2-13b 1.90 GiB, 3.2 layers).
# The layers first hold none (gpt2-10b at 4 x 8: 16.58 GiB of temporaries
# overlapping, 16.56 with the update first).
OVERLAP_FETCH_LAYERS = 4

# A streamed host update (jzo.host.update) holds this many spans under its landing
# limit: one going down, one in the kernel, one going up, one more.
STREAM_SPANS = 4
# The landing limit of an update that is not delayed, where one step's host
# parts are more: spans of 512 MiB.
STREAM_LANDING_BYTES = 2 * 2**30
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
  cpu_adam: bool  # the optimizer is jzo.cpu_adam(w), whose state may live on the host
  delayed_update: bool  # the host part's update lands one step late
  dpu_warmup: int  # plain steps before delayed updates start
  moment_bytes: int  # optimizer state bytes per parameter besides the master weights
  processes: int = 1  # processes the data axis spans, each with n_devices / processes of it
  # grad_accum > 1 with a host part: each micro-batch's host parts go down and
  # are summed in float32 on the host (else the step sums everything on the device)
  host_accumulation: bool = False
  # Bytes of landing buffers one process holds at once (0: one set, every
  # host part's gradient). Under host accumulation they carry micro-batches
  # to the sums; otherwise a limit streams the update in spans (jzo.host.update).
  landing_limit: int = 0
  # Stage 3 with layers: each layer's gradient is written over its weights
  # in the backward pass (jzo.scan_layers); the host update writes them back.
  grads_in_params: bool = False
  # Host RAM a checkpoint's save takes beside the state while it writes (0:
  # none counted; jzo.checkpoint.SAVE_HOST_BYTES where the run saves them,
  # or `save_bytes` of a state too small to fill it).
  checkpoint_bytes: int = 0
  # Host RAM of one process's runtime (CUDA, XLA, Python: host_runtime_bytes).
  runtime_bytes: int = HOST_RUNTIME_BYTES
  # The devices have XLA's pinned host pools (GPUs), where the landing
  # buffers live; CPU devices' are plain host arrays.
  pinned_pools: bool = True
  # offload_params: the first this many layers of the stack also keep their
  # weights in device memory (EngineState.resident, (r, S*k) a leaf), so the
  # step fetches only the others; those layers' new weights then come up once.
  resident_layers: int = 0
  # Elements the build's draws may hold at once where the largest leaf has
  # fewer (`draws.draw_groups`): DRAW_GROUP_FLOOR where the devices report no
  # memory limit, none where the plan budgets the device's memory.
  draw_floor: int = 0
  # The params' source can give a stacked leaf's layers apart (arrays, files;
  # not an initializer, which computes a leaf whole): the build draws a
  # stacked leaf larger than any other draw a slice of its layers at a time.
  sliced_draws: bool = False
  # Asked for: a step's forward may run beside the last step's host update
  # (`overlaps_update`).
  overlap_forward: bool = True
  # grads_in_params with grad_accum > 1: the layers run over every micro-
  # batch at once, a layer at a time, keeping every micro-batch's layer
  # inputs (counted in the activations) and no float32 sums of the layers
  # (jzo.step.layers_first); else the layers' backward adds into such sums.
  layers_first: bool = False
  # The step programs are compiled for run-to-run bitwise results on GPUs
  # (EngineOptions.deterministic; jzo.step.compiler_options).
  deterministic: bool = False

  def __post_init__(self):
    if self.layers_first and not (self.grads_in_params and self.grad_accum > 1):
      raise ValueError("layers_first needs grads_in_params and grad_accum > 1")
    if self.resident_layers:
      stacked = [l for l in self.leaves if l.per_layer]
      if not all(map(self.params_on_host, stacked)):
        raise ValueError("resident_layers needs every leaf of the stacked layers' weights in "
                         "host memory (offload_params)")
      if not 0 <= self.resident_layers <= stacked[0].shape[0]:
        raise ValueError(f"resident_layers must be in [0, {stacked[0].shape[0]}] (the "
                         f"layers), got {self.resident_layers}")

  # ------------------------------------------------------------ structure
  @property
  def leaves(self) -> list[LeafLayout]:
    return jax.tree.leaves(self.layouts, is_leaf=is_layout)

  def grads_over_weights(self, layout: LeafLayout) -> bool:
    """The leaf's gradient takes its weights' memory (grads_in_params: the
    stacked layers' leaves)."""
    return self.grads_in_params and layout.per_layer

  def params_on_host(self, layout: LeafLayout) -> bool:
    """The leaf's low-precision weights (and so, with grads_in_params, its
    gradients) live in pinned host memory, fetched a layer at a time
    (offload_params: some or all of the stacked layers' leaves)."""
    return layout.weights_on_host

  @property
  def overlaps_update(self) -> bool:
    """Each step's forward runs beside the last step's host update, taking
    each layer's new weights as the host finishes them (jzo.step.plain.make_step's
    `wait`): asked for (`overlap_forward`), with grads_in_params, one
    micro-batch or the layers first, the stacked layers' weights in device
    memory and one set of landing buffers (not streamed), where some of them
    have a host part. On one device or several, in one process or a process
    a device: each layer is read at the index its wait returns
    (jzo.parallel.layer_scan)."""
    return (self.overlap_forward and self.grads_in_params
            and (self.grad_accum == 1 or self.layers_first)
            and not self.offload_params and not self.streamed
            and bool(self.overlapped_leaves()))

  def layer_leaves(self) -> list[int]:
    """Indices (jax.tree.leaves order) of the leaves of the `layers`
    subtree, in its own order."""
    index = jax.tree.unflatten(jax.tree.structure(self.layouts, is_leaf=is_layout),
                               range(len(self.leaves)))
    return jax.tree.leaves(partition.subtree(index, self.layers))

  def overlapped_leaves(self) -> list[int]:
    """Indices (jax.tree.leaves order) of the leaves whose host parts' new
    weights a step overlapping the host update fetches itself: the stacked
    layers' leaves with a host part, in device memory."""
    return [i for i, l in enumerate(self.leaves)
            if self.grads_over_weights(l) and l.on_host and not self.params_on_host(l)]

  @property
  def offload_params(self) -> bool:
    """Some leaf's weights live in pinned host memory."""
    return any(map(self.params_on_host, self.leaves))

  def host_params_bytes(self) -> int:
    """Bytes of pinned host memory the offloaded weights take in one process."""
    lowp = np.dtype(self.compute_dtype).itemsize
    return lowp * sum(l.shards * shard_rows(l) * l.shard_size for l in self.leaves
                      if self.params_on_host(l)) // self.processes

  def pinned_bytes(self) -> int:
    """Bytes of XLA's pinned pools the engine holds at once in one process:
    the landing buffers and the offloaded weights."""
    return self.host_bytes()["landing"] + self.host_params_bytes()

  def pool_overhead(self) -> int:
    """Bytes the process's pinned pools hold beyond `pinned_bytes()`: their
    regions' rounding, their headroom and their allocators' tables
    (`pinned_pool_bytes`)."""
    if not self.pinned_pools:
      return 0
    return pinned_pool_bytes(self.pinned_bytes(), self.local_devices) - self.pinned_bytes()

  @property
  def local_devices(self) -> int:
    """Devices of one process."""
    return self.n_devices // self.processes

  @property
  def sharded_lowp(self) -> bool:
    """Devices keep low-precision param shards, gathered in the step (stage 3)."""
    return self.stage == 3

  @property
  def host_elements(self) -> int:
    """Parameters (padding included, all shards) whose state is on the host."""
    return sum(l.shards * shard_rows(l) * l.on_host for l in self.leaves) if self.cpu_adam else 0

  @property
  def device_elements(self) -> int:
    """Parameters (padding included) of one device's shard whose state is on the device."""
    return sum(shard_rows(l) * l.on_device for l in self.leaves)

  @property
  def has_host_state(self) -> bool:
    return self.host_elements > 0

  @property
  def has_device_state(self) -> bool:
    return not self.cpu_adam or self.device_elements > 0

  @property
  def n_params(self) -> int:
    return sum(math.prod(l.shape) for l in self.leaves)

  @property
  def offloaded_fraction(self) -> float:
    """Share of the (padded) parameters whose optimizer state is on the host."""
    total = sum(l.shards * shard_rows(l) * l.shard_size for l in self.leaves)
    return self.host_elements / total

  # --------------------------------------------------------------- memory
  def device_bytes(self) -> dict[str, int]:
    """Bytes one device holds between steps: params, gradient buffer, masters, moments."""
    lowp = np.dtype(self.compute_dtype).itemsize
    full = self.n_params
    local = sum(shard_rows(l) * l.shard_size for l in self.leaves)  # one shard, padded
    on_host = sum((shard_rows(l) - self.resident_layers) * l.shard_size
                  for l in self.leaves if self.params_on_host(l))
    params = lowp * ((local - on_host) if self.sharded_lowp else full)
    if self.cpu_adam:
      grads = 0  # the host part lands in pinned host memory, the device part is used at once
    elif self.stage == 0 or self.stage == 1:
      grads = self.grad_dtype.itemsize * full  # full gradients (stage 1: unreduced)
    else:
      grads = self.grad_dtype.itemsize * local
    if self.cpu_adam:
      master = 4 * self.device_elements
      moments = self.moment_bytes * self.device_elements
    else:  # every leaf whole on the device (stage 0: one shard, the whole leaf)
      master = 4 * local
      moments = self.moment_bytes * local
    return {"params": params, "grads": grads, "master": master, "moments": moments}

  def device_peak(self, activations: int = 0) -> dict[str, int]:
    """Bytes one device needs at its peak: `device_bytes()` and the larger
    of the step's peak (the backward pass's gradients with the fp32
    accumulator, and the activations, which XLA's temporaries of the
    compiled step match) and the exchange after it (see the module docstring)."""
    lowp = np.dtype(self.compute_dtype).itemsize
    local = sum(shard_rows(l) * l.shard_size for l in self.leaves)
    # Stages 0-2 differentiate full params; stage 3's per-layer gathers
    # reduce-scatter each layer's gradients inside the scan.
    grads = lowp * (local if self.stage == 3 and self.layers else self.n_params)
    # The layers' gradients in their weights' memory, but the one being
    # written; with the weights on the host, that layer's fetched weights too.
    grads -= lowp * sum((shard_rows(l) - 1 - self.params_on_host(l)) * l.shard_size
                        for l in self.leaves if self.grads_over_weights(l))
    step = {"backward grads": grads, "activations": activations}
    if self.overlaps_update and not self.layers_first:  # the layers' new weights it fetches
      step["fetched layers"] = OVERLAP_FETCH_LAYERS * lowp * sum(
          l.shard_size for l in self.leaves if self.grads_over_weights(l))
    if self.host_accumulation:  # the device parts' float32 sums beside one micro-batch's
      step["float32 sums"] = 4 * self.device_elements
    elif self.layers_first:  # of the other leaves, and of the layer in its backward
      stacked = [l for l in self.leaves if self.grads_over_weights(l)]
      step["float32 sums"] = 4 * (local - sum(shard_rows(l) * l.shard_size for l in stacked)
                                  + sum(l.shard_size for l in stacked))
    elif self.grad_accum > 1:
      step["float32 sums"] = 4 * (self.n_params if self.stage < 2 else local)
    if not self.has_host_state:
      return {**self.device_bytes(), **step}
    itemsize = self.grad_dtype.itemsize
    # Offloaded weights are updated where they are: nothing moves for them.
    host_leaves = [l for l in self.leaves if l.on_host and not self.params_on_host(l)]
    kept = itemsize * sum(shard_rows(l) * l.shard_size for l in host_leaves
                          if not self.grads_over_weights(l))
    # Leaf by leaf, its new weights come up (then go into the params in
    # place) and its next gradient goes down: a whole leaf's gradient goes
    # as it is, the split leaf's host part is first sliced into a copy.
    upload = lambda l: (lowp * shard_rows(l) * l.on_host
                        * (1 if self.sharded_lowp else self.n_devices))
    sliced = lambda l: itemsize * shard_rows(l) * l.on_host if l.on_device else 0
    moving = max(map(upload, host_leaves), default=0) + max(map(sliced, host_leaves), default=0)
    if self.streamed:  # a span of a leaf at a time, sliced out and back
      elements = self.landing_limit // STREAM_SPANS // (self.n_devices // self.processes)
      elements //= itemsize  # of one device's span
      spread = 1 if self.sharded_lowp else self.n_devices  # stages 1-2 gather it
      moving = min(moving, elements * (lowp * spread + itemsize))
    exchange = {"grads to the host": kept, "leaves in transfer": moving}
    bigger = step if sum(step.values()) >= sum(exchange.values()) else exchange
    return {**self.device_bytes(), **bigger}

  def host_bytes(self) -> dict[str, int]:
    """Bytes of host RAM the offloaded state takes in one process (its
    devices' shards: all of them with one process)."""
    n = self.host_elements // self.processes
    # Offloaded weights take their gradients in place of landing buffers.
    landing = n * self.grad_dtype.itemsize - self.host_params_bytes()
    landing = min(landing, self.landing_limit or landing)
    if self.offload_params:
      return {"master": 4 * n, "moments": self.moment_bytes * n,
              "params": self.host_params_bytes(), "landing": landing}
    if not self.host_accumulation:
      return {"master": 4 * n, "moments": self.moment_bytes * n, "landing": landing}
    return {"master": 4 * n, "moments": self.moment_bytes * n, "accumulator": 4 * n,
            "landing": landing}

  @property
  def streamed(self) -> bool:
    """The host update goes through the landing buffers in spans (a landing
    limit without host accumulation; see jzo.host.update)."""
    return self.has_host_state and not self.host_accumulation and self.landing_limit > 0

  def landing_bytes(self, i: int) -> int:
    """Bytes of leaf i's landing buffer in one process: its devices' host
    parts of the leaf, in the gradient dtype (0 for a leaf without one)."""
    l = self.leaves[i]
    return self.grad_dtype.itemsize * l.shards * shard_rows(l) * l.on_host // self.processes

  def landing_ring(self) -> int:
    """Bytes of the smallest landing ring of host accumulation: the two
    largest leaves' host parts of this process's devices (one lands while
    the host sums the other)."""
    return sum(sorted(map(self.landing_bytes, range(len(self.leaves))))[-2:])

  def build_bytes(self) -> int:
    """Bytes on the first device, beside the state (`device_bytes()`),
    while the engine draws a group of leaves (`build_groups`): their
    float32 values and, on several devices, one device's piece of a leaf's
    low-precision weights (offloaded weights are made on the host) or of
    its device part's float32 master, made there and moved before the next
    (jzo.state.fill.placed). On one device each is written straight into its
    buffer. (Before, the whole low-precision copy and every device's piece
    of it were made at once: gpt2-20b's shape at 104 layers over 4 H200s
    peaked at the state 35.54 + the MLP kernel drawn 58.50 + in bf16 29.25
    + a piece 7.31 = 130.60 GiB, as measured.)"""
    n = self.n_devices

    def piece(l: LeafLayout, rows: int) -> int:
      if n == 1:
        return 0
      lowp = 0 if self.params_on_host(l) else 2 * rows * math.prod(l.inner_shape)
      master = 4 * l.shards * rows * l.on_device if self.has_device_state else 0
      return max(lowp // n if self.sharded_lowp else lowp, master // n)

    def rows_of(i: int, span: tuple[int, int] | None) -> int:
      return shard_rows(self.leaves[i]) if span is None else span[1] - span[0]

    return max(sum(4 * rows_of(i, span) * math.prod(self.leaves[i].inner_shape)
                   for i, span in group)
               + max(piece(self.leaves[i], rows_of(i, span)) for i, span in group)
               for group in self.build_groups())

  def build_groups(self) -> list[list[tuple[int, tuple[int, int] | None]]]:
    """What the build draws together, group by group (`draws.draw_pieces`):
    each a list of (leaf index, its layers [lo, hi), or None for the whole
    leaf)."""
    return draw_pieces(self.leaves, self.draw_floor, self.sliced_draws)

  def __str__(self) -> str:
    return format_plan(self)


def _weights_on_host(plan: Plan) -> str:
  """What format_plan says of offload_params: the layers' weights on the
  host, and how many layers' stay on the device as well."""
  if not plan.offload_params:
    return ""
  layers = max(map(shard_rows, plan.leaves))
  return (", layers' weights on the host"
          + (f" ({plan.resident_layers} of {layers} layers resident on the device)"
             if plan.resident_layers else ""))


def shard_rows(layout: LeafLayout) -> int:
  """Rows of a shard: L for per-layer shards, else 1."""
  return layout.shape[0] if layout.per_layer else 1


def count_text(n: int) -> str:
  """A parameter count for a person: 10.279B, 124.44M, 0.14M, 3.2K, 512."""
  if n >= 1e9:
    return f"{n / 1e9:.3f}B"
  if n >= 1e5:
    return f"{n / 1e6:.2f}M"
  return f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


def bytes_text(n: int) -> str:
  """Bytes in the binary unit that fits, 8 columns and the unit: "   19.15 GiB"."""
  for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      break
  return f"{n / size:8.2f} {unit}"


def format_plan(plan: Plan, activations: int | None = None,
                device_memory: int | None = None, host_memory: int | None = None) -> str:
  """A table of what lives where, for a person to read at a glance: a row
  for each part that takes memory, each in the unit that fits it."""
  row = lambda name, b: f"  {name:<22}{bytes_text(b)}"
  of = lambda total, memory: (row(total[0], total[1])
                              + (f"  of {bytes_text(memory).strip()} available" if memory else ""))
  rows = [f"ZeRO stage {plan.stage} on {plan.n_devices} device(s), {count_text(plan.n_params)} "
          f"params, {np.dtype(plan.compute_dtype).name} compute, optimizer state "
          f"{100 * (1 - plan.offloaded_fraction):.1f}% on the device, "
          f"{100 * plan.offloaded_fraction:.1f}% on the host"
          + (", delayed update" if plan.delayed_update else "")
          + _weights_on_host(plan)]
  peak = plan.device_peak(activations or 0)
  rows.append("  per device")
  rows += [row(name, b) for name, b in peak.items() if b]
  rows.append(of(("total (peak)", sum(peak.values())), device_memory))
  if plan.cpu_adam:
    host = plan.host_bytes()
    if plan.streamed:
      host["landing (streamed)"] = host.pop("landing")
    # A GPU's runtime (CUDA and the allocator's table) or a CPU process's.
    runtime = "runtime (CUDA, XLA)" if plan.pinned_pools else "runtime (Python, XLA)"
    host.update({"pinned pool overhead": plan.pool_overhead(), runtime: plan.runtime_bytes,
                 "checkpoint writes": plan.checkpoint_bytes})
    rows.append("  host" if plan.processes == 1 else f"  host, each of {plan.processes} processes")
    rows += [row(name, b) for name, b in host.items() if b]
    rows.append(of(("total", sum(host.values())), host_memory))
    seconds = plan.host_elements / plan.processes / HOST_UPDATE_PARAMS_PER_S
    took = f"{seconds:.2f} s" if seconds >= 0.01 else f"{1e3 * seconds:.2f} ms"
    rows.append(f"  host update about {took} a step at {HOST_UPDATE_PARAMS_PER_S / 1e9:.1f} "
                "Gparam/s")
  return "\n".join(rows)
