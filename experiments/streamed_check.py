"""A streamed host update on one GPU, of one leaf of more than 2**31
elements (as one device's shard of a stacked qwen2.5-14b leaf, 6.8e9): after
each step every weight on the device equals its float32 master in bf16, so
each span went up to its own offset (a 32-bit offset would have wrapped past
2**31 and written over the start of the leaf), and the weights moved.

  python experiments/streamed_check.py [--elements N] [--landing-gib 1] [--steps 2]

Prints one JSON line: the span count, each step's seconds and host timings,
and the checks.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jzo

CHUNK = 2**28  # elements compared at once


@functools.partial(jax.jit, static_argnums=(1, 2))
def take(w, lo: int, hi: int):
  """w[lo:hi] as a compiled static slice: jax's eager slicing passes its
  offsets as 32-bit arguments, which overflow past 2**31."""
  return jax.lax.slice_in_dim(w, lo, hi)


def loss_fn(params, batch):
  w = params["w"].astype(jnp.float32)
  return jnp.sum(w * w) * batch["s"][0]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--elements", type=int, default=2**31 + 2**28 + 12345)
  parser.add_argument("--landing-gib", type=float, default=1.0)
  parser.add_argument("--steps", type=int, default=2)
  args = parser.parse_args()
  n = args.elements
  init = lambda: {"w": jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.float32) * 0.02}
  engine = jzo.ZeroEngine(loss_fn, init, jzo.cpu_adamw(1e-3, mu_dtype=jnp.bfloat16,
                                                      nu_dtype=jnp.bfloat16),
                          mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
                          offload=True, landing_limit=int(args.landing_gib * 2**30))
  assert engine.plan.streamed
  span_bytes = engine.plan.landing_limit // jzo.plan.STREAM_SPANS
  spans = engine.host_update.transfer.spans(0, span_bytes)
  before = np.asarray(take(engine.state.params["w"], n - CHUNK, n))  # the last elements' weights
  record = {"elements": n, "landing_gib": args.landing_gib, "spans": len(spans),
            "device": str(jax.devices()[0]), "steps": []}
  batch = {"s": jnp.ones((1,), jnp.float32)}
  for _ in range(args.steps):
    start = time.perf_counter()
    engine.step(batch)
    jax.block_until_ready(engine.state.params)
    record["steps"].append({"s": time.perf_counter() - start, **engine.host_timings})
  weights, master = engine.state.params["w"], engine.host.master["w"][0]
  mismatched = 0
  for lo in range(0, n, CHUNK):
    hi = min(lo + CHUNK, n)
    got = np.asarray(take(weights, lo, hi)).view(np.uint16)
    want = master[lo:hi].astype(ml_dtypes.bfloat16).view(np.uint16)
    mismatched += int(np.count_nonzero(got != want))
  moved = float(np.mean(np.asarray(take(weights, n - CHUNK, n)) != before))
  record.update(mismatched=mismatched, moved_share_of_last_chunk=moved,
                landing_peak_gib=engine.host_update.landing_peak / 2**30,
                ok=mismatched == 0 and moved > 0.9)
  print(json.dumps(record), flush=True)
  engine.close()
  raise SystemExit(0 if record["ok"] else 1)


if __name__ == "__main__":
  main()
