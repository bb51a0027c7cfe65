"""A GPT-2 style language model in Flax NNX.

`GPT` is the module; `init_params`, `forward` and `loss_fn` are the same
model as functions of a nested dict of arrays, which is what the ZeRO engine
partitions and trains. Pre-LayerNorm blocks, causal attention through jax.nn.dot_product_attention
(cuDNN flash attention on GPU), tied input/output embeddings, the layer stack
stored stacked (leading axis = layer) and run by `jzo.scan_layers` with a
choice of rematerialization. Each scan step passes its layer's params through
`jzo.gather_layer`, so ZeRO stage 3 gathers one layer at a time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jzo.models import common, cross_entropy
from jzo.models.common import REMAT_POLICIES, attention_implementation, layers_first_bytes


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 128 (tensor-core tiles)
  seq_len: int = 1024  # longest context (learned position embeddings)
  n_layer: int = 12
  n_head: int = 12
  d_model: int = 768
  # What the backward pass recomputes: "full" (each layer's activations:
  # least memory, one more forward), "dots" (saves the matmul outputs, redoes
  # the cheap elementwise ops and attention), "none" (saves everything).
  remat: str = "full"
  # "auto": cuDNN flash attention on GPU for bf16/fp16 (never materialises
  # the T x T scores), XLA's otherwise; or "cudnn" / "xla" to force one.
  attention: str = "auto"

  def __post_init__(self):
    if self.d_model % self.n_head:
      raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}")
    if self.attention not in ("auto", "cudnn", "xla"):
      raise ValueError(f"attention must be auto, cudnn or xla, got {self.attention!r}")
    if min(self.vocab_size, self.seq_len, self.n_layer, self.n_head) < 1:
      raise ValueError(f"every size must be >= 1: {self}")

  @property
  def n_params(self) -> int:
    """Parameters (embeddings tied): 12 L D^2 + 13 L D + (V + S + 2) D."""
    L, D = self.n_layer, self.d_model
    return 12 * L * D * D + 13 * L * D + (self.vocab_size + self.seq_len + 2) * D

  def flops_per_token(self, seq_len: int | None = None) -> float:
    """Model FLOPs of one training token, forward and backward: 6 N for the
    matmuls plus 12 L D T for attention scores and values (Chowdhery et al.,
    PaLM, 2022, appendix B); recomputation is not counted."""
    return 6 * self.n_params + 12 * self.n_layer * self.d_model * (seq_len or self.seq_len)


def activation_bytes(config: GPTConfig, batch: int, seq_len: int | None = None,
                     itemsize: int = 2, accumulation: int = 1) -> int:
  """Bytes of activations one device needs at the peak of a training step
  with `batch` sequences (its micro-batch): what the scan saves for the
  backward pass, plus the larger of the loss's (`cross_entropy.loss_bytes`:
  one chunk of logits at a time) and one layer's recomputed intermediates
  and gradients. accumulation: micro-batches whose layers run first
  (grads_in_params, jzo.ZeroEngine's accumulation "layers"): what the scan
  saves is kept for all of them, with their layers' inputs, outputs and the
  outputs' gradients (`layers_first_bytes`).

  Per token and layer, `remat` full saves the layer input (D values), dots
  also the matmul outputs (qkv 3D, proj D, fc 4D, out D), none every
  intermediate (about 20 D incl. float32 LayerNorm statistics). One
  layer's backward holds about 28 D a token: XLA's peak on an H100 for
  gpt2-10b at micro-batches 80 and 96, where it is the larger term (25.5 D
  and 28.4 D).
  """
  T = seq_len or config.seq_len
  tokens = batch * T
  D, L = config.d_model, config.n_layer
  saved_per_layer = {"full": D, "dots": 10 * D, "none": 20 * D}[config.remat]
  saved = L * tokens * saved_per_layer * itemsize
  loss = cross_entropy.loss_bytes(tokens, config.vocab_size, D, itemsize)
  layer = tokens * 28 * D * itemsize
  return layers_first_bytes(saved, tokens * D * itemsize, accumulation) + max(loss, layer)


PRESETS = {
    "tiny": GPTConfig(vocab_size=256, seq_len=128, n_layer=2, n_head=4, d_model=128),
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, d_model=768),
    "gpt2-350m": GPTConfig(n_layer=24, n_head=16, d_model=1024),
    "gpt2-1.5b": GPTConfig(n_layer=48, n_head=25, d_model=1600),
    "gpt2-4b": GPTConfig(n_layer=36, n_head=24, d_model=3072),
    "gpt2-10b": GPTConfig(n_layer=50, n_head=32, d_model=4096),
    "gpt2-13b": GPTConfig(n_layer=40, n_head=40, d_model=5120),
    "gpt2-20b": GPTConfig(n_layer=44, n_head=48, d_model=6144),  # GPT-NeoX-20B's width and depth
}


class LayerNorm(nnx.Module):
  """LayerNorm over the last axis with float32 statistics; the result keeps
  the input's dtype (nnx.LayerNorm would return the promoted dtype)."""

  def __init__(self, dim: int, eps: float = 1e-5):
    self.scale = nnx.Param(jnp.ones((dim,)))
    self.bias = nnx.Param(jnp.zeros((dim,)))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...]
            + self.bias[...]).astype(x.dtype)


