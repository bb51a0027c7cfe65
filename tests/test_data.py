"""Token sources and deterministic batches."""

import socket

import numpy as np
import pytest

from jzo.recipe import data


def test_embedded_corpus_is_python_source():
  corpus = data.embedded_corpus()
  assert corpus.dtype == np.uint8 and corpus.size > 100_000
  assert b"def " in corpus[:200_000].tobytes()
  np.testing.assert_array_equal(corpus, data.embedded_corpus())  # same every time


def test_text_file_and_folder(tmp_path):
  (tmp_path / "b.txt").write_bytes(b"world")
  (tmp_path / "a.txt").write_bytes(b"hello ")
  assert data.read_text(tmp_path).tobytes() == b"hello world"  # sorted by name
  assert data.read_text(tmp_path / "b.txt").tobytes() == b"world"
  with pytest.raises(FileNotFoundError, match="does not exist"):
    data.read_text(tmp_path / "missing.txt")
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "e.txt").write_bytes(b"")
  with pytest.raises(ValueError, match="holds no bytes"):
    data.read_text(tmp_path / "empty")


def test_binary_and_unreadable_text(tmp_path):
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "a.txt").write_bytes(b"text")
  (tmp_path / "run" / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
  with pytest.raises(ValueError, match=r"data file \S+/run/loss.png is binary \(a NUL byte at "
                                       r"offset 8\): --data takes text, or token ids in a .bin"):
    data.read_text(tmp_path / "run")
  # A socket: a path that exists but no one, root included, can open for reading.
  with socket.socket(socket.AF_UNIX) as server:
    server.bind(str(tmp_path / "socket.txt"))
    with pytest.raises(OSError, match=r"^data file \S+/socket.txt cannot be read: No such device"):
      data.read_text(tmp_path / "socket.txt")


def test_token_file(tmp_path):
  path = tmp_path / "train.bin"
  np.array([1, 5, 300, 2], np.uint16).tofile(path)
  np.testing.assert_array_equal(data.read_tokens(path, vocab_size=512), [1, 5, 300, 2])
  with pytest.raises(ValueError, match="token id 300, beyond the vocabulary of 256"):
    data.read_tokens(path, vocab_size=256)
  (tmp_path / "odd.bin").write_bytes(b"abc")
  with pytest.raises(ValueError, match="not a non-empty array of uint16"):
    data.read_tokens(tmp_path / "odd.bin", vocab_size=256)
  with pytest.raises(FileNotFoundError, match="token file .+ does not exist"):
    data.read_tokens(tmp_path / "none.bin", vocab_size=256)
  (tmp_path / "empty.bin").write_bytes(b"")
  with pytest.raises(ValueError, match="has 0 bytes: not a non-empty array of uint16"):
    data.read_tokens(tmp_path / "empty.bin", vocab_size=256)
  (tmp_path / "folder.bin").mkdir()
  with pytest.raises(ValueError, match="token file .+/folder.bin is not a file"):
    data.read_tokens(tmp_path / "folder.bin", vocab_size=256)


def test_batches_are_a_function_of_seed_and_step():
  tokens = np.arange(1000, dtype=np.uint16)
  batches = data.Batches(tokens, batch_size=4, seq_len=16, seed=3)
  b = batches[7]
  assert b.shape == (4, 17) and b.dtype == np.int32
  np.testing.assert_array_equal(b[:, 1:], b[:, :-1] + 1)  # contiguous windows
  np.testing.assert_array_equal(b, data.Batches(tokens, 4, 16, seed=3)[7])
  assert not np.array_equal(b, batches[8])
  assert not np.array_equal(b, data.Batches(tokens, 4, 16, seed=4)[7])
  with pytest.raises(ValueError, match="too few"):
    data.Batches(tokens[:10], batch_size=1, seq_len=16)


def test_train_val_split():
  train, val = data.train_val_split(np.arange(100), 0.1)
  assert len(train) == 90 and len(val) == 10 and val[0] == 90
  with pytest.raises(ValueError, match="val_fraction"):
    data.train_val_split(np.arange(100), 1.5)
