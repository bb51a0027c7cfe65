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

The engine is used through `state_dict(streamed=True)` and
`load_state_dict(saved)`, and `restore` reads the shapes of what it loads
from its state (jzo.checkpoint.expected). Adam's masters and moments go to
disk and back a span at a time (jzo.checkpoint.spans, handler and
saved_leaf): the host holds a few spans beside the state, never a copy of it.
Every failure to find, read or apply a checkpoint raises `CheckpointError`,
whose message names the folder and the step; a checkpoint that does not
fit the engine is refused before any array is read, naming the first
entries that differ (another model's parameters, shapes or optimizer).
A save that the disk refuses (full, over quota, read-only, failing) raises
`CheckpointWriteError` naming the OS's reason, with the checkpoints before
it as they were. Each chunk of every array is saved with its CRC32 and
checked as it is read back (jzo.checkpoint.checksums): a checkpoint whose
bytes changed on disk is unreadable, not trained on.

What is saved, in which format, and what loads into what, is
jzo.checkpoint.state_dict's. With several processes (jzo.distributed) every process
calls `save` and `restore` together and orbax writes one set of files, each
process writing and reading its own devices' shards, span by span as one
process does (another optimizer's state: staged in host memory); scalars
are written once. `read_masters` and the export read such a
checkpoint like any other.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import pathlib
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp

from jzo.checkpoint import checksums, disk, handler
from jzo.checkpoint.expected import expected, streamed_entries
from jzo.checkpoint.load import StateChanged
from jzo.checkpoint.outline import misfit, outline
from jzo.checkpoint.saved_leaf import MasterView, SavedLeaf
from jzo.parallel.partition import LeafLayout

# Orbax's own errors carry the whole tensorstore spec; a message keeps this much.
_MAX_DETAIL = 300

# Host RAM a save takes beside the state while it writes: the spans in flight
# (jzo.checkpoint.spans: 8 of 64 MiB), their compressed copies, tensorstore's buffers
# and orbax's cache, and what glibc keeps of them until `release_freed_memory`.
# Measured on an H100 machine with a 125 GiB host:
# host RSS rose 2.38-2.50 GiB in five saves of gpt2-4b's 47 GiB of fp32
# state, 1.29-2.11 GiB for int8 states of 1.5B to 10.28B parameters; the
# spans in flight and the threads' arenas bound it, not the model.
SAVE_HOST_BYTES = int(2.5 * 2**30)
# Seconds a failed save waits for orbax's threads of it to end.
SAVE_THREADS_TIMEOUT_S = 30


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


class UnreadableCheckpointError(CheckpointError):
  """A complete checkpoint whose files cannot be read (damaged, cut short,
  missing): unlike one of another model, an earlier one may still serve.

  Attributes:
    engine_changed: the failure came while the engine's state was being
      written, span by span: it holds part of this checkpoint's values, so
      it must load another one or be built again before it trains.
  """

  def __init__(self, message: str, directory: pathlib.Path, step: int | None = None,
               engine_changed: bool = False):
    super().__init__(message, directory, step)
    self.engine_changed = engine_changed


class CheckpointWriteError(CheckpointError):
  """A checkpoint the disk refused (full, over quota, read-only, failing):
  what was written of it is removed (with several processes, left in
  orbax's temporary folder for the next run's start), and the checkpoints
  before it are as they were.

  Attributes:
    reason: the OS's words for the failure, e.g. "No space left on device".
    latest: the step of the latest complete checkpoint; None if none.
  """

  def __init__(self, message: str, directory: pathlib.Path, step: int, reason: str,
               latest: int | None):
    super().__init__(message, directory, step)
    self.reason, self.latest = reason, latest


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
      item_handlers=ocp.PyTreeCheckpointHandler(type_handler_registry=handler.registry()))


def saved_bytes(engine) -> int:
  """Bytes of the arrays a checkpoint of `engine` writes, before
  compression (zstd saves about 8% of float32 Adam state); reads nothing."""
  target, _ = expected(engine.trained, {})
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(target))


