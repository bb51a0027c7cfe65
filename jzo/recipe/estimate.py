"""`python -m jzo.estimate`: the memory planner's table for a model of the
recipe's, from its shapes alone (seconds, no weight drawn).

  python -m jzo.estimate --model gpt2-10b --devices 1 --batch-size 8 \\
      --seq-len 1024 --remat full --stage 2 --offload auto --moments fp32 \\
      --host-gb 125 --device-gb 80
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Literal
from unittest import mock

import jax

from jzo.recipe import config as config_lib
from jzo.checkpoint.files import SAVE_HOST_BYTES
from jzo.plan import GiB
from jzo.plan.fit import Estimate, estimate_micro_batch
from jzo.recipe import models
from jzo.recipe.loop import cap_pinned_pool, claim_gpu_memory
from jzo.recipe.options import (ALL_WEIGHTS_FIT, UserError, check_resident_layers, in_flags,
                                resident_count)

Preset = Literal[tuple(models.PRESETS)]


def estimate_model(name: str, *, batch_size: int = 8, seq_len: int = 1024,
                   remat: str = "full", devices: int = 1, **kw) -> Estimate:
  """`jzo.estimate` for a preset of jzo.recipe.models: shapes and
  activations (batch_size sequences over all devices) from the config alone.
  `kw`: the other arguments of `jzo.estimate`."""
  if name not in models.PRESETS:
    raise ValueError(f"unknown model {name!r}; presets: {', '.join(models.PRESETS)}")
  model = models.PRESETS[name]
  config = dataclasses.replace(model.config, remat=remat)
  if model.family is models.GPT:
    config = dataclasses.replace(config, seq_len=seq_len)
  model = dataclasses.replace(model, config=config)
  if batch_size % devices:
    raise ValueError(f"batch size {batch_size} does not split over {devices} devices")
  shapes = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0)))
  layers = model.family.layers if kw.get("stage") == 3 else None
  # As jzo.train: with accumulation, the layers first where they fit, else their sums.
  return estimate_micro_batch(shapes, functools.partial(model.activation_bytes, seq_len=seq_len),
                              batch_size // devices, devices=devices, layers=layers, **kw)[1]


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
  model: Preset
  """a preset of jzo.models (GPT-2 shapes, Llama, Mistral, Qwen)"""
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
  moments: Literal["fp32", "bf16", "int8"] = "fp32"
  """dtype of the Adam moments (int8: on the host, so offload auto means true)"""
  precision: Literal["bf16", "fp16"] = "bf16"
  """compute precision"""
  grad_accum: int = 1
  """micro-batches per optimizer step"""
  delayed_update: bool = False
  """offload: one-step delayed parameter update"""
  grads_in_params: bool = False
  """stage 3 + offload: each layer's gradient written over its weights (no room for both); with --grad-accum, the layers run first over every micro-batch where they fit, else float32 sums of the layers on the GPU"""
  offload_params: bool = False
  """stage 3 + offload: the layers' weights in pinned host memory where the device needs it, fetched a layer at a time but for the first layers that still fit on the device (implies --grads-in-params)"""
  resident_layers: int = -1
  """with --offload-params: how many of the first layers keep their weights on the device as well, always offloading the rest (-1: the planner's choice)"""
  overlap_forward: bool = True
  """with --grads-in-params and the layers' weights on the device (one micro-batch, or the layers first): each step's forward overlaps the last host update, the plan with its fetched layers at one micro-batch (--no-overlap-forward: the update first)"""
  checkpoints: bool = True
  """count the host RAM a checkpoint's save takes beside the state (as jzo.train does, unless --checkpoint-every 0)"""
  host_gb: float | None = None
  """GiB of host RAM (None: what this machine has available)"""
  device_gb: float | None = None
  """GiB of one device (None: this machine's accelerator, else 80)"""


def check_estimate_options(cfg: EstimateConfig) -> None:
  """Raises ValueError (UserError for --resident-layers, as jzo.train's)
  naming an option out of range; the engine's options are jzo.EngineOptions'
  to check, in `main`."""
  for name in ("devices", "batch_size", "seq_len", "grad_accum"):
    if getattr(cfg, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
  for name in ("host_gb", "device_gb"):
    if getattr(cfg, name) is not None and not getattr(cfg, name) > 0:
      raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(cfg, name)}")
  check_resident_layers(cfg)


def main(argv: list[str] | None = None) -> int:
  cfg = config_lib.parse(EstimateConfig, argv, description=__doc__.splitlines()[0],
                         prog="python -m jzo.estimate")
  gib = lambda x: None if x is None else int(x * GiB)
  try:
    check_estimate_options(cfg)
    offload = parse_offload(cfg.offload)
    # The GPU's share and XLA's pinned pool as the recipe sets them while the
    # plan is made and printed (the pool's overhead is part of the host's
    # bytes); the environment is left as it was.
    with mock.patch.dict(os.environ):
      claim_gpu_memory()
      cap_pinned_pool(models.PRESETS[cfg.model], cfg.devices)
      try:
        result = estimate_model(cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                remat=cfg.remat, devices=cfg.devices, stage=cfg.stage,
                                offload=offload, moments=cfg.moments, precision=cfg.precision,
                                grad_accum=cfg.grad_accum, delayed_update=cfg.delayed_update,
                                grads_in_params=cfg.grads_in_params,
                                offload_params=(("auto" if resident_count(cfg) is None else True)
                                                if cfg.offload_params else False),
                                resident_layers=resident_count(cfg),
                                overlap_forward=cfg.overlap_forward,
                                device_memory=gib(cfg.device_gb),
                                host_memory=gib(cfg.host_gb),
                                checkpoint_memory=SAVE_HOST_BYTES if cfg.checkpoints else 0)
      except ValueError as e:  # jzo.EngineOptions' and the plan's, told in this command's flags
        raise UserError(in_flags(str(e), fraction="--offload",
                                 no_offload="--offload false")) from e
      table = str(result)
  except (ValueError, UserError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{cfg.model}, micro-batch {cfg.batch_size} x seq {cfg.seq_len}, remat {cfg.remat}, "
        f"{cfg.moments} moments")
  print(table)
  if cfg.offload_params and not result.plan.offload_params:
    print(ALL_WEIGHTS_FIT)
  return 0 if result.fits else 1


if __name__ == "__main__":
  sys.exit(main())
