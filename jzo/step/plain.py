"""The training step as one jitted call (`make_step`; `local_step`, one
device's part inside shard_map): forward and backward over the local
batch's micro-batches, the gradients reduced as the stage has them, then
`end_step`. With `Plan.overlaps_update` it takes the overlapped leaves'
landing buffers and runs its forward beside the host update."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from jzo.parallel import layer_scan
from jzo.parallel.partition import is_layout
from jzo.plan import Plan
from jzo.step import programs
from jzo.step.layers_first import landing_of_layers, layers_first, sums_in_layers
from jzo.step.loss import scaled_loss
from jzo.step.programs import shard_map_without_empty
from jzo.step.specs import EngineState, StepMetrics, kept_params, state_specs
from jzo.step.update import end_step, non_finite, sum_of_squares


def make_step(plan: Plan, mesh: Mesh, loss_fn: Callable, tx: optax.GradientTransformation,
              batch, wait: Callable | None = None) -> Callable:
  """The jitted step `(state, batch) -> (state, metrics, grad_scale)` for
  batches shaped like `batch`. The state is donated. With offload the
  state's `grads` go in as None and come out as the shards of the leaves
  with a host part, with `grad_scale` the factor (1 / loss scale, times the
  clip) the host applies.

  wait: overlap the host update (`Plan.overlaps_update`): the step is then
  `(state, batch, landing) -> (state, metrics, grad_scale, landing)`,
  landing the landing buffers of the `Plan.overlapped_leaves()` in that
  order (donated), and `wait(i)` (on the host: returns i, as int32, once
  the host has written layer i's weights into them) runs before the
  forward reads layer i; the landing buffers come back holding those
  leaves' host parts' gradients (written in place as each layer's backward
  ends: nothing of them is left to download)."""
  specs = state_specs(plan, tx)
  batch_specs = jax.tree.map(lambda _: P(plan.axis), batch)
  in_state = specs._replace(grads=None) if plan.cpu_adam else specs
  # check_vma=False: the replicated outputs (all-gathered params, psum'd
  # metrics) are equal on every device by construction; the spelling of the
  # invariant all-gather that would prove it differs across JAX versions.
  out_state = specs._replace(params=kept_params(plan, specs.params))
  out_specs = (out_state, StepMetrics(P(), P(), P(), P()), P())
  platform = mesh.devices.flat[0].platform
  if wait is None:
    fn = shard_map_without_empty(lambda s, b: local_step(plan, loss_fn, tx, s, b), mesh=mesh,
                                 in_specs=(in_state, batch_specs), out_specs=out_specs,
                                 check_vma=False)
    return jax.jit(fn, donate_argnums=0, compiler_options=programs.compiler_options(plan, platform))
  landing_specs = [plan.leaves[i].spec(plan.axis) for i in plan.overlapped_leaves()]
  fn = shard_map_without_empty(
      lambda s, b, landing: local_step(plan, loss_fn, tx, s, b, (landing, wait)), mesh=mesh,
      in_specs=(in_state, batch_specs, landing_specs), out_specs=out_specs + (landing_specs,),
      check_vma=False)
  return jax.jit(fn, donate_argnums=(0, 2),
                 compiler_options=programs.compiler_options(plan, platform, fetching=True))


def local_step(plan: Plan, loss_fn: Callable, tx: optax.GradientTransformation,
               state: EngineState, batch, overlap: tuple | None = None):
  """One device's step inside shard_map (see the jzo.step docstring);
  overlap: (the overlapped leaves' local landing buffers, wait), see
  `make_step`."""
  axis, stage, layouts = plan.axis, plan.stage, plan.layouts
  scale = state.loss_scale.scale
  # offload_params: the layers' gradients are in host memory, where the
  # step cannot read them; jzo.scan_layers counts them into this one's gradient.
  stats = jnp.zeros(2, jnp.float32) if plan.offload_params else None
  landing, wait = overlap if overlap is not None else (None, None)
  grad_fn = jax.value_and_grad(
      lambda p, s, landing, b: scaled_loss(
          plan, loss_fn, p, b, scale, layer_scan.writing_grads_over_layers(
              s, resident=state.resident, wait=wait,
              landing=None if landing is None else landing_of_layers(plan, landing))),
      argnums=(0, 1, 2), has_aux=True)
  flatten = lambda f, tree: jax.tree.map(f, layouts, tree, is_leaf=is_layout)

  def micro_grads(mb):
    (_, loss), (g, host_stats, landed) = grad_fn(state.params, stats, landing, mb)
    if stage == 2:  # reduce-scatter now, keep only this device's shard
      g = flatten(lambda l, x: jax.lax.psum_scatter(l.flatten(x), axis, tiled=True), g)
    return g, loss, host_stats, landed

  micro = jax.tree.map(lambda x: x.reshape((plan.grad_accum, -1) + x.shape[1:]), batch)
  host_stats = landed = None
  if plan.grad_accum == 1:
    grads, loss, host_stats, landed = micro_grads(batch)
  elif plan.layers_first:
    grads, loss, host_stats, landed = layers_first(plan, loss_fn, state.params, scale, stats,
                                                    micro, state.resident, landing, wait)
  elif plan.grads_in_params:
    grads, loss, host_stats = sums_in_layers(plan, loss_fn, state.params, scale, stats, micro,
                                              state.resident)
  else:
    def body(acc, mb):
      g, loss = micro_grads(mb)[:2]
      return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g), loss
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), jax.eval_shape(
        lambda: micro_grads(jax.tree.map(lambda x: x[0], micro))[0]))
    grads, losses = jax.lax.scan(body, zeros, micro)
    loss = losses.mean()

  # The gradient this device's optimizer shard needs, flat like the master.
  if stage == 0:
    grads = jax.tree.map(lambda x: jax.lax.psum(x, axis), grads)
    shard = flatten(lambda l, x: l.flatten(x), grads)
    buffer = grads
  elif stage == 1:
    shard = flatten(lambda l, x: jax.lax.psum_scatter(l.flatten(x), axis, tiled=True), grads)
    buffer = jax.tree.map(lambda x: x[None], grads)
  else:
    shard = buffer = grads
  device_part = flatten(lambda l, x: _empty_part(x) if plan.params_on_host(l)
                        else x[..., :l.on_device], shard)
  # Offload ships each shard's host part in the compute dtype: accumulated
  # fp32 sums are rounded once (the precision one large batch's gradient
  # has), at half the bytes on the copy that follows the step. Gradients
  # written over the weights stay whole: their array is the weights' too.
  if plan.cpu_adam:
    buffer = flatten(lambda l, x: (x if l.on_host or plan.grads_over_weights(l)
                                   else x[..., :0]).astype(plan.grad_dtype), shard)
  else:
    buffer = jax.tree.map(lambda x: x.astype(plan.grad_dtype), buffer)

  # Offload checks what it ships (an fp16 rounding of an fp32 sum may overflow).
  on_device = lambda tree: [x for l, x in zip(plan.leaves, jax.tree.leaves(tree))
                            if not plan.params_on_host(l)]
  sq = sum_of_squares(on_device(shard))
  bad = non_finite(jax.tree.leaves(device_part) + (on_device(buffer) if plan.cpu_adam else []))
  if host_stats is not None:
    sq, bad = sq + host_stats[0], bad + host_stats[1]
  out = end_step(plan, tx, state, device_part, buffer, sq, bad,
                 jax.lax.psum(loss, axis) / plan.n_devices)
  # Overlapping the update, the landing buffers come back with the host
  # parts' gradients, in the order they came in.
  return out if overlap is None else out + (list(landed),)


def _empty_part(x):
  """A device part of no elements for a gradient x in host memory (no op on x)."""
  return jnp.zeros(x.shape[:-1] + (0,), x.dtype)
