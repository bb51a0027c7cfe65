"""The run folder (`--out`): its config and log, the model's own files
(`model/`: what `python -m jzo.export --format hf` writes back beside the
weights), and its checkpoints: which one to continue from, the damaged and
unfinished ones, and a new run refused where an earlier one lives."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import sys

import jax
from jax.experimental import multihost_utils

import jzo
from jzo import checkpoint
from jzo.parallel import distributed
from jzo.recipe.options import TrainConfig, UserError


# Options a resumed run must share with the saved one: they fix the state's
# shapes, the optimizer's layout, the batch order, or (--deterministic) that
# the steps after the checkpoint are those of the uninterrupted run.
RUN_KEYS = ("model", "init_from", "tokenizer", "data", "seq_len", "batch_size", "micro_batch",
            "seed", "stage", "offload", "precision", "deterministic")


def check_same_run(cfg: TrainConfig, out: pathlib.Path) -> None:
  """Refuses to continue the run in `out` (its config.json) with other RUN_KEYS
  (one missing there, from a run made before it existed, had its default)."""
  saved_cfg = json.loads((out / "config.json").read_text())
  defaults = TrainConfig()
  for key in RUN_KEYS:
    if saved_cfg.get(key, getattr(defaults, key)) != getattr(cfg, key):
      raise UserError(f"checkpoint in {out} was made with --{key.replace('_', '-')} "
                      f"{saved_cfg.get(key)!r}, not {getattr(cfg, key)!r}")


def with_run_options(cfg: TrainConfig, out: pathlib.Path) -> TrainConfig:
  """`cfg` with the run's own values (its config.json in `out`) of the
  RUN_KEYS and --devices left at their defaults: --sample needs no training
  flag again. A flag given with another value than the run's is left for
  check_same_run to refuse."""
  try:
    saved = json.loads((out / "config.json").read_text())
  except (OSError, ValueError):
    return cfg  # no run here: the checks that follow say so
  defaults = TrainConfig()
  taken = {key: saved[key] for key in (*RUN_KEYS, "devices")
           if key in saved and getattr(cfg, key) == getattr(defaults, key)}
  return dataclasses.replace(cfg, **taken)


class EngineChanged(Exception):
  """No checkpoint could be read, and one failed while its values were
  being written into the engine: to start at step 0, build a new one."""


def restore_run(manager, engine: jzo.ZeroEngine, cfg: TrainConfig, out: pathlib.Path) -> int:
  """Loads the run's last complete checkpoint that reads into `engine`;
  returns its step (0: none, or with --resume --fresh-start-ok none readable;
  EngineChanged then if reading one changed the engine's state).

  An unreadable checkpoint (damaged files) is passed over for an earlier
  one, with a warning; to train on, the passed-over ones move to
  `damaged_folder(out)` (later saves would collide with their steps).
  Refused when none reads, unless --fresh-start-ok; nothing is moved then.
  `manager` is `checkpoint.open_manager(out / "checkpoints")`.
  """
  if manager.latest_step() is None:
    return 0
  check_same_run(cfg, out)  # first: it names the option, where the engine sees only shapes
  try:
    step, unreadable = checkpoint.restore_readable(manager, engine)
  except checkpoint.CheckpointError as e:  # one of another model
    raise UserError(str(e)) from e
  folder = out.absolute() / "checkpoints"
  if step is None and not (cfg.resume and cfg.fresh_start_ok):
    flag = "--sample" if cfg.sample else "--resume"
    hint = "" if cfg.sample else (f" (to start at step 0, with them moved to "
                                  f"{damaged_folder(out)}, add --fresh-start-ok)")
    raise UserError(f"{flag}: no checkpoint can be read: " + "; ".join(map(str, unreadable))
                    + hint)
  primary = distributed.is_primary()  # the one that moves folders and prints
  for e in unreadable:
    if cfg.sample and primary:
      print(f"warning: {e}", file=sys.stderr)
    elif primary:
      print(f"warning: {e}; moved to {set_aside(out, e.step)}", file=sys.stderr)
  if unreadable and not cfg.sample:
    barrier("jzo: unreadable checkpoints set aside")
    manager.reload()
  if step is None:
    if primary:
      print(f"--resume: no checkpoint in {folder} can be read: starting at step 0")
    if any(e.engine_changed for e in unreadable):
      raise EngineChanged()
    return 0
  if primary:
    print(f"{'sampling' if cfg.sample else 'resuming'} from checkpoint {step} in {folder}")
  return step


def save_checkpoint(manager, engine: jzo.ZeroEngine, step: int) -> None:
  """`checkpoint.save`; one the disk refuses (full, over quota, read-only,
  failing) closes the engine and stops the run with a UserError naming the
  reason and the checkpoint to continue from."""
  try:
    checkpoint.save(manager, engine, step)
  except checkpoint.CheckpointWriteError as e:
    engine.close()
    then = ("--resume continues from it" if e.latest is not None
            else "--resume --fresh-start-ok starts the run again at step 0")
    raise UserError(f"{e}: {then}") from e


def damaged_folder(out: pathlib.Path) -> pathlib.Path:
  """Where unreadable checkpoints go when a run trains on without them."""
  return out.absolute() / "checkpoints-unreadable"


def set_aside(out: pathlib.Path, step: int) -> pathlib.Path:
  """Moves checkpoint `step` into `damaged_folder(out)`; returns where it went."""
  aside, n = damaged_folder(out) / str(step), 1
  while aside.exists():  # the same step unreadable again
    n += 1
    aside = damaged_folder(out) / f"{step}-{n}"
  aside.parent.mkdir(exist_ok=True)
  shutil.move(out / "checkpoints" / str(step), aside)
  return aside


def remove_partial_checkpoints(out: pathlib.Path) -> None:
  """Deletes what a run stopped while writing a checkpoint left: orbax's
  temporary folders, never read (a checkpoint is renamed into place whole),
  but as large as a checkpoint each."""
  partial = sorted((out / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
  for path in partial:
    shutil.rmtree(path)
  if partial:
    print(f"removed {len(partial)} unfinished checkpoint(s) of a run stopped while writing: "
          + ", ".join(p.name for p in partial))


def latest_checkpoint(out: pathlib.Path) -> int | None:
  """The step of the last complete checkpoint in `out`, None if none (creating nothing)."""
  if not (out / "checkpoints").is_dir():
    return None
  with checkpoint.open_manager(out / "checkpoints") as manager:
    return manager.latest_step()


def check_disk_for_checkpoints(cfg: TrainConfig, manager, engine: jzo.ZeroEngine,
                               first: int) -> None:
  """Refuses a run whose checkpoints will not fit on their disk, before its
  first step rather than at its first save: each takes about the optimizer
  state's bytes, and the run holds up to --keep-checkpoints of them plus
  the one a save writes before the oldest goes (fewer if it saves fewer).
  With --checkpoint-every 0 (a checkpoint only on a signal) it warns
  instead. `manager`: the run's (jzo.checkpoint.open_manager); `first`:
  the step the run starts at."""
  folder = checkpoint.folder_of(manager)
  each = checkpoint.saved_bytes(engine)
  free = shutil.disk_usage(folder).free
  gib = lambda n: f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
  if not cfg.checkpoint_every:
    if free < each and distributed.is_primary():
      print(f"jzo: warning: a checkpoint takes up to {gib(each)} and {folder} has {gib(free)} "
            "free: one written on SIGINT or SIGTERM would not fit", file=sys.stderr)
    return
  saves = cfg.steps // cfg.checkpoint_every - first // cfg.checkpoint_every \
      + (cfg.steps % cfg.checkpoint_every != 0)
  kept = len(manager.all_steps())
  # The first save adds one to those there; then orbax keeps --keep-checkpoints.
  at_once = min(max(cfg.keep_checkpoints, kept) + 1, kept + saves)
  if (at_once - kept) * each > free:  # those there already take their room
    raise UserError(
        f"checkpoints will not fit in {folder}: each takes up to {gib(each)} (the optimizer "
        f"state; zstd saves about 8%), and this run holds up to {at_once} at once (--keep-"
        f"checkpoints {cfg.keep_checkpoints}, and the one a save writes before the oldest "
        f"goes): {at_once - kept} more, {gib((at_once - kept) * each)}, against {gib(free)} "
        "free. Free some disk, point --out at a larger one, or pass --keep-checkpoints 1 or "
        "--checkpoint-every 0 (a checkpoint only on SIGINT or SIGTERM)")


def check_checkpoint_to_continue(cfg: TrainConfig, out: pathlib.Path) -> None:
  """Refuses --resume and --sample with no complete checkpoint in `out`
  (--resume --fresh-start-ok starts at step 0 instead, and says so), before
  anything is built or written: a typo in --out must cost neither the
  engine's build nor a run from scratch."""
  if not (cfg.resume or cfg.sample) or latest_checkpoint(out) is not None:
    return
  where = out.absolute() / "checkpoints"
  if cfg.sample:
    raise UserError(f"--sample: no complete checkpoint in {where}")
  if not cfg.fresh_start_ok:
    raise UserError(f"--resume: no complete checkpoint in {where} (to start at step 0 then, "
                    "add --fresh-start-ok)")
  print(f"--resume: no checkpoint in {where} yet: starting at step 0")


def check_no_earlier_run(cfg: TrainConfig, out: pathlib.Path) -> None:
  """Refuses a new run (no --resume or --sample) in a folder holding a run's
  log or checkpoints: it would replace the log, then fail at its first
  checkpoint behind the earlier run's latest."""
  if cfg.resume or cfg.sample:
    return
  held = [name for name in ("metrics.jsonl", "checkpoints")
          if (out / name).is_file() or any((out / name).glob("*"))]
  if held:
    raise UserError(f"--out {out.absolute()} holds an earlier run ({', '.join(held)}): "
                    "--resume continues it; a new run needs another --out")


def start_log(cfg: TrainConfig, out: pathlib.Path, first: int) -> list[dict]:
  """Writes config.json and metrics.jsonl as of step `first`; returns the log so far.

  The log keeps its lines up to the checkpoint (the train loop writes a
  step's line before the step's checkpoint, so they are all there) and
  drops the later ones, which the run writes again; a last line cut short
  by a kill is dropped with them. Both files are replaced whole, so a kill
  here leaves the old ones.
  """
  write_whole(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
  history = []
  if first and (out / "metrics.jsonl").exists():
    for line in (out / "metrics.jsonl").read_text().splitlines():
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue  # cut short: a step after the checkpoint's
      if record["step"] <= first:
        history.append(record)
  write_whole(out / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))
  return history


def write_whole(path: pathlib.Path, text: str) -> None:
  """Replaces `path` with `text` in one rename: the file is the old or the new, never half."""
  part = path.with_name(path.name + ".part")
  part.write_text(text)
  os.replace(part, path)



def barrier(name: str) -> None:
  """Waits until every process reaches the barrier of this name (one process: returns)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)



# Files of a Hugging Face folder that belong with its weights: the tokenizer's
# and the generation defaults.
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "chat_template.jinja", "tokenizer.model", "generation_config.json")


def model_folder(out: pathlib.Path) -> pathlib.Path:
  """Where a run keeps its model's config.json and tokenizer files."""
  return out / "model"


def keep_model_files(out: pathlib.Path, hf_config: dict | None, sources: list[str]) -> None:
  """Writes the model's Hugging Face config.json (None: a family without
  one) and copies MODEL_FILES from `sources` (folders, the first that has a
  file wins) into `model_folder(out)`, so that an export needs neither the
  checkpoint it started from nor its tokenizer to be still there."""
  folder = model_folder(out)
  folder.mkdir(exist_ok=True)
  if hf_config is not None:
    write_whole(folder / "config.json", json.dumps(hf_config, indent=2) + "\n")
  for name in MODEL_FILES:
    found = [pathlib.Path(s) / name for s in sources if (pathlib.Path(s) / name).is_file()]
    if found:
      shutil.copyfile(found[0], folder / name)
