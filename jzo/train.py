"""`python -m jzo.train`: train a GPT with jzo's ZeRO engine.

With no arguments it trains the `tiny` preset on the embedded corpus (the
standard library's Python sources, byte-level) with the optimizer offloaded
to the host, on every local device, for a few hundred steps (minutes on a
laptop CPU), then prints a sample of generated text. `--help` lists every
option with its default.

Each log line reports model TFLOPS = tokens/s x (6 N + 12 L D T) (PaLM,
Chowdhery et al. 2022, appendix B) and MFU = that over the devices' peak
bf16 rate: `--peak-tflops` per device, or on GPUs the bf16 matmul rate
measured at start-up (the ceiling a JAX program can reach there).

SIGINT (Ctrl-C) or SIGTERM finishes the step in flight, writes a checkpoint
and exits with status 130 or 143, naming it; the same signal again exits at
once. `--resume` continues from the last checkpoint that reads, bit for bit.

Several processes (one per host, or per accelerator) run the same command
with --coordinator, --num-processes and --process-id (or JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID, or JZO_DISTRIBUTED=auto under Slurm, Open
MPI or a TPU pod; jzo.distributed): each feeds its devices' rows of every
batch and writes its shards of each checkpoint; process 0 alone prints, logs
and plots.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import re
import shutil
import signal
import sys
import threading
import time
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
import tqdm
from jax.experimental import multihost_utils
from jax.sharding import Mesh

import jzo
from jzo import checkpoint
from jzo import config as config_lib
from jzo import data as data_lib
from jzo import distributed
from jzo.models import gpt


Preset = Literal[tuple(gpt.PRESETS)]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The recipe's options; the docstring under each field is its --help."""
  model: Preset = "tiny"
  """preset of jzo/models/gpt.py"""
  data: str = ""
  """'' (the embedded corpus), a text file or folder, or a .bin of uint16 tokens (--vocab-size)"""
  vocab_size: int = 0
  """vocabulary of a .bin token file (0: the preset's)"""
  seq_len: int = 128
  """tokens per training sequence"""
  batch_size: int = 16
  """sequences per micro-batch, over all devices"""
  grad_accum: int = 1
  """micro-batches per optimizer step"""
  steps: int = 300
  """optimizer steps"""
  lr: float = 3e-3
  """peak learning rate (linear warm-up, cosine decay to a tenth of it)"""
  warmup: int | None = None
  """warm-up steps (None: a tenth of --steps)"""
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
  moments: Literal["fp32", "bf16"] = "fp32"
  """dtype of the Adam moments (bf16: half the memory)"""
  delayed_update: bool = False
  """offload: one-step delayed parameter update"""
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
  """Refuses option values out of range (types and choices: the parser's)."""
  for name in ("seq_len", "batch_size", "grad_accum", "steps", "log_every", "eval_every",
               "eval_batches"):
    if getattr(cfg, name) < 1:
      raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
  for name in ("checkpoint_every", "devices", "vocab_size", "sample_tokens", "seed"):
    if getattr(cfg, name) < 0:
      raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
  for name in ("lr", "max_grad_norm"):
    if not (math.isfinite(getattr(cfg, name)) and getattr(cfg, name) > 0):
      raise UserError(f"--{name.replace('_', '-')} must be a number > 0, got {getattr(cfg, name)}")
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
  if cfg.warmup is not None and not 0 <= cfg.warmup < cfg.steps:
    raise UserError(f"--warmup must be in [0, --steps), got {cfg.warmup} with {cfg.steps} steps")
  if cfg.seq_len > gpt.PRESETS[cfg.model].seq_len:
    raise UserError(f"--seq-len {cfg.seq_len} is beyond {cfg.model}'s context of "
                    f"{gpt.PRESETS[cfg.model].seq_len} tokens")
  out = pathlib.Path(cfg.out)
  if out.exists() and not out.is_dir():
    raise UserError(f"--out {out} is a file, not a folder")
  if cfg.offload and cfg.stage == 0:
    raise UserError("--offload needs --stage 1, 2 or 3 (stage 0 replicates the optimizer "
                    "state; or add --no-offload)")
  if cfg.delayed_update and not cfg.offload:
    raise UserError("--delayed-update delays the host's update: it needs --offload")
  if cfg.fresh_start_ok and not cfg.resume:
    raise UserError("--fresh-start-ok only applies with --resume")


