"""Moving the host parts of the shards between the devices and host memory.

One landing buffer per leaf, in XLA's pinned host memory, carries a step's
traffic both ways: the host part of each shard's gradient is copied down
into it (at PCIe speed: pinned memory needs no bounce buffer), the host
kernel reads each gradient and writes the new low-precision weight over it
(`kernels.adam_step_(..., lowp_out=grad)`), and the same buffer goes back
up. So the host holds 2 bytes a parameter (bf16/fp16) for all transfers,
and one set of landing buffers: the engine downloads a step's gradients
only once the previous update's weights have left (see jzo.host.update).

That fast path needs the device to place arrays in pinned host memory
(the 'pinned_host' memory kind: GPUs, CPUs). Elsewhere, or when asked
(`host_transfer="portable"`), the portable path copies each shard's part to
a numpy array of its own and back with `device_put`: the host holds the
same bytes, but every copy goes through pageable memory (on the GPU
machines 1.3-1.8 GB/s down and 7-8 up, against 50-54 from pinned memory)
and each one waits for the step it follows.

Each process moves only its own devices' shards (jzo.distributed).
"""

from __future__ import annotations

import ctypes
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jzo.parallel.distributed import local_positions
from jzo.parallel.partition import LeafLayout, is_layout
from jzo.plan import BUILD_CHUNK_BYTES

# Compiler options of the programs that copy, slice or convert a leaf while
# the engine is built: no autotuning. XLA's autotuner profiles even a loop
# fusion, on buffers as large as its operands, allocated while it compiles:
# slicing the tail of gpt2-20b's MLP kernel drawn at 101 layers (56.8 GiB in
# float32) asked for another 56.8 GiB beside it. A copy has nothing to tune.
UNTUNED = {"xla_gpu_autotune_level": 0}


def zeros(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding) -> jax.Array:
  """A new array of zeros placed by `sharding` (its memory kind included),
  made by a program of its own: each buffer is allocated where it lives,
  never copied there."""
  return full(shape, dtype, sharding, 0)


def full(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding, value) -> jax.Array:
  """A new array of `value` (a Python number) placed as `zeros` places
  its arrays."""
  return _fill_program(tuple(shape), jnp.dtype(dtype), sharding, value)()


@functools.lru_cache(maxsize=1024)
def _fill_program(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding,
                  value):
  # One per shape, dtype, placement and value, shared by every leaf and
  # engine that asks. A new program each time costs ~17 ms to trace, lower
  # and compile or look up: test_grads_in_params.py made 1735 one-off programs.
  return jax.jit(functools.partial(jnp.full, shape, value, dtype), out_shardings=sharding)


def has_pinned_host(device) -> bool:
  """The device can hold arrays in pinned host memory (XLA's 'pinned_host'
  memory kind), whence its copies to and from the host run as DMA."""
  return any(m.kind == "pinned_host" for m in device.addressable_memories())


def host_memory_kind(device) -> str | None:
  """A memory kind in host RAM the device can hold arrays in ('unpinned_host'
  or 'pinned_host'); None where it has neither (its arrays are on it)."""
  kinds = {m.kind for m in device.addressable_memories()}
  return next((k for k in ("unpinned_host", "pinned_host") if k in kinds), None)


def resolve_host_transfer(choice: str, device) -> str:
  """'pinned' or 'portable' for the engine's `host_transfer` option: "auto"
  takes pinned host memory where `device` has it and otherwise the portable
  path, with a warning that names its cost (once per engine). `choice` is
  one of jzo.options.HOST_TRANSFERS (the engine checks its options first).

  Raises:
    ValueError: 'pinned' on a device without it.
  """
  pinned = has_pinned_host(device)
  if choice == "pinned" and not pinned:
    kinds = sorted(m.kind for m in device.addressable_memories())
    raise ValueError(f"host_transfer='pinned': {device.platform} device {device.id} has no "
                     f"'pinned_host' memory (it has {kinds}); use 'auto' or 'portable'")
  if choice != "auto":
    return choice
  if pinned:
    return "pinned"
  warnings.warn(
      f"{device.platform} devices have no 'pinned_host' memory: offload moves gradients "
      "and weights through pageable host memory (numpy copies and device_put), so each "
      "step's transfers wait for the step and run slower than DMA from pinned memory",
      RuntimeWarning, stacklevel=3)
  return "portable"


