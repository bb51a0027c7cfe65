"""`python -m jzo.export --out DIR`: a run's trained weights, loadable without jzo's engine.

What DeepSpeed's zero_to_fp32.py is to DeepSpeed: it reads the float32 master
weights of a checkpoint of `python -m jzo.train` (by default the latest
complete one in `--run`'s checkpoints folder), whatever stage, placement and
device count trained them, on the CPU alone, and writes them to DIR, float32
or `--dtype bfloat16`.

By default (`--format hf`) DIR is a Hugging Face folder that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads as it is:
config.json, model.safetensors (or shards with model.safetensors.index.json)
and a tokenizer, whatever model the run trained:

  a Hugging Face family (Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Phi-3,
                 Gemma 2/3: fine-tuned from a Hugging Face checkpoint or
                 trained from a preset) in its own format (jzo.models.hf)
  jzo's GPT      as transformers' GPT-2, GPT2LMHeadModel (jzo.models.gpt2_hf,
                 which reads it back too: read_config, load_params)

A Hugging Face family's masters are read as its tensors are cut out of them
(jzo.checkpoint.read_masters(lazy=True)): a saved chunk at a time, never the
whole float32 model on the host. A GPT's are read whole.

The tokenizer is the one the run read its data with (--tokenizer's or
--init-from's files, copied); a run on bytes (no tokenizer) gets a
tokenizer.json whose ids are the bytes (jzo.recipe.tokens.byte_level_tokenizer),
so that transformers' pipeline and `python -m jzo.generate --hf DIR` read and
write text; a run on token ids (--data *.bin) has none to give.

`--format jzo` writes a GPT run in jzo's own form instead:

  model.safetensors  the params with flat names ("blocks.qkv.kernel"; the
                     blocks' leaves carry a leading layer axis), float32 or
                     `--dtype bfloat16`; metadata "config" (the JSON below)
                     and "step"
  nnx_state/         an orbax checkpoint of the `gpt.GPT` module's state as
                     `nnx.to_pure_dict` gives it (the form that does not
                     depend on flax's Variable layout), which is the params
                     dict: `gpt.init_params` makes it so
  config.json        the `gpt.GPTConfig`

Loading them (`jzo/models/gpt.py` is the model; jzo's engine plays no part):

    import json, pathlib
    import orbax.checkpoint as ocp
    from flax import nnx, traverse_util
    from safetensors.numpy import load_file
    from jzo.models import gpt

    config = gpt.GPTConfig(**json.loads(pathlib.Path("DIR/config.json").read_text()))

    params = traverse_util.unflatten_dict(load_file("DIR/model.safetensors"), sep=".")
    logits = gpt.forward(config, params, tokens)    # tokens: int (B, T)

    graphdef, state = nnx.split(nnx.eval_shape(lambda: gpt.GPT(config, rngs=nnx.Rngs(0))))
    with ocp.StandardCheckpointer() as checkpointer:  # orbax takes absolute paths
      saved = checkpointer.restore(pathlib.Path("DIR/nnx_state").absolute())
    nnx.replace_by_pure_dict(state, saved)
    model = nnx.merge(graphdef, state)
    logits = model(tokens)

The export is written to a temporary folder beside DIR and renamed into
place at the end, so DIR never holds half an export.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import pathlib
import shutil
import sys
import uuid
from typing import Literal

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import safetensors.numpy
from flax import traverse_util

from jzo import checkpoint
from jzo.recipe import config as config_lib
from jzo.models import gpt, gpt2_hf, hf
from jzo.recipe import runs, tokens

FORMATS = ("hf", "jzo")

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


class ExportError(ValueError):
  """A run, checkpoint or output folder that cannot be exported from or to."""


@dataclasses.dataclass(frozen=True)
class Exported:
  """What `export` wrote."""
  step: int  # the checkpoint's step (optimizer steps done)
  safetensors: pathlib.Path  # model.safetensors (hf with shards: model.safetensors.index.json)
  nnx_state: pathlib.Path | None  # the orbax checkpoint of the gpt.GPT state (hf: None)
  config: pathlib.Path  # config.json: Hugging Face's (jzo: the GPTConfig)
  tokenizer: pathlib.Path | None = None  # tokenizer.json (None: jzo, or a run that has none)


def export(run_dir: str | pathlib.Path, out_dir: str | pathlib.Path, step: int | None = None,
           dtype: str = "float32", overwrite: bool = False, format: str = "hf") -> Exported:
  """Writes the weights of one of a run's checkpoints to `out_dir` (see the module docstring).

  The work is the host's, but orbax starts JAX's backends (it asks for the
  process layout): beside a GPU training run, set JAX_PLATFORMS=cpu first,
  as the command line does.

  Args:
    run_dir: the training run's folder (the recipe's --out).
    out_dir: where to write; created, or replaced if it is an empty folder
      (or any folder, with `overwrite`).
    step: the checkpoint; None for the latest complete one.
    dtype: of the weights written: "float32" (the masters as they are) or
      "bfloat16" (rounded to nearest even).
    overwrite: replace an `out_dir` that holds files.
    format: "hf" (a Hugging Face folder: any run) or "jzo" (jzo's own form of a
      GPT run).

  Returns:
    The step exported and the paths written.

  Raises:
    ExportError: no such run or checkpoint, an unreadable one, one that does
      not fit the run's model, an unknown dtype or format, "jzo" for a run of
      a Hugging Face family, a tokenizer the run kept that does not read, or an
      `out_dir` in the way.
  """
  if dtype not in DTYPES:
    raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
  if format not in FORMATS:
    raise ExportError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
  run, out = pathlib.Path(run_dir).absolute(), pathlib.Path(out_dir).absolute()
  _check_out(out, overwrite)
  hf_config = runs.model_folder(run) / "config.json"
  hf_run = hf_config.is_file()  # a GPT run keeps no Hugging Face config
  if format == "jzo" and hf_run:
    raise ExportError(f"{run} trained a {_hf_model(hf_config).model_type} model: jzo's own form "
                      "is a GPT's; --format hf (the default) writes it in Hugging Face's format")
  # A Hugging Face family's tensors (format hf, the only one it has) are cut
  # out of the masters a layer at a time: read as they are cut, never whole.
  step, config, params = read_run(run, step, hf_config if hf_run else None, lazy=hf_run)
  if format == "hf":
    return _staged_hf(out, run, step, config, params, dtype)
  params = jax.tree.map(lambda x: x.astype(DTYPES[dtype], copy=False), params)
  _staged(out, lambda staging: write(staging, step, config, params))
  return Exported(step, out / "model.safetensors", out / "nnx_state", out / "config.json")


def export_engine(engine, run_dir: str | pathlib.Path, out_dir: str | pathlib.Path, step: int,
                  config, dtype: str = "bfloat16") -> Exported:
  """Writes the weights of a run's live engine to `out_dir` as a Hugging
  Face folder, as `export` does from a checkpoint: cut a layer at a time
  from the masters where they live (jzo.checkpoint.live_masters), so that
  neither a checkpoint nor a float32 copy of the model is needed (a 70B
  model's checkpoint is 400 GB). What `python -m jzo.train --export DIR`
  does at the end of a run.

  Args:
    engine: the run's ZeroEngine (one process, Adam), after its last step.
    run_dir: the run's folder (the files it kept beside its model).
    step: the steps it trained (`Exported.step`).
    config: the model's config (gpt.GPTConfig or a Hugging Face family's).

  Raises:
    ExportError: an `out_dir` in the way, several processes, or an
      optimizer other than Adam.
  """
  run, out = pathlib.Path(run_dir).absolute(), pathlib.Path(out_dir).absolute()
  _check_out(out, overwrite=None)
  try:
    params = checkpoint.live_masters(engine)
  except ValueError as e:
    raise ExportError(str(e)) from e
  if isinstance(config, gpt.GPTConfig):  # jzo.models.gpt2_hf reads a GPT's leaves whole
    params = jax.tree.map(np.asarray, params)
  return _staged_hf(out, run, step, config, params, dtype)


def _staged_hf(out: pathlib.Path, run: pathlib.Path, step: int, config, params,
               dtype: str) -> Exported:
  """`write_hf` into `out`, through a folder beside it; what it wrote."""
  _staged(out, lambda staging: write_hf(staging, run, config, params, dtype))
  index, tokenizer = out / hf.INDEX, out / "tokenizer.json"
  return Exported(step, index if index.exists() else out / hf.SINGLE, None, out / "config.json",
                  tokenizer if tokenizer.exists() else None)


def _staged(out: pathlib.Path, write_into) -> None:
  """Calls write_into(a new folder beside `out`), then puts that folder in
  `out`'s place: `out` never holds half an export."""
  out.parent.mkdir(parents=True, exist_ok=True)
  staging = _new_folder_beside(out, "tmp")
  try:
    write_into(staging)
    _replace(out, staging)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def load_run(run: str | pathlib.Path, step: int | None = None):
  """(step, model config, float32 params in full shapes, numpy) of a run's
  checkpoint (None: the latest complete one), of whichever family it trained.

  Raises:
    ExportError: no such run or checkpoint, or one that does not read or fit.
  """
  run = pathlib.Path(run)
  hf_config = runs.model_folder(run) / "config.json"
  return read_run(run, step, hf_config if hf_config.is_file() else None)


