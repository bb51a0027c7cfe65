"""What every model family here shares: the functional view of an NNX model
(its parameters as a nested dict of arrays, which the ZeRO engine partitions
and trains, and the module rebuilt around them), the stacked layers built and
run as one scan, the remat and attention choices, the activation count of
running the layers first, and the layers run over a key/value cache for
generation (jzo.models.decoding).

A family's module class takes `(config, *, rngs=nnx.Rngs)`, its config is
hashable (a frozen dataclass), and its stacked layers are one nnx.Module
whose params carry a leading layer axis.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import jzo

# jax.checkpoint policy of each config's `remat` value ("none": no checkpoint).
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "none": None,
}


def attention_implementation(choice: str, head_dim: int, dtype) -> str:
  """The `jax.nn.dot_product_attention` implementation a model's `attention`
  setting (`choice`: "auto", "cudnn" or "xla") gives for heads of `head_dim`
  and activations of `dtype`: "auto" is cuDNN's flash attention where it
  runs (a GPU, 16-bit activations, heads a multiple of 8 up to 128), else XLA."""
  if choice != "auto":
    return choice
  cudnn_ok = (jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16)
              and head_dim % 8 == 0 and head_dim <= 128)
  return "cudnn" if cudnn_ok else "xla"


def layers_first_bytes(saved: int, layer_io: int, accumulation: int) -> int:
  """What a step keeps of its micro-batches' layers: `saved` bytes (one
  micro-batch's saved activations, layer_io its layers' input) for one, or,
  running the layers first over `accumulation` micro-batches, that many
  times saved plus their inputs, outputs and the outputs' gradients."""
  if accumulation == 1:
    return saved
  return accumulation * (saved + 3 * layer_io)


def stacked_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], n_layer: int,
                   rngs: nnx.Rngs) -> nnx.Module:
  """n_layer layers from `make_layer(rngs)` as one module whose params are
  stacked on a leading layer axis, each layer drawn from its own split of
  `rngs`."""
  @nnx.split_rngs(splits=n_layer)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def stacked_blocks(rngs):
    return make_layer(rngs)
  return stacked_blocks(rngs)


def scan_layers(layers: nnx.Module, x: jax.Array, remat: str, *args) -> jax.Array:
  """x through the stacked `layers` one at a time (`jzo.scan_layers`), each
  called as layer(x, *args); every step passes its layer's params through
  `jzo.gather_layer` (ZeRO stage 3 gathers one layer at a time) and is
  rematerialized as `remat` says (REMAT_POLICIES)."""
  block, params = nnx.split(layers)

  def step(x, layer):  # layer: one block's params as a dict (ZeRO-3 shards them)
    return nnx.merge(block, jzo.gather_layer(layer))(x, *args)
  if remat != "none":
    # prevent_cse=False: inside a scan CSE cannot merge the recomputation
    # away, and the barriers it would add keep XLA from fusing across them.
    step = jax.checkpoint(step, policy=REMAT_POLICIES[remat], prevent_cse=False)
  return jzo.scan_layers(step, x, nnx.to_pure_dict(params))


