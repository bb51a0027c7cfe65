"""Gemma 2 and Gemma 3 (text) in Hugging Face form: which checkpoint tensors
make each leaf of `gemma.init_params`, for jzo.models.hf (which reads and
writes the folders). A converter as jzo.models.llama_hf describes.

Gemma's four norms per layer map by position, not by name: transformers'
post_attention_layernorm norms the attention's output (jzo's
attn_post_norm), and pre_feedforward_layernorm the MLP's input (mlp_norm).
Gemma 3's image-text checkpoints (model_type gemma3) hold the same tensors
under "language_model.", beside the vision tower and its projector, which
are passed over.
"""

from __future__ import annotations

import re
from typing import Callable

from jzo.models import gemma
from jzo.models.gemma_config import GemmaConfig
from jzo.models.hf_files import Leaf

MODEL = gemma
ARCHITECTURES = gemma.ARCHITECTURES

# Buffers some checkpoints carry that the model recomputes (RoPE's frequencies).
_HARMLESS = re.compile(
    r"(language_model\.)?model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# What an image-text checkpoint holds besides its text model.
_VISION = re.compile(r"(vision_tower|multi_modal_projector)\..*")


def _prefix(config: GemmaConfig) -> str:
  """What the text model's tensor names start with."""
  return "language_model." if config.model_type == "gemma3" else ""


def leaves(config: GemmaConfig) -> dict[tuple[str, ...], Leaf]:
  """The jzo params' leaves (key paths as in gemma.init_params) and the
  Hugging Face tensors each is made of."""
  D, V, F, hd = config.d_model, config.vocab_size, config.d_ff, config.head_dim
  Q, KV = config.n_head * hd, config.n_kv_head * hd
  top = _prefix(config)
  p = top + "model.layers.{i}."
  once = lambda name, shape: Leaf(((top + name, shape),), False, False)
  layer = lambda parts, transpose=False: Leaf(tuple((p + n, s) for n, s in parts), transpose,
                                              True)
  norm = lambda name: layer([(name + ".weight", (D,))])
  out = {
      ("embed",): once("model.embed_tokens.weight", (V, D)),
      ("layers", "attn_norm", "scale"): norm("input_layernorm"),
      ("layers", "qkv", "kernel"): layer([("self_attn.q_proj.weight", (Q, D)),
                                          ("self_attn.k_proj.weight", (KV, D)),
                                          ("self_attn.v_proj.weight", (KV, D))], True),
      ("layers", "o", "kernel"): layer([("self_attn.o_proj.weight", (D, Q))], True),
      ("layers", "attn_post_norm", "scale"): norm("post_attention_layernorm"),
      ("layers", "mlp_norm", "scale"): norm("pre_feedforward_layernorm"),
      ("layers", "gate_up", "kernel"): layer([("mlp.gate_proj.weight", (F, D)),
                                              ("mlp.up_proj.weight", (F, D))], True),
      ("layers", "down", "kernel"): layer([("mlp.down_proj.weight", (D, F))], True),
      ("layers", "mlp_post_norm", "scale"): norm("post_feedforward_layernorm"),
      ("norm", "scale"): once("model.norm.weight", (D,)),
  }
  if config.qk_norm:
    out["layers", "q_norm", "scale"] = layer([("self_attn.q_norm.weight", (hd,))])
    out["layers", "k_norm", "scale"] = layer([("self_attn.k_norm.weight", (hd,))])
  if not config.tie_embeddings:
    out["lm_head",] = once("lm_head.weight", (V, D))
  return out


def config_from_hf(hf: dict, **overrides) -> GemmaConfig:
  """The GemmaConfig of a config.json's dict; `overrides` set jzo's own
  fields (remat, attention). Raises ValueError naming what it refuses."""
  return GemmaConfig.from_hf(hf, **overrides)


def unused(config: GemmaConfig) -> Callable[[str], bool]:
  """Whether a checkpoint tensor that no leaf takes may be passed over:
  RoPE's saved frequencies, a tied model's lm_head.weight, and an
  image-text model's vision tower and projector."""
  head = _prefix(config) + "lm_head.weight"
  return lambda name: ((config.tie_embeddings and name == head)
                       or bool(_HARMLESS.fullmatch(name))
                       or (config.model_type == "gemma3" and bool(_VISION.fullmatch(name))))
