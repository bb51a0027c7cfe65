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
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jzo.kernels.cpu_adam import MOMENT_DTYPES
from jzo.options import EngineOptions
from jzo.plan.machine import device_memory_limit, host_memory_for, host_runtime_bytes
from jzo.plan.placement import PlacementError, make_plan
from jzo.plan.plan import GiB, Plan, format_plan

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
    return False if not self.plan.cpu_adam else self.plan.offloaded_fraction

  def __str__(self) -> str:
    if self.plan is None:
      return f"does not fit: {self.error}"
    table = format_plan(self.plan, self.activations, self.device_memory, self.host_memory)
    return table + ("\nfits" if self.fits else f"\ndoes not fit: {self.error}")


def estimate(params, *, activations: int = 0, devices: int = 1, stage: int = 2,
             offload: bool | float | str = "auto", moments: str = "fp32",
             precision: str = "bf16", grad_accum: int = 1, delayed_update: bool = False,
             layers: str | None = None, device_memory: int | None = None,
             host_memory: int | None = None, accumulation: str = "auto",
             grads_in_params: bool = False, offload_params: bool | str = False,
             resident_layers: int | None = None, overlap_forward: bool = True,
             checkpoint_memory: int = 0, sliced_draws: bool | None = None) -> Estimate:
  """Plans a ZeRO engine over `params` and checks it fits.

  Args:
    params: a tree of arrays or ShapeDtypeStructs, or a function returning
      the params (only traced for its shapes).
    activations: bytes one device needs for activations and temporaries at
      the step's peak (`activation_bytes` of a family in jzo.models).
    devices: size of the data axis.
    stage, grad_accum, delayed_update, layers, accumulation, grads_in_params,
      offload_params: as for `ZeroEngine` (offload_params "auto": the
      layers' weights in host memory where the device needs it, and as many
      layers resident on the device as fit); resident_layers,
      overlap_forward: as for `ZeroEngine`.
    offload: as for `ZeroEngine` (False, True, a fraction or "auto"; "auto"
      means True with int8 moments or offload_params).
    moments: "fp32", "bf16" or "int8" Adam moments (jzo.cpu_adamw's mu/nu_dtype;
      int8 ones are kept on the host, so offload "auto" means True).
    precision: "bf16" or "fp16" compute (or "fp32").
    device_memory: bytes of one device (default: this machine's accelerator,
      else DEFAULT_DEVICE_GIB).
    host_memory: bytes of host RAM (default: what this machine has available,
      with the part of the planned runtime this process holds: `jzo.plan.host_memory_for`).
    checkpoint_memory: as for `ZeroEngine`: host RAM a checkpoint's save
      takes beside the state (`jzo.checkpoint.SAVE_HOST_BYTES`), or 0.
    sliced_draws: the weights come from arrays or files, whose large
      stacked leaves the engine draws a slice of layers at a time, not
      from an initializer, which computes each leaf whole (`Plan.sliced_draws`;
      default: a tree of params is sliced, a function is not).
    The host's runtime is counted for one process over `devices` GPUs (one
    CPU's where JAX is limited to CPUs: jax_platforms "cpu").

  Returns:
    An Estimate; print it for the table.
  """
  if sliced_draws is None:
    sliced_draws = not callable(params)
  shapes = jax.eval_shape(params) if callable(params) else params
  if moments not in MOMENT_DTYPES:
    raise ValueError(f"moments must be one of {', '.join(MOMENT_DTYPES)}, got {moments!r}")
  if moments == "int8":  # kept on the host, as ZeroEngine keeps them
    if offload == "auto":
      offload = True
    if offload is not True and offload != 1:
      raise ValueError(f"int8 moments are kept in host memory: offload must be True or "
                       f"'auto', got {offload!r}")
  grads_in_params = True if offload_params else grads_in_params
  if offload_params and offload == "auto":  # the host kernel updates the weights in host memory
    offload = True
  dtypes = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
  if precision not in dtypes:
    raise ValueError(f"precision must be bf16, fp16 or fp32, got {precision!r}")
  options = EngineOptions(stage=stage, compute_dtype=dtypes[precision], grad_accum=grad_accum,
                          layers=layers, offload=offload, delayed_update=delayed_update,
                          dpu_warmup=0, accumulation=accumulation,
                          grads_in_params=grads_in_params, offload_params=offload_params,
                          resident_layers=resident_layers, overlap_forward=overlap_forward)
  if device_memory is None:
    device_memory = local_device_memory() or int(DEFAULT_DEVICE_GIB * GiB)
  runtime = host_runtime_bytes(devices, _planned_platform(), device_memory)
  if host_memory is None:
    host_memory = host_memory_for(runtime)
  moment_dtype = np.dtype(MOMENT_DTYPES[moments])
  kw = dict(n_devices=devices, activations=activations, checkpoint_memory=checkpoint_memory,
            runtime_bytes=runtime, sliced_draws=sliced_draws)
  try:
    plan = make_plan(shapes, 2 * moment_dtype.itemsize, options,
                     device_memory=device_memory, host_memory=host_memory, **kw)
    error = None
  except PlacementError as e:
    error, plan = str(e), e.plan  # the plan the numbers are of, to show where memory goes
  return Estimate(plan, activations, device_memory, host_memory, error)