def save(manager: ocp.CheckpointManager, engine, step: int) -> None:
  """Writes `engine.state_dict(streamed=True)` as the checkpoint of `step`,
  and waits for it.

  Waiting matters: the state dict reads the engine's live state span by
  span (jzo.checkpoint.spans: no copy of it on the host), which the next step
  updates in place; and a run that dies after this returns finds the
  checkpoint complete.

  Args:
    manager: from `open_manager`.
    engine: a `ZeroEngine` (anything with `state_dict(streamed=...)`).
    step: the optimizer steps done; later than every checkpoint already there.

  Raises:
    CheckpointError: `step` is not later than the latest checkpoint (orbax
      only adds later steps and would skip it without a word).
    CheckpointWriteError: the disk refused the checkpoint (an OS error:
      no space left, over quota, read-only, I/O error).
  """
  folder = folder_of(manager)
  try:
    disk.write_probe(folder)
  except OSError as e:
    raise _write_failed(manager, step, os.strerror(e.errno) if e.errno else str(e)) from e
  saved = engine.state_dict(streamed=True)
  with disk.orbax_errors_held() as held:
    running = disk.orbax_threads()
    try:
      marked = {checksums.MARK: jax.process_count()}
      written = manager.save(step, args=ocp.args.PyTreeSave(saved, custom_metadata=marked))
      if written:
        manager.wait_until_finished()
    except Exception as e:  # orbax re-raises tensorstore's errors as ValueErrors
      reason = disk.os_error_text(e)
      if reason is None:  # not the disk's: as it came, with orbax's logs
        raise
      # Its threads log the failure on their way out: once, by the error.
      disk.join(disk.orbax_threads() - running, SAVE_THREADS_TIMEOUT_S)
      held.clear()
      raise _write_failed(manager, step, reason) from e
  if not written:
    raise CheckpointError(f"checkpoint {step} in {folder} was not written: the latest there "
                          f"is step {manager.latest_step()}", folder, step)
  release_freed_memory()


def _write_failed(manager: ocp.CheckpointManager, step: int,
                  reason: str) -> CheckpointWriteError:
  """The error of checkpoint `step`, which failed for `reason`, once what
  was written of it is removed (one process alone: with several, another
  may still be writing there)."""
  folder = folder_of(manager)
  if jax.process_count() == 1:
    for partial in folder.glob(f"{step}.orbax-checkpoint-tmp*"):
      shutil.rmtree(partial, ignore_errors=True)  # the rest, if any: the next start's
  try:
    free = f" ({disk.size_text(shutil.disk_usage(folder).free)} free there)"
  except OSError:
    free = ""
  latest = manager.latest_step()
  before = (f"checkpoint {latest} there is intact" if latest is not None
            else "there is no earlier checkpoint")
  return CheckpointWriteError(f"checkpoint {step} could not be written to {folder}: {reason}"
                              f"{free}; {before}", folder, step, reason, latest)


