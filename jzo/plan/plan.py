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
as fit in their memory, then part of one more (a device update costs milliseconds where the host
kernel needs about 28 bytes of host memory traffic per parameter, so the
host then has the least work possible) and offloads the rest.

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
the leaves in float32 on the first device, largest first, a group at a time
(`draw_groups`).

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
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import numpy as np
import psutil

from jzo.parallel import partition
from jzo.options import EngineOptions
from jzo.parallel.partition import LeafLayout, is_layout
from jzo.precision import LossScale
from jzo.host.transfer import BUILD_CHUNK_BYTES

# Host kernel speed assumed for the printed balance: AdamW on the 16-core
# host of the GPU machines, parameters per second (docs/results.md).
HOST_UPDATE_PARAMS_PER_S = 4.5e9
# Share of the device memory the planner leaves free for what it does not
# model (XLA's fragmentation, cuDNN and cuBLAS workspaces).
DEVICE_HEADROOM = 0.06
# Host RAM of a process besides its state, its pinned pools and its GPUs'
# allocator tables (below): Python, jax, XLA's compiler, CUDA (measured with
# the resident set after start-up on H200s: 1.5 GiB on one GPU and 1.9 on
# two of a 32-core host, 1.9 on one and 2.6 on four of a 64-core host).
HOST_RUNTIME_BYTES = 2 * 2**30
# ... and for each more GPU the process drives.
HOST_RUNTIME_BYTES_PER_DEVICE = 2**28
# XLA's allocators (tsl's BFC) keep, in host RAM, an 8-byte handle for each
# 256 bytes they manage. A GPU's memory: made when the device first runs
# something, 4.19 GiB for 95% of an H200 (measured: one anonymous mapping of
# 4,288 MiB a GPU), 2.36 for an H100. A pinned host pool: made with each of
# its regions (measured: 0.74 GiB beside 24 GiB of pools).
BYTES_PER_TABLE_BYTE = 32


# XLA's pinned host pools on GPUs, one per device: the cap in GiB of each is
# read from this variable when JAX starts its GPU backend (XLA's default: 64).
PINNED_POOL_LIMIT_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
_XLA_PINNED_POOL_LIMIT_GIB = 64
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
# Pinned memory of a process besides the landing buffers: staging of the
# batches and checkpoint reads; each device's pool keeps its share of it, but
# at least MIN_POOL_HEADROOM (a chunk of the build, and room for the pool's
# fragments).
PINNED_POOL_HEADROOM = 2 * 2**30
MIN_POOL_HEADROOM = 2**30


def pinned_pool_limit() -> int:
  """Bytes each device's pinned host pool may hold (see PINNED_POOL_LIMIT_VAR)."""
  value = os.environ.get(PINNED_POOL_LIMIT_VAR, "")
  try:
    return int(value) * 2**30 if value else _XLA_PINNED_POOL_LIMIT_GIB * 2**30
  except ValueError:
    raise ValueError(f"{PINNED_POOL_LIMIT_VAR} must be a whole number of GiB, "
                     f"got {value!r}") from None


