"""Rotary position embeddings (RoPE) as the Llama family uses them: the
angular frequencies after a config's scaling (none, linear or Llama 3.1's),
their cos and sin at given positions, and the rotation of q and k in Hugging
Face's layout. `config` is a jzo.models.llama.LlamaConfig."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def frequencies(config) -> np.ndarray:
  """RoPE's angular frequencies, float32 (head_dim / 2,), after the
  config's scaling (Llama 3.1's: wavelengths above original / low_freq_factor
  slowed by `factor`, below original / high_freq_factor kept, a linear ramp
  in original / wavelength between)."""
  hd = config.head_dim
  inv_freq = 1.0 / config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
  if config.rope_type == "linear":
    inv_freq = inv_freq / config.rope_factor
  elif config.rope_type == "llama3":
    original = config.rope_original_seq_len
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    ramp = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    inv_freq = (1 - ramp) * inv_freq / config.rope_factor + ramp * inv_freq
  return inv_freq.astype(np.float32)


def cos_sin(config, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos and sin (..., hd / 2) of RoPE's angles at float32 `positions` (...)."""
  angles = positions[..., None] * frequencies(config)
  return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x (B, T, heads, hd) rotated by RoPE in float32, Hugging Face's layout:
  the first half of each head pairs with the second; cos, sin (T, hd / 2),
  or (B, T, hd / 2) where each row has its own positions."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # each (B, T, heads, hd / 2)
  cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
