"""Rotary position embeddings (RoPE) as the Llama family uses them: the
angular frequencies after a config's scaling (none, linear, Llama 3.1's or
Phi-3's longrope), their cos and sin at given positions, and the rotation of
q and k in Hugging Face's layout, of the whole head or its leading
`rotary_dim` dims (Phi-4-mini's partial rotation). `config` is a
jzo.models.llama.LlamaConfig."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def frequencies(config, long: bool = False) -> np.ndarray:
  """RoPE's angular frequencies, float32 (rotary_dim / 2,), after the
  config's scaling (Llama 3.1's: wavelengths above original / low_freq_factor
  slowed by `factor`, below original / high_freq_factor kept, a linear ramp
  in original / wavelength between; longrope's: each divided by its short
  factor, or its long factor where `long`). A config without rotary_dim
  rotates whole heads (head_dim)."""
  dim = getattr(config, "rotary_dim", config.head_dim)
  inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  if config.rope_type == "linear":
    inv_freq = inv_freq / config.rope_factor
  elif config.rope_type == "llama3":
    original = config.rope_original_seq_len
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    ramp = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    inv_freq = (1 - ramp) * inv_freq / config.rope_factor + ramp * inv_freq
  elif config.rope_type == "longrope":
    inv_freq = inv_freq / np.asarray(config.rope_long_factor if long else config.rope_short_factor)
  return inv_freq.astype(np.float32)


def cos_sin(config, positions: jax.Array, length=None) -> tuple[jax.Array, jax.Array]:
  """cos and sin (..., rotary_dim / 2) of RoPE's angles at float32
  `positions` (...).

  length: longrope only, the length of the sequence the positions belong
    to, which picks its factors as transformers does (the long ones past
    rope_original_seq_len tokens): an int, or an int array broadcasting
    against `positions` (each row its own, (B, 1)); None: positions'
    last axis is a whole sequence from 0, its length positions.shape[-1].
  """
  if config.rope_type != "longrope":
    angles = positions[..., None] * frequencies(config)
    return jnp.cos(angles), jnp.sin(angles)
  length = positions.shape[-1] if length is None else length
  original = config.rope_original_seq_len
  if isinstance(length, int):
    inv_freq = frequencies(config, length > original)
  else:
    inv_freq = jnp.where((length > original)[..., None], frequencies(config, True),
                         frequencies(config, False))
  angles = positions[..., None] * inv_freq
  scale = config.rope_attention_factor
  return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x (B, T, heads, hd) rotated by RoPE in float32, Hugging Face's layout:
  the first half of the rotated dims pairs with the second; cos, sin (T, r /
  2), or (B, T, r / 2) where each row has its own positions. Only the first
  r = 2 cos.shape[-1] dims of each head rotate; the others pass through."""
  r = 2 * cos.shape[-1]
  if r < x.shape[-1]:
    return jnp.concatenate([rotate(x[..., :r], cos, sin), x[..., r:]], axis=-1)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # each (B, T, heads, hd / 2)
  cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
