"""ZeRO stages 0-3 on 1, 2, 4 or 8 GPUs, with or without offload: throughput
and memory of the same GPT.

For each (GPU count, stage), a fresh process trains the chosen GPT preset with
jzo.ZeroEngine (bf16 compute, AdamW on the GPUs or, with --offload, the C++
AdamW on the host with the delayed update; stage 3 gathering one layer at a
time) at a fixed per-GPU batch, and reports:
  * step time (median of --steps after 2 warm-up steps),
  * tokens/s over all GPUs and model TFLOPS per GPU, counting 6 N + 12 L D T
    FLOPs per token (jzo.models.gpt.GPTConfig.flops_per_token),
  * peak GPU memory of GPU 0 (the allocator's peak_bytes_in_use) and host RSS.
A process per run keeps each peak its own. Then it prints the scaling ratio
tokens/s(N GPUs) / tokens/s(1 GPU) per stage.

  python experiments/zero_stages_bench.py --model gpt2-350m --gpus 1 2 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time

STAGES = (0, 1, 2, 3)


def run_one(args) -> dict:
  """Trains one configuration in this process and returns its figures."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import Mesh

  import jzo
  from jzo.models import gpt

  import psutil

  config = dataclasses.replace(gpt.PRESETS[args.model], seq_len=args.seq_len, remat=args.remat)
  gpus = args.gpus[0]  # a child process runs one GPU count
  devices = jax.devices()[:gpus]
  with jax.default_device(jax.devices("cpu")[0]):  # float32 weights drawn on the host
    params = gpt.init_params(config, jax.random.PRNGKey(0))
  tx = (jzo.cpu_adamw(3e-4, weight_decay=0.1) if args.offload
        else optax.adamw(3e-4, weight_decay=0.1))
  engine = jzo.ZeroEngine(functools.partial(gpt.loss_fn, config), params, tx, stage=args.stage,
                          mesh=Mesh(np.array(devices), ("data",)), max_grad_norm=1.0,
                          layers="blocks" if args.stage == 3 else None, offload=args.offload,
                          delayed_update=args.offload, dpu_warmup=1,
                          host_memory=int(args.host_memory_gb * 2**30) or None)
  del params
  batch_size = args.batch_per_gpu * gpus
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch_size, args.seq_len + 1), 0,
                              config.vocab_size, jnp.int32)
  batch = {"tokens": tokens}
  for _ in range(3):  # compile, warm up (and start the delayed updates)
    jax.block_until_ready(engine.step(batch))
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    metrics = engine.step(batch)
    jax.block_until_ready(metrics)  # host sync: each step timed on its own
    times.append(time.perf_counter() - start)
  seconds = statistics.median(times)
  tokens_per_s = batch_size * args.seq_len / seconds
  return {
      "model": args.model, "n_params": config.n_params, "gpus": gpus, "stage": args.stage,
      "batch_per_gpu": args.batch_per_gpu, "seq_len": args.seq_len, "step_s": seconds,
      "times_s": times, "tokens_per_s": tokens_per_s,
      "tflops_per_gpu": tokens_per_s * config.flops_per_token() / gpus / 1e12,
      "peak_gpu_gib": (devices[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30,
      "host_rss_gib": psutil.Process().memory_info().rss / 2**30, "offload": args.offload,
      "loss": float(metrics.loss), "device": devices[0].device_kind,
  }


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-350m")
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--batch-per-gpu", type=int, default=8)
  parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
  parser.add_argument("--stages", type=int, nargs="+", default=list(STAGES))
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--remat", default="full", help="the model's remat policy")
  parser.add_argument("--offload", action="store_true",
                      help="ZeRO-Offload with the delayed update (jzo.cpu_adamw on the host)")
  parser.add_argument("--host-memory-gb", type=float, default=0.0,
                      help="host RAM offload may use (0: what the OS reports available)")
  parser.add_argument("--json", help="also write the results here")
  parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)  # child process: one run
  return parser.parse_args()


def main():
  args = parse_args()
  if args.stage is not None:
    print(json.dumps(run_one(args)))
    return
  results = []
  for gpus in args.gpus:
    for stage in args.stages:
      cmd = [sys.executable, __file__, "--model", args.model, "--seq-len", str(args.seq_len),
             "--batch-per-gpu", str(args.batch_per_gpu), "--gpus", str(gpus),
             "--steps", str(args.steps), "--stage", str(stage), "--remat", args.remat,
             "--host-memory-gb", str(args.host_memory_gb)] + (["--offload"] if args.offload else [])
      env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, range(gpus))))
      out = subprocess.run(cmd, capture_output=True, text=True, env=env)
      if out.returncode:
        print(f"gpus={gpus} stage={stage} failed:\n{out.stderr[-3000:]}", flush=True)
        continue
      results.append(json.loads(out.stdout.strip().splitlines()[-1]))
      r = results[-1]
      print(f"gpus={gpus} stage={stage}: {r['step_s'] * 1e3:.1f} ms/step, "
            f"{r['tokens_per_s']:.0f} tokens/s, {r['tflops_per_gpu']:.0f} TFLOPS/GPU, "
            f"peak {r['peak_gpu_gib']:.1f} GiB", flush=True)
  print(f"\n{'gpus':>4} {'stage':>5} {'ms/step':>8} {'tokens/s':>9} {'TFLOPS/GPU':>10} "
        f"{'peak GiB':>8} {'x 1 GPU':>7}")
  one_gpu = {r["stage"]: r["tokens_per_s"] for r in results if r["gpus"] == 1}
  for r in results:
    ratio = r["tokens_per_s"] / one_gpu[r["stage"]] if r["stage"] in one_gpu else float("nan")
    r["ratio_to_1_gpu"] = ratio
    print(f"{r['gpus']:>4} {r['stage']:>5} {r['step_s'] * 1e3:8.1f} {r['tokens_per_s']:9.0f} "
          f"{r['tflops_per_gpu']:10.1f} {r['peak_gpu_gib']:8.2f} {ratio:7.2f}")
  if results:
    print(f"model {args.model} ({results[0]['n_params'] / 1e6:.0f}M params), seq "
          f"{args.seq_len}, batch {args.batch_per_gpu}/GPU, {results[0]['device']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
