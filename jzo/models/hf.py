"""Hugging Face checkpoints in and out for jzo.models.llama, one leaf at a time.

`param_sources(folder)` reads a folder that transformers' `save_pretrained`
wrote (config.json and model.safetensors, or shards listed by
model.safetensors.index.json) as a LlamaConfig and a tree of `jzo.HostLeaf`
shaped like `llama.init_params`: nothing is read until the engine draws a
leaf, and each leaf is then assembled from its per-layer tensors, memory-mapped
from the files, in the files' dtype, so the host never holds more than one
leaf. `save_pretrained(folder, config, params)` writes the reverse, one tensor
at a time, for `transformers.AutoModelForCausalLM.from_pretrained`. The
files themselves are jzo.models.hf_files' (shared with GPT-2's converter).
"""

from __future__ import annotations

import functools
import re

from jzo.host.leaf import HostLeaf
from jzo.models import hf_files
from jzo.models.hf_files import CONFIG, DTYPES, INDEX, SINGLE, Leaf
from jzo.models.llama import LlamaConfig

__all__ = ["CONFIG", "DTYPES", "INDEX", "SINGLE", "read_config", "param_sources",
           "save_pretrained"]

# Buffers some checkpoints carry that the model recomputes (RoPE's frequencies).
_HARMLESS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _leaves(config: LlamaConfig) -> dict[tuple[str, ...], Leaf]:
  """The jzo params' leaves (key paths as in llama.init_params) and the
  Hugging Face tensors each is made of."""
  D, V, F, hd = config.d_model, config.vocab_size, config.d_ff, config.head_dim
  Q, KV = config.n_head * hd, config.n_kv_head * hd
  p = "model.layers.{i}."
  once = lambda name, shape: Leaf(((name, shape),), False, False)
  layer = lambda parts, transpose=False: Leaf(tuple((p + n, s) for n, s in parts), transpose,
                                              True)
  out = {
      ("embed",): once("model.embed_tokens.weight", (V, D)),
      ("layers", "attn_norm", "scale"): layer([("input_layernorm.weight", (D,))]),
      ("layers", "qkv", "kernel"): layer([("self_attn.q_proj.weight", (Q, D)),
                                          ("self_attn.k_proj.weight", (KV, D)),
                                          ("self_attn.v_proj.weight", (KV, D))], True),
      ("layers", "o", "kernel"): layer([("self_attn.o_proj.weight", (D, Q))], True),
      ("layers", "mlp_norm", "scale"): layer([("post_attention_layernorm.weight", (D,))]),
      ("layers", "gate_up", "kernel"): layer([("mlp.gate_proj.weight", (F, D)),
                                              ("mlp.up_proj.weight", (F, D))], True),
      ("layers", "down", "kernel"): layer([("mlp.down_proj.weight", (D, F))], True),
      ("norm", "scale"): once("model.norm.weight", (D,)),
  }
  if config.qkv_bias:
    out["layers", "qkv", "bias"] = layer([("self_attn.q_proj.bias", (Q,)),
                                          ("self_attn.k_proj.bias", (KV,)),
                                          ("self_attn.v_proj.bias", (KV,))])
  if config.o_bias:
    out["layers", "o", "bias"] = layer([("self_attn.o_proj.bias", (D,))])
  if config.qk_norm:
    out["layers", "q_norm", "scale"] = layer([("self_attn.q_norm.weight", (hd,))])
    out["layers", "k_norm", "scale"] = layer([("self_attn.k_norm.weight", (hd,))])
  if not config.tie_embeddings:
    out["lm_head",] = once("lm_head.weight", (V, D))
  return out


def read_config(folder: str, **overrides) -> LlamaConfig:
  """The LlamaConfig of `folder`/config.json; `overrides` set jzo's own
  fields (remat, attention).

  Raises:
    FileNotFoundError: no config.json.
    ValueError: not JSON, or a config LlamaConfig.from_hf refuses.
  """
  return LlamaConfig.from_hf(hf_files.read_config(folder), **overrides)


def param_sources(folder: str, **overrides) -> tuple[LlamaConfig, dict]:
  """(config, params) of a Hugging Face folder: params is a nested dict
  shaped like `llama.init_params(config, ...)` whose leaves are `HostLeaf`s
  in the checkpoint's dtype (bf16, fp16 or fp32): pass it to
  `ZeroEngine(params=...)`, which loads one leaf at a time, or call a
  leaf's `load()`. Every tensor's name, shape and dtype is checked here,
  from the files' headers, before anything is loaded.

  Args:
    folder: holds config.json and model.safetensors or
      model.safetensors.index.json with its shards.
    overrides: LlamaConfig fields set over config.json's (remat, attention).

  Raises:
    FileNotFoundError: the config, the weights or a shard is missing, named.
    ValueError: a bad config, index or file, or a tensor that is missing,
      unexpected, of another shape than the config implies or of an
      unsupported dtype, in one line naming it (and the shapes).
  """
  config = read_config(folder, **overrides)
  tensors = hf_files.tensors(folder)
  leaves = _leaves(config)
  # A tied model's lm_head.weight, where a checkpoint has one, goes unused
  # (transformers ties it to the embedding too).
  unused = {"lm_head.weight"} if config.tie_embeddings else set()
  hf_files.check(folder, tensors, leaves, config.n_layer,
                 lambda name: name in unused or bool(_HARMLESS.fullmatch(name)),
                 f"a {config.model_type} model of this config.json")
  params = {}
  for path, leaf in leaves.items():
    dtype = DTYPES[tensors[leaf.parts[0][0].format(i=0)].code]
    params[path] = HostLeaf(leaf.shape(config.n_layer), dtype,
                            functools.partial(hf_files.load, leaf, config.n_layer, dtype, tensors))
  return config, hf_files.nest(params)


def save_pretrained(folder: str, config: LlamaConfig, params: dict, dtype: str = "bfloat16",
                    max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes `params` (jzo's layout, numpy arrays: what ZeroEngine.params
  returns) as a Hugging Face folder that
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
  hf_config = config.to_hf()
  hf_files.write(folder, hf_config, _leaves(config), config.n_layer, params, dtype,
                 max_shard_bytes, f"a {config.model_type} model of this config")
