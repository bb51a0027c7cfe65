"""The programs that write a leaf drawn in float32 into the state's buffers
(`fill`: straight into the buffer on one device, a device's piece at a time
over several: `placed`), and the hashable function that makes the params'
leaf from it (`LowpFromMaster`). What they hold beside the draw is what
`Plan.build_bytes` counts: `write_into` computes into its donated buffer,
`piece_of` makes one device's piece without the whole.

The programs take hashable static arguments (layouts, dtypes,
partition.SplitPart), never lambdas: one program then serves every leaf
and engine alike (a new one costs what transfer.full's comment says).
None is autotuned (transfer.UNTUNED): they run beside a leaf drawn in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jzo.parallel import partition
from jzo import step as step_lib
from jzo.host import transfer


@dataclasses.dataclass(frozen=True)
class LowpFromMaster:
  """flat float32 master -> the params' leaf (`step.lowp_from_master`), as a
  hashable function."""
  compute_dtype: jnp.dtype
  sharded: bool
  layout: partition.LeafLayout

  def __call__(self, flat):
    return step_lib.lowp_from_master(flat, self.compute_dtype, self.sharded, self.layout)


def fill(buffer: jax.Array, x: jax.Array, fn, row: int = 0) -> jax.Array:
  """`buffer` (donated) holding fn(x) from `row` of its first axis on: x a
  value every process holds whole on its first device (a leaf, or some of
  a stacked leaf's layers), fn a hashable function. On one device a program
  computes fn(x) straight into the buffer; on several, each device's piece
  is made on x's device and moved (`placed`)."""
  if len(buffer.sharding.device_set) == 1:
    return write_into(buffer, x, fn, row)
  return write_into(buffer, placed(x, fn, buffer.sharding), None, row)


def placed(x: jax.Array, fn, sharding: NamedSharding) -> jax.Array:
  """fn(x) placed by `sharding` (which may span other processes' devices:
  each process makes only its own devices' pieces), a piece at a time: each
  piece is computed on x's device and moved before the next is made, the
  piece of x's own device last. So that device holds one piece beside x.
  (`jax.device_put` of the whole fn(x) slices every device's piece there at
  once: gpt2-20b's shape at 101 layers over 4 H200s ran out of memory with the
  MLP kernel in float32, in bf16 and two of its four 7.1 GiB pieces on GPU 0.)"""
  shape = jax.eval_shape(fn, x).shape
  home = list(x.devices())[0]
  index_of = sharding.addressable_devices_indices_map(shape)
  pieces = {}
  for device in sorted(index_of, key=lambda d: d == home):
    starts, sizes = zip(*(_bounds(s, n) for s, n in zip(index_of[device], shape)))
    piece = piece_of(x, fn, sizes, starts)
    to = jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
    pieces[device] = jax.block_until_ready(jax.device_put(piece, to))
    del piece  # freed on x's device before the next piece is made
  return jax.make_array_from_single_device_arrays(shape, sharding,
                                                  [pieces[d] for d in index_of])


def _bounds(index: slice, size: int) -> tuple[int, int]:
  """(start, length) of an index of a dimension of `size`."""
  start, stop, _ = index.indices(size)
  return start, stop - start


@functools.partial(jax.jit, static_argnums=(1, 2), compiler_options=transfer.UNTUNED)
def piece_of(x: jax.Array, fn, sizes: tuple[int, ...], starts) -> jax.Array:
  """The block of fn(x) at `starts` (traced: one program serves every
  device's piece) of `sizes`, fn a hashable function (computed in the same
  program: only the block is made)."""
  return jax.lax.dynamic_slice(fn(x), starts, sizes)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=2,
                   compiler_options=transfer.UNTUNED)
def write_into(buffer: jax.Array, values: jax.Array, of=None, row=0) -> jax.Array:
  """of(values) (default: values) written into `buffer` (donated: the
  result is buffer's memory; `of`, a hashable function such as a SplitPart,
  is computed in the same program, not apart) from `row` of its first axis
  (traced: one program serves every slice of a leaf's layers)."""
  values = values if of is None else of(values)
  start = (row,) + (0,) * (buffer.ndim - 1) if buffer.ndim else ()
  return jax.lax.dynamic_update_slice(buffer, values.astype(buffer.dtype), start)
