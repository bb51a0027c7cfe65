"""A `ZeroEngine`'s state as a dict of host arrays, and back: what
`engine.state_dict()` returns, `engine.load_state_dict()` takes and
jzo.checkpoint writes and reads with orbax.

The formats (`format_of` names the one an engine writes; `load_engine_state`
reads each into the engines it suits). Every one holds the loss scale
(`loss_scale`, `good_steps`) and the counters (`step`, `skipped`,
`steps_run`).

- ADAM: jzo.cpu_adam/cpu_adamw (offload on or off, any placement) and
  optax.adam/adamw (a chain of one Adam state and step counts), in one
  process. The float32 masters and both moments in the params' full shapes,
  and the step count, whatever lives where. They load into any Adam engine
  of the same model: any ZeRO stage, device count or placement, offload on
  or off (the re-sharding is a reshape on the host). The moments carry over
  as they are; learning rate and weight decay are the loading engine's.
  int8 moments are saved as they are kept, at a quarter of float32's bytes:
  `mu_codes`/`nu_codes` (uint8, the params' full shapes) and `mu_scales`/
  `nu_scales` ((S, blocks) or (S, L, blocks): each shard's blocks, of the
  leaf or of each layer) in place of `mu`/`nu`. They load into any Adam
  engine in one process as their values (an int8 engine of the same shards
  gets the same codes and scales back; another quantizes the values in its
  own blocks), in one process or several; an int8 engine loads the float32
  moments of before too. No
  optimizer name is saved: optax's others that keep a ScaleByAdamState
  (adamax, yogi, radam, lamb) save this format too, and would load into Adam.
- ADAM_FLAT: the same optimizers over several processes. The masters and
  moments are global arrays, flat and padded (`flat_shape`) over the data
  axis, each process giving its own devices' shards (the host parts
  included); they load into an Adam engine over any number of devices and
  processes with the same rows (stage 3's per-layer leaves keep a row per
  layer): the values sit at the start of each row, and the padding is cut
  or padded to the loading engine's. int8 moments are their codes, flat and
  padded the same way, and their scales ((S, blocks) or (S, L, blocks),
  each process giving its shards' rows), as ADAM's entries; they load as
  ADAM's do.
- OPTIMIZER: any other optimizer. The flat padded masters and its optax
  state as the devices keep them, which load into the same optimizer, stage
  and device count. An Adam engine without offload also loads this format
  (its checkpoints before the full-shape one).

`outline` and `misfit` compare a saved tree with what an engine loads,
naming the first entries that differ, before any array is read.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax.experimental import multihost_utils

from jzo.kernels import quant8
from jzo.checkpoint import spans as state_spans
from jzo import step as step_lib
from jzo.kernels.cpu_adam import CpuAdamState
from jzo.parallel.distributed import local_positions
from jzo.parallel.partition import LeafLayout, is_layout
from jzo.plan import Plan
from jzo.precision import LossScaleState
from jzo.state.build import ZeroState
from jzo.step import EngineState
from jzo.host.transfer import host_memory_kind, host_pieces

# Differences between a saved state and an engine that a message lists at most.
_MAX_DIFFERENCES = 4

# The formats (see the module docstring).
ADAM = "adam"  # masters and moments in the params' full shapes, and the count
ADAM_FLAT = "adam, flat"  # the same as global arrays, flat and padded (several processes)
OPTIMIZER = "optimizer"  # another optimizer's flat masters and state as the devices keep it


def misfit(saved, mine) -> str:
  """Where two outlines (see `outline`) differ, the first first; "" if they agree."""
  found: list[str] = []
  _compare(saved, mine, "", found)
  return "; ".join(found[:_MAX_DIFFERENCES]) + ("; ..." if len(found) > _MAX_DIFFERENCES else "")


def outline(tree):
  """A tree as orbax stores it: dicts, lists, None for empty nodes (optax's
  EmptyState) and 'dtype[shape]' strings for arrays."""
  if isinstance(tree, dict):
    return {str(k): outline(v) for k, v in tree.items()}
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple: stored as a dict
    return {k: outline(v) for k, v in tree._asdict().items()} or None
  if isinstance(tree, (list, tuple)):
    return [outline(v) for v in tree]
  if tree is None or isinstance(tree, str):  # an outline's already
    return tree
  return f"{np.dtype(tree.dtype)}{list(tree.shape)}"  # np arrays and orbax's ArrayMetadata


def _compare(saved, mine, path: str, found: list[str]) -> None:
  """Appends to `found` a line per difference between two outlines, in key order."""
  here = path or "the state"
  if isinstance(saved, dict) and isinstance(mine, dict):
    for k in sorted(saved.keys() | mine.keys()):
      entry = f"{path}[{k!r}]"
      if k not in mine:
        found.append(f"{entry} only in the checkpoint")
      elif k not in saved:
        found.append(f"{entry} only in this engine")
      else:
        _compare(saved[k], mine[k], entry, found)
  elif isinstance(saved, list) and isinstance(mine, list):
    if len(saved) != len(mine):
      found.append(f"{here} has {len(saved)} entries in the checkpoint, {len(mine)} in this "
                   "engine")
    else:
      for i, (s, m) in enumerate(zip(saved, mine)):
        _compare(s, m, f"{path}[{i}]", found)
  elif saved != mine:
    found.append(f"{here} is {_brief(saved)} in the checkpoint, {_brief(mine)} "
                 "in this engine")


def _brief(outline) -> str:
  """An outline in a few words: an array's 'dtype[shape]', else its kind."""
  if isinstance(outline, str):
    return outline
  if not outline:
    return "empty"
  n = len(outline)
  return f"a {'dict' if isinstance(outline, dict) else 'list'} of {n} entr{'y' if n == 1 else 'ies'}"


