"""The grouped matrix product of the mixture-of-experts MLP: rows sorted by
group, each group's rows times its own matrix (`jax.lax.ragged_dot`'s
meaning), with its gradients.

XLA on CUDA lowers ragged_dot to a grouped GEMM only with cuDNN 9.22 or
later, and the weight gradient (whose contracting dimension is ragged)
always to a dense product of every row with every group's matrix: at 128
experts, 128 times the work. On Hopper GPUs `grouped_matmul` therefore runs
jax's Mosaic GPU kernels, which compute only each group's rows: the ragged
dot for the forward product and the input gradient, the transposed ragged
dot for the weight gradient. Elsewhere (the CPU, other GPUs, shapes the
kernels' tiles do not divide) it is jax.lax.ragged_dot.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

# Tiles of both kernels (rows, output columns, contracting), the pipeline's
# depth and the output's column blocks a pass: the fastest measured on an
# H200 at Qwen3-30B-A3B's expert shapes (docs/performance.md).
TILES = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2)


@functools.cache
def _kernels():
  """jax's Mosaic GPU (ragged_dot, transposed_ragged_dot, whether ragged_dot
  takes transpose_rhs), or None where they cannot run: no Hopper GPU, or a
  jax without them."""
  devices = jax.devices()
  if jax.default_backend() != "gpu" or not all(
      str(getattr(d, "compute_capability", "")).startswith("9") for d in devices):
    return None
  try:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
  except ImportError:
    return None
  forward = ragged_dot_mgpu.ragged_dot
  return (forward, transposed_ragged_dot_mgpu.transposed_ragged_dot,
          "transpose_rhs" in inspect.signature(forward).parameters)


def runs_kernels(x: jax.Array, w: jax.Array) -> bool:
  """Whether `grouped_matmul` runs the Hopper kernels for x (R, K) times w
  (G, K, N): a Hopper GPU, x and w 16-bit floats of one dtype, and K and N
  multiples of every tile (the three products contract or output each)."""
  _, K, N = w.shape
  tile = max(TILES["block_m"], TILES["block_n"] * TILES["grid_block_n"], TILES["block_k"])
  return (x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16)
          and K % tile == 0 and N % tile == 0 and _kernels() is not None)


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
  """Rows x (R, K), sorted by group, times their group's matrix w (G, K, N):
  (R, N), row r of group g being x[r] @ w[g]. sizes (G,) int32 counts each
  group's rows and sums to R."""
  if runs_kernels(x, w):
    return _hopper(x, w, sizes)
  return jax.lax.ragged_dot(x, w, sizes)


def _forward(x, w, sizes, transposed=False):
  """x (R, K) times w (G, K, N): (R, N); with `transposed`, x (R, N) times
  each w[g] transposed (N, K): (R, K)."""
  ragged_dot, _, takes_transpose = _kernels()
  if transposed:
    if not takes_transpose:  # an older jax: the transposes written out
      return ragged_dot(x, jnp.swapaxes(w, 1, 2), group_sizes=sizes, **TILES)
    return ragged_dot(x, w, group_sizes=sizes, transpose_rhs=True, **TILES)
  return ragged_dot(x, w, group_sizes=sizes, **TILES)


@jax.custom_vjp
def _hopper(x, w, sizes):
  return _forward(x, w, sizes)


def _hopper_forward(x, w, sizes):
  return _forward(x, w, sizes), (x, w, sizes)


def _hopper_backward(saved, dy):
  """dx = dy (R, N) times each group's w transposed; dw[g] = x_g^T dy_g,
  contracting over the group's rows only."""
  x, w, sizes = saved
  dy = dy.astype(x.dtype)
  dx = _forward(dy, w, sizes, transposed=True)
  dw = _kernels()[1](x, dy, group_sizes=sizes, **TILES)
  return dx, dw.astype(w.dtype), None


_hopper.defvjp(_hopper_forward, _hopper_backward)
