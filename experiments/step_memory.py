"""What XLA allocates for one engine step, beside the planner's estimate:
compiles the step of a GPT preset (weights drawn leaf by leaf) and prints
the compiled program's memory analysis (arguments, outputs, temporaries).

  python experiments/step_memory.py --model gpt2-10b --offload auto
"""

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jzo
import jzo.partition
from jzo import planner
from models import gpt


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-10b")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--offload", type=planner.parse_offload, default="auto")
  args = parser.parse_args()
  config = dataclasses.replace(gpt.PRESETS[args.model], seq_len=args.seq_len)
  acts = gpt.activation_bytes(config, args.batch, args.seq_len)
  engine = jzo.ZeroEngine(functools.partial(gpt.loss_fn, config),
                          functools.partial(gpt.init_params, config, jax.random.PRNGKey(0)),
                          jzo.cpu_adamw(3e-4, weight_decay=0.1), stage=2,
                          mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
                          offload=args.offload, activation_memory=acts, max_grad_norm=1.0)
  print(engine.plan)
  print("device leaves:", [jax.tree_util.keystr(p) for p, l in jax.tree_util.tree_leaves_with_path(
      engine.plan.layouts, is_leaf=jzo.partition.is_layout) if l.on_device])
  batch = {"tokens": jnp.zeros((args.batch, args.seq_len + 1), jnp.int32)}
  stats = engine.lower(batch).compile().memory_analysis()
  gib = lambda b: f"{b / 2**30:.2f} GiB"
  print("compiled step: arguments", gib(stats.argument_size_in_bytes), "outputs",
        gib(stats.output_size_in_bytes), "aliased", gib(stats.alias_size_in_bytes),
        "temporaries", gib(stats.temp_size_in_bytes))
  in_use = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0)
  print("planned peak", gib(sum(engine.plan.device_peak(acts).values())),
        "in use after building", gib(in_use))


if __name__ == "__main__":
  main()
