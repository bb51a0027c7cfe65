"""The recipe's options (`python -m jzo.train --help`), their checks, the
engine options they give (checked by jzo.EngineOptions, whose errors are told
in flags), and the learning-rate schedule."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib
import re
from typing import Literal

import jax.numpy as jnp
import optax

import jzo
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
  """'' (embedded corpus), text file or folder, .jsonl (text, prompt/completion, chat), .parquet or .arrow (the same forms, as columns), or .bin"""
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
  """warm-up steps W (update k takes k/W of the peak), which may outlast the run (None: from scratch the model's published warm-up, at most a tenth of --steps but at least 3000, the tiny demo's a tenth; with --init-from 3% of them, at least 20 or half of a shorter run)"""
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
  deterministic: bool = False
  """GPU runs bitwise equal run to run on one machine and GPU count (XLA's deterministic GPU operations, no autotuning: slower, see docs/performance.md); CPU runs are so without it"""
  log_every: int = 25
  """steps between log lines"""
  tensorboard: bool = False
  """also write metrics.jsonl's numbers as TensorBoard event files in --out/tensorboard (needs the tensorboard package: pip install 'jzo[tensorboard]')"""
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
  """only generate --sample-tokens of text from the checkpoint in --out, with the run's own
  options (python -m jzo.generate --run talks to it)"""
  out: str = "runs/latest"
  """output folder (config.json, metrics.jsonl, loss.png, checkpoints/)"""
  export: str = ""
  """a new or empty folder for the trained weights, written at the end as a Hugging Face folder
  (bfloat16) from the live state, no checkpoint needed (one process)"""


class UserError(Exception):
  """A mistake in the options or the data: reported without a traceback."""


def check(cfg: TrainConfig) -> None:
  """Refuses option values out of range (types and choices: the parser's;
  what depends on the model, the engine's options included: `check_for_model`)."""
  for name in ("seq_len", "batch_size", "steps", "log_every", "eval_every", "eval_batches",
               "keep_checkpoints"):
    if getattr(cfg, name) < 1:
      raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
  for name in ("checkpoint_every", "devices", "vocab_size", "sample_tokens", "seed"):
    if getattr(cfg, name) < 0:
      raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
  if cfg.lr is not None and not (math.isfinite(cfg.lr) and cfg.lr > 0):
    raise UserError(f"--lr must be a number > 0, got {cfg.lr}")
  for name in ("weight_decay", "device_memory_gb", "peak_tflops"):
    if not (math.isfinite(getattr(cfg, name)) and getattr(cfg, name) >= 0):
      raise UserError(f"--{name.replace('_', '-')} must be a number >= 0, got "
                      f"{getattr(cfg, name)}")
  if cfg.offload_fraction != "auto":
    try:
      float(cfg.offload_fraction)  # its range: jzo.EngineOptions'
    except ValueError:
      raise UserError(f"--offload-fraction must be auto or a number in [0, 1], got "
                      f"{cfg.offload_fraction!r}") from None
  if cfg.micro_batch != "auto" and not (cfg.micro_batch.isdigit() and int(cfg.micro_batch) > 0):
    raise UserError(f"--micro-batch must be auto or a whole number >= 1, got "
                    f"{cfg.micro_batch!r}")
  if cfg.warmup is not None and cfg.warmup < 0:
    raise UserError(f"--warmup must be >= 0, got {cfg.warmup}")
  if cfg.model is not None and cfg.init_from:
    raise UserError(f"--model {cfg.model} and --init-from {cfg.init_from}: give one (the "
                    "checkpoint's config.json names its model)")
  out = pathlib.Path(cfg.out)
  if out.exists() and not out.is_dir():
    raise UserError(f"--out {out} is a file, not a folder")
  if cfg.moments == "int8" and not (cfg.offload and cfg.offload_fraction in ("auto", "1", "1.0")):
    raise UserError("--moments int8 keeps the moments in host memory: it needs --offload with "
                    f"--offload-fraction auto or 1 (got {'--no-offload' if not cfg.offload else '--offload-fraction ' + cfg.offload_fraction})")
  check_resident_layers(cfg)
  if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
    raise UserError("--tensorboard writes with the tensorboard package, which is not installed: "
                    "pip install 'jzo[tensorboard]' (or pip install tensorboard)")
  if cfg.export and cfg.sample:
    raise UserError("--export writes the weights a run trains, and --sample trains none: "
                    "python -m jzo.export writes a checkpoint's")
  export = pathlib.Path(cfg.export) if cfg.export else None
  if export and export.exists() and (not export.is_dir() or any(export.iterdir())):
    raise UserError(f"--export {export} is {'a file' if not export.is_dir() else 'not empty'}: "
                    "give a new or empty folder")
  if cfg.fresh_start_ok and not cfg.resume:
    raise UserError("--fresh-start-ok only applies with --resume")


def check_resident_layers(cfg) -> None:
  """--resident-layers: -1 or a count (jzo.train's and jzo.estimate's
  options; the rest, as jzo.EngineOptions' resident_layers)."""
  if cfg.resident_layers < -1:
    raise UserError(f"--resident-layers must be -1 (the planner's choice) or a count >= 0, "
                    f"got {cfg.resident_layers}")


def resident_count(cfg) -> int | None:
  """The engine's resident_layers= from --resident-layers (None: the planner's)."""
  return cfg.resident_layers if cfg.resident_layers >= 0 else None


def check_for_model(cfg: TrainConfig, model: models.Model) -> None:
  """Refuses options the model cannot take, and engine options that
  jzo.EngineOptions refuses (`engine_options`)."""
  if cfg.seq_len > model.max_seq_len:
    raise UserError(f"--seq-len {cfg.seq_len} is beyond {model.name}'s context of "
                    f"{model.max_seq_len} tokens")
  engine_options(cfg, model.family.layers)


def offload_placement(cfg: TrainConfig, memory_known: bool = True) -> bool | float | str:
  """The engine's offload= from --offload and --offload-fraction: "auto"
  where the devices' memory is known (they report it, or --device-memory-gb
  gives it), all on the host where not (CPUs share the host's memory)."""
  if not cfg.offload:
    return False
  if cfg.offload_params and cfg.offload_fraction == "auto":
    return True  # the host kernel updates the weights in host memory where they are
  if cfg.offload_fraction == "auto":
    return "auto" if memory_known else True
  return float(cfg.offload_fraction)


def weights_placement(cfg: TrainConfig, memory_known: bool = True) -> bool | str:
  """The engine's offload_params= from --offload-params: "auto" (the
  layers' weights in host memory where the devices need it, the first
  layers that fit resident on them) where the devices' memory is known,
  True where not (CPUs share the host's memory) or --resident-layers sets
  the count."""
  if not cfg.offload_params:
    return False
  return "auto" if resident_count(cfg) is None and memory_known else True


def engine_options(cfg: TrainConfig, layers: str, *, memory_known: bool = True,
                   grad_accum: int = 1, accumulation: str = "auto") -> jzo.EngineOptions:
  """The run's jzo.EngineOptions, checked by it.

  Args:
    layers: the model family's stacked layers (ZeroEngine's layers=, at --stage 3).
    memory_known: whether the devices' memory is known (`offload_placement`);
      either way the same options pass.
    grad_accum, accumulation: as jzo.EngineOptions'.

  Raises:
    UserError: an option EngineOptions refuses, its error told in flags
      (`in_flags`).
  """
  try:
    return jzo.EngineOptions(
        stage=cfg.stage, compute_dtype=jnp.bfloat16 if cfg.precision == "bf16" else jnp.float16,
        grad_accum=grad_accum, max_grad_norm=cfg.max_grad_norm,
        offload=offload_placement(cfg, memory_known), delayed_update=cfg.delayed_update,
        grads_in_params=cfg.grads_in_params,
        offload_params=weights_placement(cfg, memory_known),
        resident_layers=resident_count(cfg), layers=layers if cfg.stage == 3 else None,
        overlap_forward=cfg.overlap_forward, accumulation=accumulation,
        deterministic=cfg.deterministic)
  except ValueError as e:
    raise UserError(in_flags(str(e))) from e


# Phrases of jzo.EngineOptions' errors said otherwise in flags, replaced
# before the options' names: the recipe gives layers= itself, and the
# planner picks the resident layers unless --resident-layers says.
_PHRASES = {"offload=True, a fraction or 'auto'": "offload=True", "ZeRO stage": "--stage",
            " and layers=": "", " (offload_params='auto' chooses them), got False": "",
            "cannot delay the update": "cannot take --delayed-update"}
# The engine's options that flags of the same name set.
_NAMES = sorted({f.name for f in dataclasses.fields(jzo.EngineOptions)}
                & {f.name for f in dataclasses.fields(TrainConfig)})
# An option's name with its value, or bare: first in the message, or
# anywhere when it has an underscore ("offload" and "stage" are words too).
_OPTION = re.compile(rf"(?<![\w.-])(?:({'|'.join(_NAMES)})=('[^']*'|[\w.]+)|"
                     rf"^({'|'.join(_NAMES)})\b|({'|'.join(n for n in _NAMES if '_' in n)})\b)")


def in_flags(message: str, *, fraction: str = "--offload-fraction",
             no_offload: str = "--no-offload") -> str:
  """A jzo.EngineOptions error in the command line's words: each option it
  names (`name`, or `name=value`) as the flag that sets it, e.g.
  "grads_in_params needs offload=True" as "--grads-in-params needs
  --offload". fraction: the flag that takes offload's fraction; no_offload:
  the flags of offload=False."""
  for phrase, said in _PHRASES.items():
    message = message.replace(phrase, said)
  message = message.replace("offload fraction", fraction)

  def flag(match: re.Match) -> str:
    if match[1]:
      name, value = match[1], match[2].strip("'")
    else:
      name, value = match[3] or match[4], "True"
    said = "--" + name.replace("_", "-")
    if value == "False":
      return no_offload if name == "offload" else "--no-" + said[2:]
    if value == "True":
      return said
    return f"{fraction if name == 'offload' else said} {value}"
  return _OPTION.sub(flag, message)


def peak_lr(cfg: TrainConfig, model: models.Model) -> float:
  """--lr, by default the model's: its fine-tuning rate with --init-from."""
  if cfg.lr is not None:
    return cfg.lr
  return model.defaults.finetune_lr if cfg.init_from else model.defaults.lr


# Training from scratch, the fewest warm-up steps a run takes unless
# --warmup says, where the model's published warm-up is longer, even past
# the run's end: Adam's first updates move every weight by about the
# learning rate at once, and a large model's loss leaps. gpt2-20b (peak
# 1e-4) over 1000 steps rose from 11.6 to 12.8 at step 5, after updates of
# 1e-7 to 3e-7; over 3000, gpt2-10b and gpt2-20b stay under their first
# loss for 20 steps and reach 4.3 by step 20 (docs/results.md).
WARMUP_FLOOR = 3000
# Fine-tuning, the fewest warm-up steps (or half of a shorter run).
FINETUNE_WARMUP_FLOOR = 20


def warmup_steps(cfg: TrainConfig, model: models.Model) -> int:
  """--warmup; by default, fine-tuning, 3% of the steps, at least
  FINETUNE_WARMUP_FLOOR or half of a shorter run; from scratch the model's
  published warm-up in this run's tokens, at most a tenth of the steps but
  at least WARMUP_FLOOR (a shorter run ends inside its warm-up)."""
  if cfg.warmup is not None:
    return cfg.warmup
  if cfg.init_from:
    return max(math.ceil(models.FINETUNE_WARMUP_FRACTION * cfg.steps),
               min(FINETUNE_WARMUP_FLOOR, cfg.steps // 2))
  if model.defaults.warmup_tokens is None:
    return cfg.steps // 10
  published = math.ceil(model.defaults.warmup_tokens / (cfg.batch_size * cfg.seq_len))
  return min(published, max(cfg.steps // 10, WARMUP_FLOOR))


def warmup_line(cfg: TrainConfig, model: models.Model) -> str:
  """What the run's learning rate does, in one line."""
  lr, warmup = peak_lr(cfg, model), warmup_steps(cfg, model)
  if warmup < cfg.steps:
    start = f"{warmup} warm-up steps to {lr:.2g}" if warmup else f"{lr:.2g} from the first step"
    return f"learning rate: {start}, then a cosine decay to {0.1 * lr:.2g}"
  return (f"learning rate: the run ends inside its {warmup}-step warm-up, at "
          f"{lr * cfg.steps / warmup:.2g} (peak {lr:.2g}; --warmup sets the warm-up)")


def lr_schedule(cfg: TrainConfig, model: models.Model) -> optax.Schedule:
  """The learning rate of each update, by its count from 0: a linear warm-up
  over W steps in which update k (from 1) takes peak * k / W, so that none is
  spent at a rate of 0, then a cosine decay from the peak at update W to a
  tenth of it at the run's last update. A run that ends inside its warm-up
  never decays; with W = 0 the first update takes the peak."""
  peak, warmup = peak_lr(cfg, model), warmup_steps(cfg, model)
  end = 0.1 * peak
  decay_from = max(warmup - 1, 0)  # the count of the first update at the peak
  decay_steps = max(cfg.steps - 1 - decay_from, 1)

  def schedule(count):
    count = jnp.asarray(count, jnp.float32)
    warming = peak * (count + 1) / max(warmup, 1)
    progress = jnp.clip((count - decay_from) / decay_steps, 0.0, 1.0)
    decaying = end + (peak - end) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    return jnp.where(count < decay_from, warming, decaying)

  return schedule
