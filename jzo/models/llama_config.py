"""The Llama family's config: `LlamaConfig` (sizes, RoPE, attention and MLP
features, mixture of experts), its Hugging Face config.json form (`from_hf`,
`to_hf`), and the published shapes (`PRESETS`). The model itself is
jzo.models.llama."""

from __future__ import annotations

import dataclasses
import math

from jzo.models import hf_files
from jzo.models.common import REMAT_POLICIES

# Hugging Face model_type -> the class transformers builds for it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_MOE_TYPES = ("qwen3_moe", "mixtral")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab_size: int = 32000
  seq_len: int = 4096  # longest context (Hugging Face's max_position_embeddings)
  n_layer: int = 32
  n_head: int = 32  # query heads
  # Key/value heads (grouped-query attention): n_head for plain multi-head
  # attention; each K/V head serves n_head / n_kv_head query heads.
  n_kv_head: int = 32
  d_model: int = 4096
  d_ff: int = 11008  # the SwiGLU MLP's hidden width (intermediate_size)
  # Width of one head; None: d_model // n_head. Qwen3 and some Mistral
  # checkpoints set it apart from d_model (then H hd != D).
  head_dim: int | None = None
  rope_theta: float = 10000.0  # RoPE base wavelength
  # "default", "linear" (positions divided by rope_factor), "llama3"
  # (Llama 3.1's: low frequencies divided by rope_factor, a smooth ramp
  # between rope_low_freq_factor and rope_high_freq_factor) or "longrope"
  # (Phi-3's: each frequency divided by its rope_short_factor for sequences
  # up to rope_original_seq_len tokens, by its rope_long_factor past that;
  # cos and sin scaled by rope_attention_factor).
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0  # llama3 only
  rope_high_freq_factor: float = 4.0  # llama3 only
  rope_original_seq_len: int = 8192  # llama3, longrope: the context pre-training used
  rope_short_factor: tuple[float, ...] | None = None  # longrope: rotary_dim / 2 divisors
  rope_long_factor: tuple[float, ...] | None = None
  # longrope; None: transformers' default, sqrt(1 + ln factor / ln original) (1 if factor <= 1).
  rope_attention_factor: float | None = None
  # The share of each head that rotates (Phi-4-mini: 0.75): its first
  # rotary_dim = int(head_dim x this) dims; the rest pass through.
  partial_rotary_factor: float = 1.0
  norm_eps: float = 1e-5  # RMSNorm's epsilon (rms_norm_eps)
  tie_embeddings: bool = False  # logits through the input embedding (no lm_head)
  qkv_bias: bool = False  # biases on q, k, v (Qwen2; Llama's attention_bias)
  o_bias: bool = False  # a bias on the attention output (Llama's attention_bias)
  qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
  # Mistral's sliding-window attention: windows smaller than a sequence are
  # refused (forward raises) rather than computed as plain causal attention.
  sliding_window: int | None = None
  # Mixture of experts (Qwen3-MoE, Mixtral; 0: the dense MLP of width d_ff):
  # each layer's MLP is n_experts SwiGLU MLPs of width d_expert, of which a
  # router picks experts_per_token for each token (jzo.models.moe).
  n_experts: int = 0
  experts_per_token: int = 0
  d_expert: int = 0  # moe_intermediate_size (Mixtral: intermediate_size)
  norm_topk_prob: bool = False  # the top-k router weights rescaled to sum to 1
  # The load-balancing loss's weight in loss_fn (0: none).
  router_aux_loss_coef: float = 0.0
  # Which Hugging Face family to_hf writes (ARCHITECTURES' model types).
  model_type: str = "llama"
  # Token ids written back to config.json (generation stops at eos); None: unset.
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  # What the backward pass recomputes: "full" (each layer's activations:
  # least memory, one more forward), "dots" (saves the matmul outputs, redoes
  # the cheap elementwise ops and attention), "none" (saves everything).
  remat: str = "full"
  # "auto": cuDNN flash attention on GPU for bf16/fp16 (never materialises
  # the T x T scores), XLA's otherwise; or "cudnn" / "xla" to force one.
  attention: str = "auto"

  def __post_init__(self):
    if self.head_dim is None:
      if self.d_model % self.n_head:
        raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head} "
                         "(set head_dim)")
      object.__setattr__(self, "head_dim", self.d_model // self.n_head)
    if min(self.vocab_size, self.seq_len, self.n_layer, self.n_head, self.n_kv_head,
           self.d_model, self.d_ff, self.head_dim) < 1:
      raise ValueError(f"every size must be >= 1: {self}")
    if self.n_head % self.n_kv_head:
      raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
    if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
      raise ValueError(f"the rotated part of each head (head_dim {self.head_dim} x "
                       f"partial_rotary_factor {self.partial_rotary_factor}) must be even")
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"rope type {self.rope_type!r} is not supported (only "
                       f"{', '.join(ROPE_TYPES)})")
    if self.rope_type == "longrope":
      for name in ("rope_short_factor", "rope_long_factor"):
        if len(getattr(self, name) or ()) != self.rotary_dim // 2:
          raise ValueError(f"longrope's {name} must hold rotary_dim / 2 = "
                           f"{self.rotary_dim // 2} factors, got {getattr(self, name)}")
      if self.rope_attention_factor is None:
        factor, original = self.rope_factor, self.rope_original_seq_len
        object.__setattr__(self, "rope_attention_factor", 1.0 if factor <= 1 else math.sqrt(
            1 + math.log(factor) / math.log(original)))
    if self.n_experts and not (1 <= self.experts_per_token <= self.n_experts
                               and self.d_expert >= 1):
      raise ValueError(f"a mixture of {self.n_experts} experts needs 1 <= experts_per_token "
                       f"<= n_experts and d_expert >= 1, got {self.experts_per_token} and "
                       f"{self.d_expert}")
    if self.model_type not in ARCHITECTURES:
      raise ValueError(f"model_type {self.model_type!r} is not supported (only "
                       f"{', '.join(ARCHITECTURES)})")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}")
    if self.attention not in ("auto", "cudnn", "xla"):
      raise ValueError(f"attention must be auto, cudnn or xla, got {self.attention!r}")

  @property
  def rotary_dim(self) -> int:
    """How many of each head's leading dims RoPE rotates."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def n_params(self) -> int:
    """Parameters: V D (twice untied) + D + L (2 D + D (H + 2 K) hd + H hd D
    + the MLP), plus the biases and q/k norms where the config has them. The
    MLP: 3 D F dense; with experts, the router D E and every expert's 3 D I."""
    return self._params(self.n_experts)

  @property
  def n_active_params(self) -> int:
    """The parameters one token computes with: n_params with only the
    experts_per_token experts the router picks (all of them when dense)."""
    return self._params(self.experts_per_token)

  def _params(self, experts: int) -> int:
    """The parameter count with `experts` of a mixture's experts."""
    D, hd = self.d_model, self.head_dim
    qkv = (self.n_head + 2 * self.n_kv_head) * hd
    if self.n_experts:  # the router and the experts
      mlp = D * self.n_experts + experts * 3 * D * self.d_expert
    else:
      mlp = 3 * D * self.d_ff
    layer = 2 * D + D * qkv + self.n_head * hd * D + mlp
    layer += qkv * self.qkv_bias + D * self.o_bias + 2 * hd * self.qk_norm
    embeddings = self.vocab_size * D * (1 if self.tie_embeddings else 2)
    return embeddings + D + self.n_layer * layer

  def flops_per_token(self, seq_len: int | None = None) -> float:
    """Model FLOPs of one training token, forward and backward: 6 N for the
    matmuls plus 12 L (H hd) T for attention scores and values (Chowdhery et
    al., PaLM, 2022, appendix B); recomputation is not counted. N counts
    the active parameters (n_active_params: a mixture's routed experts only)."""
    attention = 12 * self.n_layer * self.n_head * self.head_dim * (seq_len or self.seq_len)
    return 6 * self.n_active_params + attention

  @classmethod
  def from_hf(cls, hf: dict, **overrides) -> LlamaConfig:
    """The config of a Hugging Face config.json (as a dict) of a model_type
    in ARCHITECTURES; `overrides` set jzo's own fields (remat, attention).
    Missing optional keys take transformers' defaults.

    Raises:
      ValueError: an unknown model_type, a rope type not in ROPE_TYPES, or a
        feature this model lacks (dropout, Qwen3-MoE's dense layers, ...),
        in one line naming it.
    """
    model_type = hf.get("model_type")
    hf_files.check_config(hf, ARCHITECTURES)
    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("mlp_bias"):
      raise ValueError("mlp_bias is not supported")
    for key in ("attention_dropout", "resid_pdrop", "embd_pdrop"):
      if hf.get(key):
        raise ValueError(f"{key} {hf[key]} is not supported (jzo trains without dropout)")
    heads = hf["num_attention_heads"]
    # transformers' defaults where a key is absent: Qwen3's head_dim is 128,
    # Mistral slides a 4,096-token window, Qwen slides only when told to,
    # Phi-3 and Mixtral where sliding_window is set.
    head_dim = hf.get("head_dim") or (128 if model_type == "qwen3"
                                      else hf["hidden_size"] // heads)
    window = hf.get("sliding_window", None if model_type in ("phi3", "mixtral") else 4096)
    if model_type == "llama" or (model_type.startswith("qwen")
                                 and not hf.get("use_sliding_window")):
      window = None
    bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    fields = dict(
        vocab_size=hf["vocab_size"], seq_len=hf.get("max_position_embeddings", 2048),
        n_layer=hf["num_hidden_layers"], n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads, d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"], head_dim=head_dim,
        norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=bias or model_type == "qwen2",
        o_bias=bias and model_type in ("llama", "qwen3", "qwen3_moe"),
        qk_norm=model_type in ("qwen3", "qwen3_moe"), sliding_window=window,
        model_type=model_type, bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=hf.get("pad_token_id"))
    return cls(**fields | _rope_from_hf(hf) | _moe_from_hf(hf) | overrides)

  def to_hf(self) -> dict:
    """This config as a Hugging Face config.json dict (without the dtype,
    which belongs to the weights). RoPE is written in both spellings, the
    older `rope_theta`/`rope_scaling` and transformers 5's `rope_parameters`,
    so either generation of transformers reads it.

    Raises:
      ValueError: the config has a feature its model_type cannot express.
    """
    biases = (self.qkv_bias, self.o_bias, self.qk_norm)
    expressible = {"llama": self.qkv_bias == self.o_bias and not self.qk_norm,
                   "mistral": not any(biases), "phi3": not any(biases),
                   "mixtral": not any(biases) and self.norm_topk_prob,
                   "qwen2": self.qkv_bias and not (self.o_bias or self.qk_norm),
                   "qwen3": self.qkv_bias == self.o_bias and self.qk_norm,
                   "qwen3_moe": self.qkv_bias == self.o_bias and self.qk_norm}
    if not expressible[self.model_type] or (
        (self.model_type in _MOE_TYPES) != bool(self.n_experts)) or (
        self.partial_rotary_factor != 1 and self.model_type != "phi3"):
      raise ValueError(f"model_type {self.model_type} has no form for qkv_bias={self.qkv_bias}, "
                       f"o_bias={self.o_bias}, qk_norm={self.qk_norm}, n_experts="
                       f"{self.n_experts}, norm_topk_prob={self.norm_topk_prob}, "
                       f"partial_rotary_factor={self.partial_rotary_factor}")
    scaling = None
    if self.rope_type == "linear":
      scaling = {"rope_type": "linear", "factor": self.rope_factor}
    elif self.rope_type == "llama3":
      scaling = {"rope_type": "llama3", "factor": self.rope_factor,
                 "low_freq_factor": self.rope_low_freq_factor,
                 "high_freq_factor": self.rope_high_freq_factor,
                 "original_max_position_embeddings": self.rope_original_seq_len}
    elif self.rope_type == "longrope":
      scaling = {"rope_type": "longrope", "short_factor": list(self.rope_short_factor),
                 "long_factor": list(self.rope_long_factor), "factor": self.rope_factor,
                 "attention_factor": self.rope_attention_factor,
                 "original_max_position_embeddings": self.rope_original_seq_len}
    parameters = {"rope_type": self.rope_type, "rope_theta": self.rope_theta, **(scaling or {})}
    if self.model_type == "phi3":
      parameters["partial_rotary_factor"] = self.partial_rotary_factor
    eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
    hf = {
        "architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type,
        "vocab_size": self.vocab_size, "max_position_embeddings": self.seq_len,
        "hidden_size": self.d_model, "intermediate_size": self.d_ff,
        "num_hidden_layers": self.n_layer, "num_attention_heads": self.n_head,
        "num_key_value_heads": self.n_kv_head, "head_dim": self.head_dim,
        "hidden_act": "silu", "rms_norm_eps": self.norm_eps, "initializer_range": 0.02,
        "rope_theta": self.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters,
        "tie_word_embeddings": self.tie_embeddings, "attention_dropout": 0.0,
        "bos_token_id": self.bos_token_id, "eos_token_id": eos,
        "pad_token_id": self.pad_token_id, "use_cache": True,
    }
    if self.model_type in ("llama", "qwen3", "qwen3_moe"):
      hf["attention_bias"] = self.qkv_bias
    if self.model_type == "llama":
      hf["mlp_bias"] = False
    if self.model_type in ("mistral", "phi3", "mixtral"):
      hf["sliding_window"] = self.sliding_window
    if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
      hf.update(use_sliding_window=self.sliding_window is not None,
                sliding_window=self.sliding_window)
    if self.model_type in ("qwen2", "qwen3"):
      # Window on every layer (max_window_layers 0): what forward's refusal assumes.
      hf["max_window_layers"] = 0
    if self.model_type == "phi3":
      hf.update(partial_rotary_factor=self.partial_rotary_factor, resid_pdrop=0.0,
                embd_pdrop=0.0, original_max_position_embeddings=self.rope_original_seq_len)
    if self.n_experts:
      hf.update(num_experts_per_tok=self.experts_per_token, output_router_logits=False,
                router_aux_loss_coef=self.router_aux_loss_coef)
    if self.model_type == "qwen3_moe":
      hf.update(num_experts=self.n_experts, moe_intermediate_size=self.d_expert,
                norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    if self.model_type == "mixtral":
      hf.update(num_local_experts=self.n_experts, intermediate_size=self.d_expert,
                router_jitter_noise=0.0)
    return hf


def _rope_from_hf(hf: dict) -> dict:
  """LlamaConfig's rope fields from config.json: `rope_scaling` (older
  transformers, beside a top-level `rope_theta`) or transformers 5's
  `rope_parameters` (theta inside). Phi-3 calls longrope "su" or "yarn" in
  older files, and keeps original_max_position_embeddings at the top level."""
  model_type = hf.get("model_type")
  scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if model_type == "phi3" and rope_type in ("su", "yarn"):
    rope_type = "longrope"
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"rope type {rope_type!r} is not supported (only {', '.join(ROPE_TYPES)})")
  partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial != 1.0 and model_type != "phi3":
    raise ValueError(f"partial_rotary_factor is not supported for {model_type} (only 1.0, "
                     f"got {partial})")
  theta = hf.get("rope_theta") or hf.get("rope_parameters", {}).get(
      "rope_theta", 1e6 if model_type == "mixtral" else 10000.0)
  fields = {"rope_theta": float(theta), "rope_type": rope_type,
            "partial_rotary_factor": float(partial)}
  if rope_type in ("linear", "llama3"):
    fields["rope_factor"] = float(scaling["factor"])
  if rope_type == "llama3":
    fields.update(rope_low_freq_factor=float(scaling["low_freq_factor"]),
                  rope_high_freq_factor=float(scaling["high_freq_factor"]),
                  rope_original_seq_len=int(scaling["original_max_position_embeddings"]))
  if model_type == "phi3":  # written whatever the rope type; longrope reads it
    fields["rope_original_seq_len"] = int(hf.get("original_max_position_embeddings", 4096))
  if rope_type == "longrope":
    seq_len = hf.get("max_position_embeddings", 2048)
    original = fields.setdefault("rope_original_seq_len", int(scaling.get(
        "original_max_position_embeddings", seq_len)))
    attention = scaling.get("attention_factor")
    fields.update(rope_factor=float(scaling.get("factor") or seq_len / original),
                  rope_short_factor=tuple(map(float, scaling["short_factor"])),
                  rope_long_factor=tuple(map(float, scaling["long_factor"])),
                  rope_attention_factor=None if attention is None else float(attention))
  return fields


def _moe_from_hf(hf: dict) -> dict:
  """LlamaConfig's mixture-of-experts fields from config.json (none for a
  dense model_type), refusing, in one line, what changes the math and jzo
  does not compute: Qwen3-MoE's dense layers, router jitter, shared experts."""
  model_type = hf.get("model_type")
  if model_type not in _MOE_TYPES:
    return {}
  refused = {"mlp_only_layers": bool(hf.get("mlp_only_layers")),
             "decoder_sparse_step": hf.get("decoder_sparse_step", 1) != 1,
             "router_jitter_noise": bool(hf.get("router_jitter_noise")),
             "shared_expert_intermediate_size": bool(hf.get("shared_expert_intermediate_size")),
             "n_shared_experts": bool(hf.get("n_shared_experts")),
             "num_shared_experts": bool(hf.get("num_shared_experts"))}
  for key, wrong in refused.items():
    if wrong:
      raise ValueError(f"{key} {hf[key]} is not supported (every layer's MLP is the routed "
                       "experts alone)")
  qwen = model_type == "qwen3_moe"
  experts = hf.get("num_experts", hf.get("num_local_experts", 128 if qwen else 8))
  if not experts:
    raise ValueError(f"num_experts {experts} is not supported (a {model_type} model needs "
                     "experts)")
  return dict(n_experts=experts, experts_per_token=hf.get("num_experts_per_tok", 8 if qwen else 2),
              d_expert=hf.get("moe_intermediate_size", 768) if qwen else hf["intermediate_size"],
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if qwen else True,
              router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


_LLAMA3_ROPE = dict(rope_theta=500000.0, rope_type="llama3", rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0, rope_original_seq_len=8192)
_QWEN25 = dict(vocab_size=152064, seq_len=32768, rope_theta=1e6, qkv_bias=True,
               model_type="qwen2", bos_token_id=151643, eos_token_id=151643)

# The published shapes (each model's config.json on the Hugging Face hub).
PRESETS = {
    "llama-tiny": LlamaConfig(vocab_size=256, seq_len=128, n_layer=2, n_head=4, n_kv_head=2,
                              d_model=128, d_ff=384),
    "llama-3.2-1b": LlamaConfig(vocab_size=128256, seq_len=131072, n_layer=16, n_head=32,
                                n_kv_head=8, d_model=2048, d_ff=8192, head_dim=64,
                                rope_factor=32.0, tie_embeddings=True, bos_token_id=128000,
                                eos_token_id=128001, **_LLAMA3_ROPE),
    "llama-3.2-3b": LlamaConfig(vocab_size=128256, seq_len=131072, n_layer=28, n_head=24,
                                n_kv_head=8, d_model=3072, d_ff=8192, head_dim=128,
                                rope_factor=32.0, tie_embeddings=True, bos_token_id=128000,
                                eos_token_id=128001, **_LLAMA3_ROPE),
    "llama-3.1-8b": LlamaConfig(vocab_size=128256, seq_len=131072, n_layer=32, n_head=32,
                                n_kv_head=8, d_model=4096, d_ff=14336, rope_factor=8.0,
                                bos_token_id=128000, eos_token_id=128001, **_LLAMA3_ROPE),
    "llama-3.1-70b": LlamaConfig(vocab_size=128256, seq_len=131072, n_layer=80, n_head=64,
                                 n_kv_head=8, d_model=8192, d_ff=28672, rope_factor=8.0,
                                 bos_token_id=128000, eos_token_id=128001, **_LLAMA3_ROPE),
    "llama-2-13b": LlamaConfig(vocab_size=32000, seq_len=4096, n_layer=40, n_head=40,
                               n_kv_head=40, d_model=5120, d_ff=13824, bos_token_id=1,
                               eos_token_id=2),
    # v0.3: the vocabulary grown to 32,768 and no sliding window.
    "mistral-7b": LlamaConfig(vocab_size=32768, seq_len=32768, n_layer=32, n_head=32,
                              n_kv_head=8, d_model=4096, d_ff=14336, rope_theta=1e6,
                              model_type="mistral", bos_token_id=1, eos_token_id=2),
    # 32,768 tokens: the context Qwen2.5 pre-trains on (longer takes YaRN).
    "qwen2.5-7b": LlamaConfig(n_layer=28, n_head=28, n_kv_head=4, d_model=3584, d_ff=18944,
                              norm_eps=1e-6, **_QWEN25),
    "qwen2.5-14b": LlamaConfig(n_layer=48, n_head=40, n_kv_head=8, d_model=5120, d_ff=13824,
                               norm_eps=1e-5, **_QWEN25),
    "qwen2.5-72b": LlamaConfig(n_layer=80, n_head=64, n_kv_head=8, d_model=8192, d_ff=29568,
                               norm_eps=1e-5, **_QWEN25),
    "phi-4": LlamaConfig(vocab_size=100352, seq_len=16384, n_layer=40, n_head=40, n_kv_head=10,
                         d_model=5120, d_ff=17920, rope_theta=250000.0,
                         rope_original_seq_len=16384, model_type="phi3", bos_token_id=100257,
                         eos_token_id=100257, pad_token_id=100257),
    # 128 experts of 768, 8 a token: 3.3B of the 30.5B parameters active.
    "qwen3-30b-a3b": LlamaConfig(vocab_size=151936, seq_len=40960, n_layer=48, n_head=32,
                                 n_kv_head=4, d_model=2048, d_ff=6144, head_dim=128,
                                 rope_theta=1e6, norm_eps=1e-6, qk_norm=True, n_experts=128,
                                 experts_per_token=8, d_expert=768, norm_topk_prob=True,
                                 router_aux_loss_coef=0.001, model_type="qwen3_moe",
                                 bos_token_id=151643, eos_token_id=151645),
    # 8 experts of 14,336, 2 a token: 12.9B of the 46.7B parameters active.
    "mixtral-8x7b": LlamaConfig(vocab_size=32000, seq_len=32768, n_layer=32, n_head=32,
                                n_kv_head=8, d_model=4096, d_ff=14336, rope_theta=1e6,
                                n_experts=8, experts_per_token=2, d_expert=14336,
                                norm_topk_prob=True, router_aux_loss_coef=0.02,
                                model_type="mixtral", bos_token_id=1, eos_token_id=2),
}
