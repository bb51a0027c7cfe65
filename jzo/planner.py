"""Will it fit, and where will each piece live? The memory planner from shapes.

`jzo.estimate(...)` and `python -m jzo.estimate --model gpt2-10b` compute,
per device and for the host, the bytes of weights, gradients, master
weights, moments, landing buffers and activations of a training
configuration, whether it fits, and the placement of the optimizer state the
engine would use. Shapes come from `jax.eval_shape`: no weight is drawn, so
it runs in seconds on a laptop for any preset. The engine and the recipe
build their plan with the same code (jzo.plan.make_plan).

  python -m jzo.estimate --model gpt2-10b --devices 1 --batch-size 8 \\
      --seq-len 1024 --remat full --stage 2 --offload auto --moments fp32 \\
      --host-gb 125 --device-gb 80
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jzo import config as config_lib, plan as plan_lib
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
      the step's peak (`jzo.models.gpt.activation_bytes` for the GPT presets).
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


def estimate_gpt(model: str, *, batch_size: int = 8, seq_len: int = 1024,
                 remat: str = "full", devices: int = 1, **kw) -> Estimate:
  """`estimate` for a GPT preset of jzo/models/gpt.py: shapes and activations
  (batch_size sequences over all devices) from the config alone."""
  from jzo.models import gpt  # the presets live beside the package
  if model not in gpt.PRESETS:
    raise ValueError(f"unknown model {model!r}; presets: {', '.join(gpt.PRESETS)}")
  config = dataclasses.replace(gpt.PRESETS[model], seq_len=seq_len, remat=remat)
  if batch_size % devices:
    raise ValueError(f"batch size {batch_size} does not split over {devices} devices")
  micro = batch_size // devices
  acts = gpt.activation_bytes(config, micro, seq_len)
  shapes = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  layers = "blocks" if kw.get("stage") == 3 else None
  return estimate(shapes, activations=acts, devices=devices, layers=layers, **kw)


def parse_offload(text: str) -> bool | float | str:
  """--offload values: auto, true/all, false/none, or a fraction in [0, 1].

  Raises:
    ValueError: anything else.
  """
  lowered = text.lower()
  if lowered == "auto":
    return "auto"
  if lowered in ("true", "all", "yes"):
    return True
  if lowered in ("false", "none", "no"):
    return False
  try:
    value = float(text)
  except ValueError:
    raise ValueError(f"--offload takes auto, true, false or a fraction in [0, 1], "
                     f"got {text!r}") from None
  if not 0.0 <= value <= 1.0:
    raise ValueError(f"--offload fraction must be in [0, 1], got {text}")
  return value


@dataclasses.dataclass(frozen=True)
class EstimateConfig:
  """`python -m jzo.estimate`'s options; the docstring under each field is its --help."""
  model: str
  """a preset of jzo/models/gpt.py (tiny, gpt2-124m, ..., gpt2-13b)"""
  devices: int = 1
  """GPUs on the data axis"""
  batch_size: int = 8
  """sequences per micro-batch, over all devices"""
  seq_len: int = 1024
  """tokens per sequence"""
  remat: Literal["full", "dots", "none"] = "full"
  """what the backward pass recomputes"""
  stage: Literal[0, 1, 2, 3] = 2
  """ZeRO stage"""
  offload: str = "auto"
  """auto, true, false, or the fraction of the state on the host"""
  moments: Literal["fp32", "bf16"] = "fp32"
  """dtype of the Adam moments"""
  precision: Literal["bf16", "fp16"] = "bf16"
  """compute precision"""
  grad_accum: int = 1
  """micro-batches per optimizer step"""
  delayed_update: bool = False
  """offload: one-step delayed parameter update"""
  host_gb: float | None = None
  """GiB of host RAM (None: what this machine has available)"""
  device_gb: float | None = None
  """GiB of one device (None: this machine's accelerator, else 80)"""


def check_estimate_options(cfg: EstimateConfig) -> None:
  """Raises ValueError naming an option out of range."""
  from jzo.models import gpt
  if cfg.model not in gpt.PRESETS:
    raise ValueError(f"unknown model {cfg.model!r}; presets: {', '.join(gpt.PRESETS)}")
  for name in ("devices", "batch_size", "seq_len", "grad_accum"):
    if getattr(cfg, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
  for name in ("host_gb", "device_gb"):
    if getattr(cfg, name) is not None and not getattr(cfg, name) > 0:
      raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(cfg, name)}")
  if cfg.delayed_update and parse_offload(cfg.offload) is False:
    raise ValueError("--delayed-update delays the host's update: it needs --offload other than "
                     "false")


def main(argv: list[str] | None = None) -> int:
  cfg = config_lib.parse(EstimateConfig, argv, description=__doc__.splitlines()[0],
                         prog="python -m jzo.estimate")
  gib = lambda x: None if x is None else int(x * GiB)
  try:
    check_estimate_options(cfg)
    result = estimate_gpt(cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                          remat=cfg.remat, devices=cfg.devices, stage=cfg.stage,
                          offload=parse_offload(cfg.offload), moments=cfg.moments,
                          precision=cfg.precision, grad_accum=cfg.grad_accum,
                          delayed_update=cfg.delayed_update, device_memory=gib(cfg.device_gb),
                          host_memory=gib(cfg.host_gb))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{cfg.model}, micro-batch {cfg.batch_size} x seq {cfg.seq_len}, remat {cfg.remat}, "
        f"{cfg.moments} moments")
  print(result)
  return 0 if result.fits else 1


if __name__ == "__main__":
  sys.exit(main())