# ------------------------------------------------- the state as host arrays
def _parts(plan: Plan, device_tree, host_tree, dtype):
  """Full-shape numpy leaves from each leaf's device part (global flat
  arrays, or None when the devices hold no state) and host part
  ((S, ..., k - c) numpy)."""
  def one(layout, device, host):
    if device is None:
      device = np.zeros(layout.part_shape(0), dtype)
    return np.asarray(layout.unflatten(layout.join(jax.device_get(device), host)))
  if device_tree is None:
    device_tree = jax.tree.map(lambda _: None, plan.layouts, is_leaf=is_layout)
  return jax.tree.map(one, plan.layouts, device_tree, host_tree, is_leaf=is_layout)


def _saved_moment_dtype(host, name: str) -> np.dtype:
  dtype = getattr(host.hyper, f"{name}_dtype")
  return np.dtype(np.float32) if quant8.is_int8(dtype) else np.dtype(dtype)


def _write_host_part(dst, d: int, piece, c: int, name: str) -> None:
  """Writes device d's host part of master or moment `name` (dst: the
  host's array, or Int8Moment, over this process's devices) from its shard
  `piece`: values ((..., k) numpy, of which [c, k) are the host's), or an
  int8 shard's codes and scales in dst's blocks (an Int8Moment), copied."""
  if isinstance(piece, quant8.Int8Moment):
    np.copyto(dst.codes[d], piece.codes)
    np.copyto(dst.scales[d], piece.scales)
    return
  values = piece[..., c:]
  if not isinstance(dst, quant8.Int8Moment):
    np.copyto(dst[d], values)
    return
  q = quant8.quantize(np.asarray(values, np.float32), signed=name == "mu")
  np.copyto(dst.codes[d], q.codes)
  np.copyto(dst.scales[d], q.scales)


def _full(plan: Plan, flat_tree):
  """Full-shape numpy leaves from flat padded ones (global arrays, `flat_shape`)."""
  return jax.tree.map(lambda l, x: np.asarray(l.unflatten(x)), plan.layouts,
                      jax.device_get(flat_tree), is_leaf=is_layout)


def _device_part(mesh: Mesh, layout: LeafLayout, pieces: list[np.ndarray], axis: str):
  """The global device part (`part_shape(c)`) of a leaf from this
  process's shards ((..., k) numpy each, in device order)."""
  devices = [mesh.devices.flat[d] for d in local_positions(mesh)]
  arrays = [jax.device_put(np.ascontiguousarray(p[..., :layout.on_device]), d)
            for p, d in zip(pieces, devices)]
  return jax.make_array_from_single_device_arrays(
      layout.part_shape(layout.on_device), NamedSharding(mesh, layout.spec(axis)), arrays)


