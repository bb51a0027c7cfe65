"""The recipe's options (`python -m jzo.train --help`), their checks, and
the learning-rate schedule they give."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Literal

import optax

from jzo.models import gpt
from jzo.recipe import models

Preset = Literal[tuple(models.PRESETS)]


# What jzo.train and jzo.estimate print when --offload-params offloads nothing.
ALL_WEIGHTS_FIT = "--offload-params: the layers' weights all fit on the device; none is offloaded"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The recipe's options; the docstring under each field is its --help."""
  model: Preset | None = None
  """a preset of jzo.models (None: tiny, or the model of --init-from)"""
  init_from: str = ""
  """fine-tune a Hugging Face checkpoint: a local folder with config.json and *.safetensors"""
  tokenizer: str = ""
  """folder with the tokenizer.json to read --data with ('': --init-from's, else bytes)"""
  data: str = ""
  """'' (embedded corpus), text file or folder, .jsonl (text, prompt/completion, chat), or .bin"""
  vocab_size: int = 0
  """vocabulary of a .bin token file (0: the preset's)"""
  seq_len: int = 128
  """tokens per training sequence"""
  batch_size: int = 16
  """sequences per optimizer step, over all devices (the global batch)"""
  micro_batch: str = "auto"
  """sequences per device per forward/backward (the rest accumulated): auto or a number"""
  steps: int = 300
  """optimizer steps"""
  lr: float | None = None
  """peak learning rate, warm-up then cosine decay to a tenth (None: the model's own)"""
  warmup: int | None = None
  """warm-up steps (None: the model's, at most a tenth of --steps; with --init-from 3% of them)"""
  weight_decay: float = 0.1
  """AdamW weight decay"""
  max_grad_norm: float = 1.0
  """global gradient-norm clip"""
  stage: Literal[0, 1, 2, 3] = 2
  """ZeRO stage"""
  offload: bool = True
  """keep optimizer state in host RAM (ZeRO-Offload)"""
  offload_fraction: str = "auto"
  """with --offload, the host's share of the optimizer state: auto (what does not fit) or 0 to 1"""
  device_memory_gb: float = 0.0
  """GiB of one device's memory the placement may plan for (0: what its allocator reports)"""
  moments: Literal["fp32", "bf16", "int8"] = "fp32"
  """dtype of the Adam moments (bf16: half the memory; int8: a quarter, block-wise quantized, on the host)"""
  delayed_update: bool = False
  """offload: one-step delayed parameter update"""
  grads_in_params: bool = False
  """stage 3 + offload: each layer's gradient written over its weights (no room for both); with accumulation the layers run first (every micro-batch's forward, then each layer's backward over all of them, keeping every micro-batch's layer inputs) where that fits, else float32 sums of the layers on the GPU (4 B a parameter), the last micro-batch's written over the weights"""
  offload_params: bool = False
  """stage 3 + offload: the layers' weights in pinned host memory where the GPU needs it (always where the devices report no memory), fetched a layer at a time but for the first layers that still fit on the GPU (implies --grads-in-params)"""
  resident_layers: int = -1
  """with --offload-params: how many of the first layers keep their weights on the GPU as well, always offloading the rest (-1: the planner's choice)"""
  overlap_forward: bool = True
  """with --grads-in-params and the layers' weights on the GPU (one micro-batch, or the layers first): each step's forward overlaps the last host update, a layer at a time (--no-overlap-forward: the update first)"""
  precision: Literal["bf16", "fp16"] = "bf16"
  """compute precision"""
  devices: int = 0
  """devices to use (0: all)"""
  coordinator: str = ""
  """several processes: host:port of process 0 ('': $JAX_COORDINATOR_ADDRESS)"""
  num_processes: int = 0
  """several processes: how many (0: $JAX_NUM_PROCESSES, or JAX's cluster detection)"""
  process_id: int = -1
  """several processes: this one's number (-1: $JAX_PROCESS_ID, or JAX's cluster detection)"""
  seed: int = 0
  """seed of the initial weights and the batch order"""
  log_every: int = 25
  """steps between log lines"""
  eval_every: int = 100
  """steps between evaluations on the held-out split"""
  eval_batches: int = 4
  """batches per evaluation"""
  sample_tokens: int = 200
  """tokens of text to generate at the end"""
  remat: Literal[tuple(gpt.REMAT_POLICIES)] = "full"
  """what the backward pass recomputes: full (least memory), dots (keeps matmul outputs), none"""
  peak_tflops: float = 0.0
  """peak bf16 TFLOPS of one device, for MFU (0: measure a bf16 matmul on GPUs, none on CPU)"""
  checkpoint_every: int = 100
  """steps between checkpoints, and one at the end (0: none but on SIGINT or SIGTERM)"""
  keep_checkpoints: int = 2
  """complete checkpoints kept in --out (the disk holds one more while a save writes it)"""
  resume: bool = False
  """continue from the last complete checkpoint in --out that reads (refused if there is none)"""
  fresh_start_ok: bool = False
  """with --resume: start at step 0 when --out has no checkpoint yet, or only unreadable ones"""
  sample: bool = False
  """only generate --sample-tokens of text from the checkpoint in --out"""
  out: str = "runs/latest"
  """output folder (config.json, metrics.jsonl, loss.png, checkpoints/)"""


