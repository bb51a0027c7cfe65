"""The Gemma 2 and Gemma 3 (text) config: `GemmaConfig`, its Hugging Face
config.json in and out (`from_hf`, `to_hf`), and the published shapes
(`PRESETS`). The model itself is jzo.models.gemma.

Both generations alternate sliding-window and global attention layers
(`layer_types`); Gemma 2 soft-caps the attention scores and the logits,
Gemma 3 normalises each head of q and k and gives its sliding layers a RoPE
base of their own (and its global ones, from 4B up, linear scaling).

Gemma 3 from 4B up is published as an image-text model (model_type gemma3,
Gemma3ForConditionalGeneration, its text model's config under
"text_config"): jzo reads its text model (model_type "gemma3" in the config
says where its tensors are), and writes it back as a text model
(gemma3_text) only.
"""

from __future__ import annotations

import dataclasses

from jzo.models import hf_files
from jzo.models.common import REMAT_POLICIES

# Hugging Face model_type -> the class transformers builds for it.
ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "gemma3": "Gemma3ForConditionalGeneration"}
SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' defaults where config.json leaves a key out: one sliding layer
# in `pattern` (the last of each `pattern` layers is global), the context, the
# soft-caps and the RoPE bases (global, sliding).
_DEFAULTS = {
    "gemma2": dict(pattern=2, seq_len=8192, attn_softcap=50.0, final_softcap=30.0,
                   thetas=(10000.0, 10000.0)),
    "gemma3_text": dict(pattern=6, seq_len=131072, attn_softcap=None, final_softcap=None,
                        thetas=(1e6, 10000.0)),
}
_DEFAULTS["gemma3"] = _DEFAULTS["gemma3_text"]
# Gemma3TextConfig's defaults for the sizes, which the image-text models'
# text_config leaves out where they equal them.
_GEMMA3_TEXT = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                "num_hidden_layers": 26, "num_attention_heads": 8}
ROPE_TYPES = ("default", "linear")