def _lowp(plan: Plan, mesh: Mesh, layout: LeafLayout, master, spec: P) -> jax.Array:
  """The compute-dtype params of a leaf from its saved float32 master: numpy
  (full or flat), or a global flat array of several processes, converted
  on the devices a leaf at a time (offloaded weights: into pinned host memory)."""
  to = NamedSharding(mesh, spec, memory_kind="pinned_host" if plan.params_on_host(layout) else None)
  if not isinstance(master, jax.Array) or master.is_fully_addressable:
    flat = layout.flatten(np.asarray(master))
    return jax.device_put(step_lib.lowp_from_master(flat, plan.compute_dtype, plan.sharded_lowp,
                                                    layout), to)
  on_devices = jax.device_put(master, NamedSharding(mesh, layout.spec(plan.axis)))
  lowp = lambda m: step_lib.lowp_from_master(m, plan.compute_dtype, plan.sharded_lowp, layout)
  return jax.jit(lowp, out_shardings=to)(on_devices)


def _several_processes() -> bool:
  return jax.process_count() > 1


def _scalar(x) -> np.ndarray:
  """A replicated scalar (a global jax array, or numpy) as numpy, read locally."""
  return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


def _shard_sharding(plan: Plan, mesh: Mesh, layout: LeafLayout) -> NamedSharding:
  """Where a flat padded leaf's shards wait for orbax: in host memory when
  the devices have some (a GPU has no room for the offloaded state)."""
  kind = host_memory_kind(mesh.devices.flat[0])
  return NamedSharding(mesh, layout.spec(plan.axis), memory_kind=kind)


def _joined_shards(plan: Plan, mesh: Mesh, device_tree, host_tree):
  """Per leaf, the global flat padded array (`flat_shape`) whose shards are
  this process's devices' parts (global arrays `part_shape(c)`, or None)
  joined to its host parts ((n local, ..., k - c) numpy): each process
  provides only its own shards."""
  devices = [mesh.devices.flat[d] for d in local_positions(mesh)]

  def one(layout, device_part, host):
    sharding = _shard_sharding(plan, mesh, layout)
    on_device = {s.device: s.data for s in device_part.addressable_shards} \
        if device_part is not None else {}
    pieces = []
    for j, device in enumerate(devices):
      piece = host[j]
      if device in on_device:
        piece = np.concatenate([np.asarray(on_device[device]), piece], axis=-1)
      pieces.append(jax.device_put(piece, jax.sharding.SingleDeviceSharding(
          device, memory_kind=sharding.memory_kind)))
    return jax.make_array_from_single_device_arrays(layout.flat_shape, sharding, pieces)
  if device_tree is None:
    device_tree = jax.tree.map(lambda _: None, plan.layouts, is_leaf=is_layout)
  return jax.tree.map(one, plan.layouts, device_tree, host_tree, is_leaf=is_layout)


def _joined_scales(plan: Plan, mesh: Mesh, layout: LeafLayout, scales: np.ndarray) -> jax.Array:
  """An int8 moment's scales as the global array (S, [L,] blocks) whose rows
  are this process's shards' ((n local, [L,] blocks) numpy), in host memory."""
  spec = P(plan.axis) if layout.shards > 1 else P()
  kind = host_memory_kind(mesh.devices.flat[0])
  devices = [mesh.devices.flat[d] for d in local_positions(mesh)]
  pieces = [jax.device_put(scales[j:j + 1], jax.sharding.SingleDeviceSharding(d, memory_kind=kind))
            for j, d in enumerate(devices)]
  return jax.make_array_from_single_device_arrays(
      (layout.shards,) + scales.shape[1:], NamedSharding(mesh, spec, memory_kind=kind), pieces)


def _local_shards(plan: Plan, mesh: Mesh, tree):
  """Per leaf, this process's shards ((..., k) numpy, in device order) of
  saved leaves: global flat arrays (their addressable shards), or numpy in
  full or flat shapes."""
  return jax.tree.map(lambda l, x: _shards_of(mesh, l, x), plan.layouts, tree,
                      is_leaf=is_layout)


def _shards_of(mesh: Mesh, layout: LeafLayout, x) -> list[np.ndarray]:
  """This process's shards of one saved leaf (see `_local_shards`)."""
  devices = [mesh.devices.flat[d] for d in local_positions(mesh)]
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    by_device = {s.device: s.data for s in x.addressable_shards}
    return [np.asarray(by_device[d]) for d in devices]
  flat = layout.flatten(np.asarray(x))  # a flat leaf stays as it is
  rows = flat.reshape(layout.flat_shape[:-1] + (layout.shards, layout.shard_size))
  return [rows[..., d, :] for d in local_positions(mesh)]


