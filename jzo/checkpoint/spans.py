"""The live optimizer state read a span at a time, so that a checkpoint of
a model as large as the host never holds a second copy of it.

A leaf's masters or moments live in pieces (`Pieces`): each shard's device
part (on its device) and host part (in host RAM; int8 moments as codes and
scales). A checkpoint keeps them in the params' full shapes
(jzo.checkpoint.state_dict's ADAM format). `StreamedArray` reads a rectangle
of the full shape (one layer's rows [a, b) of its first axis, or a leaf's)
from the pieces; `StreamedShards` one process's shards of the flat padded
leaf (several processes' format); jzo.checkpoint.handler writes one
rectangle after another. The way back, a saved leaf read span by span into
the pieces, is jzo.checkpoint.saved_leaf's. Either way the host holds a few
spans of SPAN_BYTES beside the state, whatever the model's size.

Positions: a leaf is a stack of rows (one a layer for stage 3's per-layer
leaves, else one row), each row flattened and padded to S*k values, of
which shard d holds [d*k, (d+1)*k): [0, c) on its device, [c, k) on the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import AsyncIterator

import jax
import numpy as np

from jzo.kernels import quant8
from jzo.parallel.partition import LeafLayout

# Bytes of one span: what the host holds for each write or read in flight.
SPAN_BYTES = 64 * 2**20
# Spans written or read at once (tensorstore compresses and decompresses
# them in parallel).
SPANS_IN_FLIGHT = 8


def rectangles(layout: LeafLayout, itemsize: int, per_span: int | None = None
               ) -> list[tuple[tuple[slice, ...], int, int, int]]:
  """The spans of a leaf, in order: (index into the full shape, row, first
  flat position, last + 1). Each is rows [a, b) of the inner shape's first
  axis within one row of the leaf: `per_span` of them, by default about
  SPAN_BYTES (at least one)."""
  inner = layout.inner_shape
  rest = math.prod(inner[1:])
  per_span = per_span or max(1, SPAN_BYTES // (itemsize * max(rest, 1)))
  lead = layout.shape[0] if layout.per_layer else 1
  out = []
  for row in range(lead):
    first = (slice(row, row + 1),) if layout.per_layer else ()
    if not inner:  # a scalar leaf
      out.append((first, row, 0, 1))
      continue
    for a in range(0, inner[0], per_span):
      b = min(a + per_span, inner[0])
      out.append((first + (slice(a, b),), row, a * rest, b * rest))
  return out


def span_shape(layout: LeafLayout, index: tuple[slice, ...]) -> tuple[int, ...]:
  """The shape of the rectangle `index` (from `rectangles`) of the leaf."""
  return tuple(len(range(*s.indices(n))) for s, n in zip(index, layout.shape)) \
      + layout.shape[len(index):]


# ------------------------------------------------------------ the pieces
@dataclasses.dataclass
class Pieces:
  """One leaf's master or moment as the engine holds it.

  device: the global device part (`part_shape(c)`), or None when c = 0.
  host: the host parts over this process's shards ((n, *rows, k - c) numpy,
    or a quant8.Int8Moment), or None without offload.
  signed: an int8 host part is a first moment (the signed map).
  codes: an int8 host part is read as its codes (uint8), not its values.
  """
  layout: LeafLayout
  device: jax.Array | None
  host: object | None
  signed: bool = False
  codes: bool = False

  def read(self, row: int, x0: int, x1: int, dtype) -> np.ndarray:
    """Flat positions [x0, x1) of `row` (one process: every shard is its own)."""
    k = self.layout.shard_size
    out = np.empty(x1 - x0, dtype)
    devices = self.device_shards(range(self.layout.shards))
    for d in range(x0 // k, -(-x1 // k)):
      lo, hi = max(x0, d * k) - d * k, min(x1, (d + 1) * k) - d * k
      self.read_shard(devices, d, row, lo, hi, out[d * k + lo - x0:d * k + hi - x0])
    return out

  def device_shards(self, positions: range) -> list[jax.Array] | None:
    """The device parts of the shards at `positions` (this process's), or
    None when the devices hold none."""
    return shard_arrays(self.device, self.layout, positions) if self.layout.on_device else None

  def read_shard(self, devices: list[jax.Array] | None, j: int, row: int, lo: int, hi: int,
                 out: np.ndarray) -> None:
    """out = columns [lo, hi) of `row` of this process's j-th shard: [0, c)
    from its device part (devices[j], from `device_shards`), the rest from
    its host part."""
    layout = self.layout
    c, at = layout.on_device, 0
    if lo < c:
      n = min(hi, c) - lo
      out[:n] = np.asarray(_take(devices[j], row_index(layout, row, lo), n))
      at, lo = n, lo + n
    if lo < hi:
      out[at:] = _host_values(self.host, j, layout, row, lo - c, hi - c, self.signed, self.codes)


@dataclasses.dataclass
class HeldPieces:
  """An array held whole on the host (int8 moments' scales), read as Pieces
  are: one row of its flat values."""
  array: np.ndarray

  @property
  def layout(self) -> LeafLayout:
    return LeafLayout(tuple(self.array.shape), shards=1)

  def read(self, row: int, x0: int, x1: int, dtype) -> np.ndarray:
    return self.array.reshape(-1)[x0:x1].astype(dtype)


def read_whole(pieces, dtype) -> np.ndarray:
  """A leaf's pieces (Pieces or HeldPieces) read into a new array of its
  full shape, span by span."""
  layout = pieces.layout
  out = np.empty(layout.shape, dtype)
  for index, row, x0, x1 in rectangles(layout, np.dtype(dtype).itemsize):
    out[index] = pieces.read(row, x0, x1, dtype).reshape(span_shape(layout, index))
  return out


def read_rows(pieces, rows: slice, dtype) -> np.ndarray:
  """Rows [rows.start, rows.stop) of the first axis of a leaf's full shape
  (the whole leaf for a scalar), read from its pieces (Pieces or HeldPieces)."""
  layout = pieces.layout
  if not layout.shape:
    return pieces.read(0, 0, 1, dtype).reshape(())
  a, b = rows.start or 0, layout.shape[0] if rows.stop is None else rows.stop
  row_shape = layout.shape[1:]
  size = math.prod(row_shape)
  if not layout.per_layer:  # one flat row holds the whole leaf
    return pieces.read(0, a * size, b * size, dtype).reshape((b - a,) + row_shape)
  out = np.empty((b - a,) + row_shape, dtype)
  for i in range(a, b):  # a layer a row of the pieces
    out[i - a] = pieces.read(i, 0, size, dtype).reshape(row_shape)
  return out


def row_index(layout: LeafLayout, row: int, column: int) -> tuple[int, ...]:
  """The index of `column` of `row` in a leaf's device part or flat shards:
  (row, column) with a row per layer, else (column,)."""
  return (row, column) if layout.per_layer else (column,)


def _host_values(host, d: int, layout: LeafLayout, row: int, lo: int, hi: int,
                 signed: bool, codes: bool = False) -> np.ndarray:
  """Host part columns [lo, hi) of shard d's `row`, as stored or (int8
  moments, unless `codes`) dequantized."""
  pick = (lambda x: x[d, row]) if layout.per_layer else (lambda x: x[d])
  if not isinstance(host, quant8.Int8Moment):
    return pick(host)[lo:hi]
  if codes:
    return pick(host.codes)[lo:hi]
  first, last = lo // quant8.QUANT_BLOCK, -(-hi // quant8.QUANT_BLOCK)
  codes = pick(host.codes)[first * quant8.QUANT_BLOCK:last * quant8.QUANT_BLOCK]
  block = quant8.Int8Moment(codes, pick(host.scales)[first:last])
  values = quant8.dequantize(block, signed=signed)
  return values[lo - first * quant8.QUANT_BLOCK:hi - first * quant8.QUANT_BLOCK]


def _offsets(at: tuple[int, ...], shape: tuple[int, ...]):
  """(a context, the offsets `at` as index arrays within it): 64-bit where
  an offset into `shape` may pass int32's range (a leaf of a 10B model has
  3.4B elements), else 32-bit with no context."""
  if max(shape) < 2**31:
    return contextlib.nullcontext(), tuple(np.int32(i) for i in at)
  return jax.enable_x64(True), tuple(np.int64(i) for i in at)


def _take(x: jax.Array, at: tuple[int, ...], n: int) -> jax.Array:
  """n elements of x's last axis from position `at` (a single-device array)."""
  context, offsets = _offsets(at, x.shape)
  with context:
    return _take_jit(x, offsets, n)


