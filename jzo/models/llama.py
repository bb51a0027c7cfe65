"""The Llama family (Llama 2 and 3, Mistral, Qwen2 and Qwen3, Phi-3 and
Phi-4, Qwen3-MoE and Mixtral) in Flax NNX.

`Llama` is the module; `init_params`, `forward` and `loss_fn` are the same
model as functions of a nested dict of arrays, which is what the ZeRO engine
partitions and trains (jzo.models.common's functional view). Pre-RMSNorm
blocks with rotary position embeddings, grouped-query causal attention
through jax.nn.dot_product_attention (cuDNN flash attention on GPU) and a
SwiGLU MLP, or a mixture of SwiGLU experts (jzo.models.moe); tied or untied
output embeddings; Qwen2's q/k/v biases, Qwen3's per-head q/k norms,
Phi-3's longrope and partial rotation (jzo.models.rope). The layers are
stored stacked (leading axis = layer, under `LAYERS`) and run by
`jzo.scan_layers` with a choice of rematerialization; each scan step passes
its layer's params through `jzo.gather_layer`, so ZeRO stage 3 gathers one
layer at a time (a mixture's experts with it).

Layout: q, k and v are one matrix `qkv` (D, (H + 2 K) hd) and the MLP's gate
and up one matrix `gate_up` (D, 2 F), so each runs as one matmul; kernels
are (in, out); a mixture's experts are `moe` {router (D, E), gate_up (E, D,
2 I), down (E, I, D)}. The config (LlamaConfig, PRESETS) is jzo.models.llama_config's,
re-exported here; jzo.models.hf converts to and from Hugging Face's tensors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jzo.models import common, cross_entropy, moe, rope
from jzo.models.common import REMAT_POLICIES, attention_implementation
from jzo.models.llama_config import ARCHITECTURES, PRESETS, LlamaConfig

__all__ = ["ARCHITECTURES", "LAYERS", "PRESETS", "REMAT_POLICIES", "LlamaConfig",
           "activation_bytes", "context_length", "decode", "forward", "init_cache",
           "init_params", "loss_fn", "prefill", "router_aux_loss"]

# Dotted path of the stacked layers in the params (ZeroEngine's `layers=`).
LAYERS = "layers"


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

  A mixture of experts (k a token, width I, E of them) replaces the MLP's
  4 F with the k copies of each token's row (sorted by expert, the experts'
  outputs, back in token order: 3 k D), their gate_up, silu and product
  (4 k I) and the router's logits (E), plus float32 probabilities, top-k
  weights and int32 sort indices (4 (E + 4 k) bytes); dots saves only the
  router's logits of it (a grouped matmul is not a dot the policy saves),
  and the backward's gradient is of the k gate_ups (2 k I). This assumes a
  grouped matmul that computes each row once, as jzo.models.grouped's
  kernels do (jax lowers ragged_dot on CPU by masking every expert's copy).
  """
  T = seq_len or config.seq_len
  tokens = batch * T
  D, F = config.d_model, config.d_ff
  Q, KV = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
  if config.n_experts:
    k, I, E = config.experts_per_token, config.d_expert, config.n_experts
    mlp, mlp_dots, mlp_grad, wide = 3 * k * D + 4 * k * I + E, E, 2 * k * I, 4 * (E + 4 * k)
  else:
    mlp, mlp_dots, mlp_grad, wide = 4 * F, D + 2 * F, 2 * F, 0
  everything = 6 * D + 3 * Q + 3 * KV + mlp
  saved_per_layer = {"full": D * itemsize, "dots": (2 * D + Q + 2 * KV + mlp_dots) * itemsize,
                     "none": everything * itemsize + wide}[config.remat]
  saved = config.n_layer * tokens * saved_per_layer
  loss = cross_entropy.loss_bytes(tokens, config.vocab_size, D, itemsize)
  layer = tokens * ((everything + mlp_grad) * itemsize + wide)
  return common.layers_first_bytes(saved, tokens * D * itemsize, accumulation) + max(loss, layer)


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
    if config.n_experts:
      self.moe = moe.MoE(config, rngs=rngs)
    else:
      self.gate_up, self.down = linear(D, 2 * config.d_ff), linear(config.d_ff, D)

  def __call__(self, carry, cos: jax.Array, sin: jax.Array):
    """The block's output (B, T, D) for its input x (B, T, D); where the
    carry is (x, statistics) (a mixture of experts, training), also the
    load-balancing statistics (2, E) with this layer's added."""
    x, stats = carry if isinstance(carry, tuple) else (carry, None)
    q, k, v = self.attention_inputs(x, cos, sin)
    # K/V keep their K heads: dot_product_attention groups the H query heads over them.
    impl = attention_implementation(self.config.attention, self.config.head_dim, x.dtype)
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    x, layer_stats = self.attention_out(x, att)
    return x if stats is None else (x, stats + layer_stats)

  def attention_inputs(self, x: jax.Array, cos: jax.Array,
                       sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q (B, T, H, hd), k and v (B, T, K, hd) of x (B, T, D), q and k
    rotated by cos, sin ((T, r / 2), or (B, T, r / 2) per row; r: the
    config's rotary_dim)."""
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
    return self.attention_out(x, att)[0]

  def attention_out(self, x: jax.Array, att: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """(the block's output (B, T, D), the experts' load-balancing statistics
    (2, E), or None for a dense MLP) from its input x and the attention's."""
    B, T, _ = x.shape
    x = x + self.o(att.reshape(B, T, self.config.n_head * self.config.head_dim))  # (B, T, D)
    if self.config.n_experts:
      out, stats = self.moe(self.mlp_norm(x))
      return x + out, stats
    gate, up = jnp.split(self.gate_up(self.mlp_norm(x)), 2, axis=-1)  # each (B, T, F)
    return x + self.down(jax.nn.silu(gate) * up), None


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
    return self.hidden_and_balance(tokens, False)[0]

  def hidden_and_balance(self, tokens: jax.Array,
                         balance: bool = True) -> tuple[jax.Array, jax.Array | None]:
    """(the last hidden states (B, T, D), as `hidden`; a mixture of experts'
    load-balancing statistics (2, E) summed over the layers, carried through
    the scan beside x, or None where not `balance` or dense)."""
    config = self.config
    T = tokens.shape[1]
    if T > config.seq_len:
      raise ValueError(f"sequence of {T} tokens is longer than the model's {config.seq_len}")
    if config.sliding_window is not None and T > config.sliding_window:
      raise ValueError(f"sequence of {T} tokens is longer than the model's sliding window of "
                       f"{config.sliding_window}, which jzo does not implement")
    cos, sin = rope.cos_sin(config, jnp.arange(T, dtype=jnp.float32))  # each (T, r / 2)
    x = self.embed[...][tokens]  # (B, T, D)
    if not (balance and config.n_experts):
      return self.norm(common.scan_layers(self.layers, x, config.remat, cos, sin)), None
    stats = jnp.zeros((2, config.n_experts), jnp.float32)
    x, stats = common.scan_layers(self.layers, (x, stats), config.remat, cos, sin)
    return self.norm(x), stats

  def prefill(self, tokens: jax.Array, last: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """Float32 logits (B, V) at positions `last` (B,) of prompts `tokens`
    (B, T) from position 0, and `cache` (common.kv_cache's) holding their
    keys and values. longrope's factors are each row's, by its prompt's
    length (last + 1)."""
    cos, sin = rope.cos_sin(self.config, jnp.arange(tokens.shape[1], dtype=jnp.float32),
                            (last + 1)[:, None])
    x, cache = common.prefill_layers(self.layers, self.embed[...][tokens], cache, cos, sin)
    return self.logits(x[jnp.arange(x.shape[0]), last]), cache

  def decode(self, tokens: jax.Array, positions: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """Float32 logits (B, V) after one token a row, `tokens` (B,) at
    `positions` (B,), and `cache` with their keys and values added.

    longrope rotates a token past rope_original_seq_len by its long factors,
    as transformers does; the keys cached before it keep their short
    rotation (transformers recomputes them when a generation crosses it)."""
    # cos, sin: each (B, 1, r / 2)
    cos, sin = rope.cos_sin(self.config, positions[:, None].astype(jnp.float32),
                            (positions + 1)[:, None])
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

  A mixture of experts adds router_aux_loss_coef times its load-balancing
  loss (`router_aux_loss`) over the B T input tokens, whatever loss_weight
  says. transformers adds it only when output_router_logits is true; jzo
  trains with it always, at the config's coefficient (0 turns it off). The
  balance is that of the batch given here, in the ZeRO engine one device's
  micro-batch (as each replica's under transformers' data parallelism): not
  linear in the tokens, it is not the whole step's.
  """
  tokens = batch["tokens"][:, :-1]
  model = common.bind(Llama, config, params)
  balance = bool(config.n_experts and config.router_aux_loss_coef)
  hidden, stats = model.hidden_and_balance(tokens, balance)
  loss = cross_entropy.cross_entropy(hidden, model.head(), batch["tokens"][:, 1:],
                                     batch.get("loss_weight"))
  if not balance:
    return loss
  return loss + config.router_aux_loss_coef * moe.load_balancing_loss(
      stats, config.n_layer * tokens.size)


def router_aux_loss(config: LlamaConfig, params: dict, tokens: jax.Array) -> jax.Array:
  """A mixture of experts' load-balancing loss (float32 scalar, without
  router_aux_loss_coef) for int tokens (B, T): transformers' aux_loss, over
  every layer's router logits for all B T tokens (moe.load_balancing_loss)."""
  _, stats = common.bind(Llama, config, params).hidden_and_balance(tokens)
  return moe.load_balancing_loss(stats, config.n_layer * tokens.size)


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
