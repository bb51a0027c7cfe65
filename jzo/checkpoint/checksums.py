"""CRC32 checksums of a checkpoint's arrays, taken as a save writes them and
checked as a restore reads them: bytes changed on disk (a flipped bit, a
block another file's) are refused rather than trained on. Tensorstore's
files do not catch them: a flipped byte in an array's data reads back as
other values without a word.

Each chunk an array is written in (a span of jzo.checkpoint.spans, or a
whole host array) has the CRC32 of its values as they are in memory (C
order, before compression). Each process writes those of the chunks it
wrote to `<item folder>/jzo_checksums/` inside orbax's temporary folder, so
that they are renamed into place with the checkpoint. (Arrays that orbax's
own handlers write, the global jax.Arrays of several processes' int8 scales
and other optimizers' state, have none.) A restore reads each
chunk it needs whole and checks it before any value is used; a span that
covers part of a chunk reads the chunk (tensorstore decodes whole chunks
anyway). Checkpoints written before the checksums have no such folder and
restore unchecked.

Positions are flat (C order) within an array: a chunk is [start, start +
length), a box of the array (rows of one axis, within one index of the axes
before it, every axis after it whole).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import pathlib
import secrets
import zlib

import numpy as np

from jzo.checkpoint import spans as spans_lib

# The folder, in an item's folder, of the checksums' files (one a process).
FOLDER = "jzo_checksums"
# The key of the item's custom metadata that says how many processes wrote
# checksums: a restore that finds fewer refuses the checkpoint.
MARK = "jzo_checksums"


class ChecksumError(ValueError):
  """An array of a checkpoint does not read back as it was written."""


def crc32(values: np.ndarray) -> int:
  """The CRC32 of an array's values in C order, as bytes (any dtype). zlib
  lets go of the GIL for it: threads take several at once."""
  return zlib.crc32(np.ascontiguousarray(values).reshape(-1).view(np.uint8))


@functools.cache
def threads() -> concurrent.futures.ThreadPoolExecutor:
  """The threads that take CRC32s: as many as spans are written or read at once."""
  return concurrent.futures.ThreadPoolExecutor(
      max(spans_lib.SPANS_IN_FLIGHT, os.cpu_count() or 1), thread_name_prefix="jzo-crc32")


def flat_range(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int]:
  """The flat positions [start, stop) of the box `index` (slices, the axes
  it leaves out whole) of an array of `shape`.

  Raises:
    ValueError: the box is not one run of positions.
  """
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  ranges = [range(*s.indices(n)) for s, n in zip(index, shape)]
  sizes = [len(r) for r in ranges]
  first_wide = next((i for i, n in enumerate(sizes) if n > 1), len(shape))
  if any(sizes[i] != shape[i] for i in range(first_wide + 1, len(shape))):
    raise ValueError(f"{index} of {list(shape)} is not one run of positions")
  start = sum(r.start * math.prod(shape[i + 1:]) for i, r in enumerate(ranges))
  return start, start + math.prod(sizes)


def box_of(start: int, stop: int, shape: tuple[int, ...]) -> tuple[slice, ...]:
  """The index (slices of the leading axes; the rest whole) of the flat
  positions [start, stop) of an array of `shape`, which must be a box."""
  for axis in range(len(shape)):
    inner = math.prod(shape[axis + 1:])
    if start % inner or stop % inner:
      continue
    lo, hi = start // inner, stop // inner  # along `axis`, with the outer axes flattened
    outer = lo // shape[axis]
    if (hi - 1) // shape[axis] != outer:
      continue
    lead = np.unravel_index(outer, shape[:axis]) if axis else ()
    at = lo % shape[axis]
    return tuple(slice(int(i), int(i) + 1) for i in lead) + (slice(at, at + hi - lo),)
  if (start, stop) == (0, math.prod(shape)):  # a scalar, or the whole array
    return ()
  raise ValueError(f"positions [{start}, {stop}) of {list(shape)} are not a box")


@dataclasses.dataclass
class ArraySums:
  """The checksums of one saved array.

  name: the array's name in the checkpoint (orbax's: its keys joined by dots).
  shape, dtype: as written.
  chunks: flat start -> (length, CRC32), over the chunks written.
  """
  name: str
  shape: tuple[int, ...]
  dtype: str
  chunks: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)

  def add(self, start: int, length: int, crc: int) -> None:
    self.chunks[start] = (length, crc)

  def check_store(self, store) -> None:
    """Refuses an opened tensorstore array whose shape or dtype is not what was written."""
    shape, dtype = tuple(store.shape), np.dtype(store.dtype.numpy_dtype).name
    if (shape, dtype) != (self.shape, self.dtype):
      raise ChecksumError(f"{self.name} was written as {self.dtype}{list(self.shape)}, but its "
                          f"metadata say {dtype}{list(shape)}")

  def check(self, start: int, values: np.ndarray) -> None:
    """Checks the values of the chunk at `start` (flat, C order) against its CRC32."""
    length, expected = self.chunks[start]
    if values.size != length:
      raise ChecksumError(f"{self.name}: the chunk at position {start} holds {values.size} "
                          f"values, not {length}")
    got = crc32(values)
    if got != expected:
      raise ChecksumError(f"{self.name}: values [{start}, {start + length}) do not match the "
                          f"CRC32 written with them ({got:08x}, not {expected:08x}): the file "
                          "that holds them changed on disk")

  def check_whole(self, values: np.ndarray) -> None:
    """Checks every chunk of the whole array `values` (in its saved shape and dtype)."""
    flat = np.ascontiguousarray(values).reshape(-1)
    self._covering(0, flat.size)
    for start, (length, _) in self.chunks.items():
      self.check(start, flat[start:start + length])

  def read(self, store, index: tuple[slice, ...]) -> concurrent.futures.Future:
    """Starts reading the box `index` of `store` (this array), checked:
    the whole chunks that hold it are read, each checked against its CRC32
    on `threads()`. The result (`.result()`) is the box's values, in its
    shape, or raises ChecksumError."""
    start, stop = flat_range(index, self.shape)
    if start == stop:
      return store[index].read()
    chunks = self._covering(start, stop)
    reads = [(at, store[box_of(at, at + self.chunks[at][0], self.shape)].read())
             for at in chunks]
    shape = tuple(len(range(*s.indices(n))) for s, n in
                  zip(tuple(index) + (slice(None),) * (len(self.shape) - len(index)),
                      self.shape))

    def checked() -> np.ndarray:
      parts = []
      for at, reading in reads:
        values = np.asarray(reading.result()).reshape(-1)
        self.check(at, values)
        parts.append(values)
      whole = parts[0] if len(parts) == 1 else np.concatenate(parts)
      return whole[start - chunks[0]:stop - chunks[0]].reshape(shape)
    return threads().submit(checked)

  def _covering(self, start: int, stop: int) -> list[int]:
    """The starts of the chunks that hold positions [start, stop), in order;
    ChecksumError where a position has none."""
    starts = sorted(self.chunks)
    i = max(0, bisect.bisect_right(starts, start) - 1)
    out, at = [], start
    while at < stop:
      if i >= len(starts) or not starts[i] <= at < starts[i] + self.chunks[starts[i]][0]:
        raise ChecksumError(f"{self.name}: no checksum was written for position {at}")
      out.append(starts[i])
      at = starts[i] + self.chunks[starts[i]][0]
      i += 1
    return out


class Recorder:
  """The checksums one process takes during one save, array by array."""

  def __init__(self):
    self.arrays: dict[str, ArraySums] = {}

  def array(self, name: str, shape: tuple[int, ...], dtype) -> ArraySums:
    """The ArraySums that the chunks of array `name` are added to."""
    if name not in self.arrays:
      self.arrays[name] = ArraySums(name, tuple(shape), np.dtype(dtype).name)
    return self.arrays[name]

  def write(self, item_folder: pathlib.Path, process: int) -> None:
    """Writes the checksums into a new file of `item_folder`'s FOLDER,
    flushed to the disk (an OSError where it cannot be written)."""
    folder = pathlib.Path(item_folder) / FOLDER
    folder.mkdir(exist_ok=True)
    record = {"arrays": {a.name: {"shape": list(a.shape), "dtype": a.dtype,
                                  "chunks": [[s, n, c] for s, (n, c) in sorted(a.chunks.items())]}
                         for a in self.arrays.values()}}
    path = folder / f"process_{process}.{secrets.token_hex(4)}.json"
    with open(path, "w") as f:
      json.dump(record, f)
      f.flush()
      os.fsync(f.fileno())


def processes(item_folder: pathlib.Path) -> int:
  """How many processes' checksums files an item folder holds."""
  names = (p.name for p in (pathlib.Path(item_folder) / FOLDER).glob("process_*.json"))
  return len({n.split(".")[0] for n in names})


def read(item_folder: pathlib.Path) -> dict[str, ArraySums] | None:
  """The checksums of a checkpoint's item folder, every process's; None
  where it has none (written before them).

  Raises:
    ChecksumError: a checksums file that does not read, or two that differ
      on an array's shape or dtype.
  """
  folder = pathlib.Path(item_folder) / FOLDER
  if not folder.is_dir():
    return None
  arrays: dict[str, ArraySums] = {}
  for path in sorted(folder.glob("*.json")):
    try:
      record = json.loads(path.read_text())["arrays"]
      for name, saved in record.items():
        sums = ArraySums(name, tuple(saved["shape"]), saved["dtype"])
        old = arrays.setdefault(name, sums)
        if (old.shape, old.dtype) != (sums.shape, sums.dtype):
          raise ChecksumError(f"{path} gives {name} as {sums.dtype}{list(sums.shape)}, another "
                              f"file as {old.dtype}{list(old.shape)}")
        for start, length, crc in saved["chunks"]:
          old.add(int(start), int(length), int(crc))
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
      if isinstance(e, ChecksumError):
        raise
      raise ChecksumError(f"the checksums file {path} does not read: {e}") from e
  return arrays
