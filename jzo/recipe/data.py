"""Token streams for language-model training, deterministic batches, and
the data of a recipe run (`load_data`): bytes without a tokenizer, else the
checkpoint's tokenizer over text, JSONL, parquet and Arrow files
(jzo.recipe.tokens, .parquet, .packing).

Sources, all to a 1-D array of token ids:
  * the embedded corpus: the top-level source files of Python's own standard
    library, byte-level (vocabulary 256), so a first run needs no download;
  * a text file or a folder of them, byte-level;
  * a nanoGPT-style `.bin` file of uint16 token ids, with its vocabulary size.

`Batches` draws windows at random positions from a seed: batch i is a pure
function of (seed, i), so a run resumes exactly from its step count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import sysconfig
from typing import Callable

import numpy as np

from jzo.recipe import packing, parquet, tokens as tokens_lib
from jzo.recipe.options import TrainConfig, UserError

BYTE_VOCAB = 256


def embedded_corpus() -> np.ndarray:
  """The standard library's top-level .py files, sorted by name, as bytes (uint8)."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(root.glob("*.py"))
  if not files:
    raise FileNotFoundError(f"no Python sources under {root} to use as the embedded corpus")
  return np.frombuffer(b"".join(f.read_bytes() for f in files), np.uint8)


def read_text(path: str | pathlib.Path) -> np.ndarray:
  """A text file, or every file in a folder (sorted, recursively), as bytes (uint8).

  Raises:
    FileNotFoundError: `path` does not exist.
    ValueError: no bytes, or a file holds a NUL byte (binary: an image, an
      archive, a token file without its .bin name), which no text holds.
    OSError: a file cannot be read, named with the reason.
  """
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"data path {path} does not exist")
  files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
  chunks = []
  for f in files:
    with _reading(f, "data file"):
      chunks.append(f.read_bytes())
    if (nul := chunks[-1].find(0)) >= 0:
      raise ValueError(f"data file {f} is binary (a NUL byte at offset {nul}): --data takes "
                       "text, or token ids in a .bin file")
  data = b"".join(chunks)
  if not data:
    raise ValueError(f"data path {path} holds no bytes")
  return np.frombuffer(data, np.uint8)


@contextlib.contextmanager
def _reading(path: pathlib.Path, what: str):
  """Re-raises an OSError as one of its type whose message is the one line
  the command line prints: `what`, the path and the reason."""
  try:
    yield
  except OSError as e:
    raise type(e)(f"{what} {path} cannot be read: {e.strerror or e}") from None


def read_tokens(path: str | pathlib.Path, vocab_size: int) -> np.ndarray:
  """A nanoGPT `.bin` file of uint16 token ids (memory-mapped), checked against the vocabulary."""
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"token file {path} does not exist")
  if not path.is_file():
    raise ValueError(f"token file {path} is not a file")
  if path.stat().st_size == 0 or path.stat().st_size % 2:
    raise ValueError(f"token file {path} has {path.stat().st_size} bytes: not a non-empty "
                     "array of uint16 tokens")
  with _reading(path, "token file"):
    tokens = np.memmap(path, np.uint16, mode="r")
  top = int(tokens.max())
  if top >= vocab_size:
    raise ValueError(f"token file {path} holds token id {top}, beyond the vocabulary of "
                     f"{vocab_size}")
  return tokens


def train_val_split(tokens: np.ndarray, val_fraction: float = 0.05):
  """The last `val_fraction` of the stream is held out for evaluation."""
  if not 0 < val_fraction < 1:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
  cut = int(len(tokens) * (1 - val_fraction))
  return tokens[:cut], tokens[cut:]


@dataclasses.dataclass(frozen=True)
class Batches:
  """Random windows of `seq_len + 1` tokens (inputs and shifted targets).

  Attributes:
    tokens: 1-D token ids.
    batch_size: windows per batch.
    seq_len: model context; each window holds seq_len + 1 tokens.
    seed: the stream of batches is a function of it alone.
  """
  tokens: np.ndarray
  batch_size: int
  seq_len: int
  seed: int = 0

  def __post_init__(self):
    if self.batch_size < 1 or self.seq_len < 1:
      raise ValueError(f"batch_size and seq_len must be >= 1, got {self.batch_size}, "
                       f"{self.seq_len}")
    if len(self.tokens) < self.seq_len + 1:
      raise ValueError(f"{len(self.tokens)} tokens are too few for windows of "
                       f"{self.seq_len + 1}")

  def __getitem__(self, step: int) -> np.ndarray:
    """Batch number `step`: int32 (batch_size, seq_len + 1)."""
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, len(self.tokens) - self.seq_len, self.batch_size)
    return np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], np.int32) for s in starts])


