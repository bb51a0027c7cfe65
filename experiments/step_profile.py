"""Where the time of the recipe's training step goes (no offload), on a GPU.

Times, in one process: the engine's whole step; the model's forward and
backward alone (jit of value_and_grad on the same bf16 params, no optimizer);
the forward alone. Then records a profile of `--trace-steps` engine steps
(`jax.profiler`, with a Perfetto JSON trace) and, from it, sums the GPU time
by kernel, to say which kernels outside the matmuls cost the most.

  python experiments/step_profile.py --model gpt2-1.5b --remat dots --out DIR
  python experiments/step_profile.py --summarize DIR   # the table again, from a trace
  python experiments/step_profile.py --idle DIR        # where the GPU and its compute
                                                       # stream wait, from a trace
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import pathlib
import time


def timed(fn, steps: int) -> float:
  """Seconds per call of fn() over `steps` back-to-back calls (after one warm-up)."""
  import jax
  jax.block_until_ready(fn())
  start = time.perf_counter()
  for _ in range(steps):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps


def profile(args) -> None:
  import functools

  import jax
  import numpy as np

  from jzo import train
  from jzo.models import gpt
  from jzo.recipe import loop, models

  cfg = train.TrainConfig(model=args.model, seq_len=args.seq_len, batch_size=args.batch,
                          stage=args.stage, offload=False, remat=args.remat)
  model = dataclasses.replace(gpt.PRESETS[args.model], seq_len=args.seq_len, remat=args.remat)
  recipe_model = dataclasses.replace(models.PRESETS[args.model], config=model)
  engine = loop.make_engine(cfg, recipe_model, None, jax.devices()[:1], args.batch)
  rng = np.random.default_rng(0)
  batch = {"tokens": rng.integers(0, model.vocab_size, (args.batch, args.seq_len + 1),
                                  dtype=np.int32)}
  params = engine.state.params  # full bf16 params on the GPU (stages 0-2)
  loss = functools.partial(gpt.loss_fn, model)
  grad = jax.jit(jax.value_and_grad(loss))
  forward = jax.jit(loss)
  flops = args.batch * args.seq_len * model.flops_per_token()
  # The model alone first: the engine's step donates (frees) these params.
  times = {"forward": timed(lambda: forward(params, batch), args.steps),
           "forward + backward": timed(lambda: grad(params, batch), args.steps)}
  del params
  times["engine step"] = timed(lambda: engine.step(batch).loss, args.steps)
  for name, seconds in times.items():
    print(f"{name:<20} {1e3 * seconds:8.1f} ms" + (
        f"  {flops / seconds / 1e12:6.1f} model TFLOPS" if name == "engine step" else ""))
  out = pathlib.Path(args.out)
  with jax.profiler.trace(str(out), create_perfetto_trace=True):
    for _ in range(args.trace_steps):
      metrics = engine.step(batch)
    jax.block_until_ready(metrics.loss)
  # The optimized HLO, to read the ops the trace names.
  (out / "step_hlo.txt").write_text(engine.lower(batch).compile().as_text())
  summarize(out, args.trace_steps)


def _trace(out: pathlib.Path):
  """The Perfetto trace in `out`: (its complete events, process names by
  pid, thread names by (pid, tid))."""
  (path,) = pathlib.Path(out).rglob("perfetto_trace.json.gz")
  events = json.loads(gzip.open(path).read())
  events = events["traceEvents"] if isinstance(events, dict) else events
  meta = lambda kind: {(e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]:
                       e["args"]["name"] for e in events
                       if e.get("ph") == "M" and e.get("name") == kind}
  return [e for e in events if e.get("ph") == "X"], meta("process_name"), meta("thread_name")


def _op(e) -> str:
  args = e.get("args", {})
  return f"{args.get('hlo_module', '')}/{args['hlo_op']}" if "hlo_op" in args else e["name"]


def summarize(out: pathlib.Path, steps: int, top: int = 30) -> None:
  """GPU time per step by trace line, then by name on the busiest GPU lines
  (CUDA streams: kernels and copies), from the Perfetto trace in `out`."""
  events, procs, threads = _trace(out)
  by_line, by_name = collections.Counter(), collections.Counter()
  for e in events:
    if "gpu" not in procs.get(e["pid"], "").lower():
      continue
    line = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
    by_line[line] += e["dur"] / 1e3 / steps  # us -> ms per step
    if "stream" in line.lower():
      by_name[_op(e)] += e["dur"] / 1e3 / steps
  print("\nGPU trace lines, ms per step:")
  for line, ms in by_line.most_common():
    print(f"{ms:9.2f}  {line}")
  print(f"\nstreams: {sum(by_name.values()):.1f} ms per step; top {top} HLO ops (or kernels):")
  for name, ms in by_name.most_common(top):
    print(f"{ms:8.2f} ms  {name[:110]}")


def _gaps(events, least_ms: float):
  """(span ms, [(gap ms, at ms, op before, op after)]) of events (sorted by
  start): the times of at least least_ms when none of them runs."""
  start, end, last = events[0]["ts"], events[0]["ts"], events[0]
  gaps = []
  for e in events:
    if e["ts"] - end >= least_ms * 1e3:
      gaps.append(((e["ts"] - end) / 1e3, (end - start) / 1e3, _op(last), _op(e)))
    if e["ts"] + e["dur"] >= end:
      end, last = e["ts"] + e["dur"], e
  return (end - start) / 1e3, gaps


def idle(out: pathlib.Path, top: int = 25, least_ms: float = 0.5) -> None:
  """Where the GPU waits: the gaps of at least `least_ms` between the
  kernels and copies of every stream together (the GPU idle), then those
  of the busiest stream alone (the compute stream waiting, for a copy on
  another stream or for the host), each with when it starts (ms from the
  first GPU event) and the ops on either side; the gaps summed by the op
  after them (what was waited for); and each stream's busiest ops."""
  events, procs, threads = _trace(out)
  line = lambda e: threads.get((e["pid"], e.get("tid")), "")
  gpu = sorted((e for e in events if "gpu" in procs.get(e["pid"], "").lower()
                and "stream" in line(e).lower()), key=lambda e: e["ts"])
  if not gpu:
    print("no GPU stream events in the trace")
    return
  busy = collections.Counter()
  for e in gpu:
    busy[line(e)] += e["dur"]
  compute = busy.most_common(1)[0][0]
  for title, chosen in (("every stream", gpu), (compute, [e for e in gpu if line(e) == compute])):
    span, gaps = _gaps(chosen, least_ms)
    print(f"\n{title}: span {span:.1f} ms, idle {sum(g[0] for g in gaps):.1f} ms in "
          f"{len(gaps)} gaps of >= {least_ms} ms")
    print(f"{'gap ms':>8} {'at ms':>9}  before -> after")
    for gap, at, before, after in sorted(gaps, reverse=True)[:top]:
      print(f"{gap:8.2f} {at:9.1f}  {before[:70]} -> {after[:70]}")
    by_after = collections.Counter()
    for gap, _, _, after in gaps:
      by_after[after] += gap
    print("idle by the op after it, ms:")
    for name, ms in by_after.most_common(top):
      print(f"{ms:9.2f}  {name[:100]}")
  for name, _ in busy.most_common():
    ops = collections.Counter()
    for e in gpu:
      if line(e) == name:
        ops[_op(e)] += e["dur"] / 1e3
    print(f"\n{name}: {sum(ops.values()):.1f} ms; its busiest ops:")
    for op, ms in ops.most_common(8):
      print(f"{ms:9.2f}  {op[:100]}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-1.5b")
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--stage", type=int, default=2)
  parser.add_argument("--remat", default="dots")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--trace-steps", type=int, default=2)
  parser.add_argument("--out", default="/tmp/jzo_profile")
  parser.add_argument("--summarize", metavar="DIR", help="only print the table of a trace")
  parser.add_argument("--idle", metavar="DIR", help="only print where a trace's GPU is idle")
  args = parser.parse_args()
  if args.idle:
    idle(pathlib.Path(args.idle))
  elif args.summarize:
    summarize(pathlib.Path(args.summarize), args.trace_steps)
  else:
    profile(args)


if __name__ == "__main__":
  main()
