"""The largest GPT jzo trains with offload per GPU count: the planner's answer
from shapes, then (--run) a training run of each.

For each GPU count N of --gpus, the layer count of a base shape (--base,
default gpt2-20b: d_model 6144, 0.45B parameters a layer) is searched for the
largest model the planner (jzo.estimate) fits on N devices of --device-gb
each and --host-gb of host RAM, at --batch sequences a GPU, --seq-len, full
remat, each of --moments' Adam moments. Two placements are tried, both ZeRO stage 3
with offload, and the one of more layers kept:
  auto    the optimizer state on the GPUs where it fits, the rest on the
          host (the GPUs' memory adds up with N);
  params  all of the optimizer state on the host and the layers' weights in
          pinned host memory, as many layers resident as fit.
With --run each count's answer trains --steps steps in a child of
benchmarks/train_gpt.py (a time limit), planned with the same memory; its
point, or why it did not train ("oom", "killed": the host, "timeout"),
goes beside the plan's.

  python3 benchmarks/largest_model.py --gpus 1 2 4 --moments fp32 int8 --run --limit 450 \\
      --json largest.json
  python3 benchmarks/largest_model.py --base tiny --seq-len 32 --batch 2 --device-gb 0.02 \\
      --host-gb 4.4 --moments fp32 int8 --run --steps 1      # a CPU
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
# Placement -> (train_gpt.py's flags, jzo.estimate's options).
PLACEMENTS = {
    "auto": (["--child", "auto"], dict(offload="auto")),
    "params": (["--child", "offload", "--offload-params", "auto"],
               dict(offload=True, offload_params="auto")),
}


def base_config(args, n_layer: int | None = None):
  from jzo.models import gpt
  config = dataclasses.replace(gpt.PRESETS[args.base], seq_len=args.seq_len, remat="full")
  return dataclasses.replace(config, n_layer=n_layer) if n_layer else config


def fits(n_layer: int, gpus: int, placement: str, moments: str, args) -> bool:
  """Whether the planner fits `n_layer` layers on `gpus` devices in
  `placement` with `moments` Adam moments."""
  import jax
  import jzo
  from jzo.models import gpt
  from jzo.plan import host_runtime_bytes
  config = base_config(args, n_layer)
  shapes = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  device_memory = int(args.device_gb * 2**30)
  # The search runs on the CPU (it takes no GPU from the runs), where
  # jzo.estimate counts a CPU process's runtime: what the run's GPUs add to
  # it (their allocators' tables, a driver each) comes off the host here.
  gpu_runtime = (host_runtime_bytes(gpus, "gpu", device_memory)
                 - host_runtime_bytes(gpus, "cpu", device_memory))
  return jzo.estimate(shapes, activations=gpt.activation_bytes(config, args.batch, args.seq_len),
                      devices=gpus, stage=3, layers="blocks", moments=moments,
                      device_memory=device_memory,
                      host_memory=int(args.host_gb * 2**30) - gpu_runtime,
                      **PLACEMENTS[placement][1]).fits


def largest_layers(gpus: int, placement: str, moments: str, args) -> int:
  """The most layers that fit (0: not even one): doubling until one does
  not, then halving the gap."""
  low, high = 0, 1
  while fits(high, gpus, placement, moments, args):
    low, high = high, 2 * high
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if fits(mid, gpus, placement, moments, args) else (low, mid)
  return low


def device_gib() -> float:
  """GiB of this machine's first accelerator a plan may use (0: none reports
  its memory), asked of a process of its own: JAX here would hold every GPU
  while the runs train."""
  ask = ("import jax, jzo.plan as p; "
         "print((p.device_memory_limit(jax.devices()[0]) or 0) / 2**30)")
  first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
  env = dict(os.environ, CUDA_VISIBLE_DEVICES=first, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, env=env)
  return float(done.stdout.split()[-1]) if done.returncode == 0 and done.stdout.split() else 0.0


def run_environment(args, machine_gib: float | None) -> dict[str, str]:
  """The run's GPU allocator held to --device-gb where that is less than the
  machine's: the allocator's host tables, which the plan counts, then match
  the device the search planned for."""
  if not machine_gib or args.device_gb >= machine_gib:
    return {}
  fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"))
  return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction * args.device_gb / machine_gib:.4f}"}


def largest(gpus: int, moments: str, args, machine_gib: float) -> dict:
  """The point of `gpus` GPUs with `moments`: the planner's largest, and its
  run with --run."""
  layers = {p: largest_layers(gpus, p, moments, args) for p in PLACEMENTS}
  placement = max(layers, key=layers.get)
  n_layer = layers[placement]
  point = {"status": "ok", "gpus": gpus, "base": args.base, "placement": placement,
           "n_layer": n_layer, "n_params": base_config(args, n_layer).n_params if n_layer else 0,
           "layers_by_placement": layers, "batch": args.batch, "moments": moments,
           "device_gb": args.device_gb, "host_gb": args.host_gb}
  print(f"{gpus} GPU(s), {moments} moments: {point['n_params'] / 1e9:.2f}B ({n_layer} layers of "
        f"{args.base}, {placement}); by placement: {layers}", flush=True)
  if args.run and n_layer:
    cmd = [sys.executable, os.path.join(HERE, "train_gpt.py"), *PLACEMENTS[placement][0],
           "--model", args.base, "--n-layer", str(n_layer), "--gpus", str(gpus),
           "--stage", "3", "--batch", str(args.batch), "--seq-len", str(args.seq_len),
           "--moments", moments, "--steps", str(args.steps), "--no-breakdown",
           "--device-memory-gb", str(args.device_gb), "--host-memory-gb", str(args.host_gb)]
    # The environment's JAX_PLATFORMS for the run (this process's is set in jax.config).
    point["trained"] = harness.run_child(cmd, timeout_s=args.limit,
                                         env=run_environment(args, machine_gib))[0]
    run = point["trained"]
    print(f"  trained: {run['status']}" + (f", {run['tflops']:.1f} TFLOPS a GPU"
                                           if run["status"] == "ok" else ""), flush=True)
  return point


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--base", default="gpt2-20b", help="the preset whose layers are stacked")
  parser.add_argument("--batch", type=int, default=8, help="sequences a GPU")
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--moments", choices=["fp32", "bf16", "int8"], nargs="+", default=["fp32"],
                      help="Adam moments' dtypes: each GPU count is searched with each")
  parser.add_argument("--device-gb", type=float, help="GiB of one device the plan may use "
                      "(default: this machine's first accelerator's)")
  parser.add_argument("--host-gb", type=float, help="GiB of host RAM (default: what this "
                      "machine has available at the start)")
  parser.add_argument("--run", action="store_true", help="train each count's largest")
  parser.add_argument("--steps", type=int, default=2, help="timed steps of each run")
  parser.add_argument("--limit", type=float, default=480, help="seconds a run may take")
  args = parser.parse_args()
  import jax
  jax.config.update("jax_platforms", "cpu")  # the search plans from shapes: no GPU taken
  machine_gib = device_gib()
  args.device_gb = args.device_gb or machine_gib
  if not args.device_gb:
    parser.error("no accelerator here reports its memory: give --device-gb")
  if not args.host_gb:  # read once, before any run: the search and each run plan with it
    from jzo.plan import available_host_memory
    args.host_gb = available_host_memory() / 2**30
  points = []
  for moments in args.moments:
    for gpus in args.gpus:
      points.append(largest(gpus, moments, args, machine_gib))
      harness.write_record(args.json, "largest_model", args, points, with_devices=False)
  harness.child_result(points)


if __name__ == "__main__":
  main()