def restore(manager: ocp.CheckpointManager, engine, step: int | None = None) -> int:
  """Loads a complete checkpoint into `engine` with `engine.load_state_dict`.

  Args:
    manager: from `open_manager`.
    engine: a `ZeroEngine` that takes the saved state (the same model, and
      what its `load_state_dict` names); its state is replaced.
    step: the checkpoint to load; None for the latest complete one.

  Returns:
    The step of the checkpoint loaded.

  Raises:
    CheckpointError: the folder has no (such) complete checkpoint; the
      checkpoint cannot be read (damaged files); or it does not fit the
      engine (another model or optimizer: the message names the first
      entries that differ, found before any array is read).
  """
  folder = folder_of(manager)
  step = _complete_step(manager, step)
  try:
    metadata = manager.item_metadata(step)
    _check_sums_kept(metadata, folder, step)
    saved = outline(metadata.tree)
  except Exception as e:  # orbax and tensorstore raise many kinds for a damaged folder
    raise _unreadable(e, folder, step) from e
  # The target is what the engine loads, as shapes: orbax reads numpy arrays
  # into its tree types (optax's named tuples) and refuses other dtypes.
  try:
    target, accepted = expected(engine.trained, saved)
  except ValueError as e:  # a format this engine cannot read
    raise CheckpointError(f"checkpoint {step} in {folder} does not fit this engine: {e}",
                          folder, step) from e
  differences = misfit(saved, accepted)
  if differences:  # before any array is read
    raise CheckpointError(f"checkpoint {step} in {folder} does not fit this engine: "
                          f"{differences}", folder, step)
  args = ocp.checkpoint_utils.construct_restore_args(target)
  if outline(target) != saved:
    # Not strict where a flat leaf's padding is another device count's: orbax
    # cuts or pads it (every other entry has the saved shape, checked above).
    args = jax.tree.map(lambda a: dataclasses.replace(a, strict=False)
                        if hasattr(a, "strict") else a, args)
  for name in streamed_entries(engine.trained, target):
    args[name] = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=SavedLeaf),
                              args[name])
  try:
    restored = manager.restore(step, args=ocp.args.PyTreeRestore(target, restore_args=args))
  except Exception as e:  # orbax and tensorstore raise many kinds for a damaged folder
    raise _unreadable(e, folder, step) from e
  try:
    engine.load_state_dict(restored)
  except StateChanged as e:  # a span that did not read
    raise _unreadable(e.__cause__, folder, step, engine_changed=True) from e
  except ValueError as e:  # refused before any value was written (int8 scales of other codes)
    raise CheckpointError(f"checkpoint {step} in {folder} does not fit this engine: {e}",
                          folder, step) from e
  finally:
    del restored
    release_freed_memory()
  return step


def release_freed_memory() -> bool:
  """Returns the heap memory a save or restore freed to the OS (glibc's
  malloc_trim; False where there is none). glibc keeps what tensorstore's
  threads freed in their arenas: without this, gpt2-4b's save left the
  host's RSS 1.2 GiB higher for the rest of the run, on hosts the
  offloaded state fills."""
  try:
    trim = ctypes.CDLL(None).malloc_trim
  except (OSError, AttributeError):  # not glibc
    return False
  trim(0)
  return True


def restore_readable(manager: ocp.CheckpointManager, engine
                     ) -> tuple[int | None, list[UnreadableCheckpointError]]:
  """Loads the latest complete checkpoint that can be read, going back past
  unreadable ones (a damaged disk, files lost or cut short by hand).

  Args:
    manager: from `open_manager`.
    engine: as for `restore`; its state is replaced only by a checkpoint that reads.

  Returns:
    (the step loaded, None if none could be read; the errors of the
    checkpoints passed over, latest first).

  Raises:
    CheckpointError: the folder has no checkpoint, or one does not fit the
      engine (the earlier ones, of the same run, would not either).
  """
  passed: list[UnreadableCheckpointError] = []
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      return restore(manager, engine, step), passed
    except UnreadableCheckpointError as e:
      passed.append(e)
  if not passed:
    raise CheckpointError(f"no checkpoint in {folder_of(manager)}", folder_of(manager))
  return None, passed


