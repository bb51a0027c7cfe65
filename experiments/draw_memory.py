"""XLA's memory for drawing the largest leaf of a GPT preset alone (how the
engine builds its state): the output and the temporaries of the compiled draw.

  python experiments/draw_memory.py gpt2-10b
"""
import sys

import functools, jax, jax.numpy as jnp
from jzo.models import gpt
config = gpt.PRESETS[sys.argv[1] if len(sys.argv) > 1 else "gpt2-10b"]
init = functools.partial(gpt.init_params, config, jax.random.PRNGKey(0))
shapes = jax.eval_shape(init)
leaves = jax.tree.leaves(shapes)
i = max(range(len(leaves)), key=lambda i: leaves[i].size)
m = jax.jit(lambda: jax.tree.leaves(init())[i].astype(jnp.float32).reshape(-1)).lower().compile().memory_analysis()
print("draw of leaf", leaves[i].shape, "output GiB", m.output_size_in_bytes / 2**30, "temp GiB", m.temp_size_in_bytes / 2**30, flush=True)
