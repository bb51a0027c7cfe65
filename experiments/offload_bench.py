"""ZeRO-Offload on one GPU (or --gpus of them): jzo with and without offload
(and with delayed parameter update) training the same GPT, with the step-time
breakdown.

Each configuration runs in a fresh process (its own GPU peak and host RSS):
  device       ZeroEngine stage 2, optax.adamw on the GPU (where it fits);
  offload      stage 2 + offload: fp32 masters and moments in host RAM, the
               C++ AdamW on the host, bf16 weights back;
  offload_dpu  the same with the one-step delayed parameter update;
  auto         offload="auto": as much of the state on the GPU as fits
               (jzo.estimate's plan), the rest on the host;
  auto_dpu     the same with the delayed update of the host part.
Reported: median step time, tokens/s, model TFLOPS (6 N + 12 L D T per token),
peak GPU memory, host RSS (before the engine, now and at its peak) beside
the planner's figures and, for offload, the breakdown of a step: the device
step alone (run without the host side), the host update (the C++ kernel),
the exchange left after the kernel (uploads of the last leaves and the
downloads of the next gradients), and the pinned-memory bandwidth of the
engine's own transfers measured apart (all host parts down, then up).

With --grad-accum K > 1, --accumulation host sums the host parts on the
host (a device call per micro-batch); the result then also has the device
time per micro-batch (the device calls alone / K), the host's summing
passes a step and the time the engine waited for micro-batches' gradients
to leave the GPU.

With --gpus N the engine spans the first N GPUs (one process, --batch
sequences per GPU): tokens/s counts them all, model TFLOPS are per GPU and
the GPU peak is GPU 0's.

  python experiments/offload_bench.py --model gpt2-1.5b --batch 8 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import pathlib
import resource
import statistics
import subprocess
import sys
import time

CONFIGS = ("device", "offload", "offload_dpu", "auto", "auto_dpu")


def timed(fn, repeats=3):
  """Median wall time of fn() (which must block until done)."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def devices(count: int) -> list:
  """The first `count` accelerators, refusing a count the machine lacks."""
  import jax
  found = jax.devices()
  if count > len(found):
    raise SystemExit(f"--gpus {count}: this machine has {len(found)} {found[0].platform} devices")
  return found[:count]


def model_config(args):
  """The preset, with --n-layer's layer count if given."""
  from jzo.models import gpt
  config = gpt.PRESETS[args.model]
  return dataclasses.replace(config, seq_len=args.seq_len, remat=args.remat,
                             n_layer=args.n_layer or config.n_layer)


