"""Where a process's host memory grows, phase by phase: gpt2 (--model) at
--stage (3) over --gpus GPUs, with all the optimizer state on the host (int8
or fp32 moments; --delayed-update: the paper's one-step delayed update) or
(--no-offload) none of it.

Prints the resident set after the runtime starts, after the engine is
built (beside jzo's own count of its host arrays and landing buffers,
`host_bytes_in_use`), after the step is compiled ahead of time, after the
device step alone, and after whole steps; each with the resident set by
kind of mapping (anonymous, glibc's malloc arenas, thread stacks, files),
and the mappings other than files that grew most since the engine was built:

  python experiments/host_rss_phases.py --model gpt2-1.5b --moments int8 --gpus 2
  python experiments/host_rss_phases.py --model gpt2-13b --moments fp32 --stage 2 \
      --delayed-update --gpus 2
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import re

ARENA_BYTES = 64 << 20  # a glibc malloc arena's heap reservation (64-bit)


def mappings() -> dict[str, tuple[str, int, int]]:
  """This process's mappings: start address -> (kind, size, resident bytes).
  Kinds: file, stack, heap, arena (anonymous, 64 MiB: glibc's per-thread
  heaps), anon."""
  found, current = {}, None
  with open("/proc/self/smaps") as f:
    for line in f:
      head = re.match(r"([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)", line)
      if head:
        start, end, name = int(head[1], 16), int(head[2], 16), head[3].strip()
        size = end - start
        kind = ("stack" if "stack" in name else "heap" if name == "[heap]" else
                "file" if name.startswith("/") else "arena" if not name and size == ARENA_BYTES
                else "anon")
        current = head[1]
        found[current] = (kind, size, 0)
      elif line.startswith("Rss:") and current:
        kind, size, _ = found[current]
        found[current] = (kind, size, int(line.split()[1]) * 1024)
  return found


def peak_rss() -> int:
  """This process's peak resident set so far (VmHWM), in bytes: with the
  delayed update the host's work goes on after a step returns."""
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def by_kind(found) -> str:
  """Resident GiB by kind of mapping, and how many arenas."""
  totals = collections.Counter()
  for kind, _, rss in found.values():
    totals[kind] += rss
  arenas = sum(kind == "arena" for kind, _, _ in found.values())
  return " ".join(f"{k} {v / 2**30:.2f}" for k, v in sorted(totals.items())) + \
      f" ({arenas} arenas)"


def grown(before, after, top: int = 6) -> str:
  """The mappings other than files (anonymous, arenas, heap, stacks) that
  grew most between two `mappings()`."""
  rises = sorted(((rss - before.get(addr, ("", 0, 0))[2], kind, size, addr)
                  for addr, (kind, size, rss) in after.items() if kind != "file"), reverse=True)
  return ", ".join(f"{kind} {size / 2**20:.0f} MiB +{rise / 2**20:.0f}"
                   for rise, kind, size, addr in rises[:top] if rise > 0)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-1.5b")
  parser.add_argument("--moments", choices=["fp32", "int8"], default="int8")
  parser.add_argument("--batch", type=int, default=8, help="sequences a GPU")
  parser.add_argument("--gpus", type=int, default=1)
  parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=3)
  parser.add_argument("--delayed-update", action="store_true",
                      help="with offload, the update overlaps the next step")
  parser.add_argument("--steps", type=int, default=3, help="whole steps after the device step")
  parser.add_argument("--no-offload", action="store_true",
                      help="all of the optimizer state on the GPUs")
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
  seen = {}

  def phase(name, **extra):
    seen[name] = mappings()
    print(name, "rss", gib(psutil.Process().memory_info().rss), "peak", gib(peak_rss()),
          *(f"{k} {gib(v)}" for k, v in extra.items()), "|", by_kind(seen[name]), flush=True)
    if "built" in seen and name != "built":
      print("  grown since built:", grown(seen["built"], seen[name]), flush=True)
  config = dataclasses.replace(gpt.PRESETS[args.model], seq_len=1024)
  moments = jnp.int8 if args.moments == "int8" else None
  jzo.plan.limit_pinned_pool(2 * config.n_params, args.gpus)  # as the recipe
  jax.devices()
  phase("runtime started")
  engine = jzo.ZeroEngine(
      functools.partial(gpt.loss_fn, config),
      functools.partial(gpt.init_params, config, jax.random.PRNGKey(0)),
      jzo.cpu_adamw(3e-4, weight_decay=0.1, mu_dtype=moments, nu_dtype=moments),
      mesh=jax.sharding.Mesh(np.array(jax.devices()[:args.gpus]), ("data",)), stage=args.stage,
      offload=not args.no_offload, delayed_update=args.delayed_update and not args.no_offload,
      dpu_warmup=1, activation_memory=gpt.activation_bytes(config, args.batch, 1024))
  plan = engine.plan
  phase("built", host_bytes_in_use=engine.host_bytes_in_use(),
        planned_host=plan.runtime_bytes + (sum(plan.host_bytes().values()) + plan.pool_overhead()
                                           if plan.cpu_adam else 0))
  batch = {"tokens": jax.random.randint(jax.random.PRNGKey(1), (args.batch * args.gpus, 1025), 0,
                                        config.vocab_size, jnp.int32)}
  engine.lower(batch).compile()
  phase("compiled ahead of time")
  jax.block_until_ready(engine.run_device_step(batch)[0].loss)
  phase("device step alone")
  for i in range(args.steps):
    jax.block_until_ready(engine.step(batch).loss)
    phase(f"step {i}", host_bytes_in_use=engine.host_bytes_in_use())
  engine.close()


if __name__ == "__main__":
  main()
