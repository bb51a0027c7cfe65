"""PyTorch alone and DeepSpeed ZeRO-2 or 3 with offload_optimizer to the CPU,
training transformers' LlamaForCausalLM (Qwen2ForCausalLM for the Qwen
shapes) of a published shape from random weights: the peers of
benchmarks/train_llama.py.

The model: the shape's config.json values (below; nothing is downloaded),
gradient checkpointing on every decoder layer (use_reentrant=False), SDPA
attention (flash on an H100), the loss computed here in float32 (the same
in every transformers version). The systems are benchmarks/torch_peers.py's.

Reported: the median step after --warmup steps, tokens/s, model TFLOPS with
jzo's formula (6 N + 12 L (H head_dim) T a token, N every parameter), the
GPU's peaks (allocated and reserved), the host RSS peak of the process and
its children (sampled). The measurement runs in a child process: a host out
of memory ends it before the kernel's OOM killer would (the host's available
memory under --min-available-gb) and is recorded as status "killed".

  python3 benchmarks/peers_hf.py --shape llama-3.1-8b --n-layer 14 --system deepspeed \\
      --seq-len 4096 --micro-batch 4 --steps 8
  python3 benchmarks/peers_hf.py --shape llama-3.1-70b --system deepspeed --zero-stage 3 \\
      --offload-param --gpus 4 --seq-len 4096 --micro-batch 1 --steps 4
  python3 benchmarks/peers_hf.py --shape llama-tiny --system torch --seq-len 32 --steps 1  # CPU
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

import harness
import torch_peers

# The published config.json values of each shape (the Hugging Face hub's
# base models), the shapes of jzo.models.llama's presets of the same names.
# Mistral is v0.3 (vocabulary 32,768, no sliding window), built as a
# LlamaForCausalLM: the same layers. The tiny ones are for a CPU.
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             tie_word_embeddings=False)
_LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(_LLAMA3_ROPE, factor=8.0), tie_word_embeddings=False)
_QWEN25_14B = dict(
    vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
    num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768,
    rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)
SHAPES = {
    "llama-tiny": ("llama", dict(_TINY, rms_norm_eps=1e-5, rope_theta=10000.0)),
    "qwen2-tiny": ("qwen2", dict(_TINY, rms_norm_eps=1e-6, rope_theta=1e6)),
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
    "llama-3.1-8b": ("llama", _LLAMA31_8B),
    "llama-2-13b": ("llama", dict(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)),
    "mistral-7b": ("llama", dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)),
    "qwen2.5-7b": ("qwen2", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)),
    "qwen2.5-14b": ("qwen2", _QWEN25_14B),
    # The 70B-class shapes differ from the 8B and 14B in their widths and depth alone.
    "llama-3.1-70b": ("llama", dict(_LLAMA31_8B, hidden_size=8192, intermediate_size=28672,
                                    num_hidden_layers=80, num_attention_heads=64)),
    "qwen2.5-72b": ("qwen2", dict(_QWEN25_14B, hidden_size=8192, intermediate_size=29568,
                                  num_hidden_layers=80, num_attention_heads=64)),
    "qwen3-moe-tiny": ("qwen3_moe", dict(
        _TINY, rms_norm_eps=1e-6, rope_theta=1e6, head_dim=32, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True)),
}


def shape_config(name: str, n_layer: int | None = None) -> tuple[str, dict]:
  """(family, config.json values) of a shape, with `n_layer` decoder layers if given."""
  family, config = SHAPES[name]
  return family, dict(config, num_hidden_layers=n_layer or config["num_hidden_layers"])


def head_dim(config: dict) -> int:
  return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def count_params(family: str, config: dict, active: bool = False) -> int:
  """Parameters of the model of `config`, from its shape (a tied output
  embedding counted once, as torch's parameters() counts it); `active`: a
  mixture of experts' routed experts only (num_experts_per_tok a token)."""
  D, V, L = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
  hd = head_dim(config)
  q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
  bias = q + 2 * kv if family == "qwen2" else 0  # Qwen2's q, k, v projections have biases
  if family == "qwen3_moe":  # q/k norms, the router, the experts' SwiGLUs
    experts = config["num_experts_per_tok"] if active else config["num_experts"]
    mlp = 2 * hd + D * config["num_experts"] + experts * 3 * D * config["moe_intermediate_size"]
  else:
    mlp = 3 * D * config["intermediate_size"]
  layer = D * q + 2 * D * kv + bias + q * D + mlp + 2 * D
  return V * D * (1 if config["tie_word_embeddings"] else 2) + L * layer + D


def flops_per_token(config: dict, n_active: int, seq_len: int) -> float:
  """jzo's model FLOPs of a training token: 6 N for the matmuls of forward
  and backward (N a mixture of experts' active parameters), 12 L (H
  head_dim) T for attention; recomputation not counted."""
  width = config["num_attention_heads"] * head_dim(config)
  return 6 * n_active + 12 * config["num_hidden_layers"] * width * seq_len


def causal_lm_module(family: str, config: dict, dtype, device: str):
  """transformers' model of `config`, weights of `dtype` drawn on `device`,
  every decoder layer recomputed in the backward pass, wrapped so that it
  maps tokens (B, T + 1) to the mean next-token cross-entropy (float32)."""
  import torch
  import torch.nn.functional as F
  import transformers
  cls, config_cls = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                     "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
                     "qwen3_moe": (transformers.Qwen3MoeForCausalLM,
                                   transformers.Qwen3MoeConfig)}[family]
  hf_config = config_cls(**config, attn_implementation="sdpa", use_cache=False)
  default = torch.get_default_dtype()
  torch.set_default_dtype(dtype)  # what from_config(dtype=...) does: no float32 copy first
  try:
    with torch.device(device):
      model = cls(hf_config)
  finally:
    torch.set_default_dtype(default)
  kwargs = {"use_reentrant": False}
  if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
  else:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
  model.train()

  class CausalLMLoss(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.model = model

    def forward(self, tokens):
      logits = self.model(input_ids=tokens[:, :-1], use_cache=False).logits
      return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
  return CausalLMLoss()


class HostWatch:
  """Samples the resident memory of this process and its children in a
  thread (`peak`, bytes); when the host's available memory falls under
  `min_available`, says so and ends the process group (the point's status
  "killed"), where the kernel's OOM killer might pick another process."""

  def __init__(self, min_available: int, interval: float = 0.2):
    import psutil
    self.process, self.min_available, self.interval = psutil.Process(), min_available, interval
    self.peak = 0
    self._stop = threading.Event()
    threading.Thread(target=self._run, daemon=True).start()

  def _run(self):
    import psutil
    while not self._stop.wait(self.interval):
      try:
        procs = [self.process] + self.process.children(recursive=True)
        self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
      except psutil.Error:  # a child has just ended
        pass
      available = psutil.virtual_memory().available
      if available < self.min_available:  # the last line of the point's detail
        print(f"host RSS peak {self.peak / 2**30:.2f} GiB; the host had {available / 2**30:.2f} "
              "GiB available: stopped before the kernel's OOM killer", file=sys.stderr, flush=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)

  def stop(self) -> float:
    self._stop.set()
    return self.peak / 2**30


def measure(args) -> dict:
  """In a child: builds the model and the system's step, times the steps."""
  import torch
  import transformers
  device = args.device or torch_peers.default_device()
  if device == "cuda":
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
  watch = HostWatch(int(args.min_available_gb * 2**30))
  family, config = shape_config(args.shape, args.n_layer)
  torch.manual_seed(0)
  # DeepSpeed keeps float32 masters on the host: bf16 weights on the GPU.
  dtype = torch.bfloat16 if args.system == "deepspeed" else torch.float32
  ds_config = torch_peers.deepspeed_config(args.micro_batch, args.zero_stage, args.offload_param)
  if args.system == "deepspeed" and args.zero_stage == 3:
    # Each weight partitioned (or offloaded) as it is made: a 70B model's
    # bf16 weights would not fit one GPU whole.
    import deepspeed
    torch_peers.init_deepspeed(device)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
      module = causal_lm_module(family, config, dtype, device)
  else:
    module = causal_lm_module(family, config, dtype, device)
  # ZeRO-3 leaves each process a partition: ds_numel is a weight's whole size.
  n_params = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
  if n_params != count_params(family, config):  # the FLOPs' N must be the model's
    raise AssertionError(f"{n_params} parameters built, {count_params(family, config)} counted")
  step, info = torch_peers.make_step(args.system, module, args.micro_batch, device,
                                     args.zero_stage, ds_config)
  generator = torch.Generator().manual_seed(1)
  tokens = torch.randint(0, config["vocab_size"], (args.micro_batch, args.seq_len + 1),
                         generator=generator).to(device)
  try:
    timed = torch_peers.timed_steps(step, tokens, warmup=args.warmup, steps=args.steps,
                                    device=device)
  except torch.OutOfMemoryError as e:
    return dict(torch_peers.out_of_memory(e), host_rss_peak_gib=watch.stop())
  gpus = torch_peers.world()
  tokens_per_s = gpus * args.micro_batch * args.seq_len / timed["step_s"]
  flops = flops_per_token(config, count_params(family, config, active=True), args.seq_len)
  return dict(timed, status="ok", tokens_per_s=tokens_per_s, flops_per_token=flops,
              tflops=tokens_per_s / gpus * flops / 1e12, gpus=gpus,
              host_rss_gib=harness.host_rss_gib(),
              host_rss_peak_gib=watch.stop(), transformers=transformers.__version__,
              attention=module.model.config._attn_implementation, **info,
              **({"experts": module.model.config._experts_implementation}
                 if family == "qwen3_moe" else {}))


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--shape", default="llama-3.1-8b", choices=list(SHAPES))
  parser.add_argument("--system", choices=torch_peers.SYSTEMS, default="deepspeed")
  parser.add_argument("--seq-len", type=int, default=4096)
  parser.add_argument("--micro-batch", type=int, default=1, help="sequences a GPU a step")
  parser.add_argument("--gpus", type=int, default=1, help="processes, one a GPU (DeepSpeed)")
  parser.add_argument("--zero-stage", type=int, choices=[2, 3], default=2,
                      help="DeepSpeed's ZeRO stage (3: the weights partitioned too)")
  parser.add_argument("--offload-param", action="store_true",
                      help="DeepSpeed ZeRO-3: the bf16 weights on the CPU too (offload_param)")
  parser.add_argument("--n-layer", type=int, help="decoder layers, instead of the shape's")
  parser.add_argument("--steps", type=int, default=10, help="timed steps, after the warm-up")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda where there is one")
  parser.add_argument("--timeout", type=float, default=600, help="seconds the run may take")
  parser.add_argument("--min-available-gb", type=float, default=2.0,
                      help="end the run (status 'killed') when the host has less available")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  torch_peers.require(args.system)
  if args.gpus > 1 and args.system != "deepspeed":
    parser.error("--gpus > 1 is for DeepSpeed (PyTorch alone trains on one GPU)")
  if args.offload_param and (args.system != "deepspeed" or args.zero_stage != 3):
    parser.error("--offload-param is DeepSpeed's, at --zero-stage 3")
  if args.child:
    others = torch_peers.start_ranks(args.gpus)
    point = measure(args)
    for proc in others:
      proc.wait()
    if torch_peers.rank() == 0:
      harness.child_result(point)
    return
  family, config = shape_config(args.shape, args.n_layer)
  about = {"system": args.system, "shape": args.shape, "family": family,
           "n_layer": config["num_hidden_layers"], "n_params": count_params(family, config),
           "micro_batch": args.micro_batch, "seq_len": args.seq_len, "gpus": args.gpus,
           "zero_stage": args.zero_stage, "offload_param": args.offload_param}
  torch_peers.run_and_record(args, "peers_hf", about, args.shape)

if __name__ == "__main__":
  main()
