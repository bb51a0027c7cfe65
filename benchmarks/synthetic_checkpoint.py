"""A Hugging Face folder of random bf16 weights in a preset's published shape, written fast.

  python3 benchmarks/synthetic_checkpoint.py --model llama-3.1-70b --out DIR [--n-layer N]

For shapes no checkpoint can be downloaded for here (a 70B model's 141 GB), DIR gets what
`python -m jzo.train --init-from DIR` and transformers read:
  config.json               the preset's, as jzo.models.hf writes it
  model*.safetensors        bf16 shards of at most --shard-gb, with model.safetensors.index.json
  tokenizer.json,           bytes as ids 0-255, ChatML's <|endoftext|>, <|im_start|> and
  tokenizer_config.json     <|im_end|> at 256-258 and ChatML's chat template, so that chat
                            JSONL trains on it (the model's vocabulary keeps its size)

Each weight matrix is N(0, 0.02), as the families initialise them, cut at a random offset per
tensor from one pool of 2^26 bf16 normals (drawing every value would take minutes a billion
parameters, writing is bound by the disk instead); norms' scales are the family's initial
ones and biases zero. The record gives the parameters and bytes written, the seconds and GB/s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import time

import ml_dtypes
import numpy as np
import tokenizers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

from jzo.models import gemma, hf, llama  # noqa: E402
from jzo.recipe import tokens  # noqa: E402

POOL = 1 << 26  # bf16 normals every tensor is cut from: 128 MiB
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class RandomLeaf:
  """A params leaf whose values are made when indexed (as jzo.models.hf_files
  cuts tensors out of a leaf): each index's block is a slice of `pool` at
  an offset drawn from (seed, the leaf's name, the index), or `fill`
  everywhere; never the leaf whole."""

  def __init__(self, shape, name: str, pool: np.ndarray, seed: int, fill: float | None):
    self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(ml_dtypes.bfloat16), len(shape)
    self.name, self.pool, self.seed, self.fill = name, pool, seed, fill

  def __getitem__(self, index) -> np.ndarray:
    shape = np.broadcast_to(np.bool_(False), self.shape)[index].shape  # no copy made
    if self.fill is not None:
      return np.full(shape, self.fill, self.dtype)
    size = int(np.prod(shape, dtype=np.int64))
    key = hashlib.sha256(f"{self.seed} {self.name} {index}".encode()).digest()
    start = int.from_bytes(key[:8], "little") % len(self.pool)
    if start + size <= len(self.pool):
      return self.pool[start:start + size].reshape(shape)
    return np.resize(np.roll(self.pool, -start), size).reshape(shape)  # the pool over again


def random_params(config, seed: int):
  """The preset's params tree (jzo's layout) of RandomLeafs."""
  import jax  # the shapes alone: no weight is drawn, no device is used
  family = hf.family(config)
  shapes = jax.eval_shape(lambda: family.init_params(config, jax.random.key(0)))
  pool = (np.random.default_rng(seed).standard_normal(POOL, np.float32) * 0.02).astype(
      ml_dtypes.bfloat16)
  scale = 0.0 if family is gemma else 1.0  # Gemma's norms multiply by (1 + weight)

  def leaf(path, x):
    name = jax.tree_util.keystr(path)
    fill = scale if "norm" in name else 0.0 if "bias" in name else None
    return RandomLeaf(x.shape, name, pool, seed, fill)
  return jax.tree_util.tree_map_with_path(leaf, shapes)


def write_tokenizer(folder: pathlib.Path) -> None:
  """Bytes, then ChatML's special tokens, with its chat template."""
  backend = tokens.byte_level_tokenizer().backend
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIAL])
  (folder / "tokenizer.json").write_text(backend.to_str(), encoding="utf-8")
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
       "chat_template": CHATML}, indent=2) + "\n", encoding="utf-8")


def write_folder(config, out: pathlib.Path, shard_gb: float = 5.0, seed: int = 0) -> dict:
  """Writes `config`'s shape into `out` (which exists, empty): random bf16
  shards with an index, config.json and the byte tokenizer; the point."""
  start = time.perf_counter()
  hf.save_pretrained(str(out), config, random_params(config, seed), dtype="bfloat16",
                     max_shard_bytes=int(shard_gb * 1e9))
  write_tokenizer(out)
  seconds = time.perf_counter() - start
  written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
  return {"status": "ok", "n_layer": config.n_layer, "n_params": config.n_params,
          "bytes": written, "seconds": seconds, "gb_per_s": written / seconds / 1e9}


def preset(name: str, n_layer: int | None = None, vocab_size: int | None = None):
  """The config of preset `name` of a Hugging Face family, with other sizes
  where given; ValueError naming the problem for an unknown preset or a
  vocabulary the tokenizer does not fit."""
  presets = {**llama.PRESETS, **gemma.PRESETS}
  if name not in presets:
    raise ValueError(f"--model {name!r} is not a preset of a Hugging Face family: "
                     f"{', '.join(presets)}")
  config = dataclasses.replace(presets[name], n_layer=n_layer or presets[name].n_layer,
                               vocab_size=vocab_size or presets[name].vocab_size)
  if config.vocab_size < 256 + len(SPECIAL):
    raise ValueError(f"the vocabulary of {config.vocab_size} is smaller than the tokenizer's "
                     f"{256 + len(SPECIAL)} ids: give --vocab-size")
  return config


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--model", required=True, help="a preset of the Hugging Face families "
                      "(jzo.models' Llama, Mistral, Qwen, Phi, mixtures of experts, Gemma)")
  parser.add_argument("--out", required=True, help="the folder to write (new, or empty)")
  parser.add_argument("--n-layer", type=int, help="layers, instead of the preset's")
  parser.add_argument("--vocab-size", type=int, help="vocabulary, instead of the preset's "
                      f"(at least the tokenizer's {256 + len(SPECIAL)} ids)")
  parser.add_argument("--shard-gb", type=float, default=5.0, help="most GB of one shard")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  try:
    config = preset(args.model, args.n_layer, args.vocab_size)
  except ValueError as e:
    parser.error(str(e))
  out = pathlib.Path(args.out)
  if out.exists() and any(out.iterdir()):
    parser.error(f"--out {out} holds files")
  out.mkdir(parents=True, exist_ok=True)
  point = {"model": args.model, **write_folder(config, out, args.shard_gb, args.seed)}
  print(f"{args.model}: {config.n_params / 1e9:.2f}B parameters, {point['bytes'] / 1e9:.1f} GB "
        f"in {point['seconds']:.0f} s ({point['gb_per_s']:.2f} GB/s) to {out}")
  harness.write_record(args.json, "synthetic_checkpoint", args, [point], with_devices=False)


if __name__ == "__main__":
  main()
