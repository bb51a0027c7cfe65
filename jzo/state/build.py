"""The state a `ZeroEngine` trains, as one bundle, and the functions that
build it.

`ZeroState` holds the plan, the mesh, the optimizer the devices run, the
device state (`EngineState`, donated to every step) and the host state
(`HostAdam`, with offload). Its one step counter is the device state's:
`step` (updates applied, the Adam count the host's kernel uses too) and
`skipped` (steps whose gradients were not finite); `steps_run` is their sum.

`empty_device_state` is the device state's first value, zeros: a plain
function of the plan, so `jax.eval_shape` gives its shapes and dtypes
without allocating (the step can be lowered and compiled on them alone).
`build_state` allocates it, then fills it a leaf at a time (jzo.state.fill).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jzo.parallel import partition
from jzo import step as step_lib
from jzo.host import transfer
from jzo.parallel.distributed import local_positions
from jzo.host.adam import HostAdam
from jzo.parallel.partition import is_layout
from jzo.plan import Plan
from jzo.precision import init_loss_scale
from jzo.step import EngineState
from jzo.host.transfer import copy_to_host, host_pieces
from jzo.state.fill import LowpFromMaster, fill


@dataclasses.dataclass
class ZeroState:
  """Everything an engine trains.

  Attributes:
    plan: the layouts and placement.
    mesh: the devices (of every process) over the plan's axis.
    tx: the optimizer of the device parts, elementwise over flat shards
      (with offload, the user's jzo.cpu_adamw with its mask resolved per leaf).
    device: the state on the devices (global arrays); every step donates it.
    host: the host parts' masters and moments (None without any).
  """
  plan: Plan
  mesh: Mesh
  tx: optax.GradientTransformation
  device: EngineState
  host: HostAdam | None = None

  def __post_init__(self):
    self._install = (step_lib.host_part_installer(self.plan, self.mesh)
                     if self.host is not None else None)
    self._copy_resident = step_lib.resident_copier(self.plan, self.mesh)

  @property
  def steps_run(self) -> int:
    """Steps run: updates applied and steps skipped (reads the devices'
    counters, so it waits for the step that writes them)."""
    # This process's copy of each (replicated) counter: nothing crosses processes.
    step, skipped = jax.device_get([x.addressable_data(0)
                                    for x in (self.device.step, self.device.skipped)])
    return int(step) + int(skipped)

  def install(self, i: int, uploaded: jax.Array, span: tuple[int, int] | None = None
              ) -> jax.Array:
    """Writes leaf i's new host parts (on the devices, flat
    `part_shape(k - c)`, or a span of them: see `ShardTransfer.spans`) into
    the params, in place; returns the new params leaf."""
    leaves, treedef = jax.tree.flatten(self.device.params)
    leaves[i] = self._install(i, leaves[i], uploaded, span)
    self.device = self.device._replace(params=jax.tree.unflatten(treedef, leaves))
    return leaves[i]

  def refresh_resident(self, i: int | None = None) -> None:
    """Copies leaf i's (every leaf's: None) resident layers' weights again
    from the params' rows in host memory into `device.resident`, once the
    host has written them (no-op without resident layers)."""
    if self._copy_resident is not None:
      self.device = self._copy_resident(self.device, i)


def empty_device_state(plan: Plan, mesh: Mesh, tx: optax.GradientTransformation
                       ) -> EngineState:
  """The device state before any weight is drawn: params, masters and
  gradient buffers zero, tx's first state, the plan's first loss scale and
  counters at zero, each placed by `step.state_specs`. Each buffer is its
  own program's output, so all of them are allocated side by side, before
  any draw."""
  specs = step_lib.state_specs(plan, tx)
  sharding = lambda spec, kind=None: NamedSharding(mesh, spec, memory_kind=kind)
  zeros = lambda shape, dtype, spec, kind=None: transfer.zeros(shape, dtype,
                                                                sharding(spec, kind))
  on_layouts = lambda fn, specs: jax.tree.map(fn, plan.layouts, specs, is_leaf=is_layout)
  lowp_shape = lambda l: l.flat_shape if plan.sharded_lowp else l.shape
  lowp_kind = lambda l: "pinned_host" if plan.params_on_host(l) else None
  lowp = on_layouts(lambda l, s: zeros(lowp_shape(l), plan.compute_dtype, s, lowp_kind(l)),
                    specs.params)
  master = opt_state = None
  if plan.has_device_state:
    master = on_layouts(lambda l, s: zeros(l.part_shape(l.on_device), jnp.float32, s),
                        specs.master)
    opt_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs.master,),
                                      out_specs=specs.opt_state))(master)
  grads = None  # offload: the step's outputs until they are downloaded
  if not plan.cpu_adam:
    grads = on_layouts(
        lambda l, s: zeros(step_lib.grad_buffer_shape(plan, l), plan.grad_dtype, s),
        specs.grads)
  scalar = lambda x: transfer.full((), x.dtype, sharding(P()), x.item())
  resident = None
  if plan.resident_layers:
    layers = partition.subtree(plan.layouts, plan.layers)
    resident = jax.tree.map(
        lambda l, s: zeros((plan.resident_layers,) + l.flat_shape[1:], plan.compute_dtype, s),
        layers, specs.resident, is_leaf=is_layout)
  return EngineState(lowp, master, opt_state, grads,
                     jax.tree.map(scalar, init_loss_scale(plan.loss_scale)),
                     scalar(jnp.int32(0)), scalar(jnp.int32(0)), resident=resident)


def build_state(plan: Plan, mesh: Mesh, tx: optax.GradientTransformation,
                draw_leaves: Callable, host: HostAdam | None = None, *,
                pinned: bool = False) -> ZeroState:
  """The first state. Its device buffers are allocated first, side by side
  (`empty_device_state`), then filled a leaf at a time, largest first, from
  the leaves' float32 values drawn on this process's first device (every
  process draws the same values and keeps its devices' parts). Leaves are
  drawn in groups of at most the largest leaf's size, or `plan.draw_floor`
  where that is more, a large stacked leaf a slice of its layers at a time
  where the source can (`Plan.build_groups`). So beside the state there are
  at most that many float32 weights and one device's piece of a leaf's
  copy (`Plan.build_bytes`), and the draws' memory, freed, leaves one free
  block for the step (the allocator could not fit gpt2-10b's step into the
  holes of state allocated between draws).
  Every buffer is new: the state is donated each step and must never alias
  the caller's arrays.

  Args:
    draw_leaves: draw_leaves([(i, layout, span), ...]) is a list of those
      leaves as float32 (of a stacked leaf's layers [lo, hi) where span is
      given, else whole), each flattened by its `layout.flatten`, computed
      on this process's first device.
    host: the host parts' state to fill (its masters), with offload.
    pinned: the host masters are filled through pinned host memory.
  """
  state = empty_device_state(plan, mesh, tx)
  lowp, treedef = jax.tree.flatten(state.params)
  master = jax.tree.leaves(state.master) if state.master is not None else None
  host_masters = jax.tree.leaves(host.master) if host is not None else None
  positions = local_positions(mesh)
  for group in plan.build_groups():
    drawn = draw_leaves([(i, plan.leaves[i], span) for i, span in group])
    for i, span in group:
      layout = plan.leaves[i]
      c, k = layout.on_device, layout.shard_size
      row = 0 if span is None else span[0]
      flat = drawn.pop(0)  # the only float32 copy of the leaf (or of its layers in span)
      if not plan.params_on_host(layout):  # offloaded weights are made from the host's masters
        lowp[i] = fill(lowp[i], flat,
                       LowpFromMaster(plan.compute_dtype, plan.sharded_lowp, layout), row)
      if master is not None and c:
        master[i] = fill(master[i], flat, partition.SplitPart(layout, 0), row)
      if host is not None and c < k:
        if span is None:  # every local device's host part at once: (P, ..., k - c)
          mine = partition.SplitPart(layout, 1, (positions.start, positions.stop))
          copy_to_host(flat, host_masters[i], mine, pinned=pinned)
        else:  # the span's rows of each device's (L, k - c), one device at a time
          for d, position in enumerate(positions):
            mine = partition.SplitPart(layout, 1, (position, position + 1))
            copy_to_host(flat, host_masters[i][d, span[0]:span[1]], mine, pinned=pinned)
      del flat
      if plan.params_on_host(layout):  # every element's master is on the host (offload=True)
        pieces = host_pieces(lowp[i], layout, positions)
        host.lowp_weights(i, pieces if span is None else [p[span[0]:span[1]] for p in pieces],
                          span)
  state = state._replace(params=jax.tree.unflatten(treedef, lowp))
  if master is not None:
    state = state._replace(master=jax.tree.unflatten(treedef, master))
  built = ZeroState(plan, mesh, tx, state, host)
  built.refresh_resident()
  return built
