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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
import tqdm
from jax.sharding import Mesh

import jzo
from jzo import checkpoint
from jzo import config as config_lib
from jzo import data as data_lib
from models import gpt


def _opt(help_text: str, default):
  return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model: str = _opt(f"preset: {', '.join(gpt.PRESETS)}", "tiny")
  data: str = _opt("'' for the embedded corpus, a text file or folder, or a .bin of uint16 "
                   "tokens (then give --vocab-size)", "")
  vocab_size: int = _opt("vocabulary of a .bin token file (0: the preset's)", 0)
  seq_len: int = _opt("tokens per training sequence", 128)
  batch_size: int = _opt("sequences per micro-batch, over all devices", 16)
  grad_accum: int = _opt("micro-batches per optimizer step", 1)
  steps: int = _opt("optimizer steps", 300)
  lr: float = _opt("peak learning rate (linear warm-up, cosine decay to 10%)", 3e-3)
  warmup: int = _opt("warm-up steps", 30)
  weight_decay: float = _opt("AdamW weight decay", 0.1)
  max_grad_norm: float = _opt("global gradient-norm clip", 1.0)
  stage: int = _opt("ZeRO stage 0-3", 2)
  offload: bool = _opt("keep optimizer state in host RAM (ZeRO-Offload)", True)
  offload_fraction: str = _opt("with --offload, the share of the optimizer state in host RAM: "
                               "auto (as much on the devices as fits; all of it on CPUs) or a "
                               "number in [0, 1]", "auto")
  device_memory_gb: float = _opt("GiB of one device's memory the placement may plan for (0: what "
                                 "its allocator reports)", 0.0)
  moments: str = _opt("dtype of the Adam moments: fp32, or bf16 (half the memory)", "fp32")
  delayed_update: bool = _opt("offload: one-step delayed parameter update", False)
  precision: str = _opt("compute precision: bf16 or fp16", "bf16")
  devices: int = _opt("devices to use (0: all)", 0)
  seed: int = _opt("seed of the initial weights and the batch order", 0)
  log_every: int = _opt("steps between log lines", 25)
  eval_every: int = _opt("steps between evaluations on the held-out split", 100)
  eval_batches: int = _opt("batches per evaluation", 4)
  sample_tokens: int = _opt("tokens of text to generate at the end", 200)
  remat: str = _opt("what the backward pass recomputes: full (least memory), dots (keeps "
                    "matmul outputs), none", "full")
  peak_tflops: float = _opt("peak bf16 TFLOPS of one device, for MFU (0: measure a bf16 "
                            "matmul on GPUs, none on CPU)", 0.0)
  checkpoint_every: int = _opt("steps between checkpoints (and one at the end; 0: none)", 100)
  resume: bool = _opt("continue from the last complete checkpoint in --out", False)
  sample: bool = _opt("only generate --sample-tokens of text from the checkpoint in --out", False)
  out: str = _opt("output folder (metrics.jsonl, loss.png)", "runs/latest")


class UserError(Exception):
  """A mistake in the options or the data: reported without a traceback."""


def check(cfg: TrainConfig) -> None:
  if cfg.model not in gpt.PRESETS:
    raise UserError(f"unknown model {cfg.model!r}; presets: {', '.join(gpt.PRESETS)}")
  if cfg.precision not in ("bf16", "fp16"):
    raise UserError(f"--precision must be bf16 or fp16, got {cfg.precision!r}")
  for name in ("seq_len", "batch_size", "grad_accum", "steps", "log_every", "eval_every",
               "eval_batches"):
    if getattr(cfg, name) < 1:
      raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
  if cfg.checkpoint_every < 0:
    raise UserError(f"--checkpoint-every must be >= 0, got {cfg.checkpoint_every}")
  if cfg.moments not in ("fp32", "bf16"):
    raise UserError(f"--moments must be fp32 or bf16, got {cfg.moments!r}")
  if cfg.offload_fraction != "auto":
    try:
      fraction = float(cfg.offload_fraction)
    except ValueError:
      fraction = -1.0
    if not 0.0 <= fraction <= 1.0:
      raise UserError(f"--offload-fraction must be auto or a number in [0, 1], got "
                      f"{cfg.offload_fraction!r}")
  if not 0 <= cfg.warmup < cfg.steps:
    raise UserError(f"--warmup must be in [0, --steps), got {cfg.warmup} with {cfg.steps} steps")
  if cfg.remat not in gpt.REMAT_POLICIES:
    raise UserError(f"--remat must be one of {', '.join(gpt.REMAT_POLICIES)}, got {cfg.remat!r}")
  if cfg.device_memory_gb < 0:
    raise UserError(f"--device-memory-gb must be >= 0, got {cfg.device_memory_gb}")
  if cfg.peak_tflops < 0:
    raise UserError(f"--peak-tflops must be >= 0, got {cfg.peak_tflops}")
  if cfg.seq_len > gpt.PRESETS[cfg.model].seq_len:
    raise UserError(f"--seq-len {cfg.seq_len} is beyond {cfg.model}'s context of "
                    f"{gpt.PRESETS[cfg.model].seq_len} tokens")


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
  return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps,
                                            end_value=0.1 * cfg.lr)


