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
"""

from __future__ import annotations

import pathlib

import numpy as np
import orbax.checkpoint as ocp

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
  if step is None:
    step = manager.latest_step()
    if step is None:
      raise CheckpointError(f"no checkpoint in {folder}", folder)
  elif step not in manager.all_steps():
    raise CheckpointError(f"no checkpoint {step} in {folder} (complete ones: "
                          f"{sorted(manager.all_steps()) or 'none'})", folder, step)
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
    detail = str(e).splitlines()[0] if str(e) else ""
    if len(detail) > _MAX_DETAIL:
      detail = detail[:_MAX_DETAIL] + "..."
    raise CheckpointError(f"{where} is unreadable: {type(e).__name__}: {detail}",
                          folder, step) from e
  try:
    engine.load_state_dict(saved)
  except ValueError as e:  # same tree, other shapes or dtypes (e.g. another device count)
    raise CheckpointError(f"{where} does not fit this engine: {e}", folder, step) from e
  return step


def _folder(manager: ocp.CheckpointManager) -> pathlib.Path:
  return pathlib.Path(str(manager.directory))


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
