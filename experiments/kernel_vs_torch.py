"""jzo's fused fp32 AdamW kernel against torch's fused AdamW, each in a process of its own.

cpu_adam_bench.py times every system in one process, taking turns. On a
small shared VM that read 0.69 one run and 1.02 the next at 2^20 (issue 26):
the host's speed drifts over seconds, and what one system leaves running
(torch's OpenMP workers spin for a while after each step, on the same CPUs)
falls on the next one. Here each measurement is a fresh process holding one
optimizer only, and the two run in pairs, one right after the other, in
alternating order: the ratio of a pair is side by side in time, and the
median over pairs, with its spread, is the figure.

A child process (`--child jzo|torch`) sets up cpu_adam_bench's system for
2^N parameters on `--threads` CPUs, runs WARMUP untimed steps and prints
the median seconds of the timed ones: at least `--steps`, and at least
MIN_SECONDS of them (many more than --steps at the small sizes).

  python experiments/kernel_vs_torch.py --sizes 16 18 20 22 24 26 28 --pairs 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ("jzo", "torch")
MIN_SECONDS = 1.0


def child(system: str, log2_n: int, threads: int, steps: int) -> None:
  """Prints {"median_s": ...} for one system's timed steps."""
  sys.path.insert(0, HERE)
  import cpu_adam_bench as bench

  bench.use_threads(threads)
  n = 2**log2_n
  s = bench.jzo_system(n) if system == "jzo" else bench.torch_system(n, impl="fused")
  for _ in range(bench.WARMUP):
    s.step()
  times = []
  while len(times) < steps or sum(times) < MIN_SECONDS:
    start = time.perf_counter()
    s.step()
    times.append(time.perf_counter() - start)
  print(json.dumps({"median_s": statistics.median(times)}))


def run_child(system: str, log2_n: int, args: argparse.Namespace) -> float:
  out = subprocess.run([sys.executable, __file__, "--child", system, "--sizes", str(log2_n),
                        "--threads", str(args.threads), "--steps", str(args.steps)],
                       check=True, capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])["median_s"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=int, nargs="+", default=[16, 18, 20, 22, 24, 26, 28],
                      help="log2 of the parameter counts")
  parser.add_argument("--pairs", type=int, default=9, help="pairs of processes per size")
  parser.add_argument("--steps", type=int, default=50, help="timed steps per process")
  parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                      help="CPUs (and threads) of each process (default: all available)")
  parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
  parser.add_argument("--json", metavar="PATH", help="also write the results here")
  args = parser.parse_args()
  if args.child:
    return child(args.child, args.sizes[0], args.threads, args.steps)

  print(f"{'N':>5} {'jzo Gparam/s':>13} {'torch Gparam/s':>15} {'ratio (median)':>15} "
        f"{'min':>6} {'max':>6} {'pairs >= 1':>11}", flush=True)
  rows = []
  for log2_n in args.sizes:
    n, ratios, seconds = 2**log2_n, [], {s: [] for s in SYSTEMS}
    for p in range(args.pairs):
      order = SYSTEMS if p % 2 == 0 else SYSTEMS[::-1]
      pair = {s: run_child(s, log2_n, args) for s in order}
      for s in SYSTEMS:
        seconds[s].append(pair[s])
      ratios.append(pair["torch"] / pair["jzo"])  # jzo's params/s over torch's
    speed = {s: n / statistics.median(seconds[s]) / 1e9 for s in SYSTEMS}
    row = {"log2_n": log2_n, "gparams": speed, "ratios": ratios,
           "median_ratio": statistics.median(ratios), "seconds": seconds}
    rows.append(row)
    print(f"{'2^' + str(log2_n):>5} {speed['jzo']:13.3f} {speed['torch']:15.3f} "
          f"{row['median_ratio']:15.2f} {min(ratios):6.2f} {max(ratios):6.2f} "
          f"{sum(r >= 1 for r in ratios):>5} of {len(ratios)}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"threads": args.threads, "steps": args.steps, "pairs": args.pairs,
                 "cpu": os.uname().machine, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
