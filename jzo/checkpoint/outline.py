"""A saved tree's outline (`outline`: its structure, and each array's
dtype and shape) and the differences between two (`misfit`): how a
checkpoint is compared with what an engine loads, naming the first entries
that differ, before any array is read."""

import numpy as np


# Differences between a saved state and an engine that a message lists at most.
_MAX_DIFFERENCES = 4


def misfit(saved, mine) -> str:
  """Where two outlines (see `outline`) differ, the first first; "" if they agree."""
  found: list[str] = []
  _compare(saved, mine, "", found)
  return "; ".join(found[:_MAX_DIFFERENCES]) + ("; ..." if len(found) > _MAX_DIFFERENCES else "")


def outline(tree):
  """A tree as orbax stores it: dicts, lists, None for empty nodes (optax's
  EmptyState) and 'dtype[shape]' strings for arrays."""
  if isinstance(tree, dict):
    return {str(k): outline(v) for k, v in tree.items()}
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple: stored as a dict
    return {k: outline(v) for k, v in tree._asdict().items()} or None
  if isinstance(tree, (list, tuple)):
    return [outline(v) for v in tree]
  if tree is None or isinstance(tree, str):  # an outline's already
    return tree
  return f"{np.dtype(tree.dtype)}{list(tree.shape)}"  # np arrays and orbax's ArrayMetadata


def _compare(saved, mine, path: str, found: list[str]) -> None:
  """Appends to `found` a line per difference between two outlines, in key order."""
  here = path or "the state"
  if isinstance(saved, dict) and isinstance(mine, dict):
    for k in sorted(saved.keys() | mine.keys()):
      entry = f"{path}[{k!r}]"
      if k not in mine:
        found.append(f"{entry} only in the checkpoint")
      elif k not in saved:
        found.append(f"{entry} only in this engine")
      else:
        _compare(saved[k], mine[k], entry, found)
  elif isinstance(saved, list) and isinstance(mine, list):
    if len(saved) != len(mine):
      found.append(f"{here} has {len(saved)} entries in the checkpoint, {len(mine)} in this "
                   "engine")
    else:
      for i, (s, m) in enumerate(zip(saved, mine)):
        _compare(s, m, f"{path}[{i}]", found)
  elif saved != mine:
    found.append(f"{here} is {_brief(saved)} in the checkpoint, {_brief(mine)} "
                 "in this engine")


def _brief(outline) -> str:
  """An outline in a few words: an array's 'dtype[shape]', else its kind."""
  if isinstance(outline, str):
    return outline
  if not outline:
    return "empty"
  n = len(outline)
  kind = 'dict' if isinstance(outline, dict) else 'list'
  return f"a {kind} of {n} entr{'y' if n == 1 else 'ies'}"