def _int8_shards(plan: Plan, mesh: Mesh, saved: dict, name: str, host):
  """Per leaf, this process's shards of moment `name` saved as int8 codes
  and scales (in one process's format or several's): where this engine
  keeps int8 moments in the same blocks (host: its moment tree), Int8Moments
  of each shard's codes and scales; else the values ((..., k) float32
  numpy, in device order)."""
  positions = local_positions(mesh)
  signed = name == "mu"

  def one(layout, codes, scales, mine):
    if isinstance(scales, jax.Array) and not scales.is_fully_addressable:  # a state dict's
      scales = multihost_utils.process_allgather(scales, tiled=True)
    scales = np.asarray(scales, np.float32)
    pieces = _shards_of(mesh, layout, codes)
    if (isinstance(mine, quant8.Int8Moment) and scales.shape[0] == layout.shards
        and scales.shape[1:] == mine.scales.shape[1:]):
      return [quant8.Int8Moment(p, scales[d]) for p, d in zip(pieces, positions)]
    # Values at positions of the full shape (rows, layers or not, may be
    # the saving engine's or this one's: the same values either way).
    size, k = math.prod(layout.inner_shape), layout.shard_size
    blocks = state_spans.Int8Blocks(scales, layout.shape, signed)
    out = []
    for p, d in zip(pieces, positions):
      rows = p.reshape(-1, k)
      values = np.zeros(rows.shape, np.float32)  # the padding's are zeros
      n = max(0, min(k, size - d * k))
      for r in range(rows.shape[0]):
        values[r, :n] = blocks.values(rows[r, :n], r * size + d * k)
      out.append(values.reshape(p.shape))
    return out
  mine = host if host is not None else jax.tree.map(lambda _: None, plan.layouts,
                                                    is_leaf=is_layout)
  return jax.tree.map(one, plan.layouts, saved[codes_entry(name)], saved[scales_entry(name)],
                      mine, is_leaf=is_layout)


def full_masters(trained: ZeroState):
  """The float32 master weights in full shapes (numpy). With several
  processes every process calls it: the shards are gathered from all."""
  plan, mesh, state, host = trained.plan, trained.mesh, trained.device, trained.host
  if _several_processes():
    flat = (_joined_shards(plan, mesh, state.master, host.master) if plan.cpu_adam
            else state.master)
    return _full(plan, multihost_utils.process_allgather(flat, tiled=True))
  if not plan.cpu_adam:
    return _full(plan, state.master)
  return _parts(plan, state.master, host.master, np.float32)


def _is_adam(node) -> bool:
  return isinstance(node, (optax.ScaleByAdamState, CpuAdamState))


def _is_count(path, x) -> bool:
  """A step count: an integer scalar in a field named count (a schedule's)."""
  return (bool(path) and getattr(path[-1], "name", None) == "count" and x.ndim == 0
          and np.issubdtype(x.dtype, np.integer))


def _device_adam(plan: Plan, state: EngineState):
  """The Adam state (count, mu and nu over flat shards) of an engine without
  offload whose optimizer keeps one Adam state beside step counts at most
  (jzo.cpu_adam(w), optax.adam/adamw, with a schedule); else None: other
  state (another optimizer's, injected hyperparameters) has no place in the
  full-shape format."""
  if plan.cpu_adam:
    return None
  leaves = jax.tree_util.tree_leaves_with_path(state.opt_state, is_leaf=_is_adam)
  adams = [x for _, x in leaves if _is_adam(x)]
  if len(adams) == 1 and all(_is_adam(x) or _is_count(path, x) for path, x in leaves):
    return adams[0]
  return None


def _with_adam(opt_state, count: int, mu, nu):
  """`opt_state` (see `_device_adam`) as numpy, its Adam state's moments
  replaced and every count set to `count` (a chain's counts advance together:
  a skipped step keeps the whole state)."""
  def one(path, x):
    if _is_adam(x):
      return x._replace(count=np.asarray(count, x.count.dtype), mu=mu, nu=nu)
    return np.asarray(count, x.dtype)
  return jax.tree_util.tree_map_with_path(one, opt_state, is_leaf=_is_adam)


def format_of(trained: ZeroState) -> str:
  """The format `engine_state_dict` writes for this engine: ADAM, ADAM_FLAT
  or OPTIMIZER (see the module docstring)."""
  if not trained.plan.cpu_adam and _device_adam(trained.plan, trained.device) is None:
    return OPTIMIZER
  return ADAM_FLAT if _several_processes() else ADAM


