"""Where a process's host memory grows, phase by phase: gpt2 (--model) with
all the optimizer state on the host (int8 or fp32 moments), one GPU.

Prints the resident set after the runtime starts, after the engine is
built (beside jzo's own count of its host arrays and landing buffers,
`host_bytes_in_use`), after the step is compiled ahead of time, after the
device step alone, and after whole steps:

  python experiments/host_rss_phases.py --model gpt2-1.5b --moments int8
"""

from __future__ import annotations

import argparse
import dataclasses
import functools


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-1.5b")
  parser.add_argument("--moments", choices=["fp32", "int8"], default="int8")
  parser.add_argument("--batch", type=int, default=8)
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp
  import numpy as np
  import psutil

  import jzo
  from jzo.models import gpt
  from jzo.recipe.loop import claim_gpu_memory

  claim_gpu_memory()
  gib = lambda b: round(b / 2**30, 2)
  phase = lambda name, **extra: print(name, "rss", gib(psutil.Process().memory_info().rss),
                                      *(f"{k} {gib(v)}" for k, v in extra.items()), flush=True)
  config = dataclasses.replace(gpt.PRESETS[args.model], seq_len=1024)
  moments = jnp.int8 if args.moments == "int8" else None
  jzo.plan.limit_pinned_pool(2 * config.n_params)  # as the recipe
  jax.devices()
  phase("runtime started")
  engine = jzo.ZeroEngine(
      functools.partial(gpt.loss_fn, config),
      functools.partial(gpt.init_params, config, jax.random.PRNGKey(0)),
      jzo.cpu_adamw(3e-4, weight_decay=0.1, mu_dtype=moments, nu_dtype=moments),
      mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)), offload=True,
      activation_memory=gpt.activation_bytes(config, args.batch, 1024))
  phase("built", host_bytes_in_use=engine.host_bytes_in_use())
  batch = {"tokens": jax.random.randint(jax.random.PRNGKey(1), (args.batch, 1025), 0,
                                        config.vocab_size, jnp.int32)}
  engine.lower(batch).compile()
  phase("compiled ahead of time")
  jax.block_until_ready(engine.run_device_step(batch)[0].loss)
  phase("device step alone")
  for i in range(3):
    jax.block_until_ready(engine.step(batch).loss)
    phase(f"step {i}", host_bytes_in_use=engine.host_bytes_in_use())
  engine.close()


if __name__ == "__main__":
  main()