def _planned_platform() -> str:
  """The devices whose runtime an estimate counts: CPUs where JAX may run
  on nothing else (jax_platforms "cpu"), else accelerators, which the plan
  is for; read without starting a backend (a process that only plans
  must not take a GPU from the run it plans)."""
  return "cpu" if (jax.config.jax_platforms or "").split(",")[0] == "cpu" else "gpu"


def local_device_memory() -> int | None:
  """Bytes of this machine's first accelerator, or None where there is none."""
  device = jax.devices()[0]
  return None if device.platform == "cpu" else device_memory_limit(device)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
  """The outcome of `pick_micro_batch`."""
  micro_batch: int  # sequences per device in one forward and backward
  grad_accum: int  # micro-batches per step
  accumulation: str  # the engine's `accumulation` for it ("layers" where they run first)
  estimate: Estimate  # the plan at that micro-batch (it fits)
  line: str  # what was picked and why, for a person to read


def estimate_micro_batch(params, activation_bytes: Callable[..., int], micro: int, *,
                         grad_accum: int = 1, accumulation: str = "auto",
                         **options) -> tuple[str, Estimate]:
  """`estimate` at micro-batches of `micro` sequences a device, grad_accum
  of them, with activations from `activation_bytes` (as `pick_micro_batch`
  takes it): (the engine's `accumulation` for it, the estimate). With
  grads_in_params and accumulation "auto", the layers first ("layers":
  activation_bytes(micro, accumulation=grad_accum)) where they fit, else
  the layers' float32 sums ("device"); where neither fits, the first's
  estimate."""
  first = bool(options.get("grads_in_params") or options.get("offload_params")) and (
      grad_accum > 1)
  tries = ["layers", "device"] if first and accumulation == "auto" else [accumulation]
  estimates = []
  for accumulation in tries:
    acts = (activation_bytes(micro, accumulation=grad_accum)
            if first and accumulation in ("auto", "layers") else activation_bytes(micro))
    estimates.append((accumulation, estimate(params, activations=acts, grad_accum=grad_accum,
                                             accumulation=accumulation, **options)))
    if estimates[-1][1].fits:
      return estimates[-1]
  return estimates[0]


def batch_line(plan: Plan, micro_batch: int, devices: int) -> str:
  """How a plan's global batch is made, for a person to read: "micro-batch
  8 a device x 4 accumulation summed on the host x 1 device = global batch
  32" (the plan's grad_accum micro-batches of `micro_batch` sequences a
  device, and where they are summed)."""
  accum = plan.grad_accum
  where = ""
  if accum > 1 and plan.layers_first:
    where = " with the layers first"
  elif accum > 1 and plan.cpu_adam:
    where = " summed on the host" if plan.host_accumulation else " summed on the device"
  return (f"micro-batch {micro_batch} a device x {accum} accumulation{where} x {devices} "
          f"device{'s' if devices > 1 else ''} = global batch {micro_batch * accum * devices}")


def pick_micro_batch(params, activation_bytes: Callable[[int], int], *, devices: int,
                     global_batch: int, **options) -> MicroBatch:
  """The largest micro-batch whose plan fits, and the accumulation that
  makes `global_batch` of it: micro-batches of m sequences a device, m
  dividing global_batch / devices, tried from the largest down.

  Args:
    params: as for `estimate` (a tree of shapes, or a function returning params).
    activation_bytes: activation_bytes(m) is the bytes one device needs for
      activations at a micro-batch of m sequences (e.g.
      `functools.partial(gpt.activation_bytes, config, seq_len=1024)`);
      with grads_in_params it is also called as activation_bytes(m,
      accumulation=k) for k micro-batches whose layers run first.
    devices: size of the data axis.
    global_batch: sequences per optimizer step over all devices.
    **options: the rest of `estimate`'s arguments (stage, offload, moments,
      precision, delayed_update, layers, device_memory, host_memory,
      accumulation, grads_in_params, offload_params, resident_layers,
      checkpoint_memory, sliced_draws);
      not grad_accum, which this picks.

  Returns:
    A MicroBatch; its `line` reads e.g. "micro-batch 8 a device x 4
    accumulation x 1 device = global batch 32 (16 does not fit: ...)".

  Raises:
    ValueError: global_batch or devices not positive, or global_batch not a
      multiple of devices.
    PlacementError: no micro-batch fits, not even 1; the message has the numbers.
  """
  if "grad_accum" in options:
    raise TypeError("pick_micro_batch picks grad_accum; do not pass it")
  for name, value in (("devices", devices), ("global_batch", global_batch)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
  per_device, rest = divmod(global_batch, devices)
  if rest:
    raise ValueError(f"global batch {global_batch} does not split over {devices} devices "
                     f"({global_batch} = {per_device} x {devices} + {rest})")
  options.setdefault("sliced_draws", not callable(params))  # as `estimate` takes params
  shapes = jax.eval_shape(params) if callable(params) else params
  refused = None
  for micro in (m for m in range(per_device, 0, -1) if per_device % m == 0):
    accum = per_device // micro
    accumulation, found = estimate_micro_batch(shapes, activation_bytes, micro, devices=devices,
                                               grad_accum=accum, **options)
    if found.fits:
      why = f" ({refused[0]} does not fit: {refused[1]})" if refused else ""
      return MicroBatch(micro, accum, accumulation, found,
                        batch_line(found.plan, micro, devices) + why)
    refused = (micro, found.error)  # the next larger, reported if a smaller one fits
  raise PlacementError(f"global batch {global_batch} on {devices} device(s): no micro-batch "
                       f"fits, not even 1 a device x {per_device} accumulation: {found.error}")
