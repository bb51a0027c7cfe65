"""What saved tree an engine loads: the shapes and dtypes orbax reads
(`expected`'s target), the outline of a checkpoint that fits, and which
entries are read span by span (`streamed_entries`). Before any array is
read, jzo.checkpoint's restore compares a checkpoint with them."""

from __future__ import annotations

import math
import re

import jax
import numpy as np

from jzo.checkpoint import engine_parts
from jzo.checkpoint.engine_parts import (adam_on_devices, codes_entry, int8_moments,
                                         saved_moment_dtype, scales_entry, shard_sharding)
from jzo.checkpoint.outline import outline
from jzo.kernels import quant8
from jzo.parallel.partition import LeafLayout, is_layout
from jzo.state.build import ZeroState


def expected(trained: ZeroState, saved, prefer_full: bool = False) -> tuple[dict, dict]:
  """(target, accepted): the shapes and dtypes (jax.ShapeDtypeStructs) of
  the saved tree this engine loads, fetching nothing, and the outline (see
  `outline`) of a checkpoint that loads into it.

  The target is the format the engine saves, or for an Adam engine without
  offload the flat one of its older checkpoints if `saved` (a state dict or
  its outline) has "opt_state". Masters and moments come in full shapes, or
  flat as several processes wrote them where `saved` has them so; each
  process reads only its own shards (`streamed_entries`). A flat leaf
  padded for another device count is read into this engine's flat shape
  (orbax pads or cuts its padding): in `accepted` it keeps the saved shape.
  prefer_full: a leaf saved in its full shape that could also be flat and
  padded (a stacked 1-d leaf, saved by one device) is read as full: one
  process's state dicts are (several processes' checkpoints are flat, and
  are read as such).
  """
  plan, mesh, state, host = trained.plan, trained.mesh, trained.device, trained.host
  scalars = {"loss_scale": np.float32, "good_steps": np.int32, "step": np.int32,
             "skipped": np.int32, "steps_run": np.int64}
  tree = {k: jax.ShapeDtypeStruct((), v) for k, v in scalars.items()}
  device_adam = adam_on_devices(plan, state)
  several = engine_parts.several_processes()
  saved_outline = outline(saved)
  if not plan.cpu_adam and (device_adam is None or "opt_state" in saved):
    flat = {"master": state.master, "opt_state": state.opt_state}
    target = {**tree, **jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=x.sharding if several else None), flat)}
    return target, outline(target)

  def entry(name, like):
    """(target, accepted outline) of one of master, mu and nu."""
    saved_leaves = jax.tree.leaves(saved_outline.get(name),
                                   is_leaf=lambda x: isinstance(x, str))
    # Flat leaves are Adam's only when saved in its format (with its count);
    # another optimizer's flat masters are refused, naming the shapes.
    if "count" not in saved_outline or len(saved_leaves) != len(plan.leaves):
      saved_leaves = [None] * len(plan.leaves)

    def one(layout, x, saved_leaf):
      # Sharded as the engine's leaf, also in one process: orbax would take
      # the sharding it was saved with, over devices that may not be here.
      flat = jax.ShapeDtypeStruct(layout.flat_shape, x.dtype,
                                  sharding=shard_sharding(plan, mesh, layout))
      written_flat = saved_leaf == outline(flat)
      if written_flat and (several or layout.flat_shape != layout.shape):
        return flat, saved_leaf
      full = jax.ShapeDtypeStruct(layout.shape, x.dtype)
      whole = prefer_full and saved_leaf == outline(full)
      if not whole and _padded_otherwise(saved_leaf, layout, x.dtype):
        return flat, saved_leaf
      return full, outline(full)
    pairs = [one(l, x, s) for l, x, s in zip(plan.leaves, jax.tree.leaves(like), saved_leaves)]
    structure = jax.tree.structure(plan.layouts, is_leaf=is_layout)
    return (jax.tree.unflatten(structure, [t for t, _ in pairs]),
            jax.tree.unflatten(structure, [a for _, a in pairs]))
  # Arrays of the masters' and moments' dtypes, one a leaf (a host part may be empty).
  if plan.cpu_adam:
    masters = host.master
    moments = {name: jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        quant8.shape_of(x), saved_moment_dtype(host, name)), getattr(host, name),
        is_leaf=quant8.is_moment) for name in ("mu", "nu")}
  else:
    masters, moments = state.master, {"mu": device_adam.mu, "nu": device_adam.nu}
  entries = {"master": entry("master", masters)}
  for name, like in moments.items():
    if _reads_codes(trained, name, saved_outline):  # as masters are: full, or flat and padded
      codes = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape, np.uint8), plan.layouts,
                           is_leaf=is_layout)
      entries[codes_entry(name)] = entry(codes_entry(name), codes)
      entries[scales_entry(name)] = _scales_entry(trained, name, saved_outline)
    else:
      entries[name] = entry(name, like)
  target = {**tree, **{k: t for k, (t, _) in entries.items()},
            "count": jax.ShapeDtypeStruct((), np.int64)}
  accepted = {**outline(target), **{k: a for k, (_, a) in entries.items()}}
  return target, accepted