@functools.partial(jax.jit, static_argnums=2)
def _take_jit(x, at, n):
  return jax.lax.dynamic_slice(x, at, (1,) * (x.ndim - 1) + (n,)).reshape(-1)


def put_into(buffer: jax.Array, values: np.ndarray, at: tuple[int, ...]) -> jax.Array:
  """`values` written into the single-device `buffer` at `at` (donated: in
  place); values has buffer's rank, or is flat along its last axis."""
  values = values.reshape((1,) * (buffer.ndim - values.ndim) + values.shape)
  context, offsets = _offsets(at, buffer.shape)
  with context:
    return _put_jit(buffer, jax.device_put(values, next(iter(buffer.devices()))), offsets)


@functools.partial(jax.jit, donate_argnums=0)
def _put_jit(buffer, values, at):
  return jax.lax.dynamic_update_slice(buffer, values.astype(buffer.dtype), at)


# ------------------------------------------------------------ saving
class _Streamed:
  """What orbax sees of an array written span by span from the live state
  (a subclass gives `shape`, `dtype`, `chunk_shape` and `spans`)."""

  def __deepcopy__(self, memo):
    # Orbax copies what it saves before writing it in the background; this
    # is read from the live state while jzo.checkpoint.save waits for it.
    return self

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)


@dataclasses.dataclass
class StreamedArray(_Streamed):
  """A leaf's master or moment in its full shape, read span by span from
  the live state when jzo.checkpoint writes it (valid until the next step)."""
  pieces: Pieces
  dtype: np.dtype
  # Bytes a value counts for when the leaf is cut into spans (None: its
  # dtype's): int8 codes are cut as the float32 values a restore makes of them.
  span_itemsize: int | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    return self.pieces.layout.shape

  @property
  def chunk_shape(self) -> tuple[int, ...]:
    """The shape of the first (largest) span: the chunks of the saved array."""
    layout = self.pieces.layout
    return span_shape(layout, rectangles(layout, self._itemsize)[0][0])

  @property
  def _itemsize(self) -> int:
    return self.span_itemsize or self.dtype.itemsize

  async def spans(self, before_each) -> AsyncIterator[tuple[tuple[slice, ...], np.ndarray]]:
    """(index into the full shape, the values there), one span after
    another, each read after `await before_each(its bytes)`."""
    layout = self.pieces.layout
    for index, row, x0, x1 in rectangles(layout, self._itemsize):
      await before_each((x1 - x0) * self.dtype.itemsize)
      values = self.pieces.read(row, x0, x1, self.dtype)
      yield index, values.reshape(span_shape(layout, index))