def layer_pattern(n_layer: int, pattern: int) -> tuple[str, ...]:
  """Each layer's type when every `pattern`-th layer is global, the others
  sliding (transformers' rule where config.json has no layer_types)."""
  return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n_layer))


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  vocab_size: int = 256000
  seq_len: int = 8192  # longest context (Hugging Face's max_position_embeddings)
  n_layer: int = 26
  n_head: int = 8  # query heads
  n_kv_head: int = 4  # key/value heads (grouped-query attention)
  d_model: int = 2304
  d_ff: int = 9216  # the GeGLU MLP's hidden width (intermediate_size)
  head_dim: int = 256
  # Scores are q.k / sqrt(query_pre_attn_scalar) (head_dim on most sizes).
  query_pre_attn_scalar: float = 256.0
  # Gemma 2's soft-caps, c tanh(x / c): on the attention scores
  # (attn_logit_softcapping) and on the logits (final_logit_softcapping,
  # which the loss sees too); None: none.
  attn_softcap: float | None = None
  final_softcap: float | None = None
  # Sliding layers see the last `sliding_window` keys: key j is visible to
  # query i iff i - sliding_window < j <= i.
  sliding_window: int = 4096
  # Each layer's attention, SLIDING or FULL; () (the default): the
  # model_type's pattern (Gemma 2 alternates, Gemma 3 has 5 sliding to 1).
  layer_types: tuple[str, ...] = ()
  # RoPE of the global layers and of the sliding ones: base wavelength and
  # linear scaling (positions divided by the factor; 1: none).
  rope_theta: float = 10000.0
  rope_factor: float = 1.0
  rope_local_theta: float = 10000.0
  rope_local_factor: float = 1.0
  norm_eps: float = 1e-6  # RMSNorm's epsilon (rms_norm_eps)
  tie_embeddings: bool = True  # logits through the input embedding (no lm_head)
  # gemma2, gemma3_text (which adds the per-head q/k norms) or gemma3 (the
  # text model of Gemma 3's image-text checkpoints, exported as gemma3_text).
  model_type: str = "gemma2"
  bos_token_id: int | None = 2
  eos_token_id: int | tuple[int, ...] | None = 1
  # What the backward pass recomputes: as jzo.models.llama.LlamaConfig's.
  remat: str = "full"
  # "auto": cuDNN flash attention on GPU where it runs and nothing is
  # soft-capped, XLA's otherwise; or "cudnn" / "xla" to force one.
  attention: str = "auto"

  def __post_init__(self):
    if self.model_type not in ARCHITECTURES:
      raise ValueError(f"model_type {self.model_type!r} is not supported (only "
                       f"{', '.join(ARCHITECTURES)})")
    if not self.layer_types:
      object.__setattr__(self, "layer_types",
                         layer_pattern(self.n_layer, _DEFAULTS[self.model_type]["pattern"]))
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if min(self.vocab_size, self.seq_len, self.n_layer, self.n_head, self.n_kv_head,
           self.d_model, self.d_ff, self.head_dim, self.sliding_window) < 1:
      raise ValueError(f"every size must be >= 1: {self}")
    if self.n_head % self.n_kv_head:
      raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
    if len(self.layer_types) != self.n_layer or set(self.layer_types) - {SLIDING, FULL}:
      raise ValueError(f"layer_types must give each of the {self.n_layer} layers "
                       f"{SLIDING} or {FULL}, got {list(self.layer_types)}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}")
    if self.attention not in ("auto", "cudnn", "xla"):
      raise ValueError(f"attention must be auto, cudnn or xla, got {self.attention!r}")
    if self.attention == "cudnn" and self.attn_softcap is not None:
      raise ValueError("attention 'cudnn' cannot soft-cap the attention scores "
                       "(attn_softcap): use 'xla' or 'auto'")

  @property
  def qk_norm(self) -> bool:
    """Whether each head of q and k is RMS-normalised before RoPE (Gemma 3)."""
    return self.model_type != "gemma2"

  @property
  def n_params(self) -> int:
    """Parameters: V D (twice untied) + D + L (4 D + D (H + 2 K) hd + H hd D
    + 3 D F), plus 2 hd a layer for Gemma 3's q/k norms."""
    D, hd = self.d_model, self.head_dim
    layer = (4 * D + D * (self.n_head + 2 * self.n_kv_head) * hd + self.n_head * hd * D
             + 3 * D * self.d_ff + 2 * hd * self.qk_norm)
    embeddings = self.vocab_size * D * (1 if self.tie_embeddings else 2)
    return embeddings + D + self.n_layer * layer

  def flops_per_token(self, seq_len: int | None = None) -> float:
    """Model FLOPs of one training token, forward and backward: 6 N for the
    matmuls plus 12 H hd T per global layer for the attention scores and
    values (PaLM's count, as LlamaConfig's), where a sliding layer counts
    min(T, sliding_window) keys instead of T; recomputation is not counted."""
    T = seq_len or self.seq_len
    keys = sum(min(T, self.sliding_window) if t == SLIDING else T for t in self.layer_types)
    return 6 * self.n_params + 12 * self.n_head * self.head_dim * keys

  @classmethod
  def from_hf(cls, hf: dict, **overrides) -> GemmaConfig:
    """The config of a Hugging Face config.json (as a dict) of model_type
    gemma2 or gemma3_text, or gemma3 (an image-text model, whose text
    model is read); `overrides` set jzo's own fields (remat, attention).
    Missing optional keys take transformers' defaults. Gemma 3's
    attn_logit_softcapping is not read: transformers does not apply it.

    Raises:
      ValueError: an unknown model_type, or a field that changes the model
        and is not implemented, named in one line.
    """
    model_type = hf.get("model_type")
    if model_type == "gemma3":
      if not isinstance(hf.get("text_config"), dict):
        raise ValueError("a gemma3 config has no text_config")
      # The outer config's token ids and tying are the model's.
      outer = {k: hf[k] for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id")
               if k in hf}
      hf = _GEMMA3_TEXT | hf["text_config"] | outer | {"model_type": model_type}
    hf_files.check_config(hf, ARCHITECTURES)
    _refuse_unimplemented(hf)
    defaults = _DEFAULTS[model_type]
    n_layer = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
      pattern = defaults["pattern"]
      if model_type != "gemma2":
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or pattern
      layer_types = layer_pattern(n_layer, pattern)
    window = hf.get("sliding_window", 4096)
    if window is None:
      raise ValueError("sliding_window null is not supported (transformers needs one too)")
    eos = hf.get("eos_token_id", 1)
    fields = dict(
        vocab_size=hf["vocab_size"],
        seq_len=hf.get("max_position_embeddings", defaults["seq_len"]),
        n_layer=n_layer, n_head=hf["num_attention_heads"],
        n_kv_head=hf.get("num_key_value_heads") or 4, d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"], head_dim=hf.get("head_dim") or 256,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_softcap=(hf.get("attn_logit_softcapping", defaults["attn_softcap"])
                      if model_type == "gemma2" else None),
        final_softcap=hf.get("final_logit_softcapping", defaults["final_softcap"]),
        sliding_window=window,
        layer_types=tuple(layer_types), norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", True), model_type=model_type,
        bos_token_id=hf.get("bos_token_id", 2),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos)
    return cls(**fields | _rope_from_hf(hf, model_type) | overrides)

  def to_hf(self) -> dict:
    """This config as a Hugging Face config.json dict (without the dtype,
    which belongs to the weights). RoPE is written in both spellings:
    transformers 5's `rope_parameters` and the older top-level keys.

    Raises:
      ValueError: Gemma 2 with RoPE that differs between its layer types,
        or Gemma 3 with attention scores soft-capped (neither can say so).
    """
    local = {"rope_type": "default" if self.rope_local_factor == 1 else "linear",
             "rope_theta": self.rope_local_theta}
    full = {"rope_type": "default" if self.rope_factor == 1 else "linear",
            "rope_theta": self.rope_theta}
    if self.rope_local_factor != 1:
      local["factor"] = self.rope_local_factor
    if self.rope_factor != 1:
      full["factor"] = self.rope_factor
    scaling = {"rope_type": "linear", "factor": self.rope_factor} if self.rope_factor != 1 else None
    eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
    hf = {
        "architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type,
        "vocab_size": self.vocab_size, "max_position_embeddings": self.seq_len,
        "hidden_size": self.d_model, "intermediate_size": self.d_ff,
        "num_hidden_layers": self.n_layer, "num_attention_heads": self.n_head,
        "num_key_value_heads": self.n_kv_head, "head_dim": self.head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": self.norm_eps,
        "initializer_range": 0.02,
        # An int where it is one: transformers 5 checks the field's type.
        "query_pre_attn_scalar": (int(self.query_pre_attn_scalar)
                                  if float(self.query_pre_attn_scalar).is_integer()
                                  else self.query_pre_attn_scalar),
        "attn_logit_softcapping": self.attn_softcap,
        "final_logit_softcapping": self.final_softcap, "sliding_window": self.sliding_window,
        "layer_types": list(self.layer_types), "rope_theta": self.rope_theta,
        "rope_scaling": scaling, "tie_word_embeddings": self.tie_embeddings,
        "attention_bias": False, "attention_dropout": 0.0, "pad_token_id": 0,
        "bos_token_id": self.bos_token_id, "eos_token_id": eos, "use_cache": True,
    }
    if self.model_type == "gemma3":
      raise ValueError("a gemma3 model (image-text) is written as its text model alone: "
                       "dataclasses.replace(config, model_type='gemma3_text')")
    if self.model_type == "gemma2":
      if local != full:
        raise ValueError(f"model_type gemma2 has one RoPE for every layer: sliding {local} "
                         f"and global {full} differ")
      hf["rope_parameters"] = full
    else:
      if self.attn_softcap is not None:
        raise ValueError("model_type gemma3_text does not soft-cap attention scores "
                         f"(attn_softcap={self.attn_softcap})")
      hf.update(rope_parameters={SLIDING: local, FULL: full},
                rope_local_base_freq=self.rope_local_theta)
      patterns = [p for p in range(1, self.n_layer + 1)
                  if layer_pattern(self.n_layer, p) == self.layer_types]
      if patterns:  # what transformers before layer_types read
        hf["sliding_window_pattern"] = patterns[0]
    return hf


