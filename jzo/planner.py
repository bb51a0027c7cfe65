"""Will it fit, and where will each piece live? The memory planner from shapes.

`jzo.estimate(...)` (and `python -m jzo.estimate --model gpt2-10b`, the
recipe's command line for its models: jzo.recipe.estimate) compute,
per device and for the host, the bytes of weights, gradients, master
weights, moments, landing buffers and activations of a training
configuration, whether it fits, and the placement of the optimizer state the
engine would use. Shapes come from `jax.eval_shape`: no weight is drawn, so
it runs in seconds on a laptop for any preset. The engine and the recipe
build their plan with the same code (jzo.plan.make_plan).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jzo import plan as plan_lib
from jzo.plan import GiB, Plan, PlacementError
from jzo.precision import resolve_precision

# Device memory assumed when the estimate runs where there is no accelerator.
DEFAULT_DEVICE_GIB = 80.0


@dataclasses.dataclass(frozen=True)
class Estimate:
  """The outcome of `estimate`: the plan (None if nothing fits) and the numbers."""
  plan: Plan | None
  activations: int  # bytes per device at the step's peak
  device_memory: int  # bytes of one device
  host_memory: int  # bytes of host RAM
  error: str | None  # why it does not fit, with the numbers; None if it fits

  @property
  def fits(self) -> bool:
    return self.error is None

  @property
  def offload(self) -> float | bool:
    """The placement to give the engine: False or the offloaded fraction."""
    return False if not self.plan.offload else self.plan.offloaded_fraction

  def __str__(self) -> str:
    if self.plan is None:
      return f"does not fit: {self.error}"
    table = plan_lib.format_plan(self.plan, self.activations, self.device_memory,
                                 self.host_memory)
    return table + ("\nfits" if self.fits else f"\ndoes not fit: {self.error}")


def estimate(params, *, activations: int = 0, devices: int = 1, stage: int = 2,
             offload: bool | float | str = "auto", moments: str = "fp32",
             precision: str = "bf16", grad_accum: int = 1, delayed_update: bool = False,
             layers: str | None = None, device_memory: int | None = None,
             host_memory: int | None = None) -> Estimate:
  """Plans a ZeRO engine over `params` and checks it fits.

  Args:
    params: a tree of arrays or ShapeDtypeStructs, or a function returning
      the params (only traced for its shapes).
    activations: bytes one device needs for activations and temporaries at
      the step's peak (`activation_bytes` of a family in jzo.models).
    devices: size of the data axis.
    stage, grad_accum, delayed_update, layers: as for `ZeroEngine`.
    offload: as for `ZeroEngine` (False, True, a fraction or "auto").
    moments: "fp32" or "bf16" Adam moments (jzo.cpu_adamw's mu/nu_dtype).
    precision: "bf16" or "fp16" compute (or "fp32").
    device_memory: bytes of one device (default: this machine's accelerator,
      else DEFAULT_DEVICE_GIB).
    host_memory: bytes of host RAM (default: what this machine has available).

  Returns:
    An Estimate; print it for the table.
  """
  shapes = jax.eval_shape(params) if callable(params) else params
  if moments not in ("fp32", "bf16"):
    raise ValueError(f"moments must be fp32 or bf16, got {moments!r}")
  dtypes = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
  if precision not in dtypes:
    raise ValueError(f"precision must be bf16, fp16 or fp32, got {precision!r}")
  compute_dtype, loss_scale = resolve_precision(dtypes[precision], "auto")
  if device_memory is None:
    device_memory = local_device_memory() or int(DEFAULT_DEVICE_GIB * GiB)
  if host_memory is None:
    host_memory = plan_lib.available_host_memory()
  moment_dtype = np.dtype(jnp.bfloat16 if moments == "bf16" else np.float32)
  offloading = offload is not False
  kw = dict(stage=stage, n_devices=devices, axis="data", compute_dtype=compute_dtype,
            grad_dtype=jnp.float32 if grad_accum > 1 and not offloading else compute_dtype,
            loss_scale=loss_scale, grad_accum=grad_accum, max_grad_norm=None, layers=layers,
            offload=offload, delayed_update=delayed_update, dpu_warmup=0,
            activations=activations)
  try:
    plan = plan_lib.make_plan(shapes, 2 * moment_dtype.itemsize, device_memory=device_memory,
                              host_memory=host_memory, **kw)
    error = None
  except PlacementError as e:
    error = str(e)
    # The plan without the checks, to show where the memory would go.
    plan = plan_lib.make_plan(shapes, 2 * moment_dtype.itemsize, **{
        **kw, "offload": 1.0 if offload == "auto" else offload})
  return Estimate(plan, activations, device_memory, host_memory, error)


def local_device_memory() -> int | None:
  """Bytes of this machine's first accelerator, or None where there is none."""
  device = jax.devices()[0]
  return None if device.platform == "cpu" else plan_lib.device_memory_limit(device)
