"""A saved state dict loaded into an engine (`load_engine_state`): in the
format it was saved in (jzo.checkpoint.state_dict's ADAM, ADAM_FLAT or
OPTIMIZER), re-sharded on the host for the loading engine's devices,
processes and placement. Adam's masters and moments are read a leaf and a
span at a time (jzo.checkpoint.saved_leaf), each process its own shards'."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jzo import step as step_lib
from jzo.checkpoint import engine_parts
from jzo.checkpoint.engine_parts import (adam_on_devices, adam_pieces, codes_entry, is_adam,
                                         is_count, scales_entry)
from jzo.checkpoint.expected import expected
from jzo.checkpoint.outline import misfit, outline
from jzo.checkpoint.saved_leaf import (Int8Blocks, SavedInt8Leaf, SavedLeaf, Target,
                                       as_saved_leaf, global_array, load_leaf, target_for)
from jzo.host.transfer import host_pieces
from jzo.kernels import quant8
from jzo.parallel.distributed import local_positions
from jzo.parallel.partition import LeafLayout, is_layout
from jzo.plan import Plan
from jzo.precision import LossScaleState
from jzo.state.build import ZeroState
from jzo.step import EngineState


class StateChanged(RuntimeError):
  """A load that failed part-way: the engine's state holds part of the
  saved values (its `__cause__` is the failure)."""


def load_engine_state(trained: ZeroState, saved: dict) -> EngineState:
  """The device state from `engine_state_dict` output (of one process or
  several); the host arrays are written in place. The saved `step` sets
  the engine's counter (Adam's counts are the same number). Adam's
  masters and moments may be `saved_leaf.SavedLeaf`s (a checkpoint open
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
  lazy = isinstance(jax.tree.leaves(saved.get("master"))[0], SavedLeaf)
  if "opt_state" not in saved and (lazy or not engine_parts.several_processes()):
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


def _load_adam(trained: ZeroState, saved: dict) -> EngineState:
  """ADAM's or ADAM_FLAT's masters and moments (full shapes, or flat and
  padded; arrays in one process, SavedLeafs in any) into the engine's
  pieces, a leaf and a span at a time, in place: the device parts, the
  compute-dtype weights made from the masters, and the host parts. Each
  process reads the spans of its own shards. The host never holds more
  than a few spans beside the state; the devices, one span."""
  plan, mesh, state, host = trained.plan, trained.mesh, trained.device, trained.host
  positions = local_positions(mesh)
  pieces = adam_pieces(trained)
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
    adam = state.opt_state if plan.cpu_adam else adam_on_devices(plan, state)
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
        targets.append((target_for(layout, p.device, positions), device[name]))
      if p.host is not None and layout.on_host:
        targets.append((Target(layout, [], [], 0, host=p.host, signed=p.signed), None))
      if name == "master" and not plan.params_on_host(layout):
        targets.append((target_for(layout, lowp[i], positions, part=False,
                                   full=not plan.sharded_lowp), lowp))
      try:
        try:
          load_leaf(as_saved_leaf(saved_leaves[name][i]), [t for t, _ in targets], positions)
        finally:  # the buffers are whole arrays, every span read or not
          for t, arrays in targets:
            if arrays is not None:
              arrays[i] = global_array(t, arrays[i])
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
  return [SavedInt8Leaf(as_saved_leaf(codes), np.asarray(scales), signed=name == "mu")
          for codes, scales in zip(jax.tree.leaves(saved[codes_entry(name)]),
                                   jax.tree.leaves(saved[scales_entry(name)]))]


def _replace_adam(opt_state, mu, nu):
  """opt_state (see `adam_on_devices`) with its Adam state's moments replaced."""
  return jax.tree.map(lambda x: x._replace(mu=mu, nu=nu) if is_adam(x) else x, opt_state,
                      is_leaf=is_adam)


def _with_count(opt_state, scalar, count: int):
  """opt_state with every step count (Adam's, a schedule's) set to `count`,
  replicated on the devices."""
  def one(path, x):
    if is_adam(x):
      return x._replace(count=scalar(np.asarray(count, x.count.dtype)))
    return scalar(np.asarray(count, x.dtype)) if is_count(path, x) else x
  return jax.tree_util.tree_map_with_path(one, opt_state, is_leaf=is_adam)


def _with_adam(opt_state, count: int, mu, nu):
  """`opt_state` (see `adam_on_devices`) as numpy, its Adam state's moments
  replaced and every count set to `count` (a chain's counts advance together:
  a skipped step keeps the whole state)."""
  def one(path, x):
    if is_adam(x):
      return x._replace(count=np.asarray(count, x.count.dtype), mu=mu, nu=nu)
    return np.asarray(count, x.dtype)
  return jax.tree_util.tree_map_with_path(one, opt_state, is_leaf=is_adam)


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
    blocks = Int8Blocks(scales, layout.shape, signed)
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


def _device_part(mesh: Mesh, layout: LeafLayout, pieces: list[np.ndarray], axis: str):
  """The global device part (`part_shape(c)`) of a leaf from this
  process's shards ((..., k) numpy each, in device order)."""
  devices = [mesh.devices.flat[d] for d in local_positions(mesh)]
  arrays = [jax.device_put(np.ascontiguousarray(p[..., :layout.on_device]), d)
            for p, d in zip(pieces, devices)]
  return jax.make_array_from_single_device_arrays(
      layout.part_shape(layout.on_device), NamedSharding(mesh, layout.spec(axis)), arrays)


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