def read_masters(directory: str | pathlib.Path, step: int | None = None, *,
                 lazy: bool = False) -> tuple[int, dict]:
  """Reads the float32 master weights of a checkpoint alone: no engine, no
  device, and none of the optimizer state is read from disk.

  Args:
    directory: the checkpoints folder (what `open_manager` opened); left
      as it is (a missing folder is not created).
    step: the checkpoint to read; None for the latest complete one.
    lazy: give each leaf as a `MasterView`, which reads only what is
      indexed, when it is indexed (a 70B model's masters are 263 GiB).

  Returns:
    (step, masters): numpy float32 leaves (or MasterViews) as saved: in the
    params' shapes with Adam (see the module docstring); with another
    optimizer flat and padded as the devices keep them ((S*k,), or (L, S*k)
    for stage 3's per-layer leaves), which `masters_in_shapes` undoes.

  Raises:
    CheckpointError: no such folder, no (such) complete checkpoint, or an
      unreadable one.
  """
  folder = pathlib.Path(directory).absolute()
  if not folder.is_dir():
    raise CheckpointError(f"no checkpoints folder {folder}", folder, step)
  # The tree handler (which StandardCheckpointHandler wraps: same files) can
  # restore one entry of the saved dict; jzo's type handler checks it.
  with ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(create=False),
                             item_handlers=ocp.PyTreeCheckpointHandler(
                                 type_handler_registry=handler.registry())) as manager:
    step = _complete_step(manager, step)
    try:
      metadata = manager.item_metadata(step)
      _check_sums_kept(metadata, folder, step)
      saved = metadata.tree["master"]
      kind = ocp.RestoreArgs(restore_type=SavedLeaf if lazy else np.ndarray)
      restored = manager.restore(step, args=ocp.args.PyTreeRestore(
          {"master": saved}, restore_args={"master": jax.tree.map(lambda _: kind, saved)},
          partial_restore=True))
    except Exception as e:  # orbax and tensorstore raise many kinds for a damaged folder
      raise _unreadable(e, folder, step) from e
  masters = restored["master"]
  if lazy:
    masters = jax.tree.map(MasterView.of_saved, masters,
                           is_leaf=lambda x: isinstance(x, SavedLeaf))
  return step, masters


def masters_in_shapes(masters: dict, shapes) -> dict:
  """`read_masters`' masters in the params' full shapes.

  Args:
    masters: as saved (full shapes, or flat and padded; arrays or
      MasterViews, of which those flat are read whole).
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
    return np.asarray(layout.unflatten(np.asarray(saved)))
  return jax.tree_util.tree_map_with_path(one, masters, shapes)


def _names(tree) -> set[str]:
  return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}


def folder_of(manager: ocp.CheckpointManager) -> pathlib.Path:
  """The folder `manager` keeps its checkpoints in."""
  return pathlib.Path(str(manager.directory))


def _complete_step(manager: ocp.CheckpointManager, step: int | None) -> int:
  """`step` if it is a complete checkpoint, the latest one if None; else CheckpointError."""
  folder = folder_of(manager)
  if step is None:
    step = manager.latest_step()
    if step is None:
      raise CheckpointError(f"no checkpoint in {folder}", folder)
  elif step not in manager.all_steps():
    raise CheckpointError(f"no checkpoint {step} in {folder} (complete ones: "
                          f"{sorted(manager.all_steps()) or 'none'})", folder, step)
  return step


def _check_sums_kept(metadata, folder: pathlib.Path, step: int) -> None:
  """Refuses checkpoint `step` (its item metadata given) where its save
  wrote checksums and some processes' are gone."""
  wrote = (getattr(metadata, "custom_metadata", None) or {}).get(checksums.MARK)
  found = max((checksums.processes(item) for item in (folder / str(step)).iterdir()
               if item.is_dir()), default=0)
  if wrote and found < wrote:
    raise checksums.ChecksumError(f"its checksums ({checksums.FOLDER}) are missing: of "
                                  f"{wrote} process(es), {found} found")


def _unreadable(e: Exception, folder: pathlib.Path, step: int,
                engine_changed: bool = False) -> UnreadableCheckpointError:
  """The error for a checkpoint that orbax failed to read with `e`."""
  detail = str(e).splitlines()[0] if str(e) else ""
  if len(detail) > _MAX_DETAIL:
    detail = detail[:_MAX_DETAIL] + "..."
  return UnreadableCheckpointError(f"checkpoint {step} in {folder} is unreadable: "
                                  f"{type(e).__name__}: {detail}", folder, step, engine_changed)
