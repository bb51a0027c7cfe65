"""Programs that read the weights without training: the mean loss over a
batch (`make_eval`) and the params in full shapes (`make_full_params`)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jzo.parallel import layer_scan
from jzo.parallel.partition import LeafLayout, is_layout
from jzo.plan import Plan
from jzo.step import programs
from jzo.step.loss import full_params, scaled_loss
from jzo.step.programs import shard_map_without_empty
from jzo.step.specs import on_layouts, params_specs


def make_eval(plan: Plan, mesh: Mesh, loss_fn: Callable, batch) -> Callable:
  """The jitted `(params, batch) -> mean loss` over batches shaped like
  `batch`, with the compute-dtype params as the step uses them (stage 3
  gathers a layer at a time, offloaded weights come up a layer at a time):
  no float32 copy of the model is made anywhere. Each device's rows run
  as grad_accum micro-batches, one after the other, so the forward holds
  no more activations than a training micro-batch's."""
  batch_specs = jax.tree.map(lambda _: P(plan.axis), batch)

  def local(params, batch):
    micro = jax.tree.map(lambda x: x.reshape((plan.grad_accum, -1) + x.shape[1:]), batch)
    losses = jax.lax.map(lambda mb: scaled_loss(plan, loss_fn, params, mb, jnp.float32(1))[1],
                         micro)
    return jax.lax.psum(losses.mean(), plan.axis) / plan.n_devices
  fn = shard_map_without_empty(local, mesh=mesh, in_specs=(params_specs(plan), batch_specs),
                               out_specs=P(), check_vma=False)
  platform = mesh.devices.flat[0].platform
  return jax.jit(fn, compiler_options=programs.compiler_options(plan, platform))


def make_full_params(plan: Plan, mesh: Mesh) -> Callable:
  """The jitted `params -> the same weights in full shapes`, compute dtype,
  replicated on every device (stage 3 gathers the shards; weights in host
  memory come up)."""
  def full(l: LeafLayout, x):
    x = layer_scan.on_device(x)
    if l.per_layer:  # (L, k): each layer's row as gather_layer gathers it
      return jax.vmap(lambda row: l.gather_inner(row, plan.axis))(x)
    return full_params(plan, l, x)

  out_specs = on_layouts(plan, lambda l: P())
  fn = shard_map_without_empty(
      lambda params: jax.tree.map(full, plan.layouts, params, is_leaf=is_layout), mesh=mesh,
      in_specs=(params_specs(plan),), out_specs=out_specs, check_vma=False)
  return jax.jit(fn)
