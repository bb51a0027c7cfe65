"""What one host optimizer's step pays for running right after another's, in one process.

cpu_adam_bench.py's systems take turns in one process. Session 42 read jzo's
fp32 kernel there at 2^22 on 16 threads at 2.6-3.4 Gparam/s, where a process
of its own had run it at 11.8 (kernel_vs_torch.py, session 27). This probe
holds jzo's kernel (fp32 gradients) and torch's fused AdamW at 2^N
parameters on `--threads` CPUs and times jzo's steps, step by step, in three
kinds of turn, ROUNDS each, in turn:

  settled      after 0.2 s idle and one untimed step;
  after torch  right after STEPS torch steps;
  after jzo    right after STEPS jzo steps (back to back, the kernel's best case).

Printed: each kind's median ms over all its steps, and over each step index
in a turn (how long the effect lasts).

  python experiments/turns_probe.py --sizes 20 22 24 --threads 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_adam_bench as bench  # noqa: E402

STEPS = 8
ROUNDS = 15


def timed(system: bench.System, steps: int) -> list[float]:
  """Seconds of each of `steps` steps."""
  out = []
  for _ in range(steps):
    start = time.perf_counter()
    system.step()
    out.append(time.perf_counter() - start)
  return out


def probe(log2_n: int) -> None:
  n = 2**log2_n
  jzo, torch = bench.jzo_system(n), bench.torch_system(n, impl="fused")
  for _ in range(bench.WARMUP):
    jzo.step()
    torch.step()
  turns = {"settled": [], "after torch": [], "after jzo": []}
  for _ in range(ROUNDS):
    time.sleep(0.2)
    jzo.step()
    turns["settled"].append(timed(jzo, STEPS))
    timed(torch, STEPS)
    turns["after torch"].append(timed(jzo, STEPS))
    turns["after jzo"].append(timed(jzo, STEPS))
  for kind, runs in turns.items():
    by_index = " ".join(f"{statistics.median(r[i] for r in runs) * 1e3:.2f}" for i in range(STEPS))
    median = statistics.median(t for r in runs for t in r)
    print(f"2^{log2_n} {kind:<12} median {median * 1e3:7.3f} ms ({n / median / 1e9:6.2f} Gparam/s);"
          f" by step: {by_index}", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=int, nargs="+", default=[20, 22, 24])
  parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
  args = parser.parse_args()
  if bench.torch is None:
    raise SystemExit("turns_probe.py needs torch")
  bench.use_threads(args.threads)
  for log2_n in args.sizes:
    probe(log2_n)


if __name__ == "__main__":
  main()
