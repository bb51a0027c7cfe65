"""The gradients of a step with grads_in_params and grad_accum = K > 1, in
one call: the layers run first (`layers_first`: every micro-batch's
forward through the layers, a layer at a time, then each layer's backward
over every micro-batch, its float32 sum written over its weights), or the
layers' float32 sums are added to in their backward passes
(`sums_in_layers`, jzo.parallel.layer_scan) and the last micro-batch writes
them over the weights. Also the order of the overlapped leaves' landing
buffers as the layers take them (`landing_of_layers`)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jzo.parallel import layer_scan
from jzo.parallel import partition
from jzo.parallel.partition import is_layout
from jzo.plan import Plan
from jzo.step.loss import scaled_loss


def landing_of_layers(plan: Plan, landing: list) -> tuple:
  """The overlapped leaves' landing buffers (`Plan.overlapped_leaves()`
  order) as jzo.scan_layers takes them: one entry per leaf of the layers
  subtree, in its order, None for those without."""
  by_leaf = dict(zip(plan.overlapped_leaves(), landing))
  return tuple(by_leaf.get(i) for i in plan.layer_leaves())


def overlapped_of_layers(plan: Plan, per_layer_leaf) -> list:
  """The inverse of `landing_of_layers`: the overlapped leaves' entries,
  in `Plan.overlapped_leaves()` order."""
  by_leaf = dict(zip(plan.layer_leaves(), per_layer_leaf))
  return [by_leaf[i] for i in plan.overlapped_leaves()]


def sums_in_layers(plan: Plan, loss_fn: Callable, params, scale, stats, micro, resident):
  """grads_in_params with grad_accum = K > 1, inside shard_map: (the
  step's gradients, the mean loss, the host-memory layers' gradient stats
  or None). micro: the local batch as (K, m, ...); resident: the state's
  resident layers. Micro-batches 1 to K - 1 add every leaf's gradient
  into float32 sums (the layers' in their backward pass,
  jzo.scan_layers); micro-batch K writes the layers' sums
  with its own gradients over their weights, and the other leaves' come
  out as float32 sums."""
  layouts = plan.layouts
  of_layers = lambda tree: partition.subtree(tree, plan.layers)
  combine = lambda f, *trees: jax.tree.map(f, layouts, *trees, is_leaf=is_layout)

  def add(sums, mb):
    grad_fn = jax.value_and_grad(
        lambda p, s, b: scaled_loss(plan, loss_fn, p, b, scale,
                                    layer_scan.writing_grads_over_layers(
                                        sums=of_layers(s), adding=True, resident=resident)),
        argnums=(0, 1), has_aux=True)
    (_, loss), (g, new_sums) = grad_fn(params, sums, mb)
    # The layers' new sums are the gradient of theirs; their gradient
    # proper is zeros (nothing reads it).
    return combine(lambda l, s, new, x: new if plan.grads_over_weights(l)
                   else s + x.astype(jnp.float32), sums, new_sums, g), loss

  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
  sums, losses = jax.lax.scan(add, zeros, jax.tree.map(lambda x: x[:-1], micro))
  # The last micro-batch's forward does not read the sums: without the
  # barrier XLA may run it first and keep its layers' inputs through the scan.
  sums, last = jax.lax.optimization_barrier((sums, jax.tree.map(lambda x: x[-1], micro)))
  grad_fn = jax.value_and_grad(
      lambda p, st, b: scaled_loss(plan, loss_fn, p, b, scale,
                                   layer_scan.writing_grads_over_layers(
                                       st, sums=of_layers(sums), resident=resident)),
      argnums=(0, 1), has_aux=True)
  (_, loss), (g, host_stats) = grad_fn(params, stats, last)
  grads = combine(lambda l, s, x: x if plan.grads_over_weights(l) else s + x.astype(jnp.float32),
                  sums, g)
  return grads, jnp.concatenate([losses, loss[None]]).mean(), host_stats


def layers_first(plan: Plan, loss_fn: Callable, params, scale, stats, micro, resident,
                  landing, wait):
  """grads_in_params with grad_accum = K > 1 and `Plan.layers_first`,
  inside shard_map: (the step's gradients, the mean loss, the host-memory
  layers' gradient stats or None, the landing buffers with the host parts'
  gradients or None). micro: the local batch as (K, m, ...); landing (the
  overlapped leaves' local landing buffers) and wait: the overlapped host
  update's, or None.

  The layers' forward runs over all K micro-batches, a layer at a time
  (with landing, beside the host update: jzo.parallel.layer_scan.forward_chunks); then
  each micro-batch's loss and its gradient; then the layers' backward a
  layer at a time over every micro-batch, its float32 sum written over its
  weights (backward_chunks); then the gradients of what comes before the
  layers. The other leaves' gradients are summed in float32, those through
  the loss first: as the device sums would, to float32 rounding."""
  leaves, treedef = jax.tree.flatten(params)
  in_layers = set(plan.layer_leaves())
  others = [i for i in range(len(leaves)) if i not in in_layers]

  def with_others(rest):  # the params, the layers' leaves not differentiated
    full = list(leaves)
    for i, x in zip(others, rest):
      full[i] = x
    return jax.tree.unflatten(treedef, full)

  captured: dict = {}
  layers = partition.subtree(params, plan.layers)

  def before(rest, mb):  # (the layers' input, the values their function closes over)
    scaled_loss(plan, loss_fn, with_others(rest), mb, scale,
                layer_scan.capturing_layers(captured, layers))
    return captured["carry"], captured["consts"]

  rest = [leaves[i] for i in others]
  carries, consts = jax.lax.map(lambda mb: before(rest, mb), micro)
  fn = captured["fn"]
  outs, saved = layer_scan.forward_chunks(
      fn, consts, carries, layers, stats, resident,
      None if landing is None else landing_of_layers(plan, landing), wait)
  wide = lambda tree: [x.astype(jnp.float32) for x in tree]

  def after(sums, a):  # one micro-batch's loss from the layers' output
    out, mb = a
    (_, loss), vjp = jax.vjp(
        lambda rest, out: scaled_loss(plan, loss_fn, with_others(rest), mb, scale,
                                      layer_scan.giving_layers(out)), rest, out)
    d_rest, d_out = vjp((jnp.float32(1), jnp.float32(0)))
    return [s + g for s, g in zip(sums, wide(d_rest))], (d_out, loss)

  sums = [jnp.zeros(x.shape, jnp.float32) for x in rest]
  sums, (d_outs, losses) = jax.lax.scan(after, sums, (outs, micro))
  d_consts, d_carries, layers, host_stats, landed = layer_scan.backward_chunks(fn, saved, d_outs)
  floats = [d is not None for d in d_consts]

  def through_layers(sums, a):  # the gradients of what comes before the layers
    mb, d_carry, d_floats = a

    def inexact(rest):  # (before records again; fn is already taken)
      carry, consts = before(rest, mb)
      return (carry, [c for c, f in zip(consts, floats) if f])
    _, vjp = jax.vjp(inexact, rest)
    (d_rest,) = vjp((d_carry, list(d_floats)))
    return [s + g for s, g in zip(sums, wide(d_rest))], None

  sums, _ = jax.lax.scan(through_layers, sums,
                         (micro, d_carries, [d for d in d_consts if d is not None]))
  grads = list(leaves)
  for i, x in zip(others, sums):
    grads[i] = x
  for i, x in zip(plan.layer_leaves(), jax.tree.leaves(layers)):
    grads[i] = x
  if landed is not None:  # by overlapped leaf, as they came in
    landed = overlapped_of_layers(plan, landed)
  return jax.tree.unflatten(treedef, grads), losses.mean(), host_stats, landed