def run_one(args) -> list[dict]:
  """Builds one engine and measures it at each micro-batch of --batch."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import psutil

  import jzo
  from jzo.models import gpt
  from jzo.recipe.loop import claim_gpu_memory

  claim_gpu_memory()  # as jzo's command line (before the GPU backend starts)
  config = model_config(args)
  offload = {"device": False, "offload": True, "offload_dpu": True, "auto": "auto",
             "auto_dpu": "auto"}[args.config]
  moments = {"fp32": None, "bf16": jnp.bfloat16, "int8": jnp.int8}[args.moments]
  tx = (jzo.cpu_adamw(3e-4, weight_decay=0.1, mu_dtype=moments, nu_dtype=moments) if offload
        else optax.adamw(3e-4, weight_decay=0.1, mu_dtype=moments))
  # The plan makes room for the largest micro-batch's activations.
  # With grads_in_params the layers run first (accumulation auto or layers):
  # every micro-batch's layer inputs are kept.
  first = (args.grads_in_params or args.offload_params) and args.grad_accum > 1 and (
      args.accumulation in ("auto", "layers"))
  activations = {micro: gpt.activation_bytes(config, micro, args.seq_len,
                                             accumulation=args.grad_accum if first else 1)
                 for micro in args.batch}
  # As the recipe: the pinned pool is not rounded up past the landing
  # buffers and offloaded weights (at most 2 B a parameter).
  jzo.plan.limit_pinned_pool(2 * config.n_params, args.gpus)
  jax.devices()  # the runtime's own host memory counts as the baseline
  rss_before = psutil.Process().memory_info().rss
  start = time.perf_counter()
  engine = jzo.ZeroEngine(
      functools.partial(gpt.loss_fn, config),
      functools.partial(gpt.init_params, config, jax.random.PRNGKey(0)),  # drawn leaf by leaf
      tx, stage=args.stage, layers="blocks" if args.stage == 3 else None,
      grads_in_params=args.grads_in_params, overlap_forward=args.overlap_forward,
      offload_params={None: False, "all": True, "auto": "auto"}[args.offload_params],
      resident_layers=args.resident_layers,
      mesh=jax.sharding.Mesh(np.array(devices(args.gpus)), ("data",)),
      max_grad_norm=1.0, grad_accum=args.grad_accum, offload=offload,
      accumulation=args.accumulation if offload else "auto",
      delayed_update=args.config.endswith("_dpu"), dpu_warmup=1,
      activation_memory=max(activations.values()),
      host_memory=int(args.host_memory_gb * 2**30) if args.host_memory_gb else None,
      device_memory=int(args.device_memory_gb * 2**30) if args.device_memory_gb else None)
  build_s = time.perf_counter() - start
  rss_built = psutil.Process().memory_info().rss
  gib = lambda b: round(b / 2**30, 2)
  stats = jax.devices()[0].memory_stats() or {}
  print("built:", {k: gib(v) for k, v in engine.memory_per_device().items()}, "in use",
        gib(stats.get("bytes_in_use", 0)), "peak", gib(stats.get("peak_bytes_in_use", 0)),
        "limit", gib(stats.get("bytes_limit", 0)), "largest free block",
        gib(stats.get("largest_free_block_bytes", 0)),  # the allocator's fragments
        "rss", gib(rss_built), file=sys.stderr, flush=True)
  if args.live_arrays:
    print_live_arrays(engine)
  print(engine.plan, file=sys.stderr)
  results = [measure_batch(args, engine, config, micro, rss_before, rss_built, build_s,
                           activations[micro])
             for micro in args.batch]
  if args.breakdown and engine.host_update is not None and engine.state.grads is not None:
    # The engine's transfers apart (host accumulation keeps no step's gradients to time): every host part down, then up, one set
    # of landing buffers at a time (a second set of gpt2-10b's does not fit
    # the host).
    print("timing the transfers", file=sys.stderr, flush=True)
    transfer, grads = engine.host_update.transfer, jax.tree.leaves(engine.state.grads)
    leaves = [i for i, l in enumerate(transfer.layouts) if l.on_host]
    down = lambda: jax.block_until_ready({i: transfer.download(i, grads[i]) for i in leaves})
    delete = lambda arrays: [x.delete() for x in arrays]
    nbytes = sum(x.nbytes for x in down().values())
    results[-1]["d2h_gb_s"] = nbytes / timed(lambda: delete(down().values())) / 1e9
    landing = down()
    results[-1]["h2d_gb_s"] = nbytes / timed(lambda: [transfer.upload(i, landing[i]).delete()
                                                       for i in leaves]) / 1e9
  engine.close()
  return results


def print_live_arrays(engine, largest: int = 8) -> None:
  """Prints the bytes of the live arrays' buffers in GPU 0's memory, the
  engine's device state's among them, and the largest of the others (shape,
  dtype, GiB): what the allocator's bytes in use hold beyond the state. A
  buffer counts once, though a global array's shard is also a live array."""
  import jax
  device = jax.devices()[0]
  on_gpu = lambda x: x.sharding.memory_kind in (None, "device")  # not pinned host
  buffers = lambda x: {s.data.unsafe_buffer_pointer(): s.data.nbytes
                       for s in x.addressable_shards if s.device == device}
  state = {}
  for x in filter(on_gpu, jax.tree.leaves(engine.state)):
    state.update(buffers(x))
  others = {}
  for x in filter(on_gpu, jax.live_arrays()):
    others.update({p: (n, x.shape, str(x.dtype)) for p, n in buffers(x).items()
                   if p not in state})
  largest_others = sorted(others.values(), reverse=True)[:largest]
  gib = lambda b: round(b / 2**30, 2)
  print("live on GPU 0: the state's", gib(sum(state.values())), "GiB;", len(others),
        "other buffers,", gib(sum(n for n, _, _ in others.values())), "GiB, the largest:",
        [(shape, dtype, gib(n)) for n, shape, dtype in largest_others],
        file=sys.stderr, flush=True)


