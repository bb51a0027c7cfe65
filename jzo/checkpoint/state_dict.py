"""A `ZeroEngine`'s state as a dict of host arrays, and back: what
`engine.state_dict()` returns, `engine.load_state_dict()` takes and
jzo.checkpoint writes and reads with orbax.

The formats (`format_of` names the one an engine writes; `load_engine_state`
reads each into the engines it suits). Every one holds the loss scale
(`loss_scale`, `good_steps`) and the counters (`step`, `skipped`,
`steps_run`). Loading is jzo.checkpoint.load's (`load_engine_state`, also
reached here); what a checkpoint must look like to load,
jzo.checkpoint.expected's.

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

"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jzo.checkpoint import engine_parts
from jzo.checkpoint.engine_parts import (adam_on_devices, adam_pieces, codes_entry, int8_moments,
                                         saved_moment_dtype, scales_entry, shard_sharding)
from jzo.checkpoint.load import load_engine_state
from jzo.checkpoint.saved_leaf import MasterView
from jzo.checkpoint.spans import HeldPieces, StreamedArray, StreamedShards, read_whole
from jzo.host.transfer import host_memory_kind
from jzo.kernels import quant8
from jzo.parallel.distributed import local_positions
from jzo.parallel.partition import LeafLayout, is_layout
from jzo.plan import Plan
from jzo.state.build import ZeroState

__all__ = ["ADAM", "ADAM_FLAT", "OPTIMIZER", "engine_state_dict", "format_of", "full_masters",
           "live_masters", "load_engine_state", "saved_pieces"]

# The formats (see the module docstring).
ADAM = "adam"  # masters and moments in the params' full shapes, and the count
ADAM_FLAT = "adam, flat"  # the same as global arrays, flat and padded (several processes)
OPTIMIZER = "optimizer"  # another optimizer's flat masters and state as the devices keep it


def full_masters(trained: ZeroState):
  """The float32 master weights in full shapes (numpy). With several
  processes every process calls it: the shards are gathered from all."""
  plan, mesh, state, host = trained.plan, trained.mesh, trained.device, trained.host
  if engine_parts.several_processes():
    flat = (_joined_shards(plan, mesh, state.master, host.master) if plan.cpu_adam
            else state.master)
    return _full(plan, multihost_utils.process_allgather(flat, tiled=True))
  if not plan.cpu_adam:
    return _full(plan, state.master)
  return _parts(plan, state.master, host.master, np.float32)


def live_masters(engine) -> dict:
  """The float32 master weights of `engine` (a ZeroEngine: anything with
  `state_dict(streamed=...)`) in full shapes, as `MasterView`s that read
  the live state, device and host parts, only where indexed: what a Hugging
  Face export cuts its tensors from at the end of a run, with no checkpoint
  and no float32 copy of the model on the host. Valid until the next step.

  Raises:
    ValueError: several processes (each holds only its own shards), or an
      optimizer other than Adam (whose masters stay flat as the devices
      keep them).
  """
  if engine_parts.several_processes():
    raise ValueError("the live masters are read in one process; with several, save a "
                     "checkpoint and export it (python -m jzo.export)")
  masters = engine.state_dict(streamed=True)["master"]
  if not all(isinstance(x, StreamedArray) for x in jax.tree.leaves(masters)):
    raise ValueError("the live masters are read from Adam's state (jzo's or optax's); save a "
                     "checkpoint of another optimizer's and export it (python -m jzo.export)")
  return jax.tree.map(MasterView.of_streamed, masters)


def format_of(trained: ZeroState) -> str:
  """The format `engine_state_dict` writes for this engine: ADAM, ADAM_FLAT
  or OPTIMIZER (see the module docstring)."""
  if not trained.plan.cpu_adam and adam_on_devices(trained.plan, trained.device) is None:
    return OPTIMIZER
  return ADAM_FLAT if engine_parts.several_processes() else ADAM


def engine_state_dict(trained: ZeroState, streamed: bool = False) -> dict:
  """Host numpy arrays of everything needed to continue exactly, in the
  engine's format (`format_of`): masters, optimizer state, loss scale and
  counters; in ADAM_FLAT and with several processes, global arrays of each
  process's shards.

  streamed: the masters and moments as `spans.StreamedArray`s (ADAM) or
  `StreamedShards` (ADAM_FLAT: each process's own shards) that read the
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
    return saved if engine_parts.several_processes() else jax.device_get(saved)
  if form == ADAM_FLAT:
    adam = _adam_shards(trained) if streamed else _adam_flat(trained)
  else:
    adam = _adam_streamed(trained) if streamed else _adam_full(trained)
  return {**common, **adam, "count": np.asarray(common["step"], np.int64)}


def _adam_full(trained: ZeroState) -> dict:
  """ADAM's masters and moments: numpy arrays in the params' full shapes
  (int8 moments as their codes and scales)."""
  plan, state, host = trained.plan, trained.device, trained.host
  if int8_moments(trained):
    structure = jax.tree.structure(plan.layouts, is_leaf=is_layout)
    return {name: jax.tree.unflatten(structure, [read_whole(p, dtype) for p in pieces])
            for name, (pieces, dtype) in saved_pieces(trained).items()}
  if plan.cpu_adam:
    opt = state.opt_state
    moments = {name: _parts(plan, getattr(opt, name) if opt else None, getattr(host, name),
                            saved_moment_dtype(host, name)) for name in ("mu", "nu")}
    return {"master": _parts(plan, state.master, host.master, np.float32), **moments}
  adam = adam_on_devices(plan, state)
  return {"master": _full(plan, state.master), "mu": _full(plan, adam.mu),
          "nu": _full(plan, adam.nu)}


def _adam_streamed(trained: ZeroState) -> dict:
  """ADAM's masters and moments as StreamedArrays in the params' tree
  (int8 moments as their codes and scales)."""
  structure = jax.tree.structure(trained.plan.layouts, is_leaf=is_layout)
  # Codes are cut into the spans of the float32 values a restore makes of them.
  itemsize = lambda name: 4 if name.endswith("_codes") else None
  return {name: jax.tree.unflatten(structure, [StreamedArray(p, dtype, itemsize(name))
                                               for p in pieces])
          for name, (pieces, dtype) in saved_pieces(trained).items()}


def saved_pieces(trained: ZeroState) -> dict:
  """ADAM's masters and moments as the format saves them: per entry, a list
  of `spans.Pieces` a leaf (`engine_parts.adam_pieces`) and the dtype it is
  saved in; int8 moments as two entries, `{name}_codes` (uint8, read from
  the host's codes) and `{name}_scales` (float32, `spans.HeldPieces` of the
  host's (S, [L,] blocks) scales whole)."""
  out = {}
  for name, (pieces, dtype) in adam_pieces(trained).items():
    if name == "master" or not int8_moments(trained):
      out[name] = (pieces, dtype)
      continue
    out[codes_entry(name)] = ([dataclasses.replace(p, codes=True) for p in pieces],
                              np.dtype(np.uint8))
    out[scales_entry(name)] = ([HeldPieces(p.host.scales) for p in pieces],
                               np.dtype(np.float32))
  return out


def _adam_shards(trained: ZeroState) -> dict:
  """ADAM_FLAT's masters and moments as `spans.StreamedShards` (int8 moments
  as their codes, and their scales as `_joined_scales`' arrays)."""
  plan, mesh = trained.plan, trained.mesh
  structure = jax.tree.structure(plan.layouts, is_leaf=is_layout)
  positions = local_positions(mesh)
  out = {}
  for name, (pieces, dtype) in saved_pieces(trained).items():
    if isinstance(pieces[0], HeldPieces):  # int8 scales: this process's, whole
      leaves = [_joined_scales(plan, mesh, l, p.array) for l, p in zip(plan.leaves, pieces)]
    else:
      leaves = [StreamedShards(p, dtype, positions) for p in pieces]
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
      if int8_moments(trained):  # all on the host
        adam[codes_entry(name)] = _joined_shards(plan, mesh, None, jax.tree.map(
            lambda q: q.codes, moment, is_leaf=quant8.is_moment))
        adam[scales_entry(name)] = jax.tree.map(
            lambda l, q: _joined_scales(plan, mesh, l, q.scales), plan.layouts, moment,
            is_leaf=is_layout)
      else:
        adam[name] = _joined_shards(plan, mesh, getattr(opt, name) if opt else None, moment)
    return adam
  adam = adam_on_devices(plan, state)
  return {"master": state.master, "mu": adam.mu, "nu": adam.nu}


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


def _full(plan: Plan, flat_tree):
  """Full-shape numpy leaves from flat padded ones (global arrays, `flat_shape`)."""
  return jax.tree.map(lambda l, x: np.asarray(l.unflatten(x)), plan.layouts,
                      jax.device_get(flat_tree), is_leaf=is_layout)


def _scalar(x) -> np.ndarray:
  """A replicated scalar (a global jax array, or numpy) as numpy, read locally."""
  return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


def _joined_shards(plan: Plan, mesh: Mesh, device_tree, host_tree):
  """Per leaf, the global flat padded array (`flat_shape`) whose shards are
  this process's devices' parts (global arrays `part_shape(c)`, or None)
  joined to its host parts ((n local, ..., k - c) numpy): each process
  provides only its own shards."""
  devices = [mesh.devices.flat[d] for d in local_positions(mesh)]

  def one(layout, device_part, host):
    sharding = shard_sharding(plan, mesh, layout)
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
