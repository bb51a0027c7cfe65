"""Host passes of host accumulation, alone on the host: the float32 sum of a
bf16 micro-batch gradient (first: write; later: add) and the fused AdamW
step over the float32 sums with bf16 moments, each on N elements, in
elements/s and bytes/s of memory traffic (write 6, add 10, Adam 20 B an
element). Tells whether a slow sum in a training step is the kernel or the
machine beside it (transfers, the update thread's other work).

  python experiments/host_sums_bench.py [--log2n 29] [--repeats 5]
"""

import argparse
import time

import ml_dtypes
import numpy as np

from jzo import kernels


def timed(fn, repeats: int) -> float:
  fn()  # warm-up: first touch of the pages
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--log2n", type=int, default=29)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  n = 1 << args.log2n
  acc = kernels.aligned_empty(n, np.float32)
  grad = kernels.aligned_empty(n, ml_dtypes.bfloat16)
  master = kernels.aligned_empty(n, np.float32)
  mu = kernels.aligned_empty(n, ml_dtypes.bfloat16)
  nu = kernels.aligned_empty(n, ml_dtypes.bfloat16)
  for a in (acc, grad, master, mu, nu):
    a[...] = 0
  print(f"n = 2^{args.log2n}, {kernels.num_threads()} threads, SIMD {kernels.simd_level()}")
  passes = {
      "sum, first (write)": (6, lambda: kernels.accumulate_(acc, grad, add=False)),
      "sum, add": (10, lambda: kernels.accumulate_(acc, grad, add=True)),
      "adamw over the sums": (20, lambda: kernels.adam_step_(
          master, acc, mu, nu, learning_rate=1e-4, count=1, weight_decay=0.1)),
  }
  for name, (bytes_per, fn) in passes.items():
    s = timed(fn, args.repeats)
    print(f"{name:<22} {s:7.3f} s  {n / s / 1e9:6.2f} Gelem/s  {bytes_per * n / s / 1e9:6.1f} GB/s")


if __name__ == "__main__":
  main()
