"""ZeRO stages 0-3 over GPU counts, with or without offload: the throughput
and memory of the same GPT, and how each stage scales.

For each GPU count of --gpus and stage of --stages a fresh process (a child
of benchmarks/train_gpt.py) trains --model with jzo.ZeroEngine over that
many GPUs at --batch-per-gpu sequences each: AdamW on the GPUs, or with
--offload the C++ AdamW on the host with the delayed update (all of the
optimizer state there); stage 3 gathers one layer at a time. Reported: the
median step, tokens/s over all GPUs, model TFLOPS a GPU (6 N + 12 L D T a
token), GPU 0's peak, the host RSS, and tokens/s over the same stage's on
one GPU ("x 1 GPU"; linear is the GPU count).

  python3 benchmarks/zero_stages.py --model gpt2-1.5b --gpus 1 2 4 --stages 1 2 3 --steps 5
  python3 benchmarks/zero_stages.py --model tiny --seq-len 32 --batch-per-gpu 2 --gpus 1 \\
      --stages 2 --steps 1     # a CPU
"""

from __future__ import annotations

import os
import sys

import harness

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--model", default="gpt2-350m", help="a preset of jzo.models.gpt")
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--batch-per-gpu", type=int, default=8)
  parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
  parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--remat", default="full", help="the model's remat policy")
  parser.add_argument("--offload", action="store_true",
                      help="ZeRO-Offload with the delayed update (the C++ AdamW on the host)")
  parser.add_argument("--host-memory-gb", type=float, help="host RAM offload may use "
                      "(default: what the OS reports available)")
  parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take")
  args = parser.parse_args()
  points = []
  for gpus in args.gpus:
    for stage in args.stages:
      cmd = [sys.executable, os.path.join(HERE, "train_gpt.py"),
             "--child", "offload_dpu" if args.offload else "device", "--model", args.model,
             "--seq-len", str(args.seq_len), "--batch", str(args.batch_per_gpu),
             "--gpus", str(gpus), "--stage", str(stage), "--steps", str(args.steps),
             "--remat", args.remat, "--no-breakdown"]
      if args.host_memory_gb:
        cmd += ["--host-memory-gb", str(args.host_memory_gb)]
      (point,) = harness.run_child(cmd, timeout_s=args.timeout)
      points.append(dict(point, gpus=gpus, stage=stage, model=args.model))
  one_gpu = {p["stage"]: p["tokens_per_s"] for p in points
             if p["gpus"] == 1 and p["status"] == "ok"}
  print(f"{'gpus':>4} {'stage':>5} {'s/step':>7} {'tokens/s':>9} {'TFLOPS/GPU':>10} "
        f"{'peak GiB':>8} {'x 1 GPU':>7}")
  for p in points:
    if p["status"] != "ok":
      print(f"{p['gpus']:>4} {p['stage']:>5} {p['status']}: {(p.get('detail') or [''])[-1]}")
      continue
    if p["stage"] in one_gpu:
      p["x_one_gpu"] = p["tokens_per_s"] / one_gpu[p["stage"]]
    print(f"{p['gpus']:>4} {p['stage']:>5} {p['step_s']:7.3f} {p['tokens_per_s']:9.0f} "
          f"{p['tflops']:10.1f} {p['peak_gpu_gib']:8.2f} {p.get('x_one_gpu', float('nan')):7.3f}")
  harness.write_record(args.json, "zero_stages", args, points, with_devices=False)
  harness.child_result(points)


if __name__ == "__main__":
  main()