class ShardTransfer:
  """Downloads gradients into landing buffers and uploads weights from them.

  Args:
    mesh: a mesh whose only axis of size > 1 is `axis`.
    axis: the data axis.
    layouts: tree of LeafLayout with placement, one per parameter leaf.
    dtype: of the landing buffers (the gradients and the weights both).
    pinned: land in pinned host memory (the fast path); False: the
      portable path (see the module docstring), whose landing buffers are
      `HostLanding`s.
  """

  def __init__(self, mesh: Mesh, axis: str, layouts, dtype, pinned: bool = True):
    self._mesh, self._axis, self.dtype = mesh, axis, np.dtype(dtype)
    self.pinned = pinned
    self.layouts: list[LeafLayout] = jax.tree.leaves(layouts, is_leaf=is_layout)
    self._positions = local_positions(mesh)  # this process's shards
    specs = [l.spec(axis) for l in self.layouts]
    self._on_device = [NamedSharding(mesh, s) for s in specs]
    self._pinned = [NamedSharding(mesh, s, memory_kind="pinned_host") for s in specs]

  def download(self, i: int, grad: jax.Array, span: tuple[int, int] | None = None) -> jax.Array:
    """Starts the copy of every shard's host part of leaf i's gradient
    (`grad`: the step's local flat gradients, `flat_shape`), or of its
    elements [lo, hi) along the host part's first axis (span, one of
    `spans(i, ...)`), into a new landing buffer in pinned host memory
    (`part_shape(k - c)`, or of the span); returns it at once (the copy
    completes in the background). The portable path returns a
    `HostLanding` once the copy is done."""
    layout = self.layouts[i]
    whole = span is None or span == (0, self._span_axis_size(i))
    if self.pinned and whole and not layout.on_device:  # the shard itself: nothing to slice
      return jax.device_put(grad, self._pinned[i])
    host_part = _host_part_program(self._mesh, self._axis, layout, None if whole else span,
                                   self._pinned[i] if self.pinned else None)
    if self.pinned:
      return host_part(grad)
    part = grad if whole and not layout.on_device else host_part(grad)
    return HostLanding([np.array(shard.data)
                        for shard in _by_position(part, layout, self._positions)])

  def spans(self, i: int, max_bytes: int, block: int = 1) -> list[tuple[int, int]]:
    """Leaf i's host part cut into spans [lo, hi) along the first axis of
    each device's host part (elements of a flat shard, layers of a
    per-layer one), of at most max_bytes of this process's landing buffer
    each, but at least one layer, or `block` elements of a flat shard
    (whose spans then start at multiples of it: int8 moments' blocks of
    scales): a streamed update moves one at a time."""
    layout = self.layouts[i]
    row = layout.on_host if layout.per_layer else 1  # elements per unit of the axis
    unit = len(self._positions) * row * self.dtype.itemsize
    size = self._span_axis_size(i)
    step = max(1, max_bytes // unit)
    if not layout.per_layer:
      # Whole rows of 64 Ki elements (aligned spans), else whole blocks.
      row_of = _ROW if step > _ROW else block
      step = max(step - step % row_of, block)
    return [(lo, min(lo + step, size)) for lo in range(0, size, step)]

  def span_bytes(self, i: int, span: tuple[int, int]) -> int:
    """Bytes of the landing buffer of a span of leaf i (this process's devices)."""
    layout = self.layouts[i]
    row = layout.on_host if layout.per_layer else 1
    return len(self._positions) * row * (span[1] - span[0]) * self.dtype.itemsize

  def _span_axis_size(self, i: int) -> int:
    layout = self.layouts[i]
    return layout.shape[0] if layout.per_layer else layout.on_host

  def reserve(self, nbytes: int) -> None:
    """Makes XLA's pinned host pools hold nbytes of landing buffers (this
    process's: `Plan.pinned_bytes()`), before anything else is pinned: each
    of this process's devices has a pool of its own, where its shards of
    the landing buffers live, and each reserves its share in one piece. A
    pool grows by regions of doubling size and never shrinks: allocated
    leaf by leaf, gpt2-10b's 15.6 GiB of landing buffers took regions of
    8 + 8 + 16 GiB, and the host killed the run; reserved at once, one
    region of 16 GiB. (All of gpt2-13b's reserved in the first device's
    pool of four, the other three grew 26 GiB more of their own.)"""
    if nbytes and self.pinned:
      mine = Mesh(np.array([self._mesh.devices.flat[d] for d in self._positions]), ("d",))
      share = -(-nbytes // mine.size)  # bytes of each device's piece, in its own pool
      pinned = NamedSharding(mine, P("d"), memory_kind="pinned_host")
      zeros((share * mine.size,), np.uint8, pinned).delete()

  def new_landing(self, i: int, span: tuple[int, int] | None = None):
    """A new landing buffer of leaf i (`part_shape(k - c)`, zeros), or of a
    span of it (see `spans`), for weights made on the host: in pinned host
    memory, or on the portable path a `HostLanding`."""
    piece = self._landing_piece(i, span)
    if not self.pinned:
      return HostLanding([np.zeros(piece, self.dtype) for _ in self._positions])
    return zeros(self._landing_shape(i, piece), self.dtype, self._pinned[i])

  def landing_struct(self, i: int) -> jax.ShapeDtypeStruct:
    """The shape, dtype and placement of leaf i's whole landing buffer on
    the pinned path (what `download` and `new_landing` make)."""
    return jax.ShapeDtypeStruct(self._landing_shape(i, self._landing_piece(i, None)),
                                self.dtype, sharding=self._pinned[i])

  def _landing_piece(self, i: int, span: tuple[int, int] | None) -> tuple[int, ...]:
    """One device's piece of leaf i's landing buffer, or of a span's."""
    piece = self.layouts[i].host_shape[1:]
    return piece if span is None else (span[1] - span[0],) + piece[1:]

  def _landing_shape(self, i: int, piece: tuple[int, ...]) -> tuple[int, ...]:
    """The global shape of a landing buffer of leaf i with pieces `piece`."""
    return piece[:-1] + (self.layouts[i].shards * piece[-1],)

  def upload(self, i: int, landing: jax.Array) -> jax.Array:
    """Copies a landing buffer back to the devices (flat, `part_shape(k - c)`,
    or a span's); returns once the copy is done, so the landing buffer may
    be freed."""
    if self.pinned:
      return jax.block_until_ready(jax.device_put(landing, self._on_device[i]))
    devices = [self._mesh.devices.flat[d] for d in self._positions]
    pieces = [jax.device_put(piece, device) for piece, device in zip(landing.pieces, devices)]
    local = landing.pieces[0].shape
    shape = local[:-1] + (self.layouts[i].shards * local[-1],)
    return jax.block_until_ready(jax.make_array_from_single_device_arrays(
        shape, self._on_device[i], pieces))

  def views(self, i: int, landing) -> list[np.ndarray]:
    """Writable numpy views of each of this process's devices' pieces of a
    landing buffer, in device order, each (..., k - c). The buffer must
    stay referenced while they are in use."""
    if not self.pinned:
      return landing.pieces
    return host_pieces(jax.block_until_ready(landing), self.layouts[i], self._positions)


@functools.lru_cache(maxsize=1024)
def _host_part_program(mesh: Mesh, axis: str, layout: LeafLayout,
                       span: tuple[int, int] | None, out_sharding: NamedSharding | None):
  """The program that slices a leaf's host part (or a span of it) out of
  its local flat gradients; keyed by hashable values, so every engine with
  the same layouts shares it."""
  spec = layout.spec(axis)
  c = layout.on_device

  # A split leaf's host part (or a span of any) is sliced on the device
  # here, after the step, rather than in it, where the slice would be a
  # second copy of the gradient at the step's peak. Static slices: their
  # bounds may pass 2**31 elements, where a traced offset would wrap.
  def host_part(g):
    if span is None:
      return g[..., c:]
    lo, hi = span
    if layout.per_layer:  # (L, k): layers lo..hi of the host part
      return jax.lax.slice_in_dim(g[..., c:], lo, hi, axis=0)
    return jax.lax.slice_in_dim(g, c + lo, c + hi, axis=-1)
  host_part = jax.shard_map(host_part, mesh=mesh, in_specs=spec, out_specs=spec)
  return jax.jit(host_part, out_shardings=out_sharding)


def _by_position(part: jax.Array, layout: LeafLayout, positions: range) -> list:
  """The shards of a host-part array of a leaf with `layout` (or of a span
  of it) on the devices at `positions` of the data axis, in that order."""
  width = part.shape[-1] // layout.shards  # of one shard's piece
  position = lambda s: s.index[-1].start // width if layout.shards > 1 else 0
  shards = {position(s): s for s in part.addressable_shards}
  return [shards[d] for d in positions]


def host_pieces(part: jax.Array, layout: LeafLayout, positions: range) -> list[np.ndarray]:
  """Writable numpy views of the pieces, at `positions` of the data axis, of
  an array in host memory (a landing buffer, or offloaded weights) of a leaf
  with `layout`, in that order, each (..., k - c)."""
  return [writable_view(shard.data) for shard in _by_position(part, layout, positions)]


class HostLanding:
  """The portable path's landing buffer of one leaf: a numpy array of its
  own per device of this process, in device order, each (..., k - c)."""

  def __init__(self, pieces: list[np.ndarray]):
    self.pieces = pieces

  @property
  def nbytes(self) -> int:
    return sum(p.nbytes for p in self.pieces)


def writable_view(array: jax.Array) -> np.ndarray:
  """A writable numpy view of a single-device array in host memory
  (pinned_host, or any CPU array): the same bytes, not a copy.

  Raises:
    ValueError: the array is in an accelerator's own memory, whose address
      the host cannot read (it would crash the process).
  """
  device = next(iter(array.devices()))
  # A CPU device's 'device' memory is host RAM; an accelerator's is not.
  in_host = array.sharding.memory_kind in ("pinned_host", "unpinned_host")
  if not in_host and device.platform != "cpu":
    raise ValueError(f"writable_view needs an array in host memory, got one in "
                     f"{array.sharding.memory_kind!r} memory of {device}")
  dtype, shape = np.dtype(array.dtype), array.shape
  nbytes = dtype.itemsize * int(np.prod(shape))
  if nbytes == 0:
    return np.empty(shape, dtype)
  raw = (ctypes.c_char * nbytes).from_address(array.unsafe_buffer_pointer())
  return np.frombuffer(raw, dtype).reshape(shape)


def copy_to_host(x: jax.Array, out: np.ndarray, part=None, pinned: bool = True) -> None:
  """Copies part(x) (default: x) of a single-device array into the numpy
  array `out` (same number of elements, in the same order) through pinned
  host memory (pinned=False: pageable, the portable path), in chunks of
  BUILD_CHUNK_BYTES: the device makes one chunk at a time (a part that is
  a contiguous slice is never copied whole), the host holds one chunk
  beside `out`, and a pinned copy runs at PCIe speed. `part` is a static
  argument of the programs that slice it: a hashable function (such as
  partition.SplitPart), so that equal parts share them."""
  dest = out.reshape(-1)
  size = math.prod(jax.eval_shape(part, x).shape) if part is not None else x.size
  if size != dest.size:
    raise ValueError(f"copy of {size} elements into {dest.size}")
  device = list(x.devices())[0]
  if pinned:
    to_pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    down = lambda chunk: np.asarray(jax.device_put(chunk, to_pinned))
  else:  # np.asarray copies a device array into pageable memory itself
    down = np.asarray
  # Chunks are whole rows of a (size // _ROW, _ROW) view: a dynamic offset
  # is a 32-bit index, too small for the elements of a 10B model's leaf.
  rows = max(1, BUILD_CHUNK_BYTES // (dest.itemsize * _ROW))
  main = size // _ROW * _ROW
  for row in range(0, size // _ROW, rows):
    n = min(rows, size // _ROW - row)
    chunk = _rows_of(x, row, n, part)  # a traced start: one compiled slice per size
    np.copyto(dest[row * _ROW:(row + n) * _ROW], down(chunk), casting="same_kind")
  if main < size:
    np.copyto(dest[main:], down(_tail_of(x, main, part)), casting="same_kind")


_ROW = 1 << 16


def _flat(x: jax.Array, part) -> jax.Array:
  return (x if part is None else part(x)).reshape(-1)


@functools.partial(jax.jit, static_argnums=(1, 2), compiler_options=UNTUNED)
def _tail_of(x: jax.Array, start: int, part) -> jax.Array:
  """Elements [start:] of part(x), flat."""
  return _flat(x, part)[start:]


@functools.partial(jax.jit, static_argnums=(2, 3), compiler_options=UNTUNED)
def _rows_of(x: jax.Array, row, n: int, part) -> jax.Array:
  """Rows [row, row + n) of part(x) seen as (size // _ROW, _ROW), flat."""
  whole = _flat(x, part)
  grid = whole[:whole.size // _ROW * _ROW].reshape(-1, _ROW)
  return jax.lax.dynamic_slice_in_dim(grid, row, n).reshape(-1)
