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

With gradient accumulation (grad_accum = K > 1), the engine gives the
scan float32 sums shaped like the layers (`sums`, in device memory). For
micro-batches 1 to K - 1 the backward adds each layer's gradient into its
row of the sums, which come out as the gradient of `sums`, and the weights
stay as they are; for micro-batch K it writes the sum with that micro-
batch's gradient, rounded once to the weights' dtype, over the weights.
So a device holds the weights and the float32 sums of the layers (6 B a
parameter in bf16), never a gradient of the whole stack beside them.
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
  non-finite count; `sums` (float32, shaped like the layers, or None) the
  earlier micro-batches' gradients of the layers; `adding` whether this
  micro-batch adds into the sums (else it writes over the weights); `ran`
  whether scan_layers ran."""

  def __init__(self, stats, sums, adding):
    self.stats, self.sums, self.adding, self.ran = stats, sums, adding, False

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
  if watching.sums is not None:
    _check_sums(watching.sums, layers)
  # One layer in device memory: the forward and backward fetch each one
  # before fn sees it (so fn's gradient stays on the device, to be counted).
  first = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), layers)
  converted, consts = jax.closure_convert(fn, carry, first)
  return _scan_writing_grads(converted, watching.adding, tuple(consts), carry, layers,
                             watching.stats, watching.sums)


def _check_sums(sums, layers) -> None:
  shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
  if jax.tree.structure(sums) != jax.tree.structure(layers) or shapes(sums) != shapes(layers):
    raise ValueError("with grad_accum > 1 and grads_in_params, scan_layers must get the "
                     f"engine's `layers` subtree whole: got {shapes(layers)}, the engine's "
                     f"sums are {shapes(sums)}")


@contextlib.contextmanager
def writing_grads_over_layers(stats=None, sums=None, adding: bool = False):
  """While tracing the step: `scan_layers` writes each layer's gradient over
  its weights. stats: float32 zeros of shape (2,) whose gradient is to be
  the layers' gradients' (sum of squares, count of non-finite values), or
  None. sums: float32 arrays shaped like the layers (the earlier micro-
  batches' gradients), or None; adding: add this micro-batch's gradients
  into them, to come out as their gradient, instead of writing over the
  weights (see the module docstring). Yields an object that is true once
  scan_layers has run."""
  if adding and sums is None:
    raise ValueError("adding into the layers' sums needs the sums")
  watching = _Watch(stats, sums, adding)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scan_writing_grads(fn, adding, consts, carry, layers, stats, sums):
  del stats, sums  # only their gradients are used
  return _forward(fn, adding, consts, carry, layers, None, None)[0]


def _forward(fn, adding, consts, carry, layers, stats, sums):
  del adding
  out, inputs = jax.lax.scan(
      lambda c, layer: (fn(c, jax.tree.map(on_device, layer), *consts), c), carry, layers)
  return out, (consts, inputs, layers, stats, sums)


def _backward(fn, adding, saved, d_out):
  consts, inputs, layers, stats, sums = saved
  n_layers = jax.tree.leaves(layers)[0].shape[0]
  row = lambda b, i: jax.lax.dynamic_index_in_dim(b, i, 0, False)

  def one_layer(j, acc):
    d_carry, buffer, d_consts, d_stats = acc
    i = n_layers - 1 - j
    # Adding, the buffer is the sums and the weights stay; writing, the
    # buffer is the weights, whose row i still holds layer i's (only rows
    # above it were written).
    weights = jax.tree.map(lambda b: on_device(row(b, i)), layers if adding else buffer)
    x = jax.tree.map(lambda a: a[i], inputs)
    _, vjp = jax.vjp(lambda c, x, w: fn(x, w, *c), consts, x, weights)
    dc, d_carry, d_weights = vjp(d_carry)
    if sums is not None:  # float32, added to the earlier micro-batches' (rounded once)
      d_weights = jax.tree.map(lambda s, d: row(s, i) + d.astype(jnp.float32),
                               buffer if adding else sums, d_weights)
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
  d_stats = None if stats is None or adding else jnp.zeros_like(stats)
  d_carry, buffer, d_consts, d_stats = jax.lax.fori_loop(
      0, n_layers, one_layer, (d_out, sums if adding else layers, zeros, d_stats))
  if adding:  # the sums' gradient is the new sums; the weights' is not used
    return d_consts, d_carry, None, None, buffer
  return d_consts, d_carry, buffer, d_stats, None


_scan_writing_grads.defvjp(_forward, _backward)
