"""Hugging Face checkpoints in and out, for every family that has a Hugging
Face form (jzo.models.llama_hf: Llama, Mistral, Qwen2/3, Phi-3/4, Qwen3-MoE,
Mixtral; jzo.models.gemma_hf: Gemma 2 and 3), one leaf at a time.

`param_sources(folder)` reads a folder that transformers' `save_pretrained`
wrote (config.json and model.safetensors, or shards listed by
model.safetensors.index.json) as its family's config and a tree of
`jzo.HostLeaf` shaped like the family's `init_params`: nothing is read until
the engine draws a leaf, and each leaf is then assembled from its per-layer
tensors, memory-mapped from the files, in the files' dtype, so the host never
holds more than one leaf. `save_pretrained(folder, config, params)` writes the
reverse, one tensor at a time, for `transformers.AutoModelForCausalLM
.from_pretrained`. config.json's model_type picks the family; the files
themselves are jzo.models.hf_files' (shared with GPT-2's converter).
"""

from __future__ import annotations

import functools
import types

from jzo.host.leaf import HostLeaf
from jzo.models import gemma_hf, hf_files, llama_hf
from jzo.models.hf_files import CONFIG, DTYPES, INDEX, SINGLE

__all__ = ["CONFIG", "DTYPES", "INDEX", "SINGLE", "ARCHITECTURES", "config_from_hf",
           "family", "read_config", "param_sources", "save_pretrained"]

CONVERTERS = (llama_hf, gemma_hf)
# Every Hugging Face model_type jzo reads -> the class transformers builds for it.
ARCHITECTURES = {t: a for c in CONVERTERS for t, a in c.ARCHITECTURES.items()}


def _converter(model_type) -> types.ModuleType:
  for converter in CONVERTERS:
    if model_type in converter.ARCHITECTURES:
      return converter
  raise ValueError(f"model_type {model_type!r} is not supported (only "
                   f"{', '.join(ARCHITECTURES)})")


def config_from_hf(hf: dict, **overrides):
  """The config of a Hugging Face config.json (as a dict), in the family its
  model_type names; `overrides` set jzo's own fields (remat, attention).

  Raises:
    ValueError: an unknown model_type, or a config field its family cannot
      compute, named.
  """
  return _converter(hf.get("model_type")).config_from_hf(hf, **overrides)


def family(config) -> types.ModuleType:
  """The model module (init_params, forward, loss_fn, ...) of a config
  read from a Hugging Face folder."""
  return _converter(config.model_type).MODEL


def read_config(folder: str, **overrides):
  """The config of `folder`/config.json; `overrides` as config_from_hf's.

  Raises:
    FileNotFoundError: no config.json.
    ValueError: not JSON, or a config its family refuses.
  """
  return config_from_hf(hf_files.read_config(folder), **overrides)


def param_sources(folder: str, **overrides) -> tuple[object, dict]:
  """(config, params) of a Hugging Face folder: params is a nested dict
  shaped like the family's `init_params(config, ...)` whose leaves are
  `HostLeaf`s in the checkpoint's dtype (bf16, fp16 or fp32): pass it to
  `ZeroEngine(params=...)`, which loads one leaf at a time, or call a
  leaf's `load()`. Every tensor's name, shape and dtype is checked here,
  from the files' headers, before anything is loaded.

  Args:
    folder: holds config.json and model.safetensors or
      model.safetensors.index.json with its shards.
    overrides: config fields set over config.json's (remat, attention).

  Raises:
    FileNotFoundError: the config, the weights or a shard is missing, named.
    ValueError: a bad config, index or file, or a tensor that is missing,
      unexpected, of another shape than the config implies or of an
      unsupported dtype, in one line naming it (and the shapes).
  """
  config = read_config(folder, **overrides)
  converter = _converter(config.model_type)
  tensors = hf_files.tensors(folder)
  leaves = converter.leaves(config)
  hf_files.check(folder, tensors, leaves, config.n_layer, converter.unused(config),
                 f"a {config.model_type} model of this config.json")
  params = {}
  for path, leaf in leaves.items():
    dtype = DTYPES[tensors[leaf.parts[0][0].format(i=0)].code]
    load = functools.partial(hf_files.load, leaf, config.n_layer, dtype, tensors)
    params[path] = HostLeaf(leaf.shape(config.n_layer), dtype, load,
                            load if leaf.stacked else None)
  return config, hf_files.nest(params)


def save_pretrained(folder: str, config, params: dict, dtype: str = "bfloat16",
                    max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes `params` (the family's layout, numpy arrays: what
  ZeroEngine.params returns) as a Hugging Face folder that
  `transformers.AutoModelForCausalLM.from_pretrained` loads: config.json,
  then model.safetensors, or shards model-0000k-of-0000n.safetensors with
  model.safetensors.index.json when the tensors pass `max_shard_bytes`.
  Tensors are converted and written one at a time. Tokenizer files are the
  caller's to copy.

  Args:
    dtype: of the written tensors: "bfloat16", "float16" or "float32".
    max_shard_bytes: most bytes of tensor data in one file (a tensor larger
      than this gets a file of its own).

  Raises:
    ValueError: a dtype other than these, a params leaf missing, extra or
      of another shape than the config's, or a config its model_type
      cannot express.
  """
  converter = _converter(config.model_type)
  hf_files.write(folder, config.to_hf(), converter.leaves(config), config.n_layer, params, dtype,
                 max_shard_bytes, f"a {config.model_type} model of this config")
