"""PyTorch alone and DeepSpeed ZeRO-2 with offload_optimizer to the CPU,
training the GPT shapes benchmarks/train_gpt.py trains in jzo.

The model mirrors jzo.models.gpt: pre-LN GPT-2 blocks, causal
scaled_dot_product_attention (flash on a GPU), tied embeddings, every block
rematerialized (torch.utils.checkpoint), bf16 compute. The systems are
benchmarks/torch_peers.py's. Reported as train_gpt.py reports: the median
step after 2 warm-up steps, tokens/s, model TFLOPS a GPU (6 N + 12 L D T a
token), the GPU peak (torch.cuda.max_memory_allocated), the host RSS peak.
The measurement runs in a child process (a time limit; a GPU or host out of
memory recorded as the point's status).

With --gpus N, N processes train --batch sequences each (one a GPU, each
with 1/N of the host's cores): tokens/s counts every GPU's.

  python3 benchmarks/peers_gpt.py --model gpt2-4b --system deepspeed --batch 8 --steps 4
  python3 benchmarks/peers_gpt.py --model gpt2-13b --system deepspeed --gpus 4 --steps 2
  python3 benchmarks/peers_gpt.py --model tiny --system torch --seq-len 32 --batch 2 --steps 1
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import harness
import torch_peers


def gpt_module(config, device: str, dtype):
  """jzo.models.gpt's model of `config` in PyTorch: tokens (B, T + 1) -> the
  mean next-token loss. Weights drawn on `device` in `dtype`."""
  import torch
  import torch.nn.functional as F
  from torch import nn
  from torch.utils.checkpoint import checkpoint

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
    def __init__(self):
      super().__init__()
      self.wte = nn.Embedding(config.vocab_size, config.d_model)
      self.wpe = nn.Embedding(config.seq_len, config.d_model)
      self.blocks = nn.ModuleList(Block(config.d_model, config.n_head)
                                  for _ in range(config.n_layer))
      self.lnf = nn.LayerNorm(config.d_model)
      scaled = 0.02 / (2 * config.n_layer) ** 0.5  # GPT-2's, as jzo.models.gpt
      for name, p in self.named_parameters():
        if name.endswith("bias"):
          nn.init.zeros_(p)
        elif p.dim() > 1:
          nn.init.normal_(p, std=scaled if name.endswith(("proj.weight", "out.weight")) else 0.02)

    def forward(self, tokens):  # (B, T + 1)
      x = self.wte(tokens[:, :-1]) + self.wpe.weight[:tokens.shape[1] - 1]
      for block in self.blocks:
        x = checkpoint(block, x, use_reentrant=False)
      logits = self.lnf(x) @ self.wte.weight.T
      return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

  default = torch.get_default_dtype()
  torch.set_default_dtype(dtype)
  try:
    with torch.device(device):
      return GPT()
  finally:
    torch.set_default_dtype(default)


def measure(args) -> dict:
  """In a child (one rank with --gpus > 1): builds the model and the
  system's step, times the steps; the point."""
  import torch
  from jzo.models.gpt import PRESETS  # shapes only: no JAX code runs
  config = PRESETS[args.model]
  config = dataclasses.replace(config, seq_len=args.seq_len,
                               n_layer=args.n_layer or config.n_layer)
  device = args.device or torch_peers.default_device()
  if device == "cuda":
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
  torch.manual_seed(0)
  # DeepSpeed keeps float32 masters on the host: bf16 weights on the GPU.
  dtype = torch.bfloat16 if args.system == "deepspeed" else torch.float32
  module = gpt_module(config, device, dtype)
  step, info = torch_peers.make_step(args.system, module, args.batch, device)
  tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq_len + 1), device=device)
  try:
    timed = torch_peers.timed_steps(step, tokens, warmup=2, steps=args.steps, device=device)
  except torch.OutOfMemoryError as e:
    return torch_peers.out_of_memory(e)
  gpus = torch_peers.world()
  tokens_per_s = gpus * args.batch * args.seq_len / timed["step_s"]
  flops = config.flops_per_token(args.seq_len)
  return dict(timed, status="ok", tokens_per_s=tokens_per_s, flops_per_token=flops,
              tflops=tokens_per_s / gpus * flops / 1e12, gpus=gpus,
              n_params=config.n_params, host_rss_gib=harness.host_rss_gib(),
              host_rss_peak_gib=harness.host_peak_rss_gib(), **info)


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--model", default="gpt2-1.5b", help="a preset of jzo.models.gpt")
  parser.add_argument("--system", choices=torch_peers.SYSTEMS, default="deepspeed")
  parser.add_argument("--batch", type=int, default=8, help="micro-batch (sequences a GPU)")
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--steps", type=int, default=4, help="timed steps, after 2 warm-up")
  parser.add_argument("--n-layer", type=int, help="layers, instead of the preset's")
  parser.add_argument("--gpus", type=int, default=1, help="processes, one a GPU")
  parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda where there is one")
  parser.add_argument("--timeout", type=float, default=600, help="seconds the run may take")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  torch_peers.require(args.system)
  if args.gpus > 1 and args.system != "deepspeed":
    parser.error("--gpus > 1 is for DeepSpeed (PyTorch alone trains on one GPU)")
  if args.child:
    others = torch_peers.start_ranks(args.gpus)
    point = measure(args)
    for proc in others:
      proc.wait()
    if torch_peers.rank() == 0:
      harness.child_result(point)
    return
  from jzo.models.gpt import PRESETS
  config = PRESETS[args.model]
  config = dataclasses.replace(config, n_layer=args.n_layer or config.n_layer)
  about = {"system": args.system, "model": args.model, "n_layer": config.n_layer,
           "n_params": config.n_params, "batch": args.batch, "seq_len": args.seq_len}
  torch_peers.run_and_record(args, "peers_gpt", about, args.model)

if __name__ == "__main__":
  main()
