"""Hugging Face checkpoints in and out for jzo.models.llama, one leaf at a time.

`param_sources(folder)` reads a folder that transformers' `save_pretrained`
wrote (config.json and model.safetensors, or shards listed by
model.safetensors.index.json) as a LlamaConfig and a tree of `jzo.HostLeaf`
shaped like `llama.init_params`: nothing is read until the engine draws a
leaf, and each leaf is then assembled from its per-layer tensors, memory-mapped
from the files, in the files' dtype, so the host never holds more than one
leaf. `save_pretrained(folder, config, params)` writes the reverse, one tensor
at a time, for `transformers.AutoModelForCausalLM.from_pretrained`.

The safetensors format (a little-endian u64 header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the raw data) is parsed here
rather than through safetensors' numpy loader, which lacks bfloat16 on some
numpy versions, so every tensor is a plain np.memmap.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import struct

import ml_dtypes
import numpy as np

from jzo.host.leaf import HostLeaf
from jzo.models.llama import LlamaConfig

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# safetensors dtype code <-> numpy dtype, for the float formats jzo reads and writes.
DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
          "F32": np.dtype(np.float32)}
# Buffers some checkpoints carry that the model recomputes (RoPE's frequencies).
_HARMLESS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """Where one tensor's data lies in a safetensors file."""
  file: str  # path of the file
  code: str  # safetensors dtype code ("BF16", ...)
  shape: tuple[int, ...]
  offset: int  # bytes from the start of the file to the tensor's data


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """How one jzo leaf is made of Hugging Face tensors: per layer (names with
  `{i}`) or once, the parts concatenated along their first axis, then
  transposed (matrices: Hugging Face stores (out, in), jzo kernels (in, out))."""
  parts: tuple[tuple[str, tuple[int, ...]], ...]  # (name, its shape in the checkpoint)
  transpose: bool
  stacked: bool  # one per layer: the leaf gains a leading layer axis

  def shape(self, n_layer: int) -> tuple[int, ...]:
    """The jzo leaf's shape."""
    first = self.parts[0][1]
    shape = (sum(s[0] for _, s in self.parts),) + first[1:]
    shape = shape[::-1] if self.transpose else shape
    return (n_layer,) + shape if self.stacked else shape


def _leaves(config: LlamaConfig) -> dict[tuple[str, ...], _Leaf]:
  """The jzo params' leaves (key paths as in llama.init_params) and the
  Hugging Face tensors each is made of."""
  D, V, F, hd = config.d_model, config.vocab_size, config.d_ff, config.head_dim
  Q, KV = config.n_head * hd, config.n_kv_head * hd
  p = "model.layers.{i}."
  once = lambda name, shape: _Leaf(((name, shape),), False, False)
  layer = lambda parts, transpose=False: _Leaf(tuple((p + n, s) for n, s in parts), transpose,
                                               True)
  out = {
      ("embed",): once("model.embed_tokens.weight", (V, D)),
      ("layers", "attn_norm", "scale"): layer([("input_layernorm.weight", (D,))]),
      ("layers", "qkv", "kernel"): layer([("self_attn.q_proj.weight", (Q, D)),
                                          ("self_attn.k_proj.weight", (KV, D)),
                                          ("self_attn.v_proj.weight", (KV, D))], True),
      ("layers", "o", "kernel"): layer([("self_attn.o_proj.weight", (D, Q))], True),
      ("layers", "mlp_norm", "scale"): layer([("post_attention_layernorm.weight", (D,))]),
      ("layers", "gate_up", "kernel"): layer([("mlp.gate_proj.weight", (F, D)),
                                              ("mlp.up_proj.weight", (F, D))], True),
      ("layers", "down", "kernel"): layer([("mlp.down_proj.weight", (D, F))], True),
      ("norm", "scale"): once("model.norm.weight", (D,)),
  }
  if config.qkv_bias:
    out["layers", "qkv", "bias"] = layer([("self_attn.q_proj.bias", (Q,)),
                                          ("self_attn.k_proj.bias", (KV,)),
                                          ("self_attn.v_proj.bias", (KV,))])
  if config.o_bias:
    out["layers", "o", "bias"] = layer([("self_attn.o_proj.bias", (D,))])
  if config.qk_norm:
    out["layers", "q_norm", "scale"] = layer([("self_attn.q_norm.weight", (hd,))])
    out["layers", "k_norm", "scale"] = layer([("self_attn.k_norm.weight", (hd,))])
  if not config.tie_embeddings:
    out["lm_head",] = once("lm_head.weight", (V, D))
  return out


