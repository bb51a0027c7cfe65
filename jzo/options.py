"""The options of a ZeRO engine, checked in one place: `ZeroEngine`, the
planner (`jzo.estimate`, `jzo.pick_micro_batch`) and the benchmarks build
their plans from an `EngineOptions` (`jzo.plan.make_plan`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jzo.precision import resolve_precision
from jzo.host.transfer import HOST_TRANSFERS

ACCUMULATIONS = ("auto", "device", "host", "layers")


@dataclasses.dataclass(frozen=True)
class EngineOptions:
  """What a ZeRO engine does with a model's parameters; `ZeroEngine`'s
  docstring says what each option means. Built checked: a bad value raises
  ValueError (TypeError for a loss scale of another type), naming it.

  `compute_dtype` and `loss_scale` are kept resolved: a numpy dtype, and a
  LossScale or None ("auto" is dynamic scaling for float16 only).
  """
  stage: int = 2
  compute_dtype: Any = jnp.bfloat16
  loss_scale: Any = "auto"
  grad_accum: int = 1
  max_grad_norm: float | None = None
  layers: str | None = None
  offload: bool | float | str = False
  delayed_update: bool = False
  dpu_warmup: int = 10
  accumulation: str = "auto"
  landing_limit: int | None = None
  host_transfer: str = "auto"
  grads_in_params: bool = False
  offload_params: bool | str = False
  resident_layers: int | None = None
  overlap_forward: bool = True

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
    sum; offload ships the compute dtype (jzo.step.step)."""
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
