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
`build_state` allocates it, then fills it a leaf at a time.
"""

from __future__ import annotations

import dataclasses
import functools
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
  where that is more (`Plan.build_groups`). So beside the state there are
  at most that many float32 weights and one device's piece of a leaf's
  copy (`Plan.build_bytes`), and the draws' memory, freed, leaves one free
  block for the step (the allocator could not fit gpt2-10b's step into the
  holes of state allocated between draws).
  Every buffer is new: the state is donated each step and must never alias
  the caller's arrays.

  Args:
    draw_leaves: draw_leaves([(i, layout), ...]) is a list of those leaves
      as float32, each flattened by its `layout.flatten`, computed on this
      process's first device.
    host: the host parts' state to fill (its masters), with offload.
    pinned: the host masters are filled through pinned host memory.
  """
  state = empty_device_state(plan, mesh, tx)
  lowp, treedef = jax.tree.flatten(state.params)
  master = jax.tree.leaves(state.master) if state.master is not None else None
  host_masters = jax.tree.leaves(host.master) if host is not None else None
  positions = local_positions(mesh)
  for group in plan.build_groups():
    drawn = draw_leaves([(i, plan.leaves[i]) for i in group])
    for i in group:
      layout = plan.leaves[i]
      c, k = layout.on_device, layout.shard_size
      flat = drawn.pop(0)  # the only float32 copy of the leaf
      if not plan.params_on_host(layout):  # offloaded weights are made from the host's masters
        lowp[i] = _fill(lowp[i], flat,
                        _LowpFromMaster(plan.compute_dtype, plan.sharded_lowp, layout))
      if master is not None and c:
        master[i] = _fill(master[i], flat, partition.SplitPart(layout, 0))
      if host is not None and c < k:
        mine = partition.SplitPart(layout, 1, (positions.start, positions.stop))
        copy_to_host(flat, host_masters[i], mine, pinned=pinned)
      del flat
      if plan.params_on_host(layout):  # every element's master is on the host (offload=True)
        host.lowp_weights(i, host_pieces(lowp[i], layout, positions))
  state = state._replace(params=jax.tree.unflatten(treedef, lowp))
  if master is not None:
    state = state._replace(master=jax.tree.unflatten(treedef, master))
  built = ZeroState(plan, mesh, tx, state, host)
  built.refresh_resident()
  return built


# The programs below take hashable static arguments (layouts, dtypes,
# partition.SplitPart), never lambdas: one program then serves every leaf
# and engine alike (a new one costs what transfer.full's comment says).
# None is autotuned (transfer.UNTUNED): they run beside a leaf drawn in float32.


@dataclasses.dataclass(frozen=True)
class _LowpFromMaster:
  """flat float32 master -> the params' leaf (`step.lowp_from_master`), as a
  hashable function."""
  compute_dtype: jnp.dtype
  sharded: bool
  layout: partition.LeafLayout

  def __call__(self, flat):
    return step_lib.lowp_from_master(flat, self.compute_dtype, self.sharded, self.layout)


def _fill(buffer: jax.Array, x: jax.Array, fn) -> jax.Array:
  """`buffer` (donated) holding fn(x): x a value every process holds whole on
  its first device, fn a hashable function. On one device a program computes
  fn(x) straight into the buffer; on several, each device's piece is made on
  x's device and moved (`_placed`)."""
  if len(buffer.sharding.device_set) == 1:
    return _write_into(buffer, x, fn)
  return _write_into(buffer, _placed(x, fn, buffer.sharding))


def _placed(x: jax.Array, fn, sharding: NamedSharding) -> jax.Array:
  """fn(x) placed by `sharding` (which may span other processes' devices:
  each process makes only its own devices' pieces), a piece at a time: each
  piece is computed on x's device and moved before the next is made, the
  piece of x's own device last. So that device holds one piece beside x.
  (`jax.device_put` of the whole fn(x) slices every device's piece there at
  once: gpt2-20b's shape at 101 layers over 4 H200s ran out of memory with the
  MLP kernel in float32, in bf16 and two of its four 7.1 GiB pieces on GPU 0.)"""
  shape = jax.eval_shape(fn, x).shape
  home = list(x.devices())[0]
  index_of = sharding.addressable_devices_indices_map(shape)
  pieces = {}
  for device in sorted(index_of, key=lambda d: d == home):
    starts, sizes = zip(*(_bounds(s, n) for s, n in zip(index_of[device], shape)))
    piece = _piece_of(x, fn, sizes, starts)
    to = jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
    pieces[device] = jax.block_until_ready(jax.device_put(piece, to))
    del piece  # freed on x's device before the next piece is made
  return jax.make_array_from_single_device_arrays(shape, sharding,
                                                  [pieces[d] for d in index_of])


def _bounds(index: slice, size: int) -> tuple[int, int]:
  """(start, length) of an index of a dimension of `size`."""
  start, stop, _ = index.indices(size)
  return start, stop - start


@functools.partial(jax.jit, static_argnums=(1, 2), compiler_options=transfer.UNTUNED)
def _piece_of(x: jax.Array, fn, sizes: tuple[int, ...], starts) -> jax.Array:
  """The block of fn(x) at `starts` (traced: one program serves every
  device's piece) of `sizes`, fn a hashable function (computed in the same
  program: only the block is made)."""
  return jax.lax.dynamic_slice(fn(x), starts, sizes)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=2,
                   compiler_options=transfer.UNTUNED)
def _write_into(buffer: jax.Array, values: jax.Array, of=None) -> jax.Array:
  """of(values) (default: values) written into `buffer` (donated: the
  result is buffer's memory; `of`, a hashable function such as a SplitPart,
  is computed in the same program, not apart)."""
  values = values if of is None else of(values)
  return jax.lax.dynamic_update_slice(buffer, values.astype(buffer.dtype), (0,) * buffer.ndim)
