"""The device state's layout: `EngineState` (what the devices keep between
steps), `StepMetrics` (what a step reports), the PartitionSpecs of every
part of the state, and the forms its weights and gradient buffers take
(`lowp_from_master`, `grad_buffer_shape`, `kept_params`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jzo.parallel import partition
from jzo.parallel.partition import LeafLayout, is_layout
from jzo.plan import Plan
from jzo.precision import LossScaleState


class EngineState(NamedTuple):
  """Everything the engine keeps on the devices between steps (global arrays)."""
  params: Any  # compute-dtype params for the forward: full (stages 0-2) or flat shards (3)
  master: Any  # float32 masters of each shard's device part, flat (None: all on the host)
  opt_state: Any  # the optimizer state of the device part (None: all on the host)
  grads: Any  # kept gradients: reduced full (0), local full (1), reduced shard (2, 3);
  #             with offload, the shards of leaves with a host part (others
  #             empty) until they are downloaded, then None
  loss_scale: LossScaleState
  step: jax.Array  # int32: optimizer steps applied
  skipped: jax.Array  # int32: steps skipped for non-finite gradients
  acc: Any = None  # host accumulation, inside a step: float32 sums of the device parts
  # plan.resident_layers > 0: the first layers' weights of the stacked leaves
  # (a tree like the `layers` subtree, (r, S*k) each), a copy in device
  # memory of their rows in host memory, remade after each host update
  resident: Any = None


class StepMetrics(NamedTuple):
  """What one step reports (device scalars: reading them waits for the step)."""
  loss: jax.Array  # mean loss over the global batch
  grad_norm: jax.Array  # global L2 norm of the unscaled gradients, before clipping
  loss_scale: jax.Array  # the loss scale this step used
  skipped: jax.Array  # bool: gradients were not finite, nothing was updated


# ------------------------------------------------------------------ specs
def on_layouts(plan: Plan, fn):
  return jax.tree.map(fn, plan.layouts, is_leaf=is_layout)


def lowp_spec(plan: Plan, layout: LeafLayout) -> P:
  return layout.spec(plan.axis) if plan.sharded_lowp else P()


def grad_spec(plan: Plan, layout: LeafLayout) -> P:
  if plan.stage == 1 and not plan.cpu_adam:
    return P(plan.axis)  # (Nd, *shape): each device's own unreduced gradients
  return layout.spec(plan.axis)  # stage 0: replicated full; 2-3 and offload: shards


def opt_state_specs(plan: Plan, tx: optax.GradientTransformation):
  """Specs of tx's state over the device parts: leaves shaped like a device
  part are sharded like it, scalars replicated."""
  local = on_layouts(plan, lambda l: jax.ShapeDtypeStruct(l.device_local_shape, jnp.float32))
  shapes = jax.eval_shape(tx.init, local)
  by_shape = {l.device_local_shape: l.spec(plan.axis) for l in plan.leaves}

  def spec(x):
    if x.ndim == 0:
      return P()
    if tuple(x.shape) not in by_shape:
      raise ValueError(f"tx keeps a state leaf of shape {x.shape} that does not mirror the "
                       "params' shards; the ZeRO engine takes elementwise optimizers")
    return by_shape[tuple(x.shape)]
  return jax.tree.map(spec, shapes)


def params_specs(plan: Plan):
  """PartitionSpecs of the compute-dtype params (`EngineState.params`)."""
  return on_layouts(plan, lambda l: lowp_spec(plan, l))


def state_specs(plan: Plan, tx: optax.GradientTransformation) -> EngineState:
  """PartitionSpecs of every part of the state."""
  device_state = plan.has_device_state
  return EngineState(
      params=params_specs(plan),
      master=on_layouts(plan, lambda l: l.spec(plan.axis)) if device_state else None,
      opt_state=opt_state_specs(plan, tx) if device_state else None,
      grads=on_layouts(plan, lambda l: grad_spec(plan, l)),
      loss_scale=LossScaleState(P(), P()), step=P(), skipped=P(),
      resident=resident_specs(plan))


def resident_specs(plan: Plan):
  """Specs of `EngineState.resident` (None without resident layers)."""
  if not plan.resident_layers:
    return None
  return partition.subtree(on_layouts(plan, lambda l: l.spec(plan.axis)), plan.layers)


def acc_specs(plan: Plan):
  """Specs of the device parts' accumulator (None: no device part)."""
  return on_layouts(plan, lambda l: l.spec(plan.axis)) if plan.has_device_state else None


def grad_buffer_shape(plan: Plan, layout: LeafLayout) -> tuple[int, ...]:
  """Global shape of the gradient buffer the state keeps for one leaf
  without offload (with offload the step's outputs are downloaded, not kept)."""
  if plan.stage == 1:
    return (plan.n_devices,) + layout.shape
  return layout.shape if plan.stage == 0 else layout.flat_shape


def lowp_from_master(flat_master, compute_dtype, sharded: bool, layout: LeafLayout):
  """The compute-dtype params the forward uses, from a flat float32 master
  (numpy or a jax array, and the same kind back; the same rounding as the
  step and the host kernel: to nearest even): flat where the plan keeps
  them sharded (`Plan.sharded_lowp`), else in the leaf's shape. Hashable
  arguments besides the master, so a program of it serves every leaf and
  engine alike."""
  lowp = flat_master.astype(compute_dtype)
  return lowp if sharded else layout.unflatten(lowp)


def kept_params(plan: Plan, params):
  """The params (or their specs) a step hands back: with grads_in_params,
  the stacked layers' leaves are None, their memory holding their gradients
  (the step's `grads`), until the host update writes the weights back."""
  if not plan.grads_in_params:
    return params
  return jax.tree.map(lambda l, p: None if plan.grads_over_weights(l) else p, plan.layouts,
                      params, is_leaf=is_layout)
