"""The end of every step, once its gradients are summed (`end_step`): the
finite check, the global norm and clip factor, the loss-scale update and
the optimizer update of the device parts, their new low-precision weights
written into the params."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jzo.parallel.partition import is_layout
from jzo.plan import Plan
from jzo.precision import update_loss_scale
from jzo.step.install import write_part
from jzo.step.specs import EngineState, StepMetrics, kept_params


def sum_of_squares(tree):
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)),
             jnp.float32(0))


def non_finite(leaves):
  return sum((jnp.sum(~jnp.isfinite(x)) for x in leaves), jnp.int32(0)).astype(jnp.float32)


def end_step(plan: Plan, tx: optax.GradientTransformation, state: EngineState, device_part,
             buffer, sq, bad, loss):
  """Inside shard_map, once the step's gradients are summed: the finite
  check, the global norm and clip factor, the loss-scale update and the
  device part's update. sq, bad: this device's sum of squares and count of
  non-finite values (stage 0: of the full reduced gradient); device_part:
  its float32-able device parts; buffer: what the state keeps as `grads`;
  loss: the mean loss over the global batch. Returns (state, metrics,
  the host's grad scale)."""
  axis, layouts, scale = plan.axis, plan.layouts, state.loss_scale.scale
  if plan.stage > 0:  # shards: sum over devices (stage 0 holds the full reduced gradient)
    sq, bad = jax.lax.psum((sq, bad), axis)
  finite = (bad == 0) & jnp.isfinite(sq)
  grad_norm = jnp.sqrt(sq) / scale
  factor = 1.0 / scale
  if plan.max_grad_norm is not None:
    factor = factor * jnp.minimum(1.0, plan.max_grad_norm / (grad_norm + 1e-6))
  metrics = StepMetrics(loss=loss, grad_norm=grad_norm, loss_scale=scale, skipped=~finite)
  counters = dict(loss_scale=update_loss_scale(state.loss_scale, finite, plan.loss_scale),
                  step=state.step + finite.astype(jnp.int32),
                  skipped=state.skipped + (~finite).astype(jnp.int32))
  if not plan.has_device_state:
    return (EngineState(kept_params(plan, state.params), None, None, buffer, **counters,
                        resident=state.resident), metrics, factor)

  # A select rather than lax.cond: XLA then fuses unscaling, the update, the
  # skip and the low-precision copy into one pass over each leaf (a cond
  # would materialise the float32 gradients and re-read the new masters).
  g32 = jax.tree.map(lambda x: x.astype(jnp.float32) * factor, device_part)
  updates, new_opt_state = tx.update(g32, state.opt_state, state.master)
  keep_if_skipped = lambda new, old: jnp.where(finite, new, old)
  master = jax.tree.map(keep_if_skipped, optax.apply_updates(state.master, updates),
                        state.master)
  opt_state = jax.tree.map(keep_if_skipped, new_opt_state, state.opt_state)
  # The new weights of the device parts; where the layers' gradients took
  # their weights' memory (grads_in_params), they go there, over the device
  # part's gradient, and the host's come up into the rest after the step.
  lowp = jax.tree.map(lambda m: m.astype(plan.compute_dtype), master)
  in_params = plan.grads_over_weights
  write = functools.partial(write_part, plan.stage, plan.axis, start=0)
  params = kept_params(plan, jax.tree.map(write, layouts, state.params, lowp, is_leaf=is_layout))
  if buffer is not None:
    buffer = jax.tree.map(lambda l, b, w: write(l, b, w) if in_params(l) else b,
                          layouts, buffer, lowp, is_leaf=is_layout)
  return (EngineState(params, master, opt_state, buffer, **counters, resident=state.resident),
          metrics, factor)
