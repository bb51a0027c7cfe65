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
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable

import jax
import jax.numpy as jnp

# A list the engine watches while it traces its step with grads_in_params:
# scan_layers appends to it when it runs (None: a plain scan).
_WRITING_GRADS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "jzo_writing_grads", default=None)


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
  watching.append(True)
  first = jax.tree.map(lambda x: x[0], layers)
  converted, consts = jax.closure_convert(fn, carry, first)
  return _scan_writing_grads(converted, tuple(consts), carry, layers)


@contextlib.contextmanager
def writing_grads_over_layers():
  """While tracing the step: `scan_layers` writes each layer's gradient over
  its weights. Yields a list that is non-empty once scan_layers has run."""
  watching: list = []
  token = _WRITING_GRADS.set(watching)
  try:
    yield watching
  finally:
    _WRITING_GRADS.reset(token)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan_writing_grads(fn, consts, carry, layers):
  return jax.lax.scan(lambda c, layer: (fn(c, layer, *consts), None), carry, layers)[0]


def _forward(fn, consts, carry, layers):
  out, inputs = jax.lax.scan(lambda c, layer: (fn(c, layer, *consts), c), carry, layers)
  return out, (consts, inputs, layers)


def _backward(fn, saved, d_out):
  consts, inputs, layers = saved
  n_layers = jax.tree.leaves(layers)[0].shape[0]

  def one_layer(j, acc):
    d_carry, buffer, d_consts = acc
    i = n_layers - 1 - j
    # Row i still holds layer i's weights: only rows above it were written.
    weights = jax.tree.map(lambda b: b[i], buffer)
    x = jax.tree.map(lambda a: a[i], inputs)
    _, vjp = jax.vjp(lambda c, x, w: fn(x, w, *c), consts, x, weights)
    dc, d_carry, d_weights = vjp(d_carry)
    buffer = jax.tree.map(
        lambda b, d: jax.lax.dynamic_update_index_in_dim(b, d.astype(b.dtype), i, 0),
        buffer, d_weights)
    return d_carry, buffer, jax.tree.map(jnp.add, d_consts, dc)

  zeros = jax.tree.map(jnp.zeros_like, consts)
  d_carry, grads, d_consts = jax.lax.fori_loop(0, n_layers, one_layer, (d_out, layers, zeros))
  return d_consts, d_carry, grads


_scan_writing_grads.defvjp(_forward, _backward)
