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

Overlapping the host update (`landing` and `wait`, one micro-batch or
the layers first, no resident layers): when the step starts, the host is
still updating the layers' host parts, a layer at a time, into landing
buffers in pinned host memory (one per leaf with a host part, (L, k - c) a
device). Before layer i the forward calls `wait(i)` on the host (a
callback that returns once the host has written layer i's new weights),
copies them into row i of the layers, after its device part (in place),
and runs the layer. So the forward over the step's batch runs beside the
host update instead of after it, and reads the same weights. The backward
then writes each layer's host parts' gradients over those weights in the
landing buffers as the layer's backward ends (they come out as the landing
buffers' gradient), so the gradients' trip down runs under the backward.

Layers first (grad_accum = K > 1, the engine's accumulation "layers"): the
engine runs the layers itself over all K micro-batches at once. It traces
the model's loss once per micro-batch with scan_layers recording its
arguments and returning its input (`capturing_layers`: what comes before
the layers), runs the forward a layer at a time over every micro-batch
(`forward_chunks`, with `landing` and `wait` beside the host update), each
micro-batch's loss with scan_layers returning that output
(`giving_layers`), then the backward a layer at a time over every
micro-batch (`backward_chunks`): the layer's gradient summed over them in
float32 and rounded once over its weights. No float32 sums of the stack are
kept; the layers' inputs of every micro-batch are.
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
  the overlapped host update's (or None); `ran` whether scan_layers ran.
  `record` (a dict, or None): scan_layers records its arguments there and
  returns its carry (`capturing_layers`), checking it got `expect` (the
  engine's layers); `given` (or None): scan_layers returns it
  (`giving_layers`)."""

  def __init__(self, stats=None, sums=None, adding=False, resident=None, landing=None,
               wait=None, record=None, expect=None, given=None):
    self.stats, self.sums, self.adding, self.ran = stats, sums, adding, False
    self.resident, self.landing, self.wait = resident, landing, wait
    self.record, self.expect, self.given = record, expect, given

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
  if watching.record is not None:
    _check_whole_layers(watching.expect, layers)
    _record(watching.record, fn, carry, layers)
    return carry
  if watching.given is not None:
    kind = lambda tree: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)
    if kind(watching.given) != kind(carry):
      raise ValueError("scan_layers' layers must give what they take: its input is "
                       f"{kind(carry)}, the layers gave {kind(watching.given)}")
    return watching.given
  if watching.sums is not None:
    _check_whole_layers(watching.sums, layers)
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


def _record(record: dict, fn: Callable, carry, layers) -> None:
  """Records, for the engine's layers-first step, fn as a function of
  (carry, layer, *consts) closed over no traced value, the values it
  closes over (`consts`, every one: they are the traced micro-batch's, used
  outside its trace) and its `carry`."""
  first = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), layers)
  closed, out = jax.make_jaxpr(fn, return_shape=True)(carry, first)
  out_tree = jax.tree.structure(out)

  def converted(c, layer, *consts):
    return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(closed.jaxpr, consts,
                                                            *jax.tree.leaves((c, layer))))
  record.update(fn=converted, consts=tuple(closed.consts), carry=carry)


def _check_whole_layers(engine_layers, layers) -> None:
  """layers (what scan_layers got) are shaped as the engine's (its layers,
  or their sums)."""
  shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
  if (jax.tree.structure(engine_layers) != jax.tree.structure(layers)
      or shapes(engine_layers) != shapes(layers)):
    raise ValueError("with grad_accum > 1 and grads_in_params, scan_layers must get the "
                     f"engine's `layers` subtree whole: got {shapes(layers)}, the engine's "
                     f"layers are {shapes(engine_layers)}")


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
  `wait(i) -> i` (int32), which returns once layer i's are written; the
  landing buffers' gradient is them with the host parts' gradients written
  over the weights. Yields an object that is true once scan_layers has run."""
  if adding and sums is None:
    raise ValueError("adding into the layers' sums needs the sums")
  if landing is not None and (wait is None or sums is not None or resident is not None):
    raise ValueError("overlapping the host update needs a wait, one micro-batch and no "
                     "resident layers")
  with _watching(_Watch(stats, sums, adding, resident,
                        None if landing is None else tuple(landing), wait)) as watch:
    yield watch


@contextlib.contextmanager
def _watching(watch: _Watch):
  token = _WRITING_GRADS.set(watch)
  try:
    yield watch
  finally:
    _WRITING_GRADS.reset(token)


def capturing_layers(record: dict, layers):
  """While tracing the model's loss: `scan_layers` does not run the layers
  but records, in `record`, its function as `fn(carry, layer, *consts)`,
  the `consts` it closes over and its `carry`, and returns the carry.
  layers: the engine's (arrays or shapes), which scan_layers must get.
  Yields an object that is true once scan_layers has run."""
  return _watching(_Watch(record=record, expect=layers))


def giving_layers(out):
  """While tracing the model's loss: `scan_layers` returns `out` (shaped
  and typed as its carry) instead of running the layers."""
  return _watching(_Watch(given=out))


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
    out, inputs, layers, landing = _fetching_scan(step, wait, carry, layers, landing)
    return out, (consts, (None, inputs), layers, stats, sums, resident, landing)
  if resident is None:
    out, inputs = jax.lax.scan(lambda c, layer: step(c, jax.tree.map(on_device, layer)),
                               carry, layers)
    return out, (consts, (None, inputs), layers, stats, sums, resident, None)
  r, n_layers = _n_rows(resident), _n_rows(layers)
  middle, first = jax.lax.scan(step, carry, resident)
  # The others by index: a scan over a slice of them could copy it whole.
  out, rest = jax.lax.scan(
      lambda c, i: step(c, jax.tree.map(lambda x: on_device(_row(x, i)), layers)), middle,
      jnp.arange(r, n_layers))
  return out, (consts, (first, rest), layers, stats, sums, resident, None)


def _fetching_scan(step, wait, carry, layers, landing):
  """The scan overlapping the host update: (out, each layer's input, the
  layers with each one's host parts' new weights copied in from `landing`
  once `wait` says the host wrote them, the landing buffers)."""
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
        # Row j, the callback's answer (equal to i): an index the copy cannot
        # have before the callback returns, a stronger order than the barrier's.
        # Reading row i, XLA's latency-hiding scheduler on two GPUs started the
        # copy before the wait returned, and the step read the last weights.
        row = on_device(_row(host, j))[None]
        start = (i,) + (0,) * (x.ndim - 2) + (x.shape[-1] - row.shape[-1],)
        x = jax.lax.dynamic_update_slice(x, row, start)
      new.append(x)
    out, saved = step(c, jax.tree.unflatten(treedef, [_row(x, i) for x in new]))
    return (out, new, here), saved

  (out, leaves, landing), inputs = jax.lax.scan(body, (carry, leaves, landing),
                                                jnp.arange(_n_rows(layers)))
  return out, inputs, jax.tree.unflatten(treedef, leaves), landing


def _n_rows(tree) -> int:
  return jax.tree.leaves(tree)[0].shape[0]


def forward_chunks(fn, consts, carries, layers, stats=None, resident=None, landing=None,
                   wait=None):
  """The layers-first forward (see the module docstring): every layer in
  turn over K micro-batches, one after the other. fn(carry, layer, *consts)
  as `capturing_layers` records it; consts and carries: the micro-batches'
  (each with a leading axis K); the rest as `writing_grads_over_layers`
  takes them. Returns (the outputs, (K, ...) like carries; what
  `backward_chunks` needs)."""
  each = lambda c, layer, *consts: jax.lax.map(lambda a: fn(a[0], layer, *a[1]), (c, consts))
  return _forward(each, False, wait, consts, carries, layers, stats, None, resident, landing)


def backward_chunks(fn, saved, d_out):
  """The layers-first backward: from the last layer to the first, each
  layer's over every micro-batch, its weights' gradient summed over them in
  float32 and written, rounded once, over its weights (with stats: counted
  as the step's backward counts one micro-batch's). d_out: the gradient of
  forward_chunks' outputs. Returns (the gradients of the consts, None for
  those not floating-point; of the carries; the layers, their gradients
  over their weights; of stats, or None; the landing buffers with each
  layer's host parts' gradients written over its new weights, or None)."""
  d_consts, d_carries, layers, d_stats, _, _, landing = _backward_layers(fn, False, saved, d_out,
                                                                         chunked=True)
  return d_consts, d_carries, layers, d_stats, landing


def _backward(fn, adding, wait, saved, d_out):
  del wait  # the forward's
  return _backward_layers(fn, adding, saved, d_out)


def _inexact(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _layer_vjp(fn, consts, x, weights, d_carry):
  """(gradients of the floating-point consts, of x, of the weights) of
  fn(x, weights, *consts) for the output's gradient d_carry."""
  floats = [_inexact(c) for c in consts]

  def f(wide, x, w):
    wide = iter(wide)
    return fn(x, w, *[next(wide) if f else c for c, f in zip(consts, floats)])
  _, vjp = jax.vjp(f, [c for c, f in zip(consts, floats) if f], x, weights)
  return vjp(d_carry)


def _chunks_vjp(fn, consts, x, weights, d_carry):
  """_layer_vjp over micro-batches (consts, x, d_carry: a leading axis K),
  one after the other, the weights' gradients summed in float32 (from the
  first: the order the float32 sums of accumulation add them in)."""
  def one(total, a):
    dc, dx, dw = _layer_vjp(fn, *a[:2], weights, a[2])
    return jax.tree.map(lambda s, d: s + d.astype(jnp.float32), total, dw), (dc, dx)
  zeros = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), weights)
  total, (dc, dx) = jax.lax.scan(one, zeros, (consts, x, d_carry))
  return dc, dx, total


def _backward_layers(fn, adding, saved, d_out, chunked=False):
  """The layers' backward pass: (the gradients of the consts, of the
  carry, of the layers, of stats, of sums, of resident, of landing) as the
  custom VJP returns them. With landing (the step overlapping the host
  update), each layer's host parts' gradients also go down, as the layer's
  backward ends, over the new weights the forward fetched from there: the
  landing buffers' "gradient" is them (the host then reads them there,
  with nothing left to copy after the step)."""
  consts, (first_inputs, inputs), layers, stats, sums, resident, landing = saved
  n_layers = _n_rows(layers)
  r = 0 if resident is None else _n_rows(resident)
  floats = [_inexact(c) for c in consts]

  def one_layer(i, weights, x, acc):
    d_carry, buffer, d_consts, d_stats, landing = acc
    dc, d_carry, d_weights = (_chunks_vjp if chunked else _layer_vjp)(fn, consts, x, weights,
                                                                       d_carry)
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
    if landing is not None:  # the host parts, [k - n, k) of the row (as the forward fetched)
      landing = tuple(h if h is None else jax.lax.dynamic_update_index_in_dim(
          h, _to(jax.memory.Space.Host, d[..., d.shape[-1] - h.shape[-1]:]), i, 0)
          for h, d in zip(landing, jax.tree.leaves(d_weights)))
    return d_carry, buffer, [a + d for a, d in zip(d_consts, dc)], d_stats, landing

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

  zeros = [jnp.zeros_like(c) for c, f in zip(consts, floats) if f]
  d_stats = None if stats is None or adding else jnp.zeros_like(stats)
  acc = (d_out, sums if adding else layers, zeros, d_stats, landing)
  # (A loop's body is traced even for no iterations: indexing none fails.)
  if r < n_layers:
    acc = jax.lax.fori_loop(0, n_layers - r, fetched_layer, acc)
  if r:
    acc = jax.lax.fori_loop(0, r, resident_layer, acc)
  d_carry, buffer, d_floats, d_stats, landing = acc
  d_floats = iter(d_floats)
  d_consts = tuple(next(d_floats) if f else None for f in floats)
  if adding:  # the sums' gradient is the new sums; the weights' is not used
    return d_consts, d_carry, None, None, buffer, None, None
  return d_consts, d_carry, buffer, d_stats, None, None, landing


_scan_writing_grads.defvjp(_forward, _backward)
