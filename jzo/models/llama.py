"""The Llama family (Llama 2 and 3, Mistral, Qwen2 and Qwen3) in Flax NNX.

`Llama` is the module; `init_params`, `forward` and `loss_fn` are the same
model as functions of a nested dict of arrays, which is what the ZeRO engine
partitions and trains (jzo.models.common's functional view). Pre-RMSNorm
blocks with rotary position embeddings, grouped-query causal attention
through jax.nn.dot_product_attention (cuDNN flash attention on GPU) and a
SwiGLU MLP; tied or untied output embeddings; Qwen2's q/k/v biases and
Qwen3's per-head q/k norms. The layers are stored stacked (leading axis =
layer, under `LAYERS`) and run by `jzo.scan_layers` with a choice of rematerialization;
each scan step passes its layer's params through `jzo.gather_layer`, so ZeRO
stage 3 gathers one layer at a time.

Layout: q, k and v are one matrix `qkv` (D, (H + 2 K) hd) and the MLP's gate
and up one matrix `gate_up` (D, 2 F), so each runs as one matmul; kernels
are (in, out). jzo.models.hf converts to and from Hugging Face's tensors.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jzo.models import common, cross_entropy, rope
from jzo.models.common import REMAT_POLICIES, attention_implementation

# Dotted path of the stacked layers in the params (ZeroEngine's `layers=`).
LAYERS = "layers"
# Hugging Face model_type -> the class transformers builds for it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")


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
  # "default", "linear" (positions divided by rope_factor) or "llama3"
  # (Llama 3.1's: low frequencies divided by rope_factor, a smooth ramp
  # between rope_low_freq_factor and rope_high_freq_factor).
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0  # llama3 only
  rope_high_freq_factor: float = 4.0  # llama3 only
  rope_original_seq_len: int = 8192  # llama3 only: the context pre-training used
  norm_eps: float = 1e-5  # RMSNorm's epsilon (rms_norm_eps)
  tie_embeddings: bool = False  # logits through the input embedding (no lm_head)
  qkv_bias: bool = False  # biases on q, k, v (Qwen2; Llama's attention_bias)
  o_bias: bool = False  # a bias on the attention output (Llama's attention_bias)
  qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
  # Mistral's sliding-window attention: windows smaller than a sequence are
  # refused (forward raises) rather than computed as plain causal attention.
  sliding_window: int | None = None
  # Which Hugging Face family to_hf writes (llama, mistral, qwen2, qwen3).
  model_type: str = "llama"
  # Token ids written back to config.json (generation stops at eos); None: unset.
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
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
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"rope type {self.rope_type!r} is not supported (only "
                       f"{', '.join(ROPE_TYPES)})")
    if self.model_type not in ARCHITECTURES:
      raise ValueError(f"model_type {self.model_type!r} is not supported (only "
                       f"{', '.join(ARCHITECTURES)})")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}")
    if self.attention not in ("auto", "cudnn", "xla"):
      raise ValueError(f"attention must be auto, cudnn or xla, got {self.attention!r}")

  @property
  def n_params(self) -> int:
    """Parameters: V D (twice untied) + D + L (2 D + D (H + 2 K) hd + H hd D
    + 3 D F), plus the biases and q/k norms where the config has them."""
    D, hd = self.d_model, self.head_dim
    qkv = (self.n_head + 2 * self.n_kv_head) * hd
    layer = 2 * D + D * qkv + self.n_head * hd * D + 3 * D * self.d_ff
    layer += qkv * self.qkv_bias + D * self.o_bias + 2 * hd * self.qk_norm
    embeddings = self.vocab_size * D * (1 if self.tie_embeddings else 2)
    return embeddings + D + self.n_layer * layer

  def flops_per_token(self, seq_len: int | None = None) -> float:
    """Model FLOPs of one training token, forward and backward: 6 N for the
    matmuls plus 12 L (H hd) T for attention scores and values (Chowdhery et
    al., PaLM, 2022, appendix B); recomputation is not counted."""
    attention = 12 * self.n_layer * self.n_head * self.head_dim * (seq_len or self.seq_len)
    return 6 * self.n_params + attention

  @classmethod
  def from_hf(cls, hf: dict, **overrides) -> LlamaConfig:
    """The config of a Hugging Face config.json (as a dict) of model_type
    llama, mistral, qwen2 or qwen3; `overrides` set jzo's own fields (remat,
    attention). Missing optional keys take transformers' defaults.

    Raises:
      ValueError: an unknown model_type, a rope type other than default,
        linear or llama3, or a feature this model lacks, naming it.
    """
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
      raise ValueError(f"model_type {model_type!r} is not supported (only "
                       f"{', '.join(ARCHITECTURES)})")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
      if key not in hf:
        raise ValueError(f"config has no {key!r}")
    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("mlp_bias"):
      raise ValueError("mlp_bias is not supported")
    heads = hf["num_attention_heads"]
    # transformers' defaults where a key is absent: Qwen3's head_dim is 128,
    # Mistral slides a 4,096-token window, Qwen slides only when told to.
    head_dim = hf.get("head_dim") or (128 if model_type == "qwen3"
                                      else hf["hidden_size"] // heads)
    window = hf.get("sliding_window", 4096)
    if model_type == "llama" or (model_type != "mistral" and not hf.get("use_sliding_window")):
      window = None
    bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    fields = dict(
        vocab_size=hf["vocab_size"], seq_len=hf.get("max_position_embeddings", 2048),
        n_layer=hf["num_hidden_layers"], n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads, d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"], head_dim=head_dim,
        norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=bias or model_type == "qwen2", o_bias=bias and model_type in ("llama", "qwen3"),
        qk_norm=model_type == "qwen3", sliding_window=window, model_type=model_type,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos)
    return cls(**fields | _rope_from_hf(hf) | overrides)

  def to_hf(self) -> dict:
    """This config as a Hugging Face config.json dict (without the dtype,
    which belongs to the weights). RoPE is written in both spellings, the
    older `rope_theta`/`rope_scaling` and transformers 5's `rope_parameters`,
    so either generation of transformers reads it.

    Raises:
      ValueError: the config has a feature its model_type cannot express.
    """
    expressible = {"llama": self.qkv_bias == self.o_bias and not self.qk_norm,
                   "mistral": not (self.qkv_bias or self.o_bias or self.qk_norm),
                   "qwen2": self.qkv_bias and not (self.o_bias or self.qk_norm),
                   "qwen3": self.qkv_bias == self.o_bias and self.qk_norm}
    if not expressible[self.model_type]:
      raise ValueError(f"model_type {self.model_type} has no form for qkv_bias={self.qkv_bias}, "
                       f"o_bias={self.o_bias}, qk_norm={self.qk_norm}")
    scaling = None
    if self.rope_type == "linear":
      scaling = {"rope_type": "linear", "factor": self.rope_factor}
    elif self.rope_type == "llama3":
      scaling = {"rope_type": "llama3", "factor": self.rope_factor,
                 "low_freq_factor": self.rope_low_freq_factor,
                 "high_freq_factor": self.rope_high_freq_factor,
                 "original_max_position_embeddings": self.rope_original_seq_len}
    eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
    hf = {
        "architectures": [ARCHITECTURES[self.model_type]], "model_type": self.model_type,
        "vocab_size": self.vocab_size, "max_position_embeddings": self.seq_len,
        "hidden_size": self.d_model, "intermediate_size": self.d_ff,
        "num_hidden_layers": self.n_layer, "num_attention_heads": self.n_head,
        "num_key_value_heads": self.n_kv_head, "head_dim": self.head_dim,
        "hidden_act": "silu", "rms_norm_eps": self.norm_eps, "initializer_range": 0.02,
        "rope_theta": self.rope_theta, "rope_scaling": scaling,
        "rope_parameters": {"rope_type": self.rope_type, "rope_theta": self.rope_theta,
                            **(scaling or {})},
        "tie_word_embeddings": self.tie_embeddings, "attention_dropout": 0.0,
        "bos_token_id": self.bos_token_id, "eos_token_id": eos, "use_cache": True,
    }
    if self.model_type in ("llama", "qwen3"):
      hf["attention_bias"] = self.qkv_bias
    if self.model_type == "llama":
      hf["mlp_bias"] = False
    if self.model_type == "mistral":
      hf["sliding_window"] = self.sliding_window
    if self.model_type in ("qwen2", "qwen3"):
      # Window on every layer (max_window_layers 0): what forward's refusal assumes.
      hf.update(use_sliding_window=self.sliding_window is not None,
                sliding_window=self.sliding_window, max_window_layers=0)
    return hf


def _rope_from_hf(hf: dict) -> dict:
  """LlamaConfig's rope fields from config.json: `rope_scaling` (older
  transformers, beside a top-level `rope_theta`) or transformers 5's
  `rope_parameters` (theta inside)."""
  scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"rope type {rope_type!r} is not supported (only {', '.join(ROPE_TYPES)})")
  if scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError("partial_rotary_factor is not supported (only 1.0)")
  theta = hf.get("rope_theta") or hf.get("rope_parameters", {}).get("rope_theta", 10000.0)
  fields = {"rope_theta": float(theta), "rope_type": rope_type}
  if rope_type != "default":
    fields["rope_factor"] = float(scaling["factor"])
  if rope_type == "llama3":
    fields.update(rope_low_freq_factor=float(scaling["low_freq_factor"]),
                  rope_high_freq_factor=float(scaling["high_freq_factor"]),
                  rope_original_seq_len=int(scaling["original_max_position_embeddings"]))
  return fields


def activation_bytes(config: LlamaConfig, batch: int, seq_len: int | None = None,
                     itemsize: int = 2, accumulation: int = 1) -> int:
  """Bytes of activations one device needs at the peak of a training step
  with `batch` sequences (its micro-batch): what the scan saves for the
  backward pass, plus the larger of the loss's (`cross_entropy.loss_bytes`:
  one chunk of logits at a time, where all of them would often be the peak
  with vocabularies of 128-152k) and one layer's recomputed intermediates
  and gradients. accumulation: as gpt.activation_bytes'.

  Per token and layer (Q = H hd, KV = K hd), `remat` full saves the layer
  input (D values), dots also the matmul outputs (qkv Q + 2 KV, o D, gate_up
  2 F, down D), none every intermediate (6 D + 3 Q + 3 KV + 4 F: norms,
  residuals, rotated q and k, attention output, the MLP's gate, up, silu and
  product). One layer's backward holds its intermediates plus the gate_up
  gradient (2 F). The same count as gpt.activation_bytes. On an H100,
  llama-3.1-8b at micro-batch 4 of 4096 with offload auto peaked at 70.50
  GiB against a plan of 70.71 (docs/results.md).
  """
  T = seq_len or config.seq_len
  tokens = batch * T
  D, F = config.d_model, config.d_ff
  Q, KV = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
  everything = 6 * D + 3 * Q + 3 * KV + 4 * F
  saved_per_layer = {"full": D, "dots": 3 * D + Q + 2 * KV + 2 * F,
                     "none": everything}[config.remat]
  saved = config.n_layer * tokens * saved_per_layer * itemsize
  loss = cross_entropy.loss_bytes(tokens, config.vocab_size, D, itemsize)
  layer = tokens * (everything + 2 * F) * itemsize
  return common.layers_first_bytes(saved, tokens * D * itemsize, accumulation) + max(loss, layer)


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
}


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with float32 statistics. As in Hugging Face's
  Llama, the normalised input is cast back to its dtype before the scale
  multiplies it, so bf16 training matches the checkpoint's own arithmetic."""

  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,)))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
    return normed.astype(x.dtype) * self.scale[...]


