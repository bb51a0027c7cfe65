"""A saved master or moment read span by span into the engine's pieces
(`load_leaf`), so that a restore never holds a second copy of the state.

`SavedLeaf` is a checkpoint's leaf open for reading (or, `HeldLeaf`, an
array held whole: a state dict's); `SavedInt8Leaf` reads int8 codes and
scales (`Int8Blocks`) as their float32 values. `load_leaf` writes one into
its `Target`s: device buffers in place, host parts in place (int8 moments
quantized block by block), a few spans of jzo.checkpoint.spans.SPAN_BYTES
read ahead. jzo.checkpoint.load drives it a leaf at a time.

Positions are jzo.checkpoint.spans': rows of S*k values, shard d's
[d*k, (d+1)*k), of which [0, c) on its device and [c, k) on the host.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import os
from typing import Callable

import jax
import numpy as np
import tensorstore as ts

from jzo.checkpoint import checksums, spans as spans_lib
from jzo.kernels import quant8
from jzo.parallel.partition import LeafLayout


class SavedLeaf:
  """A saved master or moment, open for reading spans (what `load_leaf` reads):
  in its full shape, or flat and padded with a row per layer (several
  processes' checkpoints); the values of each row are at its start. With
  `sums` (its checksums), every value read is checked first, whole chunk by
  whole chunk."""

  def __init__(self, store: ts.TensorStore, sums: checksums.ArraySums | None = None):
    self.store, self.sums = store, sums
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
            and all(n == 1 for n in chunk[:-1])
            and chunk[-1] * self.dtype.itemsize <= spans_lib.SPAN_BYTES)

  def held(self) -> SavedLeaf:
    """The whole leaf read into memory, as a SavedLeaf."""
    values = self.store.read().result()
    if self.sums is not None:
      self.sums.check_whole(values)
    return HeldLeaf(values)

  def fetch(self, layout: LeafLayout, index: tuple[slice, ...], x0: int, x1: int):
    """Starts reading flat positions [x0, x1) of the span `index` of
    `rectangles` (a row, and rows [a, b) of the inner shape's first axis);
    the result (`.result()`) is flat, in the saved dtype."""
    index = self._index(layout, index, x0, x1)
    if self.sums is None:
      return self.store[index].read()
    return self.sums.read(self.store, index)

  def _index(self, layout, index, x0, x1) -> tuple[slice, ...]:
    if self.shape == layout.shape:
      return index
    return ((index[0],) if layout.per_layer else ()) + (slice(x0, x1),)


class MasterView:
  """A leaf read on demand as numpy: `view[index]` reads only the rows of
  the first axis that `index` selects and applies the rest of `index` to
  those, so that a caller cutting tensors out of the masters one at a time
  never holds a leaf whole. `np.asarray(view)` reads it all.

  read_rows(rows): the rows that `rows` (a slice of the first axis, step 1)
  selects as numpy, the whole leaf for a scalar. `MasterView.of_saved`
  reads a checkpoint's leaf (checked against the save's checksums where it
  took them), `MasterView.of_streamed` the live state."""

  def __init__(self, shape: tuple[int, ...], dtype, read_rows: Callable[[slice], np.ndarray]):
    self.shape, self.dtype, self.read_rows = tuple(shape), np.dtype(dtype), read_rows

  @classmethod
  def of_saved(cls, saved: SavedLeaf) -> MasterView:
    def read_rows(rows: slice) -> np.ndarray:
      box = (rows,) if saved.shape else ()
      reading = (saved.store[box].read() if saved.sums is None
                 else saved.sums.read(saved.store, box))
      return np.asarray(reading.result())
    return cls(saved.shape, saved.dtype, read_rows)

  @classmethod
  def of_streamed(cls, streamed: spans_lib.StreamedArray) -> MasterView:
    return cls(streamed.shape, streamed.dtype,
               lambda rows: spans_lib.read_rows(streamed.pieces, rows, streamed.dtype))

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def __getitem__(self, index) -> np.ndarray:
    index = index if isinstance(index, tuple) else (index,)
    first = index[0] if index and self.shape else None
    if isinstance(first, (int, np.integer)):  # one row: read it, then drop its axis
      rows, rest = slice(int(first), int(first) + 1), (0,) + index[1:]
    elif isinstance(first, slice) and first.step in (None, 1):
      rows, rest = slice(*first.indices(self.shape[0])[:2]), (slice(None),) + index[1:]
    else:  # anything else (or a scalar leaf): every row, the index applied after
      rows, rest = slice(0, self.shape[0] if self.shape else None), index
    return np.asarray(self.read_rows(rows)[rest])

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    values = self[()]
    return values if dtype is None else values.astype(dtype)


class HeldLeaf(SavedLeaf):
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
  return x if isinstance(x, SavedLeaf) else HeldLeaf(np.asarray(x))


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
    saved = saved.held()  # chunked otherwise (older checkpoints): a leaf at a time
  spans = spans_lib.rectangles(layout, 4, rows)
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
  depth = max(1, min(spans_lib.SPANS_IN_FLIGHT,
                    spans_lib.SPANS_IN_FLIGHT * spans_lib.SPAN_BYTES // span_bytes))
  ahead = collections.deque(fetch(n) for n in range(depth))
  for n, (index, row, x0, x1) in enumerate(spans):
    reading = ahead.popleft()
    ahead.append(fetch(n + depth))
    values = (np.zeros(x1 - x0, np.uint8 if codes else np.float32) if reading is None
              else np.asarray(reading.result()).reshape(-1))
    for t in targets:
      if t.full and index is not None:
        shape = spans_lib.span_shape(layout, index)
        at = tuple(s.start for s in index) + (0,) * (len(layout.shape) - len(index))
        t.buffers[:] = [spans_lib.put_into(b, values.reshape(shape), at) for b in t.buffers]
        continue
      for j, d in enumerate(positions):
        if t.buffers and not t.full:
          lo, hi = max(x0, t.starts[j]), min(x1, t.starts[j] + t.width)
          if lo < hi:
            t.buffers[j] = spans_lib.put_into(t.buffers[j], values[lo - x0:hi - x0],
                                              spans_lib.row_index(layout, row, lo - t.starts[j]))
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
    q = quantize_in_parts(values[:done - start], t.signed)
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


def quantize_in_parts(values: np.ndarray, signed: bool) -> quant8.Int8Moment:
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


def target_for(layout: LeafLayout, x: jax.Array, positions: range, *, full: bool = False,
               part: bool = True) -> Target:
  """A Target over the device arrays of x: a device part (`part`: each
  shard's [0, c)), flat shards of the compute-dtype weights (each shard's
  [0, k)), or (`full`) the weights in full shape on every device."""
  k = layout.shard_size
  shard = lambda d: d if layout.shards > 1 else 0
  width = layout.on_device if part else k
  return Target(layout, spans_lib.shard_arrays(x, layout, positions),
                [shard(d) * k for d in positions], width, full=full)


def global_array(t: Target, like: jax.Array) -> jax.Array:
  """The global array of `like`'s shape and sharding over t's buffers."""
  return jax.make_array_from_single_device_arrays(like.shape, like.sharding, t.buffers)
