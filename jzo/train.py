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
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import psutil
import tqdm
from jax.sharding import Mesh

import jzo
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
  checkpoint_every: int = _opt("steps between checkpoints (and one at the end)", 100)
  resume: bool = _opt("continue from the last complete checkpoint in --out", False)
  sample: bool = _opt("only generate --sample-tokens of text from the checkpoint in --out", False)
  out: str = _opt("output folder (metrics.jsonl, loss.png)", "runs/latest")


class UserError(Exception):
  """A mistake in the options or the data: reported without a traceback."""


def load_tokens(cfg: TrainConfig, model_vocab: int) -> tuple[np.ndarray, int]:
  """Token stream and vocabulary size for the chosen data."""
  if not cfg.data:
    return data_lib.embedded_corpus(), data_lib.BYTE_VOCAB
  if cfg.data.endswith(".bin"):
    vocab = cfg.vocab_size or model_vocab
    return data_lib.read_tokens(cfg.data, vocab), vocab
  return data_lib.read_text(cfg.data), data_lib.BYTE_VOCAB


def check(cfg: TrainConfig) -> None:
  if cfg.model not in gpt.PRESETS:
    raise UserError(f"unknown model {cfg.model!r}; presets: {', '.join(gpt.PRESETS)}")
  if cfg.precision not in ("bf16", "fp16"):
    raise UserError(f"--precision must be bf16 or fp16, got {cfg.precision!r}")
  for name in ("seq_len", "batch_size", "grad_accum", "steps", "log_every", "eval_every",
               "eval_batches", "checkpoint_every"):
    if getattr(cfg, name) < 1:
      raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
  if not 0 <= cfg.warmup < cfg.steps:
    raise UserError(f"--warmup must be in [0, --steps), got {cfg.warmup} with {cfg.steps} steps")
  if cfg.remat not in gpt.REMAT_POLICIES:
    raise UserError(f"--remat must be one of {', '.join(gpt.REMAT_POLICIES)}, got {cfg.remat!r}")
  if cfg.peak_tflops < 0:
    raise UserError(f"--peak-tflops must be >= 0, got {cfg.peak_tflops}")
  if cfg.seq_len > gpt.PRESETS[cfg.model].seq_len:
    raise UserError(f"--seq-len {cfg.seq_len} is beyond {cfg.model}'s context of "
                    f"{gpt.PRESETS[cfg.model].seq_len} tokens")


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps,
                                            end_value=0.1 * cfg.lr)


def make_engine(cfg: TrainConfig, model: gpt.GPTConfig, devices) -> jzo.ZeroEngine:
  # The float32 weights are drawn in host memory: the engine puts only its
  # masters' shards (none with offload) and the compute-dtype copy on the devices.
  with jax.default_device(jax.devices("cpu")[0]):
    params = gpt.init_params(model, jax.random.PRNGKey(cfg.seed))
  # Weight decay on the embeddings and weight matrices, not on biases and
  # LayerNorm parameters.
  mask = jax.tree_util.tree_map_with_path(
      lambda path, _: path[-1].key in ("wte", "wpe", "kernel"), params)
  tx = jzo.cpu_adamw(lr_schedule(cfg), b2=0.95, weight_decay=cfg.weight_decay, mask=mask)
  return jzo.ZeroEngine(
      functools.partial(gpt.loss_fn, model), params, tx,
      mesh=Mesh(np.array(devices), ("data",)), stage=cfg.stage,
      compute_dtype=jnp.bfloat16 if cfg.precision == "bf16" else jnp.float16,
      grad_accum=cfg.grad_accum, max_grad_norm=cfg.max_grad_norm, offload=cfg.offload,
      delayed_update=cfg.delayed_update, layers="blocks" if cfg.stage == 3 else None)


@functools.cache
def _loss(model: gpt.GPTConfig):
  """The jitted loss of one model, compiled once per run."""
  return jax.jit(functools.partial(gpt.loss_fn, model))


def evaluate(model: gpt.GPTConfig, params, batches: data_lib.Batches, n: int) -> float:
  """Mean loss of n held-out batches with the float32 master weights."""
  return float(np.mean([_loss(model)(params, {"tokens": batches[i]}) for i in range(n)]))


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


