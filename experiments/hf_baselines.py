"""The PyTorch peers of jzo's Llama-family points: transformers'
LlamaForCausalLM (Qwen2ForCausalLM for the Qwen presets) of a named
published shape, random weights, trained by DeepSpeed ZeRO-2 with
offload_optimizer to the CPU, or by PyTorch alone, for the same steps as
experiments/llama_bench.py runs jzo.

The model: the shape's config.json values (below; nothing is downloaded),
gradient checkpointing on every decoder layer (use_reentrant=False), SDPA
attention (flash on an H100), bf16. DeepSpeed: bf16 weights on the GPU,
ZeRO stage 2, offload_optimizer cpu with pinned memory, contiguous gradients,
overlapped reduction, its AdamW (DeepSpeedCPUAdam, JIT-built on first use).
PyTorch alone: float32 weights, bf16 autocast, fused AdamW on the GPU. Both:
lr 3e-4, weight decay 0.1, global-norm clip 1.0, one micro-batch a step.

Measured: the median step over the steps after warm-up, tokens/s, model
TFLOPS with jzo's formula (6 N + 12 L (H head_dim) T per token, N all
parameters, T the sequence length; recomputation not counted), the GPU's
peak (torch.cuda.max_memory_allocated and max_memory_reserved), the host
RSS peak (psutil, sampled, and the kernel's ru_maxrss). The measurement runs
in a child process, so that a host out of memory (the kernel's OOM killer)
still leaves a record: the outcome (ok, GPU OOM, host OOM, timeout, error)
goes as one JSON line onto --out.

  python experiments/hf_baselines.py --shape llama-3.1-8b --system deepspeed \\
      --seq-len 4096 --micro-batch 1 --steps 10 --out hf.jsonl

A CPU smoke test: --shape llama-tiny --system torch --seq-len 64 --device cpu.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

# The published config.json values of each shape (Hugging Face hub, the
# base models), the shapes of jzo.models.llama's presets of the same names.
# Llama 3's rope_scaling is its "llama3" frequency scaling; Mistral is v0.3
# (vocabulary 32,768, no sliding window), built as a LlamaForCausalLM: the
# same layers. The tiny ones are jzo's llama-tiny, for smoke tests on a CPU.
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-tiny": ("llama", dict(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False)),
    "qwen2-tiny": ("qwen2", dict(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False)),
    "llama-3.2-1b": ("llama", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0), tie_word_embeddings=True)),
    "llama-3.2-3b": ("llama", dict(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0), tie_word_embeddings=True)),
    "llama-3.1-8b": ("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=8.0), tie_word_embeddings=False)),
    "llama-2-13b": ("llama", dict(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=40,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False)),
    "mistral-7b": ("llama", dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6,
        tie_word_embeddings=False)),
    "qwen2.5-7b": ("qwen2", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False)),
    "qwen2.5-14b": ("qwen2", dict(
        vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
        num_attention_heads=40, num_key_value_heads=8,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6,
        tie_word_embeddings=False)),
}
FLOPS_FORMULA = "6 N + 12 L (H head_dim) T per token (N all parameters, T the sequence length)"
OUTCOMES = ("ok", "GPU OOM", "host OOM", "timeout", "error")


def shape_config(name: str, n_layer: int | None = None) -> tuple[str, dict]:
  """(family, config dict) of a shape, with `n_layer` decoder layers if given.

  Raises:
    ValueError: an unknown shape.
  """
  if name not in SHAPES:
    raise ValueError(f"unknown shape {name!r}; shapes: {', '.join(SHAPES)}")
  family, config = SHAPES[name]
  return family, dict(config, num_hidden_layers=n_layer or config["num_hidden_layers"])


def head_dim(config: dict) -> int:
  """Per-head width: the config's head_dim, else hidden / heads (as transformers)."""
  return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def count_params(family: str, config: dict) -> int:
  """Parameters of the model built from `config`, from its shape alone (a
  tied output embedding counted once, as torch's parameters() does)."""
  D, V, L = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
  q, kv = config["num_attention_heads"] * head_dim(config), (
      config["num_key_value_heads"] * head_dim(config))
  bias = q + 2 * kv if family == "qwen2" else 0  # Qwen2's q, k, v projections have biases
  layer = D * q + 2 * D * kv + bias + q * D + 3 * D * config["intermediate_size"] + 2 * D
  embeddings = V * D * (1 if config["tie_word_embeddings"] else 2)
  return embeddings + L * layer + D