def _reads_codes(trained: ZeroState, name: str, saved_outline) -> bool:
  """Whether moment `name` is read as int8 codes and scales: the
  checkpoint has them so, or this int8 engine's own format where the
  checkpoint has the moment neither way (or there is none)."""
  if codes_entry(name) in saved_outline:
    return True
  return int8_moments(trained) and name not in saved_outline


def _scales_entry(trained: ZeroState, name: str, saved_outline) -> tuple:
  """(target, accepted outline) of an int8 moment's scales, read whole by
  every process: as saved (any shard count: saved_leaf.Int8Blocks checks
  them against the codes), else as this engine keeps them."""
  plan = trained.plan
  structure = jax.tree.structure(plan.layouts, is_leaf=is_layout)
  saved = jax.tree.leaves(saved_outline.get(scales_entry(name)),
                          is_leaf=lambda x: isinstance(x, str))
  if len(saved) != len(plan.leaves):
    saved = [None] * len(plan.leaves)

  def scales_of(layout, saved_leaf):
    found = re.fullmatch(r"float32\[([\d, ]*)\]", saved_leaf or "")
    if found:
      shape = tuple(int(n) for n in found[1].split(",") if n.strip())
    else:  # this engine's own: every shard's (and layer's) blocks
      shape = quant8.scale_shape(layout.host_shape)
    return jax.ShapeDtypeStruct(shape, np.float32)
  scales = jax.tree.unflatten(structure, [scales_of(l, x) for l, x in zip(plan.leaves, saved)])
  return scales, outline(scales)


def streamed_entries(trained: ZeroState, target: dict) -> tuple[str, ...]:
  """The entries of `expected`'s target that `load_engine_state` reads span
  by span from `saved_leaf.SavedLeaf`s (each process the spans of its own
  shards): Adam's masters and moments; none for another optimizer's state
  (global arrays, which orbax reads shard by shard)."""
  if "opt_state" in target:
    return ()
  return tuple(name for name in ("master", "mu", "nu", codes_entry("mu"), codes_entry("nu"))
               if name in target)


def _padded_otherwise(saved_leaf: str | None, layout: LeafLayout, dtype) -> bool:
  """Whether a saved leaf (its outline) is this leaf flat and padded for
  another device count: rows as this layout's (one per layer, or one), each
  at least the leaf's (or layer's) size. The values are at the start of
  each row, so reading it cut or padded to this engine's rows gives them."""
  if saved_leaf is None:
    return False
  found = re.fullmatch(r"(\w+)\[([\d, ]*)\]", saved_leaf)
  if not found or found[1] != np.dtype(dtype).name:
    return False
  shape = tuple(int(n) for n in found[2].split(",") if n.strip())
  lead = layout.flat_shape[:-1]
  return (len(shape) == len(layout.flat_shape) and shape[:-1] == lead
          and shape[-1] >= math.prod(layout.inner_shape))