def pool_share(nbytes: int, devices: int) -> int:
  """Bytes of each device's pinned pool for `nbytes` of landing buffers
  spread evenly over `devices` (rounded up)."""
  return -(-nbytes // devices)


def pool_headroom(devices: int) -> int:
  """Bytes of each of `devices` pinned pools beyond its share of the landing
  buffers (PINNED_POOL_HEADROOM)."""
  return max(PINNED_POOL_HEADROOM // devices, MIN_POOL_HEADROOM)


def pinned_pool_bytes(landing: int, devices: int = 1) -> int:
  """Host bytes XLA's pinned pools take for `landing` bytes of landing
  buffers of a process spread evenly over its `devices`, each device's
  share reserved in one piece in its own pool (`ShardTransfer.reserve`).
  Pinned pages are resident, and a pool never shrinks: its first region is
  the share rounded up to a power of two, up to what its cap leaves
  (gpt2-13b's 21.6 GiB of landing buffers took a 32 GiB region under the
  default 64 GiB cap), and what else is pinned beside the landing buffers
  grows it by its headroom (measured: 4.1 GiB for a streamed update's 2 GiB
  of spans, on one GPU and on two). Each pool's allocator keeps a table of
  1/32 of it (BYTES_PER_TABLE_BYTE)."""
  if not landing:
    return 0
  share = pool_share(landing, devices)
  region = max(1 << (share - 1).bit_length(), share + pool_headroom(devices))
  pool = min(region, pinned_pool_limit())
  return devices * (pool + pool // BYTES_PER_TABLE_BYTE)


def limit_pinned_pool(landing: int, devices: int = 1) -> int:
  """Caps each device's pinned pool at its share of `landing` bytes (the
  most landing buffers a process can hold, e.g. every parameter's gradient
  in the compute dtype, spread over at least `devices` devices) plus its
  headroom, so that the pool does not round its share up to a power of two
  (it would be resident: 32 GiB for 21.6 GiB at gpt2-13b). Takes effect
  only before JAX starts its GPU backend, and leaves a cap the user set
  alone. `devices` must not be more than the devices the run spreads the
  landing buffers over (a cap too small fails allocations). Returns the cap
  in bytes."""
  if PINNED_POOL_LIMIT_VAR not in os.environ:
    share = pool_share(landing, devices) + pool_headroom(devices)
    os.environ[PINNED_POOL_LIMIT_VAR] = str(math.ceil(share / 2**30))
  return pinned_pool_limit()


def visible_gpus() -> int:
  """GPUs this process can see, counted without starting JAX's GPU backend
  (where the pinned pools' cap must be set): CUDA_VISIBLE_DEVICES's up to
  its first invalid entry (where CUDA stops), else the NVIDIA driver's; at
  least 1."""
  listed = os.environ.get("CUDA_VISIBLE_DEVICES")
  if listed is None:
    try:
      return max(1, len(os.listdir("/proc/driver/nvidia/gpus")))
    except OSError:
      return 1
  count = 0
  for entry in listed.split(","):
    if not entry.strip() or entry.strip().startswith("-"):
      break
    count += 1
  return max(1, count)


def host_runtime_bytes(devices: int, platform: str = "gpu", device_memory: int = 0) -> int:
  """Host RAM of a process that drives `devices` devices of `platform`, each
  with an allocator of `device_memory` bytes, besides its state and pinned
  pools (CUDA, XLA, Python): more for each more accelerator, and a GPU's
  allocator's table; CPU devices add none."""
  if platform == "cpu":
    return HOST_RUNTIME_BYTES
  table = device_memory // BYTES_PER_TABLE_BYTE if platform == "gpu" else 0
  return HOST_RUNTIME_BYTES + HOST_RUNTIME_BYTES_PER_DEVICE * (devices - 1) + devices * table


# Host part of a large split leaf: a multiple of this many elements (a cache
# line of float32), so that the split falls on a cache-line boundary.
_ALIGN = 16
GiB = 2**30

# Where the devices report no memory limit (a CPU's are host RAM), draws may
# hold this many float32 elements (64 MiB) beside the state even where the
# largest leaf is smaller: a small model's leaves are then drawn by one
# program, not by one for each leaf's size (`Plan.draw_floor`).
DRAW_GROUP_FLOOR = 1 << 24


def draw_groups(sizes: list[int], floor: int) -> list[list[int]]:
  """The leaves' indices, largest first, in runs whose sizes (elements) add
  up to at most the largest leaf's or `floor`, whichever is more: what one
  draw computes at once, so that a model's leaves are drawn by a few
  programs, not one each."""
  groups, room, limit = [], 0, max(max(sizes), floor)
  for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
    if not groups or sizes[i] > room:
      groups.append([])
      room = limit
    groups[-1].append(i)
    room -= sizes[i]
  return groups


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
  # none counted; jzo.checkpoint.SAVE_HOST_BYTES where the run saves them).
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
  # fewer (`draw_groups`): DRAW_GROUP_FLOOR where the devices report no
  # memory limit, none where the plan budgets the device's memory.
  draw_floor: int = 0
  # Asked for: a step's forward may run beside the last step's host update
  # (`overlaps_update`).
  overlap_forward: bool = True
  # grads_in_params with grad_accum > 1: the layers run over every micro-
  # batch at once, a layer at a time, keeping every micro-batch's layer
  # inputs (counted in the activations) and no float32 sums of the layers
  # (jzo.step.step._layers_first); else the layers' backward adds into such sums.
  layers_first: bool = False

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
    each layer's new weights as the host finishes them (jzo.step.step.make_step's
    `wait`): asked for (`overlap_forward`), with grads_in_params, one
    micro-batch or the layers first, the stacked layers' weights in device
    memory and one set of landing buffers (not streamed), where some of them
    have a host part."""
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
    return lowp * sum(l.shards * _rows(l) * l.shard_size for l in self.leaves
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
    return sum(l.shards * _rows(l) * l.on_host for l in self.leaves) if self.cpu_adam else 0

  @property
  def device_elements(self) -> int:
    """Parameters (padding included) of one device's shard whose state is on the device."""
    return sum(_rows(l) * l.on_device for l in self.leaves)

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
    total = sum(l.shards * _rows(l) * l.shard_size for l in self.leaves)
    return self.host_elements / total

  # --------------------------------------------------------------- memory
  def device_bytes(self) -> dict[str, int]:
    """Bytes one device holds between steps: params, gradient buffer, masters, moments."""
    lowp = np.dtype(self.compute_dtype).itemsize
    full = self.n_params
    local = sum(_rows(l) * l.shard_size for l in self.leaves)  # one shard, padded
    on_host = sum((_rows(l) - self.resident_layers) * l.shard_size
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
    local = sum(_rows(l) * l.shard_size for l in self.leaves)
    # Stages 0-2 differentiate full params; stage 3's per-layer gathers
    # reduce-scatter each layer's gradients inside the scan.
    grads = lowp * (local if self.stage == 3 and self.layers else self.n_params)
    # The layers' gradients in their weights' memory, but the one being
    # written; with the weights on the host, that layer's fetched weights too.
    grads -= lowp * sum((_rows(l) - 1 - self.params_on_host(l)) * l.shard_size
                        for l in self.leaves if self.grads_over_weights(l))
    step = {"backward grads": grads, "activations": activations}
    if self.overlaps_update and not self.layers_first:  # the layers' new weights it fetches
      step["fetched layers"] = OVERLAP_FETCH_LAYERS * lowp * sum(
          l.shard_size for l in self.leaves if self.grads_over_weights(l))
    if self.host_accumulation:  # the device parts' float32 sums beside one micro-batch's
      step["float32 sums"] = 4 * self.device_elements
    elif self.layers_first:  # of the other leaves, and of the layer in its backward
      stacked = [l for l in self.leaves if self.grads_over_weights(l)]
      step["float32 sums"] = 4 * (local - sum(_rows(l) * l.shard_size for l in stacked)
                                  + sum(l.shard_size for l in stacked))
    elif self.grad_accum > 1:
      step["float32 sums"] = 4 * (self.n_params if self.stage < 2 else local)
    if not self.has_host_state:
      return {**self.device_bytes(), **step}
    itemsize = self.grad_dtype.itemsize
    # Offloaded weights are updated where they are: nothing moves for them.
    host_leaves = [l for l in self.leaves if l.on_host and not self.params_on_host(l)]
    kept = itemsize * sum(_rows(l) * l.shard_size for l in host_leaves
                          if not self.grads_over_weights(l))
    # Leaf by leaf, its new weights come up (then go into the params in
    # place) and its next gradient goes down: a whole leaf's gradient goes
    # as it is, the split leaf's host part is first sliced into a copy.
    upload = lambda l: lowp * _rows(l) * l.on_host * (1 if self.sharded_lowp else self.n_devices)
    sliced = lambda l: itemsize * _rows(l) * l.on_host if l.on_device else 0
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
    return self.grad_dtype.itemsize * l.shards * _rows(l) * l.on_host // self.processes

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
    (jzo.state.build._placed). On one device each is written straight into its
    buffer. (Before, the whole low-precision copy and every device's piece
    of it were made at once: gpt2-20b's shape at 104 layers over 4 H200s
    peaked at the state 35.54 + the MLP kernel drawn 58.50 + in bf16 29.25
    + a piece 7.31 = 130.60 GiB, as measured.)"""
    n = self.n_devices

    def piece(l: LeafLayout) -> int:
      if n == 1:
        return 0
      lowp = 0 if self.params_on_host(l) else 2 * math.prod(l.shape)
      master = 4 * l.shards * _rows(l) * l.on_device if self.has_device_state else 0
      return max(lowp // n if self.sharded_lowp else lowp, master // n)

    return max(sum(4 * math.prod(self.leaves[i].shape) for i in group)
               + max(piece(self.leaves[i]) for i in group)
               for group in self.build_groups())

  def build_groups(self) -> list[list[int]]:
    """The leaves' indices in the groups the build draws together (`draw_groups`)."""
    return draw_groups([math.prod(l.shape) for l in self.leaves], self.draw_floor)

  def __str__(self) -> str:
    return format_plan(self)


def _weights_on_host(plan: Plan) -> str:
  """What format_plan says of offload_params: the layers' weights on the
  host, and how many layers' stay on the device as well."""
  if not plan.offload_params:
    return ""
  layers = max(map(_rows, plan.leaves))
  return (", layers' weights on the host"
          + (f" ({plan.resident_layers} of {layers} layers resident on the device)"
             if plan.resident_layers else ""))


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
          + (", delayed update" if plan.delayed_update else "")
          + _weights_on_host(plan)]
  peak = plan.device_peak(activations or 0)
  rows.append(f"  {'per device':<22}{'GiB':>8}")
  for name, b in peak.items():
    if b or name in ("params", "activations"):
      rows.append(f"  {name:<22}{gib(b)}")
  rows.append(f"  {'total (peak)':<22}{gib(sum(peak.values()))}"
              + (f"  of {device_memory / GiB:.2f} available" if device_memory else ""))
  if plan.cpu_adam:
    host = plan.host_bytes()
    where = "host" if plan.processes == 1 else f"host, each of {plan.processes} processes"
    rows.append(f"  {where:<22}{'GiB':>8}")
    for name, b in host.items():
      name = "landing (streamed)" if name == "landing" and plan.streamed else name
      rows.append(f"  {name:<22}{gib(b)}")
    overhead = plan.pool_overhead()
    rows.append(f"  {'pinned pool overhead':<22}{gib(overhead)}")
    rows.append(f"  {'runtime (CUDA, XLA)':<22}{gib(plan.runtime_bytes)}")
    if plan.checkpoint_bytes:
      rows.append(f"  {'checkpoint writes':<22}{gib(plan.checkpoint_bytes)}")
    total = sum(host.values()) + overhead + plan.runtime_bytes + plan.checkpoint_bytes
    rows.append(f"  {'total':<22}{gib(total)}"
                + (f"  of {host_memory / GiB:.2f} available" if host_memory else ""))
    seconds = plan.host_elements / plan.processes / HOST_UPDATE_PARAMS_PER_S
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


def host_memory_for(runtime_bytes: int) -> int:
  """Host bytes a plan that counts `runtime_bytes` for this process's runtime
  may use: what is available, plus what this process already holds up to
  that runtime. Once JAX has run anything on a GPU, the process holds most
  of its runtime (4.2 GiB for each H200, mostly its allocator's table),
  which the available memory no longer includes; without this the plan
  would count it twice, and a plan made in another process (jzo.estimate)
  would fit what the run refuses."""
  return available_host_memory() + min(psutil.Process().memory_info().rss, runtime_bytes)


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
  lo, hi = 0, max(map(_rows, jax.tree.leaves(layouts, is_leaf=is_layout)))
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
  by_size = sorted(range(len(leaves)), key=lambda i: -leaves[i].shard_size * _rows(leaves[i]))
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
             if plan.cpu_adam and plan.offloaded_fraction < 1 else ""))
    state = sum(plan.device_bytes().values())
    if state + plan.build_bytes() > device_memory:
      raise PlacementError(
          f"cannot draw the weights on a device beside the state: needs "
          f"{(state + plan.build_bytes()) / GiB:.2f} GiB (state {state / GiB:.2f}, the leaves "
          f"drawn {plan.build_bytes() / GiB:.2f}), {device_memory / GiB:.2f} GiB available")
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
          f"{PINNED_POOL_LIMIT_VAR} higher before JAX starts (jzo.plan.limit_pinned_pool)")
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
          f"{host_memory / GiB:.2f} GiB available{without}")