class Block(nnx.Module):
  """One pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    D = config.d_model
    # GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 L).
    std, resid_std = 0.02, 0.02 / (2 * config.n_layer) ** 0.5

    def linear(n_in, n_out, init_std):
      return nnx.Linear(n_in, n_out, kernel_init=nnx.initializers.normal(init_std), rngs=rngs)
    self.config = config
    self.ln1, self.ln2 = LayerNorm(D), LayerNorm(D)
    self.qkv, self.proj = linear(D, 3 * D, std), linear(D, D, resid_std)
    self.fc, self.out = linear(D, 4 * D, std), linear(4 * D, D, resid_std)

  def __call__(self, x: jax.Array) -> jax.Array:  # (B, T, D)
    q, k, v = self.attention_inputs(x)
    impl = attention_implementation(self.config.attention, q.shape[-1], x.dtype)
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    return self.after_attention(x, att)

  def attention_inputs(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v, each (B, T, H, head size), of x (B, T, D)."""
    B, T, D = x.shape
    H = self.config.n_head
    qkv = self.qkv(self.ln1(x)).reshape(B, T, 3, H, D // H)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

  def after_attention(self, x: jax.Array, att: jax.Array) -> jax.Array:
    """The block's output (B, T, D) from its input x and the attention's (B, T, H, head size)."""
    x = x + self.proj(att.reshape(x.shape))
    return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
  """GPT-2: token + learned position embeddings, a stack of blocks (params
  stacked on a leading layer axis, run as a scan), a final LayerNorm, and
  logits through the tied token embedding."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.config = config
    # Plain Params rather than nnx.Embed, which computes in float32 whatever
    # the params' dtype; the engine hands the model bf16 or fp16 params.
    normal = lambda std, *shape: nnx.Param(nnx.initializers.normal(std)(rngs.params(), shape))
    self.wte = normal(0.02, config.vocab_size, config.d_model)  # (V, D), tied with the output
    self.wpe = normal(0.01, config.seq_len, config.d_model)  # (S, D)
    self.blocks = common.stacked_layers(lambda rngs: Block(config, rngs=rngs), config.n_layer,
                                        rngs)
    self.lnf = LayerNorm(config.d_model)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits (B, T, V) for int tokens (B, T), in the params' dtype."""
    return self.hidden(tokens) @ self.wte[...].T

  def hidden(self, tokens: jax.Array) -> jax.Array:
    """The last hidden states (B, T, D), after the final LayerNorm: the
    logits are these times the embedding (V, D), transposed."""
    config = self.config
    T = tokens.shape[1]
    if T > config.seq_len:
      raise ValueError(f"sequence of {T} tokens is longer than the model's {config.seq_len}")
    x = self.wte[...][tokens] + self.wpe[:T]  # (B, T, D)
    return self.lnf(common.scan_layers(self.blocks, x, config.remat))

  def prefill(self, tokens: jax.Array, last: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """Float32 logits (B, V) at positions `last` (B,) of prompts `tokens`
    (B, T) from position 0, and `cache` (common.kv_cache's) holding their
    keys and values."""
    x = self.wte[...][tokens] + self.wpe[:tokens.shape[1]]  # (B, T, D)
    x, cache = common.prefill_layers(self.blocks, x, cache)
    return self.logits(x[jnp.arange(x.shape[0]), last]), cache

  def decode(self, tokens: jax.Array, positions: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """Float32 logits (B, V) after one token a row, `tokens` (B,) at
    `positions` (B,), and `cache` with their keys and values added."""
    x = (self.wte[...][tokens] + self.wpe[...][positions])[:, None]  # (B, 1, D)
    x, cache = common.decode_layers(self.blocks, x, cache, positions)
    return self.logits(x[:, 0]), cache

  def logits(self, x: jax.Array) -> jax.Array:
    """Float32 logits (B, V) of the last layer's output x (B, D)."""
    return (self.lnf(x) @ self.wte[...].T).astype(jnp.float32)


def init_params(config: GPTConfig, key: jax.Array, dtype=jnp.float32) -> dict:
  """A new GPT's parameters as a nested dict of arrays: what the ZeRO engine
  partitions and trains, and `forward` turns back into the module."""
  return common.init_params(GPT, config, key, dtype)


def forward(config: GPTConfig, params: dict, tokens: jax.Array) -> jax.Array:
  """Logits (B, T, V) for int tokens (B, T), in the params' dtype."""
  return common.bind(GPT, config, params)(tokens)


def loss_fn(config: GPTConfig, params: dict, batch: dict) -> jax.Array:
  """Mean next-token cross-entropy; batch["tokens"]: int (B, T + 1)."""
  tokens = batch["tokens"]
  model = common.bind(GPT, config, params)
  return cross_entropy.cross_entropy(model.hidden(tokens[:, :-1]), model.wte[...], tokens[:, 1:])


def prefill(config: GPTConfig, params: dict, tokens: jax.Array, last: jax.Array,
            cache: dict) -> tuple[jax.Array, dict]:
  """GPT.prefill as a function of the params: float32 logits (B, V) at
  positions `last` (B,) of prompts `tokens` (B, T), and the filled cache."""
  return common.bind(GPT, config, params).prefill(tokens, last, cache)


def decode(config: GPTConfig, params: dict, tokens: jax.Array, positions: jax.Array,
           cache: dict) -> tuple[jax.Array, dict]:
  """GPT.decode as a function of the params: float32 logits (B, V) after
  `tokens` (B,) at `positions` (B,), and the cache with them added."""
  return common.bind(GPT, config, params).decode(tokens, positions, cache)


def init_cache(config: GPTConfig, batch: int, length: int, dtype) -> dict:
  """An empty key/value cache for `batch` sequences of up to `length` tokens."""
  return common.kv_cache(config.n_layer, batch, length, config.n_head,
                         config.d_model // config.n_head, dtype)


def context_length(config: GPTConfig) -> int:
  """The most tokens a sequence may hold (the learned positions)."""
  return config.seq_len
