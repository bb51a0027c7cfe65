"""The training step as pure functions of (plan, state, batch).

One step is one jitted `shard_map` over the data axis:

  forward/backward on the local batch with low-precision params
    -> stage 0: all-reduce the gradients (plain data parallelism)
       stage 1: accumulate full local gradients, then reduce-scatter once
       stage 2: reduce-scatter each micro-batch's gradients
       stage 3: params are gathered inside the loss (per layer with
                `gather_layer`), so autodiff reduce-scatters the gradients
    -> finite check, global-norm clip factor, loss-scale update
    -> the device part of every shard: unscale and clip, the optimizer on its
       float32 masters, the new low-precision weights written into the params
       (stages 0-2 all-gather them; stage 3 keeps shards)
    -> every shard's gradient of each leaf with a host part stays on the
       device as an output (the whole shard: a slice would copy it at the
       step's peak), with the factor the host kernel unscales and clips by;
       jzo.host.transfer copies the host parts down after the step.

With offload, grad_accum = K > 1 and the host part accumulated on the host
(`plan.host_accumulation`), a step is K + 1 calls the engine drives instead:
`make_micro_step` runs one micro-batch (stages 1-2 reduce-scatter its
gradients at once), adds the device part into a float32 accumulator carried
in the state (`acc`; the first micro-batch writes it) and outputs the host
parts' gradients in the compute dtype for the host to sum; `make_finish`
then takes the host's sum of squares and non-finite count per device and
ends the step as above. So a device holds one micro-batch's gradients and
the device part's accumulator, never a float32 sum of the host part.

With grads_in_params, grad_accum > 1 stays one call: the layers run first
(`Plan.layers_first`, `_layers_first`: every micro-batch's forward through
the layers, a layer at a time, then each layer's backward over every
micro-batch, its float32 sum written over its weights), or the layers'
float32 sums are added to in their backward passes (`_sums_in_layers`,
jzo.parallel.layer_scan) and the last micro-batch writes them over the weights.

With grads_in_params and one micro-batch or the layers first the step may
overlap the host update (`Plan.overlaps_update`): it takes the stacked
leaves' landing buffers, where the host is still writing the last update's
weights, and its forward fetches each layer's as the host finishes it
(`wait`, jzo.parallel.layer_scan), so the forward runs beside the host update; its
backward writes those leaves' host parts' gradients back into them.

`host_part_installer` writes a leaf's host part's new weights, once
uploaded, into the params in place. Nothing here keeps Python state but
caches of programs: the engine holds the state and calls these.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jzo.parallel import layer_scan
from jzo.parallel import partition
from jzo.parallel.partition import LeafLayout, is_layout
from jzo.plan import Plan
from jzo.precision import LossScaleState, update_loss_scale


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
def _on_layouts(plan: Plan, fn):
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
  local = _on_layouts(plan, lambda l: jax.ShapeDtypeStruct(l.device_local_shape, jnp.float32))
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
  return _on_layouts(plan, lambda l: lowp_spec(plan, l))


def state_specs(plan: Plan, tx: optax.GradientTransformation) -> EngineState:
  """PartitionSpecs of every part of the state."""
  device_state = plan.has_device_state
  return EngineState(
      params=params_specs(plan),
      master=_on_layouts(plan, lambda l: l.spec(plan.axis)) if device_state else None,
      opt_state=opt_state_specs(plan, tx) if device_state else None,
      grads=_on_layouts(plan, lambda l: grad_spec(plan, l)),
      loss_scale=LossScaleState(P(), P()), step=P(), skipped=P(),
      resident=resident_specs(plan))


def resident_specs(plan: Plan):
  """Specs of `EngineState.resident` (None without resident layers)."""
  if not plan.resident_layers:
    return None
  return partition.subtree(_on_layouts(plan, lambda l: l.spec(plan.axis)), plan.layers)


def acc_specs(plan: Plan):
  """Specs of the device parts' accumulator (None: no device part)."""
  return _on_layouts(plan, lambda l: l.spec(plan.axis)) if plan.has_device_state else None


