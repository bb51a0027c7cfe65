"""Programs that write weights into the device state in place: `write_part`
(a part of every shard written into the params, inside shard_map), the
installer of a leaf's host parts' new weights once uploaded
(`host_part_installer`) and the copier of the resident layers' weights
(`resident_copier`)."""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jzo.parallel import layer_scan
from jzo.parallel.partition import LeafLayout
from jzo.plan import Plan
from jzo.step.specs import EngineState, lowp_spec


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
