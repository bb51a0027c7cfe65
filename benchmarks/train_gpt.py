"""jzo training a GPT preset: step time, model TFLOPS, the step's parts, and
the GPU peak and host RSS against the planner's figures.

Each configuration of --configs runs in a fresh process of its own (its own
GPU peak and host RSS):
  device       ZeroEngine, optax.adamw on the GPU (no offload);
  offload      all of the optimizer state on the host: fp32 masters and Adam
               moments in host RAM, the C++ AdamW there, bf16 weights back;
  offload_dpu  the same with the one-step delayed parameter update;
  auto         offload="auto": as much of the state on the GPU as fits
               (jzo.estimate's plan), the rest on the host;
  auto_dpu     the same with the delayed update of the host part.

Reported a micro-batch of --batch: the median step over --steps after 3 to
compile and warm up, tokens/s, model TFLOPS a GPU (6 N + 12 L D T a token,
recomputation not counted), the GPU peak (the allocator's; 0 on a CPU), the
host RSS (before the engine, now, and its peak), the plan's GPU peak (step
and build) and host total beside them. With offload, the step's parts: the
host update (the C++ kernel) and the exchange left after it; unless
--no-breakdown, the device step alone (run without the host side) and, on a
GPU, the pinned bandwidth of the engine's own transfers (all host parts
down, then up). With --grad-accum K and --accumulation host, the host's
summing passes and the time the engine waited for micro-batches' gradients.

With --gpus N one process spans N GPUs (--batch sequences a GPU): tokens/s
counts them all, TFLOPS are a GPU's, the GPU peak is GPU 0's.

  python3 benchmarks/train_gpt.py --model gpt2-1.5b --batch 8 --json out.json
  python3 benchmarks/train_gpt.py --model gpt2-20b --stage 3 --grads-in-params \\
      --moments int8 --batch 32 --configs offload --steps 3 --compiled-memory
  python3 benchmarks/train_gpt.py --model tiny --seq-len 32 --batch 2 --steps 1  # CPU
"""

import engine_runs

if __name__ == "__main__":
  engine_runs.main(__doc__, engine_runs.GPT, "train_gpt")