def _refuse_unimplemented(hf: dict) -> None:
  """Raises ValueError naming a config.json field that changes the model and
  that jzo does not implement."""
  if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
    raise ValueError(f"hidden_activation {hf['hidden_activation']!r} is not supported "
                     "(only gelu_pytorch_tanh)")
  if hf.get("attention_bias"):
    raise ValueError("attention_bias true is not supported")
  if hf.get("attention_dropout"):
    raise ValueError(f"attention_dropout {hf['attention_dropout']} is not supported "
                     "(jzo trains without dropout)")
  if hf.get("use_bidirectional_attention"):
    raise ValueError("use_bidirectional_attention true is not supported (only causal attention)")


def _rope_from_hf(hf: dict, model_type: str) -> dict:
  """GemmaConfig's RoPE fields from config.json, read as transformers 5
  reads them: Gemma 2's one `rope_parameters` (or the older `rope_scaling`),
  Gemma 3's nested by layer type with the older `rope_scaling` over the
  global layers'; a base absent from them is the top-level `rope_theta`
  (and Gemma 3's sliding layers' `rope_local_base_freq`), else the default."""
  theta, local_theta = _DEFAULTS[model_type]["thetas"]
  params, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
  theta = hf.get("rope_theta") or theta
  if model_type == "gemma2":
    full = local = scaling or params
    local_theta = theta
  else:
    full = (params.get(FULL) or {}) | scaling
    local = params.get(SLIDING) or {}
    local_theta = hf.get("rope_local_base_freq") or local_theta
  out = {}
  for spec, prefix, base in ((full, "rope_", theta), (local, "rope_local_", local_theta)):
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type not in ROPE_TYPES:
      raise ValueError(f"rope type {rope_type!r} is not supported (only {', '.join(ROPE_TYPES)})")
    if spec.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
      raise ValueError("partial_rotary_factor is not supported (only 1.0)")
    out[prefix + "theta"] = float(spec.get("rope_theta") or base)
    out[prefix + "factor"] = float(spec["factor"]) if rope_type == "linear" else 1.0
  return out


