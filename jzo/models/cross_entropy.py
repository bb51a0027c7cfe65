"""Next-token cross-entropy through the output head, without the logits of
every position at once where that saves memory.

A step's logits are tokens x vocabulary: at micro-batch 96 of 1024 tokens
and GPT-2's 50,257 words, 9.2 GiB in bf16 and 18.4 GiB more for their
float32 gradient; with Llama 3's 128,256 words they are often a step's
largest activation. `cross_entropy` then walks the positions in chunks:
each chunk's logits (float32, about `CHUNK_LOGITS_BYTES`) give its loss and,
in the same pass, its gradients with respect to the hidden states and the
head. The backward pass only scales those by the incoming cotangent, so the
head's matmuls are not recomputed: the FLOPs are those of the plain loss.
The chunks' price is float32 gradients of the hidden states and the head
(4 B x D per token and per word), so few tokens take the logits at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# A chunk's float32 logits; its softmax and low-precision gradient come
# beside them (see `loss_bytes`).
CHUNK_LOGITS_BYTES = 2**29


def chunk_tokens(vocab_size: int, n_tokens: int) -> int:
  """Positions per chunk for a vocabulary: float32 logits of about
  CHUNK_LOGITS_BYTES, a multiple of 128 rows (the matmuls' tiles), at most
  all n_tokens."""
  rows = max(128, CHUNK_LOGITS_BYTES // (4 * vocab_size) // 128 * 128)
  return min(rows, n_tokens)


def _plain_bytes(n_tokens: int, vocab_size: int, itemsize: int) -> int:
  """All logits in the compute dtype and their float32 gradient."""
  return n_tokens * vocab_size * (itemsize + 4)


def _chunked_bytes(n_tokens: int, vocab_size: int, d_model: int, itemsize: int) -> int:
  """One chunk's float32 logits and softmax and their gradient in the
  compute dtype, and the float32 gradients of all hidden states and of the
  head."""
  chunk = chunk_tokens(vocab_size, n_tokens)
  return chunk * vocab_size * (8 + itemsize) + 4 * d_model * (n_tokens + vocab_size)


def loss_bytes(n_tokens: int, vocab_size: int, d_model: int, itemsize: int = 2) -> int:
  """Device bytes `cross_entropy` holds at its peak for n_tokens positions,
  beside the hidden states, in a compute dtype of `itemsize` bytes: the
  smaller of all the logits at once and the chunks' (which it takes)."""
  return min(_plain_bytes(n_tokens, vocab_size, itemsize),
             _chunked_bytes(n_tokens, vocab_size, d_model, itemsize))


def cross_entropy(hidden: jax.Array, head: jax.Array, targets: jax.Array,
                  weight: jax.Array | None = None, *, chunk: int | None = None,
                  softcap: float | None = None) -> jax.Array:
  """Mean over all B T positions of weight x cross-entropy of the logits
  hidden @ head.T (soft-capped where `softcap` is given) against targets;
  float32 scalar.

  Args:
    hidden: (B, T, D), the model's last hidden states (compute dtype).
    head: (V, D), the output projection (an untied head or the embedding).
    targets: int (B, T), each position's next token.
    weight: float32 (B, T) or None (all ones): each position's
      cross-entropy is multiplied by it before the mean.
    chunk: positions per chunk (all B T: the logits at once); default the
      way that takes fewer bytes (`loss_bytes`).
    softcap: c: the logits are c tanh(logits / c) (Gemma 2's
      final_logit_softcapping), in float32; None: as they are.
  """
  B, T, D = hidden.shape
  if head.ndim != 2 or head.shape[1] != D:
    raise ValueError(f"the head must be (vocab, {D}) for hidden states {hidden.shape}, "
                     f"got {head.shape}")
  for name, x in (("targets", targets), ("weight", weight)):
    if x is not None and x.shape != (B, T):
      raise ValueError(f"{name} must be {(B, T)} for hidden states {hidden.shape}, "
                       f"got {x.shape}")
  V, n, itemsize = head.shape[0], B * T, hidden.dtype.itemsize
  if chunk is None:
    chunked = _chunked_bytes(n, V, D, itemsize) < _plain_bytes(n, V, itemsize)
    chunk = chunk_tokens(V, n) if chunked else n
  if chunk >= n:
    logits = _capped((hidden @ head.T).astype(jnp.float32), softcap)  # (B, T, V)
    loss = jax.nn.logsumexp(logits, axis=-1) - _target_logit(logits, targets)
    return (loss if weight is None else loss * weight).mean()
  weight = jnp.ones((B, T), jnp.float32) if weight is None else weight.astype(jnp.float32)
  dtypes = (hidden.dtype, head.dtype)
  loss = _chunked(chunk, dtypes, softcap, hidden.reshape(n, D), head, targets.reshape(n),
                  weight.reshape(n))
  return loss / n


def _capped(logits, softcap):
  """Float32 logits soft-capped to (-softcap, softcap), or as they are (None)."""
  return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def _target_logit(logits, targets):
  """logits (..., V) at targets (...): picked by comparison with an iota,
  which XLA fuses into a reduction over the logits, where take_along_axis's
  gradient would be a scatter."""
  is_target = jnp.arange(logits.shape[-1]) == targets[..., None]
  return jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)