def engine_state_dict(trained: ZeroState, streamed: bool = False) -> dict:
  """Host numpy arrays of everything needed to continue exactly, in the
  engine's format (`format_of`): masters, optimizer state, loss scale and
  counters; in ADAM_FLAT and with several processes, global arrays of each
  process's shards.

  streamed: the masters and moments as `state_spans.StreamedArray`s (ADAM)
  or `StreamedShards` (ADAM_FLAT: each process's own shards) that read the
  live state a span at a time (what jzo.checkpoint writes: no copy of the
  state on the host), valid until the next step.

  The counters all come from the engine's one: `step` (Adam's `count` is
  the same number) and `skipped` (`steps_run` is their sum)."""
  state = trained.device
  common = {"loss_scale": state.loss_scale.scale, "good_steps": state.loss_scale.good_steps,
            "step": state.step, "skipped": state.skipped}
  common = {k: _scalar(v) for k, v in common.items()}
  common["steps_run"] = np.asarray(int(common["step"]) + int(common["skipped"]), np.int64)
  form = format_of(trained)
  if form == OPTIMIZER:
    saved = {**common, "master": state.master, "opt_state": state.opt_state}
    return saved if _several_processes() else jax.device_get(saved)
  if form == ADAM_FLAT:
    adam = _adam_shards(trained) if streamed else _adam_flat(trained)
  else:
    adam = _adam_streamed(trained) if streamed else _adam_full(trained)
  return {**common, **adam, "count": np.asarray(common["step"], np.int64)}


def _adam_full(trained: ZeroState) -> dict:
  """ADAM's masters and moments: numpy arrays in the params' full shapes
  (int8 moments as their codes and scales)."""
  plan, state, host = trained.plan, trained.device, trained.host
  if _int8(trained):
    structure = jax.tree.structure(plan.layouts, is_leaf=is_layout)
    return {name: jax.tree.unflatten(structure, [_read_whole(p, dtype) for p in pieces])
            for name, (pieces, dtype) in _saved_pieces(trained).items()}
  if plan.cpu_adam:
    opt = state.opt_state
    moments = {name: _parts(plan, getattr(opt, name) if opt else None, getattr(host, name),
                            _saved_moment_dtype(host, name)) for name in ("mu", "nu")}
    return {"master": _parts(plan, state.master, host.master, np.float32), **moments}
  adam = _device_adam(plan, state)
  return {"master": _full(plan, state.master), "mu": _full(plan, adam.mu),
          "nu": _full(plan, adam.nu)}


def _read_whole(pieces, dtype) -> np.ndarray:
  """A leaf's pieces (state_spans.Pieces or HeldPieces) read into a new
  array of its full shape, span by span."""
  layout = pieces.layout
  out = np.empty(layout.shape, dtype)
  for index, row, x0, x1 in state_spans.rectangles(layout, np.dtype(dtype).itemsize):
    out[index] = pieces.read(row, x0, x1, dtype).reshape(state_spans.span_shape(layout, index))
  return out


def _adam_pieces(trained: ZeroState) -> dict:
  """ADAM's masters and moments as the engine holds them: per name, a list
  of `state_spans.Pieces` a leaf, and the dtype each is saved in."""
  plan, state, host = trained.plan, trained.device, trained.host
  if plan.cpu_adam:
    opt = state.opt_state
    device = {"master": state.master, "mu": opt.mu if opt else None,
              "nu": opt.nu if opt else None}
    hosts = {name: quant8.leaves(getattr(host, name)) for name in ("master", "mu", "nu")}
    dtypes = {"master": np.dtype(np.float32),
              **{name: _saved_moment_dtype(host, name) for name in ("mu", "nu")}}
  else:
    adam = _device_adam(plan, state)
    device = {"master": state.master, "mu": adam.mu, "nu": adam.nu}
    hosts = {name: [None] * len(plan.leaves) for name in device}
    dtypes = {name: np.dtype(jax.tree.leaves(device[name])[0].dtype) for name in device}
  out = {}
  for name, tree in device.items():
    leaves = jax.tree.leaves(tree) if tree is not None else [None] * len(plan.leaves)
    out[name] = ([state_spans.Pieces(l, d if l.on_device else None, h, signed=name == "mu")
                  for l, d, h in zip(plan.leaves, leaves, hosts[name])], dtypes[name])
  return out