def warmup_steps(cfg: TrainConfig) -> int:
  """--warmup, by default a tenth of the steps."""
  return cfg.steps // 10 if cfg.warmup is None else cfg.warmup


def own_device(devices) -> jax.Device:
  """This process's first device among `devices` (where it can measure and query)."""
  return next(d for d in devices if d.process_index == jax.process_index())


def pick_devices(cfg: TrainConfig) -> list:
  """The first --devices devices (all for 0; with several processes,
  process by process); refuses more than there are."""
  devices = list(distributed.default_mesh("data").devices.flat)
  if cfg.devices > len(devices):
    raise UserError(f"--devices {cfg.devices}: this machine has {len(devices)} "
                    f"{devices[0].platform} device(s)")
  return devices[:cfg.devices or None]


@dataclasses.dataclass(frozen=True)
class Data:
  """The run's token streams and batches.

  Attributes:
    n_tokens: tokens in the whole stream (training and held-out).
    vocab: vocabulary the data needs (256 for byte-level text).
    batches: training batches, int32 (batch_size * grad_accum, seq_len + 1).
    val: held-out batches, int32 (batch_size, seq_len + 1).
    val_tokens: the held-out stream (the sample's prompt comes from it).
  """
  n_tokens: int
  vocab: int
  batches: data_lib.Batches
  val: data_lib.Batches
  val_tokens: np.ndarray


def load_tokens(cfg: TrainConfig, model_vocab: int) -> tuple[np.ndarray, int]:
  """Token stream and vocabulary size for the chosen data."""
  if not cfg.data:
    return data_lib.embedded_corpus(), data_lib.BYTE_VOCAB
  if cfg.data.endswith(".bin"):
    vocab = cfg.vocab_size or model_vocab
    return data_lib.read_tokens(cfg.data, vocab), vocab
  return data_lib.read_text(cfg.data), data_lib.BYTE_VOCAB


def load_data(cfg: TrainConfig, devices) -> Data:
  """Reads the data, holds out its end, and checks that a batch splits over `devices`."""
  try:
    tokens, vocab = load_tokens(cfg, gpt.PRESETS[cfg.model].vocab_size)
  except ValueError as e:
    raise UserError(str(e)) from e
  if cfg.batch_size % len(devices):
    raise UserError(f"--batch-size {cfg.batch_size} does not split over {len(devices)} devices")
  train_tokens, val_tokens = data_lib.train_val_split(tokens)
  try:
    batches = data_lib.Batches(train_tokens, cfg.batch_size * cfg.grad_accum, cfg.seq_len,
                               cfg.seed)
    val = data_lib.Batches(val_tokens, cfg.batch_size, cfg.seq_len, cfg.seed + 1)
  except ValueError as e:
    raise UserError(str(e)) from e
  return Data(len(tokens), vocab, batches, val, val_tokens)


