"""Documents packed into one token stream, cached next to the run, and cut into
deterministic batches of rows.

`tokenize_cached(path, tokenizer, cache_dir)` tokenizes a data path once
(jzo.recipe.tokens) into a stream of ids (uint32) with a parallel loss mask
(uint8), saved as .npy files and read back memory-mapped. `split_rows` holds
out the last rows; `PackedBatches` draws them a permutation an epoch.

Packing is naive: documents follow each other, each ending with eos, and
rows are cut at fixed positions, so a document may run on into the next row
(attention is not masked at document boundaries).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np
import tqdm

from jzo.recipe import tokens as tokens_lib

# Bump when the tokens a data file gives change (formats, masking), so old caches are not read.
FORMAT_VERSION = 1
_PREFIX = "tokens-"  # cache entries are folders named _PREFIX + key


@dataclasses.dataclass(frozen=True)
class TokenStream:
  """A data path's documents, one after another.

  Attributes:
    tokens: uint32 (n,) token ids, memory-mapped.
    loss_mask: uint8 (n,) 1 where the token is learned (predicted with the loss).
    n_documents: documents in the stream.
  """
  tokens: np.ndarray
  loss_mask: np.ndarray
  n_documents: int


def tokenize_cached(path: str | pathlib.Path, tokenizer: tokens_lib.Tokenizer,
                    cache_dir: str | pathlib.Path, *, progress: bool = True) -> TokenStream:
  """The token stream of a data path, tokenized once and then read from `cache_dir`.

  The cache is keyed by the data files (path, size, mtime_ns), the tokenizer's fingerprint
  and FORMAT_VERSION; a new entry replaces the others in `cache_dir`.

  Args:
    path: a text, JSONL, parquet or Arrow file or a folder of them (jzo.recipe.tokens).
    tokenizer: the checkpoint's tokenizer.
    cache_dir: folder for the cache (the recipe's `<out>/data-cache`); created if missing.
    progress: show a progress bar over the data's bytes (False on non-primary processes).

  Raises:
    FileNotFoundError: `path` does not exist.
    tokens.DataError: a file that cannot be used, or no document, or no token with a loss.
  """
  files = tokens_lib.data_files(path)
  cache_dir = pathlib.Path(cache_dir)
  entry = cache_dir / (_PREFIX + _key(files, tokenizer))
  if not (entry / "meta.json").is_file():
    shutil.rmtree(entry, ignore_errors=True)  # one that lost its meta.json by hand
    _write(entry, _tokenize(path, files, tokenizer, progress))
  return _read(entry)


def _key(files: list[pathlib.Path], tokenizer: tokens_lib.Tokenizer) -> str:
  """sha256 (hex, 32 digits) of what the stream depends on."""
  stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
  blob = json.dumps([FORMAT_VERSION, tokenizer.fingerprint, stats])
  return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _tokenize(path, files: list[pathlib.Path], tokenizer: tokens_lib.Tokenizer,
              progress: bool) -> TokenStream:
  """Every document of `files`, concatenated in memory."""
  ids, masks = [], []
  total = sum(f.stat().st_size for f in files)
  with tqdm.tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing",
                 disable=not progress) as bar:
    for document, n_bytes in tokens_lib.documents(files, tokenizer):
      if document is not None:
        ids.append(document[0])
        masks.append(document[1])
      bar.update(n_bytes)
  if not ids:
    raise tokens_lib.DataError(f"data path {path} holds no documents")
  stream = TokenStream(np.concatenate(ids), np.concatenate(masks), len(ids))
  if not stream.loss_mask.any():
    raise tokens_lib.DataError(f"data path {path}: no token carries the loss (chat data "
                               "without assistant turns?)")
  return stream


def _write(entry: pathlib.Path, stream: TokenStream) -> None:
  """Writes the entry under a temporary name and renames it whole, so a killed run leaves
  no entry that reads; drops the folder's other entries (older data or tokenizers)."""
  entry.parent.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=".staging-", dir=entry.parent))
  np.save(staging / "tokens.npy", stream.tokens)
  np.save(staging / "loss_mask.npy", stream.loss_mask)
  (staging / "meta.json").write_text(json.dumps({"n_documents": stream.n_documents}))
  try:
    os.replace(staging, entry)
  except OSError:
    shutil.rmtree(staging, ignore_errors=True)
    if not (entry / "meta.json").is_file():
      raise
    # Another process of the run wrote the same entry first: its files are the same.
  for other in entry.parent.glob(_PREFIX + "*"):
    if other != entry:
      shutil.rmtree(other, ignore_errors=True)


