"""Hugging Face safetensors checkpoints as jzo's stacked leaves, for any model family.

A family's converter (jzo.models.hf for the Llama family, jzo.models.gpt2_hf
for GPT-2) describes each leaf of its params as a `Leaf`: the checkpoint
tensors it is made of, per layer or once. Here, whatever the family:
`tensors(folder)` reads the files' headers (one model.safetensors, or the
shards model.safetensors.index.json lists), `check` holds them against the
leaves, `load` assembles one leaf from its tensors, memory-mapped one at a
time, and `write` does the reverse, one tensor at a time, in shards. A
leaf may also stack a mixture's experts, one checkpoint tensor (or group of
them) per layer and expert.

The safetensors format (a little-endian u64 header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the raw data) is parsed here
rather than through safetensors' numpy loader, which lacks bfloat16 on some
numpy versions, so every tensor is a plain np.memmap.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Callable, Iterator

import ml_dtypes
import numpy as np

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# safetensors dtype code <-> numpy dtype, for the float formats jzo reads and writes.
DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
          "F32": np.dtype(np.float32)}

Path = tuple[str, ...]  # a leaf's keys in the nested params dict


@dataclasses.dataclass(frozen=True)
class Tensor:
  """Where one tensor's data lies in a safetensors file."""
  file: str  # path of the file
  code: str  # safetensors dtype code ("BF16", ...)
  shape: tuple[int, ...]
  offset: int  # bytes from the start of the file to the tensor's data


@dataclasses.dataclass(frozen=True)
class Leaf:
  """How one jzo leaf is made of checkpoint tensors: per layer (names with
  `{i}`) or once, the parts concatenated along their first axis, then
  transposed where `transpose` (torch's Linear stores (out, in), jzo's
  kernels are (in, out)).

  With `experts` E > 0 (a mixture's stacked experts), the parts are E
  equal groups in expert order (names with the expert's number in them),
  each group concatenated and transposed as above into its expert's slab:
  the leaf gains an expert axis after the layer axis ((L, E, ...))."""
  parts: tuple[tuple[str, tuple[int, ...]], ...]  # (name, its shape in the checkpoint)
  transpose: bool
  stacked: bool  # one per layer: the leaf gains a leading layer axis
  experts: int = 0

  def _rows(self) -> int:
    """One slab's length along the parts' concatenated (first) axis."""
    return sum(s[0] for _, s in self.parts) // max(self.experts, 1)

  def shape(self, n_layer: int) -> tuple[int, ...]:
    """The jzo leaf's shape."""
    shape = (self._rows(),) + self.parts[0][1][1:]
    shape = shape[::-1] if self.transpose else shape
    shape = (self.experts,) + shape if self.experts else shape
    return (n_layer,) + shape if self.stacked else shape

  def names(self, n_layer: int) -> Iterator[tuple[int, int, str, tuple[int, ...]]]:
    """(layer, offset along the first axis, name, shape) of each of its
    tensors; with experts, the offset runs on through the groups (expert e's
    slab starts at e times its length)."""
    for i in range(n_layer if self.stacked else 1):
      start = 0
      for name, shape in self.parts:
        yield i, start, name.format(i=i), shape
        start += shape[0]

  def slab(self, leaf: np.ndarray, layer: int, start: int) -> tuple[np.ndarray, int]:
    """Where a tensor that `names` yields lies in the leaf's array: (the
    slab it is part of, a view of `leaf`: its layer's row, and its
    expert's, and its offset along the slab's concatenated axis)."""
    row = leaf[layer] if self.stacked else leaf
    if not self.experts:
      return row, start
    expert, start = divmod(start, self._rows())
    return row[expert], start


def read_config(folder: str) -> dict:
  """`folder`/config.json as a dict.

  Raises:
    FileNotFoundError: no config.json.
    ValueError: not a JSON object.
  """
  path = os.path.join(folder, CONFIG)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} is missing")
  with open(path) as f:
    try:
      config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{path} is not JSON: {e}") from None
  if not isinstance(config, dict):
    raise ValueError(f"{path} holds a {type(config).__name__}, not a JSON object")
  return config


def check_config(hf: dict, model_types) -> None:
  """Refuses a config.json dict whose model_type is not one of
  `model_types`, or that lacks a size every decoder-only model has.

  Raises:
    ValueError: one line naming the model_type or the missing key.
  """
  model_type = hf.get("model_type")
  if model_type not in model_types:
    raise ValueError(f"model_type {model_type!r} is not supported (only "
                     f"{', '.join(model_types)})")
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads"):
    if key not in hf:
      raise ValueError(f"config has no {key!r}")


