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
in host memory (a layers' array on the device is the engine's to count).

Resident layers (`Plan.resident_layers` = r > 0: offload_params="auto"'s
choice, or resident_layers=): the engine also gives the scan a copy of the
first r layers' weights in device memory (`resident`, shaped like the
layers but r rows). The forward and backward read those layers there and
fetch only the other L - r from host memory; every layer's gradient still
goes down over its weights.

With gradient accumulation (grad_accum = K > 1), the engine gives the
scan float32 sums shaped like the layers (`sums`, in device memory). For
micro-batches 1 to K - 1 the backward adds each layer's gradient into its
row of the sums, which come out as the gradient of `sums`, and the weights
stay as they are; for micro-batch K it writes the sum with that micro-
batch's gradient, rounded once to the weights' dtype, over the weights.
So a device holds the weights and the float32 sums of the layers (6 B a
parameter in bf16), never a gradient of the whole stack beside them.

Overlapping the host update (`landing` and `wait`, one micro-batch, no
resident layers): when the step starts, the layers' host parts hold the
last step's gradients, and the host is still updating them, a layer at a
time, into landing buffers in pinned host memory (one per leaf with a host
part, (L, k - c) a device). Before layer i the forward calls `wait(i)` on
the host (a callback that returns once the host has written layer i's new
weights), copies them into row i of the layers, after its device part
(in place), and runs the layer. So the forward over the step's batch runs
beside the host update instead of after it, and reads the same weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

# What the engine watches while it traces its step with grads_in_params:
# scan_layers marks it when it runs (None: a plain scan).
_WRITING_GRADS: contextvars.ContextVar["_Watch | None"] = contextvars.ContextVar(
    "jzo_writing_grads", default=None)


class _Watch:
  """A trace's grads_in_params: `stats` (float32 (2,) or None) is the
  input whose gradient gets the layers' gradients' sum of squares and
  non-finite count; `sums` (float32, shaped like the layers, or None) the
  earlier micro-batches' gradients of the layers; `adding` whether this
  micro-batch adds into the sums (else it writes over the weights);
  `resident` the first layers' weights in device memory (or None);
  `landing` (a tuple, per leaf of the layers in jax.tree.leaves order, of
  its host parts' new weights in pinned host memory, or None) and `wait`
  the overlapped host update's (or None); `ran` whether scan_layers ran."""

  def __init__(self, stats, sums, adding, resident, landing, wait):
    self.stats, self.sums, self.adding, self.ran = stats, sums, adding, False
    self.resident, self.landing, self.wait = resident, landing, wait

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
  if watching.resident is not None:
    _check_resident(watching.resident, layers)
  if watching.landing is not None:
    _check_landing(watching.landing, layers)
  # One layer in device memory: the forward and backward fetch each one
  # before fn sees it (so fn's gradient stays on the device, to be counted).
  first = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), layers)
  converted, consts = jax.closure_convert(fn, carry, first)
  return _scan_writing_grads(converted, watching.adding, watching.wait, tuple(consts), carry,
                             layers, watching.stats, watching.sums, watching.resident,
                             watching.landing)


def _check_sums(sums, layers) -> None:
  shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
  if jax.tree.structure(sums) != jax.tree.structure(layers) or shapes(sums) != shapes(layers):
    raise ValueError("with grad_accum > 1 and grads_in_params, scan_layers must get the "
                     f"engine's `layers` subtree whole: got {shapes(layers)}, the engine's "
                     f"sums are {shapes(sums)}")


def _check_resident(resident, layers) -> None:
  tails = lambda tree: jax.tree.map(lambda x: tuple(x.shape[1:]), tree)
  rows = {x.shape[0] for x in jax.tree.leaves(resident)}
  if (jax.tree.structure(resident) != jax.tree.structure(layers)
      or tails(resident) != tails(layers) or len(rows) != 1
      or rows.pop() > jax.tree.leaves(layers)[0].shape[0]):
    raise ValueError("with resident layers, scan_layers must get the engine's `layers` "
                     f"subtree whole: got {jax.tree.map(jnp.shape, layers)}, the resident "
                     f"layers are {jax.tree.map(jnp.shape, resident)}")


def _check_landing(landing, layers) -> None:
  leaves = jax.tree.leaves(layers)
  fits = len(landing) == len(leaves) and all(
      h is None or (h.shape[0] == x.shape[0] and h.shape[1:-1] == x.shape[1:-1]
                    and h.shape[-1] <= x.shape[-1]) for h, x in zip(landing, leaves))
  if not fits:
    raise ValueError("overlapping the host update, scan_layers must get the engine's `layers` "
                     f"subtree whole: got {jax.tree.map(jnp.shape, layers)}, the landing "
                     f"buffers are {[None if h is None else h.shape for h in landing]}")


@contextlib.contextmanager
def writing_grads_over_layers(stats=None, sums=None, adding: bool = False, resident=None,
                              landing=None, wait: Callable | None = None):
  """While tracing the step: `scan_layers` writes each layer's gradient over
  its weights. stats: float32 zeros of shape (2,) whose gradient is to be
  the layers' gradients' (sum of squares, count of non-finite values), or
  None. sums: float32 arrays shaped like the layers (the earlier micro-
  batches' gradients), or None; adding: add this micro-batch's gradients
  into them, to come out as their gradient, instead of writing over the
  weights (see the module docstring). resident: the first layers' weights
  in device memory, (r, ...) shaped like the layers otherwise, or None.
  landing, wait: overlap the host update (see the module docstring): per
  leaf of the layers, its host parts' landing buffer or None, and
  `wait(i) -> i` (int32), which returns once layer i's are written.
  Yields an object that is true once scan_layers has run."""
  if adding and sums is None:
    raise ValueError("adding into the layers' sums needs the sums")
  if landing is not None and (wait is None or sums is not None or resident is not None):
    raise ValueError("overlapping the host update needs a wait, one micro-batch and no "
                     "resident layers")
  watching = _Watch(stats, sums, adding, resident,
                    None if landing is None else tuple(landing), wait)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _scan_writing_grads(fn, adding, wait, consts, carry, layers, stats, sums, resident, landing):
  del stats, sums  # only their gradients are used
  return _forward(fn, adding, wait, consts, carry, layers, None, None, resident, landing)[0]