# The published shapes (each model's config.json on the Hugging Face hub;
# Gemma 3 4B-27B: the text_config of their image-text checkpoints).
_GEMMA2 = dict(vocab_size=256000, seq_len=8192, head_dim=256, sliding_window=4096,
               attn_softcap=50.0, final_softcap=30.0, model_type="gemma2")
_GEMMA3 = dict(vocab_size=262208, seq_len=131072, head_dim=256, sliding_window=1024,
               rope_theta=1e6, rope_factor=8.0, model_type="gemma3_text")
PRESETS = {
    # A CPU's: a sliding and a global layer, soft-capped as Gemma 2.
    "gemma-tiny": GemmaConfig(vocab_size=256, seq_len=128, n_layer=2, n_head=4, n_kv_head=2,
                              d_model=128, d_ff=384, head_dim=32, sliding_window=16,
                              attn_softcap=50.0, final_softcap=30.0, model_type="gemma2"),
    "gemma-2-2b": GemmaConfig(n_layer=26, n_head=8, n_kv_head=4, d_model=2304, d_ff=9216,
                              **_GEMMA2),
    "gemma-2-9b": GemmaConfig(n_layer=42, n_head=16, n_kv_head=8, d_model=3584, d_ff=14336,
                              **_GEMMA2),
    # 27B scales the scores by (d_model / n_head) ** -1/2, not head_dim's.
    "gemma-2-27b": GemmaConfig(n_layer=46, n_head=32, n_kv_head=16, d_model=4608, d_ff=36864,
                               **_GEMMA2 | dict(head_dim=128, query_pre_attn_scalar=144.0)),
    "gemma-3-1b": GemmaConfig(n_layer=26, n_head=4, n_kv_head=1, d_model=1152, d_ff=6912,
                              **_GEMMA3 | dict(vocab_size=262144, seq_len=32768,
                                               sliding_window=512, rope_factor=1.0)),
    "gemma-3-4b": GemmaConfig(n_layer=34, n_head=8, n_kv_head=4, d_model=2560, d_ff=10240,
                              **_GEMMA3),
    "gemma-3-12b": GemmaConfig(n_layer=48, n_head=16, n_kv_head=8, d_model=3840, d_ff=15360,
                               **_GEMMA3),
    "gemma-3-27b": GemmaConfig(n_layer=62, n_head=32, n_kv_head=16, d_model=5376, d_ff=21504,
                               **_GEMMA3 | dict(head_dim=128, query_pre_attn_scalar=168.0)),
}
