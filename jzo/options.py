"""The options of a ZeRO engine, documented and checked in one place:
`ZeroEngine`, the planner (`jzo.estimate`, `jzo.pick_micro_batch`), the
recipe and the benchmarks build their plans from an `EngineOptions`
(`jzo.plan.make_plan`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jzo.precision import resolve_precision

ACCUMULATIONS = ("auto", "device", "host", "layers")
# How offload moves gradients down and weights up (jzo.host.transfer).
HOST_TRANSFERS = ("auto", "pinned", "portable")


@dataclasses.dataclass(frozen=True)
class EngineOptions:
  """What a ZeRO engine does with a model's parameters: each field below,
  with what it means. Built checked: a bad value raises ValueError
  (TypeError for a loss scale of another type), naming it.

  `ZeroEngine(loss_fn, params, tx, EngineOptions(...))` takes it; the
  planner (`jzo.estimate`, `jzo.plan.make_plan`) and the recipe build their
  plans from the same object. `compute_dtype` and `loss_scale` are kept
  resolved: a numpy dtype, and a LossScale or None.
  """
  stage: int = 2
  """ZeRO stage, 0 (plain data parallelism) to 3."""
  compute_dtype: Any = jnp.bfloat16
  """dtype of the forward and backward passes: bfloat16, float16 or float32."""
  loss_scale: Any = "auto"
  """"auto" (dynamic for float16, none otherwise), None, or a jzo.LossScale."""
  grad_accum: int = 1
  """micro-batches per step; the batch splits evenly into them."""
  max_grad_norm: float | None = None
  """clip the global gradient norm to this (None: no clipping)."""
  layers: str | None = None
  """stage 3 only: dotted key path of the subtree that holds the stack of
  layers (leading axis = layer), which the model's scan gathers one layer
  at a time with `jzo.gather_layer`. None: gather all at once."""
  offload: bool | float | str = False
  """where the optimizer state (float32 masters and Adam moments) of each
  device's shard lives (stages 1-3, tx jzo.cpu_adam or cpu_adamw; with int8
  moments the host, "auto" included). False: device memory; True: host RAM
  (ZeRO-Offload), updated by the C++ kernel; a fraction f in [0, 1]: about
  f of every shard on the host, the rest updated on the device inside the
  step; "auto": as much on the device as fits (the engine's device_memory
  and activation_memory), the rest on the host."""
  delayed_update: bool = False
  """with offload, the ZeRO-Offload paper's one-step delayed parameter
  update: the host part of step t's update overlaps the device's step
  t + 1, whose gradients are computed on weights that lack it (the device
  part is never delayed)."""
  dpu_warmup: int = 10
  """plain (not delayed) steps before delayed_update starts."""
  accumulation: str = "auto"
  """with offload and grad_accum > 1, where the micro-batches' gradients are
  summed (float32): "device" (one jitted call a step; a float32 sum of
  every shard on the device), "host" (a call per micro-batch; the host
  parts' gradients go down after each and are summed on the host, the
  device parts' on the device: the device holds one micro-batch's
  gradients), "layers" (grads_in_params: the layers run first, see there),
  or "auto": with grads_in_params "layers", else the device where it fits."""
  landing_limit: int | None = None
  """with offload, bytes of pinned host memory the landing buffers
  (gradients going down, weights going up) may hold at once in this
  process; 0: all of a step's host parts. Without host accumulation a limit
  streams the update: spans of a quarter of it go down, through the kernel
  and up, overlapped (not with delayed_update). None: 2 GiB streamed
  (jzo.plan.STREAM_LANDING_BYTES) where a step's host parts are more, one
  set with delayed_update; under host accumulation one micro-batch's set,
  or a ring of two leaves where the host lacks room."""
  host_transfer: str = "auto"
  """how offload moves gradients down and weights up: "auto" (pinned host
  memory where the devices have it, else the portable path, with a
  warning), "pinned", or "portable" (see jzo.host.transfer)."""
  grads_in_params: bool = False
  """stage 3 with layers= and offload (True, a fraction or "auto"), no
  delayed update: the model's `jzo.scan_layers` writes each layer's
  gradient over its weights in the backward pass, so the layers' gradients
  take no device memory of their own; the step writes the device parts'
  new weights over their gradients and the host update writes the host
  parts' back (jzo.parallel.layer_scan). A device part costs its masters
  and moments in device memory (12 B a parameter with fp32 moments) and
  takes its update off the host. With grad_accum > 1 (accumulation "auto"
  or "layers") the step runs the layers' forward over every micro-batch
  first, a layer at a time, then each layer's backward over every
  micro-batch, its gradient summed in float32 and written over its
  weights: no float32 sums of the layers, but every micro-batch's layer
  inputs are kept (activation_memory must count them: e.g.
  jzo.models.gpt's activation_bytes(..., accumulation=grad_accum)), and the
  forward may overlap the host update as with one micro-batch.
  Accumulation "device" instead adds the layers' gradients into float32
  sums on the device (4 B a parameter), the last micro-batch's written
  over the weights. Not "host"."""
  offload_params: bool | str = False
  """grads_in_params (implied, with its conditions) with the layers'
  low-precision weights in pinned host memory (ZeRO-3 offload of
  parameters): each layer comes up to the device for its forward and
  again for its backward, and its gradient goes down over its weights,
  which the host kernel then updates where they are. The devices hold one
  layer's weights and gradient at a time. True offloads the stacked
  layers' weights; "auto" keeps them on the devices where they fit (the
  engine's device_memory and activation_memory), else offloads them and
  keeps as many of the first layers resident as still fit: a copy of their
  weights stays in device memory, so the step does not fetch them, and
  comes up again once after each host update (the plan says how many).
  Needs devices with pinned host memory (GPUs; the CPU backend runs it
  too)."""
  resident_layers: int | None = None
  """with offload_params=True, how many of the first layers stay resident
  (None: 0), in place of "auto"'s choice."""
  overlap_forward: bool = True
  """with grads_in_params, one micro-batch or the layers first, the layers'
  weights in device memory, no landing limit and pinned transfers
  (`Plan.overlaps_update`), on accelerators (not CPU devices): each step's
  forward runs beside the last step's host update, a layer at a time, each
  layer as soon as the host has its new weights (jzo.parallel.layer_scan).
  The same arithmetic as without; False runs the update before the next
  step instead."""
  deterministic: bool = False
  """GPU steps that give bitwise the same losses and weights run to run on
  one machine and device count: the step programs are compiled with XLA's
  deterministic GPU operations (scatter-adds without atomics, cuDNN
  attention's deterministic backward, one GEMM algorithm per shape, not
  the fastest measured that run). Costs some speed (docs/performance.md).
  CPU steps, the host kernel and the collectives are deterministic
  without it."""

  def __post_init__(self):
    if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
      raise ValueError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
    dtype, loss_scale = resolve_precision(self.compute_dtype, self.loss_scale)
    object.__setattr__(self, "compute_dtype", np.dtype(dtype))
    object.__setattr__(self, "loss_scale", loss_scale)
    if not _whole(self.grad_accum) or self.grad_accum < 1:
      raise ValueError(f"grad_accum must be an integer >= 1, got {self.grad_accum!r}")
    if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm)
                                               and self.max_grad_norm > 0):
      raise ValueError(f"max_grad_norm must be a finite number > 0, got {self.max_grad_norm!r}")
    if self.layers is not None and self.stage != 3:
      raise ValueError("layers= only applies to stage 3")
    _check_offload(self.offload)
    if self.offloading and self.stage == 0:
      raise ValueError("offload needs ZeRO stage 1, 2 or 3 (stage 0 replicates the state)")
    if self.delayed_update and not self.offloading:
      raise ValueError("delayed_update needs offload=True")
    if not _whole(self.dpu_warmup) or self.dpu_warmup < 0:
      raise ValueError(f"dpu_warmup must be an integer >= 0, got {self.dpu_warmup!r}")
    if self.accumulation not in ACCUMULATIONS:
      raise ValueError(f"accumulation must be 'auto', 'device', 'host' or 'layers', got "
                       f"{self.accumulation!r}")
    if self.landing_limit is not None and (not _whole(self.landing_limit)
                                           or self.landing_limit < 0):
      raise ValueError(f"landing_limit must be a whole number of bytes >= 0, got "
                       f"{self.landing_limit!r}")
    if self.offload_params is not False:
      if self.offload_params is not True and self.offload_params != "auto":
        raise ValueError(f"offload_params must be True, False or 'auto', got "
                         f"{self.offload_params!r}")
      # The layers' gradients go over their weights in host memory.
      object.__setattr__(self, "grads_in_params", True)
    if self.grads_in_params:
      _check_grads_in_params(self, "offload_params" if self.offload_params else "grads_in_params")
    elif self.accumulation == "layers":
      raise ValueError("accumulation='layers' runs the layers first with grads_in_params "
                       "(set grads_in_params=True)")
    if self.resident_layers is not None:
      if not _whole(self.resident_layers) or self.resident_layers < 0:
        raise ValueError(f"resident_layers must be an integer >= 0, got {self.resident_layers!r}")
      if self.offload_params is not True:
        raise ValueError("resident_layers keeps the first layers of the weights in host memory "
                         "on the devices as well: it needs offload_params=True "
                         f"(offload_params='auto' chooses them), got {self.offload_params!r}")
    if not isinstance(self.deterministic, bool):
      raise ValueError(f"deterministic must be True or False, got {self.deterministic!r}")
    if not isinstance(self.overlap_forward, bool):
      raise ValueError(f"overlap_forward must be True or False, got {self.overlap_forward!r}")
    if self.host_transfer not in HOST_TRANSFERS:
      raise ValueError(f"host_transfer must be one of {HOST_TRANSFERS}, got "
                       f"{self.host_transfer!r}")

  @property
  def offloading(self) -> bool:
    """The optimizer is jzo's Adam, whose state may live on the host."""
    return self.offload is not False

  @property
  def layers_first(self) -> bool:
    """grads_in_params with grad_accum > 1 runs the layers over every micro-
    batch at once (accumulation "layers", or "auto"), not into float32
    sums of the layers ("device"); see jzo.plan.Plan.layers_first."""
    return (self.grads_in_params and self.grad_accum > 1
            and self.accumulation in ("auto", "layers"))

  @property
  def grad_dtype(self) -> np.dtype:
    """The gradients the step keeps or ships: several micro-batches are
    summed in float32 on the device when the device's optimizer keeps the
    sum; offload ships the compute dtype (jzo.step)."""
    if self.grad_accum > 1 and not self.offloading:
      return np.dtype(np.float32)
    return self.compute_dtype