def make_plan(shapes, tx_state_bytes: int, options: EngineOptions, *, n_devices: int,
              axis: str = "data", device_memory: int | None = None,
              host_memory: int | None = None, activations: int = 0,
              processes: int = 1, checkpoint_memory: int = 0,
              runtime_bytes: int = HOST_RUNTIME_BYTES, checked: bool = True) -> Plan:
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
  offload="auto" needs `device_memory`.

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
            checkpoint_memory=checkpoint_memory, runtime_bytes=runtime_bytes, checked=checked)
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
          check(plan)  # overlap the update (jzo.step.step), which a streamed one cannot
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
               checkpoint_memory: int, runtime_bytes: int, landing_limit: int = 0,
               checked: bool = True) -> Plan:
  """make_plan with the accumulation decided."""
  stage, layers, offload = options.stage, options.layers, options.offload
  auto = isinstance(offload, str)  # "auto", the one string EngineOptions lets through
  if auto and device_memory is None:
    raise ValueError("offload='auto' needs the device memory: pass device_memory= (bytes); "
                     "this device reports no limit")
  shards = 1 if stage == 0 else n_devices
  base = partition.make_layouts(shapes, shards, layers)
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
        draw_floor=DRAW_GROUP_FLOOR if device_memory is None else 0,
        pinned_pools=device_memory is not None, overlap_forward=options.overlap_forward,
        layers_first=options.layers_first)
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
