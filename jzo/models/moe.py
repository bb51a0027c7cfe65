"""The mixture-of-experts MLP of the Llama family (Qwen3-MoE, Mixtral): a
router that sends each token to its top-k experts, the experts' SwiGLU MLPs
run as grouped matmuls over the tokens each one receives, and the
load-balancing statistics and auxiliary loss (Switch Transformer's, as
transformers' load_balancing_loss_func computes it).

Shapes: N tokens (B T), E experts of hidden width I, k experts a token, D
the model width. The (token, choice) pairs are sorted by expert, so each
expert's rows are contiguous, and `grouped.grouped_matmul` multiplies each
group of rows by its expert's weights: no expert computes a row it was not
given (on Hopper GPUs, or where XLA lowers ragged_dot natively), and no
Python loop runs over the experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jzo.models.grouped import grouped_matmul


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each token's experts from the router's logits (N, E): (weights (N, k)
  float32, experts (N, k) int32, probabilities (N, E) float32). The softmax
  is float32 whatever the logits' dtype; `normalize` rescales the top-k
  probabilities to sum to 1 (Qwen3-MoE's norm_topk_prob; Mixtral always)."""
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, k)
  if normalize:
    weights = weights / weights.sum(-1, keepdims=True)
  return weights, experts.astype(jnp.int32), probs


def experts_mlp(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_up: jax.Array,
                down: jax.Array, float32_weights: bool) -> jax.Array:
  """The weighted sum (N, D) over each token's experts of their SwiGLU MLPs.

  Args:
    x: (N, D) tokens. weights, experts: (N, k), as `route` gives them.
    gate_up: (E, D, 2 I) each expert's gate then up kernel; down: (E, I, D).
    float32_weights: multiply the experts' outputs by the float32 weights,
      then round (Mixtral's order); else round the weights to x's dtype
      first (Qwen3-MoE's).
  """
  N, k = experts.shape
  flat = experts.reshape(-1)  # (N k,): row r is token r // k's choice r % k
  order = jnp.argsort(flat, stable=True)  # the rows grouped by expert
  sizes = jnp.bincount(flat, length=gate_up.shape[0]).astype(jnp.int32)  # (E,)
  # Permutations gather with unique indices: their transposes are scatters
  # without collisions, deterministic on a GPU (unlike x[order // k]'s).
  rows = jnp.broadcast_to(x[:, None], (N, k, x.shape[-1])).reshape(N * k, -1)
  rows = rows.at[order].get(unique_indices=True)  # (N k, D), sorted by expert
  gate, up = jnp.split(grouped_matmul(rows, gate_up, sizes), 2, axis=-1)  # (N k, I) each
  out = grouped_matmul(jax.nn.silu(gate) * up, down, sizes)  # (N k, D)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(N * k, dtype=order.dtype),
                                                unique_indices=True)
  out = out.at[inverse].get(unique_indices=True).reshape(N, k, -1)  # back in token order
  if float32_weights:
    out = (out.astype(jnp.float32) * weights[..., None]).astype(x.dtype)
  else:
    out = out * weights.astype(x.dtype)[..., None]
  return out.sum(axis=1)


def balance_statistics(experts: jax.Array, probs: jax.Array) -> jax.Array:
  """One layer's load-balancing statistics, float32 (2, E): how many of the
  (token, choice) pairs each expert got, and the sum of each expert's
  router probability over the tokens. Layers' statistics add up."""
  counts = jnp.bincount(experts.reshape(-1), length=probs.shape[-1]).astype(jnp.float32)
  return jnp.stack([counts, probs.sum(axis=0)])


def load_balancing_loss(stats: jax.Array, rows: int) -> jax.Array:
  """Switch Transformer's auxiliary loss from the statistics (2, E) summed
  over all layers, as transformers' load_balancing_loss_func computes it over
  every layer's router logits concatenated: E times the sum over experts of
  (the fraction of pairs routed to it) x (its mean probability), both means
  over all `rows` = layers x tokens (not a sum of per-layer losses)."""
  counts, probs = stats
  return stats.shape[-1] * jnp.sum((counts / rows) * (probs / rows))


class MoE(nnx.Module):
  """The mixture-of-experts MLP of one layer: `router` (D, E), and each
  expert's `gate_up` (E, D, 2 I) and `down` (E, I, D) kernels stacked.

  `config` (a jzo.models.llama.LlamaConfig) gives d_model, n_experts,
  experts_per_token, d_expert, norm_topk_prob and model_type (Mixtral
  weighs the experts' outputs in float32)."""

  def __init__(self, config, *, rngs: nnx.Rngs):
    D, E, I = config.d_model, config.n_experts, config.d_expert
    normal = nnx.initializers.normal(0.02)  # Hugging Face's initialisation
    self.router = nnx.Linear(D, E, use_bias=False, kernel_init=normal, rngs=rngs)
    self.gate_up = nnx.Param(normal(rngs.params(), (E, D, 2 * I)))
    self.down = nnx.Param(normal(rngs.params(), (E, I, D)))
    self.k, self.normalize = config.experts_per_token, config.norm_topk_prob
    self.float32_weights = config.model_type == "mixtral"

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the MLP's output (B, T, D), the layer's balance_statistics (2, E))
    for its input x (B, T, D)."""
    flat = x.reshape(-1, x.shape[-1])  # (N, D)
    weights, experts, probs = route(self.router(flat), self.k, self.normalize)
    out = experts_mlp(flat, weights, experts, self.gate_up[...], self.down[...],
                      self.float32_weights)
    return out.reshape(x.shape), balance_statistics(experts, probs)
