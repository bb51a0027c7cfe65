"""The largest GPT jzo trains per GPU count with offload (figure 5): the
planner's answer from shapes, then (--run) a measured run of each.

For each GPU count N of --gpus, the layer count L of a base shape (--base,
default gpt2-20b: d_model 6144, 48 heads, 0.45B parameters a layer) is
searched for the largest model the planner fits on N devices of --device-gb
each and --host-gb of host RAM, at --batch sequences a GPU, seq 1024, full
remat, --moments Adam moments, no checkpoints. Two placements are tried,
both ZeRO stage 3 with offload, and the larger kept:
  auto     the optimizer state on the GPUs where it fits, the rest on the
           host (the GPUs' memory adds up with N);
  params   all of the optimizer state on the host and the layers' weights
           in pinned host memory, as many layers resident as fit
           (--offload-params auto: the GPU holds almost nothing of the model).
With --run, each count's largest trains --steps steps in
experiments/offload_bench.py (its own process, a time limit), and its
record (or why it failed: "oom", "killed" by the host, "timeout") goes
beside the plan.

  python experiments/largest_model.py --gpus 1 2 4 --json largest.json [--run]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# Placement name -> (offload_bench.py's --config, its extra flags; the planner's options).
PLACEMENTS = {
    "auto": (["--configs", "auto"], dict(offload="auto")),
    "params": (["--configs", "offload", "--offload-params", "auto"],
               dict(offload=True, offload_params="auto")),
}


def fits(config, gpus: int, placement: str, args) -> bool:
  """Whether the planner fits `config` on `gpus` devices in `placement`."""
  import jax

  from jzo.models import gpt
  from jzo.planner import estimate

  shapes = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  found = estimate(shapes, activations=gpt.activation_bytes(config, args.batch, args.seq_len),
                   devices=gpus, stage=3, layers="blocks", moments=args.moments,
                   device_memory=int(args.device_gb * 2**30) if args.device_gb else None,
                   host_memory=int(args.host_gb * 2**30) if args.host_gb else None,
                   **PLACEMENTS[placement][1])
  return found.fits


def base_config(args):
  """The base preset at --seq-len with full remat: the shape whose layers are counted."""
  from jzo.models import gpt
  return dataclasses.replace(gpt.PRESETS[args.base], seq_len=args.seq_len, remat="full")


def largest_layers(gpus: int, placement: str, args) -> int:
  """The most layers of the base shape that fit (0: not even one)."""
  base = base_config(args)
  ok = lambda n: fits(dataclasses.replace(base, n_layer=n), gpus, placement, args)
  low, high = 0, 1
  while ok(high):  # doubling until one does not fit, then halving the gap
    low, high = high, 2 * high
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if ok(mid) else (low, mid)
  return low


def device_gib() -> float:
  """GiB of this machine's first accelerator that a run's plan may use,
  asked of a process of its own: JAX in this one would start on every GPU
  and hold their memory and the runtime's host RAM while the runs train."""
  ask = ("import jax, jzo.plan as p; "
         "print((p.device_memory_limit(jax.devices()[0]) or 0) / 2**30)")
  first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
  env = dict(os.environ, CUDA_VISIBLE_DEVICES=first, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  done = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, env=env)
  if done.returncode or not float(done.stdout.split()[-1]):
    raise SystemExit(f"no accelerator's memory to plan with; give --device-gb\n{done.stderr}")
  return float(done.stdout.split()[-1])


def run(gpus: int, placement: str, n_layer: int, args) -> dict:
  """offload_bench.py on the largest model: its record, or why it failed."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "out.json")
    cmd = [sys.executable, os.path.join(HERE, "offload_bench.py"), "--model", args.base,
           "--n-layer", str(n_layer), "--gpus", str(gpus), "--stage", "3",
           "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--moments", args.moments,
           "--steps", str(args.steps), "--no-breakdown", "--json", out,
           *PLACEMENTS[placement][0]]
    # The run plans with the memory the search planned with: the host's as it
    # was before any run, which the run's own runtime then takes from.
    cmd += ["--device-memory-gb", str(args.device_gb), "--host-memory-gb", str(args.host_gb)]
    print("$", " ".join(cmd), flush=True)
    try:
      done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit)
    except subprocess.TimeoutExpired:
      return {"status": "timeout", "limit_s": args.limit}
    print(done.stdout[-2000:], flush=True)
    if not os.path.exists(out):
      return {"status": "error", "exit": done.returncode, "detail": done.stderr[-1500:]}
    with open(out) as f:
      return json.load(f)[0]  # offload_bench's record, or its failure's


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
  parser.add_argument("--base", default="gpt2-20b", help="the preset whose layers are counted")
  parser.add_argument("--batch", type=int, default=8, help="sequences a GPU")
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--moments", choices=["fp32", "bf16", "int8"], default="fp32")
  parser.add_argument("--device-gb", type=float,
                      help="GiB of one device the plan may use (default: this machine's "
                      "first accelerator's)")
  parser.add_argument("--host-gb", type=float,
                      help="GiB of host RAM (default: what this machine has available at the "
                      "start)")
  parser.add_argument("--run", action="store_true", help="train each count's largest")
  parser.add_argument("--steps", type=int, default=2, help="timed steps of each run")
  parser.add_argument("--limit", type=float, default=480, help="seconds a run may take")
  parser.add_argument("--json")
  args = parser.parse_args()
  args.device_gb = args.device_gb or device_gib()
  if not args.host_gb:  # read once, before any run: the search and each run plan with it
    from jzo.plan import available_host_memory
    args.host_gb = available_host_memory() / 2**30

  base = base_config(args)  # the shape planned, so its parameter count is the plan's
  results = []
  for gpus in args.gpus:
    layers = {p: largest_layers(gpus, p, args) for p in PLACEMENTS}
    placement = max(layers, key=layers.get)
    n_params = (dataclasses.replace(base, n_layer=layers[placement]).n_params
                if layers[placement] else 0)
    record = {"gpus": gpus, "base": args.base, "placement": placement,
              "n_layer": layers[placement], "n_params": n_params,
              "layers_by_placement": layers, "batch": args.batch, "moments": args.moments}
    print(f"{gpus} GPU(s): {n_params / 1e9:.2f}B ({layers[placement]} layers of "
          f"{args.base}, {placement}); by placement: {layers}", flush=True)
    if args.run and layers[placement]:
      record["trained"] = run(gpus, placement, layers[placement], args)
      print("  trained:", record["trained"].get("status"),
            f"{record['trained'].get('tflops', 0):.1f} TFLOPS a GPU", flush=True)
    results.append(record)
    if args.json:  # after each count
      with open(args.json, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