def init_params(module: type[nnx.Module], config, key: jax.Array, dtype=jnp.float32) -> dict:
  """A new `module(config)`'s parameters as a nested dict of `dtype` arrays
  (drawn from `key`): what the ZeRO engine partitions and trains, and `bind`
  turns back into the module."""
  model = module(config, rngs=nnx.Rngs(key))
  return jax.tree.map(lambda x: x.astype(dtype), nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@functools.lru_cache(maxsize=None)
def graphdef(module: type[nnx.Module], config) -> nnx.GraphDef:
  """`module(config)`'s structure, without materialising any parameter;
  one object for each (module, config), so programs over it trace alike."""
  return nnx.split(nnx.eval_shape(lambda: module(config, rngs=nnx.Rngs(0))))[0]


def bind(module: type[nnx.Module], config, params: dict) -> nnx.Module:
  """The `module(config)` holding `params` (a nested dict of arrays, as
  init_params makes), to call inside a traced function."""
  return nnx.merge(graphdef(module, config), params)


def kv_cache(n_layer: int, batch: int, length: int, kv_heads: int, head_dim: int,
             dtype) -> dict:
  """An empty key/value cache for `batch` sequences of up to `length`
  tokens: "k" and "v", each (n_layer, batch, length, kv_heads, head_dim)."""
  shape = (n_layer, batch, length, kv_heads, head_dim)
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def prefill_layers(layers: nnx.Module, x, cache: dict, *args,
                   attention: Callable | None = None) -> tuple[jax.Array, dict]:
  """x (B, T, D), prompts from position 0, through the stacked `layers`
  (each has attention_inputs(x, *args) -> q, k, v and after_attention(x,
  att); x may be a tree the layers carry): attention is causal over the
  prompt itself (flash attention where the model's `attention` allows), and
  each layer's keys and values are written to `cache` (kv_cache's, T <= its
  length) at positions 0..T-1.

  attention: for models whose layers attend otherwise (sliding windows,
  soft-capped scores), `attention(config, q, k, v, layer)` -> the layer's
  (B, T, H, hd) over the prompt's own keys; `layer`: its index (int32).
  """
  def attend(config, q, k, v, cache, layer):
    if attention is None:
      impl = attention_implementation(config.attention, q.shape[-1], q.dtype)
      att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    else:
      att = attention(config, q, k, v, layer)
    start = (layer, 0, 0, 0, 0)
    return att, {"k": jax.lax.dynamic_update_slice(cache["k"], k[None], start),
                 "v": jax.lax.dynamic_update_slice(cache["v"], v[None], start)}
  return _cached_layers(layers, x, cache, attend, False, *args)


def decode_layers(layers: nnx.Module, x, cache: dict, positions: jax.Array, *args,
                  attention: Callable | None = None) -> tuple[jax.Array, dict]:
  """x (B, 1, D), one token a row at `positions` (B,) int, through the
  stacked `layers` as prefill_layers: each layer writes the token's key and
  value to `cache` at its position and attends over the cache up to it.

  attention: as prefill_layers', `attention(config, q, k, v, layer,
  positions)` -> (B, 1, H, hd) over the layer's whole cache k, v (B, S, K,
  hd), of which each row reads keys 0..its position.
  """
  rows = jnp.arange(positions.shape[0])

  def attend(config, q, k, v, cache, layer):
    cache = {"k": cache["k"].at[layer, rows, positions].set(k[:, 0]),
             "v": cache["v"].at[layer, rows, positions].set(v[:, 0])}
    if attention is not None:
      return attention(config, q, cache["k"][layer], cache["v"][layer], layer, positions), cache
    att = jax.nn.dot_product_attention(q, cache["k"][layer], cache["v"][layer],
                                       key_value_seq_lengths=positions + 1, implementation="xla")
    return att, cache
  # Unrolled: each layer's weights are then a static slice, which the matmul
  # reads in place; a scan's dynamic slice is copied out first, which triples
  # the bytes a token moves (weights read, written, read again).
  return _cached_layers(layers, x, cache, attend, True, *args)


def _cached_layers(layers: nnx.Module, x: jax.Array, cache: dict, attend: Callable,
                   unroll: bool, *args) -> tuple[jax.Array, dict]:
  """x through the stacked layers as one scan (unrolled or not), the whole
  cache carried (so each layer updates it in place) and `attend(config, q,
  k, v, cache, layer index)` giving each layer's attention and the updated
  cache."""
  block, params = nnx.split(layers)

  def step(carry, layer_params):
    x, cache, layer = carry
    module = nnx.merge(block, layer_params)
    q, k, v = module.attention_inputs(x, *args)
    att, cache = attend(module.config, q, k.astype(cache["k"].dtype),
                        v.astype(cache["v"].dtype), cache, layer)
    return (module.after_attention(x, att), cache, layer + 1), None
  (x, cache, _), _ = jax.lax.scan(step, (x, cache, 0), nnx.to_pure_dict(params),
                                  unroll=unroll)
  return x, cache