def placement(cfg: TrainConfig, devices) -> bool | float | str:
  """The engine's offload= from --offload and --offload-fraction: "auto"
  where the devices report their memory, all on the host where they do not
  (CPUs share the host's memory)."""
  if not cfg.offload:
    return False
  if cfg.offload_fraction == "auto":
    return "auto" if jzo.plan.device_memory_limit(devices[0]) else True
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
  stats = jax.devices()[0].memory_stats() or {}
  device = stats.get("peak_bytes_in_use")
  return f"host {host:.1f} GiB" + (f", device {device / 2**30:.1f} GiB" if device else "")


def plot(history: list[dict], path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
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
  plt.close(fig)


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
  """Loads the run's last complete checkpoint into `engine`; returns its step (0: none).

  `manager` is `checkpoint.open_manager(out / "checkpoints")`.
  """
  step = manager.latest_step()
  if step is None:
    return 0
  check_same_run(cfg, out)  # first: it names the option, where the engine sees only shapes
  try:
    return checkpoint.restore(manager, engine, step)
  except checkpoint.CheckpointError as e:
    raise UserError(str(e)) from e


def start_log(cfg: TrainConfig, out: pathlib.Path, first: int) -> list[dict]:
  """Writes config.json and metrics.jsonl as of step `first`; returns the log so far."""
  (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
  # The log keeps what came before the checkpoint, so the curve stays whole.
  history = []
  if first and (out / "metrics.jsonl").exists():
    history = [h for h in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if h["step"] <= first]
  (out / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
  return history


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
  return matmul_tflops(devices[0])


def banner(cfg: TrainConfig, model: gpt.GPTConfig, data: Data, devices, peak: float) -> str:
  """The line that opens a run: model, data, devices, ZeRO setup, kernel, peak."""
  return (f"jzo: {cfg.model} ({model.n_params / 1e6:.2f}M params), {data.n_tokens:,} tokens, "
          f"{len(devices)} {devices[0].platform} device(s), stage {cfg.stage}"
          f"{' + offload' if cfg.offload else ''}, kernel {jzo.kernels.simd_level()}"
          + (f", peak {peak:.0f} TFLOPS/device{'' if cfg.peak_tflops else ' (measured)'}"
             if peak else ""))


def train(cfg: TrainConfig) -> dict:
  """Runs the recipe; returns the last step's record ({} if no step was run)."""
  check(cfg)
  if cfg.offload:
    cap_pinned_pool(cfg)  # before JAX starts its GPU backend, which reads the cap
  devices = jax.devices()[:cfg.devices or None]
  data = load_data(cfg, devices)
  model = model_config(cfg, data.vocab)
  engine = build_engine(cfg, model, devices)
  out = pathlib.Path(cfg.out)
  out.mkdir(parents=True, exist_ok=True)
  with checkpoint.open_manager(out / "checkpoints") as manager:
    if cfg.sample:
      if restore_run(manager, engine, cfg, out) == 0:
        raise UserError(f"--sample: no checkpoint in {out / 'checkpoints'}")
      print_sample(model, engine.params, data.val_tokens, cfg)
      engine.close()
      return {}
    first = restore_run(manager, engine, cfg, out) if cfg.resume else 0
    history = start_log(cfg, out, first)
    peak = peak_tflops(cfg, devices)
    print(banner(cfg, model, data, devices, peak))
    print(engine.plan)
    schedule = lr_schedule(cfg)
    meter = Throughput(cfg, model, peak * len(devices))
    last = {}
    with open(out / "metrics.jsonl", "a") as log, \
         tqdm.tqdm(total=cfg.steps, initial=first, unit="step") as bar:
      started = time.perf_counter()
      for step in range(first, cfg.steps):
        metrics = engine.step({"tokens": data.batches[step]})
        done = step + 1
        last = step_record(done, metrics, float(schedule(step)))  # waits for the step
        last["step_s"] = time.perf_counter() - started
        meter.add(last["step_s"])
        bar.update()
        if cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
          # The batch order is a function of the step, so the step is the data position.
          checkpoint.save(manager, engine, done)
        is_eval = done % cfg.eval_every == 0 or done == cfg.steps
        if is_eval or done % cfg.log_every == 0:
          last.update(meter.rates())
          if is_eval:
            last["eval_loss"] = evaluate(model, eval_params(engine, cfg), data.val,
                                         cfg.eval_batches)
          bar.write(log_line(last))
        history.append(last)
        log.write(json.dumps(last) + "\n")
        log.flush()
        started = time.perf_counter()  # the next step's clock: not this bookkeeping
  engine.close()
  plot(history, out / "loss.png")
  if cfg.sample_tokens and data.vocab == data_lib.BYTE_VOCAB:
    print_sample(model, engine.params, data.val_tokens, cfg)
  print(f"\nmetrics: {out / 'metrics.jsonl'}, loss curve: {out / 'loss.png'}")
  return last


def eval_params(engine: jzo.ZeroEngine, cfg: TrainConfig):
  """The weights to evaluate: the compute-dtype params already on the
  devices (stages 0-2: full; no float32 copy of a large model goes up), the
  float32 masters for stage 3's shards."""
  if cfg.stage == 3:
    return engine.params
  engine.wait()  # a delayed update in flight belongs to these weights
  return engine.state.params


def main(argv: list[str] | None = None) -> int:
  # Large models need more of the GPU than XLA's default 75% preallocation;
  # jzo's planner keeps its own headroom.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  cfg = config_lib.parse(TrainConfig, argv, description=__doc__.splitlines()[0])
  try:
    train(cfg)
  except (UserError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
