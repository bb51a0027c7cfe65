"""The optimizer state read and written a span at a time, so that a
checkpoint of a model as large as the host never holds a second copy of it.

A leaf's masters or moments live in pieces: each shard's device part (on
its device) and host part (in host RAM; int8 moments as codes and scales).
A checkpoint keeps them in the params' full shapes (jzo.checkpoint.state_dict's ADAM
format). `StreamedArray` reads a rectangle of the full shape (one layer's
rows [a, b) of its first axis, or a leaf's) from the pieces; jzo.checkpoint
writes one rectangle after another (`SpanHandler`). `load_leaf` goes the
other way: it reads a saved leaf (`SavedLeaf`, or an array held whole) span
by span and writes the engine's pieces in place (jzo.checkpoint.state_dict drives it).
Either way the host holds a few spans of SPAN_BYTES beside the state,
whatever the model's size.

Positions: a leaf is a stack of rows (one a layer for stage 3's per-layer
leaves, else one row), each row flattened and padded to S*k values, of
which shard d holds [d*k, (d+1)*k): [0, c) on its device, [c, k) on the host.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import os
import weakref
from typing import AsyncIterator

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

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
      out[:n] = np.asarray(_take(devices[j], _at(layout, row, lo), n))
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


def _at(layout: LeafLayout, row: int, column: int) -> tuple[int, ...]:
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


def _put(buffer: jax.Array, values: np.ndarray, at: tuple[int, ...]) -> jax.Array:
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


class SavedLeaf:
  """A saved master or moment, open for reading spans (what `load_leaf` reads):
  in its full shape, or flat and padded with a row per layer (several
  processes' checkpoints); the values of each row are at its start."""

  def __init__(self, store: ts.TensorStore):
    self.store = store
    self.shape = tuple(store.shape)
    self.dtype = np.dtype(store.dtype.numpy_dtype)

  def chunk_rows(self, layout: LeafLayout) -> int | None:
    """Rows of the inner shape's first axis in each saved chunk, where the
    chunks are whole rows of one layer (as SpanHandler writes them); None
    where a span would not be whole chunks (orbax's own chunking, or flat
    leaves), so that reading one would decode chunks again and again."""
    chunk = tuple(self.store.chunk_layout.read_chunk.shape)
    lead = 1 if layout.per_layer else 0
    if self.shape != layout.shape or len(self.shape) <= lead:
      return None
    if (layout.per_layer and chunk[0] != 1) or chunk[lead + 1:] != self.shape[lead + 1:]:
      return None
    return chunk[lead]

  def reads_spans(self, layout: LeafLayout) -> bool:
    """Whether `rectangles`' spans read well from this leaf saved flat and
    padded: its chunks parts of a row of at most SPAN_BYTES (as
    StreamedShards writes them), each decoded by at most two spans."""
    chunk = tuple(self.store.chunk_layout.read_chunk.shape)
    return (self.shape != layout.shape and len(chunk) == len(self.shape)
            and all(n == 1 for n in chunk[:-1]) and chunk[-1] * self.dtype.itemsize <= SPAN_BYTES)

  def held(self) -> SavedLeaf:
    """The whole leaf read into memory, as a SavedLeaf."""
    return _HeldLeaf(self.store.read().result())

  def fetch(self, layout: LeafLayout, index: tuple[slice, ...], x0: int, x1: int):
    """Starts reading flat positions [x0, x1) of the span `index` of
    `rectangles` (a row, and rows [a, b) of the inner shape's first axis);
    the result (`.result()`) is flat, in the saved dtype."""
    return self.store[self._index(layout, index, x0, x1)].read()

  def _index(self, layout, index, x0, x1) -> tuple[slice, ...]:
    if self.shape == layout.shape:
      return index
    return ((index[0],) if layout.per_layer else ()) + (slice(x0, x1),)


class _HeldLeaf(SavedLeaf):
  """A saved leaf held whole in memory (state_dict() output), read as a SavedLeaf."""

  def __init__(self, array: np.ndarray):
    self.store, self.shape, self.dtype = array, tuple(array.shape), array.dtype

  def chunk_rows(self, layout):
    return None  # any span reads as fast

  def reads_spans(self, layout):
    return True

  def held(self):
    return self

  def fetch(self, layout, index, x0, x1):
    done = concurrent.futures.Future()
    done.set_result(self.store[self._index(layout, index, x0, x1)])
    return done


class Int8Blocks:
  """The float32 values of int8 codes saved in some engine's blocks: each
  value its code's times its block's scale, as quant8.dequantize gives it.

  scales: (S, blocks) or (S, L, blocks): a scale per block of QUANT_BLOCK
    values of each of S shards' flat part, of the leaf or of each of its L
    layers, as the engine that saved them kept them.
  shape: the saved codes' shape: the leaf's full shape, or flat and padded
    ((S*k,) or (L, S*k); the values at the start of each row).
  """

  def __init__(self, scales: np.ndarray, shape: tuple[int, ...], signed: bool):
    self.scales, self.signed = np.asarray(scales, np.float32), signed
    per_layer = self.scales.ndim == 3
    self.row = math.prod(shape[1:] if per_layer else shape)  # a saved row's values
    shards = self.scales.shape[0] if self.scales.ndim else 0
    self.shard = -(-self.row // shards) if shards else 0  # k: values of a shard's row
    layers = tuple(shape[:1]) if per_layer else ()
    expected = quant8.scale_shape((shards,) + layers + (self.shard,))
    if not shards or self.scales.shape != expected:
      raise ValueError(f"int8 moment scales {list(self.scales.shape)} do not fit codes "
                       f"{list(shape)}: expected (shards, [layers,] blocks of each "
                       f"shard's part), e.g. {list(expected)}")

  def values(self, codes: np.ndarray, first: int) -> np.ndarray:
    """The float32 values of `codes` (flat) at saved positions first, first
    + 1, ... (row r's column j at r * row + j), in parts of QUANTIZE_PART
    over the CPUs."""
    codes, out = codes.reshape(-1), np.empty(codes.size, np.float32)
    parts = range(0, codes.size, QUANTIZE_PART)
    list(_threads().map(lambda a: self._values(codes, first, a, min(a + QUANTIZE_PART,
                                                                    codes.size), out), parts))
    return out

  def _values(self, codes: np.ndarray, first: int, lo: int, hi: int, out: np.ndarray) -> None:
    """out[lo:hi] = the values of codes[lo:hi], a run of one shard's blocks at a time."""
    table, block = quant8.code_values(self.signed), quant8.QUANT_BLOCK
    while lo < hi:
      row, column = divmod(first + lo, self.row)
      shard, at = divmod(column, self.shard)  # column `at` of the shard's part of the row
      n = min(hi - lo, self.shard - at, self.row - column)
      scales = self.scales[shard, row] if self.scales.ndim == 3 else self.scales[shard]
      b0, skip = divmod(at, block)
      scale = np.repeat(scales[b0:-(-(at + n) // block)], block)[skip:skip + n]
      np.multiply(table[codes[lo:lo + n]], scale, out=out[lo:lo + n])
      lo += n


class SavedInt8Leaf(SavedLeaf):
  """An int8 moment saved as its codes (uint8: the leaf's full shape, or
  flat and padded as several processes save them) and scales (see
  `Int8Blocks`), read as a SavedLeaf of its float32 values (an int8 engine
  of the same shards quantizes them back to the same codes and scales)."""

  def __init__(self, codes: SavedLeaf, scales: np.ndarray, signed: bool):
    self.codes, self.blocks = codes, Int8Blocks(scales, codes.shape, signed)
    self.scales, self.signed = self.blocks.scales, signed
    self.shape, self.dtype = codes.shape, np.dtype(np.float32)

  def chunk_rows(self, layout: LeafLayout) -> int | None:
    return self.codes.chunk_rows(layout)

  def reads_spans(self, layout: LeafLayout) -> bool:
    return self.codes.reads_spans(layout)

  def same_blocks(self, target: Target) -> bool:
    """Whether `target` is an int8 host part in these blocks (the same
    shards): it takes the codes and its shards' scales as they are."""
    host, layout = target.host, target.layout
    return (isinstance(host, quant8.Int8Moment) and not target.buffers
            and layout.on_device == 0 and target.signed == self.signed
            and layout.per_layer == (self.scales.ndim == 3)
            and self.scales.shape[0] == layout.shards
            and tuple(host.scales.shape[1:]) == self.scales.shape[1:])

  def held(self) -> SavedInt8Leaf:
    return SavedInt8Leaf(self.codes.held(), self.scales, self.signed)

  def fetch(self, layout: LeafLayout, index: tuple[slice, ...], x0: int, x1: int):
    codes = self.codes.fetch(layout, index, x0, x1)
    row = index[0].start if layout.per_layer else 0
    return _Dequantized(self.blocks, codes, row * self.blocks.row + x0)


class _Dequantized:
  """A read of codes under way (its `.result()`), whose result is their values."""

  def __init__(self, blocks: Int8Blocks, codes, first: int):
    self.blocks, self.codes, self.first = blocks, codes, first

  def result(self) -> np.ndarray:
    return self.blocks.values(np.asarray(self.codes.result()), self.first)


def as_saved_leaf(x) -> SavedLeaf:
  """A SavedLeaf of a restored leaf (already one) or an array held whole."""
  return x if isinstance(x, SavedLeaf) else _HeldLeaf(np.asarray(x))


class SpanHandler(ocp.type_handlers.NumpyHandler):
  """Orbax's numpy handler, which also writes StreamedArrays span by span
  (never a copy of the whole: see StreamedArray.__deepcopy__), StreamedShards
  from every process (each its own shards' chunks), and opens saved arrays
  as SavedLeafs (restore_type=SavedLeaf). The files are a numpy array's:
  any reader of the checkpoint reads them as one."""

  def __init__(self):
    super().__init__()
    # event loop -> (Semaphore(SPANS_IN_FLIGHT), Lock): a span takes a permit
    # per SPAN_BYTES (a shard's chunk may be larger), under the lock so that
    # two spans never each hold part of what they wait for.
    self._in_flight = weakref.WeakKeyDictionary()

  async def _open_and_write(self, value, tspec, ts_context):
    if not isinstance(value, StreamedArray):
      return await super()._open_and_write(value, tspec, ts_context)
    _set_chunk_shape(tspec, value.chunk_shape)
    store = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
    await self._write_spans(store, value)

  async def _write_spans(self, store: ts.TensorStore, value) -> None:
    """Writes a StreamedArray's or StreamedShards' spans into `store`."""
    # Orbax writes all leaves at once: one limit over all of them bounds the
    # spans held (each until tensorstore has written it).
    in_flight, taking = self._in_flight.setdefault(
        asyncio.get_running_loop(), (asyncio.Semaphore(SPANS_IN_FLIGHT), asyncio.Lock()))
    permits = lambda nbytes: min(SPANS_IN_FLIGHT, max(1, -(-nbytes // SPAN_BYTES)))

    async def reserve(nbytes: int) -> None:
      async with taking:
        for _ in range(permits(nbytes)):
          await in_flight.acquire()

    async def written(write, nbytes: int) -> None:
      try:
        await write
      finally:  # on the loop's thread: never after the loop has closed
        for _ in range(permits(nbytes)):
          in_flight.release()
    writes = []
    async for index, values in value.spans(before_each=reserve):
      writes.append(asyncio.ensure_future(written(store[index].write(values), values.nbytes)))
    await asyncio.gather(*writes)

  async def _background_serialize(self, values, infos, args=None):
    # Orbax's numpy handler writes on the first process alone; every
    # process writes its StreamedShards.
    args = list(args) if args else [ocp.SaveArgs()] * len(values)
    mine = [isinstance(v, StreamedShards) for v in values]
    pick = lambda xs, want: [x for x, m in zip(xs, mine) if m == want]
    others = pick(values, False)
    if others:
      await super()._background_serialize(others, pick(infos, False), pick(args, False))
    await asyncio.gather(*(self._write_shards(v, i, a) for v, i, a in
                           zip(pick(values, True), pick(infos, True), pick(args, True))))

  async def _write_shards(self, value: StreamedShards, info, arg) -> None:
    """This process's chunks of `value`, into the array the first process
    creates (with OCDBT each process writes a database of its own, which
    orbax merges when the checkpoint is complete)."""
    await info.await_path_creation()
    ocdbt = info.is_ocdbt_checkpoint
    tspec = ocp.type_handlers.get_json_tspec_write(
        info, use_ocdbt=ocdbt, global_shape=value.shape, local_shape=value.chunk_shape,
        dtype=value.dtype, process_index=ocp.multihost.process_index() if ocdbt else None,
        metadata_key=self._metadata_key, arg=arg)
    tspec.setdefault("dtype", value.dtype.name)  # where this orbax leaves it to its caller
    _set_chunk_shape(tspec, value.chunk_shape)
    if ocp.multihost.process_index() == 0:
      await ts.open(ts.Spec(tspec), create=True, open=True, context=info.ts_context)
    store = await ts.open(ts.Spec(tspec), open=True, assume_metadata=True,
                          context=info.ts_context)
    await self._write_spans(store, value)

  async def deserialize(self, infos, args=None):
    args = list(args) if args else [ocp.type_handlers.RestoreArgs()] * len(infos)
    lazy = [a.restore_type is SavedLeaf for a in args]
    held = iter(await super().deserialize([i for i, x in zip(infos, lazy) if not x],
                                          [a for a, x in zip(args, lazy) if not x])
                if not all(lazy) else [])
    opened = []
    for info in (i for i, x in zip(infos, lazy) if x):
      await info.await_path_creation()
      spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=info.is_ocdbt_checkpoint)
      opened.append(ts.open(ts.Spec(spec), open=True, context=info.ts_context))
    stores = iter(await asyncio.gather(*opened))
    return [SavedLeaf(next(stores)) if x else next(held) for x in lazy]


def registry() -> ocp.type_handlers.TypeHandlerRegistry:
  """Orbax's standard type handlers, with SpanHandler for numpy arrays,
  StreamedArrays, StreamedShards and SavedLeafs (jzo.checkpoint's managers
  use it)."""
  spans = SpanHandler()
  standard = [(ty, ocp.type_handlers.get_type_handler(ty))
              for ty in ocp.type_handlers.supported_types() if ty is not np.ndarray]
  return ocp.type_handlers.create_type_handler_registry(
      *standard, (np.ndarray, spans), (StreamedArray, spans), (StreamedShards, spans),
      (SavedLeaf, spans))


def _set_chunk_shape(tspec: dict, shape: tuple[int, ...]) -> None:
  """Makes each span one chunk of the zarr array orbax's spec describes
  (orbax would chunk a numpy array whole, or in chunks of its own, so
  that a span's write would rewrite a larger chunk)."""
  spec = tspec.get("base", tspec)  # under a cast driver, when one converts the dtype
  metadata = spec["metadata"]
  if "chunk_grid" in metadata:  # zarr v3
    metadata["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": list(shape)}}
  else:  # zarr v2
    metadata["chunks"] = list(shape)


# ------------------------------------------------------------ loading
@dataclasses.dataclass
class Target:
  """Where loaded values go for one leaf: device buffers (single-device
  arrays, per local device, each the flat positions [start, start + width)
  of every row, or the full shape when `full`) and host parts."""
  layout: LeafLayout
  buffers: list[jax.Array]  # per local device (empty: none)
  starts: list[int]  # each buffer's first flat position of a row
  width: int  # flat positions a buffer holds of each row
  full: bool = False  # the buffers are the leaf's full shape (replicated weights)
  host: object | None = None  # (n, *rows, k - c) numpy or Int8Moment, as Pieces.host
  signed: bool = False
  pending: dict = dataclasses.field(default_factory=dict)  # int8: (shard, row) -> values


def load_leaf(saved: SavedLeaf, targets: list[Target], positions: range) -> None:
  """Writes one saved leaf into `targets` (all of the same leaf), span by
  span: device buffers through in-place updates, host parts in place
  (int8 moments quantized block by block as their values arrive, or, saved
  in the same blocks, their codes and scales copied as they are). Only the
  spans of this process's shards (`positions`) are read."""
  layout = targets[0].layout
  codes = isinstance(saved, SavedInt8Leaf) and all(saved.same_blocks(t) for t in targets)
  if codes:
    for t in targets:
      np.copyto(t.host.scales, saved.scales[positions.start:positions.stop])
    saved = saved.codes
  k, c, S = layout.shard_size, layout.on_device, layout.shards
  size = math.prod(layout.inner_shape)
  rows = saved.chunk_rows(layout)
  if rows is None and not saved.reads_spans(layout):
    saved = saved.held()  # chunked otherwise (before state_spans): a leaf at a time
  spans = rectangles(layout, 4, rows)
  if not any(t.full for t in targets):  # the spans of this process's shards' columns
    columns = [(d * k, (d + 1) * k) for d in (positions if S > 1 else range(1))]
    spans = [x for x in spans if any(lo < x[3] and x[2] < hi for lo, hi in columns)]
  if S * k > size:  # the padding: zeros, as the engine keeps it
    lead = layout.shape[0] if layout.per_layer else 1
    spans = [s for row in range(lead) for s in
             [x for x in spans if x[1] == row] + [(None, row, size, S * k)]]

  def fetch(n: int):
    """Starts reading span n (None: past the last, or the padding)."""
    if n >= len(spans) or spans[n][0] is None:
      return None
    index, _, x0, x1 = spans[n]
    return saved.fetch(layout, index, x0, x1)
  # The next spans read while this one is written: SPANS_IN_FLIGHT of
  # SPAN_BYTES' worth, fewer where the saved chunks are larger (one at least).
  span_bytes = 4 * max(x1 - x0 for _, _, x0, x1 in spans)
  depth = max(1, min(SPANS_IN_FLIGHT, SPANS_IN_FLIGHT * SPAN_BYTES // span_bytes))
  ahead = collections.deque(fetch(n) for n in range(depth))
  for n, (index, row, x0, x1) in enumerate(spans):
    reading = ahead.popleft()
    ahead.append(fetch(n + depth))
    values = (np.zeros(x1 - x0, np.uint8 if codes else np.float32) if reading is None
              else np.asarray(reading.result()).reshape(-1))
    for t in targets:
      if t.full and index is not None:
        shape = span_shape(layout, index)
        at = tuple(s.start for s in index) + (0,) * (len(layout.shape) - len(index))
        t.buffers[:] = [_put(b, values.reshape(shape), at) for b in t.buffers]
        continue
      for j, d in enumerate(positions):
        if t.buffers and not t.full:
          lo, hi = max(x0, t.starts[j]), min(x1, t.starts[j] + t.width)
          if lo < hi:
            t.buffers[j] = _put(t.buffers[j], values[lo - x0:hi - x0],
                                _at(layout, row, lo - t.starts[j]))
        if t.host is not None:
          lo, hi = max(x0, d * k + c), min(x1, (d + 1) * k)
          if lo < hi:
            _write_host(t, j, row, lo - d * k - c, values[lo - x0:hi - x0], codes)


def _write_host(t: Target, j: int, row: int, at: int, values: np.ndarray,
                codes: bool = False) -> None:
  """Host part columns [at, at + len(values)) of local shard j's `row`
  (`codes`: int8 codes, written as they are)."""
  layout = t.layout
  pick = (lambda x: x[j, row]) if layout.per_layer else (lambda x: x[j])
  if codes or not isinstance(t.host, quant8.Int8Moment):
    pick(t.host.codes if codes else t.host)[at:at + values.size] = values
    return
  # Blocks start at the host part's column 0: quantize each once whole.
  held = t.pending.pop((j, row), np.empty(0, np.float32))
  start = at - held.size
  values = np.concatenate([held, values.astype(np.float32)])
  end = start + values.size
  done = end if end == layout.on_host else end // quant8.QUANT_BLOCK * quant8.QUANT_BLOCK
  if done > start:
    q = _quantize(values[:done - start], t.signed)
    pick(t.host.codes)[start:done] = q.codes
    first = start // quant8.QUANT_BLOCK
    pick(t.host.scales)[first:first + q.scales.size] = q.scales
  if done < end:
    t.pending[(j, row)] = values[done - start:]


# Values a thread quantizes at once when a restore writes int8 moments.
QUANTIZE_PART = 1 << 20


@functools.cache
def _threads() -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1)


def _quantize(values: np.ndarray, signed: bool) -> quant8.Int8Moment:
  """quant8.quantize of a flat run of whole blocks (the last may be short),
  in parts of QUANTIZE_PART values over the CPUs (numpy lets go of the GIL):
  the same codes and scales, block by block."""
  if values.size <= QUANTIZE_PART:
    return quant8.quantize(values, signed=signed)
  starts = range(0, values.size, QUANTIZE_PART)  # a multiple of QUANT_BLOCK: whole blocks
  parts = list(_threads().map(lambda a: quant8.quantize(values[a:a + QUANTIZE_PART],
                                                        signed=signed), starts))
  return quant8.Int8Moment(np.concatenate([q.codes for q in parts]),
                           np.concatenate([q.scales for q in parts]))


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


def target_for(layout: LeafLayout, x: jax.Array, positions: range, *, full: bool = False,
               part: bool = True) -> Target:
  """A Target over the device arrays of x: a device part (`part`: each
  shard's [0, c)), flat shards of the compute-dtype weights (each shard's
  [0, k)), or (`full`) the weights in full shape on every device."""
  k = layout.shard_size
  shard = lambda d: d if layout.shards > 1 else 0
  width = layout.on_device if part else k
  return Target(layout, shard_arrays(x, layout, positions), [shard(d) * k for d in positions],
                width, full=full)


def global_array(t: Target, like: jax.Array) -> jax.Array:
  """The global array of `like`'s shape and sharding over t's buffers."""
  return jax.make_array_from_single_device_arrays(like.shape, like.sharding, t.buffers)