def checkpoints(out: pathlib.Path) -> ocp.CheckpointManager:
  """Checkpoints under out/checkpoints; orbax writes each to a temporary
  folder and renames it when complete, so a run killed while saving leaves
  the previous one intact (and unfinished ones are never restored)."""
  return ocp.CheckpointManager((out / "checkpoints").absolute(),
                               options=ocp.CheckpointManagerOptions(max_to_keep=2))


def restore(manager: ocp.CheckpointManager, engine: jzo.ZeroEngine, cfg: TrainConfig,
            out: pathlib.Path) -> int:
  """Loads the last complete checkpoint; returns its step (0 if none)."""
  step = manager.latest_step()
  if step is None:
    return 0
  saved_cfg = json.loads((out / "config.json").read_text())
  for key in ("model", "data", "seq_len", "batch_size", "grad_accum", "seed", "stage",
              "offload", "precision"):
    if saved_cfg.get(key) != getattr(cfg, key):
      raise UserError(f"checkpoint in {out} was made with --{key.replace('_', '-')} "
                      f"{saved_cfg.get(key)!r}, not {getattr(cfg, key)!r}")
  try:
    # The engine's own state as the target: orbax rebuilds the same tree types.
    saved = manager.restore(step, args=ocp.args.StandardRestore(engine.state_dict()))
  except Exception as e:  # orbax raises many kinds for a damaged folder
    raise UserError(f"checkpoint {step} in {out} is unreadable: {type(e).__name__}: {e}") from e
  try:
    engine.load_state_dict(saved)
  except ValueError as e:
    raise UserError(f"checkpoint {step} in {out} does not fit this run: {e}") from e
  return step


def print_sample(model: gpt.GPTConfig, params, val_tokens: np.ndarray, cfg: TrainConfig):
  """Generates from a prompt taken from the held-out split (byte-level text)."""
  prompt = val_tokens[:32]
  text = gpt.generate(model, params, prompt, cfg.sample_tokens, jax.random.PRNGKey(cfg.seed))
  print("\n--- sample (prompt from the held-out split) ---\n"
        + bytes(np.asarray(prompt, np.uint8)).decode("utf-8", "replace")
        + bytes(text.astype(np.uint8)).decode("utf-8", "replace"))


def check_device_memory(cfg: TrainConfig, model: gpt.GPTConfig, devices) -> None:
  """Refuses a model whose persistent state alone exceeds a device's memory.

  Per device, Psi params: bf16 params 2 Psi (stage 3: / Nd), gradients 2 Psi
  (stages 2-3: / Nd), and without offload fp32 master + Adam 12 Psi / Nd
  (stage 0: not divided). Activations come on top; they are not estimated.
  """
  limit = (devices[0].memory_stats() or {}).get("bytes_limit")
  if not limit:
    return  # the CPU backend reports no limit
  n, psi = len(devices), model.n_params
  params = 2 * psi / (n if cfg.stage == 3 else 1)
  grads = 2 * psi / (n if cfg.stage >= 2 else 1)
  optimizer = 0 if cfg.offload else 12 * psi / (1 if cfg.stage == 0 else n)
  need = params + grads + optimizer
  if need > limit:
    raise UserError(f"{cfg.model} needs {need / 2**30:.1f} GiB of device memory per device for "
                    f"params, gradients and optimizer state at stage {cfg.stage}"
                    f"{' with offload' if cfg.offload else ''}; a {devices[0].device_kind} "
                    f"has {limit / 2**30:.1f} GiB")


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