class UserError(Exception):
  """A mistake in the options or the data: reported without a traceback."""


def check(cfg: TrainConfig) -> None:
  """Refuses option values out of range (types and choices: the parser's;
  what depends on the model: `check_for_model`)."""
  for name in ("seq_len", "batch_size", "steps", "log_every", "eval_every", "eval_batches",
               "keep_checkpoints"):
    if getattr(cfg, name) < 1:
      raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
  for name in ("checkpoint_every", "devices", "vocab_size", "sample_tokens", "seed"):
    if getattr(cfg, name) < 0:
      raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
  for name in ("lr", "max_grad_norm"):
    value = getattr(cfg, name)
    if value is not None and not (math.isfinite(value) and value > 0):
      raise UserError(f"--{name.replace('_', '-')} must be a number > 0, got {value}")
  for name in ("weight_decay", "device_memory_gb", "peak_tflops"):
    if not (math.isfinite(getattr(cfg, name)) and getattr(cfg, name) >= 0):
      raise UserError(f"--{name.replace('_', '-')} must be a number >= 0, got "
                      f"{getattr(cfg, name)}")
  if cfg.offload_fraction != "auto":
    try:
      fraction = float(cfg.offload_fraction)
    except ValueError:
      fraction = -1.0
    if not 0.0 <= fraction <= 1.0:
      raise UserError(f"--offload-fraction must be auto or a number in [0, 1], got "
                      f"{cfg.offload_fraction!r}")
  if cfg.micro_batch != "auto" and not (cfg.micro_batch.isdigit() and int(cfg.micro_batch) > 0):
    raise UserError(f"--micro-batch must be auto or a whole number >= 1, got "
                    f"{cfg.micro_batch!r}")
  if cfg.warmup is not None and not 0 <= cfg.warmup < cfg.steps:
    raise UserError(f"--warmup must be in [0, --steps), got {cfg.warmup} with {cfg.steps} steps")
  if cfg.model is not None and cfg.init_from:
    raise UserError(f"--model {cfg.model} and --init-from {cfg.init_from}: give one (the "
                    "checkpoint's config.json names its model)")
  out = pathlib.Path(cfg.out)
  if out.exists() and not out.is_dir():
    raise UserError(f"--out {out} is a file, not a folder")
  if cfg.offload and cfg.stage == 0:
    raise UserError("--offload needs --stage 1, 2 or 3 (stage 0 replicates the optimizer "
                    "state; or add --no-offload)")
  if cfg.delayed_update and not cfg.offload:
    raise UserError("--delayed-update delays the host's update: it needs --offload")
  if cfg.moments == "int8" and not (cfg.offload and cfg.offload_fraction in ("auto", "1", "1.0")):
    raise UserError("--moments int8 keeps the moments in host memory: it needs --offload with "
                    f"--offload-fraction auto or 1 (got {'--no-offload' if not cfg.offload else '--offload-fraction ' + cfg.offload_fraction})")
  if cfg.grads_in_params or cfg.offload_params:
    _check_grads_in_params(cfg, "--offload-params" if cfg.offload_params else "--grads-in-params")
  check_resident_layers(cfg)
  if cfg.fresh_start_ok and not cfg.resume:
    raise UserError("--fresh-start-ok only applies with --resume")