def _adam_streamed(trained: ZeroState) -> dict:
  """ADAM's masters and moments as StreamedArrays in the params' tree
  (int8 moments as their codes and scales)."""
  structure = jax.tree.structure(trained.plan.layouts, is_leaf=is_layout)
  # Codes are cut into the spans of the float32 values a restore makes of them.
  itemsize = lambda name: 4 if name.endswith("_codes") else None
  return {name: jax.tree.unflatten(structure, [state_spans.StreamedArray(p, dtype, itemsize(name))
                                               for p in pieces])
          for name, (pieces, dtype) in _saved_pieces(trained).items()}


def _saved_pieces(trained: ZeroState) -> dict:
  """`_adam_pieces` as the ADAM format saves them: int8 moments as two
  entries, `{name}_codes` (uint8, read from the host's codes) and
  `{name}_scales` (float32, the host's (S, [L,] blocks) scales whole)."""
  out = {}
  for name, (pieces, dtype) in _adam_pieces(trained).items():
    if name == "master" or not _int8(trained):
      out[name] = (pieces, dtype)
      continue
    out[codes_entry(name)] = ([dataclasses.replace(p, codes=True) for p in pieces],
                              np.dtype(np.uint8))
    out[scales_entry(name)] = ([state_spans.HeldPieces(p.host.scales) for p in pieces],
                               np.dtype(np.float32))
  return out


def codes_entry(name: str) -> str:
  """The entry of an int8 moment's codes in the ADAM format (name: mu or nu)."""
  return f"{name}_codes"


def scales_entry(name: str) -> str:
  """The entry of an int8 moment's scales in the ADAM format."""
  return f"{name}_scales"


def _int8(trained: ZeroState) -> bool:
  """The engine keeps int8 moments (on the host, with jzo's Adam)."""
  return trained.plan.cpu_adam and quant8.is_int8(trained.host.hyper.mu_dtype)


def _adam_shards(trained: ZeroState) -> dict:
  """ADAM_FLAT's masters and moments as `state_spans.StreamedShards` (int8
  moments as their codes, and their scales as `_joined_scales`' arrays)."""
  plan, mesh = trained.plan, trained.mesh
  structure = jax.tree.structure(plan.layouts, is_leaf=is_layout)
  positions = local_positions(mesh)
  out = {}
  for name, (pieces, dtype) in _saved_pieces(trained).items():
    if isinstance(pieces[0], state_spans.HeldPieces):  # int8 scales: this process's, whole
      leaves = [_joined_scales(plan, mesh, l, p.array) for l, p in zip(plan.leaves, pieces)]
    else:
      leaves = [state_spans.StreamedShards(p, dtype, positions) for p in pieces]
    out[name] = jax.tree.unflatten(structure, leaves)
  return out


def _adam_flat(trained: ZeroState) -> dict:
  """ADAM_FLAT's masters and moments: global arrays, flat and padded, whose
  shards each process gives from its own (int8 moments as their codes and
  scales)."""
  plan, mesh, state, host = trained.plan, trained.mesh, trained.device, trained.host
  if plan.cpu_adam:
    opt = state.opt_state
    adam = {"master": _joined_shards(plan, mesh, state.master, host.master)}
    for name in ("mu", "nu"):
      moment = getattr(host, name)
      if _int8(trained):  # all on the host
        adam[codes_entry(name)] = _joined_shards(plan, mesh, None, jax.tree.map(
            lambda q: q.codes, moment, is_leaf=quant8.is_moment))
        adam[scales_entry(name)] = jax.tree.map(
            lambda l, q: _joined_scales(plan, mesh, l, q.scales), plan.layouts, moment,
            is_leaf=is_layout)
      else:
        adam[name] = _joined_shards(plan, mesh, getattr(opt, name) if opt else None, moment)
    return adam
  adam = _device_adam(plan, state)
  return {"master": state.master, "mu": adam.mu, "nu": adam.nu}


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
  device_adam = _device_adam(plan, state)
  several = _several_processes()
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
                                  sharding=_shard_sharding(plan, mesh, layout))
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
        quant8.shape_of(x), _saved_moment_dtype(host, name)), getattr(host, name),
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
  return _int8(trained) and name not in saved_outline