def train(cfg: TrainConfig) -> dict:
  """Runs the recipe; returns the last metrics."""
  check(cfg)
  devices = jax.devices()[:cfg.devices or None]
  preset = gpt.PRESETS[cfg.model]
  try:
    tokens, vocab = load_tokens(cfg, preset.vocab_size)
  except ValueError as e:
    raise UserError(str(e)) from e
  # tiny and token files take the data's vocabulary, padded to a multiple of 128.
  own_vocab = cfg.model == "tiny" or cfg.data.endswith(".bin")
  model = dataclasses.replace(preset, seq_len=cfg.seq_len, remat=cfg.remat,
                              vocab_size=-(-vocab // 128) * 128 if own_vocab else preset.vocab_size)
  if vocab > model.vocab_size:
    raise UserError(f"the data needs a vocabulary of {vocab}, {cfg.model} has {model.vocab_size}")
  train_tokens, val_tokens = data_lib.train_val_split(tokens)
  global_batch = cfg.batch_size * cfg.grad_accum
  if cfg.batch_size % len(devices):
    raise UserError(f"--batch-size {cfg.batch_size} does not split over {len(devices)} devices")
  check_device_memory(cfg, model, devices)
  try:
    batches = data_lib.Batches(train_tokens, global_batch, cfg.seq_len, cfg.seed)
    val = data_lib.Batches(val_tokens, cfg.batch_size, cfg.seq_len, cfg.seed + 1)
    engine = make_engine(cfg, model, devices)
  except (ValueError, TypeError, MemoryError) as e:
    raise UserError(str(e)) from e

  out = pathlib.Path(cfg.out)
  out.mkdir(parents=True, exist_ok=True)
  manager = checkpoints(out)
  if cfg.sample:
    if restore(manager, engine, cfg, out) == 0:
      raise UserError(f"--sample: no checkpoint in {out / 'checkpoints'}")
    print_sample(model, engine.params, val_tokens, cfg)
    return {}
  first = restore(manager, engine, cfg, out) if cfg.resume else 0
  (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
  # The log keeps what came before the checkpoint, so the curve stays whole.
  history = []
  if first and (out / "metrics.jsonl").exists():
    history = [h for h in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if h["step"] <= first]
  peak = cfg.peak_tflops
  if not peak and devices[0].platform == "gpu":
    peak = matmul_tflops(devices[0])
  print(f"jzo: {cfg.model} ({model.n_params / 1e6:.2f}M params), {len(tokens):,} tokens, "
        f"{len(devices)} {devices[0].platform} device(s), stage {cfg.stage}"
        f"{' + offload' if cfg.offload else ''}, kernel {jzo.kernels.simd_level()}"
        + (f", peak {peak:.0f} TFLOPS/device{'' if cfg.peak_tflops else ' (measured)'}"
           if peak else ""))
  last, logged = {}, first
  tokens_per_step = global_batch * cfg.seq_len
  flops_per_step = tokens_per_step * model.flops_per_token()
  schedule = lr_schedule(cfg)
  start = time.perf_counter()
  (out / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
  with open(out / "metrics.jsonl", "a") as log, tqdm.tqdm(total=cfg.steps, initial=first,
                                                          unit="step") as bar:
    for step in range(first, cfg.steps):
      metrics = engine.step({"tokens": batches[step]})
      bar.update()
      done = step + 1
      if done % cfg.checkpoint_every == 0 or done == cfg.steps:
        # The batch order is a function of the step, so the step is the data position.
        manager.save(done, args=ocp.args.StandardSave(engine.state_dict()))
        manager.wait_until_finished()  # offload's state_dict is the live host state
      is_eval = done % cfg.eval_every == 0 or done == cfg.steps
      if done % cfg.log_every and not is_eval:
        continue
      loss = float(metrics.loss)  # host sync: once per log line
      elapsed = time.perf_counter() - start
      steps_done, logged = done - logged, done
      tflops = flops_per_step * steps_done / elapsed / 1e12
      last = {"step": done, "loss": loss, "lr": float(schedule(step)),
              "tokens_per_s": tokens_per_step * steps_done / elapsed, "model_tflops": tflops,
              "grad_norm": float(metrics.grad_norm), "skipped": int(engine.state.skipped)}
      if peak:
        last["mfu"] = tflops / (peak * len(devices))
      if is_eval:
        last["eval_loss"] = evaluate(model, engine.params, val, cfg.eval_batches)
      history.append(last)
      log.write(json.dumps(last) + "\n")
      log.flush()
      bar.write(f"step {done}: loss {loss:.4f}"
                + (f", eval {last['eval_loss']:.4f}" if "eval_loss" in last else "")
                + f", lr {last['lr']:.2e}, {last['tokens_per_s']:,.0f} tokens/s, "
                f"{tflops:.3f} TFLOPS" + (f", MFU {last['mfu']:.1%}" if "mfu" in last else "")
                + f", {memory_line()}")
      start = time.perf_counter()  # the next interval times training only, not evaluation
  engine.close()
  manager.close()
  plot(history, out / "loss.png")
  if cfg.sample_tokens and vocab == data_lib.BYTE_VOCAB:
    print_sample(model, engine.params, val_tokens, cfg)
  print(f"\nmetrics: {out / 'metrics.jsonl'}, loss curve: {out / 'loss.png'}")
  return last


def main(argv: list[str] | None = None) -> int:
  cfg = config_lib.parse(TrainConfig, argv, description=__doc__.splitlines()[0])
  try:
    train(cfg)
  except (UserError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
