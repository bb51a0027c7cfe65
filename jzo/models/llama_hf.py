"""The Llama family's Hugging Face form (Llama, Mistral, Qwen2/3, Phi-3,
Qwen3-MoE, Mixtral): which checkpoint tensors make each leaf of
`llama.init_params`, for jzo.models.hf (which reads and writes the folders).

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
  Hugging Face tensors each is made of: Phi-3's fused qkv_proj and
  gate_up_proj are jzo's qkv and gate_up as they are; a mixture's experts
  are one tensor each per layer, expert and projection."""
  D, V, F, hd = config.d_model, config.vocab_size, config.d_ff, config.head_dim
  Q, KV = config.n_head * hd, config.n_kv_head * hd
  p = "model.layers.{i}."
  once = lambda name, shape: Leaf(((name, shape),), False, False)
  layer = lambda parts, transpose=False: Leaf(tuple((p + n, s) for n, s in parts), transpose,
                                              True)
  if config.model_type == "phi3":
    qkv = layer([("self_attn.qkv_proj.weight", (Q + 2 * KV, D))], True)
  else:
    qkv = layer([("self_attn.q_proj.weight", (Q, D)), ("self_attn.k_proj.weight", (KV, D)),
                 ("self_attn.v_proj.weight", (KV, D))], True)
  out = {
      ("embed",): once("model.embed_tokens.weight", (V, D)),
      ("layers", "attn_norm", "scale"): layer([("input_layernorm.weight", (D,))]),
      ("layers", "qkv", "kernel"): qkv,
      ("layers", "o", "kernel"): layer([("self_attn.o_proj.weight", (D, Q))], True),
      ("layers", "mlp_norm", "scale"): layer([("post_attention_layernorm.weight", (D,))]),
  }
  if config.n_experts:
    out.update(_expert_leaves(config))
  elif config.model_type == "phi3":
    out["layers", "gate_up", "kernel"] = layer([("mlp.gate_up_proj.weight", (2 * F, D))], True)
  else:
    out["layers", "gate_up", "kernel"] = layer([("mlp.gate_proj.weight", (F, D)),
                                                ("mlp.up_proj.weight", (F, D))], True)
  if not config.n_experts:
    out["layers", "down", "kernel"] = layer([("mlp.down_proj.weight", (D, F))], True)
  out["norm", "scale"] = once("model.norm.weight", (D,))
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


def _expert_leaves(config: LlamaConfig) -> dict[tuple[str, ...], Leaf]:
  """A mixture's router and stacked experts: Qwen3-MoE's mlp.gate and
  mlp.experts.{e}.gate_proj|up_proj|down_proj, Mixtral's
  block_sparse_moe.gate and block_sparse_moe.experts.{e}.w1 (gate) | w3
  (up) | w2 (down)."""
  D, E, I = config.d_model, config.n_experts, config.d_expert
  p = "model.layers.{i}."
  if config.model_type == "mixtral":
    mlp, gate, up, down = "block_sparse_moe.", "w1", "w3", "w2"
  else:
    mlp, gate, up, down = "mlp.", "gate_proj", "up_proj", "down_proj"
  expert = lambda e, name: f"{p}{mlp}experts.{e}.{name}.weight"
  return {
      ("layers", "moe", "router", "kernel"): Leaf(((p + mlp + "gate.weight", (E, D)),), True,
                                                  True),
      ("layers", "moe", "gate_up"): Leaf(tuple(
          part for e in range(E) for part in ((expert(e, gate), (I, D)),
                                              (expert(e, up), (I, D)))), True, True, E),
      ("layers", "moe", "down"): Leaf(tuple((expert(e, down), (D, I)) for e in range(E)), True,
                                      True, E),
  }


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
