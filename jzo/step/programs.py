"""What every step program is built with: `shard_map_without_empty` (the
mapping over the mesh) and `compiler_options` (the XLA options of a plan's
programs on a platform)."""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jzo.plan import Plan


def shard_map_without_empty(f: Callable, *, mesh: Mesh, in_specs, out_specs, **kw) -> Callable:
  """`jax.shard_map(f, ...)` that keeps empty arrays (a dimension of size 0,
  as the device part of a leaf kept wholly on the host) out of the map:
  jax 0.11.2's SPMD partitioner crashed compiling a step that mapped them
  beside a split leaf (8 devices, stage 1-2, offload 0.5). Inside, f sees
  them as zeros of their local shapes; they come out as zeros."""
  is_spec = lambda x: isinstance(x, P)
  empty = lambda x: math.prod(x.shape) == 0

  def call(*args):
    leaves, treedef = jax.tree.flatten(args)
    specs = jax.tree.leaves(jax.tree.broadcast(in_specs, args, is_leaf=is_spec), is_leaf=is_spec)
    local = [NamedSharding(mesh, s).shard_shape(x.shape) if empty(x) else None
             for x, s in zip(leaves, specs)]
    outs = jax.eval_shape(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                        **kw), *args)
    out_leaves, out_treedef = jax.tree.flatten(outs)
    out_spec_leaves = jax.tree.leaves(jax.tree.broadcast(out_specs, outs, is_leaf=is_spec),
                                      is_leaf=is_spec)
    kept_out = [not empty(o) for o in out_leaves]

    def inner(kept):
      kept = iter(kept)
      full = [jnp.zeros(shape, x.dtype) if shape is not None else next(kept)
              for x, shape in zip(leaves, local)]
      results = jax.tree.leaves(f(*jax.tree.unflatten(treedef, full)))
      return [r for r, keep in zip(results, kept_out) if keep]

    mapped = jax.shard_map(
        inner, mesh=mesh, in_specs=([s for s, shape in zip(specs, local) if shape is None],),
        out_specs=[s for s, keep in zip(out_spec_leaves, kept_out) if keep], **kw)
    results = iter(mapped([x for x, shape in zip(leaves, local) if shape is None]))
    return jax.tree.unflatten(out_treedef, [next(results) if keep else jnp.zeros(o.shape, o.dtype)
                                            for o, keep in zip(out_leaves, kept_out)])
  return call


def compiler_options(plan: Plan, platform: str, fetching: bool = False) -> dict | None:
  """XLA options for the plan's step on devices of `platform` ("gpu", "cpu",
  "tpu"). On a GPU with weights in host memory (offload_params, or the
  landing buffers a step overlapping the host update fetches from:
  `fetching`) the step runs without XLA:GPU's command buffers: a command
  buffer chains its commands one after another, so the layers'
  asynchronous fetches from host memory would wait for the matmuls instead
  of running under them (openxla/xla#48900). At gpt2-10b, micro-batch 32,
  on one H100: 6.94 s a step with them, 6.45 s without (docs/performance.md).
  A deterministic plan's GPU programs are compiled with
  xla_gpu_deterministic_ops: no atomics in scatters and reductions, cuDNN's
  deterministic attention backward, and no autotuning, whose choice of
  kernel follows that compilation's timings.

  The step room's jitted programs read it from this module
  (`programs.compiler_options`) when they are made: it is the one place
  their options are chosen, and replacing it here changes what each new
  program is compiled with."""
  options = {}
  if platform == "gpu" and (plan.offload_params or fetching):
    options["xla_gpu_enable_command_buffer"] = ""
  if platform == "gpu" and plan.deterministic:
    options["xla_gpu_deterministic_ops"] = True
  return options or None
