"""The PyTorch peers on the same GPT shapes: DeepSpeed ZeRO-2 with
offload_optimizer to the CPU, and PyTorch alone (fused AdamW on the GPU).

The model mirrors jzo/models/gpt.py: pre-LN GPT-2 blocks, causal
scaled_dot_product_attention (flash on GPU), tied embeddings, every block
rematerialized (torch.utils.checkpoint); bf16. Reported like
experiments/offload_bench.py: median step time, tokens/s, model TFLOPS
(6 N + 12 L D T per token), peak GPU memory, host RSS.

  python experiments/torch_baselines.py --model gpt2-4b --system deepspeed
  OMP_NUM_THREADS=$(($(nproc) / 2)) python -m torch.distributed.run --standalone \
      --nproc-per-node 2 experiments/torch_baselines.py --model gpt2-1.5b --system deepspeed

Under torchrun each process trains --batch sequences on its GPU; tokens/s
counts every GPU's, model TFLOPS are per GPU. Give each process its share of
the cores: torchrun's default of one OpenMP thread a process runs
DeepSpeed's CPU Adam on one core (2-4x slower at 13B on 2 and 4 GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import psutil
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jzo.models.gpt import PRESETS  # noqa: E402  (shapes only: no JAX code runs)


class Block(nn.Module):
  def __init__(self, d: int, n_head: int):
    super().__init__()
    self.n_head = n_head
    self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
    self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
    self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

  def forward(self, x):  # (B, T, D)
    B, T, D = x.shape
    q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, D // self.n_head).unbind(2)
    att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=True)  # (B, H, T, hs)
    x = x + self.proj(att.transpose(1, 2).reshape(B, T, D))
    return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
  def __init__(self, config):
    super().__init__()
    self.wte = nn.Embedding(config.vocab_size, config.d_model)
    self.wpe = nn.Embedding(config.seq_len, config.d_model)
    self.blocks = nn.ModuleList(Block(config.d_model, config.n_head)
                                for _ in range(config.n_layer))
    self.lnf = nn.LayerNorm(config.d_model)
    for name, p in self.named_parameters():  # GPT-2 initialisation, as jzo/models/gpt.py
      if name.endswith("bias"):
        nn.init.zeros_(p)
      elif p.dim() > 1:
        std = 0.02 / (2 * config.n_layer) ** 0.5 if name.endswith(("proj.weight", "out.weight")) else 0.02
        nn.init.normal_(p, std=std)

  def forward(self, tokens):  # (B, T + 1) -> mean next-token loss
    x = self.wte(tokens[:, :-1]) + self.wpe.weight[:tokens.shape[1] - 1]
    for block in self.blocks:
      x = checkpoint(block, x, use_reentrant=False)
    logits = self.lnf(x) @ self.wte.weight.T
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def deepspeed_engine(model, args):
  import deepspeed
  os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
  os.environ.setdefault("MASTER_PORT", "29511")
  os.environ.setdefault("RANK", "0")
  os.environ.setdefault("LOCAL_RANK", "0")
  os.environ.setdefault("WORLD_SIZE", "1")
  config = {
      "train_micro_batch_size_per_gpu": args.batch,
      "gradient_accumulation_steps": 1,
      "gradient_clipping": 1.0,
      "bf16": {"enabled": True},
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                            "contiguous_gradients": True, "overlap_comm": True,
                            "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
      "steps_per_print": 10**9,
  }
  engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                    config=config)

  def step(tokens):
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    return loss
  return step


def torch_alone(model, args):
  opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)

  def step(tokens):
    with torch.autocast("cuda", dtype=torch.bfloat16):
      loss = model(tokens)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
  return step


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-1.5b")
  parser.add_argument("--system", choices=["deepspeed", "torch"], default="deepspeed")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--n-layer", type=int, help="layers, instead of the preset's")
  parser.add_argument("--json")
  args = parser.parse_args()
  config = PRESETS[args.model]
  config = dataclasses.replace(config, n_layer=args.n_layer or config.n_layer)
  try:
    result = measure(config, args)
  except torch.OutOfMemoryError as e:  # the GPU's memory: a point that does not fit
    result = {"status": "oom", "detail": str(e).splitlines()[:1],
              "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30}
  result = {"system": args.system, "model": args.model, "n_layer": config.n_layer,
            "n_params": config.n_params, "batch": args.batch, "seq_len": args.seq_len,
            "device": torch.cuda.get_device_name(), **result}
  print(json.dumps(result))
  if args.json and int(os.environ.get("RANK", "0")) == 0:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)


def measure(config, args) -> dict:
  """Builds the model and the system's step; times args.steps steps. Under
  torchrun (DeepSpeed on several GPUs, a process each) every process takes
  its own GPU and tokens/s counts them all."""
  torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
  world = int(os.environ.get("WORLD_SIZE", "1"))
  torch.manual_seed(0)
  with torch.device("cuda"):  # initialise on the GPU: fast, and what both systems start from
    model = GPT(config)
  step = deepspeed_engine(model, args) if args.system == "deepspeed" else torch_alone(model, args)
  tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq_len + 1), device="cuda")
  for _ in range(2):
    step(tokens)
  torch.cuda.synchronize()
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    loss = step(tokens)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
  seconds = statistics.median(times)
  tokens_per_s = world * args.batch * args.seq_len / seconds
  return {"step_s": seconds, "times_s": times, "tokens_per_s": tokens_per_s, "gpus": world,
          "tflops": tokens_per_s / world * config.flops_per_token(args.seq_len) / 1e12,
          "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
          "host_rss_gib": psutil.Process().memory_info().rss / 2**30, "loss": float(loss),
          "status": "ok"}


if __name__ == "__main__":
  main()
