"""jzo's side of the Llama-family points (issue 22): ZeroEngine training
jzo.models.llama of a preset's shape from random weights, with offload, on
one GPU; experiments/hf_baselines.py measures DeepSpeed and PyTorch on the
same shapes.

Each configuration runs in a fresh process (its own GPU peak and host RSS),
as in experiments/offload_bench.py, whose measurement it reuses
(`offload_bench.measure_batch`: warm-up, timed steps, the device step alone,
the host update, GPU peak, host RSS, the plan's figures beside the measured
ones, one record per micro-batch). Configurations: device (optax.adamw on
the GPU), offload, offload_dpu, auto, auto_dpu (offload_bench's meanings;
_dpu: the one-step delayed update). Model TFLOPS: 6 N + 12 L (H head_dim) T
per token (LlamaConfig.flops_per_token at --seq-len). XLA's pinned pool is
capped at the landing buffers' need, as the recipe does, so that it is not
rounded up to a power of two.

--plan-only prints, without a GPU, the planner's table for each micro-batch
and the arithmetic of a step: FLOPs, the device step at an assumed model
TFLOPS, the host update at the planner's kernel speed, the transfers at
PCIe speed, and the step they predict.

  python experiments/llama_bench.py --model llama-3.1-8b --seq-len 4096 \\
      --batch 2 --configs auto_dpu --steps 10 --json llama8b.json
  python experiments/llama_bench.py --model qwen2.5-14b --moments bf16 \\
      --batch 1 2 --plan-only --host-memory-gb 123 --device-memory-gb 75.2
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offload_bench  # noqa: E402  (the measurement; imports nothing heavy at the top)

CONFIGS = offload_bench.CONFIGS
OFFLOAD = {"device": False, "offload": True, "offload_dpu": True, "auto": "auto",
           "auto_dpu": "auto"}
# Assumed for --plan-only's step: model TFLOPS of jzo's device step alone at
# long sequences (gpt2-4b without offload ran at 432 on an H100), pinned
# PCIe bandwidth each way (/work/shared/DESIGN.md: 50-54 GB/s).
ASSUMED_DEVICE_TFLOPS = 420.0
PCIE_BYTES_PER_S = 50e9
# bytes_limit of an H100 80GB under XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
# (the planner's 70.71 GiB at 6% headroom in experiments/RESULTS.md).
H100_DEVICE_GIB = 75.2
# How a child process's stdout marks a record.
RECORD = "RECORD "


def model_config(args):
  """The preset at --seq-len (its context, and the T of its FLOPs), --remat
  and --n-layer."""
  from jzo.models import llama
  config = llama.PRESETS[args.model]
  return dataclasses.replace(config, seq_len=args.seq_len, remat=args.remat,
                             n_layer=args.n_layer or config.n_layer)


def make_tx(args, offload):
  """AdamW as offload_bench builds it: jzo's on the host, optax's on the GPU."""
  import jax.numpy as jnp
  import optax

  import jzo
  moments = jnp.bfloat16 if args.moments == "bf16" else None
  if offload is False:
    return optax.adamw(3e-4, weight_decay=0.1, mu_dtype=moments)
  return jzo.cpu_adamw(3e-4, weight_decay=0.1, mu_dtype=moments, nu_dtype=moments)


def run_one(args) -> None:
  """Builds one engine and measures it at each micro-batch of --batch;
  prints each record on a line of its own after RECORD."""
  config = model_config(args)
  offload = OFFLOAD[args.config]
  if offload is not False:
    # Before JAX starts its GPU backend: the pool holds every parameter's
    # bf16 gradient at most (the recipe's cap, jzo.recipe.loop).
    from jzo import plan
    plan.limit_pinned_pool(2 * config.n_params)
  import jax
  import numpy as np
  import psutil

  import jzo
  from jzo.models import llama

  activations = {micro: llama.activation_bytes(config, micro, args.seq_len)
                 for micro in args.batch}
  jax.devices()  # the runtime's own host memory counts as the baseline
  rss_before = psutil.Process().memory_info().rss
  start = time.perf_counter()
  gib = lambda b: None if b is None else int(b * 2**30)
  engine = jzo.ZeroEngine(
      functools.partial(llama.loss_fn, config),
      functools.partial(llama.init_params, config, jax.random.PRNGKey(0)),  # leaf by leaf
      make_tx(args, offload), stage=2,
      mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
      max_grad_norm=1.0, grad_accum=args.grad_accum, offload=offload,
      delayed_update=args.config.endswith("_dpu"), dpu_warmup=1,
      activation_memory=max(activations.values()),
      host_memory=gib(args.host_memory_gb), device_memory=gib(args.device_memory_gb),
      landing_limit=gib(args.landing_limit_gb))
  build_s = time.perf_counter() - start
  rss_built = psutil.Process().memory_info().rss
  print(f"built in {build_s:.1f} s, host RSS {rss_built / 2**30:.2f} GiB", file=sys.stderr)
  print(engine.plan, file=sys.stderr, flush=True)
  for micro in args.batch:
    record = offload_bench.measure_batch(args, engine, config, micro, rss_before, rss_built,
                                         build_s, activations[micro])
    record.update(family="llama", flops_per_token=config.flops_per_token(),
                  streamed=engine.plan.streamed,
                  landing_gib=(engine.plan.host_bytes()["landing"] / 2**30
                               if engine.plan.cpu_adam else 0.0),
                  flops_formula="6 N + 12 L (H head_dim) T per token")
    # At once, so that a later micro-batch that fails does not take it along.
    print(RECORD + json.dumps(record), flush=True)
  engine.close()


def failure(args, name: str, returncode: int, stderr: str) -> dict:
  """The record of a configuration that did not train: "refused" by the
  planner, "GPU OOM", "host OOM" (SIGKILL: the kernel's OOM killer),
  "timeout" or "error", with the last lines it printed."""
  lines = stderr.strip().splitlines()
  if returncode in (-9, 137):
    status = "host OOM"
  elif returncode == 124:
    status = "timeout"
  elif any("PlacementError" in line for line in lines[-5:]):
    status = "refused"
  elif "RESOURCE_EXHAUSTED" in stderr or "out of memory" in stderr.lower():
    status = "GPU OOM"
  else:
    status = "error"
  config = model_config(args)
  return {"config": name, "family": "llama", "model": args.model, "n_layer": config.n_layer,
          "n_params": config.n_params, "moments": args.moments, "batch": args.batch[0],
          "seq_len": args.seq_len, "status": status, "exit": returncode, "detail": lines[-3:]}


def plan_only(args) -> list[dict]:
  """The planner's table and a step's arithmetic at each micro-batch, from
  shapes alone."""
  import jax

  import jzo
  from jzo import plan as plan_lib
  from jzo.models import llama
  config = model_config(args)
  if OFFLOAD[args.config] is not False:
    plan_lib.limit_pinned_pool(2 * config.n_params)  # as run_one: no rounding up
  shapes = jax.eval_shape(functools.partial(llama.init_params, config, jax.random.PRNGKey(0)))
  offload = OFFLOAD[args.config]
  device_gib = args.device_memory_gb or H100_DEVICE_GIB
  rows = []
  for micro in args.batch:
    acts = llama.activation_bytes(config, micro, args.seq_len)
    est = jzo.planner.estimate(
        shapes, activations=acts, offload=offload, moments=args.moments,
        grad_accum=args.grad_accum, delayed_update=args.config.endswith("_dpu"),
        device_memory=int(device_gib * 2**30),
        host_memory=int(args.host_memory_gb * 2**30) if args.host_memory_gb else None)
    print(f"\n== {args.model}, {args.config}, {args.moments} moments, micro-batch {micro} x "
          f"{args.grad_accum}, seq {args.seq_len}\n{est}")
    tokens = micro * args.grad_accum * args.seq_len
    flops = tokens * config.flops_per_token()
    device_s = flops / (ASSUMED_DEVICE_TFLOPS * 1e12)
    row = {"model": args.model, "config": args.config, "moments": args.moments,
           "batch": micro, "seq_len": args.seq_len, "n_params": config.n_params,
           "fits": est.fits, "activations_gib": acts / 2**30,
           "tflop_per_step": flops / 1e12, "device_s": device_s}
    if est.plan is not None and est.plan.cpu_adam:
      host = est.plan.host_elements
      # Each host parameter's bf16 gradient goes down and its bf16 weight up.
      transfer_s = 2 * host / PCIE_BYTES_PER_S
      update_s = host / plan_lib.HOST_UPDATE_PARAMS_PER_S
      # The delayed update overlaps the host's work with the next device step.
      step_s = (max(device_s, update_s + transfer_s) if args.config.endswith("_dpu")
                else device_s + update_s + transfer_s)
      row.update(host_params=host, offloaded_fraction=est.plan.offloaded_fraction,
                 device_peak_gib=sum(est.plan.device_peak(acts).values()) / 2**30,
                 host_state_gib=sum(est.plan.host_bytes().values()) / 2**30,
                 host_update_s=update_s, transfer_s=transfer_s, step_s=step_s,
                 tflops=flops / step_s / 1e12)
    rows.append(row)
    print("arithmetic: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in row.items()))
  return rows


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="llama-3.1-8b", help="a preset of jzo.models.llama")
  parser.add_argument("--seq-len", type=int, default=4096)
  parser.add_argument("--batch", type=int, nargs="+", default=[1],
                      help="micro-batch (sequences); several: one engine measured at each")
  parser.add_argument("--n-layer", type=int, help="layers, instead of the preset's")
  parser.add_argument("--grad-accum", type=int, default=1)
  parser.add_argument("--remat", default="full", help="full, dots or none")
  parser.add_argument("--configs", nargs="+", default=["auto_dpu"], choices=CONFIGS)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--moments", choices=["fp32", "bf16"], default="fp32",
                      help="dtype of the Adam moments")
  parser.add_argument("--host-memory-gb", type=float,
                      help="host RAM offload may use (default: what the OS reports available)")
  parser.add_argument("--device-memory-gb", type=float,
                      help="device memory the plan may use (default: the allocator's limit; "
                      f"--plan-only: {H100_DEVICE_GIB}, an H100's at 0.95)")
  parser.add_argument("--landing-limit-gb", type=float,
                      help="landing buffers' limit (ZeroEngine's landing_limit; default: "
                      "the plan's, which streams the update through 2 GiB where one set "
                      "is more; 0: one set)")
  parser.add_argument("--compiled-memory", action="store_true",
                      help="print the compiled step's memory analysis first")
  parser.add_argument("--timeout", type=float, default=600,
                      help="seconds a configuration may run before it is killed")
  parser.add_argument("--plan-only", action="store_true",
                      help="print the plan and a step's arithmetic; run nothing")
  parser.add_argument("--json", help="file for the records (a JSON list)")
  parser.add_argument("--config", help=argparse.SUPPRESS)  # child process: one run
  return parser.parse_args()


def child_command(args, name: str) -> list[str]:
  """The command line of the child process that measures configuration `name`."""
  cmd = [sys.executable, os.path.abspath(__file__), "--config", name, "--model", args.model,
         "--seq-len", str(args.seq_len), "--batch", *map(str, args.batch),
         "--grad-accum", str(args.grad_accum), "--steps", str(args.steps),
         "--moments", args.moments, "--remat", args.remat]
  for flag, value in (("--n-layer", args.n_layer), ("--host-memory-gb", args.host_memory_gb),
                      ("--device-memory-gb", args.device_memory_gb),
                      ("--landing-limit-gb", args.landing_limit_gb)):
    if value is not None:  # --landing-limit-gb 0 (one set of landing buffers) included
      cmd += [flag, str(value)]
  return cmd + (["--compiled-memory"] if args.compiled_memory else [])


def main():
  args = parse_args()
  from jzo.recipe.loop import claim_gpu_memory
  claim_gpu_memory()  # as jzo's command line
  if args.plan_only:
    args.config = args.config or args.configs[0]
    rows = plan_only(args)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)
    return
  if args.config:
    run_one(args)
    return
  results = []
  for name in args.configs:
    start = time.perf_counter()
    try:
      out = subprocess.run(child_command(args, name), capture_output=True, text=True,
                           timeout=args.timeout)
      returncode, stdout, stderr = out.returncode, out.stdout, out.stderr
    except subprocess.TimeoutExpired as e:  # run() has killed the child
      returncode = 124
      text = lambda x: x.decode() if isinstance(x, bytes) else (x or "")
      stdout, stderr = text(e.stdout), text(e.stderr)
    wall = time.perf_counter() - start
    for line in stdout.splitlines():
      if line.startswith(RECORD):
        results.append(dict(json.loads(line[len(RECORD):]), wall_s=wall))
        print(json.dumps(results[-1]), flush=True)
    if returncode:
      print(f"{name} failed (exit {returncode}):\n{stderr[-3000:]}", flush=True)
      results.append(dict(failure(args, name, returncode, stderr), wall_s=wall))
    else:
      print(stderr[-2500:], flush=True)  # the plan and the steps
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  for r in results:
    if r["status"] != "ok":
      print(f"{r['config']:<12} {r['status']}: {r['detail'][-1] if r['detail'] else ''}")
      continue
    print(f"{r['config']:<12} mb {r['batch']} {r['step_s']:.3f} s/step {r['tflops']:.1f} "
          f"TFLOPS; GPU peak {r['peak_gpu_gib']:.2f} GiB (planned {r['planned_gpu_gib']:.2f}); "
          f"host RSS peak {r['host_rss_peak_gib']:.2f} GiB, state {r['host_state_gib']:.2f} "
          f"(planned {r['planned_host_state_gib']:.2f}); {100 * r['offloaded_fraction']:.1f}% "
          f"on the host" + (f"; device step {r['device_step_s']:.3f} s, host update "
                            f"{r['host_update_s']:.3f} s" if "device_step_s" in r else ""))


if __name__ == "__main__":
  main()
