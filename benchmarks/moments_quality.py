"""The loss of gpt2-124m trained with fp32, bf16 and int8 Adam moments, side by side.

Trains the model once a moment dtype (--moments) through the recipe,
`python -m jzo.train`, on its embedded corpus with the model's learning rate
and schedule and every moment on the host, updated by the C++ kernel
(--offload-fraction 1). The runs go at once (--jobs, default all of them:
three processes on one GPU, each allowed an equal share of its memory); each
is a process of its own, and one that fails gives a point with its status.

Reported, from each run's metrics.jsonl: the training loss at every step, the
held-out loss every --eval-every steps over --eval-batches batches (nats a
byte), and the final held-out loss against fp32's, in percent. The record's
points hold the curves, one a dtype (moments, steps, train_loss, eval_steps,
eval_loss); benchmarks/plot.py draws them.

  python3 benchmarks/moments_quality.py --steps 2000 --json moments-quality.json
  python3 benchmarks/moments_quality.py --model tiny --steps 4 --seq-len 32 --batch-size 2 \\
      --eval-every 2 --eval-batches 1 --jobs 1
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

MOMENTS = ("fp32", "bf16", "int8")


def train_argv(args, moments: str, out: str) -> list[str]:
  """`python -m jzo.train`'s options for one run."""
  return ["--model", args.model, "--seq-len", str(args.seq_len), "--batch-size",
          str(args.batch_size), "--steps", str(args.steps), "--moments", moments,
          "--offload-fraction", "1", "--eval-every", str(args.eval_every), "--eval-batches",
          str(args.eval_batches), "--log-every", str(args.eval_every), "--checkpoint-every", "0",
          "--sample-tokens", "0", "--seed", str(args.seed), "--out", out]


def curves(metrics_path: str) -> dict:
  """A run's loss curves from its metrics.jsonl."""
  with open(metrics_path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  evals = [r for r in records if "eval_loss" in r]
  return {"steps": [r["step"] for r in records],
          "train_loss": [round(r["loss"], 5) for r in records],
          "eval_steps": [r["step"] for r in evals],
          "eval_loss": [round(r["eval_loss"], 5) for r in evals],
          "skipped_steps": sum(bool(r.get("skipped")) for r in records),
          "step_s_median": harness.stats([r["step_s"] for r in records[1:] if "step_s" in r])["median"]}


def child(args) -> None:
  """One run of the recipe in this process; prints its curves."""
  from jzo import train
  out = os.path.join(args.out, args.child)
  status = train.main(train_argv(args, args.child, out))
  if status:
    raise SystemExit(status)
  import jax
  harness.child_result({"status": "ok", "moments": args.child,
                        "device": jax.devices()[0].device_kind,
                        **curves(os.path.join(out, "metrics.jsonl"))})


def run_all(args) -> list[dict]:
  """Each dtype's run as a child, --jobs at once; the points, fp32's first."""
  env = {}
  if args.jobs == 1:  # one after another: the later runs load the first one's executables
    env = {"JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                       os.path.join(args.out, "jax-cache")),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  else:  # each run at once gets its share of the GPU this environment allows
    whole = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9"))
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{whole / args.jobs:.3f}"
  passed = sum(([f"--{k.replace('_', '-')}", str(getattr(args, k))] for k in
                ("model", "seq_len", "batch_size", "steps", "eval_every", "eval_batches", "seed",
                 "out")), [])

  def run(moments: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", moments] + passed
    [point] = harness.run_child(cmd, timeout_s=args.timeout, env=env)
    return dict(point, moments=moments)

  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    points = list(pool.map(run, args.moments))
  finals = {p["moments"]: p["eval_loss"][-1] for p in points
            if p["status"] == "ok" and p["eval_loss"]}
  for p in points:
    if p["moments"] in finals:
      p["final_eval_loss"] = finals[p["moments"]]
      if "fp32" in finals:
        p["against_fp32_pct"] = round(100 * (finals[p["moments"]] / finals["fp32"] - 1), 3)
  return points


def report(points: list[dict]) -> None:
  ok = [p for p in points if p["status"] == "ok"]
  print(f"\nheld-out loss (nats a byte)\n{'step':>6} " + " ".join(f"{p['moments']:>8}" for p in ok))
  for i, step in enumerate(ok[0]["eval_steps"] if ok else []):
    print(f"{step:>6} " + " ".join(f"{p['eval_loss'][i]:8.4f}" if i < len(p["eval_loss"])
                                    else f"{'':>8}" for p in ok))
  for p in points:
    if p["status"] != "ok":
      print(f"{p['moments']}: {p['status']}: {' '.join(p.get('detail', []))[-300:]}")
    elif "final_eval_loss" in p:
      against = p.get("against_fp32_pct")
      print(f"{p['moments']}: final held-out loss {p['final_eval_loss']:.4f}"
            + (f" ({against:+.2f}% against fp32)" if against is not None else "")
            + f", {p['skipped_steps']} steps skipped")


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--model", default="gpt2-124m", help="jzo.train's preset (default: gpt2-124m)")
  parser.add_argument("--steps", type=int, default=2000, help="optimizer steps (default: 2000)")
  parser.add_argument("--seq-len", type=int, default=256, help="bytes a sequence (default: 256)")
  parser.add_argument("--batch-size", type=int, default=16, help="sequences a step (default: 16)")
  parser.add_argument("--eval-every", type=int, default=100,
                      help="steps between held-out evaluations (default: 100)")
  parser.add_argument("--eval-batches", type=int, default=16,
                      help="batches an evaluation (default: 16)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the weights and batches")
  parser.add_argument("--moments", nargs="+", choices=MOMENTS, default=list(MOMENTS),
                      help="the moment dtypes, a run each (default: %(default)s)")
  parser.add_argument("--jobs", type=int, default=0,
                      help="runs at once (default: 0, all of them)")
  parser.add_argument("--out", default="",
                      help="folder for the runs (default: a temporary one, removed after)")
  parser.add_argument("--timeout", type=float, default=3600, help="seconds a run may take")
  parser.add_argument("--child", choices=MOMENTS, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return child(args)
  args.jobs = args.jobs or len(args.moments)
  temporary = not args.out
  args.out = args.out or tempfile.mkdtemp(prefix="moments-quality-")
  try:
    points = run_all(args)
  finally:
    if temporary:
      shutil.rmtree(args.out, ignore_errors=True)
  report(points)
  del args.child
  harness.write_record(args.json, "moments_quality", args, points, with_devices=False)


if __name__ == "__main__":
  main()