def measure_batch(args, engine, config, micro, rss_before, rss_built, build_s,
                  activations) -> dict:
  """Warm-up and timed steps of `engine` at micro-batch `micro`: one result."""
  import jax
  import jax.numpy as jnp
  import psutil

  import jzo
  gib = lambda b: round(b / 2**30, 2)
  offload = args.config != "device"
  batch_size = micro * args.grad_accum * args.gpus
  batch = {"tokens": jax.random.randint(jax.random.PRNGKey(1), (batch_size, args.seq_len + 1),
                                        0, config.vocab_size, jnp.int32)}
  if args.compiled_memory:
    m = engine.lower(batch).compile().memory_analysis()
    print("compiled step: arguments", gib(m.argument_size_in_bytes), "outputs",
          gib(m.output_size_in_bytes), "aliased", gib(m.alias_size_in_bytes), "temporaries",
          gib(m.temp_size_in_bytes), "host temporaries", gib(m.host_temp_size_in_bytes),
          file=sys.stderr, flush=True)
  for i in range(3):  # compile, warm up, and start the delayed updates
    jax.block_until_ready(engine.step(batch).loss)
    stats = jax.devices()[0].memory_stats() or {}
    print(f"step {i}: in use", gib(stats.get("bytes_in_use", 0)), "peak",
          gib(stats.get("peak_bytes_in_use", 0)), "rss",
          gib(psutil.Process().memory_info().rss), file=sys.stderr, flush=True)
  times, timings = [], []
  for _ in range(args.steps):
    start = time.perf_counter()
    jax.block_until_ready(engine.step(batch).loss)
    times.append(time.perf_counter() - start)
    timings.append(dict(engine.host_timings))
  if args.profile:  # two more steps, traced: where the GPU waits
    import step_profile
    with jax.profiler.trace(args.profile, create_perfetto_trace=True):
      for _ in range(2):
        jax.block_until_ready(engine.step(batch).loss)
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the record
      step_profile.summarize(pathlib.Path(args.profile), 2, top=25)
      step_profile.idle(pathlib.Path(args.profile))
  seconds = statistics.median(times)
  tokens_per_s = batch_size * args.seq_len / seconds
  result = {
      "config": args.config, "status": "ok", "moments": args.moments, "model": args.model,
      "n_layer": config.n_layer, "n_params": config.n_params,
      "batch": micro, "grad_accum": args.grad_accum, "seq_len": args.seq_len,
      "stage": engine.plan.stage, "grads_in_params": engine.plan.grads_in_params,
      "overlaps_update": engine.overlaps_update, "layers_first": engine.plan.layers_first,
      "offload_params": engine.plan.offload_params,
      "host_params_gib": engine.plan.host_params_bytes() / 2**30,
      "resident_layers": engine.plan.resident_layers,
      "gpus": args.gpus, "step_s": seconds, "times_s": times, "tokens_per_s": tokens_per_s,
      "tflops": tokens_per_s * config.flops_per_token() / args.gpus / 1e12,  # per GPU
      # The process's peak so far: with several micro-batches, the largest yet.
      "peak_gpu_gib": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30,
      "host_rss_gib": psutil.Process().memory_info().rss / 2**30,
      "host_rss_before_gib": rss_before / 2**30,
      "host_rss_built_gib": rss_built / 2**30,
      "host_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
      "device": jax.devices()[0].device_kind, "build_s": build_s,
      "offloaded_fraction": engine.plan.offloaded_fraction if offload else 0.0,
      "host_accumulation": engine.plan.host_accumulation,
      # The planner's figures for this run, beside the measured ones.
      "planned_gpu_gib": sum(engine.plan.device_peak(activations).values()) / 2**30,
      # The build's peak: the state beside the largest leaf drawn in float32.
      "planned_build_gib": (sum(engine.plan.device_bytes().values())
                            + engine.plan.build_bytes()) / 2**30,
      "planned_host_state_gib": (sum(engine.plan.host_bytes().values()) if offload else 0) / 2**30,
      # ... and beside it the pinned pools' overhead and the runtime, to set against the RSS.
      "planned_host_gib": ((sum(engine.plan.host_bytes().values()) + engine.plan.pool_overhead()
                            if offload else 0)
                           + engine.plan.runtime_bytes) / 2**30,
      "host_state_gib": engine.host_bytes_in_use() / 2**30,
  }
  if engine.host_update is not None:
    engine.wait()  # no delayed update may share the timings below
    result["host_update_s"] = statistics.median(t["update"] for t in timings)
    result["exchange_tail_s"] = statistics.median(t["upload"] for t in timings)
    result["host_update_gparam_s"] = (engine.plan.host_elements / result["host_update_s"] / 1e9)
    result["int8_codes"] = jzo.kernels.int8_codes()  # how the int8 kernel finds codes here
    if engine.plan.host_accumulation:
      result["host_accumulate_s"] = statistics.median(t["accumulate"] for t in timings)
      result["wait_micro_s"] = statistics.median(t["wait_micro"] for t in timings)
  print("result:", json.dumps(result), file=sys.stderr, flush=True)  # kept if a later one fails
  if args.breakdown and engine.host_update is not None and not engine.plan.grads_in_params:
    # The device step alone: forward, backward, device-part update (under
    # grads_in_params it would remake the layers' weights too).
    print("timing the device step alone", file=sys.stderr, flush=True)
    result["device_step_s"] = timed(lambda: jax.block_until_ready(engine.run_device_step(batch)))
    result["device_micro_s"] = result["device_step_s"] / args.grad_accum
  return result


