"""`python -m jzo.export --out DIR`: a run's trained weights, loadable without jzo's engine.

`--format hf` (a run of the Llama family, fine-tuned from a Hugging Face
checkpoint or trained from a preset) writes DIR as a Hugging Face folder:
config.json, model.safetensors (or shards with model.safetensors.index.json)
and the tokenizer's files the run started from, which
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads as it is.
The rest of this docstring is `--format jzo`, the form of jzo's own GPTs.

What DeepSpeed's zero_to_fp32.py is to DeepSpeed: it reads the float32 master
weights of a checkpoint of `python -m jzo.train` (by default the latest
complete one in `--run`'s checkpoints folder), whatever stage, placement and
device count trained them, on the CPU alone, and writes to DIR:

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
from jzo.models import gpt, hf, llama
from jzo.recipe import runs

FORMATS = ("jzo", "hf")

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


class ExportError(ValueError):
  """A run, checkpoint or output folder that cannot be exported from or to."""


@dataclasses.dataclass(frozen=True)
class Exported:
  """What `export` wrote."""
  step: int  # the checkpoint's step (optimizer steps done)
  safetensors: pathlib.Path  # model.safetensors (hf with shards: model.safetensors.index.json)
  nnx_state: pathlib.Path | None  # the orbax checkpoint of the gpt.GPT state (hf: None)
  config: pathlib.Path  # config.json: the GPTConfig (hf: Hugging Face's)


def export(run_dir: str | pathlib.Path, out_dir: str | pathlib.Path, step: int | None = None,
           dtype: str = "float32", overwrite: bool = False, format: str = "jzo") -> Exported:
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
    format: "jzo" (a GPT run) or "hf" (a run of the Llama family).

  Returns:
    The step exported and the paths written.

  Raises:
    ExportError: no such run or checkpoint, an unreadable one, one that does
      not fit the run's model, an unknown dtype, or an `out_dir` in the way.
  """
  if dtype not in DTYPES:
    raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
  if format not in FORMATS:
    raise ExportError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
  run, out = pathlib.Path(run_dir).absolute(), pathlib.Path(out_dir).absolute()
  _check_out(out, overwrite)
  hf_config = runs.model_folder(run) / "config.json"
  if format == "hf" and not hf_config.is_file():
    raise ExportError(f"{run} trained none of the Llama family (no {hf_config}): a GPT of "
                      "jzo's own exports with --format jzo")
  if format == "jzo" and hf_config.is_file():
    raise ExportError(f"{run} trained a model of the Llama family: --format hf writes it in "
                      "Hugging Face's format")
  step, config, params = read_run(run, step, hf_config if format == "hf" else None)
  if format == "jzo":
    params = jax.tree.map(lambda x: x.astype(DTYPES[dtype], copy=False), params)
  out.parent.mkdir(parents=True, exist_ok=True)
  staging = _new_folder_beside(out, "tmp")
  try:
    if format == "hf":
      write_hf(staging, run, config, params, dtype)
    else:
      write(staging, step, config, params)
    _replace(out, staging)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  if format == "hf":
    index = out / "model.safetensors.index.json"
    return Exported(step, index if index.exists() else out / "model.safetensors", None,
                    out / "config.json")
  return Exported(step, out / "model.safetensors", out / "nnx_state", out / "config.json")


def read_run(run: pathlib.Path, step: int | None, hf_config: pathlib.Path | None = None):
  """(step, model config, float32 params in full shapes, numpy) of a run's
  checkpoint: a GPT's, or with `hf_config` (the run's model/config.json) a
  Llama-family model's."""
  if not run.is_dir():
    raise ExportError(f"no run folder {run}" + (" (a file)" if run.exists() else ""))
  try:
    step, masters = checkpoint.read_masters(run / "checkpoints", step)
  except checkpoint.CheckpointError as e:
    raise ExportError(str(e)) from e
  family = gpt if hf_config is None else llama
  config = model_config(run, masters) if hf_config is None else _hf_model(hf_config)
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
  path = run / "config.json"
  try:
    saved = json.loads(path.read_text())
    preset = gpt.PRESETS[saved["model"] or "tiny"]  # None: the recipe's default
    remat = saved["remat"]
  except (OSError, ValueError, KeyError) as e:
    raise ExportError(f"{path} is not the config of a jzo.train run: "
                      f"{type(e).__name__}: {e}") from e
  D = preset.d_model
  # wte holds V x D values, wpe S x D (saved flat, fewer than the device
  # count of padding besides).
  return dataclasses.replace(preset, vocab_size=masters["wte"].size // D,
                             seq_len=masters["wpe"].size // D, remat=remat)


def _hf_model(path: pathlib.Path) -> llama.LlamaConfig:
  """The LlamaConfig of a run's model/config.json."""
  try:
    return llama.LlamaConfig.from_hf(json.loads(path.read_text()))
  except (OSError, ValueError) as e:
    raise ExportError(f"{path} is not a model config jzo reads: {e}") from e


def write_hf(folder: pathlib.Path, run: pathlib.Path, config: llama.LlamaConfig, params: dict,
             dtype: str) -> None:
  """Writes a Hugging Face folder: config.json and the weights in `dtype`
  (jzo.models.hf), and the files the run kept beside its model (the tokenizer's)."""
  hf.save_pretrained(str(folder), config, params, dtype=dtype)
  kept = runs.model_folder(run)
  for name in runs.MODEL_FILES:
    if (kept / name).is_file():
      shutil.copyfile(kept / name, folder / name)


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


def _check_out(out: pathlib.Path, overwrite: bool) -> None:
  """Refuses an output path that is a file, or a folder with files unless `overwrite`."""
  if out.exists() and not out.is_dir():
    raise ExportError(f"output {out} is a file, not a folder")
  if out.is_dir() and any(out.iterdir()) and not overwrite:
    raise ExportError(f"output folder {out} is not empty (overwrite: --overwrite)")


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
  """Export a jzo.train run's weights: a Hugging Face folder (--format hf), or safetensors and
  an orbax checkpoint of gpt.GPT."""

  out: str
  """folder to write (model.safetensors, nnx_state/, config.json)"""
  run: str = "runs/latest"
  """the training run's folder (jzo.train's --out)"""
  step: int | None = None
  """the checkpoint to export (default: the latest complete one)"""
  dtype: Literal["float32", "bfloat16"] = "float32"
  """dtype of the weights written: the float32 masters, or rounded to bfloat16"""
  overwrite: bool = False
  """replace --out if it holds files"""
  format: Literal["jzo", "hf"] = "jzo"
  """jzo (a GPT run: safetensors, nnx_state, config.json) or hf (Llama family: Hugging Face)"""


def main(argv: list[str] | None = None) -> int:
  cfg = config_lib.parse(ExportConfig, argv, description=ExportConfig.__doc__,
                         prog="python -m jzo.export")
  # Reading and writing weights needs no accelerator: leave a GPU (perhaps
  # training the next run) alone.
  jax.config.update("jax_platforms", "cpu")
  try:
    done = export(cfg.run, cfg.out, cfg.step, cfg.dtype, cfg.overwrite, cfg.format)
  except ExportError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  written = [p for p in (done.safetensors, done.nnx_state, done.config) if p is not None]
  print(f"exported step {done.step} of {pathlib.Path(cfg.run).absolute()}: "
        + ", ".join(map(str, written)))
  return 0