def flops_per_token(config: dict, n_params: int, seq_len: int) -> float:
  """Model FLOPs of one training token: jzo's formula (FLOPS_FORMULA), the
  matmuls of forward and backward (6 N) and attention's scores and values
  (12 L (H head_dim) T); recomputation is not counted."""
  width = config["num_attention_heads"] * head_dim(config)
  return 6 * n_params + 12 * config["num_hidden_layers"] * width * seq_len


class RssPeak:
  """Samples the resident memory of a process and its children in a thread;
  `peak` is the largest sum seen, in bytes. A sampler: a short peak between
  samples can be missed (the kernel's ru_maxrss is exact, for one process).

  With `min_available` (bytes), it also ends the process's group when the
  host's available memory falls below that, and keeps what it saw in
  `stopped_at`: a host out of memory recorded without waiting for the
  kernel's OOM killer, which may pick another process of the machine."""

  def __init__(self, pid: int, interval: float = 0.2, min_available: int | None = None):
    import psutil
    self.process, self.interval, self.peak = psutil.Process(pid), interval, 0
    self.min_available, self.stopped_at = min_available, None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    import psutil
    while not self._stop.is_set():
      try:
        procs = [self.process] + self.process.children(recursive=True)
        self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
      except psutil.Error:  # the process (or a child) has just ended
        pass
      available = psutil.virtual_memory().available
      if self.min_available and available < self.min_available and self.stopped_at is None:
        self.stopped_at = available
        try:
          os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      self._stop.wait(self.interval)

  def stop(self) -> int:
    self._stop.set()
    self._thread.join()
    return self.peak


# ------------------------------------------------------------------ child
def build_model(family: str, config: dict, dtype, device: str):
  """The transformers model of `config`, random weights of `dtype` drawn
  directly on `device` (no float32 copy of a bf16 model), in training mode
  with gradient checkpointing."""
  import torch
  import transformers
  cls, config_cls = {
      "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
      "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
  }[family]
  # Passed as in config.json; transformers 5 turns rope_theta and
  # rope_scaling into its rope_parameters.
  hf_config = config_cls(**config, attn_implementation="sdpa", use_cache=False)
  default = torch.get_default_dtype()
  torch.set_default_dtype(dtype)  # what transformers' from_config(dtype=...) does
  try:
    with torch.device(device):
      model = cls(hf_config)
  finally:
    torch.set_default_dtype(default)
  # Every decoder layer recomputed in the backward pass, as jzo's remat
  # "full"; transformers 5 renamed the method (the old name warns).
  kwargs = {"use_reentrant": False}
  if hasattr(model, "activation_checkpointing_enable"):
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
  else:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
  model.train()
  return model


