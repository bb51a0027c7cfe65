"""Where an engine's initial parameters come from, and what the optimizer's
state costs: the forms `ZeroEngine(params=...)` takes (arrays, a function
that returns them, lazy HostLeafs from files), each drawn a leaf at a time
so that no float32 copy of the model is ever whole."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.extend.core import jaxpr_as_fun

from jzo.host.leaf import HostLeaf


def leaf_sources(params, device):
  """(shapes, draw, sliced) for params given as a tree of arrays or of
  HostLeafs, or as a function returning a tree: draw([(i, layout, span),
  ...]) is a list of those leaves as float32 (a stacked leaf's layers
  [lo, hi) where span is given, else whole), each flattened by its
  `layout.flatten` and computed on `device`, so each is the only copy made.
  A function is traced once, then the leaves asked for are computed
  together by replaying the trace in one program (XLA drops the rest of the
  function), so no whole float32 copy is ever held; it computes each leaf
  whole (sliced False: a slice of a replayed leaf still computes all of
  it). A HostLeaf is loaded only when drawn (`HostLeaf.rows` for a span),
  and its host array is let go as soon as it is on the device."""
  if callable(params):
    # Replaying the trace is cheaper than tracing the model's initializer
    # again for each leaf (those traces were half of a small model's build),
    # and one program for several leaves than one for each (each program
    # costs its lowering and compile or cache lookup).
    traced, shapes = jax.make_jaxpr(params, return_shape=True)()
    replay = jaxpr_as_fun(traced)

    def draw(leaves):  # never asked for spans: the plan's sliced_draws is False
      def program():
        values = replay()
        return [layout.flatten(values[i].astype(jnp.float32)) for i, layout, _ in leaves]
      with jax.default_device(device):
        return jax.jit(program)()
  else:
    leaves = jax.tree.leaves(params)
    lazy = lambda x: isinstance(x, HostLeaf)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if lazy(x) else x,
                          params)

    def draw_one(i, layout, span):
      x = leaves[i]
      if lazy(x):
        host = x.load() if span is None else x.rows(*span)
        shape = x.shape if span is None else (span[1] - span[0],) + x.shape[1:]
        if host.shape != shape or host.dtype != x.dtype:
          what = "" if span is None else f" layers [{span[0]}, {span[1]})"
          raise ValueError(f"params leaf {i}{what} loaded as {host.dtype}{list(host.shape)}, "
                           f"declared {x.dtype}{list(shape)}")
        x = jax.device_put(host, device)
        del host  # the device copy (or the transfer in flight) keeps what it needs
      else:
        x = jax.device_put(x if span is None else x[span[0]:span[1]], device)
      # A new buffer (jit does not hand back its input): the state is donated
      # each step and must not alias the caller's arrays.
      return _flat_float32(x, layout)

    def draw(leaves):
      return [draw_one(i, layout, span) for i, layout, span in leaves]
  if not jax.tree.leaves(shapes):
    raise ValueError("params has no leaves")
  for path, x in jax.tree_util.tree_leaves_with_path(shapes):
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise TypeError(f"params leaf {jax.tree_util.keystr(path)} is {jnp.result_type(x)}, "
                      "not floating point")
  return shapes, draw, not callable(params)


@functools.partial(jax.jit, static_argnums=1)
def _flat_float32(x: jax.Array, layout) -> jax.Array:
  """x as float32, flattened by `layout` (static: one program per layout,
  shared by every engine)."""
  return layout.flatten(x.astype(jnp.float32))


def state_bytes_per_param(tx: optax.GradientTransformation) -> int:
  """Bytes of tx's state per parameter (e.g. 8 for Adam's float32 moments)."""
  n = 1024
  state = jax.eval_shape(tx.init, {"x": jax.ShapeDtypeStruct((n,), jnp.float32)})
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.ndim) // n
