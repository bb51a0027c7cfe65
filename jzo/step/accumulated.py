"""A step of K + 1 calls under host accumulation (offload, grad_accum = K > 1,
`plan.host_accumulation`): `make_micro_step` runs one micro-batch, adds
the device part into the state's float32 accumulator (`acc`) and outputs
the host parts' gradients in the compute dtype for the host to sum;
`make_finish` then takes the host's sums of squares and non-finite counts
and ends the step (`end_step`)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from jzo.parallel.partition import is_layout
from jzo.plan import Plan
from jzo.step.loss import scaled_loss
from jzo.step import programs
from jzo.step.programs import shard_map_without_empty
from jzo.step.specs import EngineState, StepMetrics, acc_specs, state_specs
from jzo.step.update import end_step, non_finite, sum_of_squares


def make_micro_step(plan: Plan, mesh: Mesh, loss_fn: Callable, tx: optax.GradientTransformation,
                    micro_batch, first: bool) -> Callable:
  """The jitted call of one micro-batch under host accumulation,
  `(state, micro_batch) -> (state, loss)`: the state (donated) comes out
  with `acc`, the device parts' float32 sums so far (the first micro-batch
  writes them: `acc` goes in as None), and `grads`, this micro-batch's
  gradient shards of the leaves with a host part in the compute dtype
  (others empty); loss is its mean over the devices."""
  specs = state_specs(plan, tx)
  acc = acc_specs(plan)
  batch_specs = jax.tree.map(lambda _: P(plan.axis), micro_batch)
  fn = shard_map_without_empty(lambda s, b: local_micro_step(plan, loss_fn, s, b, first),
                               mesh=mesh,
                               in_specs=(specs._replace(grads=None, acc=None if first else acc),
                                         batch_specs),
                               out_specs=(specs._replace(acc=acc), P()), check_vma=False)
  return jax.jit(fn, donate_argnums=0, compiler_options=programs.compiler_options(
      plan, mesh.devices.flat[0].platform))


def local_micro_step(plan: Plan, loss_fn: Callable, state: EngineState, batch, first: bool):
  """One device's micro-batch inside shard_map (see make_micro_step)."""
  grad_fn = jax.value_and_grad(
      lambda p, b: scaled_loss(plan, loss_fn, p, b, state.loss_scale.scale), has_aux=True)
  (_, loss), g = grad_fn(state.params, batch)
  flatten = lambda f, tree: jax.tree.map(f, plan.layouts, tree, is_leaf=is_layout)
  if plan.stage in (1, 2):  # each micro-batch's shard: stage 1 has no full fp32 sum to keep
    g = flatten(lambda l, x: jax.lax.psum_scatter(l.flatten(x), plan.axis, tiled=True), g)
  acc = None
  if plan.has_device_state:
    part = flatten(lambda l, x: x[..., :l.on_device].astype(jnp.float32), g)
    acc = part if first else jax.tree.map(jnp.add, state.acc, part)
  host = flatten(lambda l, x: (x if l.on_host else x[..., :0]).astype(plan.grad_dtype), g)
  return state._replace(grads=host, acc=acc), jax.lax.psum(loss, plan.axis) / plan.n_devices


def make_finish(plan: Plan, mesh: Mesh, tx: optax.GradientTransformation) -> Callable:
  """The jitted end of a host-accumulated step, `(state, host_sq, host_bad,
  loss) -> (state, metrics, grad_scale)`: host_sq and host_bad (float32,
  (n_devices,), sharded over the data axis) are the sum of squares and the
  count of non-finite values of each device's host parts, as the host
  summed them; loss is the mean over the micro-batches. The state (donated)
  comes out without `acc`, its device part updated as `make_step`'s."""
  specs = state_specs(plan, tx)
  fn = shard_map_without_empty(
      lambda s, sq, bad, loss: local_finish(plan, tx, s, sq, bad, loss), mesh=mesh,
      in_specs=(specs._replace(grads=None, acc=acc_specs(plan)), P(plan.axis), P(plan.axis), P()),
      out_specs=(specs._replace(grads=None), StepMetrics(P(), P(), P(), P()), P()),
      check_vma=False)
  return jax.jit(fn, donate_argnums=0, compiler_options=programs.compiler_options(
      plan, mesh.devices.flat[0].platform))


def local_finish(plan: Plan, tx: optax.GradientTransformation, state: EngineState, host_sq,
                 host_bad, loss):
  """One device's end of a host-accumulated step inside shard_map."""
  acc = state.acc if state.acc is not None else {}
  sq = sum_of_squares(acc) + host_sq[0]
  bad = non_finite(jax.tree.leaves(acc)) + host_bad[0]
  return end_step(plan, tx, state._replace(acc=None), state.acc, None, sq, bad, loss)
