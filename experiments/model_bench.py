"""Speed of the recipe's training step without offload, by attention
implementation and rematerialization policy, against the bf16 matmul ceiling
measured in the same run.

Each variant builds its engine with `jzo.recipe.loop.make_engine` (the recipe's own
code path: ZeroEngine, jzo.cpu_adamw on the device, bf16, clip 1.0) in a fresh
process (its own peak GPU memory) and times `--steps` steps after warm-up,
dispatched back to back as the recipe does. Reported: ms/step, tokens/s,
model TFLOPS (6 N + 12 L D T per token) and MFU against the ceiling, which
each process measures first.

  python experiments/model_bench.py --model gpt2-1.5b --batch 8 \
      --variants xla/full cudnn/full cudnn/dots cudnn/none --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time


def run_one(args) -> dict:
  import jax
  import numpy as np

  from jzo import train
  from jzo.models import gpt
  from jzo.recipe import logs, loop, models

  # The ceiling first, in this process (the parent never touches the GPU:
  # JAX there would take most of its memory from the children).
  ceiling = logs.matmul_tflops(jax.devices()[0])

  attention, remat = args.variant.split("/")
  cfg = train.TrainConfig(model=args.model, seq_len=args.seq_len, batch_size=args.batch,
                          stage=args.stage, offload=False, remat=remat)
  model = dataclasses.replace(gpt.PRESETS[args.model], seq_len=args.seq_len, remat=remat,
                              attention=attention)
  recipe_model = dataclasses.replace(models.PRESETS[args.model], config=model)
  engine = loop.make_engine(cfg, recipe_model, None, jax.devices()[:1], args.batch)
  rng = np.random.default_rng(0)
  batch = {"tokens": rng.integers(0, model.vocab_size, (args.batch, args.seq_len + 1),
                                  dtype=np.int32)}
  for _ in range(3):  # compile and warm up
    jax.block_until_ready(engine.step(batch).loss)
  start = time.perf_counter()
  for _ in range(args.steps):
    metrics = engine.step(batch)
  jax.block_until_ready(metrics.loss)
  seconds = (time.perf_counter() - start) / args.steps
  tokens_per_s = args.batch * args.seq_len / seconds
  stats = jax.devices()[0].memory_stats() or {}  # the CPU backend reports none
  tflops = tokens_per_s * model.flops_per_token() / 1e12
  return {"variant": args.variant, "model": args.model, "stage": args.stage,
          "ceiling_tflops": ceiling, "mfu": tflops / ceiling,
          "batch": args.batch, "seq_len": args.seq_len, "step_s": seconds,
          "tokens_per_s": tokens_per_s,
          "tflops": tflops,
          "peak_gpu_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
          "device": jax.devices()[0].device_kind}


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-1.5b")
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--stage", type=int, default=2)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--variants", nargs="+", default=["xla/full", "cudnn/full", "cudnn/dots",
                                                        "cudnn/none"],
                      help="attention/remat pairs: attention xla|cudnn|auto, remat full|dots|none")
  parser.add_argument("--json")
  parser.add_argument("--variant", help=argparse.SUPPRESS)  # child process: one run
  return parser.parse_args()


def main():
  args = parse_args()
  if args.variant:
    print(json.dumps(run_one(args)))
    return
  results = []
  for variant in args.variants:
    cmd = [sys.executable, __file__, "--variant", variant, "--model", args.model,
           "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--stage",
           str(args.stage), "--steps", str(args.steps)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
      print(f"{variant} failed:\n{out.stderr[-3000:]}", flush=True)
      continue
    result = json.loads(out.stdout.strip().splitlines()[-1])
    results.append(result)
    print(json.dumps(result), flush=True)
  print(f"\n{'attention/remat':<16} {'ms/step':>8} {'tokens/s':>9} {'TFLOPS':>7} {'MFU':>6} "
        f"{'ceiling':>8} {'GPU GiB':>8}")
  for r in results:
    print(f"{r['variant']:<16} {1e3 * r['step_s']:8.1f} {r['tokens_per_s']:9.0f} "
          f"{r['tflops']:7.1f} {r['mfu']:6.1%} {r['ceiling_tflops']:8.0f} {r['peak_gpu_gib']:8.2f}")
  print(f"{args.model}, stage {args.stage}, micro-batch {args.batch}, seq {args.seq_len}; "
        "MFU against the bf16 matmul TFLOPS (ceiling) measured in the same process")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
