"""Reproducible runs: what jzo's deterministic steps cost, and whether runs
and resumed runs of the recipe are bitwise equal.

  python3 benchmarks/reproducibility.py cost --rounds 5 --json cost.json
  python3 benchmarks/reproducibility.py bitwise --json bitwise.json
  python3 benchmarks/reproducibility.py bitwise --processes 2 --json bitwise-2.json
  python3 benchmarks/reproducibility.py cost --smoke; ... bitwise --smoke  # CPU

cost: model TFLOPS of a step with and without EngineOptions(deterministic=
True), both engines built in one process and timed in rounds taken in turn
(--steps timed steps each a round, after 3 to compile and warm up): at
gpt2-1.5b (seq 1024, micro-batch 8) and at llama-3.1-8b's layer shape (seq
4096, micro-batch 2, --llama-layers of its 32 layers), no offload (the
option changes the GPU's programs, not the host's). Each's median, spread
and the ratio.

bitwise: the recipe (`python -m jzo.train`, --model gpt2-124m at seq 1024,
global batch 16, offload + the delayed update, --steps 30, a checkpoint
every 10, one kept, a log line a step), each run in a folder of its own
(removed at the end, with --keep-runs kept and named) with no
compilation cache, over --processes processes (one GPU each, over
loopback), all of --runs at once, each with its share of the GPUs' memory:
"reference" and "again" with --deterministic; "usual" without it;
"sigkill": --deterministic, process 0 killed by SIGKILL at a random step
(--seed) after the first checkpoint, then --resume; "sigterm": the same
stopped by SIGTERM. Each against the reference: whether the losses of
every step and the final float32 masters are bitwise equal, the first step
whose loss differs, and the largest difference of a master weight; and each
run's alarming lines (tracebacks, errors, the C++ logs of JAX's coordination
service and gRPC), over every process's log, as it ran and as it ended.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import harness

SHAPES = ("gpt2-1.5b", "llama-3.1-8b")
RUNS = ("reference", "again", "usual", "sigkill", "sigterm")
# What a run's processes must not print: tracebacks, errors, and the C++ logs of JAX's
# coordination service and gRPC (E/F/W lines, CANCELLED and UNAVAILABLE, stack traces).
ALARMING = re.compile(r"Traceback|Error|error:|^[EFW]\d{4} |CANCELLED|UNAVAILABLE|WatchTasks|"
                      r"Terminating process|Source Location Trace|[Cc]heck fail", re.M)


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("mode", choices=["cost", "bitwise"])
  parser.add_argument("--smoke", action="store_true",
                      help="the tiny preset and a few steps: the plumbing on a CPU")
  parser.add_argument("--rounds", type=int, default=5, help="cost: rounds taken in turn")
  parser.add_argument("--steps", type=int, help="cost: timed steps a round (default 3); "
                      "bitwise: the run's steps (default 30)")
  parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
  parser.add_argument("--llama-layers", type=int, default=8,
                      help="cost: layers of llama-3.1-8b (two engines share the GPU)")
  parser.add_argument("--processes", type=int, default=1, help="bitwise: one GPU each")
  parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
  parser.add_argument("--seed", type=int, default=0, help="bitwise: picks the kill steps")
  parser.add_argument("--keep-runs", action="store_true", help="bitwise: keep the run folders")
  parser.add_argument("--child", help=argparse.SUPPRESS)  # measures one shape's cost
  args = parser.parse_args()
  if args.child:
    harness.child_result(cost_of(args, args.child))
    return
  if args.mode == "cost":
    points = []
    for shape in args.shapes:
      cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", shape]
      points += harness.run_child(cmd, timeout_s=900)
      print(json.dumps(points[-1]), flush=True)
  else:
    points = bitwise(args)
  harness.write_record(args.json, f"reproducibility-{args.mode}", args, points)
  harness.child_result(points)


# ------------------------------------------------------------------ cost
def cost_of(args, shape: str) -> dict:
  """In a child: both engines of `shape`, timed in rounds taken in turn."""
  from jzo.recipe.loop import claim_gpu_memory
  claim_gpu_memory()
  import dataclasses
  import functools
  import jax
  import numpy as np
  import optax
  import jzo
  from jzo.models import gpt, llama
  module = gpt if shape.startswith("gpt") else llama
  seq, micro = (1024, 8) if module is gpt else (4096, 2)
  config = module.PRESETS[shape]
  if module is llama:
    config = dataclasses.replace(config, n_layer=args.llama_layers)
  if args.smoke:
    module, seq, micro, shape = gpt, 32, 2, "tiny"
    config = gpt.PRESETS["tiny"]
  config = dataclasses.replace(config, seq_len=seq)
  devices = jax.devices()[:1]
  batch = {"tokens": np.random.default_rng(0).integers(0, config.vocab_size, (micro, seq + 1),
                                                       dtype=np.int32)}
  engines = {}
  for deterministic in (False, True):
    engines[deterministic] = jzo.ZeroEngine(
        functools.partial(module.loss_fn, config),
        functools.partial(module.init_params, config, jax.random.PRNGKey(0)),
        optax.adamw(3e-4, weight_decay=0.1),
        jzo.EngineOptions(max_grad_norm=1.0, deterministic=deterministic),
        mesh=jax.sharding.Mesh(np.array(devices), ("data",)),
        activation_memory=module.activation_bytes(config, micro, seq))
    for _ in range(3):  # compile and warm up
      jax.block_until_ready(engines[deterministic].step(batch).loss)
  steps = args.steps or 3
  times = {False: [], True: []}
  for _ in range(args.rounds):
    for deterministic, engine in engines.items():
      start = time.perf_counter()
      for _ in range(steps):
        jax.block_until_ready(engine.step(batch).loss)
      times[deterministic].append((time.perf_counter() - start) / steps)
  for engine in engines.values():
    engine.close()
  flops = micro * seq * config.flops_per_token(seq)
  tflops = {k: [flops / t / 1e12 for t in v] for k, v in times.items()}
  ratios = [a / b for a, b in zip(tflops[True], tflops[False])]
  return {"status": "ok", "shape": shape, "n_layer": config.n_layer, "n_params": config.n_params,
          "seq_len": seq, "micro_batch": micro, "device": devices[0].device_kind,
          "usual_tflops": harness.stats(tflops[False]),
          "deterministic_tflops": harness.stats(tflops[True]),
          "ratio": harness.stats(ratios), "usual_rounds": tflops[False],
          "deterministic_rounds": tflops[True]}


# --------------------------------------------------------------- bitwise
def recipe_args(args) -> list[str]:
  if args.smoke:
    return ["--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--steps",
            str(args.steps or 12), "--checkpoint-every", "4", "--log-every", "1",
            "--eval-every", "1000", "--sample-tokens", "0", "--offload", "--delayed-update"]
  return ["--model", "gpt2-124m", "--seq-len", "1024", "--batch-size", "16", "--steps",
          str(args.steps or 30), "--checkpoint-every", "10", "--keep-checkpoints", "1",
          "--log-every", "1", "--eval-every", "1000", "--sample-tokens", "0", "--offload",
          "--delayed-update"]


class Run:
  """One run of the recipe over `processes` processes (one GPU each), in
  `out`, with no compilation cache and `memory_share` of each GPU."""

  def __init__(self, out: pathlib.Path, argv: list[str], processes: int, tag: str,
               memory_share: str):
    self.out, self.procs, self.logs = out, [], []
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = memory_share
    port = free_port()
    for i in range(processes):
      extra = [] if processes == 1 else [
          "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
          "--process-id", str(i)]
      if processes > 1:
        env = dict(env, CUDA_VISIBLE_DEVICES=str(i))
      log = out.parent / f"{out.name}-{tag}-{i}.log"
      self.logs.append(log)
      with open(log, "wb") as f:
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "jzo.train", *argv, "--out", str(out), *extra],
            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=harness.ROOT,
            start_new_session=True))

  def steps_logged(self) -> int:
    path = self.out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0

  def wait(self, timeout: float = 1800) -> list[int]:
    deadline = time.monotonic() + timeout
    for p in self.procs:
      try:
        p.wait(max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return [p.returncode for p in self.procs]

  def tail(self) -> list[str]:
    return self.logs[0].read_text(errors="replace").strip().splitlines()[-3:]

  def alarming(self) -> list[str]:
    """The alarming lines of every process's log, each named by its log."""
    return [f"{log.name}: {line}" for log in self.logs
            for line in log.read_text(errors="replace").splitlines() if ALARMING.search(line)]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def losses(out: pathlib.Path) -> list[float]:
  return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def compare(out: pathlib.Path, reference: pathlib.Path, steps: int) -> dict:
  """Bitwise comparison of a finished run with the reference."""
  import jax
  import numpy as np
  from jzo import checkpoint
  mine, theirs = losses(out), losses(reference)
  differing = [i + 1 for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
  _, a = checkpoint.read_masters(out / "checkpoints", steps)
  _, b = checkpoint.read_masters(reference / "checkpoints", steps)
  diffs = [float(np.max(np.abs(x - y))) if x.size else 0.0
           for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
  return {"steps_logged": len(mine), "bitwise_losses": mine == theirs,
          "first_differing_step": differing[0] if differing else None,
          "bitwise_masters": max(diffs) == 0.0, "max_master_diff": max(diffs)}


def bitwise(args) -> list[dict]:
  """Every run of --runs at once, each with its share of the GPUs' memory:
  the stopped ones resumed as soon as they exit; then each compared."""
  argv = recipe_args(args)
  steps = int(argv[argv.index("--steps") + 1])
  every = int(argv[argv.index("--checkpoint-every") + 1])
  pick = random.Random(args.seed)
  root = pathlib.Path(tempfile.mkdtemp(prefix="jzo-bitwise-"))
  names = ["reference"] + [r for r in args.runs if r != "reference"]
  share = f"{0.9 / len(names):.3f}"  # of each GPU's memory, a process a run on it
  flags = {name: argv + ([] if name == "usual" else ["--deterministic"]) for name in names}
  start = time.perf_counter()
  runs = {name: Run(root / name, flags[name], args.processes, "first", share) for name in names}
  # After the first checkpoint, before the end.
  stop_at = {name: pick.randint(every + 1, steps - 2) for name in names if name.startswith("sig")}
  points = {name: {"run": name, "processes": args.processes} for name in names}
  stopping = set()  # signalled, not yet exited (never waited for here: others run on)
  while stopping or any(p.poll() is None for run in runs.values() for p in run.procs):
    for name, at in list(stop_at.items()):
      run = runs[name]
      if run.steps_logged() >= at or any(p.poll() is not None for p in run.procs):
        run.procs[0].send_signal(signal.SIGKILL if name == "sigkill" else signal.SIGTERM)
        points[name]["stopped_after_step"] = run.steps_logged()
        stopping.add(name)
        del stop_at[name]
    for name in list(stopping):
      exits = [p.poll() for p in runs[name].procs]
      if None not in exits:
        points[name]["stop_exits"] = exits
        points[name]["alarming_lines"] = runs[name].alarming()
        runs[name] = Run(root / name, flags[name] + ["--resume"], args.processes, "resumed",
                         share)
        stopping.remove(name)
    time.sleep(0.02)
  for name, run in runs.items():
    point, exits = points[name], run.wait()
    point.update(exits=exits, wall_s=time.perf_counter() - start,
                 alarming_lines=point.get("alarming_lines", []) + run.alarming())
    if any(exits):
      point.update(status="error", detail=run.tail())
    elif name != "reference":
      point.update(status="ok", **compare(root / name, root / "reference", steps))
    else:
      point.update(status="ok")
    print(json.dumps(point), flush=True)
  if args.keep_runs:
    print(f"runs kept in {root}", file=sys.stderr)
  else:
    shutil.rmtree(root)
  compared = [p for p in points.values() if p["status"] == "ok" and p["run"] != "reference"]
  print("\n".join(f"{p['run']:<10} losses {'equal' if p['bitwise_losses'] else 'differ'}, "
                  f"masters {'equal' if p['bitwise_masters'] else 'differ'}"
                  f" (first step differing: {p['first_differing_step']}, largest master "
                  f"difference {p['max_master_diff']:.3g})" for p in compared), file=sys.stderr)
  print("alarming lines: " + ", ".join(f"{p['run']} {len(p['alarming_lines'])}"
                                       for p in points.values()), file=sys.stderr)
  return list(points.values())


if __name__ == "__main__":
  main()