def grad_buffer_shape(plan: Plan, layout: LeafLayout) -> tuple[int, ...]:
  """Global shape of the gradient buffer the state keeps for one leaf
  without offload (with offload the step's outputs are downloaded, not kept)."""
  if plan.stage == 1:
    return (plan.n_devices,) + layout.shape
  return layout.shape if plan.stage == 0 else layout.flat_shape


# ------------------------------------------------------------ the weights
def lowp_from_master(flat_master, compute_dtype, sharded: bool, layout: LeafLayout):
  """The compute-dtype params the forward uses, from a flat float32 master
  (numpy or a jax array, and the same kind back; the same rounding as the
  step and the host kernel: to nearest even): flat where the plan keeps
  them sharded (`Plan.sharded_lowp`), else in the leaf's shape. Hashable
  arguments besides the master, so a program of it serves every leaf and
  engine alike."""
  lowp = flat_master.astype(compute_dtype)
  return lowp if sharded else layout.unflatten(lowp)


def write_part(stage: int, axis: str, layout: LeafLayout, params, part, start: int,
               row: int = 0):
  """Inside shard_map: params with elements [start, start + n) of every
  shard's last axis replaced by `part` (local, compute dtype: (n,), or per
  layer (r, n) for layers [row, row + r)). A whole shard rebuilds the leaf;
  a part is written in place (the params are donated), so no second copy
  of the leaf is made. Offsets of 2**31 elements or more need 64-bit
  indices: trace it under `jax.enable_x64` (the installer does). `stage`
  and `axis` are the plan's (hashable, where a Plan is not)."""
  n, k = part.shape[-1], layout.shard_size
  if n == 0:
    return params
  if stage == 3:  # Plan.sharded_lowp: the params are this device's shard, (k,) or (L, k)
    if part.shape == params.shape:
      return part
    return jax.lax.dynamic_update_slice(params, part, (row, start)[-params.ndim:])
  if stage > 0:
    part = jax.lax.all_gather(part, axis, tiled=True)  # (S * n,)
  if n == k:
    return layout.unflatten(part)
  S = layout.shards
  if not layout.padded:  # the full leaf is (S, k)
    rows = jax.lax.dynamic_update_slice_in_dim(params.reshape(S, k), part.reshape(S, n), start, 1)
    return rows.reshape(layout.shape)
  # A span of a padded leaf: the last shard's padding is not in the params.
  flat = params.reshape(-1)
  for d in range(S):
    begin = d * k + start
    m = min(n, flat.size - begin)
    if m > 0:
      flat = jax.lax.dynamic_update_slice(flat, part[d * n:d * n + m], (begin,))
  return flat.reshape(layout.shape)


def host_part_installer(plan: Plan, mesh: Mesh) -> Callable:
  """`install(i, params_leaf, uploaded, span=None) -> params_leaf`: writes
  leaf i's host parts (uploaded: flat parts in device memory,
  `part_shape(k - c)`), or a span of them (see `ShardTransfer.spans`),
  into that params leaf, which is donated (so written in place). One leaf
  or span at a time, so only its new weights wait on a device beside the
  params."""
  layouts = plan.leaves

  def install(i: int, params_leaf, uploaded, span: tuple[int, int] | None = None):
    l = layouts[i]
    lo = span[0] if span is not None else 0
    start, row = (l.on_device, lo) if l.per_layer else (l.on_device + lo, 0)
    program = _install_program(mesh, plan.stage, plan.axis, lowp_spec(plan, l), l, start, row)
    # 64-bit offsets: a 32-bit one wraps silently past 2**31 elements (one
    # device's shard of a stacked 14B-model leaf has 6.8e9).
    with jax.enable_x64(True):
      return program(params_leaf, uploaded)
  return install