def read_run(run: pathlib.Path, step: int | None, hf_config: pathlib.Path | None = None,
             lazy: bool = False):
  """(step, model config, float32 params in full shapes, numpy) of a run's
  checkpoint: a GPT's, or with `hf_config` (the run's model/config.json) the
  model of a Hugging Face family it names. `lazy`: the params are
  jzo.checkpoint's MasterViews, read when indexed."""
  if not run.is_dir():
    raise ExportError(f"no run folder {run}" + (" (a file)" if run.exists() else ""))
  try:
    step, masters = checkpoint.read_masters(run / "checkpoints", step, lazy=lazy)
  except checkpoint.CheckpointError as e:
    raise ExportError(str(e)) from e
  config = model_config(run, masters) if hf_config is None else _hf_model(hf_config)
  family = gpt if hf_config is None else hf.family(config)
  # The key is made inside the trace: no device is touched.
  shapes = jax.eval_shape(lambda: family.init_params(config, jax.random.key(0)))
  try:
    return step, config, checkpoint.masters_in_shapes(masters, shapes)
  except ValueError as e:
    raise ExportError(f"checkpoint {step} in {run / 'checkpoints'} does not fit its run's "
                      f"model: {e}") from e


def model_config(run: pathlib.Path, masters: dict) -> gpt.GPTConfig:
  """The GPTConfig a run trained: the preset and remat of its config.json,
  the vocabulary and context from the saved embeddings (the recipe fits them
  to the data and --seq-len)."""
  saved = _run_config(run)
  try:
    preset = gpt.PRESETS[saved["model"] or "tiny"]  # None: the recipe's default
    remat = saved["remat"]
  except KeyError as e:
    raise ExportError(f"{run / 'config.json'} is not the config of a jzo.train run: "
                      f"KeyError: {e}") from e
  D = preset.d_model
  # wte holds V x D values, wpe S x D (saved flat, fewer than the device
  # count of padding besides).
  return dataclasses.replace(preset, vocab_size=masters["wte"].size // D,
                             seq_len=masters["wpe"].size // D, remat=remat)


def _run_config(run: pathlib.Path) -> dict:
  """The options a run was trained with (its config.json)."""
  path = run / "config.json"
  try:
    saved = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise ExportError(f"{path} is not the config of a jzo.train run: "
                      f"{type(e).__name__}: {e}") from e
  if not isinstance(saved, dict):
    raise ExportError(f"{path} is not the config of a jzo.train run: a {type(saved).__name__}")
  return saved


def _hf_model(path: pathlib.Path):
  """The config (its family's) of a run's model/config.json."""
  try:
    return hf.config_from_hf(json.loads(path.read_text()))
  except (OSError, ValueError) as e:
    raise ExportError(f"{path} is not a model config jzo reads: {e}") from e


def write_hf(folder: pathlib.Path, run: pathlib.Path, config, params: dict,
             dtype: str) -> None:
  """Writes a Hugging Face folder: config.json and the weights in `dtype`
  (jzo.models.hf for a Hugging Face family, jzo.models.gpt2_hf for a GPT), the
  files the run kept beside its model (the tokenizer's), or for a run on
  bytes the byte-level tokenizer."""
  kept = runs.model_folder(run)
  tokenizer = run_tokenizer(run)
  byte_level = tokenizer is not None and not (kept / "tokenizer.json").is_file()
  if isinstance(config, gpt.GPTConfig):
    bos, eos = (tokenizer.bos_id, tokenizer.eos_id) if tokenizer else (None, None)
    gpt2_hf.save_pretrained(str(folder), config, params, dtype, bos_token_id=bos,
                            eos_token_id=eos)
  else:
    if byte_level:  # a preset's bos and eos are ids of its own vocabulary, not bytes
      config = dataclasses.replace(config, bos_token_id=None, eos_token_id=None)
    hf.save_pretrained(str(folder), config, params, dtype=dtype)
  for name in runs.MODEL_FILES:
    if (kept / name).is_file():
      shutil.copyfile(kept / name, folder / name)
  if byte_level:
    tokens.save_tokenizer(tokenizer, folder)


def run_tokenizer(run: str | pathlib.Path) -> tokens.Tokenizer | None:
  """The tokenizer of a run's token ids: the one it kept beside its model
  (--tokenizer's or --init-from's), the byte-level one for a run on bytes,
  None for a run on the token ids of a .bin file (whose tokenizer it does
  not know).

  Raises:
    ExportError: the kept tokenizer does not read, or the run's config.json
      is missing or not JSON (where that decides).
  """
  run = pathlib.Path(run)
  kept = runs.model_folder(run)
  if (kept / "tokenizer.json").is_file():
    try:
      return tokens.load_tokenizer(kept)
    except ValueError as e:
      raise ExportError(f"the tokenizer the run kept in {kept} does not read: {e}") from e
  return tokens.byte_level_tokenizer() if _on_bytes(_run_config(run)) else None


def _on_bytes(saved: dict) -> bool:
  """Whether a run's config.json (`saved`) says it trained on bytes: no tokenizer, and no
  token file (.bin) as its data."""
  return (not saved.get("tokenizer") and not saved.get("init_from")
          and not str(saved.get("data") or "").endswith(".bin"))


def write(folder: pathlib.Path, step: int, config: gpt.GPTConfig, params: dict) -> None:
  """Writes model.safetensors, nnx_state/ and config.json into `folder` (which exists)."""
  config_json = json.dumps(dataclasses.asdict(config), indent=2)
  (folder / "config.json").write_text(config_json + "\n")
  flat = {name: np.ascontiguousarray(x)
          for name, x in traverse_util.flatten_dict(params, sep=".").items()}
  safetensors.numpy.save_file(flat, folder / "model.safetensors",
                              metadata={"config": config_json, "step": str(step)})
  # safetensors creates its file readable by its owner alone; give it the
  # mode any other file gets here.
  shutil.copymode(folder / "config.json", folder / "model.safetensors")
  with ocp.StandardCheckpointer() as checkpointer:  # leaving waits for the write
    checkpointer.save(folder / "nnx_state", params)


def load_safetensors(path: str | pathlib.Path) -> tuple[gpt.GPTConfig, dict]:
  """(model config, the params dict `gpt.forward` takes) from an exported
  model.safetensors alone."""
  with safetensors.safe_open(path, "np") as f:
    config = gpt.GPTConfig(**json.loads(f.metadata()["config"]))
    return config, traverse_util.unflatten_dict({k: f.get_tensor(k) for k in f.keys()}, sep=".")


def _check_out(out: pathlib.Path, overwrite: bool | None) -> None:
  """Refuses an output path that is a file, or a folder with files unless
  `overwrite` (None: no overwriting is offered)."""
  if out.exists() and not out.is_dir():
    raise ExportError(f"output {out} is a file, not a folder")
  if out.is_dir() and any(out.iterdir()) and not overwrite:
    raise ExportError(f"output folder {out} is not empty"
                      + (" (overwrite: --overwrite)" if overwrite is not None else ""))


def _replace(out: pathlib.Path, staging: pathlib.Path) -> None:
  """Puts the finished `staging` folder at `out`, replacing what is there."""
  if not out.exists():
    staging.rename(out)
    return
  # Moved aside first: a crash between the renames leaves the old export
  # whole beside `out`, never a mix of both.
  old = _new_folder_beside(out, "old")
  out.rename(old / out.name)
  staging.rename(out)
  shutil.rmtree(old)


def _new_folder_beside(out: pathlib.Path, kind: str) -> pathlib.Path:
  """A new hidden folder in `out`'s parent (same file system: renames are
  atomic), with the permissions the umask gives (tempfile.mkdtemp's are the
  owner's alone)."""
  folder = out.parent / f".{out.name}.{kind}-{uuid.uuid4().hex[:12]}"
  folder.mkdir()
  return folder


@dataclasses.dataclass(frozen=True)
class ExportConfig:
  """Export a jzo.train run's weights as a Hugging Face folder that transformers loads (the
  default: Llama, Mistral and Qwen runs in their own format, jzo's GPT as GPT-2, with the
  run's tokenizer, a byte-level one for a run on bytes), or with --format jzo a GPT run as
  safetensors and an orbax checkpoint of gpt.GPT."""

  out: str
  """folder to write (hf: config.json, model.safetensors, the tokenizer; jzo: its own form)"""
  run: str = "runs/latest"
  """the training run's folder (jzo.train's --out)"""
  step: int | None = None
  """the checkpoint to export (default: the latest complete one)"""
  dtype: Literal["float32", "bfloat16"] = "float32"
  """dtype of the weights written: the float32 masters, or rounded to bfloat16"""
  overwrite: bool = False
  """replace --out if it holds files"""
  format: Literal["hf", "jzo"] = "hf"
  """hf: Hugging Face's format, any run (a GPT as GPT-2); jzo: a GPT run in jzo's own form"""


def main(argv: list[str] | None = None) -> int:
  cfg = config_lib.parse(ExportConfig, argv, description=inspect.cleandoc(ExportConfig.__doc__),
                         prog="python -m jzo.export")
  # Reading and writing weights needs no accelerator: leave a GPU (perhaps
  # training the next run) alone.
  jax.config.update("jax_platforms", "cpu")
  try:
    done = export(cfg.run, cfg.out, cfg.step, cfg.dtype, cfg.overwrite, cfg.format)
  except ExportError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  written = [p for p in (done.safetensors, done.nnx_state, done.config, done.tokenizer)
             if p is not None]
  print(f"exported step {done.step} of {pathlib.Path(cfg.run).absolute()}: "
        + ", ".join(map(str, written)))
  if cfg.format == "hf" and done.tokenizer is None:
    print(f"warning: the run knows no tokenizer of its token ids (--data *.bin), so {cfg.out} "
          "has none: copy that tokenizer's files into it to read and write text",
          file=sys.stderr)
  return 0

