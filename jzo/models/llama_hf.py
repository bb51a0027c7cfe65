"""The Llama family's Hugging Face form: which checkpoint tensors make each
leaf of `llama.init_params`, for jzo.models.hf (which reads and writes the
folders).

A family's converter module gives jzo.models.hf: `MODEL` (the family's
model module), `ARCHITECTURES` (each Hugging Face model_type it reads, and
the class transformers builds for it), `config_from_hf(hf, **overrides)`,
`leaves(config)` ({leaf path: hf_files.Leaf}) and `unused(config)` (which
other tensor names a checkpoint may hold and the model does not read).
"""

from __future__ import annotations

import re
from typing import Callable

from jzo.models import llama
from jzo.models.hf_files import Leaf
from jzo.models.llama import LlamaConfig

MODEL = llama
ARCHITECTURES = llama.ARCHITECTURES

# Buffers some checkpoints carry that the model recomputes (RoPE's frequencies).
_HARMLESS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def leaves(config: LlamaConfig) -> dict[tuple[str, ...], Leaf]:
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


def config_from_hf(hf: dict, **overrides) -> LlamaConfig:
  """The LlamaConfig of a config.json's dict; `overrides` set jzo's own
  fields (remat, attention). Raises ValueError naming what it refuses."""
  return LlamaConfig.from_hf(hf, **overrides)


def unused(config: LlamaConfig) -> Callable[[str], bool]:
  """Whether a checkpoint tensor that no leaf takes may be passed over:
  RoPE's saved frequencies, and a tied model's lm_head.weight (transformers
  ties it to the embedding too)."""
  return lambda name: ((config.tie_embeddings and name == "lm_head.weight")
                       or bool(_HARMLESS.fullmatch(name)))
