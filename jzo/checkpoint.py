"""Orbax checkpoints of a `ZeroEngine`: save its state at a step, restore it.

    manager = checkpoint.open_manager("runs/x/checkpoints")
    checkpoint.save(manager, engine, step)           # blocks until on disk
    step = checkpoint.restore(manager, engine)       # the latest complete one
    manager.close()

A checkpoint is the engine's `state_dict()` (float32 master weights,
optimizer state, loss scale and counters, as host arrays) in the folder
`<directory>/<step>`. Orbax writes each one to a temporary folder and renames
it when complete, so a run killed while saving leaves the previous one intact
and an unfinished one is never restored.

The engine is used only through `state_dict()` and `load_state_dict(saved)`.
Every failure to find, read or apply a checkpoint raises `CheckpointError`,
whose message names the folder and the step.

What is saved (`engine_state_dict`, `load_engine_state`, which the engine's
methods call): with jzo's Adam (offload on, any placement) full-shape
float32 masters and moments, whatever lives where, so a checkpoint loads
into any placement, device count or ZeRO stage of the same model (the
re-sharding is a reshape on the host); with another optax transformation
the flat padded masters and that optimizer's state as the devices keep them
(same stage and device count to load).
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jzo import step as step_lib
from jzo.offload import HostAdam
from jzo.partition import LeafLayout, is_layout
from jzo.plan import Plan
from jzo.precision import LossScaleState
from jzo.step import EngineState

# Orbax's own errors carry the whole tensorstore spec; a message keeps this much.
_MAX_DETAIL = 300
# Differences between a checkpoint and an engine that a message lists at most.
_MAX_DIFFERENCES = 4


class CheckpointError(ValueError):
  """No checkpoint, an unreadable one, or one that does not fit the engine.

  Attributes:
    directory: the checkpoints folder (absolute).
    step: the step concerned; None when the folder has no checkpoint.
  """

  def __init__(self, message: str, directory: pathlib.Path, step: int | None = None):
    super().__init__(message)
    self.directory = directory
    self.step = step


def open_manager(directory: str | pathlib.Path, max_to_keep: int = 2) -> ocp.CheckpointManager:
  """Opens (creating if needed) the checkpoints folder.

  Args:
    directory: the folder that holds one subfolder per step.
    max_to_keep: complete checkpoints kept; saving one more deletes the oldest.
      Two, so that the previous one survives while the next is written.

  Returns:
    An orbax `CheckpointManager` for `save` and `restore`; close it when done
    (it is also a context manager).
  """
  return ocp.CheckpointManager(
      pathlib.Path(directory).absolute(),  # orbax resolves relative paths differently
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep),
      # Declared up front so that a fresh manager can read a checkpoint's
      # metadata (the tree of shapes) before anything was restored through it.
      item_handlers=ocp.StandardCheckpointHandler())


def save(manager: ocp.CheckpointManager, engine, step: int) -> None:
  """Writes `engine.state_dict()` as the checkpoint of `step`, and waits for it.

  Waiting matters: the state dict may hold the engine's live host arrays
  (offload), which the next step updates in place; and a run that dies after
  this returns finds the checkpoint complete.

  Args:
    manager: from `open_manager`.
    engine: a `ZeroEngine` (anything with `state_dict()`).
    step: the optimizer steps done; later than every checkpoint already there.

  Raises:
    CheckpointError: `step` is not later than the latest checkpoint (orbax
      only adds later steps and would skip it without a word).
  """
  if not manager.save(step, args=ocp.args.StandardSave(engine.state_dict())):
    raise CheckpointError(f"checkpoint {step} in {_folder(manager)} was not written: the "
                          f"latest there is step {manager.latest_step()}",
                          _folder(manager), step)
  manager.wait_until_finished()


def restore(manager: ocp.CheckpointManager, engine, step: int | None = None) -> int:
  """Loads a complete checkpoint into `engine` with `engine.load_state_dict`.

  Args:
    manager: from `open_manager`.
    engine: a `ZeroEngine` that takes the saved state (the same model and the
      options its `load_state_dict` names); its state is replaced.
    step: the checkpoint to load; None for the latest complete one.

  Returns:
    The step of the checkpoint loaded.

  Raises:
    CheckpointError: the folder has no (such) complete checkpoint; the
      checkpoint cannot be read (damaged files); or it does not fit the
      engine (other options or shapes).
  """
  folder = _folder(manager)
  step = _complete_step(manager, step)
  where = f"checkpoint {step} in {folder}"
  # The engine's own state as the target: orbax rebuilds the same tree types
  # (optax's named tuples) and dtypes.
  target = engine.state_dict()
  try:
    saved = manager.restore(step, args=ocp.args.StandardRestore(target))
  except Exception as e:  # orbax and tensorstore raise many kinds for a damaged folder
    # Orbax refuses a checkpoint of another tree with the same exception
    # types as a damaged one; its metadata tells the two apart.
    differences = _differences(manager, step, target)
    if differences:
      raise CheckpointError(f"{where} does not fit this engine (saved with other stage, "
                            f"offload, optimizer or model): {differences}", folder, step) from e
    raise _unreadable(e, folder, step) from e
  try:
    engine.load_state_dict(saved)
  except ValueError as e:  # same tree, other shapes or dtypes (e.g. another device count)
    raise CheckpointError(f"{where} does not fit this engine: {e}", folder, step) from e
  return step


def read_masters(directory: str | pathlib.Path, step: int | None = None) -> tuple[int, dict]:
  """Reads the float32 master weights of a checkpoint alone: no engine, no
  device, and none of the optimizer state is read from disk.

  Args:
    directory: the checkpoints folder (what `open_manager` opened); left
      as it is (a missing folder is not created).
    step: the checkpoint to read; None for the latest complete one.

  Returns:
    (step, masters): numpy float32 leaves as saved: in the params' shapes
    with jzo's Adam (offload, any placement); with another optimizer flat and
    padded as the devices keep them ((S*k,), or (L, S*k) for stage 3's
    per-layer leaves), which `masters_in_shapes` undoes.

  Raises:
    CheckpointError: no such folder, no (such) complete checkpoint, or an
      unreadable one.
  """
  folder = pathlib.Path(directory).absolute()
  if not folder.is_dir():
    raise CheckpointError(f"no checkpoints folder {folder}", folder, step)
  # The tree handler (which StandardCheckpointHandler wraps: same files) can
  # restore one entry of the saved dict.
  with ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(create=False),
                             item_handlers=ocp.PyTreeCheckpointHandler()) as manager:
    step = _complete_step(manager, step)
    try:
      saved = manager.item_metadata(step).tree["master"]
      as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
      restored = manager.restore(step, args=ocp.args.PyTreeRestore(
          {"master": saved}, restore_args={"master": as_numpy}, partial_restore=True))
    except Exception as e:  # orbax and tensorstore raise many kinds for a damaged folder
      raise _unreadable(e, folder, step) from e
  return step, restored["master"]


def masters_in_shapes(masters: dict, shapes) -> dict:
  """`read_masters`' masters in the params' full shapes.

  Args:
    masters: as saved (full shapes, or flat and padded).
    shapes: the params' tree, with anything that has a `.shape` as leaves
      (arrays, `jax.ShapeDtypeStruct`s).

  Returns:
    The masters as numpy arrays of `shapes`' shapes (a leaf already in its
    shape is returned as it is).

  Raises:
    ValueError: other names, or a leaf that does not hold its shape's values.
  """
  if jax.tree.structure(masters) != jax.tree.structure(shapes):
    saved, model = _names(masters), _names(shapes)
    raise ValueError(f"the checkpoint's parameters are not the model's: "
                     f"{', '.join(sorted(saved - model)) or 'none'} only in the checkpoint, "
                     f"{', '.join(sorted(model - saved)) or 'none'} only in the model")

  def one(path, saved, like):
    shape = tuple(like.shape)
    if saved.shape == shape:
      return saved
    # Flat: (S*k,), or (L, S*k) with a row per layer. Unflattening reads the
    # full shape alone (the device count the padding was for does not matter).
    layout = LeafLayout(shape, shards=1, per_layer=saved.ndim == 2)
    if saved.shape[:-1] != layout.flat_shape[:-1] or saved.shape[-1] < layout.flat_shape[-1]:
      raise ValueError(f"the checkpoint's {jax.tree_util.keystr(path)} is "
                       f"{saved.dtype}{list(saved.shape)}, which does not hold the model's "
                       f"{list(shape)}")
    return np.asarray(layout.unflatten(saved))
  return jax.tree_util.tree_map_with_path(one, masters, shapes)


def _names(tree) -> set[str]:
  return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}


def _folder(manager: ocp.CheckpointManager) -> pathlib.Path:
  return pathlib.Path(str(manager.directory))


def _complete_step(manager: ocp.CheckpointManager, step: int | None) -> int:
  """`step` if it is a complete checkpoint, the latest one if None; else CheckpointError."""
  folder = _folder(manager)
  if step is None:
    step = manager.latest_step()
    if step is None:
      raise CheckpointError(f"no checkpoint in {folder}", folder)
  elif step not in manager.all_steps():
    raise CheckpointError(f"no checkpoint {step} in {folder} (complete ones: "
                          f"{sorted(manager.all_steps()) or 'none'})", folder, step)
  return step


def _unreadable(e: Exception, folder: pathlib.Path, step: int) -> CheckpointError:
  """The error for a checkpoint that orbax failed to read with `e`."""
  detail = str(e).splitlines()[0] if str(e) else ""
  if len(detail) > _MAX_DETAIL:
    detail = detail[:_MAX_DETAIL] + "..."
  return CheckpointError(f"checkpoint {step} in {folder} is unreadable: {type(e).__name__}: "
                         f"{detail}", folder, step)


def _differences(manager: ocp.CheckpointManager, step: int, target) -> str:
  """Where the saved tree differs from `target`, from the checkpoint's
  metadata (no array is read); "" if it agrees or cannot be read."""
  try:
    saved = _outline(manager.item_metadata(step).tree)
  except Exception:  # a damaged checkpoint: the caller reports it as unreadable
    return ""
  found: list[str] = []
  _compare(saved, _outline(target), "", found)
  return "; ".join(found[:_MAX_DIFFERENCES]) + ("; ..." if len(found) > _MAX_DIFFERENCES else "")


def _outline(tree):
  """A tree as orbax stores it: dicts, lists, None for empty nodes (optax's
  EmptyState) and 'dtype[shape]' strings for arrays."""
  if isinstance(tree, dict):
    return {str(k): _outline(v) for k, v in tree.items()}
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple: stored as a dict
    return {k: _outline(v) for k, v in tree._asdict().items()} or None
  if isinstance(tree, (list, tuple)):
    return [_outline(v) for v in tree]
  if tree is None:
    return None
  return f"{np.dtype(tree.dtype)}{list(tree.shape)}"  # np arrays and orbax's ArrayMetadata


def _compare(saved, mine, path: str, found: list[str]) -> None:
  """Appends to `found` a line per difference between two outlines."""
  here = path or "the state"
  if isinstance(saved, dict) and isinstance(mine, dict):
    if only := sorted(saved.keys() - mine.keys()):
      found.append(f"{here} has {', '.join(only)} only in the checkpoint")
    if only := sorted(mine.keys() - saved.keys()):
      found.append(f"{here} has {', '.join(only)} only in this engine")
    for k in sorted(saved.keys() & mine.keys()):
      _compare(saved[k], mine[k], f"{path}[{k!r}]", found)
  elif isinstance(saved, list) and isinstance(mine, list):
    if len(saved) != len(mine):
      found.append(f"{here} has {len(saved)} entries in the checkpoint, {len(mine)} in this "
                   "engine")
    else:
      for i, (s, m) in enumerate(zip(saved, mine)):
        _compare(s, m, f"{path}[{i}]", found)
  elif saved != mine:
    found.append(f"{here} is {saved or 'empty'} in the checkpoint, {mine or 'empty'} in this "
                 "engine")


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


def full_masters(plan: Plan, state: EngineState, host: HostAdam | None):
  """The float32 master weights in full shapes (numpy)."""
  if not plan.offload:
    flat = jax.device_get(state.master)
    return jax.tree.map(lambda l, m: np.asarray(l.unflatten(m)), plan.layouts, flat,
                        is_leaf=is_layout)
  return _parts(plan, state.master, host.master, np.float32)


def engine_state_dict(plan: Plan, state: EngineState, host: HostAdam | None,
                      steps_run: int) -> dict:
  """Host numpy arrays of everything needed to continue exactly: masters,
  optimizer state, loss scale and counters."""
  common = {"loss_scale": state.loss_scale.scale, "good_steps": state.loss_scale.good_steps,
            "step": state.step, "skipped": state.skipped,
            "steps_run": np.asarray(steps_run, np.int64)}
  if not plan.offload:
    return jax.device_get({**common, "master": state.master, "opt_state": state.opt_state})
  opt = state.opt_state
  count = host.count if plan.has_host_state else int(opt.count)
  return jax.device_get({
      **common, "master": full_masters(plan, state, host),
      "mu": _parts(plan, opt.mu if opt else None, host.mu, host.hyper.mu_dtype),
      "nu": _parts(plan, opt.nu if opt else None, host.nu, host.hyper.nu_dtype),
      "count": np.asarray(count, np.int64)})


def _expected(plan: Plan, state: EngineState, host: HostAdam | None):
  """Shapes and dtypes `engine_state_dict` gives, without fetching anything."""
  scalars = {"loss_scale": np.float32, "good_steps": np.int32, "step": np.int32,
             "skipped": np.int32, "steps_run": np.int64}
  tree = {k: jax.ShapeDtypeStruct((), v) for k, v in scalars.items()}
  if not plan.offload:
    return {**tree, "master": state.master, "opt_state": state.opt_state}
  full = lambda dtype: jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape, dtype),
                                    plan.layouts, is_leaf=is_layout)
  return {**tree, "master": full(np.float32), "mu": full(host.hyper.mu_dtype),
          "nu": full(host.hyper.nu_dtype), "count": jax.ShapeDtypeStruct((), np.int64)}


def load_engine_state(plan: Plan, mesh: Mesh, tx, state: EngineState, host: HostAdam | None,
                      saved: dict) -> tuple[EngineState, int]:
  """The engine state (and steps run) from `engine_state_dict` output; host
  arrays are written in place.

  Raises:
    ValueError: the saved tree does not fit this engine, naming the entry.
  """
  mine = _expected(plan, state, host)
  if jax.tree.structure(mine) != jax.tree.structure(saved):
    raise ValueError("checkpoint does not match this engine's state: saved with other "
                     "options (stage, offload, optimizer or model)")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(mine), jax.tree.leaves(saved)):
    b = np.asarray(b)
    if np.shape(a) != b.shape or np.dtype(a.dtype) != b.dtype:
      raise ValueError(f"checkpoint entry {jax.tree_util.keystr(path)} is "
                       f"{b.dtype}{list(b.shape)}, this engine needs "
                       f"{np.dtype(a.dtype)}{list(np.shape(a))}")
  specs = step_lib.state_specs(plan, tx)
  put = lambda x, spec: jax.device_put(np.asarray(x), NamedSharding(mesh, spec))
  if plan.offload:
    flat = lambda tree: jax.tree.map(lambda l, x: l.flatten(np.asarray(x)), plan.layouts,
                                     tree, is_leaf=is_layout)
    masters = flat(saved["master"])
    master = opt_state = None
    device_parts = {}
    for name in ("master", "mu", "nu"):
      split = jax.tree.map(lambda l, x: l.split(x), plan.layouts, flat(saved[name]),
                           is_leaf=is_layout)
      device_parts[name] = jax.tree.map(lambda l, s: s[0], plan.layouts, split,
                                        is_leaf=is_layout)
      if host is not None:
        jax.tree.map(lambda l, dst, s: np.copyto(dst, s[1]), plan.layouts, getattr(host, name),
                     split, is_leaf=is_layout)
    count = int(saved["count"])
    if host is not None:
      host.count = count
    if plan.has_device_state:
      master = jax.tree.map(lambda x, s: put(np.array(x), s), device_parts["master"],
                            specs.master)
      mu_spec, nu_spec = specs.opt_state.mu, specs.opt_state.nu
      opt_state = state.opt_state._replace(
          count=put(np.int32(count), P()),
          mu=jax.tree.map(lambda x, s: put(np.array(x), s), device_parts["mu"], mu_spec),
          nu=jax.tree.map(lambda x, s: put(np.array(x), s), device_parts["nu"], nu_spec))
  else:
    masters = saved["master"]
    master = jax.tree.map(put, saved["master"], specs.master)
    opt_state = jax.tree.map(put, saved["opt_state"], specs.opt_state)
  lowp = jax.tree.map(lambda l, m, spec: put(step_lib.lowp_from_master(plan, l, m), spec),
                      plan.layouts, masters, specs.params, is_leaf=is_layout)
  scalar = lambda x: put(x, P())
  new = state._replace(
      params=lowp, master=master, opt_state=opt_state,
      loss_scale=LossScaleState(scalar(np.float32(saved["loss_scale"])),
                                scalar(np.int32(saved["good_steps"]))),
      step=scalar(np.int32(saved["step"])), skipped=scalar(np.int32(saved["skipped"])))
  return new, int(saved["steps_run"])