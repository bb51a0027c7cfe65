"""Device memory through the host exchange of an offloading engine, leaf by
leaf: bytes in use after each upload, install and download (the transfer
calls are wrapped; the engine is unchanged).

  python experiments/exchange_memory.py --model gpt2-4b --offload 0.5
"""

import argparse
import collections
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jzo
from jzo.recipe import estimate as estimate_cli
from jzo.models import gpt


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-4b")
  parser.add_argument("--offload", type=estimate_cli.parse_offload, default=0.5)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--steps", type=int, default=4)
  args = parser.parse_args()
  config = dataclasses.replace(gpt.PRESETS[args.model], seq_len=1024)
  engine = jzo.ZeroEngine(
      functools.partial(gpt.loss_fn, config),
      functools.partial(gpt.init_params, config, jax.random.PRNGKey(0)),
      jzo.cpu_adamw(3e-4), stage=2, mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",)),
      axis="d", offload=args.offload, delayed_update=True, dpu_warmup=1, max_grad_norm=1.0,
      activation_memory=gpt.activation_bytes(config, args.batch, 1024))
  print(engine.plan, file=sys.stderr)
  gib = lambda: round((jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0) / 2**30, 2)
  transfer = engine.host_update.transfer
  for name in ("upload", "download"):
    inner = getattr(transfer, name)

    def traced(i, x, inner=inner, name=name):
      out = inner(i, x)
      print(f"  {name} {i}: {gib()} GiB in use", file=sys.stderr, flush=True)
      return out
    setattr(transfer, name, traced)
  install = engine.trained.install

  def traced_install(i, uploaded, span=None):
    out = install(i, uploaded, span)
    print(f"  install {i}: {gib()} GiB in use", file=sys.stderr, flush=True)
    return out
  engine.trained.install = traced_install
  batch = {"tokens": jnp.zeros((args.batch, 1025), jnp.int32)}
  for step in range(args.steps):
    print(f"step {step}: before {gib()} GiB", file=sys.stderr, flush=True)
    live_before = {id(x): x for x in jax.live_arrays() if x.sharding.memory_kind == "device"}
    try:
      jax.block_until_ready(engine.step(batch).loss)
    except Exception as e:  # what held the device memory when the step failed
      print(f"step {step} failed: {e}", file=sys.stderr)
      counts = collections.Counter(
          (tuple(x.shape), str(x.dtype), id(x) in live_before, x.is_deleted())
          for x in jax.live_arrays() if x.sharding.memory_kind == "device")
      for (shape, dtype, before, deleted), n in counts.most_common(20):
        print(f"  live: {n} x {shape} {dtype} (alive before the step: {before}, "
              f"deleted: {deleted})", file=sys.stderr)
      raise
  engine.close()


if __name__ == "__main__":
  main()