def failure(args, config: str, returncode: int, stderr: str) -> dict:
  """The record of a configuration that did not train: why, in a word
  ("refused" by the planner, "oom" on the device, "killed" by a signal: the
  host out of memory), and the last lines it printed."""
  lines = stderr.strip().splitlines()
  if returncode < 0:
    status = "killed"
  elif any("PlacementError" in line for line in lines[-5:]):
    status = "refused"
  elif "RESOURCE_EXHAUSTED" in stderr or "out of memory" in stderr.lower():
    status = "oom"
  else:
    status = "error"
  model = model_config(args)
  return {"config": config, "model": args.model, "n_layer": model.n_layer,
          "n_params": model.n_params, "moments": args.moments, "batch": args.batch[0],
          "seq_len": args.seq_len, "status": status, "exit": returncode, "detail": lines[-3:]}


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-1.5b")
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--batch", type=int, nargs="+", default=[8],
                      help="micro-batch (sequences); several: one engine measured at each")
  parser.add_argument("--n-layer", type=int, help="layers, instead of the preset's")
  parser.add_argument("--grad-accum", type=int, default=1)
  parser.add_argument("--remat", default="full", help="full, dots or none")
  parser.add_argument("--accumulation", choices=["auto", "device", "host", "layers"],
                      default="auto", help="with --grad-accum > 1 and offload: where the "
                      "micro-batches are summed (layers: the layers first, grads_in_params)")
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--moments", choices=["fp32", "bf16", "int8"], default="fp32",
                      help="dtype of the Adam moments (host bytes a param: fp32 14, bf16 10, int8 "
                           "about 8)")
  parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=2,
                      help="ZeRO stage (3: the layers gathered one at a time)")
  parser.add_argument("--grads-in-params", action="store_true",
                      help="stage 3 + offload: each layer's gradient written over its weights")
  parser.add_argument("--no-overlap-forward", dest="overlap_forward", action="store_false",
                      help="with --grads-in-params: finish each host update before the next "
                           "step (default: the next step's forward overlaps it)")
  parser.add_argument("--offload-params", nargs="?", const="all", choices=["all", "auto"],
                      help="stage 3 + offload: the layers' weights in pinned host memory, or "
                           "(auto) where the largest micro-batch needs it, the first layers that "
                           "still fit resident on the GPU (implies --grads-in-params)")
  parser.add_argument("--resident-layers", type=int,
                      help="with --offload-params all: the first layers also on the GPU")
  parser.add_argument("--host-memory-gb", type=float,
                      help="host RAM offload may use (default: what the OS reports available)")
  parser.add_argument("--compiled-memory", action="store_true",
                      help="print the compiled step's memory analysis first")
  parser.add_argument("--live-arrays", action="store_true",
                      help="after the build, print the live arrays on GPU 0 beyond the state")
  parser.add_argument("--device-memory-gb", type=float,
                      help="device memory the plan may use (default: the allocator's limit)")
  parser.add_argument("--gpus", type=int, default=1,
                      help="GPUs the engine spans (one process; --batch sequences per GPU)")
  parser.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                      help="skip the timings apart (the device step alone, the transfers)")
  parser.add_argument("--profile", metavar="DIR",
                      help="then trace two steps into DIR and print where the GPU is idle")
  parser.add_argument("--json")
  parser.add_argument("--config", help=argparse.SUPPRESS)  # child process: one run
  return parser.parse_args()


