"""The host memory of a process's runtime alone, in one process or one of several.

Each process starts jax (jax.distributed with --processes > 1, one GPU each
through CUDA_VISIBLE_DEVICES), sums a small array over every process's
device (the collectives' setup: NCCL between processes), and prints its
resident set then (GiB). The planner counts this as `HOST_RUNTIME_BYTES`
(jzo/plan.py) for every process; this shows what a process of several
adds to one alone, on the same machine.

  CUDA_VISIBLE_DEVICES=0 python experiments/runtime_probe.py
  for i in 0 1; do CUDA_VISIBLE_DEVICES=$i python experiments/runtime_probe.py \\
      --processes 2 --process-id $i --coordinator 127.0.0.1:23456 & done; wait
"""

from __future__ import annotations

import argparse
import json
import resource


def resident_gib() -> float:
  """This process's resident set now (VmRSS), in GiB."""
  with open("/proc/self/status") as f:
    kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
  return kib / 2**20


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--coordinator", default="127.0.0.1:23456")
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jzo import distributed

  if args.processes > 1:
    distributed.initialize_from_environment(args.coordinator, args.processes, args.process_id)
  after_start = resident_gib()
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  local = jnp.ones((jax.local_device_count(), 1024), jnp.float32)
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
  total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(x)
  total.block_until_ready()
  print(json.dumps({"processes": args.processes, "process_id": args.process_id,
                    "devices": jax.device_count(), "sum": float(total),
                    "rss_after_start_gib": round(after_start, 3),
                    "rss_after_collective_gib": round(resident_gib(), 3),
                    "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}))


if __name__ == "__main__":
  main()