def _scales_entry(trained: ZeroState, name: str, saved_outline) -> tuple:
  """(target, accepted outline) of an int8 moment's scales, read whole by
  every process: as saved (any shard count: state_spans.Int8Blocks checks
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
  by span from `state_spans.SavedLeaf`s (each process the spans of its own
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


class StateChanged(RuntimeError):
  """A load that failed part-way: the engine's state holds part of the
  saved values (its `__cause__` is the failure)."""


def _load_adam(trained: ZeroState, saved: dict) -> EngineState:
  """ADAM's or ADAM_FLAT's masters and moments (full shapes, or flat and
  padded; arrays in one process, SavedLeafs in any) into the engine's
  pieces, a leaf and a span at a time, in place: the device parts, the
  compute-dtype weights made from the masters, and the host parts. Each
  process reads the spans of its own shards. The host never holds more
  than a few spans beside the state; the devices, one span."""
  plan, mesh, state, host = trained.plan, trained.mesh, trained.device, trained.host
  positions = local_positions(mesh)
  pieces = _adam_pieces(trained)
  structure = jax.tree.structure(plan.layouts, is_leaf=is_layout)
  lowp = jax.tree.leaves(state.params)
  device = {name: [p.device for p in leaf_pieces] for name, (leaf_pieces, _) in pieces.items()}
  saved_leaves = {name: _saved_values(saved, name) for name in pieces}

  def assembled() -> EngineState:
    tree = lambda leaves: jax.tree.unflatten(structure, leaves)
    new = state._replace(params=tree(lowp))
    if plan.cpu_adam and not plan.has_device_state:
      return new
    fill = lambda name, old: tree([d if d is not None else o for d, o in
                                   zip(device[name], jax.tree.leaves(old))])
    master = fill("master", state.master)
    adam = state.opt_state if plan.cpu_adam else _device_adam(plan, state)
    mu, nu = fill("mu", adam.mu), fill("nu", adam.nu)
    if plan.cpu_adam:
      return new._replace(master=master, opt_state=state.opt_state._replace(mu=mu, nu=nu))
    return new._replace(master=master, opt_state=_replace_adam(state.opt_state, mu, nu))

  for i, layout in enumerate(plan.leaves):
    for name, (leaf_pieces, _) in pieces.items():
      p = leaf_pieces[i]
      # Where the leaf's values go: (target, the list of global arrays its own is in).
      targets = []
      if p.device is not None:
        targets.append((state_spans.target_for(layout, p.device, positions), device[name]))
      if p.host is not None and layout.on_host:
        targets.append((state_spans.Target(layout, [], [], 0, host=p.host, signed=p.signed),
                        None))
      if name == "master" and not plan.params_on_host(layout):
        targets.append((state_spans.target_for(layout, lowp[i], positions, part=False,
                                               full=not plan.sharded_lowp), lowp))
      try:
        try:
          state_spans.load_leaf(state_spans.as_saved_leaf(saved_leaves[name][i]),
                                [t for t, _ in targets], positions)
        finally:  # the buffers are whole arrays, every span read or not
          for t, arrays in targets:
            if arrays is not None:
              arrays[i] = state_spans.global_array(t, arrays[i])
      except Exception as e:
        trained.device = assembled()
        raise StateChanged(f"loading {name} of leaf {i} failed: {e}") from e
    if plan.params_on_host(layout):  # made from the host's masters, as the engine makes them
      host.lowp_weights(i, host_pieces(lowp[i], layout, positions))
  new = assembled()
  count = int(np.asarray(saved["count"]))
  scalar = lambda x: jax.device_put(np.asarray(x), NamedSharding(mesh, P()))
  if new.opt_state is not None:
    new = new._replace(opt_state=_with_count(new.opt_state, scalar, count))
  return new._replace(
      loss_scale=LossScaleState(scalar(np.float32(saved["loss_scale"])),
                                scalar(np.int32(saved["good_steps"]))),
      step=scalar(np.int32(saved["step"])), skipped=scalar(np.int32(saved["skipped"])))


def _saved_values(saved: dict, name: str) -> list:
  """Per leaf, what `load_leaf` reads of master or moment `name`: the saved
  leaves (arrays or SavedLeafs), or an int8 moment's codes and scales as
  SavedInt8Leafs of its values."""
  if codes_entry(name) not in saved:
    return jax.tree.leaves(saved[name])
  return [state_spans.SavedInt8Leaf(state_spans.as_saved_leaf(codes), np.asarray(scales),
                                    signed=name == "mu")
          for codes, scales in zip(jax.tree.leaves(saved[codes_entry(name)]),
                                   jax.tree.leaves(saved[scales_entry(name)]))]


def _replace_adam(opt_state, mu, nu):
  """opt_state (see `_device_adam`) with its Adam state's moments replaced."""
  return jax.tree.map(lambda x: x._replace(mu=mu, nu=nu) if _is_adam(x) else x, opt_state,
                      is_leaf=_is_adam)


