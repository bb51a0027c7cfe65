"""The loss every step program differentiates: `scaled_loss` (loss_fn on
the params as the model sees them, scaled for the sums over devices and
micro-batches) and `full_params` (what loss_fn sees of a leaf)."""

from __future__ import annotations

import contextlib
from typing import Callable

import jax
import jax.numpy as jnp

from jzo.parallel import layer_scan
from jzo.parallel import partition
from jzo.parallel.partition import LeafLayout, is_layout
from jzo.plan import Plan


def scaled_loss(plan: Plan, loss_fn: Callable, lowp_params, batch, scale, scan=None):
  """Local loss, scaled so that summing gradients over devices and
  micro-batches gives the gradient of the global mean loss (times scale).
  scan: with grads_in_params, what jzo.scan_layers does while loss_fn is
  traced: a context of jzo.parallel.layer_scan (`writing_grads_over_layers(...)`,
  its default, `capturing_layers` or `giving_layers`)."""
  layer_layouts = partition.subtree(plan.layouts, plan.layers) if plan.layers else None
  gathered = [False]

  def gather_one_layer(layer):
    gathered[0] = True
    try:  # an offloaded layer's weights come up for its use
      return jax.tree.map(lambda l, x: l.gather_inner(layer_scan.on_device(x), plan.axis),
                          layer_layouts, layer, is_leaf=is_layout)
    except ValueError as e:
      raise ValueError("gather_layer got a tree unlike one layer of the `layers` subtree: "
                       f"{e}") from e

  params = jax.tree.map(lambda l, x: full_params(plan, l, x), plan.layouts, lowp_params,
                        is_leaf=is_layout)
  scanned: list = []  # non-empty once jzo.scan_layers has written gradients over the layers
  try:
    with contextlib.ExitStack() as context:
      if layer_layouts is not None:
        context.enter_context(partition.layer_gathering(gather_one_layer))
      if plan.grads_in_params:
        scanned = context.enter_context(
            scan if scan is not None else layer_scan.writing_grads_over_layers())
      loss = loss_fn(params, batch)
  except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
    hint = ""
    if layer_layouts is not None and not gathered[0]:
      hint = (" (with stage 3 and layers=, each layer's params reach the scan as flat "
              "shards: the model must call jzo.gather_layer on them)")
    raise ValueError(f"loss_fn failed on the engine's params and batch: "
                     f"{type(e).__name__}: {e}{hint}") from e
  if not hasattr(loss, "dtype") or not jnp.issubdtype(loss.dtype, jnp.floating):
    kind = getattr(loss, "dtype", type(loss).__name__)
    raise TypeError(f"loss_fn must return a floating-point scalar (it is differentiated), "
                    f"got {kind}")
  if jnp.shape(loss) != ():
    raise ValueError(f"loss_fn must return a scalar, got shape {jnp.shape(loss)}")
  given = plan.grads_in_params and scanned.given is not None  # the layers did not run
  if layer_layouts is not None and not gathered[0] and not given:
    raise ValueError("stage 3 with layers= needs the model to call jzo.gather_layer on each "
                     "layer's params inside its scan")
  if plan.grads_in_params and not scanned:
    raise ValueError("grads_in_params needs the model to run its layers with "
                     "jzo.scan_layers (where it would call lax.scan)")
  loss = loss.astype(jnp.float32)
  return loss * scale / (plan.n_devices * plan.grad_accum), loss


def full_params(plan: Plan, layout: LeafLayout, lowp):
  """What loss_fn sees: sharded params are gathered (per-layer ones by the model)."""
  if not plan.sharded_lowp or layout.per_layer:
    return lowp
  return layout.gather_inner(lowp, plan.axis)
