"""Gemma 2 and Gemma 3 (text) in Flax NNX.

`Gemma` is the module; `init_params`, `forward` and `loss_fn` are the same
model as functions of a nested dict of arrays (jzo.models.common's
functional view), as in jzo.models.llama. Each block norms its input and
its output around attention and around a GeGLU MLP (GELU's tanh
approximation), with Gemma's RMSNorm (a (1 + scale) gain, in float32);
embeddings are scaled by sqrt(d_model) and the output is tied to them
unless the config says otherwise. Attention is grouped-query, scaled by
query_pre_attn_scalar ** -1/2, sliding-window or global layer by layer
(GemmaConfig.layer_types); Gemma 2 soft-caps the scores and the logits (the
loss sees the capped logits), Gemma 3 RMS-normalises each head of q and k
and gives its sliding layers their own RoPE base.

The layers are stored stacked and run as one scan (`jzo.scan_layers`,
each step through `jzo.gather_layer`): the carry is the hidden states and
the layer's index, from which each layer reads its type (which mask, which
RoPE). Attention is cuDNN's flash attention where it runs and nothing is
soft-capped, with a window on sliding layers; otherwise XLA's, which
materialises the float32 scores (B, H, T, T) of a layer.

Layout: q, k and v are one matrix `qkv` (D, (H + 2 K) hd), the MLP's gate
and up one matrix `gate_up` (D, 2 F); kernels are (in, out).
jzo.models.gemma_hf converts to and from Hugging Face's tensors.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jzo.models import common, cross_entropy, gemma_config, rope
from jzo.models.common import attention_implementation
from jzo.models.gemma_config import SLIDING, GemmaConfig

# Dotted path of the stacked layers in the params (ZeroEngine's `layers=`).
LAYERS = "layers"
# Hugging Face model_type -> the class transformers builds for it.
ARCHITECTURES = gemma_config.ARCHITECTURES
PRESETS = gemma_config.PRESETS  # the published shapes


def is_sliding(config: GemmaConfig, layer: jax.Array) -> jax.Array:
  """Whether layer `layer` (an int32 scalar, traced) slides its window."""
  return jnp.asarray(np.array([t == SLIDING for t in config.layer_types]))[layer]


def _ropes(config: GemmaConfig, positions: jax.Array):
  """((cos, sin) of the sliding layers, (cos, sin) of the global ones), each
  (..., hd / 2), at float32 `positions` (...)."""
  def cos_sin(theta, factor):  # linear scaling by 1 is plain RoPE
    spec = types.SimpleNamespace(head_dim=config.head_dim, rope_theta=theta,
                                 rope_type="linear", rope_factor=factor)
    return rope.cos_sin(spec, positions)
  return (cos_sin(config.rope_local_theta, config.rope_local_factor),
          cos_sin(config.rope_theta, config.rope_factor))


def attend(config: GemmaConfig, q: jax.Array, k: jax.Array, v: jax.Array, sliding: jax.Array,
           positions: jax.Array | None = None) -> jax.Array:
  """Gemma's attention (B, Tq, H, hd) of q (B, Tq, H, hd) over k, v (B, S,
  K, hd) at positions 0..S-1: scaled by query_pre_attn_scalar ** -1/2,
  soft-capped where the config says, causal, and in the last
  sliding_window positions only where `sliding` (a bool scalar, traced).

  positions: None: the queries are at 0..Tq-1 (Tq = S: a sequence attending
  to itself), through flash attention where the config allows; or int
  (B,), one query a row at that position (keys past it are not looked at).
  """
  scale = config.query_pre_attn_scalar ** -0.5
  window = config.sliding_window
  impl = attention_implementation(config.attention, config.head_dim, q.dtype)
  if positions is None and config.attn_softcap is None and impl == "cudnn":
    def flash(local):
      return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                          local_window_size=local, implementation="cudnn")
    return jax.lax.cond(sliding, lambda: flash((window - 1, 0)), lambda: flash(None))
  B, Tq, H, hd = q.shape
  K = k.shape[2]
  query = jnp.arange(Tq)[None] if positions is None else positions[:, None]  # (B|1, Tq)
  key = jnp.arange(k.shape[1])
  distance = query[:, :, None] - key  # (B|1, Tq, S)
  visible = (distance >= 0) & ((distance < window) | ~sliding)
  # Query head h reads K/V head h // (H / K), as transformers' repeat_kv.
  q = q.reshape(B, Tq, K, H // K, hd)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
  if config.attn_softcap is not None:
    scores = config.attn_softcap * jnp.tanh(scores / config.attn_softcap)
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(B, Tq, H, hd)


def activation_bytes(config: GemmaConfig, batch: int, seq_len: int | None = None,
                     itemsize: int = 2, accumulation: int = 1) -> int:
  """Bytes of activations one device needs at the peak of a training step
  with `batch` sequences (its micro-batch), counted as
  jzo.models.llama.activation_bytes counts them: what the scan saves, plus
  the larger of the loss's and one layer's recomputed intermediates and
  gradients.

  Per token and layer (Q = H hd, KV = K hd), `remat` full saves the layer
  input (D values), dots also the matmul outputs (qkv Q + 2 KV, o D,
  gate_up 2 F, down D), none every intermediate (8 D + 3 Q + 3 KV + 4 F:
  Llama's and the two output norms; Gemma 3's normed q and k, Q + KV, too).
  One layer's backward holds its intermediates plus the gate_up gradient
  (2 F). Where attention is XLA's (always under Gemma 2's soft-capping),
  each layer materialises its scores, B H T T values: remat none saves
  three float32 arrays of them (scores, capped, softmax) and the
  probabilities in the compute dtype; a layer's backward holds four float32
  ones (scores, probabilities and their gradients). On an H200 the compiled
  step's temporaries (jax.value_and_grad of loss_fn, bf16, no engine) came
  under this count: 2.98 GiB against 3.91 for gemma-2-2b at 1 x 4096 (XLA
  attention), 2.52 against 3.31 for gemma-3-1b at 2 x 4096, 4.43 against
  6.33 for gemma-3-27b's first 8 layers at 1 x 4096 (cuDNN), 6.44 against
  7.20 and 10.31 against 10.57 for gemma-2-9b's first 6 layers at 1 x 4096
  with remat dots and at 1 x 2048 with remat none.
  """
  T = seq_len or config.seq_len
  tokens = batch * T
  D, F = config.d_model, config.d_ff
  Q, KV = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
  everything = 8 * D + 3 * Q + 3 * KV + 4 * F + (Q + KV) * config.qk_norm
  saved_per_layer = {"full": D, "dots": 3 * D + Q + 2 * KV + 2 * F,
                     "none": everything}[config.remat]
  saved = config.n_layer * tokens * saved_per_layer * itemsize
  layer = tokens * (everything + 2 * F) * itemsize
  dtype = jnp.bfloat16 if itemsize == 2 else jnp.float32
  if (config.attn_softcap is not None  # XLA's attention (as `attend` picks it here)
      or attention_implementation(config.attention, config.head_dim, dtype) == "xla"):
    scores = batch * config.n_head * T * T
    if config.remat == "none":
      saved += config.n_layer * scores * (12 + itemsize)
    layer += scores * 16
  loss = cross_entropy.loss_bytes(tokens, config.vocab_size, D, itemsize)
  return common.layers_first_bytes(saved, tokens * D * itemsize, accumulation) + max(loss, layer)


class RMSNorm(nnx.Module):
  """Gemma's RMSNorm over the last axis: x / rms(x) x (1 + scale), all in
  float32, cast to x's dtype at the end (transformers' order); the scale
  starts at zero."""

  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.zeros((dim,)))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
    return (normed * (1 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


class Block(nnx.Module):
  """One block: x + norm(attn(norm(x))), then + norm(mlp(norm(x))). Its
  carry is (x (B, T, D), the layer's index)."""

  def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
    D, hd, eps = config.d_model, config.head_dim, config.norm_eps

    # Hugging Face's initialisation: every matrix N(0, 0.02), norms zero.
    def linear(n_in, n_out):
      return nnx.Linear(n_in, n_out, use_bias=False,
                        kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.config = config
    self.attn_norm, self.attn_post_norm = RMSNorm(D, eps), RMSNorm(D, eps)
    self.mlp_norm, self.mlp_post_norm = RMSNorm(D, eps), RMSNorm(D, eps)
    self.qkv = linear(D, (config.n_head + 2 * config.n_kv_head) * hd)
    self.o = linear(config.n_head * hd, D)
    if config.qk_norm:
      self.q_norm, self.k_norm = RMSNorm(hd, eps), RMSNorm(hd, eps)
    self.gate_up, self.down = linear(D, 2 * config.d_ff), linear(config.d_ff, D)

  def __call__(self, carry: tuple[jax.Array, jax.Array], ropes) -> tuple[jax.Array, jax.Array]:
    q, k, v = self.attention_inputs(carry, ropes)
    return self.after_attention(carry, attend(self.config, q, k, v,
                                              is_sliding(self.config, carry[1])))

  def attention_inputs(self, carry: tuple[jax.Array, jax.Array],
                       ropes) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q (B, T, H, hd), k and v (B, T, K, hd) of the carry's x (B, T, D), q
    and k rotated by the layer type's (cos, sin) of `ropes` (_ropes')."""
    config = self.config
    x, layer = carry
    B, T, _ = x.shape
    H, K, hd = config.n_head, config.n_kv_head, config.head_dim
    qkv = self.qkv(self.attn_norm(x)).reshape(B, T, H + 2 * K, hd)
    q, k, v = qkv[:, :, :H], qkv[:, :, H:H + K], qkv[:, :, H + K:]  # (B, T, H|K|K, hd)
    if config.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    (cos_l, sin_l), (cos_g, sin_g) = ropes
    sliding = is_sliding(config, layer)
    cos, sin = jnp.where(sliding, cos_l, cos_g), jnp.where(sliding, sin_l, sin_g)
    return rope.rotate(q, cos, sin), rope.rotate(k, cos, sin), v

  def after_attention(self, carry: tuple[jax.Array, jax.Array],
                      att: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The block's carry out from its carry in and the attention (B, T, H, hd)."""
    x, layer = carry
    B, T, _ = x.shape
    x = x + self.attn_post_norm(self.o(att.reshape(B, T, -1)))  # (B, T, D)
    gate, up = jnp.split(self.gate_up(self.mlp_norm(x)), 2, axis=-1)  # each (B, T, F)
    return x + self.mlp_post_norm(self.down(jax.nn.gelu(gate, approximate=True) * up)), layer + 1


class Gemma(nnx.Module):
  """Token embeddings scaled by sqrt(D), a stack of blocks (params stacked
  on a leading layer axis, run as a scan), a final RMSNorm, and logits
  through the embedding (V, D), or `lm_head` when untied, soft-capped where
  the config says."""

  def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
    self.config = config
    # Plain Params rather than nnx.Embed (which computes in float32).
    normal = lambda *shape: nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), shape))
    self.embed = normal(config.vocab_size, config.d_model)  # (V, D)
    self.layers = common.stacked_layers(lambda rngs: Block(config, rngs=rngs), config.n_layer,
                                        rngs)
    self.norm = RMSNorm(config.d_model, config.norm_eps)
    if not config.tie_embeddings:
      self.lm_head = normal(config.vocab_size, config.d_model)  # (V, D)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits (B, T, V) for int tokens (B, T), in the params' dtype."""
    hidden = self.hidden(tokens)
    return self.softcap(hidden @ self.head().T).astype(hidden.dtype)

  def head(self) -> jax.Array:
    """The output projection (V, D): the embedding, or lm_head when untied."""
    return (self.embed if self.config.tie_embeddings else self.lm_head)[...]

  def softcap(self, logits: jax.Array) -> jax.Array:
    """The logits soft-capped in float32 (final_softcap), or as they are."""
    cap = self.config.final_softcap
    return logits if cap is None else cap * jnp.tanh(logits.astype(jnp.float32) / cap)

  def embedded(self, tokens: jax.Array) -> jax.Array:
    """The embeddings (B, T, D) of int tokens (B, T), times sqrt(D) rounded
    to their dtype (through float32, as transformers rounds it)."""
    embed = self.embed[...]
    return embed[tokens] * jnp.float32(np.sqrt(self.config.d_model)).astype(embed.dtype)

  def hidden(self, tokens: jax.Array) -> jax.Array:
    """The last hidden states (B, T, D), after the final RMSNorm: the logits
    are these times `head()`, transposed, then soft-capped."""
    config = self.config
    T = tokens.shape[1]
    if T > config.seq_len:
      raise ValueError(f"sequence of {T} tokens is longer than the model's {config.seq_len}")
    ropes = _ropes(config, jnp.arange(T, dtype=jnp.float32))
    carry = (self.embedded(tokens), jnp.int32(0))
    return self.norm(common.scan_layers(self.layers, carry, config.remat, ropes)[0])

  def prefill(self, tokens: jax.Array, last: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """Float32 logits (B, V) at positions `last` (B,) of prompts `tokens`
    (B, T) from position 0, and `cache` (common.kv_cache's) holding their
    keys and values."""
    ropes = _ropes(self.config, jnp.arange(tokens.shape[1], dtype=jnp.float32))
    (x, _), cache = common.prefill_layers(self.layers, (self.embedded(tokens), jnp.int32(0)),
                                          cache, ropes, attention=_cached_attention)
    return self.logits(x[jnp.arange(x.shape[0]), last]), cache

  def decode(self, tokens: jax.Array, positions: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """Float32 logits (B, V) after one token a row, `tokens` (B,) at
    `positions` (B,), and `cache` with their keys and values added."""
    ropes = _ropes(self.config, positions[:, None].astype(jnp.float32))  # each (B, 1, hd / 2)
    carry = (self.embedded(tokens[:, None]), jnp.int32(0))  # (B, 1, D)
    (x, _), cache = common.decode_layers(self.layers, carry, cache, positions, ropes,
                                         attention=_cached_attention)
    return self.logits(x[:, 0]), cache

  def logits(self, x: jax.Array) -> jax.Array:
    """Float32 logits (B, V) of the last layer's output x (B, D)."""
    return self.softcap((self.norm(x) @ self.head().T).astype(jnp.float32))


def _cached_attention(config: GemmaConfig, q, k, v, layer, positions=None) -> jax.Array:
  """`attend` for jzo.models.common's cached layers (the layer's index gives its type)."""
  return attend(config, q, k, v, is_sliding(config, layer), positions)


def init_params(config: GemmaConfig, key: jax.Array, dtype=jnp.float32) -> dict:
  """A new model's parameters as a nested dict of arrays: what the ZeRO
  engine partitions and trains, and `forward` turns back into the module."""
  return common.init_params(Gemma, config, key, dtype)


def forward(config: GemmaConfig, params: dict, tokens: jax.Array) -> jax.Array:
  """Logits (B, T, V) for int tokens (B, T), in the params' dtype,
  soft-capped where the config says.

  Raises:
    ValueError: T is longer than config.seq_len.
  """
  return common.bind(Gemma, config, params)(tokens)


def loss_fn(config: GemmaConfig, params: dict, batch: dict) -> jax.Array:
  """Next-token cross-entropy of the soft-capped logits, averaged over all
  B T positions; batch as jzo.models.llama.loss_fn's ("tokens" (B, T + 1),
  optionally "loss_weight" (B, T))."""
  tokens = batch["tokens"]
  model = common.bind(Gemma, config, params)
  return cross_entropy.cross_entropy(model.hidden(tokens[:, :-1]), model.head(), tokens[:, 1:],
                                     batch.get("loss_weight"), softcap=config.final_softcap)


def prefill(config: GemmaConfig, params: dict, tokens: jax.Array, last: jax.Array,
            cache: dict) -> tuple[jax.Array, dict]:
  """Gemma.prefill as a function of the params: float32 logits (B, V) at
  positions `last` (B,) of prompts `tokens` (B, T), and the filled cache."""
  return common.bind(Gemma, config, params).prefill(tokens, last, cache)


def decode(config: GemmaConfig, params: dict, tokens: jax.Array, positions: jax.Array,
           cache: dict) -> tuple[jax.Array, dict]:
  """Gemma.decode as a function of the params: float32 logits (B, V) after
  `tokens` (B,) at `positions` (B,), and the cache with them added."""
  return common.bind(Gemma, config, params).decode(tokens, positions, cache)


def init_cache(config: GemmaConfig, batch: int, length: int, dtype) -> dict:
  """An empty key/value cache for `batch` sequences of up to `length` tokens
  (every layer keeps all of them; sliding layers read their window)."""
  return common.kv_cache(config.n_layer, batch, length, config.n_kv_head, config.head_dim, dtype)


def context_length(config: GemmaConfig) -> int:
  """The most tokens a sequence may hold: the context (windows slide)."""
  return config.seq_len