def main():
  args = parse_args()
  failures = []
  if args.config:
    print(json.dumps(run_one(args)))
    return
  results = []
  for name in args.configs:
    cmd = [sys.executable, __file__, "--config", name, "--model", args.model,
           "--seq-len", str(args.seq_len), "--batch", *map(str, args.batch),
           "--grad-accum", str(args.grad_accum), "--steps", str(args.steps),
           "--moments", args.moments, "--remat", args.remat, "--accumulation", args.accumulation,
           "--stage", str(args.stage), "--gpus", str(args.gpus)]
    if not args.breakdown:
      cmd.append("--no-breakdown")
    if args.grads_in_params:
      cmd.append("--grads-in-params")
    if not args.overlap_forward:
      cmd.append("--no-overlap-forward")
    if args.offload_params:
      cmd += ["--offload-params", args.offload_params]
    if args.resident_layers is not None:
      cmd += ["--resident-layers", str(args.resident_layers)]
    if args.n_layer:
      cmd += ["--n-layer", str(args.n_layer)]
    if args.compiled_memory:
      cmd.append("--compiled-memory")
    if args.live_arrays:
      cmd.append("--live-arrays")
    if args.device_memory_gb:
      cmd += ["--device-memory-gb", str(args.device_memory_gb)]
    if args.host_memory_gb:
      cmd += ["--host-memory-gb", str(args.host_memory_gb)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
      # A negative exit is a signal: -9, the host out of memory.
      print(f"{name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}", flush=True)
      failures.append(failure(args, name, out.returncode, out.stderr))
      continue
    print(out.stderr[-1500:], flush=True)  # the plan
    results += json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(results[-1]), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results + failures, f, indent=2)
  print(f"\n{'config':<12} {'batch':>5} {'s/step':>7} {'tokens/s':>9} {'TFLOPS':>7} {'GPU GiB':>8} "
        f"{'planned':>8} {'RSS GiB':>8} {'before':>7} {'state':>7} {'planned':>8} {'host %':>7}"
        "  breakdown")
  for r in failures:
    print(f"{r['config']:<12} {r['status']}: {r['detail'][-1] if r['detail'] else ''}")
  for r in results:
    parts = ""
    if "device_step_s" in r:
      parts = (f"device {r['device_step_s']:.3f} s, host update {r['host_update_s']:.3f} s "
               f"({r['host_update_gparam_s']:.2f} Gparam/s), exchange after it "
               f"{r['exchange_tail_s']:.3f} s")
    if "host_accumulate_s" in r:
      parts += (f"; {r['device_micro_s']:.3f} s a micro-batch, host sums "
                f"{r['host_accumulate_s']:.3f} s, waited {r['wait_micro_s']:.3f} s for them")
    if "d2h_gb_s" in r:  # measured once per engine, after its last micro-batch
      parts += f"; pinned D2H {r['d2h_gb_s']:.1f} GB/s, H2D {r['h2d_gb_s']:.1f} GB/s"
    print(f"{r['config']:<12} {r['batch']:5} {r['step_s']:7.3f} {r['tokens_per_s']:9.0f} "
          f"{r['tflops']:7.1f} {r['peak_gpu_gib']:8.2f} {r['planned_gpu_gib']:8.2f} "
          f"{r['host_rss_gib']:8.2f} {r['host_rss_before_gib']:7.2f} {r['host_state_gib']:7.2f} "
          f"{r['planned_host_state_gib']:8.2f} {100 * r['offloaded_fraction']:7.1f}  {parts}")
  if results:
    print(f"model {args.model} ({results[0]['n_params'] / 1e9:.2f}B), micro-batch "
          f"{' '.join(map(str, args.batch))} x {args.grad_accum} accumulation, "
          f"seq {args.seq_len}, {results[0]['device']} x {args.gpus}")


if __name__ == "__main__":
  main()