def with_loss(model):
  """The model as DeepSpeed and the loop call it: tokens (B, T + 1) -> mean
  next-token cross-entropy in float32, computed here (not by transformers'
  labels path) so that every transformers version computes the same loss."""
  import torch
  import torch.nn.functional as F

  class CausalLMLoss(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.model = model

    def forward(self, tokens):
      logits = self.model(input_ids=tokens[:, :-1], use_cache=False).logits
      return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
  return CausalLMLoss()


def deepspeed_step(module, args, device: str):
  """DeepSpeed ZeRO-2 + offload_optimizer cpu over `module`: one step function."""
  import deepspeed
  for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512", "RANK": "0",
                     "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
    os.environ.setdefault(key, value)
  if device == "cpu":  # DeepSpeed's CPU accelerator would ask for oneCCL
    deepspeed.init_distributed(dist_backend="gloo")
  config = {
      "train_micro_batch_size_per_gpu": args.micro_batch,
      "gradient_accumulation_steps": 1,
      "gradient_clipping": 1.0,
      "bf16": {"enabled": True},
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
      "zero_optimization": {
          "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
          "contiguous_gradients": True, "overlap_comm": True,
          "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
      "steps_per_print": 10**9,
  }
  engine, optimizer, *_ = deepspeed.initialize(model=module, config=config,
                                               model_parameters=module.parameters())
  # ZeRO's optimizer wraps the one that updates: DeepSpeedCPUAdam with offload.
  inner = getattr(optimizer, "optimizer", optimizer)
  print("DeepSpeed optimizer:", type(optimizer).__name__, "over", type(inner).__name__,
        file=sys.stderr, flush=True)

  def step(tokens):
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    return loss
  return step, {"deepspeed": deepspeed.__version__, "optimizer": type(inner).__name__}


def torch_step(module, args, device: str):
  """PyTorch alone: float32 weights, bf16 autocast, fused AdamW where the
  weights are: one step function."""
  import torch
  opt = torch.optim.AdamW(module.parameters(), lr=3e-4, weight_decay=0.1, fused=True)

  def step(tokens):
    with torch.autocast(device, dtype=torch.bfloat16):
      loss = module(tokens)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
  return step, {"optimizer": "torch.optim.AdamW(fused=True)"}


def measure(args) -> dict:
  """Builds the model and the system's step, runs the warm-up and timed
  steps; the record of a run that trained."""
  import psutil
  import torch
  import transformers
  device = args.device
  family, config = shape_config(args.shape, args.n_layer)
  versions = {"torch": torch.__version__, "transformers": transformers.__version__}
  print("torch", torch.__version__, "transformers", transformers.__version__, "device", device,
        file=sys.stderr, flush=True)
  rss = RssPeak(os.getpid())
  torch.manual_seed(0)
  start = time.perf_counter()
  # DeepSpeed keeps float32 masters on the host: bf16 weights on the GPU.
  dtype = torch.bfloat16 if args.system == "deepspeed" else torch.float32
  module = with_loss(build_model(family, config, dtype, device))
  n_params = sum(p.numel() for p in module.parameters())
  if n_params != count_params(family, config):  # the formula's N must be the model's
    raise AssertionError(f"{n_params} parameters built, {count_params(family, config)} counted")
  attention = module.model.config._attn_implementation
  make_step = deepspeed_step if args.system == "deepspeed" else torch_step
  step, system_info = make_step(module, args, device)
  build_s = time.perf_counter() - start
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  generator = torch.Generator(device="cpu").manual_seed(1)
  tokens = torch.randint(0, config["vocab_size"], (args.micro_batch, args.seq_len + 1),
                         generator=generator).to(device)
  losses, times = [], []
  for i in range(args.warmup + args.steps):
    begin = time.perf_counter()
    loss = step(tokens)
    sync()
    losses.append(float(loss.detach()))
    if i >= args.warmup:
      times.append(time.perf_counter() - begin)
    print(f"step {i}: {time.perf_counter() - begin:.3f} s, loss {losses[-1]:.4f}, rss "
          f"{psutil.Process().memory_info().rss / 2**30:.2f} GiB", file=sys.stderr, flush=True)
  seconds = statistics.median(times)
  tokens_per_s = args.micro_batch * args.seq_len / seconds
  flops = flops_per_token(config, n_params, args.seq_len)
  gpu = {}
  if device == "cuda":
    gpu = {"peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
           "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
           "device_name": torch.cuda.get_device_name()}
  return {
      "status": "ok", "attention": attention, "build_s": build_s, "step_s": seconds,
      "times_s": times, "losses": losses, "tokens_per_s": tokens_per_s,
      "flops_per_token": flops, "tflops": tokens_per_s * flops / 1e12, **gpu,
      "host_rss_gib": psutil.Process().memory_info().rss / 2**30,
      "host_rss_peak_gib": rss.stop() / 2**30,
      "host_maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
      **versions, **system_info}


def child(args) -> int:
  """Runs `measure` and writes its record (or the GPU OOM's) to --result."""
  import torch
  try:
    record = measure(args)
  except torch.OutOfMemoryError as e:  # the GPU's memory: a point that does not fit
    record = {"status": "GPU OOM", "detail": str(e).splitlines()[:1]}
    if args.device == "cuda":
      record["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
  except MemoryError as e:  # a host allocation refused (rather than the OOM killer)
    record = {"status": "host OOM", "detail": [repr(e)]}
  with open(args.result, "w") as f:
    json.dump(record, f)
  return 0


# ----------------------------------------------------------------- parent
def classify(returncode: int, output: str) -> str:
  """The outcome of a child that wrote no record: SIGKILL is the kernel's
  OOM killer on these machines (a host out of memory)."""
  if returncode == -signal.SIGKILL:
    return "host OOM"
  if "CUDA out of memory" in output or "OutOfMemoryError" in output:
    return "GPU OOM"
  if "cannot allocate memory" in output.lower() or "MemoryError" in output:
    return "host OOM"
  return "error"


def run(args) -> dict:
  """Runs the measurement in a child process under --timeout; its record."""
  import psutil
  family, config = shape_config(args.shape, args.n_layer)
  n_params = count_params(family, config)
  print(f"{args.shape} ({family}, {config['num_hidden_layers']} layers, {n_params / 1e9:.3f}B "
        f"parameters), {args.system}, seq {args.seq_len}, micro-batch {args.micro_batch}; "
        f"model FLOPs: {FLOPS_FORMULA} = "
        f"{flops_per_token(config, n_params, args.seq_len) / 1e9:.2f} GFLOP", flush=True)
  record = {"system": args.system, "shape": args.shape, "family": family,
            "n_layer": config["num_hidden_layers"], "n_params": n_params,
            "micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps,
            "warmup": args.warmup, "flops_formula": FLOPS_FORMULA,
            "host_total_gib": psutil.virtual_memory().total / 2**30,
            "host_available_gib": psutil.virtual_memory().available / 2**30}
  with tempfile.TemporaryDirectory() as tmp:
    result = os.path.join(tmp, "result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--result", result,
           "--shape", args.shape, "--system", args.system, "--seq-len", str(args.seq_len),
           "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--device", args.device]
    if args.n_layer:
      cmd += ["--n-layer", str(args.n_layer)]
    start = time.perf_counter()
    # A session of its own, so that a time-out also ends the child's
    # children (DeepSpeed's compiler), which hold memory.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    rss = RssPeak(proc.pid, interval=0.5, min_available=int(args.min_available_gb * 2**30))
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(echo(proc.stdout)), daemon=True)
    reader.start()
    try:
      proc.wait(timeout=args.timeout)
      status = None
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
      status = "timeout"
    reader.join()
    record["wall_s"] = time.perf_counter() - start
    # What the parent saw: the child's peak even when the OOM killer ended it.
    record["host_rss_peak_seen_gib"] = rss.stop() / 2**30
    output = "".join(lines)
    if os.path.exists(result) and status is None:
      with open(result) as f:
        record.update(json.load(f))
    else:
      detail = [line.rstrip() for line in lines[-4:]]
      if rss.stopped_at is not None:
        status = "host OOM"
        detail.append(f"stopped by hf_baselines: the host had {rss.stopped_at / 2**30:.2f} GiB "
                      f"available, under --min-available-gb {args.min_available_gb}")
      record.update(status=status or classify(proc.returncode, output), exit=proc.returncode,
                    detail=detail)
  return record


def echo(stream):
  """Yields the lines of `stream`, printing each as it comes."""
  for line in stream:
    print(line, end="", flush=True)
    yield line


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default="llama-3.1-8b", choices=list(SHAPES))
  parser.add_argument("--system", choices=["deepspeed", "torch"], default="deepspeed")
  parser.add_argument("--seq-len", type=int, default=4096)
  parser.add_argument("--micro-batch", type=int, default=1, help="sequences a step")
  parser.add_argument("--n-layer", type=int, help="decoder layers, instead of the shape's")
  parser.add_argument("--steps", type=int, default=10, help="timed steps, after the warm-up")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                      help="cpu: a smoke test with a tiny shape")
  parser.add_argument("--timeout", type=float, default=600,
                      help="seconds before the child is killed (outcome 'timeout')")
  parser.add_argument("--min-available-gb", type=float, default=2.0,
                      help="end the run (outcome 'host OOM') when the host has less available")
  parser.add_argument("--out", help="file to append the record to, as one JSON line")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--result", help=argparse.SUPPRESS)  # the child's record
  return parser.parse_args(argv)


def main():
  args = parse_args()
  if args.child:
    sys.exit(child(args))
  record = run(args)
  line = json.dumps(record)
  print(line, flush=True)
  if args.out:
    with open(args.out, "a") as f:
      f.write(line + "\n")
  print(f"{args.system} {args.shape}: {record['status']}"
        + (f", {record['step_s']:.3f} s/step, {record['tflops']:.1f} TFLOPS, GPU peak "
           f"{record.get('peak_gpu_gib', 0):.1f} GiB, host RSS peak "
           f"{record['host_rss_peak_gib']:.1f} GiB" if record["status"] == "ok" else ""))


if __name__ == "__main__":
  main()
