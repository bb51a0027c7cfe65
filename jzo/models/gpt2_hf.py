"""jzo's GPT (jzo.models.gpt) in and out of transformers' GPT-2 format.

`read_config(folder)` and `load_params(folder)` read a folder that
transformers' `GPT2LMHeadModel.save_pretrained` wrote (config.json and
model.safetensors, or shards listed by model.safetensors.index.json; tensor
names with or without the "transformer." prefix) as a `gpt.GPTConfig` and
the params dict `gpt.init_params` makes; `save_pretrained(folder, config,
params)` writes the reverse, one tensor at a time, which
`transformers.GPT2LMHeadModel.from_pretrained` loads.

The two are the same model: pre-LayerNorm blocks (eps 1e-5), learned
positions, embeddings tied with the output, attention scaled by
1/sqrt(head size), GELU's tanh approximation. GPT-2's Conv1D weights are
(in, out), as jzo's kernels, and its c_attn (D, 3D) is [q | k | v], each
heads-contiguous, as jzo's qkv kernel: every tensor is a leaf's layer as it
is. A GPT-2 that jzo's GPT cannot express (another activation or LayerNorm
eps, untied embeddings, attention scaled by layer, cross-attention, an MLP
other than 4 D wide) is refused with one line naming the option;
reorder_and_upcast_attn (the same function, in float32) reads as it is.
"""

from __future__ import annotations

import os
import re

import numpy as np

from jzo.models import gpt, hf_files
from jzo.models.hf_files import CONFIG, Leaf

ARCHITECTURE = "GPT2LMHeadModel"
# transformers' GPT2Config defaults: save_pretrained leaves out the keys that equal them.
_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
             "n_head": 12, "n_inner": None, "activation_function": "gelu_new",
             "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
             "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
             "tie_word_embeddings": True}
# GPT2Config's other names for its sizes (its attribute_map).
_ALIASES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers",
            "n_head": "num_attention_heads", "n_positions": "max_position_embeddings"}
# transformers' names of GELU's tanh approximation, jzo's jax.nn.gelu (approximate=True).
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# The tied lm_head.weight where a checkpoint has one, and the causal-mask
# buffers that older transformers saved.
_UNUSED = re.compile(r"lm_head\.weight|(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)")


def _leaves(config: gpt.GPTConfig, prefix: str = "transformer.") -> dict[tuple[str, ...], Leaf]:
  """The jzo params' leaves (key paths as in gpt.init_params) and the GPT-2
  tensor each is made of, in the order transformers writes them."""
  D, V, S = config.d_model, config.vocab_size, config.seq_len
  once = lambda name, shape: Leaf(((prefix + name, shape),), False, False)
  layer = lambda name, shape: Leaf(((prefix + "h.{i}." + name, shape),), False, True)
  return {
      ("wte",): once("wte.weight", (V, D)),
      ("wpe",): once("wpe.weight", (S, D)),
      ("blocks", "ln1", "scale"): layer("ln_1.weight", (D,)),
      ("blocks", "ln1", "bias"): layer("ln_1.bias", (D,)),
      ("blocks", "qkv", "kernel"): layer("attn.c_attn.weight", (D, 3 * D)),
      ("blocks", "qkv", "bias"): layer("attn.c_attn.bias", (3 * D,)),
      ("blocks", "proj", "kernel"): layer("attn.c_proj.weight", (D, D)),
      ("blocks", "proj", "bias"): layer("attn.c_proj.bias", (D,)),
      ("blocks", "ln2", "scale"): layer("ln_2.weight", (D,)),
      ("blocks", "ln2", "bias"): layer("ln_2.bias", (D,)),
      ("blocks", "fc", "kernel"): layer("mlp.c_fc.weight", (D, 4 * D)),
      ("blocks", "fc", "bias"): layer("mlp.c_fc.bias", (4 * D,)),
      ("blocks", "out", "kernel"): layer("mlp.c_proj.weight", (4 * D, D)),
      ("blocks", "out", "bias"): layer("mlp.c_proj.bias", (D,)),
      ("lnf", "scale"): once("ln_f.weight", (D,)),
      ("lnf", "bias"): once("ln_f.bias", (D,)),
  }


