"""One host AdamW step run back to back for a few seconds in a fresh process: is it steady?

kernel_vs_torch.py's children run one system for about a second and report
the median step. On the H200 machines' Xeon (16 threads) its jzo children
ran 2^22 at 4.5 Gparam/s where turns_probe.py, in a process that also held
torch, ran the same kernel at 10.5 (session 44, call 2; fresh machines in
calls 3-4 did not reproduce it: RESULTS.md). This prints the median step of
each WINDOW_S window, so that a speed that changes over time shows.

  python experiments/sustained_probe.py --system jzo --size 22 --threads 16 [--prefetch-above -1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_adam_bench as bench  # noqa: E402
from kernel_vs_torch import SYSTEMS  # noqa: E402
from jzo import kernels  # noqa: E402

WINDOW_S = 0.25


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--system", choices=SYSTEMS, default="jzo")
  parser.add_argument("--size", type=int, default=22, help="log2 of the parameter count")
  parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
  parser.add_argument("--seconds", type=float, default=2.0)
  parser.add_argument("--prefetch-above", type=int, help="jzo's bound (bytes; -1 never, 0 always)")
  parser.add_argument("--torch-first", action="store_true",
                      help="run WARMUP steps of torch's fused AdamW (2^size) before, as turns_probe does")
  args = parser.parse_args()
  bench.use_threads(args.threads)
  if args.prefetch_above is not None:
    kernels.set_prefetch_above(args.prefetch_above)
  n = 2**args.size
  if args.torch_first:
    torch_system = bench.torch_system(n, impl="fused")
    for _ in range(bench.WARMUP):
      torch_system.step()
  s = bench.named_system(args.system, n)
  for _ in range(bench.WARMUP):
    s.step()
  windows, times, begin = [], [], time.perf_counter()
  window_end = begin + WINDOW_S
  while time.perf_counter() - begin < args.seconds:
    start = time.perf_counter()
    s.step()
    end = time.perf_counter()
    times.append(end - start)
    if end >= window_end:
      windows.append(statistics.median(times))
      times, window_end = [], end + WINDOW_S
  label = f"{args.system} 2^{args.size} {args.threads} threads"
  if args.prefetch_above is not None:
    label += f" prefetch_above {args.prefetch_above}"
  if args.torch_first:
    label += ", torch's steps first"
  print(f"{label}: Gparam/s by {WINDOW_S} s window: "
        + " ".join(f"{n / w / 1e9:.2f}" for w in windows), flush=True)


if __name__ == "__main__":
  main()