@dataclasses.dataclass
class StreamedShards(_Streamed):
  """A leaf's master or moment flat and padded (`flat_shape`: several
  processes' format), of which this process writes its own shards, span
  by span, from the live state when jzo.checkpoint writes it (valid until
  the next step). The chunks are spans of one shard's row, so that no two
  processes write the same one."""
  pieces: Pieces
  dtype: np.dtype
  positions: range  # this process's shards

  @property
  def shape(self) -> tuple[int, ...]:
    return self.pieces.layout.flat_shape

  @property
  def chunk_shape(self) -> tuple[int, ...]:
    """(1, n) or (n,): n columns of a row, the largest divisor of the
    shard's k of at most SPAN_BYTES (k itself where that would cut a row
    into more than 256 chunks: a k with no such divisor)."""
    k = self.pieces.layout.shard_size
    most = max(1, SPAN_BYTES // self.dtype.itemsize)
    n = max((n for n in _divisors(k) if n <= most), default=1)
    if k // n > 256:
      n = k
    return (1,) * (self.ndim - 1) + (n,)

  async def spans(self, before_each) -> AsyncIterator[tuple[tuple[slice, ...], np.ndarray]]:
    """(index into the flat shape, the values there): this process's chunks,
    one after another, each read after `await before_each(its bytes)`."""
    layout = self.pieces.layout
    k, n = layout.shard_size, self.chunk_shape[-1]
    devices = self.pieces.device_shards(self.positions)
    for row in range(layout.shape[0] if layout.per_layer else 1):
      first = (slice(row, row + 1),) if layout.per_layer else ()
      for j, d in enumerate(self.positions):
        for a in range(0, k, n):
          await before_each(n * self.dtype.itemsize)
          values = np.empty(n, self.dtype)
          self.pieces.read_shard(devices, j, row, a, a + n, values)
          yield first + (slice(d * k + a, d * k + a + n),), values.reshape(len(first) * (1,) + (n,))


def _divisors(k: int) -> list[int]:
  """Every n that divides k (some twice where k is a square)."""
  small = [n for n in range(1, math.isqrt(k) + 1) if k % n == 0]
  return small + [k // n for n in small]


def shard_arrays(x: jax.Array, layout: LeafLayout, positions: range) -> list[jax.Array]:
  """The single-device arrays of a global array of a leaf (flat: sharded
  over the data axis, or whole on every device) at `positions` of the data
  axis, in that order."""
  shards = x.addressable_shards
  if layout.shards == 1 or len({repr(s.index) for s in shards}) == 1:  # whole on each device
    mesh_devices = x.sharding.mesh.devices.flat
    by_device = {s.device: s.data for s in shards}
    return [by_device[mesh_devices[d]] for d in positions]
  width = x.shape[-1] // layout.shards
  by_position = {(s.index[-1].start or 0) // width: s.data for s in shards}
  return [by_position[d] for d in positions]