def _chunk_at(i, chunk, hidden, targets, weight):
  """Chunk i of the positions (leading axis n): its first position and its
  rows. Where chunk does not divide n, the last chunk ends at n and so
  overlaps the one before it; the positions that one holds weigh 0 here.
  So nothing is padded, which would copy the hidden states."""
  n = hidden.shape[0]
  start = jnp.minimum(i * chunk, n - chunk)
  rows = lambda a: jax.lax.dynamic_slice_in_dim(a, start, chunk)
  fresh = start + jnp.arange(chunk) >= i * chunk
  return start, rows(hidden), rows(targets), jnp.where(fresh, rows(weight), 0.0)


def _chunk_loss(h, head, targets, weight, softcap):
  """A chunk's logits (float32, soft-capped), their log-sum-exp and its
  weighted loss sum."""
  logits = _capped(jnp.dot(h, head.T, preferred_element_type=jnp.float32), softcap)  # (C, V)
  lse = jax.nn.logsumexp(logits, axis=-1)
  return logits, lse, jnp.sum((lse - _target_logit(logits, targets)) * weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked(chunk, dtypes, softcap, hidden, head, targets, weight):
  """Sum over positions of weight x cross-entropy; hidden (n, D). dtypes:
  hidden's and head's, for their gradients; softcap: cross_entropy's."""
  del dtypes
  def one(total, i):
    _, h, t, w = _chunk_at(i, chunk, hidden, targets, weight)
    return total + _chunk_loss(h, head, t, w, softcap)[2], None
  return jax.lax.scan(one, jnp.float32(0), jnp.arange(-(-hidden.shape[0] // chunk)))[0]


def _chunked_forward(chunk, dtypes, softcap, hidden, head, targets, weight):
  del dtypes
  n = hidden.shape[0]

  def one(acc, i):
    total, d_head, d_hidden = acc
    start, h, t, w = _chunk_at(i, chunk, hidden, targets, weight)
    logits, lse, loss = _chunk_loss(h, head, t, w, softcap)
    # d(loss sum)/d(logits), rounded once to the matmuls' dtype.
    is_target = jnp.arange(logits.shape[-1]) == t[:, None]
    d_logits = (jnp.exp(logits - lse[:, None]) - is_target) * w[:, None]
    if softcap is not None:  # through the cap: tanh' = 1 - tanh^2
      d_logits = d_logits * (1 - jnp.square(logits / softcap))
    d_logits = d_logits.astype(head.dtype)
    d_h = jnp.dot(d_logits, head, preferred_element_type=jnp.float32)
    d_head = d_head + jnp.dot(d_logits.T, h, preferred_element_type=jnp.float32)
    d_hidden = jax.lax.dynamic_update_slice_in_dim(d_hidden, d_h, start, 0)
    return (total + loss, d_head, d_hidden), None

  # The last chunk first: where it overlaps the one before, its rows there
  # (weight 0, so zero gradients) are then overwritten by that chunk's.
  count = -(-n // chunk)
  order = jnp.roll(jnp.arange(count), 1)
  zeros = (jnp.float32(0), jnp.zeros(head.shape, jnp.float32),
           jnp.zeros(hidden.shape, jnp.float32))
  (total, d_head, d_hidden), _ = jax.lax.scan(one, zeros, order)
  return total, (d_hidden, d_head)


def _chunked_backward(chunk, dtypes, softcap, saved, g):
  del chunk, softcap
  (d_hidden, d_head), (hidden_dtype, head_dtype) = saved, dtypes
  return (g * d_hidden).astype(hidden_dtype), (g * d_head).astype(head_dtype), None, None


_chunked.defvjp(_chunked_forward, _chunked_backward)