def _row(x, i):
  return jax.lax.dynamic_index_in_dim(x, i, 0, False)


def _forward(fn, adding, wait, consts, carry, layers, stats, sums, resident, landing):
  """The scan; saves each layer's input: (those of the resident layers or
  None, those of the others), and the layers (with landing: the new
  weights written into them)."""
  del adding
  step = lambda c, layer: (fn(c, layer, *consts), c)
  if landing is not None:
    out, inputs, layers = _fetching_scan(step, wait, carry, layers, landing)
    return out, (consts, (None, inputs), layers, stats, sums, resident)
  if resident is None:
    out, inputs = jax.lax.scan(lambda c, layer: step(c, jax.tree.map(on_device, layer)),
                               carry, layers)
    return out, (consts, (None, inputs), layers, stats, sums, resident)
  r, n_layers = _n_rows(resident), _n_rows(layers)
  middle, first = jax.lax.scan(step, carry, resident)
  # The others by index: a scan over a slice of them could copy it whole.
  out, rest = jax.lax.scan(
      lambda c, i: step(c, jax.tree.map(lambda x: on_device(_row(x, i)), layers)), middle,
      jnp.arange(r, n_layers))
  return out, (consts, (first, rest), layers, stats, sums, resident)


def _fetching_scan(step, wait, carry, layers, landing):
  """The scan overlapping the host update: (out, each layer's input, the
  layers with each one's host parts' new weights copied in from `landing`
  once `wait` says the host wrote them)."""
  leaves, treedef = jax.tree.flatten(layers)

  def body(state, i):
    c, leaves, here = state
    j = io_callback(wait, jax.ShapeDtypeStruct((), jnp.int32), i)
    # Nothing may read the landing buffers before the host says so: the loop
    # carries them through a barrier with the callback's result, so no read
    # of them is loop-invariant (XLA:CPU otherwise hoisted a float32 copy of
    # them, made before the loop, while the host was still writing them; even
    # so its runtime read them early at times: the engine overlaps only on
    # accelerators, whose tests are in test_offload_gpu.py).
    _, here = jax.lax.optimization_barrier((j, here))
    new = []
    for x, host in zip(leaves, here):
      if host is not None:  # after the row's device part, which the last step wrote
        row = on_device(_row(host, i))[None]
        start = (i,) + (0,) * (x.ndim - 2) + (x.shape[-1] - row.shape[-1],)
        x = jax.lax.dynamic_update_slice(x, row, start)
      new.append(x)
    out, saved = step(c, jax.tree.unflatten(treedef, [_row(x, i) for x in new]))
    return (out, new, here), saved

  (out, leaves, _), inputs = jax.lax.scan(body, (carry, leaves, landing),
                                          jnp.arange(_n_rows(layers)))
  return out, inputs, jax.tree.unflatten(treedef, leaves)


def _n_rows(tree) -> int:
  return jax.tree.leaves(tree)[0].shape[0]


def _backward(fn, adding, wait, saved, d_out):
  del wait  # the forward's
  consts, (first_inputs, inputs), layers, stats, sums, resident = saved
  n_layers = _n_rows(layers)
  r = 0 if resident is None else _n_rows(resident)

  def one_layer(i, weights, x, acc):
    d_carry, buffer, d_consts, d_stats = acc
    _, vjp = jax.vjp(lambda c, x, w: fn(x, w, *c), consts, x, weights)
    dc, d_carry, d_weights = vjp(d_carry)
    if sums is not None:  # float32, added to the earlier micro-batches' (rounded once)
      d_weights = jax.tree.map(lambda s, d: _row(s, i) + d.astype(jnp.float32),
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

  def fetched_layer(j, acc):  # layers L - 1 down to r
    i = n_layers - 1 - j
    # Adding, the buffer is the sums and the weights stay; writing, the
    # buffer is the weights, whose row i still holds layer i's (only rows
    # above it were written).
    weights = jax.tree.map(lambda b: on_device(_row(b, i)), layers if adding else acc[1])
    return one_layer(i, weights, jax.tree.map(lambda a: a[i - r], inputs), acc)

  def resident_layer(j, acc):  # layers r - 1 down to 0
    i = r - 1 - j
    return one_layer(i, jax.tree.map(lambda w: w[i], resident),
                     jax.tree.map(lambda a: a[i], first_inputs), acc)

  zeros = jax.tree.map(jnp.zeros_like, consts)
  d_stats = None if stats is None or adding else jnp.zeros_like(stats)
  acc = (d_out, sums if adding else layers, zeros, d_stats)
  # (A loop's body is traced even for no iterations: indexing none fails.)
  if r < n_layers:
    acc = jax.lax.fori_loop(0, n_layers - r, fetched_layer, acc)
  if r:
    acc = jax.lax.fori_loop(0, r, resident_layer, acc)
  d_carry, buffer, d_consts, d_stats = acc
  if adding:  # the sums' gradient is the new sums; the weights' is not used
    return d_consts, d_carry, None, None, buffer, None, None
  return d_consts, d_carry, buffer, d_stats, None, None, None


_scan_writing_grads.defvjp(_forward, _backward)