@functools.lru_cache(maxsize=1024)
def _install_program(mesh: Mesh, stage: int, axis: str, spec: P, layout: LeafLayout,
                     start: int, row: int) -> Callable:
  # Keyed by hashable values, so every engine with these layouts shares it.
  fn = jax.shard_map(lambda p, u: write_part(stage, axis, layout, p, u, start, row),
                     mesh=mesh, in_specs=(spec, layout.spec(axis)), out_specs=spec,
                     check_vma=False)
  # keep_unused: a whole host part never reads the old weights, and an
  # unused argument would be dropped, with it the donation (and the new
  # weights would take a second buffer beside the old).
  return jax.jit(fn, donate_argnums=0, keep_unused=True)


def resident_copier(plan: Plan, mesh: Mesh) -> Callable | None:
  """`copy(state, i=None) -> state`: the device state (an EngineState) with
  leaf i's (every leaf's: None) resident layers' weights copied from the
  params' first rows, in host memory, over the old copy (donated: written
  in place). None without resident layers."""
  r = plan.resident_layers
  if not r:
    return None
  leaf_of = plan.layer_leaves()  # per entry of `resident`
  compiled: dict[int, Callable] = {}

  def copy_rows(rows, out):  # local (L, k) in host memory -> (r, k): a row at a time, as
    # the step fetches them (XLA copies a dynamic slice of host memory asynchronously)
    def one(j, out):
      row = layer_scan.on_device(jax.lax.dynamic_slice_in_dim(rows, j, 1))
      return jax.lax.dynamic_update_slice_in_dim(out, row, j, 0)
    return jax.lax.fori_loop(0, r, one, out)

  def copy(state: EngineState, i: int | None = None) -> EngineState:
    params = jax.tree.leaves(state.params)
    resident, treedef = jax.tree.flatten(state.resident)
    for j, leaf in enumerate(leaf_of):
      if i is not None and leaf != i:
        continue
      if leaf not in compiled:
        spec = plan.leaves[leaf].spec(plan.axis)
        compiled[leaf] = jax.jit(jax.shard_map(copy_rows, mesh=mesh, in_specs=(spec, spec),
                                               out_specs=spec, check_vma=False),
                                 donate_argnums=1)
      resident[j] = compiled[leaf](params[leaf], resident[j])
    return state._replace(resident=jax.tree.unflatten(treedef, resident))
  return copy


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


# ---------------------------------------------------------------- the step
def compiler_options(plan: Plan, platform: str, fetching: bool = False) -> dict | None:
  """XLA options for the plan's step on devices of `platform` ("gpu", "cpu",
  "tpu"). On a GPU with weights in host memory (offload_params, or the
  landing buffers a step overlapping the host update fetches from:
  `fetching`) the step runs without XLA:GPU's command buffers: a command
  buffer chains its commands one after another, so the layers'
  asynchronous fetches from host memory would wait for the matmuls instead
  of running under them (openxla/xla#48900). At gpt2-10b, micro-batch 32,
  on one H100: 6.94 s a step with them, 6.45 s without (docs/performance.md)."""
  if platform == "gpu" and (plan.offload_params or fetching):
    return {"xla_gpu_enable_command_buffer": ""}
  return None


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
    return jax.jit(fn, donate_argnums=0, compiler_options=compiler_options(plan, platform))
  landing_specs = [plan.leaves[i].spec(plan.axis) for i in plan.overlapped_leaves()]
  fn = shard_map_without_empty(
      lambda s, b, landing: local_step(plan, loss_fn, tx, s, b, (landing, wait)), mesh=mesh,
      in_specs=(in_state, batch_specs, landing_specs), out_specs=out_specs + (landing_specs,),
      check_vma=False)
  return jax.jit(fn, donate_argnums=(0, 2),
                 compiler_options=compiler_options(plan, platform, fetching=True))


def _landing_of_layers(plan: Plan, landing: list) -> tuple:
  """The overlapped leaves' landing buffers (`Plan.overlapped_leaves()`
  order) as jzo.scan_layers takes them: one entry per leaf of the layers
  subtree, in its order, None for those without."""
  by_leaf = dict(zip(plan.overlapped_leaves(), landing))
  return tuple(by_leaf.get(i) for i in plan.layer_leaves())