def check_resident_layers(cfg) -> None:
  """--resident-layers: -1, or a count with --offload-params (jzo.train's
  and jzo.estimate's options)."""
  if cfg.resident_layers < -1:
    raise UserError(f"--resident-layers must be -1 (the planner's choice) or a count >= 0, "
                    f"got {cfg.resident_layers}")
  if cfg.resident_layers >= 0 and not cfg.offload_params:
    raise UserError("--resident-layers keeps layers of the weights in host memory on the GPU "
                    "as well: it needs --offload-params")


def resident_count(cfg) -> int | None:
  """The engine's resident_layers= from --resident-layers (None: the planner's)."""
  return cfg.resident_layers if cfg.resident_layers >= 0 else None


def _check_grads_in_params(cfg: TrainConfig, flag: str) -> None:
  if cfg.stage != 3:
    raise UserError(f"{flag} needs --stage 3 (the layers gathered one at a time), "
                    f"got --stage {cfg.stage}")
  if not cfg.offload:
    raise UserError(f"{flag} needs --offload (jzo's Adam, whose masters remake the weights "
                    "the gradients overwrote)")
  if cfg.offload_params and cfg.offload_fraction not in ("auto", "1", "1.0"):
    raise UserError(f"{flag} needs --offload-fraction auto or 1 (the host kernel updates the "
                    f"weights in host memory where they are), got {cfg.offload_fraction}")
  if cfg.delayed_update:
    raise UserError(f"{flag} cannot take --delayed-update: the next step needs the "
                    "weights the update writes back")


def check_for_model(cfg: TrainConfig, model: models.Model) -> None:
  """Refuses options the model cannot take."""
  if cfg.seq_len > model.max_seq_len:
    raise UserError(f"--seq-len {cfg.seq_len} is beyond {model.name}'s context of "
                    f"{model.max_seq_len} tokens")


def peak_lr(cfg: TrainConfig, model: models.Model) -> float:
  """--lr, by default the model's: its fine-tuning rate with --init-from."""
  if cfg.lr is not None:
    return cfg.lr
  return model.defaults.finetune_lr if cfg.init_from else model.defaults.lr


def warmup_steps(cfg: TrainConfig, model: models.Model) -> int:
  """--warmup, by default 3% of the steps fine-tuning, else the model's
  published warm-up in this run's tokens, at most a tenth of the steps."""
  if cfg.warmup is not None:
    return cfg.warmup
  if cfg.init_from:
    return math.ceil(models.FINETUNE_WARMUP_FRACTION * cfg.steps)
  if model.defaults.warmup_tokens is None:
    return cfg.steps // 10
  published = math.ceil(model.defaults.warmup_tokens / (cfg.batch_size * cfg.seq_len))
  return min(published, cfg.steps // 10)


def lr_schedule(cfg: TrainConfig, model: models.Model) -> optax.Schedule:
  """Linear warm-up from 0, then cosine decay to a tenth of the peak at the last step."""
  lr = peak_lr(cfg, model)
  return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps(cfg, model), cfg.steps,
                                            end_value=0.1 * lr)
