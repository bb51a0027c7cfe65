"""`python -m jzo.estimate`: the memory planner's table for a model of the
recipe's, from its shapes alone (seconds, no weight drawn), at the batch
jzo.train would run.

  python -m jzo.estimate --model gpt2-10b --devices 1 --batch-size 32 \\
      --micro-batch auto --seq-len 1024 --remat full --stage 2 --offload auto \\
      --moments fp32 --host-gb 125 --device-gb 80

As in jzo.train, --batch-size is the global batch (sequences per optimizer
step over all devices) and --micro-batch the sequences one device runs in a
forward and backward, the rest of its share accumulated; auto picks the
largest that fits (jzo.pick_micro_batch).
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
from jzo.plan import (GiB, MicroBatch, PlacementError, batch_line, estimate_micro_batch,
                      pick_micro_batch)
from jzo.recipe import models
from jzo.recipe.loop import cap_pinned_pool, claim_gpu_memory, per_device_batch
from jzo.recipe.options import (ALL_WEIGHTS_FIT, UserError, check_resident_layers, in_flags,
                                resident_count)

Preset = Literal[tuple(models.PRESETS)]


def estimate_model(name: str, *, batch_size: int = 8, micro_batch: int | None = None,
                   seq_len: int = 1024, remat: str = "full", devices: int = 1,
                   **kw) -> MicroBatch:
  """`jzo.estimate` for a preset of jzo.recipe.models at a global batch, as
  jzo.train plans it: shapes and activations from the config alone.

  Args:
    name: a preset of jzo.recipe.models.
    batch_size: sequences per optimizer step over all devices (the global
      batch: jzo.train's --batch-size).
    micro_batch: sequences one device runs in a forward and backward, the
      rest of its share accumulated (jzo.train's --micro-batch); None: the
      largest that fits (`jzo.pick_micro_batch`), else the whole share.
    seq_len: tokens per sequence (a GPT preset's context as well).
    remat: what the backward pass recomputes ("full", "dots", "none").
    devices: size of the data axis.
    **kw: the other arguments of `jzo.estimate` (stage, offload, moments,
      ...); not grad_accum, which batch_size / (devices x micro_batch) is.

  Returns:
    A jzo.plan.MicroBatch: micro_batch, grad_accum, accumulation, the
    `estimate` there (not `fits` where the micro-batch given does not fit,
    or none does) and the `line` saying how the batch is made.

  Raises:
    ValueError: an unknown preset, or a batch_size that does not split
      over the devices into micro-batches.
  """
  if name not in models.PRESETS:
    raise ValueError(f"unknown model {name!r}; presets: {', '.join(models.PRESETS)}")
  if "grad_accum" in kw:
    raise TypeError("estimate_model makes grad_accum from batch_size, devices and micro_batch; "
                    "do not pass it")
  per_device, rest = divmod(batch_size, devices)
  if rest:
    raise ValueError(f"batch_size {batch_size} does not split over {devices} devices")
  if micro_batch is not None and per_device % micro_batch:
    raise ValueError(f"batch_size {batch_size} over {devices} devices is {per_device} a "
                     f"device, not a multiple of micro_batch {micro_batch}")
  model = models.PRESETS[name]
  config = dataclasses.replace(model.config, remat=remat)
  if model.family is models.GPT:
    config = dataclasses.replace(config, seq_len=seq_len)
  model = dataclasses.replace(model, config=config)
  shapes = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0)))
  activations = functools.partial(model.activation_bytes, seq_len=seq_len)
  kw.update(devices=devices, layers=model.family.layers if kw.get("stage") == 3 else None)
  kw.setdefault("sliced_draws", False)  # from scratch: the initializer draws leaves whole
  why = ""
  if micro_batch is None:
    try:
      return pick_micro_batch(shapes, activations, global_batch=batch_size, **kw)
    except PlacementError:  # the batch in one micro-batch a device, and why not
      micro_batch, why = per_device, " (no micro-batch fits, not even 1)"
  # As jzo.train: with accumulation, the layers first where they fit, else their sums.
  accumulation, found = estimate_micro_batch(shapes, activations, micro_batch,
                                             grad_accum=per_device // micro_batch, **kw)
  return MicroBatch(micro_batch, per_device // micro_batch, accumulation, found,
                    batch_line(found.plan, micro_batch, devices) + why)


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
  """a preset of jzo.models (GPT-2 shapes, Llama, Mistral, Qwen, Phi, mixtures of experts, Gemma)"""
  devices: int = 1
  """GPUs on the data axis"""
  batch_size: int = 8
  """sequences per optimizer step, over all devices (the global batch)"""
  micro_batch: str = "auto"
  """sequences per device per forward/backward (the rest accumulated): auto or a number"""
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
  from_checkpoint: bool = False
  """the weights come from a checkpoint (jzo.train --init-from), which the build reads a slice of a large stacked leaf's layers at a time; from scratch the initializer draws each leaf whole"""
  checkpoints: bool = True
  """count the host RAM a checkpoint's save takes beside the state (as jzo.train does, unless --checkpoint-every 0)"""
  host_gb: float | None = None
  """GiB of host RAM (None: what this machine has available)"""
  device_gb: float | None = None
  """GiB of one device (None: this machine's accelerator, else 80)"""


def check_estimate_options(cfg: EstimateConfig) -> None:
  """Raises ValueError (UserError for --resident-layers and a --batch-size
  that does not split into --micro-batch over the devices, as jzo.train's)
  naming an option out of range; the engine's options are jzo.EngineOptions'
  to check, in `main`."""
  for name in ("devices", "batch_size", "seq_len"):
    if getattr(cfg, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
  if cfg.micro_batch != "auto" and not (cfg.micro_batch.isdigit() and int(cfg.micro_batch) > 0):
    raise ValueError(f"--micro-batch must be auto or a whole number >= 1, got "
                     f"{cfg.micro_batch!r}")
  for name in ("host_gb", "device_gb"):
    if getattr(cfg, name) is not None and not getattr(cfg, name) > 0:
      raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(cfg, name)}")
  check_resident_layers(cfg)
  per_device_batch(cfg, range(cfg.devices))  # jzo.train's refusal, in its words


def main(argv: list[str] | None = None) -> int:
  cfg = config_lib.parse(EstimateConfig, argv, description=__doc__,
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
        micro = None if cfg.micro_batch == "auto" else int(cfg.micro_batch)
        picked = estimate_model(cfg.model, batch_size=cfg.batch_size, micro_batch=micro,
                                seq_len=cfg.seq_len, remat=cfg.remat, devices=cfg.devices,
                                stage=cfg.stage, offload=offload, moments=cfg.moments,
                                precision=cfg.precision, delayed_update=cfg.delayed_update,
                                grads_in_params=cfg.grads_in_params,
                                offload_params=(("auto" if resident_count(cfg) is None else True)
                                                if cfg.offload_params else False),
                                resident_layers=resident_count(cfg),
                                overlap_forward=cfg.overlap_forward,
                                device_memory=gib(cfg.device_gb),
                                host_memory=gib(cfg.host_gb),
                                checkpoint_memory=SAVE_HOST_BYTES if cfg.checkpoints else 0,
                                sliced_draws=cfg.from_checkpoint)
      except ValueError as e:  # jzo.EngineOptions' and the plan's, told in this command's flags
        raise UserError(in_flags(str(e), fraction="--offload",
                                 no_offload="--offload false")) from e
      table = str(picked.estimate)
  except (ValueError, UserError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{cfg.model}, seq {cfg.seq_len}, remat {cfg.remat}, {cfg.moments} moments")
  print(picked.line + (" (--micro-batch)" if micro else ""))
  print(table)
  if cfg.offload_params and not picked.estimate.plan.offload_params:
    print(ALL_WEIGHTS_FIT)
  return 0 if picked.estimate.fits else 1


if __name__ == "__main__":
  sys.exit(main())