def _names(leaf: _Leaf, n_layer: int):
  """(layer, offset along the first axis, name, shape) of each tensor of a leaf."""
  for i in range(n_layer if leaf.stacked else 1):
    start = 0
    for name, shape in leaf.parts:
      yield i, start, name.format(i=i), shape
      start += shape[0]


def read_config(folder: str, **overrides) -> LlamaConfig:
  """The LlamaConfig of `folder`/config.json; `overrides` set jzo's own
  fields (remat, attention).

  Raises:
    FileNotFoundError: no config.json.
    ValueError: not JSON, or a config LlamaConfig.from_hf refuses.
  """
  path = os.path.join(folder, CONFIG)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} is missing")
  with open(path) as f:
    try:
      hf = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not JSON: {e}") from None
  return LlamaConfig.from_hf(hf, **overrides)


def _read_header(path: str) -> dict[str, _Tensor]:
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
    tensors[name] = _Tensor(path, code, shape, data + begin)
  return tensors


def _tensors(folder: str) -> dict[str, _Tensor]:
  """Every tensor of the folder's checkpoint: one model.safetensors, or the
  shards model.safetensors.index.json lists."""
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
  tensors = {}
  for name, file in weight_map.items():
    if file not in headers:
      headers[file] = _read_header(os.path.join(folder, file))
    if name not in headers[file]:
      raise ValueError(f"{index} puts tensor {name} in {file}, which does not hold it")
    tensors[name] = headers[file][name]
  return tensors


def _load(leaf: _Leaf, n_layer: int, shape: tuple[int, ...], dtype: np.dtype,
          tensors: dict[str, _Tensor]) -> np.ndarray:
  """One jzo leaf assembled from its tensors, each memory-mapped in turn."""
  out = np.empty(shape, dtype)
  for i, start, name, part_shape in _names(leaf, n_layer):
    t = tensors[name]
    w = np.memmap(t.file, DTYPES[t.code], "r", t.offset, t.shape)
    row = out[i] if leaf.stacked else out
    end = start + part_shape[0]
    if leaf.transpose:
      row[:, start:end] = w.T
    else:
      row[start:end] = w
    del w  # unmaps
  return out


def param_sources(folder: str, **overrides) -> tuple[LlamaConfig, dict]:
  """(config, params) of a Hugging Face folder: params is a nested dict
  shaped like `llama.init_params(config, ...)` whose leaves are `HostLeaf`s
  in the checkpoint's dtype (bf16, fp16 or fp32): pass it to
  `ZeroEngine(params=...)`, which loads one leaf at a time, or call a
  leaf's `load()`. Every tensor's name, shape and dtype is checked here,
  from the files' headers, before anything is loaded.

  Args:
    folder: holds config.json and model.safetensors or
      model.safetensors.index.json with its shards.
    overrides: LlamaConfig fields set over config.json's (remat, attention).

  Raises:
    FileNotFoundError: the config, the weights or a shard is missing, named.
    ValueError: a bad config, index or file, or a tensor that is missing,
      unexpected, of another shape than the config implies or of an
      unsupported dtype, in one line naming it (and the shapes).
  """
  config = read_config(folder, **overrides)
  tensors = _tensors(folder)
  leaves = _leaves(config)
  expected = set()
  for leaf in leaves.values():
    for _, _, name, shape in _names(leaf, config.n_layer):
      expected.add(name)
      if name not in tensors:
        raise ValueError(f"{folder}: tensor {name} is missing (expected shape {list(shape)})")
      t = tensors[name]
      if t.shape != shape:
        raise ValueError(f"{os.path.basename(t.file)}: tensor {name} has shape {list(t.shape)}, "
                         f"expected {list(shape)} from config.json")
      if t.code not in DTYPES:
        raise ValueError(f"{os.path.basename(t.file)}: tensor {name} is {t.code}, "
                         f"not one of {', '.join(DTYPES)}")
  # A tied model's lm_head.weight, where a checkpoint has one, goes unused
  # (transformers ties it to the embedding too).
  unused = {"lm_head.weight"} if config.tie_embeddings else set()
  unexpected = sorted(n for n in tensors
                      if n not in expected and n not in unused and not _HARMLESS.fullmatch(n))
  if unexpected:
    t = tensors[unexpected[0]]
    others = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
    raise ValueError(f"{os.path.basename(t.file)}: unexpected tensor {unexpected[0]} "
                     f"{list(t.shape)}{others}: a {config.model_type} model of this config.json "
                     "has none")
  params: dict = {}
  for path, leaf in leaves.items():
    shape = leaf.shape(config.n_layer)
    dtype = DTYPES[tensors[leaf.parts[0][0].format(i=0)].code]
    load = functools.partial(_load, leaf, config.n_layer, shape, dtype, tensors)
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = HostLeaf(shape, dtype, load)
  return config, params


