"""How much of a gpt2 step's device time is a forward pass that could run
while the host update before it is still under way (issue 23's bound).

A step of K micro-batches that first ran the layers' forward over the whole
global batch (saving each layer's input, as full rematerialization does),
layer by layer as the host's new weights came up, and then each micro-
batch's backward from those inputs, would take about

  K * (grad(m) - hidden(m)) + max(hidden(K m), host update)

of which hidden(K m) is the part that can hide the host update. This times,
on one GPU with bf16 weights (no optimizer, no engine), the layers' forward
(`hidden`) over K m and over m sequences, the whole loss over m, and its
value_and_grad over m (the model's remat policy):

  python experiments/forward_share.py --model gpt2-10b --micro-batch 8 --accumulation 4
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

from offload_bench import timed


def median_seconds(fn, steps: int) -> float:
  """Median seconds of `steps` calls of fn() after one warm-up (compile)."""
  import jax
  jax.block_until_ready(fn())
  return timed(lambda: jax.block_until_ready(fn()), steps)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-10b")
  parser.add_argument("--micro-batch", type=int, default=8)
  parser.add_argument("--accumulation", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--host-update", type=float, nargs="+", default=[1.60, 1.83, 2.02],
                      help="host updates (s) to bound the step with; gpt2-10b's with fp32 "
                      "moments: the kernel's best 1.60, measured 1.83 and 2.02 with 6.2%% and "
                      "none of the state on the GPU (RESULTS.md, session 19)")
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jzo.models import gpt

  config = dataclasses.replace(gpt.PRESETS[args.model], seq_len=args.seq_len)
  params = jax.jit(functools.partial(gpt.init_params, config, dtype=jnp.bfloat16))(
      jax.random.PRNGKey(0))
  m, k = args.micro_batch, args.accumulation
  tokens = lambda b: jax.random.randint(jax.random.PRNGKey(b), (b, args.seq_len + 1), 0,
                                        config.vocab_size, jnp.int32)

  @jax.jit
  def hidden(params, tokens):
    return nnx.merge(gpt._graphdef(config), params).hidden(tokens[:, :-1])

  loss = jax.jit(functools.partial(gpt.loss_fn, config))
  grad = jax.jit(jax.value_and_grad(functools.partial(gpt.loss_fn, config)))
  small, whole = {"tokens": tokens(m)}, {"tokens": tokens(k * m)}
  times = {f"hidden({k * m})": median_seconds(lambda: hidden(params, whole["tokens"]), args.steps),
           f"hidden({m})": median_seconds(lambda: hidden(params, small["tokens"]), args.steps),
           f"loss({m})": median_seconds(lambda: loss(params, small), args.steps),
           f"grad({m})": median_seconds(lambda: grad(params, small), args.steps)}
  device_step = k * times[f"grad({m})"]
  after_forward = k * (times[f"grad({m})"] - times[f"hidden({m})"])
  flops = k * m * args.seq_len * config.flops_per_token()
  print(json.dumps({"model": args.model, "micro_batch": m, "accumulation": k,
                    "device": jax.devices()[0].device_kind, "seconds": times,
                    "device_step_s": device_step, "after_forward_s": after_forward,
                    "step_flops": flops}))
  for name, seconds in times.items():
    print(f"{name:<14} {seconds:8.4f} s")
  print(f"{k} x grad({m}) {device_step:.3f} s; the backward passes after a forward over "
        f"{k * m}: {after_forward:.3f} s; hidden({k * m}) {times[f'hidden({k * m})']:.3f} s")
  for update in args.host_update:
    step = after_forward + max(times[f"hidden({k * m})"], update)
    print(f"host update {update:.2f} s overlapped with hidden({k * m}): step >= {step:.3f} s, "
          f"<= {flops / step / 1e12:.1f} model TFLOPS")


if __name__ == "__main__":
  main()
