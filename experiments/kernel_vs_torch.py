"""Two host AdamW steps side by side, each in a process of its own.

By default jzo's fused fp32 kernel against torch's fused AdamW.

cpu_adam_bench.py times every system in one process, taking turns. On a
small shared VM that read 0.69 one run and 1.02 the next at 2^20 (issue 26):
the host's speed drifts over seconds, and what one system leaves running
(torch's OpenMP workers spin for a while after each step, on the same CPUs)
falls on the next one. Here each measurement is a fresh process holding one
optimizer only, and the two run in pairs, one right after the other, in
alternating order: the ratio of a pair is side by side in time, and the
median over pairs, with its spread, is the figure.

The systems (`--pair A B`, ratio: A's parameters per second over B's):
  jzo          jzo's kernel on float32 gradients (cpu_adam_bench's "jzo fp32");
  torch        torch.optim.AdamW(fused=True);
  engine-M     jzo's kernel as the offload engine runs it: bf16 gradients, a
               bf16 copy of the new weights, moments M (fp32, bf16 or int8).

A child process (`--child SYSTEM`) sets up cpu_adam_bench's system for
2^N parameters on `--threads` CPUs, runs WARMUP untimed steps and prints
the median seconds of the timed ones: at least `--steps`, and at least
MIN_SECONDS of them (many more than --steps at the small sizes).

  python experiments/kernel_vs_torch.py --sizes 16 18 20 22 24 26 28 --pairs 9
  python experiments/kernel_vs_torch.py --pair engine-int8 engine-fp32 --sizes 26 28
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
SYSTEMS = ("jzo", "torch", "engine-fp32", "engine-bf16", "engine-int8")
MIN_SECONDS = 1.0


def child(system: str, log2_n: int, threads: int, steps: int) -> None:
  """Prints {"median_s": ...} for one system's timed steps."""
  sys.path.insert(0, HERE)
  import cpu_adam_bench as bench

  bench.use_threads(threads)
  n = 2**log2_n
  s = bench.named_system(system, n)
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
  parser.add_argument("--pair", nargs=2, choices=SYSTEMS, default=["jzo", "torch"],
                      metavar=("A", "B"), help="the two systems (%(choices)s); "
                      "the ratio is A's speed over B's (default: jzo torch)")
  parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
  parser.add_argument("--json", metavar="PATH", help="also write the results here")
  args = parser.parse_args()
  if args.child:
    return child(args.child, args.sizes[0], args.threads, args.steps)

  a, b = args.pair
  if a == b:
    parser.error(f"--pair needs two different systems, got {a} twice")
  print(f"{'N':>5} {a + ' Gparam/s':>22} {b + ' Gparam/s':>22} {'ratio (median)':>15} "
        f"{'min':>6} {'max':>6} {'pairs >= 1':>11}", flush=True)
  rows = []
  for log2_n in args.sizes:
    n, ratios, seconds = 2**log2_n, [], {a: [], b: []}
    for p in range(args.pairs):
      order = (a, b) if p % 2 == 0 else (b, a)
      pair = {s: run_child(s, log2_n, args) for s in order}
      for s in order:
        seconds[s].append(pair[s])
      ratios.append(pair[b] / pair[a])  # a's params/s over b's
    speed = {s: n / statistics.median(seconds[s]) / 1e9 for s in (a, b)}
    row = {"log2_n": log2_n, "gparams": speed, "ratios": ratios,
           "median_ratio": statistics.median(ratios), "seconds": seconds}
    rows.append(row)
    print(f"{'2^' + str(log2_n):>5} {speed[a]:22.3f} {speed[b]:22.3f} "
          f"{row['median_ratio']:15.2f} {min(ratios):6.2f} {max(ratios):6.2f} "
          f"{sum(r >= 1 for r in ratios):>5} of {len(ratios)}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"pair": [a, b], "threads": args.threads, "steps": args.steps, "pairs": args.pairs,
                 "cpu": os.uname().machine, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
