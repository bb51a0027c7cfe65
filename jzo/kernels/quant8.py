"""8-bit Adam moments: block-wise dynamic quantization (ext/quant8.h).

Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022.
An `Int8Moment` holds a moment of any shape as one byte a value and one
float32 scale per block of `QUANT_BLOCK` values along the last axis (a
row's last block may be shorter): value = scales[..., j // QUANT_BLOCK] *
map[codes[..., j]]. The maps are the C++ kernel's (`jzo.native.quant8_map`):
signed for the first moment, unsigned for the second.

`quantize` and `dequantize` are the kernel's rounding in array operations
(numpy or jax.numpy, whichever the input is): the XLA path of `cpu_adamw`,
checkpoints and the tests use them.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jzo import native

QUANT_BLOCK = native.QUANT_BLOCK  # values a scale covers, along the last axis
INT8 = "int8"  # the name moments take in jzo (cpu_adamw's mu_dtype, --moments)


class Int8Moment(NamedTuple):
  """A quantized Adam moment of shape `codes.shape` (a pytree of two arrays)."""
  codes: Any  # uint8, the moment's shape
  scales: Any  # float32, scale_shape(codes.shape): each block's largest magnitude


def is_int8(dtype) -> bool:
  """Whether a moment dtype (cpu_adamw's mu_dtype, nu_dtype) asks for Int8Moments."""
  return dtype is not None and np.dtype(dtype) == np.int8


def is_moment(x) -> bool:
  """is_leaf for trees of moments: an Int8Moment is one leaf."""
  return isinstance(x, Int8Moment)


def leaves(tree) -> list:
  """jax.tree.leaves with each Int8Moment one leaf."""
  return jax.tree.leaves(tree, is_leaf=is_moment)


def shape_of(x) -> tuple[int, ...]:
  """The shape of a moment: an array's, or an Int8Moment's codes'."""
  return tuple((x.codes if isinstance(x, Int8Moment) else x).shape)


def blocks(n: int) -> int:
  """Blocks of a row of n values."""
  return -(-int(n) // QUANT_BLOCK)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """Shape of the scales of a moment of `shape` (a scalar is a row of one)."""
  shape = tuple(shape) or (1,)
  return shape[:-1] + (blocks(shape[-1]),)


def nbytes(shape: tuple[int, ...]) -> int:
  """Bytes an Int8Moment of `shape` holds."""
  return int(np.prod(shape, dtype=np.int64)) + 4 * int(np.prod(scale_shape(shape), dtype=np.int64))


@functools.cache
def code_map(signed: bool) -> tuple[np.ndarray, np.ndarray]:
  """The kernel's map (float32): the 256 values the codes stand for, in
  order, and the 255 midpoints between neighbours (a magnitude at or below
  midpoint j takes a code <= j)."""
  codes, mids = native.quant8_map(signed)
  return np.asarray(codes, np.float32), np.asarray(mids, np.float32)


@functools.cache
def _index(signed: bool) -> tuple[np.ndarray, np.ndarray]:
  """The kernel's quant8_exact index (ext/quant8.h), by the top 16 bits of a
  magnitude in [0, 1] (patterns 0 .. 0x3F80): the midpoints below the
  pattern's range, and the low 16 bits of the one midpoint inside it
  (0x10000: none)."""
  mids = code_map(signed)[1]
  tops = np.arange(0x3F81, dtype=np.uint32)
  below = np.searchsorted(mids, (tops << 16).view(np.float32), side="left").astype(np.int16)
  bits = mids.view(np.uint32)
  if np.unique(bits >> 16).size != bits.size:
    raise AssertionError("two midpoints share a bfloat16 pattern: the index needs one at most")
  low = np.full(tops.size, 0x10000, np.int32)
  low[bits >> 16] = bits & 0xFFFF
  return below, low


def nearest_codes(magnitude: np.ndarray, signed: bool) -> np.ndarray:
  """The midpoints below each magnitude (float32 in [0, 1], flat): the
  nearest code, a tie to the lower, as a binary search finds it but looked
  up as the kernel does (about ten times faster in numpy)."""
  below, low = _index(signed)
  bits = np.ascontiguousarray(magnitude, np.float32).view(np.uint32)
  top = bits >> 16
  return below[top] + ((bits & 0xFFFF).astype(np.int32) > low[top])


def _xp(x):
  return np if isinstance(x, np.ndarray) else jnp


def _blocked(x, xp):
  """x (float32, shape (..., k)) as (..., blocks(k), QUANT_BLOCK), zero-padded."""
  k = x.shape[-1]
  pad = blocks(k) * QUANT_BLOCK - k
  x = xp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(x.shape[:-1] + (blocks(k), QUANT_BLOCK))


def code_values(signed: bool) -> np.ndarray:
  """The value of each of the 256 codes before its block's scale (float32)."""
  return code_map(signed)[0]


def dequantize(q: Int8Moment, *, signed: bool):
  """The float32 values of q (numpy in, numpy out; jax in, jax out)."""
  xp = _xp(q.codes)
  shape = q.codes.shape
  codes = q.codes.reshape(shape or (1,))
  values = xp.asarray(code_values(signed))[codes.astype(xp.int32)]
  scaled = _blocked(values, xp) * q.scales[..., None]
  return scaled.reshape(scaled.shape[:-2] + (-1,))[..., :codes.shape[-1]].reshape(shape)


def quantize(x, *, signed: bool) -> Int8Moment:
  """x (float32 values) as an Int8Moment, rounded as the kernel rounds: each
  block's scale is its largest magnitude (NaN if any value is not finite),
  each value the nearest code of value / scale (a tie to the lower)."""
  xp = _xp(x)
  shape = x.shape
  x = xp.asarray(x, xp.float32).reshape(shape or (1,))
  block = _blocked(x, xp)
  absmax = xp.max(xp.abs(block), axis=-1)
  finite = xp.all(xp.isfinite(block), axis=-1)
  scales = xp.where(finite, absmax, xp.float32(np.nan)).astype(xp.float32)
  safe = xp.where(finite & (absmax > 0), absmax, xp.float32(1))
  inv = xp.where(finite & (absmax > 0), xp.float32(1) / safe, xp.float32(0)).astype(xp.float32)
  y = (block * inv[..., None]).reshape(block.shape[:-2] + (-1,))[..., :x.shape[-1]]
  magnitude = xp.minimum(xp.abs(y), xp.float32(1))
  magnitude = xp.where(xp.isnan(magnitude), xp.float32(1), magnitude)  # the kernel clamps NaN bits
  if xp is np:
    k = nearest_codes(magnitude.reshape(-1), signed)
  else:
    k = xp.searchsorted(xp.asarray(code_map(signed)[1]), magnitude.reshape(-1), side="left")
  k = k.reshape(magnitude.shape).astype(xp.uint8)
  if signed:
    k = k | (xp.signbit(y).astype(xp.uint8) << 7)
  return Int8Moment(k.reshape(shape), scales)


def zeros(shape: tuple[int, ...], xp=np, **kwargs) -> Int8Moment:
  """A moment of zeros (codes 0, scales 0); kwargs go to xp.zeros (e.g. device)."""
  return Int8Moment(xp.zeros(shape, xp.uint8, **kwargs),
                    xp.zeros(scale_shape(shape), xp.float32, **kwargs))