def save_pretrained(folder: str, config: LlamaConfig, params: dict, dtype: str = "bfloat16",
                    max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes `params` (jzo's layout, numpy arrays: what ZeroEngine.params
  returns) as a Hugging Face folder that
  `transformers.AutoModelForCausalLM.from_pretrained` loads: config.json,
  then model.safetensors, or shards model-0000k-of-0000n.safetensors with
  model.safetensors.index.json when the tensors pass `max_shard_bytes`.
  Tensors are converted and written one at a time. Tokenizer files are the
  caller's to copy.

  Args:
    dtype: of the written tensors: "bfloat16", "float16" or "float32".
    max_shard_bytes: most bytes of tensor data in one file (a tensor larger
      than this gets a file of its own).

  Raises:
    ValueError: a dtype other than these, a params leaf missing, extra or
      of another shape than the config's, or a config its model_type
      cannot express.
  """
  codes = {np.dtype(v).name: k for k, v in DTYPES.items()}
  if np.dtype(dtype).name not in codes:
    raise ValueError(f"dtype must be one of {', '.join(codes)}, got {dtype!r}")
  dtype = np.dtype(dtype)
  hf_config = config.to_hf() | {"torch_dtype": dtype.name, "dtype": dtype.name}
  leaves = _leaves(config)
  given = dict(_flatten(params))
  for path, leaf in leaves.items():
    if path not in given:
      raise ValueError(f"params has no leaf {'/'.join(path)} (expected shape "
                       f"{list(leaf.shape(config.n_layer))})")
    if tuple(np.shape(given[path])) != leaf.shape(config.n_layer):
      raise ValueError(f"params leaf {'/'.join(path)} has shape {list(np.shape(given[path]))}, "
                       f"expected {list(leaf.shape(config.n_layer))}")
  extra = sorted("/".join(p) for p in given if p not in leaves)
  if extra:
    raise ValueError(f"params has a leaf {extra[0]} that a {config.model_type} model of this "
                     "config lacks")
  # (name, shape, path, layer, offset) of every tensor, layer by layer as
  # transformers orders them, so a shard holds whole layers where it can.
  tensors = []
  for path, leaf in leaves.items():
    for i, start, name, shape in _names(leaf, config.n_layer):
      tensors.append((name, shape, path, i, start))
  tensors.sort(key=lambda t: t[3] if t[2][0] == "layers" else -1 if t[2] == ("embed",)
               else config.n_layer)
  shards, size = [[]], 0
  for t in tensors:
    nbytes = math.prod(t[1]) * dtype.itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(t)
    size += nbytes
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, CONFIG), "w") as f:
    json.dump(hf_config, f, indent=2)
  n = len(shards)
  weight_map = {}
  for k, shard in enumerate(shards, 1):
    file = SINGLE if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
    _write_shard(os.path.join(folder, file), shard, given, leaves, dtype, codes[dtype.name])
    weight_map.update((t[0], file) for t in shard)
  if n > 1:
    total = sum(math.prod(t[1]) for t in tensors) * dtype.itemsize
    with open(os.path.join(folder, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _flatten(tree: dict, prefix: tuple[str, ...] = ()):
  """(key path, leaf) of a nested dict."""
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _flatten(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def _write_shard(path: str, shard: list, params: dict, leaves: dict, dtype: np.dtype,
                 code: str) -> None:
  """One safetensors file: the header, then each tensor, cut out of its
  jzo leaf and converted on its own."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape, *_ in shard:
    nbytes = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name, shape, leaf_path, i, start in shard:
      leaf = leaves[leaf_path]
      x = np.asarray(params[leaf_path])
      x = x[i] if leaf.stacked else x
      x = x[:, start:start + shape[0]].T if leaf.transpose else x[start:start + shape[0]]
      np.ascontiguousarray(x, dtype).tofile(f)
