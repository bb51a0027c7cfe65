"""Sampling tokens from a causal language model with a fixed window."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def generate(forward: Callable[[dict, jax.Array], jax.Array], params: dict, prompt: np.ndarray,
             n_tokens: int, window: int, key: jax.Array, temperature: float) -> np.ndarray:
  """Samples n_tokens after `prompt` (1-D ids); returns only the new ones.

  forward(params, tokens) gives the logits (1, window, V) of int tokens
  (1, window). The model always sees `window` tokens (zeros after the
  current position, which causal attention ignores), so one compiled
  forward serves every step; past the window it slides by a token a step.
  """
  if len(prompt) < 1:
    raise ValueError("generate needs a prompt of at least one token")
  tokens = np.zeros(window, np.int32)
  prompt = np.asarray(prompt, np.int32)[-(window - 1):]
  tokens[:len(prompt)] = prompt
  pos = len(prompt)

  @jax.jit
  def sample(params, tokens, pos, key):
    logits = forward(params, tokens[None])[0, pos - 1].astype(jnp.float32)
    return jax.random.categorical(key, logits / temperature)

  out = []
  for i in range(n_tokens):
    if pos == window:
      tokens = np.roll(tokens, -1)
      pos -= 1
    token = int(sample(params, tokens, pos, jax.random.fold_in(key, i)))
    tokens[pos] = token
    pos += 1
    out.append(token)
  return np.asarray(out, np.int32)
