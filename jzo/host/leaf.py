"""`HostLeaf`: a parameter that stays on disk until the engine draws it.

A tree of HostLeafs is one of the forms `ZeroEngine(params=...)` takes: the
plan reads each leaf's shape and dtype without loading anything, then the
engine loads one leaf at a time (jzo.models.hf reads a Hugging Face
checkpoint this way), so the host never holds more than one leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class HostLeaf:
  """A lazy host array: `load()` returns it as a numpy array of `shape` and
  `dtype`, freshly read each call (the caller lets it go when done), and
  `load_rows(lo, hi)`, where given, its rows [lo, hi) of the first axis
  alone (a stacked leaf's layers: the engine draws a large one a slice at
  a time).

  Not a pytree node: in a tree of params each HostLeaf is one leaf.
  """
  shape: tuple[int, ...]  # what load() returns: the plan reads it without loading
  dtype: np.dtype  # any floating dtype; the engine casts to float32 on the device
  load: Callable[[], np.ndarray]
  load_rows: Callable[[int, int], np.ndarray] | None = None

  def rows(self, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) of the first axis: `load_rows`', else cut from `load()`
    (which holds the whole array meanwhile)."""
    if self.load_rows is not None:
      return self.load_rows(lo, hi)
    return np.ascontiguousarray(self.load()[lo:hi])

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
    object.__setattr__(self, "dtype", np.dtype(self.dtype))

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    """Bytes load() returns."""
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
