"""What the build of an engine's state draws at once: the leaves (and slices
of a stacked leaf's layers) grouped so that a few programs draw a model's
weights, none holding more float32 than the largest draw (`Plan.build_groups`,
`Plan.build_bytes`)."""

from __future__ import annotations

import math

from jzo.parallel.partition import LeafLayout

# Where the devices report no memory limit (a CPU's are host RAM), draws may
# hold this many float32 elements (64 MiB) beside the state even where the
# largest leaf is smaller: a small model's leaves are then drawn by one
# program, not by one for each leaf's size (`Plan.draw_floor`).
DRAW_GROUP_FLOOR = 1 << 24


def draw_groups(sizes: list[int], floor: int) -> list[list[int]]:
  """The leaves' indices, largest first, in runs whose sizes (elements) add
  up to at most the largest leaf's or `floor`, whichever is more: what one
  draw computes at once, so that a model's leaves are drawn by a few
  programs, not one each."""
  groups, room, limit = [], 0, max(max(sizes), floor)
  for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
    if not groups or sizes[i] > room:
      groups.append([])
      room = limit
    groups[-1].append(i)
    room -= sizes[i]
  return groups


def draw_pieces(leaves: list[LeafLayout], floor: int, sliced: bool
                ) -> list[list[tuple[int, tuple[int, int] | None]]]:
  """The leaves (`leaves`, jax.tree.leaves order) in the groups the build
  draws together (`draw_groups`), each a list of (leaf index, its layers
  [lo, hi), or None for the whole leaf). With `sliced` (the source gives a
  stacked leaf's layers apart), a stacked leaf larger than every other leaf
  and than one layer of each is drawn in slices of as many layers as fit
  that size (or `floor`, where more): Llama-3.1-70B's MLP kernels, 140 GiB
  in float32, would not fit a GPU whole."""
  row = lambda l: math.prod(l.inner_shape)  # elements of one layer (of the leaf, unstacked)
  sizes = [math.prod(l.shape) for l in leaves]
  limit = max([floor] + [row(l) if l.per_layer else n for l, n in zip(leaves, sizes)])
  pieces, piece_sizes = [], []
  for i, l in enumerate(leaves):
    if sliced and l.per_layer and sizes[i] > limit:
      step = limit // row(l)
      for lo in range(0, l.shape[0], step):
        pieces.append((i, (lo, min(lo + step, l.shape[0]))))
        piece_sizes.append((pieces[-1][1][1] - lo) * row(l))
    else:
      pieces.append((i, None))
      piece_sizes.append(sizes[i])
  return [[pieces[j] for j in group] for group in draw_groups(piece_sizes, floor)]
