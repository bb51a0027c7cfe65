"""Text generation with a key/value cache, for every model family here.

A batch of prompts runs once through the model (the prefill, each prompt
from position 0, right-padded to a common length), filling a cache of each
layer's keys and values; then each new token is one decode step, which
attends over the cache instead of running the whole sequence again. Both
are compiled once per length bucket (powers of two), and the next tokens are
picked on the device (greedy, or sampled with temperature, top-k and top-p
as transformers' `generate` does), so a step needs no transfer but the
tokens it returns; the next step is queued before they are read.

`generate(config, params, prompts, max_new_tokens)` returns the new token
ids of each prompt; `Generator(config, params).stream(...)` yields them a
step at a time, for printing as they come.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jzo.models import gemma, gpt, llama

# A config's type -> the module of its family (prefill, decode, init_cache, context_length).
FAMILIES = {gpt.GPTConfig: gpt, llama.LlamaConfig: llama, gemma.GemmaConfig: gemma}


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is picked from the logits.

  Attributes:
    temperature: 0 picks the most likely token (greedy); above 0 samples
      from softmax(logits / temperature).
    top_k: sample among the k most likely tokens only; 0: all of them.
    top_p: sample among the most likely tokens whose probabilities sum to
      at least top_p (nucleus sampling); 1: all of them.
    seed: the random draws are a function of (seed, step), so a
      generation is reproduced by its seed.
  """
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def pick_tokens(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """The next token (B,) int32 of float32 logits (B, V), as `sampling` says:
  the logits divided by the temperature, then limited to the top_k, then to
  the top_p nucleus (transformers' order), then drawn from with `key`."""
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / sampling.temperature
  if 0 < sampling.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p < 1:
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    # The smallest logit kept: the last whose more likely tokens sum to < top_p.
    before = jnp.cumsum(probs, axis=-1) - probs
    cut = jnp.min(jnp.where(before < sampling.top_p, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cut, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "sampling"), donate_argnames=("cache",))
def _prefill(config, sampling: Sampling, params: dict, tokens: jax.Array, lengths: jax.Array,
             cache: dict, key: jax.Array) -> tuple[jax.Array, dict]:
  """The first new token (B,) after prompts `tokens` (B, T) of `lengths` (B,), and the cache."""
  logits, cache = FAMILIES[type(config)].prefill(config, params, tokens, lengths - 1, cache)
  return pick_tokens(logits, jax.random.fold_in(key, 0), sampling), cache


@functools.partial(jax.jit, static_argnames=("config", "sampling"), donate_argnames=("cache",))
def _decode(config, sampling: Sampling, params: dict, tokens: jax.Array, positions: jax.Array,
            cache: dict, key: jax.Array, step: jax.Array):
  """The token (B,) after `tokens` (B,) at `positions` (B,), the next positions, and the cache."""
  logits, cache = FAMILIES[type(config)].decode(config, params, tokens, positions, cache)
  return pick_tokens(logits, jax.random.fold_in(key, step), sampling), positions + 1, cache


def bucket(n: int, limit: int, smallest: int = 16) -> int:
  """The length bucket of n tokens: the next power of two (at least
  `smallest`), at most `limit`."""
  return min(limit, max(smallest, 1 << (n - 1).bit_length()))


class Generator:
  """Generates text from one model's params: `stream` and `generate`.

  Args:
    config: a family's config (gpt.GPTConfig or llama.LlamaConfig).
    params: its params (nested dict of arrays, as the family's init_params
      makes), in the dtype to compute in; put on the default device once.
    cache_dtype: the key/value cache's dtype; None: the params'.
  """

  def __init__(self, config, params: dict, cache_dtype=None):
    if type(config) not in FAMILIES:
      raise TypeError(f"no model family has config type {type(config).__name__}")
    self.config = config
    self.family = FAMILIES[type(config)]
    self.params = jax.device_put(params)
    self.cache_dtype = cache_dtype or jax.tree.leaves(self.params)[0].dtype
    self.context = self.family.context_length(config)

  def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: Sampling = Sampling()) -> Iterator[np.ndarray]:
    """The new tokens of each prompt, one (B,) int32 array a step, for up to
    max_new_tokens steps or until the context is full (the caller stops
    reading where its stop tokens came; rows go on past theirs).

    Raises:
      ValueError: no prompts, an empty prompt, max_new_tokens < 1, or a
        prompt that leaves no room in the model's context, naming it.
    """
    lengths = np.array([len(p) for p in prompts], np.int32)
    if not len(prompts) or lengths.min() < 1:
      raise ValueError("generate needs at least one prompt, each of at least one token")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = int(lengths.max())
    if longest >= self.context:
      raise ValueError(f"a prompt of {longest} tokens leaves no room in the model's context of "
                       f"{self.context}")
    steps = min(max_new_tokens, self.context - longest)
    cache_len = bucket(longest + steps, self.context)
    tokens = np.zeros((len(prompts), bucket(longest, cache_len)), np.int32)
    for row, prompt in zip(tokens, prompts):
      row[:len(prompt)] = prompt
    key = jax.random.key(sampling.seed)
    # The seed reaches the programs through the key: one compiled program serves every seed.
    sampling = dataclasses.replace(sampling, seed=0)
    cache = self.family.init_cache(self.config, len(prompts), cache_len, self.cache_dtype)
    next_tokens, cache = _prefill(self.config, sampling, self.params, tokens, lengths, cache, key)
    positions = jnp.asarray(lengths)
    for step in range(1, steps + 1):
      current = next_tokens
      if step < steps:  # queued before `current` is read, so the device never waits on Python
        next_tokens, positions, cache = _decode(self.config, sampling, self.params, current,
                                                positions, cache, key, step)
      yield np.asarray(current)

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               sampling: Sampling = Sampling(), stop_ids: Sequence[int] = ()) -> list[list[int]]:
    """The new token ids of each prompt: up to max_new_tokens, ending before
    the first of `stop_ids` (which is left out)."""
    stop = set(stop_ids)
    out: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(len(prompts), bool)
    for tokens in self.stream(prompts, max_new_tokens, sampling):
      for row, token in enumerate(tokens.tolist()):
        if not done[row]:
          done[row] = token in stop
          if not done[row]:
            out[row].append(token)
      if done.all():
        break
    return out


def generate(config, params: dict, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: Sampling = Sampling(), stop_ids: Sequence[int] = ()) -> list[list[int]]:
  """The new token ids of each prompt (`Generator.generate`)."""
  return Generator(config, params).generate(prompts, max_new_tokens, sampling, stop_ids)