def _read_header(path: str) -> dict[str, Tensor]:
  """The tensors of one safetensors file, from its header alone."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} is missing")
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
    if 8 + n > size:
      raise ValueError(f"{path} is not a safetensors file ({size} bytes, header of {n})")
    try:
      header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{path} is not a safetensors file (header: {e})") from None
  data = 8 + n
  tensors = {}
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    try:
      code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
      raise ValueError(f"{path}: tensor {name} has a malformed header entry {entry}") from None
    itemsize = DTYPES[code].itemsize if code in DTYPES else None
    if itemsize is not None and (end - begin != math.prod(shape) * itemsize
                                 or data + end > size):
      raise ValueError(f"{path}: tensor {name} {code}{list(shape)} has data [{begin}, {end}), "
                       f"expected {math.prod(shape) * itemsize} bytes within the file's "
                       f"{size - data}")
    tensors[name] = Tensor(path, code, shape, data + begin)
  return tensors


def tensors(folder: str) -> dict[str, Tensor]:
  """Every tensor of the folder's checkpoint: one model.safetensors, or the
  shards model.safetensors.index.json lists.

  Raises:
    FileNotFoundError: neither file, or a shard, is there (named).
    ValueError: a malformed index or file (named).
  """
  index = os.path.join(folder, INDEX)
  if not os.path.isfile(index):
    if not os.path.isfile(os.path.join(folder, SINGLE)):
      raise FileNotFoundError(f"{folder} has neither {SINGLE} nor {INDEX}")
    return _read_header(os.path.join(folder, SINGLE))
  with open(index) as f:
    try:
      weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as e:
      raise ValueError(f"{index} is not a safetensors index: {e}") from None
  if not isinstance(weight_map, dict) or not weight_map:
    raise ValueError(f"{index} has no weight_map of tensor names to files")
  headers = {}
  out = {}
  for name, file in weight_map.items():
    if file not in headers:
      headers[file] = _read_header(os.path.join(folder, file))
    if name not in headers[file]:
      raise ValueError(f"{index} puts tensor {name} in {file}, which does not hold it")
    out[name] = headers[file][name]
  return out


def check(folder: str, found: dict[str, Tensor], leaves: dict[Path, Leaf], n_layer: int,
          unused: Callable[[str], bool], model: str) -> None:
  """Refuses a checkpoint whose tensors do not make `leaves` exactly: one
  missing, of another shape or of a dtype not in DTYPES, or one that no leaf
  takes and `unused` does not pass over (`model` names the model in that
  message: "a llama model of this config.json").

  Raises:
    ValueError: one line naming the tensor (and its file and shapes).
  """
  expected = set()
  for leaf in leaves.values():
    for _, _, name, shape in leaf.names(n_layer):
      expected.add(name)
      if name not in found:
        raise ValueError(f"{folder}: tensor {name} is missing (expected shape {list(shape)})")
      t = found[name]
      if t.shape != shape:
        raise ValueError(f"{os.path.basename(t.file)}: tensor {name} has shape {list(t.shape)}, "
                         f"expected {list(shape)} from config.json")
      if t.code not in DTYPES:
        raise ValueError(f"{os.path.basename(t.file)}: tensor {name} is {t.code}, "
                         f"not one of {', '.join(DTYPES)}")
  unexpected = sorted(n for n in found if n not in expected and not unused(n))
  if unexpected:
    t = found[unexpected[0]]
    others = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
    raise ValueError(f"{os.path.basename(t.file)}: unexpected tensor {unexpected[0]} "
                     f"{list(t.shape)}{others}: {model} has none")


def load(leaf: Leaf, n_layer: int, dtype, found: dict[str, Tensor], lo: int = 0,
         hi: int | None = None) -> np.ndarray:
  """One jzo leaf in `dtype`, assembled from its tensors, each memory-mapped
  in turn; of a stacked leaf, its layers [lo, hi) alone (default: all)."""
  hi = n_layer if hi is None else hi
  shape = leaf.shape(n_layer)
  out = np.empty((hi - lo,) + shape[1:] if leaf.stacked else shape, dtype)
  for i, start, name, part_shape in leaf.names(n_layer):
    if leaf.stacked and not lo <= i < hi:
      continue
    t = found[name]
    w = np.memmap(t.file, DTYPES[t.code], "r", t.offset, t.shape)
    row, start = leaf.slab(out, i - lo if leaf.stacked else i, start)
    end = start + part_shape[0]
    if leaf.transpose:
      row[:, start:end] = w.T
    else:
      row[start:end] = w
    del w  # unmaps
  return out


def nest(flat: dict[Path, object]) -> dict:
  """The nested dict of {key path: value}."""
  out: dict = {}
  for path, value in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out


def flatten(tree: dict, prefix: Path = ()) -> Iterator[tuple[Path, object]]:
  """(key path, leaf) of a nested dict."""
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from flatten(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def write(folder: str, config: dict, leaves: dict[Path, Leaf], n_layer: int, params: dict,
          dtype, max_shard_bytes: int, model: str) -> None:
  """Writes `params` (numpy arrays in jzo's layout, shaped as `leaves` say,
  or anything indexed as they are: a checkpoint's MasterViews, read a layer
  at a time)
  into `folder`: config.json (`config` with the dtype added), then
  model.safetensors, or shards model-0000k-of-0000n.safetensors with
  model.safetensors.index.json when the tensors pass `max_shard_bytes`
  (a tensor larger than that gets a file of its own). Each tensor is cut
  out of its leaf and converted on its own; they go in the order
  transformers writes them: the leaves before the first per-layer one,
  the layers one by one, then the rest.

  Raises:
    ValueError: a dtype other than bfloat16, float16 or float32, or a params
      leaf missing, extra or of another shape (`model` names the model in
      that message).
  """
  codes = {v.name: k for k, v in DTYPES.items()}
  try:
    name = np.dtype(dtype).name
  except TypeError:
    name = None
  if name not in codes:
    raise ValueError(f"dtype must be one of {', '.join(codes)}, got {dtype!r}")
  dtype = np.dtype(dtype)
  given = dict(flatten(params))
  for path, leaf in leaves.items():
    if path not in given:
      raise ValueError(f"params has no leaf {'/'.join(path)} (expected shape "
                       f"{list(leaf.shape(n_layer))})")
    if tuple(np.shape(given[path])) != leaf.shape(n_layer):
      raise ValueError(f"params leaf {'/'.join(path)} has shape {list(np.shape(given[path]))}, "
                       f"expected {list(leaf.shape(n_layer))}")
  extra = sorted("/".join(p) for p in given if p not in leaves)
  if extra:
    raise ValueError(f"params has a leaf {extra[0]} that {model} lacks")
  first_stacked = next((k for k, leaf in enumerate(leaves.values()) if leaf.stacked), None)
  # (order, name, shape, path, layer, offset) of every tensor.
  order = []
  for k, (path, leaf) in enumerate(leaves.items()):
    for i, start, name, shape in leaf.names(n_layer):
      rank = i if leaf.stacked else -1 if first_stacked is None or k < first_stacked else n_layer
      order.append((rank, name, shape, path, i, start))
  order.sort(key=lambda t: t[0])  # stable: within a layer, the leaves' order
  shards, size = [[]], 0
  for t in order:
    nbytes = math.prod(t[2]) * dtype.itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(t)
    size += nbytes
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, CONFIG), "w") as f:
    json.dump(config | {"torch_dtype": dtype.name, "dtype": dtype.name}, f, indent=2)
    f.write("\n")
  n = len(shards)
  weight_map = {}
  for k, shard in enumerate(shards, 1):
    file = SINGLE if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
    _write_shard(os.path.join(folder, file), shard, given, leaves, dtype, codes[dtype.name])
    weight_map.update((t[1], file) for t in shard)
  if n > 1:
    total = sum(math.prod(t[2]) for t in order) * dtype.itemsize
    with open(os.path.join(folder, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _write_shard(path: str, shard: list, params: dict, leaves: dict, dtype: np.dtype,
                 code: str) -> None:
  """One safetensors file: the header, then each tensor, cut out of its
  jzo leaf and converted on its own."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for _, name, shape, *_ in shard:
    nbytes = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for _, name, shape, leaf_path, i, start in shard:
      leaf = leaves[leaf_path]
      x, start = leaf.slab(params[leaf_path], i, start)
      x = x[:, start:start + shape[0]].T if leaf.transpose else x[start:start + shape[0]]
      np.ascontiguousarray(x, dtype).tofile(f)