def _read(entry: pathlib.Path) -> TokenStream:
  meta = json.loads((entry / "meta.json").read_text())
  return TokenStream(np.load(entry / "tokens.npy", mmap_mode="r"),
                     np.load(entry / "loss_mask.npy", mmap_mode="r"), meta["n_documents"])


def split_rows(n_tokens: int, seq_len: int, val_fraction: float = 0.05) -> tuple[range, range]:
  """Training and held-out rows of a stream: the last `val_fraction` of them (at least one)
  are held out, as jzo.recipe.data.train_val_split holds out the end of a stream.

  Row r is tokens[r * seq_len : r * seq_len + seq_len + 1]: rows overlap by one token, so
  every token but the first is a target exactly once.

  Raises:
    tokens.DataError: fewer than two rows.
  """
  if not 0 < val_fraction < 1:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
  n_rows = (n_tokens - 1) // seq_len
  if n_rows < 2:
    raise tokens_lib.DataError(f"{n_tokens} tokens are too few for two rows of "
                               f"{seq_len + 1} (seq_len + 1)")
  cut = min(int(n_rows * (1 - val_fraction)), n_rows - 1)
  return range(cut), range(cut, n_rows)


@dataclasses.dataclass(frozen=True)
class PackedBatches:
  """Batches of rows of a packed stream, each row once an epoch.

  Position p = step * batch_size + j of the run's sequence of rows is row
  permutation(seed, epoch = p // n)[p % n] of the n rows, so batch `step` is a pure
  function of (seed, step): a resumed run draws the same batches.

  Attributes:
    tokens: uint32 (n,) token ids (TokenStream.tokens).
    loss_mask: uint8 (n,) the loss mask beside them.
    batch_size: rows per batch.
    seq_len: model context; a row holds seq_len + 1 tokens.
    seed: the order of rows is a function of it alone.
    rows: the rows to draw (split_rows); all of them where None.
  """
  tokens: np.ndarray
  loss_mask: np.ndarray
  batch_size: int
  seq_len: int
  seed: int = 0
  rows: range | None = None

  def __post_init__(self):
    if self.batch_size < 1 or self.seq_len < 1:
      raise ValueError(f"batch_size and seq_len must be >= 1, got {self.batch_size}, "
                       f"{self.seq_len}")
    if len(self.tokens) != len(self.loss_mask):
      raise ValueError(f"{len(self.tokens)} tokens but {len(self.loss_mask)} mask entries")
    n_rows = (len(self.tokens) - 1) // self.seq_len
    if self.rows is None:
      object.__setattr__(self, "rows", range(n_rows))
    if len(self.rows) < 1 or self.rows.step != 1 or self.rows.stop > n_rows:
      raise ValueError(f"rows {self.rows} are not a non-empty run of the stream's {n_rows}")

  @property
  def loss_tokens(self) -> int:
    """Targets with the loss in these rows: the answer tokens an epoch learns."""
    return int(np.count_nonzero(self.loss_mask[self.rows.start * self.seq_len + 1:
                                               self.rows.stop * self.seq_len + 1]))

  def __getitem__(self, step: int) -> dict[str, np.ndarray]:
    """Batch number `step`: {"tokens": int32 (batch_size, seq_len + 1),
    "loss_mask": float32 (batch_size, seq_len), aligned with tokens[:, 1:]}."""
    n = len(self.rows)
    positions = step * self.batch_size + np.arange(self.batch_size)
    starts = [(self.rows.start + _permutation(self.seed, int(p // n), n)[p % n]) * self.seq_len
              for p in positions]
    width = self.seq_len + 1
    return {
        "tokens": np.stack([np.asarray(self.tokens[s:s + width], np.int32) for s in starts]),
        "loss_mask": np.stack([np.asarray(self.loss_mask[s + 1:s + width], np.float32)
                               for s in starts]),
    }


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
  """The order of n rows in an epoch; cached, as consecutive steps share an epoch."""
  return np.random.default_rng([seed, epoch]).permutation(n)
