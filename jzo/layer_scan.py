"""`scan_layers`: a model's loop over its stacked layers, whose gradients
can take the place of the layers' weights.

A model calls `scan_layers(fn, x, layers)` where it would call
`lax.scan` over its stack of layers (leading axis = layer). Outside a
`ZeroEngine` with `grads_in_params`, it is that scan. Inside one, it runs
with a custom backward pass: the forward keeps each layer's input (as
rematerialization "full" does), and the backward walks the layers from the
last, recomputes each one, and writes its gradient over its weights in the
same buffer, which no later iteration reads. So the gradients of the stack
take no memory of their own: the step's device peak is the weights, not
the weights and the gradients (gpt2-20b's bf16 layers are 37 GiB on an
80 GB GPU).

With offload_params the stacked weights are in pinned host memory: the
forward's scan and the backward's loop fetch one layer at a time to the
device, and each layer's gradient goes back down over its weights. The
engine then needs the gradients' sum of squares and count of non-finite
values, which it cannot compute on arrays in host memory: the backward
counts them on the device, layer by layer, and hands them out as the
gradient of `stats` (zeros of shape (2,) that the engine passes in and
differentiates; the forward does not use them). It counts only the arrays
in host memory: with offload_params="auto" some of the layers' arrays stay
on the device, where the engine counts them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable

import jax
import jax.numpy as jnp

# What the engine watches while it traces its step with grads_in_params:
# scan_layers marks it when it runs (None: a plain scan).
_WRITING_GRADS: contextvars.ContextVar["_Watch | None"] = contextvars.ContextVar(
    "jzo_writing_grads", default=None)


class _Watch:
  """A trace's grads_in_params: `stats` (float32 (2,) or None) is the
  input whose gradient gets the layers' gradients' sum of squares and
  non-finite count; `ran` whether scan_layers ran."""

  def __init__(self, stats):
    self.stats, self.ran = stats, False

  def __bool__(self) -> bool:
    return self.ran


def scan_layers(fn: Callable, carry, layers):
  """`carry` after `carry = fn(carry, layer)` for each layer of `layers`
  (a tree of arrays with a leading layer axis, L), in order: the scan over
  a model's stacked layers.

  fn may close over other values (a rotary table, say), differentiable or
  not; its gradients with respect to them are summed over the layers. Wrap
  fn in `jax.checkpoint` for rematerialization as with `lax.scan`; under
  an engine with `grads_in_params` the layers are recomputed whole in the
  backward pass whatever the policy (see the module docstring).
  """
  watching = _WRITING_GRADS.get()
  if watching is None:
    return jax.lax.scan(lambda c, layer: (fn(c, layer), None), carry, layers)[0]
  watching.ran = True
  # One layer in device memory: the forward and backward fetch each one
  # before fn sees it (so fn's gradient stays on the device, to be counted).
  first = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), layers)
  converted, consts = jax.closure_convert(fn, carry, first)
  return _scan_writing_grads(converted, tuple(consts), carry, layers, watching.stats)


@contextlib.contextmanager
def writing_grads_over_layers(stats=None):
  """While tracing the step: `scan_layers` writes each layer's gradient over
  its weights. stats: float32 zeros of shape (2,) whose gradient is to be
  the layers' gradients' (sum of squares, count of non-finite values), or
  None. Yields an object that is true once scan_layers has run."""
  watching = _Watch(stats)
  token = _WRITING_GRADS.set(watching)
  try:
    yield watching
  finally:
    _WRITING_GRADS.reset(token)


def _in_host_memory(x) -> bool:
  return jax.typeof(x).memory_space == jax.memory.Space.Host


def _to(space, x):
  """x in memory `space` (jax.memory.Space), moved only if it is elsewhere."""
  return x if jax.typeof(x).memory_space == space else jax.device_put(x, space)


def on_device(x):
  """Inside a traced step: x in device memory (offloaded weights come up;
  others, and the backward's already fetched layer, stay as they are)."""
  return _to(jax.memory.Space.Device, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan_writing_grads(fn, consts, carry, layers, stats):
  del stats  # only its gradient is used
  return _forward(fn, consts, carry, layers, None)[0]


def _forward(fn, consts, carry, layers, stats):
  out, inputs = jax.lax.scan(
      lambda c, layer: (fn(c, jax.tree.map(on_device, layer), *consts), c), carry, layers)
  return out, (consts, inputs, layers, stats)


def _backward(fn, saved, d_out):
  consts, inputs, layers, stats = saved
  n_layers = jax.tree.leaves(layers)[0].shape[0]

  def one_layer(j, acc):
    d_carry, buffer, d_consts, d_stats = acc
    i = n_layers - 1 - j
    # Row i still holds layer i's weights: only rows above it were written.
    weights = jax.tree.map(lambda b: on_device(jax.lax.dynamic_index_in_dim(b, i, 0, False)),
                           buffer)
    x = jax.tree.map(lambda a: a[i], inputs)
    _, vjp = jax.vjp(lambda c, x, w: fn(x, w, *c), consts, x, weights)
    dc, d_carry, d_weights = vjp(d_carry)
    d_weights = jax.tree.map(lambda b, d: d.astype(b.dtype), buffer, d_weights)
    if d_stats is not None:  # of what the host will read: the rounded gradients
      # of the arrays in host memory (the engine counts those on the device)
      wide = [d.astype(jnp.float32) for b, d in zip(jax.tree.leaves(buffer),
                                                     jax.tree.leaves(d_weights))
              if _in_host_memory(b)]
      d_stats = d_stats + jnp.stack([sum(jnp.sum(d * d) for d in wide),
                                     sum(jnp.sum(~jnp.isfinite(d)) for d in wide
                                         ).astype(jnp.float32)])
    buffer = jax.tree.map(
        lambda b, d: jax.lax.dynamic_update_index_in_dim(
            b, _to(jax.memory.Space.Host, d) if _in_host_memory(b) else d, i, 0),
        buffer, d_weights)
    return d_carry, buffer, jax.tree.map(jnp.add, d_consts, dc), d_stats

  zeros = jax.tree.map(jnp.zeros_like, consts)
  d_stats = None if stats is None else jnp.zeros_like(stats)
  d_carry, grads, d_consts, d_stats = jax.lax.fori_loop(
      0, n_layers, one_layer, (d_out, layers, zeros, d_stats))
  return d_consts, d_carry, grads, d_stats


_scan_writing_grads.defvjp(_forward, _backward)