class Block(nnx.Module):
  """One pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    D, hd, eps = config.d_model, config.head_dim, config.norm_eps
    qkv = (config.n_head + 2 * config.n_kv_head) * hd

    # Hugging Face's initialisation: every matrix N(0, 0.02), biases zero.
    def linear(n_in, n_out, bias=False):
      return nnx.Linear(n_in, n_out, use_bias=bias, kernel_init=nnx.initializers.normal(0.02),
                        rngs=rngs)
    self.config = config
    self.attn_norm, self.mlp_norm = RMSNorm(D, eps), RMSNorm(D, eps)
    self.qkv = linear(D, qkv, config.qkv_bias)
    self.o = linear(config.n_head * hd, D, config.o_bias)
    if config.qk_norm:
      self.q_norm, self.k_norm = RMSNorm(hd, eps), RMSNorm(hd, eps)
    self.gate_up, self.down = linear(D, 2 * config.d_ff), linear(config.d_ff, D)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:  # (B, T, D)
    q, k, v = self.attention_inputs(x, cos, sin)
    # K/V keep their K heads: dot_product_attention groups the H query heads over them.
    impl = attention_implementation(self.config.attention, self.config.head_dim, x.dtype)
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    return self.after_attention(x, att)

  def attention_inputs(self, x: jax.Array, cos: jax.Array,
                       sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q (B, T, H, hd), k and v (B, T, K, hd) of x (B, T, D), q and k
    rotated by cos, sin ((T, hd / 2), or (B, T, hd / 2) per row)."""
    config = self.config
    B, T, _ = x.shape
    H, K, hd = config.n_head, config.n_kv_head, config.head_dim
    qkv = self.qkv(self.attn_norm(x)).reshape(B, T, H + 2 * K, hd)
    q, k, v = qkv[:, :, :H], qkv[:, :, H:H + K], qkv[:, :, H + K:]  # (B, T, H|K|K, hd)
    if config.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    return rope.rotate(q, cos, sin), rope.rotate(k, cos, sin), v

  def after_attention(self, x: jax.Array, att: jax.Array) -> jax.Array:
    """The block's output (B, T, D) from its input x and the attention's (B, T, H, hd)."""
    B, T, _ = x.shape
    x = x + self.o(att.reshape(B, T, self.config.n_head * self.config.head_dim))  # (B, T, D)
    gate, up = jnp.split(self.gate_up(self.mlp_norm(x)), 2, axis=-1)  # each (B, T, F)
    return x + self.down(jax.nn.silu(gate) * up)


