"""Does where the host state's arrays lie change the fp32 kernel's speed?

The same fp32 AdamW step (`kernels.adam_step_`, fp32 gradients) over 2^N
parameters whose four arrays come from one of:

  np4k  numpy's allocation, page-aligned (as `kernels.aligned_empty` made
        them before session 41; numpy advises large ones MADV_HUGEPAGE:
        the part of each array from its first 2 MiB boundary is in huge
        pages)
  np2m  `kernels.aligned_empty`: the same, started on a 2 MiB boundary
        (the whole array in huge pages)
  mmap  a private anonymous mapping advised MADV_HUGEPAGE, 2 MiB aligned

All three systems live in one process and take turns, ROUNDS rounds in
alternating order; each turn is the median of at least a second of steps.
Prints Gparam/s per system: the median over rounds, then each round's.

  python experiments/huge_pages_probe.py 22 24 26   # one process per size is steadier
"""

from __future__ import annotations

import mmap
import statistics
import sys
import time

import numpy as np

import cpu_adam_bench as bench
from jzo import kernels

ROUNDS = 6


def aligned(raw: np.ndarray, n: int, dtype, alignment: int) -> np.ndarray:
  """n values of dtype in raw's bytes from its first `alignment` boundary."""
  start = -raw.ctypes.data % alignment
  return raw[start:start + n * np.dtype(dtype).itemsize].view(dtype)


def page_aligned(n: int, dtype) -> np.ndarray:
  return aligned(np.empty(n * np.dtype(dtype).itemsize + 4096, np.uint8), n, dtype, 4096)


def via_mmap(n: int, dtype) -> np.ndarray:
  region = mmap.mmap(-1, n * np.dtype(dtype).itemsize + kernels.HUGE_PAGE,
                     flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  region.madvise(mmap.MADV_HUGEPAGE)
  return aligned(np.frombuffer(region, np.uint8), n, dtype, kernels.HUGE_PAGE)


ALLOCATORS = {"np4k": page_aligned, "np2m": kernels.aligned_empty, "mmap": via_mmap}


def system(n: int, kind: str):
  """A step of the kernel over arrays from ALLOCATORS[kind] (cpu_adam_bench's values)."""
  arrays = []
  for values in bench.random_state(n, seed=0):
    array = ALLOCATORS[kind](n, values.dtype)
    array[...] = values
    arrays.append(array)
  count = [0]

  def step():
    count[0] += 1
    kernels.adam_step_(*arrays, learning_rate=bench.LR, count=count[0], b1=bench.BETAS[0],
                       b2=bench.BETAS[1], eps=bench.EPS, weight_decay=bench.WEIGHT_DECAY)
  return step


def seconds(step, least: float = 1.0) -> float:
  for _ in range(3):
    step()
  times = []
  while sum(times) < least or len(times) < 5:
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> None:
  for log2_n in map(int, sys.argv[1:]):
    n = 2**log2_n
    systems = {kind: system(n, kind) for kind in ALLOCATORS}
    times = {kind: [] for kind in ALLOCATORS}
    order = list(ALLOCATORS)
    for r in range(ROUNDS):
      for kind in order if r % 2 == 0 else order[::-1]:
        times[kind].append(seconds(systems[kind]))
    rate = lambda t: n / t / 1e9
    print(f"2^{log2_n}: " + ", ".join(f"{kind} {rate(statistics.median(t)):.3f}"
                                     for kind, t in times.items()) + " Gparam/s", flush=True)
    for kind, t in times.items():
      print(f"  {kind} rounds: {[round(rate(x), 3) for x in t]}")
    del systems


if __name__ == "__main__":
  main()
