"""Which engine options make XLA's CPU compiler crash (jax 0.11.2): each
variant of test_accumulation's crashing case (stage 1, offload 0.5, float32,
8 CPU devices, 4 micro-batches summed on the device, clipping) builds an
engine and takes one step in a subprocess of its own; prints its exit code.

  python experiments/segv_bisect.py [NAME ...]
"""

import json
import os
import subprocess
import sys

BASE = dict(stage=1, offload=0.5, compute_dtype="float32", grad_accum=4, max_grad_norm=1.0,
            accumulation="device", devices=8, empty=None)
VARIANTS = {
    "base": {},
    "all-host": dict(offload=True),
    "stage2": dict(stage=2),
    "no-accum": dict(grad_accum=1),
    "no-clip": dict(max_grad_norm=None),
    "2-devices": dict(devices=2),
    "1-device": dict(devices=1),
    "host-accum": dict(accumulation="host"),
    "no-offload": dict(offload=False),
    "bf16": dict(compute_dtype="bfloat16"),
    "offload-0.25": dict(offload=0.25),
    # the empty device parts of the state all placed alike before the first step
    "empty-sharded": dict(empty="data"),
    "empty-replicated": dict(empty="replicated"),
    "no-accum-empty-replicated": dict(grad_accum=1, empty="replicated"),
}

CHILD = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
sys.path.insert(0, "tests")
import jax.numpy as jnp
import jzo
from test_engine import batches, init_params, loss_fn, mesh_of
from test_offload import TX
o = json.loads(sys.argv[1])
engine = jzo.ZeroEngine(loss_fn, init_params(), TX(), mesh=mesh_of(o["devices"]),
                        stage=o["stage"], offload=o["offload"],
                        compute_dtype=getattr(jnp, o["compute_dtype"]),
                        grad_accum=o["grad_accum"], max_grad_norm=o["max_grad_norm"],
                        accumulation=o["accumulation"])
if o.get("empty"):
  from jax.sharding import NamedSharding, PartitionSpec as P
  to = NamedSharding(engine.mesh, P("data") if o["empty"] == "data" else P())
  place = lambda x: jax.device_put(x, to) if x.size == 0 and x.ndim == 1 else x
  s = engine.state
  engine.state = s._replace(master=jax.tree.map(place, s.master),
                            opt_state=jax.tree.map(place, s.opt_state))
for b in batches(2, size=64):
  loss = engine.step(b).loss
print("loss", float(loss))
"""


def main():
  names = sys.argv[1:] or list(VARIANTS)
  env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
  for name in names:
    options = {**BASE, **VARIANTS[name]}
    if options["grad_accum"] == 1 or options["offload"] is False:
      options["accumulation"] = "auto"
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(options)], env=env,
                         capture_output=True, text=True, timeout=300)
    last = (run.stdout.strip().splitlines() or [""])[-1]
    err = [l for l in run.stderr.splitlines() if "Error" in l or "Fatal" in l][-1:]
    print(f"{name:<14} exit {run.returncode:4}  {last} {' '.join(err)}", flush=True)


if __name__ == "__main__":
  main()