@dataclasses.dataclass(frozen=True)
class Data:
  """The run's token streams and batches.

  Attributes:
    n_tokens: tokens in the whole stream (training and held-out).
    vocab: vocabulary the data needs (256 for byte-level text).
    batch: batch(step) -> the training batch of that step (--batch-size
      sequences): {"tokens": int32 (B, seq_len + 1)}, with "loss_weight"
      float32 (B, seq_len) where only some targets carry the loss (see
      `loss_weight`).
    val: val(i) -> held-out batch i, the same form.
    val_tokens: the held-out stream (the sample's prompt comes from it).
    tokenizer: what turned text into the tokens (None: bytes).
  """
  n_tokens: int
  vocab: int
  batch: Callable[[int], dict]
  val: Callable[[int], dict]
  val_tokens: np.ndarray
  tokenizer: tokens_lib.Tokenizer | None = None


def tokenizer_folder(cfg: TrainConfig) -> str | None:
  """Where the run's tokenizer.json is: --tokenizer, else --init-from's if
  it has one; None: byte-level text.

  Raises:
    UserError: --tokenizer without a tokenizer.json.
  """
  if cfg.tokenizer:
    return cfg.tokenizer
  if cfg.init_from and (pathlib.Path(cfg.init_from) / "tokenizer.json").is_file():
    return cfg.init_from
  return None


def load_tokens(cfg: TrainConfig, model_vocab: int) -> tuple[np.ndarray, int]:
  """Token stream and vocabulary size for the chosen data (no tokenizer)."""
  if not cfg.data:
    return embedded_corpus(), BYTE_VOCAB
  if cfg.data.endswith(".bin"):
    vocab = cfg.vocab_size or model_vocab
    return read_tokens(cfg.data, vocab), vocab
  tables = [f for f in tokens_lib.data_files(cfg.data) if f.suffix in parquet.SUFFIXES]
  if cfg.data.endswith(".jsonl") or tables:
    form = {".parquet": "parquet", ".arrow": "Arrow"}[tables[0].suffix] if tables else "JSONL"
    raise ValueError(f"--data {cfg.data}: {form} data is read with a tokenizer: --init-from a "
                     "checkpoint that has one, or --tokenizer DIR")
  return read_text(cfg.data), BYTE_VOCAB


def loss_weight(mask: np.ndarray) -> np.ndarray:
  """float32 (B, T) weights of the targets of a whole batch: the 0/1 `mask`
  times positions / targets with the loss, so that the mean over positions
  of weight x loss, which the model takes on each device's micro-batch and
  the engine averages, is the mean loss over the targets with the loss of
  the whole batch (not a mean of micro-batch means: each answer token
  counts once, however the batch is split)."""
  return mask * np.float32(mask.size / max(1, np.count_nonzero(mask)))


def load_data(cfg: TrainConfig, model_vocab: int, cache_dir: pathlib.Path,
              progress: bool = True) -> Data:
  """Reads the data and holds out its end: with a tokenizer (see
  `tokenizer_folder`; refused before any work if it has more ids than
  `model_vocab`), tokenized once into `cache_dir`; else as bytes.
  `progress`: a progress bar while tokenizing."""
  folder = tokenizer_folder(cfg)
  try:
    if folder is not None:
      tokenizer = tokens_lib.load_tokenizer(folder)
      if tokenizer.vocab_size > model_vocab:
        raise ValueError(f"the tokenizer in {folder} has {tokenizer.vocab_size} ids, the model "
                         f"has a vocabulary of {model_vocab}")
      return _tokenized(cfg, tokenizer, cache_dir, progress)
    tokens, vocab = load_tokens(cfg, model_vocab)
    train_tokens, val_tokens = train_val_split(tokens)
    batches = Batches(train_tokens, cfg.batch_size, cfg.seq_len, cfg.seed)
    val = Batches(val_tokens, cfg.batch_size, cfg.seq_len, cfg.seed + 1)
  except ValueError as e:
    raise UserError(str(e)) from e
  as_batch = lambda batches: (lambda step: {"tokens": batches[step]})
  return Data(len(tokens), vocab, as_batch(batches), as_batch(val), val_tokens)


def _tokenized(cfg: TrainConfig, tokenizer: tokens_lib.Tokenizer, cache_dir: pathlib.Path,
               progress: bool) -> Data:
  """Data read with `tokenizer`."""
  if not cfg.data:
    raise ValueError("with a tokenizer (--init-from or --tokenizer) give the text to train on: "
                     "--data FILE or FOLDER (text, JSONL or parquet)")
  if cfg.data.endswith(".bin"):
    raise ValueError(f"--data {cfg.data} holds token ids already: a tokenizer reads text")
  stream = packing.tokenize_cached(cfg.data, tokenizer, cache_dir, progress=progress)
  train_rows, val_rows = packing.split_rows(len(stream.tokens), cfg.seq_len)

  def batches(rows: range, seed: int):
    packed = packing.PackedBatches(stream.tokens, stream.loss_mask, cfg.batch_size,
                                   cfg.seq_len, seed, rows)

    def batch(step: int) -> dict:
      drawn = packed[step]
      return {"tokens": drawn["tokens"], "loss_weight": loss_weight(drawn["loss_mask"])}
    return batch
  val_tokens = np.asarray(stream.tokens[val_rows.start * cfg.seq_len:], np.int32)
  return Data(len(stream.tokens), tokenizer.vocab_size, batches(train_rows, cfg.seed),
              batches(val_rows, cfg.seed + 1), val_tokens, tokenizer)