class Llama(nnx.Module):
  """Token embeddings, a stack of blocks (params stacked on a leading layer
  axis, run as a scan), a final RMSNorm, and logits through `lm_head` (V, D),
  or the embedding itself when tied."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.config = config
    # Plain Params rather than nnx.Embed, which computes in float32 whatever
    # the params' dtype; the engine hands the model bf16 or fp16 params.
    normal = lambda *shape: nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), shape))
    self.embed = normal(config.vocab_size, config.d_model)  # (V, D)
    self.layers = common.stacked_layers(lambda rngs: Block(config, rngs=rngs), config.n_layer,
                                        rngs)
    self.norm = RMSNorm(config.d_model, config.norm_eps)
    if not config.tie_embeddings:
      self.lm_head = normal(config.vocab_size, config.d_model)  # (V, D)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits (B, T, V) for int tokens (B, T), in the params' dtype."""
    return self.hidden(tokens) @ self.head().T

  def head(self) -> jax.Array:
    """The output projection (V, D): lm_head, or the embedding when tied."""
    return (self.embed if self.config.tie_embeddings else self.lm_head)[...]

  def hidden(self, tokens: jax.Array) -> jax.Array:
    """The last hidden states (B, T, D), after the final RMSNorm: the logits
    are these times `head()`, transposed."""
    config = self.config
    T = tokens.shape[1]
    if T > config.seq_len:
      raise ValueError(f"sequence of {T} tokens is longer than the model's {config.seq_len}")
    if config.sliding_window is not None and T > config.sliding_window:
      raise ValueError(f"sequence of {T} tokens is longer than the model's sliding window of "
                       f"{config.sliding_window}, which jzo does not implement")
    cos, sin = rope.cos_sin(config, jnp.arange(T, dtype=jnp.float32))  # each (T, hd / 2)
    x = self.embed[...][tokens]  # (B, T, D)
    return self.norm(common.scan_layers(self.layers, x, config.remat, cos, sin))

  def prefill(self, tokens: jax.Array, last: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """Float32 logits (B, V) at positions `last` (B,) of prompts `tokens`
    (B, T) from position 0, and `cache` (common.kv_cache's) holding their
    keys and values."""
    cos, sin = rope.cos_sin(self.config, jnp.arange(tokens.shape[1], dtype=jnp.float32))
    x, cache = common.prefill_layers(self.layers, self.embed[...][tokens], cache, cos, sin)
    return self.logits(x[jnp.arange(x.shape[0]), last]), cache

  def decode(self, tokens: jax.Array, positions: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """Float32 logits (B, V) after one token a row, `tokens` (B,) at
    `positions` (B,), and `cache` with their keys and values added."""
    # cos, sin: each (B, 1, hd / 2)
    cos, sin = rope.cos_sin(self.config, positions[:, None].astype(jnp.float32))
    x = self.embed[...][tokens[:, None]]  # (B, 1, D)
    x, cache = common.decode_layers(self.layers, x, cache, positions, cos, sin)
    return self.logits(x[:, 0]), cache

  def logits(self, x: jax.Array) -> jax.Array:
    """Float32 logits (B, V) of the last layer's output x (B, D)."""
    return (self.norm(x) @ self.head().T).astype(jnp.float32)


def init_params(config: LlamaConfig, key: jax.Array, dtype=jnp.float32) -> dict:
  """A new model's parameters as a nested dict of arrays: what the ZeRO
  engine partitions and trains, and `forward` turns back into the module."""
  return common.init_params(Llama, config, key, dtype)


def forward(config: LlamaConfig, params: dict, tokens: jax.Array) -> jax.Array:
  """Logits (B, T, V) for int tokens (B, T), in the params' dtype.

  Raises:
    ValueError: T is longer than config.seq_len or the sliding window.
  """
  return common.bind(Llama, config, params)(tokens)


def loss_fn(config: LlamaConfig, params: dict, batch: dict) -> jax.Array:
  """Next-token cross-entropy, averaged over all B T positions.

  Args:
    batch: "tokens", int (B, T + 1); optionally "loss_weight", float32
      (B, T): each position's cross-entropy is multiplied by its weight
      before the mean over all B T positions (a 0/1 answer mask scaled by
      positions / answer tokens of the whole step puts the loss on answer
      tokens, normalised across devices and micro-batches).
  """
  tokens = batch["tokens"]
  model = common.bind(Llama, config, params)
  return cross_entropy.cross_entropy(model.hidden(tokens[:, :-1]), model.head(), tokens[:, 1:],
                                     batch.get("loss_weight"))


def prefill(config: LlamaConfig, params: dict, tokens: jax.Array, last: jax.Array,
            cache: dict) -> tuple[jax.Array, dict]:
  """Llama.prefill as a function of the params: float32 logits (B, V) at
  positions `last` (B,) of prompts `tokens` (B, T), and the filled cache."""
  return common.bind(Llama, config, params).prefill(tokens, last, cache)


def decode(config: LlamaConfig, params: dict, tokens: jax.Array, positions: jax.Array,
           cache: dict) -> tuple[jax.Array, dict]:
  """Llama.decode as a function of the params: float32 logits (B, V) after
  `tokens` (B,) at `positions` (B,), and the cache with them added."""
  return common.bind(Llama, config, params).decode(tokens, positions, cache)


def init_cache(config: LlamaConfig, batch: int, length: int, dtype) -> dict:
  """An empty key/value cache for `batch` sequences of up to `length` tokens."""
  return common.kv_cache(config.n_layer, batch, length, config.n_kv_head, config.head_dim, dtype)


def context_length(config: LlamaConfig) -> int:
  """The most tokens a sequence may hold: the context, or the sliding window where
  it is shorter (jzo does not slide it)."""
  return min(config.seq_len, config.sliding_window or config.seq_len)