def model_config(cfg: TrainConfig, vocab: int) -> gpt.GPTConfig:
  """The preset with the run's context, remat policy and (where it is the data's) vocabulary."""
  preset = gpt.PRESETS[cfg.model]
  # tiny and token files take the data's vocabulary, padded to a multiple of 128.
  own_vocab = cfg.model == "tiny" or cfg.data.endswith(".bin")
  model = dataclasses.replace(preset, seq_len=cfg.seq_len, remat=cfg.remat,
                              vocab_size=-(-vocab // 128) * 128 if own_vocab else preset.vocab_size)
  if vocab > model.vocab_size:
    raise UserError(f"the data needs a vocabulary of {vocab}, {cfg.model} has {model.vocab_size}")
  return model


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup_steps(cfg), cfg.steps,
                                            end_value=0.1 * cfg.lr)


def placement(cfg: TrainConfig, devices) -> bool | float | str:
  """The engine's offload= from --offload and --offload-fraction: "auto"
  where the devices report their memory, all on the host where they do not
  (CPUs share the host's memory)."""
  if not cfg.offload:
    return False
  if cfg.offload_fraction == "auto":
    return "auto" if jzo.plan.device_memory_limit(own_device(devices)) else True
  return float(cfg.offload_fraction)


def cap_pinned_pool(cfg: TrainConfig) -> None:
  """Caps XLA's pinned host pool at what the landing buffers can hold at
  most, every parameter's gradient in the 2-byte compute dtype, so that it
  does not round them up to a power of two (jzo.plan.limit_pinned_pool)."""
  jzo.plan.limit_pinned_pool(2 * gpt.PRESETS[cfg.model].n_params)


def make_engine(cfg: TrainConfig, model: gpt.GPTConfig, devices) -> jzo.ZeroEngine:
  # A function, not arrays: the engine checks its plan fits from the shapes,
  # then draws the float32 weights one leaf at a time in host memory.
  init = functools.partial(gpt.init_params, model, jax.random.PRNGKey(cfg.seed))
  # Weight decay on the embeddings and weight matrices, not on biases and
  # LayerNorm parameters.
  mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: path[-1].key in ("wte", "wpe", "kernel"), params)
  moments = jnp.bfloat16 if cfg.moments == "bf16" else None
  tx = jzo.cpu_adamw(lr_schedule(cfg), b2=0.95, weight_decay=cfg.weight_decay, mask=mask,
                     mu_dtype=moments, nu_dtype=moments)
  return jzo.ZeroEngine(
      functools.partial(gpt.loss_fn, model), init, tx,
      mesh=Mesh(np.array(devices), ("data",)), stage=cfg.stage,
      compute_dtype=jnp.bfloat16 if cfg.precision == "bf16" else jnp.float16,
      grad_accum=cfg.grad_accum, max_grad_norm=cfg.max_grad_norm,
      offload=placement(cfg, devices), delayed_update=cfg.delayed_update,
      layers="blocks" if cfg.stage == 3 else None,
      activation_memory=gpt.activation_bytes(model, cfg.batch_size // len(devices), cfg.seq_len),
      device_memory=int(cfg.device_memory_gb * 2**30) or None)


def build_engine(cfg: TrainConfig, model: gpt.GPTConfig, devices) -> jzo.ZeroEngine:
  """`make_engine`, its refusals (a plan that does not fit: before any
  weight is drawn) as UserErrors."""
  try:
    return make_engine(cfg, model, devices)
  except (ValueError, TypeError, MemoryError) as e:
    raise UserError(str(e)) from e


@functools.cache
def _loss(model: gpt.GPTConfig):
  """The jitted loss of one model, compiled once per run."""
  return jax.jit(functools.partial(gpt.loss_fn, model))


def evaluate(model: gpt.GPTConfig, params, batches: data_lib.Batches, n: int) -> float:
  """Mean loss of n held-out batches with `params` (see eval_params)."""
  return float(np.mean([_loss(model)(params, {"tokens": batches[i]}) for i in range(n)]))


class Throughput:
  """Training speed over the steps since the last log line, from the steps'
  own seconds (so evaluations and checkpoint writes between them do not count).

  Attributes:
    peak: bf16 TFLOPS of all the devices together, for MFU (0: unknown).
  """

  def __init__(self, cfg: TrainConfig, model: gpt.GPTConfig, peak: float):
    self.tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
    self.flops_per_step = self.tokens_per_step * model.flops_per_token()
    self.peak = peak
    self._steps, self._seconds = 0, 0.0

  def add(self, seconds: float) -> None:
    """Counts one optimizer step that took `seconds`."""
    self._steps += 1
    self._seconds += seconds

  def rates(self) -> dict:
    """Tokens/s, model TFLOPS (and MFU) of the steps counted since the last call."""
    tokens_per_s = self.tokens_per_step * self._steps / self._seconds
    tflops = self.flops_per_step * self._steps / self._seconds / 1e12
    self._steps, self._seconds = 0, 0.0
    out = {"tokens_per_s": tokens_per_s, "model_tflops": tflops}
    if self.peak:
      out["mfu"] = tflops / self.peak
    return out


def step_record(step: int, metrics: jzo.StepMetrics, lr: float) -> dict:
  """One metrics.jsonl entry after `step` optimizer steps (reading it waits for the step)."""
  return {"step": step, "loss": float(metrics.loss), "lr": lr,
          "grad_norm": float(metrics.grad_norm), "loss_scale": float(metrics.loss_scale),
          "skipped": bool(metrics.skipped)}


def log_line(record: dict) -> str:
  """The printed form of a log step's record (with its rates and evaluation, if any)."""
  return (f"step {record['step']}: loss {record['loss']:.4f}"
          + (f", eval {record['eval_loss']:.4f}" if "eval_loss" in record else "")
          + f", lr {record['lr']:.2e}, {record['tokens_per_s']:,.0f} tokens/s, "
          f"{record['model_tflops']:.3f} TFLOPS"
          + (f", MFU {record['mfu']:.1%}" if "mfu" in record else "") + f", {memory_line()}")


def memory_line() -> str:
  host = psutil.Process().memory_info().rss / 2**30
  stats = jax.local_devices()[0].memory_stats() or {}
  device = stats.get("peak_bytes_in_use")
  return f"host {host:.1f} GiB" + (f", device {device / 2**30:.1f} GiB" if device else "")


def plot(history: list[dict], path: pathlib.Path) -> None:
  # A Figure of its own, not pyplot's: no backend chosen or changed (a
  # notebook that runs the recipe keeps its inline plots).
  from matplotlib.figure import Figure
  fig = Figure(figsize=(6, 4))
  ax = fig.subplots()
  train = [(h["step"], h["loss"]) for h in history if "loss" in h]
  evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
  ax.plot(*zip(*train), label="train")
  if evals:
    ax.plot(*zip(*evals), "o-", label="held out")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


# Options a resumed run must share with the saved one: they fix the state's
# shapes, the optimizer's layout or the batch order. Others (steps, learning
# rate, logging) may change.
RUN_KEYS = ("model", "data", "seq_len", "batch_size", "grad_accum", "seed", "stage", "offload",
            "precision")


def check_same_run(cfg: TrainConfig, out: pathlib.Path) -> None:
  """Refuses to continue the run in `out` (its config.json) with other RUN_KEYS."""
  saved_cfg = json.loads((out / "config.json").read_text())
  for key in RUN_KEYS:
    if saved_cfg.get(key) != getattr(cfg, key):
      raise UserError(f"checkpoint in {out} was made with --{key.replace('_', '-')} "
                      f"{saved_cfg.get(key)!r}, not {getattr(cfg, key)!r}")


def restore_run(manager, engine: jzo.ZeroEngine, cfg: TrainConfig, out: pathlib.Path) -> int:
  """Loads the run's last complete checkpoint that reads into `engine`;
  returns its step (0: none, or with --resume --fresh-start-ok none readable).

  An unreadable checkpoint (damaged files) is passed over for an earlier
  one, with a warning; to train on, the passed-over ones move to
  `damaged_folder(out)` (later saves would collide with their steps).
  Refused when none reads, unless --fresh-start-ok; nothing is moved then.
  `manager` is `checkpoint.open_manager(out / "checkpoints")`.
  """
  if manager.latest_step() is None:
    return 0
  check_same_run(cfg, out)  # first: it names the option, where the engine sees only shapes
  try:
    step, unreadable = checkpoint.restore_readable(manager, engine)
  except checkpoint.CheckpointError as e:  # one of another model
    raise UserError(str(e)) from e
  folder = out.absolute() / "checkpoints"
  if step is None and not (cfg.resume and cfg.fresh_start_ok):
    flag = "--sample" if cfg.sample else "--resume"
    hint = "" if cfg.sample else (f" (to start at step 0, with them moved to "
                                  f"{damaged_folder(out)}, add --fresh-start-ok)")
    raise UserError(f"{flag}: no checkpoint can be read: " + "; ".join(map(str, unreadable))
                    + hint)
  primary = distributed.is_primary()  # the one that moves folders and prints
  for e in unreadable:
    if cfg.sample and primary:
      print(f"warning: {e}", file=sys.stderr)
    elif primary:
      print(f"warning: {e}; moved to {set_aside(out, e.step)}", file=sys.stderr)
  if unreadable and not cfg.sample:
    barrier("jzo: unreadable checkpoints set aside")
    manager.reload()
  if step is None:
    if primary:
      print(f"--resume: no checkpoint in {folder} can be read: starting at step 0")
    return 0
  if primary:
    print(f"{'sampling' if cfg.sample else 'resuming'} from checkpoint {step} in {folder}")
  return step


def damaged_folder(out: pathlib.Path) -> pathlib.Path:
  """Where unreadable checkpoints go when a run trains on without them."""
  return out.absolute() / "checkpoints-unreadable"


def set_aside(out: pathlib.Path, step: int) -> pathlib.Path:
  """Moves checkpoint `step` into `damaged_folder(out)`; returns where it went."""
  aside, n = damaged_folder(out) / str(step), 1
  while aside.exists():  # the same step unreadable again
    n += 1
    aside = damaged_folder(out) / f"{step}-{n}"
  aside.parent.mkdir(exist_ok=True)
  shutil.move(out / "checkpoints" / str(step), aside)
  return aside


def remove_partial_checkpoints(out: pathlib.Path) -> None:
  """Deletes what a run stopped while writing a checkpoint left: orbax's
  temporary folders, never read (a checkpoint is renamed into place whole),
  but as large as a checkpoint each."""
  partial = sorted((out / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
  for path in partial:
    shutil.rmtree(path)
  if partial:
    print(f"removed {len(partial)} unfinished checkpoint(s) of a run stopped while writing: "
          + ", ".join(p.name for p in partial))


def latest_checkpoint(out: pathlib.Path) -> int | None:
  """The step of the last complete checkpoint in `out`, None if none (creating nothing)."""
  if not (out / "checkpoints").is_dir():
    return None
  with checkpoint.open_manager(out / "checkpoints") as manager:
    return manager.latest_step()


def check_checkpoint_to_continue(cfg: TrainConfig, out: pathlib.Path) -> None:
  """Refuses --resume and --sample with no complete checkpoint in `out`
  (--resume --fresh-start-ok starts at step 0 instead, and says so), before
  anything is built or written: a typo in --out must cost neither the
  engine's build nor a run from scratch."""
  if not (cfg.resume or cfg.sample) or latest_checkpoint(out) is not None:
    return
  where = out.absolute() / "checkpoints"
  if cfg.sample:
    raise UserError(f"--sample: no complete checkpoint in {where}")
  if not cfg.fresh_start_ok:
    raise UserError(f"--resume: no complete checkpoint in {where} (to start at step 0 then, "
                    "add --fresh-start-ok)")
  print(f"--resume: no checkpoint in {where} yet: starting at step 0")


def check_no_earlier_run(cfg: TrainConfig, out: pathlib.Path) -> None:
  """Refuses a new run (no --resume or --sample) in a folder holding a run's
  log or checkpoints: it would replace the log, then fail at its first
  checkpoint behind the earlier run's latest."""
  if cfg.resume or cfg.sample:
    return
  held = [name for name in ("metrics.jsonl", "checkpoints")
          if (out / name).is_file() or any((out / name).glob("*"))]
  if held:
    raise UserError(f"--out {out.absolute()} holds an earlier run ({', '.join(held)}): "
                    "--resume continues it; a new run needs another --out")


def start_log(cfg: TrainConfig, out: pathlib.Path, first: int) -> list[dict]:
  """Writes config.json and metrics.jsonl as of step `first`; returns the log so far.

  The log keeps its lines up to the checkpoint (the train loop writes a
  step's line before the step's checkpoint, so they are all there) and
  drops the later ones, which the run writes again; a last line cut short
  by a kill is dropped with them. Both files are replaced whole, so a kill
  here leaves the old ones.
  """
  write_whole(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
  history = []
  if first and (out / "metrics.jsonl").exists():
    for line in (out / "metrics.jsonl").read_text().splitlines():
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue  # cut short: a step after the checkpoint's
      if record["step"] <= first:
        history.append(record)
  write_whole(out / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))
  return history


def write_whole(path: pathlib.Path, text: str) -> None:
  """Replaces `path` with `text` in one rename: the file is the old or the new, never half."""
  part = path.with_name(path.name + ".part")
  part.write_text(text)
  os.replace(part, path)


def print_sample(model: gpt.GPTConfig, params, val_tokens: np.ndarray, cfg: TrainConfig):
  """Generates from a prompt taken from the held-out split (byte-level text)."""
  prompt = val_tokens[:32]
  text = gpt.generate(model, params, prompt, cfg.sample_tokens, jax.random.PRNGKey(cfg.seed))
  print("\n--- sample (prompt from the held-out split) ---\n"
        + bytes(np.asarray(prompt, np.uint8)).decode("utf-8", "replace")
        + bytes(text.astype(np.uint8)).decode("utf-8", "replace"))


def matmul_tflops(device, n: int = 8192, repeats: int = 20) -> float:
  """Measured bf16 TFLOPS of an n x n x n matmul on `device` (warm, median of 3)."""
  a = jax.device_put(jnp.ones((n, n), jnp.bfloat16), device)

  @jax.jit
  def chain(a):  # `repeats` dependent matmuls in one dispatch
    return jax.lax.fori_loop(0, repeats, lambda _, x: (x @ a) * 1e-4, a)
  chain(a).block_until_ready()
  times = []
  for _ in range(3):
    start = time.perf_counter()
    chain(a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 * repeats / sorted(times)[1] / 1e12


def peak_tflops(cfg: TrainConfig, devices) -> float:
  """Peak bf16 TFLOPS of one device for MFU: --peak-tflops, else measured on a GPU, else 0."""
  if cfg.peak_tflops or devices[0].platform != "gpu":
    return cfg.peak_tflops
  return matmul_tflops(own_device(devices))


def banner(cfg: TrainConfig, model: gpt.GPTConfig, data: Data, devices, peak: float) -> str:
  """The line that opens a run: model, data, devices, ZeRO setup, kernel, peak."""
  processes = (f" in {jax.process_count()} processes" if jax.process_count() > 1 else "")
  return (f"jzo: {cfg.model} ({model.n_params / 1e6:.2f}M params), {data.n_tokens:,} tokens, "
          f"{len(devices)} {devices[0].platform} device(s){processes}, stage {cfg.stage}"
          f"{' + offload' if cfg.offload else ''}, kernel {jzo.kernels.simd_level()}"
          + (f", peak {peak:.0f} TFLOPS/device{'' if cfg.peak_tflops else ' (measured)'}"
             if peak else ""))


def train(cfg: TrainConfig) -> dict:
  """Runs the recipe; returns the last step's record ({} if no step was run).

  Raises:
    UserError: a mistake in the options or the data.
    Interrupted: SIGINT or SIGTERM stopped the run (see `Interrupts`),
      after the checkpoint of the step reached.
  """
  check(cfg)
  if cfg.offload:
    cap_pinned_pool(cfg)  # before JAX starts its GPU backend, which reads the cap
  devices = pick_devices(cfg)
  data = load_data(cfg, devices)
  model = model_config(cfg, data.vocab)
  out = pathlib.Path(cfg.out)
  check_checkpoint_to_continue(cfg, out)
  check_no_earlier_run(cfg, out)
  out.mkdir(parents=True, exist_ok=True)
  primary = distributed.is_primary()  # prints, logs and plots
  if cfg.sample:
    with checkpoint.open_manager(out / "checkpoints") as manager:
      engine = build_engine(cfg, model, devices)
      restore_run(manager, engine, cfg, out)
      params = engine.params  # every process takes part in the gather
      if primary:
        print_sample(model, params, data.val_tokens, cfg)
      engine.close()
      return {}
  if primary:
    remove_partial_checkpoints(out)
  barrier("jzo: partial checkpoints removed")
  with Interrupts() as stop, checkpoint.open_manager(out / "checkpoints") as manager:
    engine = build_engine(cfg, model, devices)
    first = restore_run(manager, engine, cfg, out) if cfg.resume else 0
    history = start_log(cfg, out, first) if primary else []
    peak = peak_tflops(cfg, devices)
    if primary:
      print(banner(cfg, model, data, devices, peak))
      print(engine.plan)
    schedule = lr_schedule(cfg)
    meter = Throughput(cfg, model, peak * len(devices))
    last = {}
    done = saved = first  # steps done; the step of the last checkpoint (or the start)
    with open(out / "metrics.jsonl" if primary else os.devnull, "a") as log, \
         tqdm.tqdm(total=cfg.steps, initial=first, unit="step", disable=not primary) as bar:
      started = time.perf_counter()
      for step in range(first, cfg.steps):
        if stop.in_any_process():
          break
        metrics = engine.step(engine.local_batch({"tokens": data.batches[step]}))
        done = step + 1
        last = step_record(done, metrics, float(schedule(step)))  # waits for the step
        last["step_s"] = time.perf_counter() - started
        meter.add(last["step_s"])
        bar.update()
        is_eval = done % cfg.eval_every == 0 or done == cfg.steps
        if is_eval or done % cfg.log_every == 0:
          last.update(meter.rates())
          if is_eval:
            last["eval_loss"] = evaluate(model, eval_params(engine, cfg), data.val,
                                         cfg.eval_batches)
          if primary:
            bar.write(log_line(last))
        history.append(last)
        # The line before the checkpoint: a run resumed from it finds the log whole.
        log.write(json.dumps(last) + "\n")
        log.flush()
        if cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
          # The batch order is a function of the step, so the step is the data position.
          checkpoint.save(manager, engine, done)
          saved = done
        started = time.perf_counter()  # the next step's clock: not this bookkeeping
    if stop.signum:
      if done > saved:  # with the handlers still in place: a second signal exits at once
        checkpoint.save(manager, engine, done)
      engine.close()
      raise Interrupted(stop.signum, done,
                        out.absolute() / "checkpoints" / str(done) if done else None)
  engine.close()
  if primary:
    plot(history, out / "loss.png")
  if cfg.sample_tokens and data.vocab == data_lib.BYTE_VOCAB:
    params = engine.params  # every process takes part in the gather
    if primary:
      print_sample(model, params, data.val_tokens, cfg)
  if primary:
    print(f"\nmetrics: {out / 'metrics.jsonl'}, loss curve: {out / 'loss.png'}")
  return last


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier of this name (one process: returns)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


class Interrupted(Exception):
  """SIGINT or SIGTERM stopped training after the checkpoint of `step`.

  Attributes:
    signum: the signal's number (main exits with 128 + it: 130, 143).
    step: steps done.
    path: the checkpoint of `step` (None: no step yet, nothing to save).
  """

  def __init__(self, signum: int, step: int, path: pathlib.Path | None):
    name = signal.Signals(signum).name
    where = (f"checkpoint {step} in {path}; --resume continues from it" if path else
             "no step done, nothing to save")
    super().__init__(f"interrupted by {name} after step {step}: {where}")
    self.signum, self.step, self.path = signum, step, path


class Interrupts:
  """SIGINT (Ctrl-C) and SIGTERM (which schedulers send before they kill)
  while a run trains: the first sets `signum`, which the loop reads between
  steps, so the step in flight finishes and a checkpoint is written; a
  second exits at once (status 128 + its number; the last complete
  checkpoint stays, the one being written is never read).

  The handler only sets a flag: stopped in the middle of an exchange with
  its update thread, an engine could not go on (jzo.offload's `_guard`), nor
  write its state. Installed from the main thread only (where Python runs
  signal handlers); the previous handlers come back on exit.

  Attributes:
    signum: the first signal received (0: none; with several processes,
      the first that any process received, once `in_any_process` saw it).
  """

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.signum = 0
    self._previous = {}

  def __enter__(self) -> Interrupts:
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, signal.SIG_DFL if handler is None else handler)

  def in_any_process(self) -> bool:
    """Whether a signal came, here or (with several processes) in any
    other: they stop at the same step, or the others would wait for the
    stopped one in the next step's collectives (one all-gather of a number
    per step)."""
    if jax.process_count() > 1:
      self.signum = self.signum or int(multihost_utils.process_allgather(
          np.int32(self.signum)).max())
    return bool(self.signum)

  def _handle(self, signum: int, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signum:
      _say(f"jzo: {name} again: exiting at once, without a checkpoint of the step reached "
           f"(--resume continues from the last complete one)")
      for stream in (sys.stdout, sys.stderr):
        try:
          stream.flush()
        except Exception:  # the interrupted code was writing to it: what it held is lost
          pass
      os._exit(128 + signum)
    self.signum = signum
    _say(f"jzo: {name}: finishing the step in flight, then writing a checkpoint "
         f"({name} again: exit at once)")


def _say(message: str) -> None:
  """A line on stderr from a signal handler: written whole, bypassing the
  buffered stream the interrupted code may be in the middle of using."""
  os.write(2, f"\n{message}\n".encode())


def eval_params(engine: jzo.ZeroEngine, cfg: TrainConfig):
  """The weights to evaluate: the compute-dtype params already on the
  devices (stages 0-2: full; no float32 copy of a large model goes up), the
  float32 masters for stage 3's shards."""
  if cfg.stage == 3:
    return engine.params
  engine.wait()  # a delayed update in flight belongs to these weights
  if jax.process_count() > 1:  # replicated: this process's copy, evaluated locally
    return jax.tree.map(lambda x: x.addressable_data(0), engine.state.params)
  return engine.state.params


def quiet_failed_reads() -> None:
  """For the rest of the process (the command line's), drops the tracebacks
  orbax leaves after it failed to read a checkpoint, whose first error the
  run reports in one line: tensorstore's late callbacks into orbax's closed
  event loop ("Event loop is closed", some at exit) and asyncio's "Task
  exception was never retrieved" for the other reads that failed; up to a
  dozen each."""
  previous = sys.unraisablehook

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"):
      previous(unraisable)
  sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(
      lambda record: not record.getMessage().startswith("Task exception was never retrieved"))


def start_processes(cfg: TrainConfig) -> None:
  """Joins the other processes of a run, where the options or the
  environment name them (jzo.distributed); a single process otherwise."""
  host_port = r"(\[[0-9a-fA-F:.]+\]|[^:\s\[\]]+):\d+"  # an IPv6 host in brackets
  if cfg.coordinator and not re.fullmatch(host_port, cfg.coordinator):
    raise UserError(f"--coordinator must be host:port, got {cfg.coordinator!r}")
  if cfg.num_processes < 0:
    raise UserError(f"--num-processes must be >= 0, got {cfg.num_processes}")
  if cfg.process_id < -1 or (cfg.num_processes and cfg.process_id >= cfg.num_processes):
    count = cfg.num_processes or "the process count"
    raise UserError(f"--process-id {cfg.process_id} is outside [0, {count}) (-1: from the "
                    "environment)")
  try:
    distributed.initialize_from_environment(cfg.coordinator or None, cfg.num_processes or None,
                                            None if cfg.process_id < 0 else cfg.process_id)
  except ValueError as e:
    raise UserError(str(e)) from e


def main(argv: list[str] | None = None) -> int:
  # Large models need more of the GPU than XLA's default 75% preallocation;
  # jzo's planner keeps its own headroom.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  cfg = config_lib.parse(TrainConfig, argv, description=__doc__.splitlines()[0],
                         prog="python -m jzo.train")
  try:
    # After the options: a process with a mistake in them stops at once
    # rather than leaving the others waiting for it at the coordinator.
    start_processes(cfg)
    train(cfg)
  except (UserError, OSError) as e:  # the options, the data or the output folder
    sys.stderr.write(f"error: {e}\n")  # one write: no other thread's output inside the line
    return 2
  except Interrupted as e:
    sys.stderr.write(f"jzo: {e}\n")
    return 128 + e.signum  # as a shell reports a process the signal ended: 130, 143
  return 0


if __name__ == "__main__":
  quiet_failed_reads()
  sys.exit(main())