def read_config(folder: str, **overrides) -> gpt.GPTConfig:
  """The GPTConfig of a GPT-2 folder's config.json: its sizes (seq_len is
  n_positions, the position embedding's rows); `overrides` set jzo's own
  fields (remat, attention).

  Raises:
    FileNotFoundError: no config.json.
    ValueError: not JSON, not a GPT-2, or an option jzo's GPT cannot
      express, in one line naming it.
  """
  hf = hf_files.read_config(folder)
  path = os.path.join(folder, CONFIG)
  model_type = hf.get("model_type")
  if model_type != "gpt2":
    raise ValueError(f"{path}: model_type {model_type!r} is not GPT-2's 'gpt2'")

  def get(key):
    return hf.get(key, hf.get(_ALIASES.get(key), _DEFAULTS[key]))
  sizes = {key: get(key) for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")}
  for key, value in sizes.items():
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{path}: {key} is {value!r}, not a positive integer")
  refusals = [
      (get("activation_function") not in _GELU_TANH,
       f"activation_function {get('activation_function')!r}: jzo's GPT has GELU's tanh "
       f"approximation ({', '.join(_GELU_TANH)})"),
      (get("n_inner") not in (None, 4 * sizes["n_embd"]),
       f"n_inner {get('n_inner')}: jzo's GPT has an MLP 4 x n_embd = {4 * sizes['n_embd']} wide"),
      (get("layer_norm_epsilon") != 1e-5,
       f"layer_norm_epsilon {get('layer_norm_epsilon')}: jzo's GPT has LayerNorm eps 1e-5"),
      (not get("scale_attn_weights"),
       "scale_attn_weights false: jzo's GPT scales attention by 1/sqrt(head size)"),
      (get("scale_attn_by_inverse_layer_idx"),
       "scale_attn_by_inverse_layer_idx: jzo's GPT scales no layer's attention apart"),
      (get("add_cross_attention"), "add_cross_attention: jzo's GPT has no cross-attention"),
      (not get("tie_word_embeddings"),
       "tie_word_embeddings false: jzo's GPT ties the output to the token embedding"),
  ]
  for refused, why in refusals:
    if refused:
      raise ValueError(f"{path}: {why}")
  try:
    return gpt.GPTConfig(vocab_size=sizes["vocab_size"], seq_len=sizes["n_positions"],
                         n_layer=sizes["n_layer"], n_head=sizes["n_head"],
                         d_model=sizes["n_embd"], **overrides)
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None


def load_params(folder: str, dtype=np.float32) -> dict:
  """The params of a GPT-2 folder as `gpt.init_params` shapes them (numpy
  arrays in `dtype`), for `gpt.forward(read_config(folder), params, tokens)`.
  Every tensor's name, shape and dtype (bf16, fp16 or fp32) is checked
  from the files' headers before anything is read; then each leaf is
  assembled from its per-layer tensors, memory-mapped one at a time.

  Raises:
    FileNotFoundError: the config, the weights or a shard is missing, named.
    ValueError: what `read_config` refuses, a bad index or file, or a
      tensor that is missing, unexpected, of another shape than config.json
      implies or of an unsupported dtype, in one line naming it.
  """
  config = read_config(folder)
  found = hf_files.tensors(folder)
  # GPT2LMHeadModel saves "transformer.h.0...", GPT2Model (OpenAI's own upload) "h.0...".
  prefix = "transformer." if any(n.startswith("transformer.") for n in found) else ""
  leaves = _leaves(config, prefix)
  hf_files.check(folder, found, leaves, config.n_layer, lambda n: bool(_UNUSED.fullmatch(n)),
                 "a GPT-2 of this config.json")
  return hf_files.nest({path: hf_files.load(leaf, config.n_layer, dtype, found)
                        for path, leaf in leaves.items()})


def to_hf(config: gpt.GPTConfig, bos_token_id: int | None = None,
          eos_token_id: int | None = None) -> dict:
  """The config.json of transformers' GPT2LMHeadModel for `config`. No
  dropout (jzo trains without); bos/eos None where the tokens have none
  (GPT2Config's defaults, 50256, belong to GPT-2's own vocabulary)."""
  return {"architectures": [ARCHITECTURE], "model_type": "gpt2",
          "vocab_size": config.vocab_size, "n_positions": config.seq_len,
          "n_embd": config.d_model, "n_layer": config.n_layer, "n_head": config.n_head,
          "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
          "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
          "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
          "reorder_and_upcast_attn": False, "add_cross_attention": False,
          "tie_word_embeddings": True, "initializer_range": 0.02, "use_cache": True,
          "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}


def save_pretrained(folder: str, config: gpt.GPTConfig, params: dict, dtype: str = "float32",
                    bos_token_id: int | None = None, eos_token_id: int | None = None,
                    max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes `params` (gpt.init_params' layout, numpy arrays) as a GPT-2
  folder that `transformers.GPT2LMHeadModel.from_pretrained` (and
  AutoModelForCausalLM) loads: config.json (`to_hf`), then
  model.safetensors, or shards model-0000k-of-0000n.safetensors with
  model.safetensors.index.json when the tensors pass `max_shard_bytes`.
  lm_head.weight is not written: transformers ties it to
  transformer.wte.weight. Tokenizer files are the caller's to write.

  Args:
    dtype: of the written tensors: "float32", "bfloat16" or "float16".
    bos_token_id, eos_token_id: the tokenizer's, for config.json.
    max_shard_bytes: most bytes of tensor data in one file (a tensor larger
      than this gets a file of its own).

  Raises:
    ValueError: a dtype other than these, or a params leaf missing, extra
      or of another shape than the config's.
  """
  hf_files.write(folder, to_hf(config, bos_token_id, eos_token_id), _leaves(config),
                 config.n_layer, params, dtype, max_shard_bytes, "a GPT of this config")