def _check_grads_in_params(options: EngineOptions, name: str) -> None:
  """grads_in_params (and offload_params, `name`, which implies it) writes
  the layers' gradients over their weights, which only the masters can
  then remake: jzo's Adam (offload), whose device part writes its weights
  back in the step and whose host part's come up after it; nothing that
  reads the weights after the last micro-batch's backward pass. Weights in
  host memory are updated there by the host kernel, so offload_params
  keeps every leaf's state on the host."""
  if options.grads_in_params is not True:
    raise ValueError(f"grads_in_params must be True or False, got {options.grads_in_params!r}")
  if options.stage != 3 or options.layers is None:
    raise ValueError(f"{name} needs stage=3 and layers= (the stacked layers whose "
                     "gradients take their weights' place)")
  if options.offload_params and options.offload is not True and options.offload != 1:
    raise ValueError(f"{name} needs offload=True (the host kernel updates the weights in host "
                     f"memory where they are), got offload={options.offload!r}")
  if not options.offloading:
    raise ValueError(f"{name} needs offload=True, a fraction or 'auto' (jzo's Adam, whose "
                     "masters remake the weights the gradients overwrote), got offload=False")
  if options.grad_accum != 1 and options.accumulation == "host":
    raise ValueError(f"{name} sums the layers' micro-batches on the device, in the backward "
                     "pass (the last writes the sums over the weights): it cannot take "
                     "accumulation='host'")
  if options.delayed_update:
    raise ValueError(f"{name} cannot delay the update: the next step needs the "
                     "weights the update writes back")


def _whole(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_offload(offload) -> None:
  if isinstance(offload, str):
    if offload != "auto":
      raise ValueError(f"offload must be True, False, a fraction in [0, 1] or 'auto', "
                       f"got {offload!r}")
  elif not isinstance(offload, bool):
    if not isinstance(offload, (int, float)) or not 0.0 <= float(offload) <= 1.0:
      raise ValueError(f"offload fraction must be in [0, 1], got {offload!r}")