def _overlapped_of_layers(plan: Plan, per_layer_leaf) -> list:
  """The inverse of `_landing_of_layers`: the overlapped leaves' entries,
  in `Plan.overlapped_leaves()` order."""
  by_leaf = dict(zip(plan.layer_leaves(), per_layer_leaf))
  return [by_leaf[i] for i in plan.overlapped_leaves()]


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
  return jax.jit(fn, compiler_options=compiler_options(plan, mesh.devices.flat[0].platform))


def make_full_params(plan: Plan, mesh: Mesh) -> Callable:
  """The jitted `params -> the same weights in full shapes`, compute dtype,
  replicated on every device (stage 3 gathers the shards; weights in host
  memory come up)."""
  def full(l: LeafLayout, x):
    x = layer_scan.on_device(x)
    if l.per_layer:  # (L, k): each layer's row as gather_layer gathers it
      return jax.vmap(lambda row: l.gather_inner(row, plan.axis))(x)
    return full_params(plan, l, x)

  out_specs = _on_layouts(plan, lambda l: P())
  fn = shard_map_without_empty(
      lambda params: jax.tree.map(full, plan.layouts, params, is_leaf=is_layout), mesh=mesh,
      in_specs=(params_specs(plan),), out_specs=out_specs, check_vma=False)
  return jax.jit(fn)


def local_step(plan: Plan, loss_fn: Callable, tx: optax.GradientTransformation,
               state: EngineState, batch, overlap: tuple | None = None):
  """One device's step inside shard_map (see the module docstring);
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
              landing=None if landing is None else _landing_of_layers(plan, landing))),
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
    grads, loss, host_stats, landed = _layers_first(plan, loss_fn, state.params, scale, stats,
                                                    micro, state.resident, landing, wait)
  elif plan.grads_in_params:
    grads, loss, host_stats = _sums_in_layers(plan, loss_fn, state.params, scale, stats, micro,
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
  sq = _sum_of_squares(on_device(shard))
  bad = _non_finite(jax.tree.leaves(device_part) + (on_device(buffer) if plan.cpu_adam else []))
  if host_stats is not None:
    sq, bad = sq + host_stats[0], bad + host_stats[1]
  out = end_step(plan, tx, state, device_part, buffer, sq, bad,
                 jax.lax.psum(loss, axis) / plan.n_devices)
  # Overlapping the update, the landing buffers come back with the host
  # parts' gradients, in the order they came in.
  return out if overlap is None else out + (list(landed),)


def _sums_in_layers(plan: Plan, loss_fn: Callable, params, scale, stats, micro, resident):
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


def _layers_first(plan: Plan, loss_fn: Callable, params, scale, stats, micro, resident,
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
      None if landing is None else _landing_of_layers(plan, landing), wait)
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
    landed = _overlapped_of_layers(plan, landed)
  return jax.tree.unflatten(treedef, grads), losses.mean(), host_stats, landed


def _empty_part(x):
  """A device part of no elements for a gradient x in host memory (no op on x)."""
  return jnp.zeros(x.shape[:-1] + (0,), x.dtype)


def _sum_of_squares(tree):
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)),
             jnp.float32(0))


def _non_finite(leaves):
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


def kept_params(plan: Plan, params):
  """The params (or their specs) a step hands back: with grads_in_params,
  the stacked layers' leaves are None, their memory holding their gradients
  (the step's `grads`), until the host update writes the weights back."""
  if not plan.grads_in_params:
    return params
  return jax.tree.map(lambda l, p: None if plan.grads_over_weights(l) else p, plan.layouts,
                      params, is_leaf=is_layout)


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
  return jax.jit(fn, donate_argnums=0)


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
  return jax.jit(fn, donate_argnums=0)


def local_finish(plan: Plan, tx: optax.GradientTransformation, state: EngineState, host_sq,
                 host_bad, loss):
  """One device's end of a host-accumulated step inside shard_map."""
  acc = state.acc if state.acc is not None else {}
  sq = _sum_of_squares(acc) + host_sq[0]
  bad = _non_finite(jax.tree.leaves(acc)) + host_bad[0]
  return end_step(plan, tx, state._replace(acc=None), state.acc, None, sq, bad, loss)


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