def _with_count(opt_state, scalar, count: int):
  """opt_state with every step count (Adam's, a schedule's) set to `count`,
  replicated on the devices."""
  def one(path, x):
    if _is_adam(x):
      return x._replace(count=scalar(np.asarray(count, x.count.dtype)))
    return scalar(np.asarray(count, x.dtype)) if _is_count(path, x) else x
  return jax.tree_util.tree_map_with_path(one, opt_state, is_leaf=_is_adam)


def load_engine_state(trained: ZeroState, saved: dict) -> EngineState:
  """The device state from `engine_state_dict` output (of one process or
  several); the host arrays are written in place. The saved `step` sets
  the engine's counter (Adam's counts are the same number). Adam's
  masters and moments may be `state_spans.SavedLeaf`s (a checkpoint open
  for reading), read a span at a time.

  Raises:
    ValueError: the saved tree does not fit this engine, naming the first
      entries that differ.
    StateChanged: reading a saved leaf failed after part of the state was
      written; `trained.device` is a whole state again, of mixed values.
  """
  plan, mesh, state, host = trained.plan, trained.mesh, trained.device, trained.host
  differences = misfit(outline(saved), outline(expected(trained, saved, prefer_full=True)[0]))
  if differences:
    raise ValueError(f"checkpoint does not fit this engine: {differences}")
  lazy = isinstance(jax.tree.leaves(saved.get("master"))[0], state_spans.SavedLeaf)
  if "opt_state" not in saved and (lazy or not _several_processes()):
    return _load_adam(trained, saved)
  specs = step_lib.state_specs(plan, trained.tx)
  # Numpy is every process's whole value; a global array (several processes'
  # state dict, or another optimizer's checkpoint) moves shard by shard into
  # the devices' memory.
  put = lambda x, spec: jax.device_put(x if isinstance(x, jax.Array) else np.asarray(x),
                                       NamedSharding(mesh, spec))
  if plan.cpu_adam:
    masters = saved["master"]
    master = opt_state = None
    device_parts = {}
    for name in ("master", "mu", "nu"):
      if codes_entry(name) in saved:
        shards = _int8_shards(plan, mesh, saved, name, getattr(host, name) if host else None)
      else:
        shards = _local_shards(plan, mesh, saved[name])
      if plan.has_device_state:
        device_parts[name] = jax.tree.map(
            lambda l, pieces: _device_part(mesh, l, pieces, plan.axis), plan.layouts, shards,
            is_leaf=is_layout)
      if host is not None:  # this process's host parts
        jax.tree.map(lambda l, dst, pieces: [_write_host_part(dst, d, p, l.on_device, name)
                                             for d, p in enumerate(pieces)],
                     plan.layouts, getattr(host, name), shards, is_leaf=is_layout)
    count = int(saved["count"])
    if plan.has_device_state:
      master = device_parts["master"]
      opt_state = state.opt_state._replace(count=put(np.int32(count), P()),
                                           mu=device_parts["mu"], nu=device_parts["nu"])
  else:
    if "opt_state" in saved:
      masters, opt_state = saved["master"], saved["opt_state"]
    else:  # several processes' Adam: flat global arrays, sharded as the engine's
      masters = saved["master"]
      opt_state = _with_adam(state.opt_state, int(saved["count"]), saved["mu"], saved["nu"])
    master = jax.tree.map(put, masters, specs.master)
    opt_state = jax.tree.map(put, opt_state, specs.opt_state)
  lowp = jax.tree.map(lambda l, m, spec: _lowp(plan, mesh, l, m, spec), plan.layouts,
                      masters, specs.params, is_leaf=is_layout)
  scalar = lambda x: put(x, P())
  new = state._replace(
      params=lowp, master=master, opt_state=opt_state,
      loss_scale=LossScaleState(scalar(np.float32(saved["loss_scale"])),
                                scalar(np.int32(saved["good_steps"]))),
      step=scalar(np.int32(saved["step"])), skipped=scalar(np.int32(saved["skipped"])))
  return new
