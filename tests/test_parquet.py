"""Hugging Face data files (jzo.recipe.parquet): parquet files, Arrow IPC files and streams
and folders of shards give the tokens and loss masks their records give as JSONL lines;
bad columns, types and files are one line; a shard is read a slice at a time; the cache
keys on them; `python -m jzo.train` trains on one.

The tables are written here by pyarrow; the tokenizers are test_tokens.py's.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jzo import train
from jzo.recipe import packing, parquet, tokens
from test_tokens import CHATML, CHATS, LLAMA3, SPECIALS, TOOL_CHAT, save_tokenizer

PROMPTS = [{"prompt": "the quick brown fox ", "completion": "jumps over"},
           {"prompt": "and then? ", "completion": "it sleeps well"}]
TEXTS = [{"text": "hello there\n"}, {"text": ""}, {"text": "the lazy dog & <b>fox</b>"}]
# Messages with a field only some have: Arrow gives the others a null, JSONL no key.
CHAT_RECORDS = ([{"messages": c} for c in CHATS]
                + [{"messages": [{**TOOL_CHAT[0], "name": "ann"}, *TOOL_CHAT[1:]]}])


@pytest.fixture(scope="module")
def tokenizer_folders(tmp_path_factory) -> dict[str, pathlib.Path]:
  """test_tokens.py's BPE in a ChatML, a Llama 3 and a template-less checkpoint folder."""
  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  backend.train_from_iterator([m["content"] for c in CHATS for m in c] * 4, trainer)
  root = tmp_path_factory.mktemp("tokenizers")
  backend.save(str(root / "tokenizer.json"))
  return {
      "chatml": save_tokenizer(root / "chatml", root / "tokenizer.json",
                               {"eos_token": "<|endoftext|>"}, jinja=CHATML),
      "llama3": save_tokenizer(root / "llama3", root / "tokenizer.json", {
          "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3}),
      "plain": save_tokenizer(root / "plain", root / "tokenizer.json", {
          "bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}),
  }


def write_jsonl(path: pathlib.Path, records: list[dict]) -> pathlib.Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def write_table(path: pathlib.Path, table: pa.Table, **kw) -> pathlib.Path:
  """`table` as parquet, or as an Arrow IPC file (.arrow) or stream (.stream.arrow)."""
  if path.suffix == ".parquet":
    pq.write_table(table, path, **kw)
  else:
    writer = pa.ipc.new_stream if path.name.endswith(".stream.arrow") else pa.ipc.new_file
    with writer(path, table.schema) as out:
      out.write_table(table, max_chunksize=kw.get("row_group_size"))
  return path


def documents(files: list[pathlib.Path], tok: tokens.Tokenizer) -> list:
  return [d for d, _ in tokens.documents(files, tok) if d is not None]


def assert_same_documents(got: list, want: list) -> None:
  assert len(got) == len(want) > 0
  for (ids, mask), (want_ids, want_mask) in zip(got, want):
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(mask, want_mask)
    assert ids.dtype == want_ids.dtype and mask.dtype == want_mask.dtype


@pytest.mark.parametrize("name", ["chatml", "llama3", "plain"])
@pytest.mark.parametrize("kind", ["t.parquet", "t.arrow", "t.stream.arrow"])
def test_tables_give_what_their_records_give_as_jsonl(tokenizer_folders, tmp_path, name, kind):
  tok = tokens.load_tokenizer(tokenizer_folders[name])
  forms = [TEXTS, PROMPTS] + ([CHAT_RECORDS] if tok.template is not None else [])
  for i, records in enumerate(forms):
    # An id column beside them, as datasets have, is not read.
    table = pa.Table.from_pylist([{"id": k, **r} for k, r in enumerate(records)])
    path = write_table(tmp_path / f"{i}{kind}", table, row_group_size=2)
    want = documents([write_jsonl(tmp_path / f"{i}.jsonl", records)], tok)
    assert_same_documents(documents([path], tok), want)
  mask = documents([tmp_path / f"1{kind}"], tok)[0][1]
  assert 0 < mask.sum() < len(mask)  # the completion alone learned


def test_a_folder_of_shards(tokenizer_folders, tmp_path):
  """The shards in order, as one JSONL file of their rows; the README.md and the
  datasets library's JSON files beside them are not data; the bytes add up."""
  tok = tokens.load_tokenizer(tokenizer_folders["chatml"])
  records = CHAT_RECORDS + PROMPTS * 3
  folder = tmp_path / "dataset"
  (folder / "data").mkdir(parents=True)
  for name in ("README.md", "dataset_info.json", "state.json"):
    (folder / name).write_text("{}")
  shards = [write_table(folder / "data" / "train-00000-of-00002.parquet",
                        pa.Table.from_pylist(records[:3])),
            write_table(folder / "data" / "train-00001-of-00002.parquet",
                        pa.Table.from_pylist(records[3:]))]
  assert tokens.data_files(folder) == shards
  want = documents([write_jsonl(tmp_path / "all.jsonl", records)], tok)
  assert_same_documents(documents(tokens.data_files(folder), tok), want)
  assert sum(n for _, n in tokens.documents(shards, tok)) == sum(
      f.stat().st_size for f in shards)
  stream = packing.tokenize_cached(folder, tok, tmp_path / "cache", progress=False)
  np.testing.assert_array_equal(stream.tokens, np.concatenate([ids for ids, _ in want]))
  np.testing.assert_array_equal(stream.loss_mask, np.concatenate([m for _, m in want]))


@pytest.mark.parametrize("kind", ["big.parquet", "big.arrow", "big.stream.arrow"])
def test_a_large_shard_is_read_a_slice_at_a_time(tmp_path, kind):
  """40 MB of text in row groups (record batches) of 20,000 rows: Arrow memory held
  while reading stays far below the text's size, and every row comes, in order."""
  rng = np.random.default_rng(0)
  n, width = 100_000, 400
  letters = rng.integers(97, 123, (n, width), np.uint8)
  texts = [row.tobytes().decode() for row in letters]
  path = write_table(tmp_path / kind, pa.table({"text": texts}), row_group_size=20_000)
  del texts
  pool = pa.default_memory_pool()
  before, peak, rows, n_bytes = pool.bytes_allocated(), 0, 0, 0
  for record, size in parquet.records(path):
    if record is not None:
      assert record["text"].encode() == letters[rows].tobytes()
      rows += 1
    n_bytes += size
    peak = max(peak, pool.bytes_allocated() - before)
  assert rows == n and n_bytes == path.stat().st_size
  assert peak < n * width / 8, peak


def test_the_cache_keys_on_the_tables(tokenizer_folders, tmp_path):
  tok = tokens.load_tokenizer(tokenizer_folders["chatml"])
  path, cache = tmp_path / "data.parquet", tmp_path / "cache"
  write_table(path, pa.Table.from_pylist(PROMPTS))
  first = packing.tokenize_cached(path, tok, cache, progress=False)
  entries = set(cache.iterdir())
  assert packing.tokenize_cached(path, tok, cache, progress=False).n_documents == 2
  assert set(cache.iterdir()) == entries
  write_table(path, pa.Table.from_pylist(PROMPTS[:1]))
  changed = packing.tokenize_cached(path, tok, cache, progress=False)
  assert changed.n_documents == 1 and set(cache.iterdir()) != entries
  assert len(changed.tokens) < len(first.tokens)


MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@pytest.mark.parametrize("table,error", [
    (pa.table({"id": [1], "body": ["a"]}),
     " has columns id, body; jzo reads a text column, prompt and completion, or messages$"),
    (pa.table({"prompt": ["a"]}), " has columns prompt; jzo reads a text column"),
    (pa.table({"text": [1]}), ": column \"text\" is int64, not a string$"),
    (pa.table({"prompt": ["a"], "completion": [[1.5]]}),
     ": column \"completion\" is list<\\w+: double>, not a string$"),
    (pa.table({"messages": [["hi"]]}), ": column \"messages\" is list<\\w+: string>, not a "
                                       "list of {role, content} structs of strings$"),
    (pa.table({"messages": [[{"role": "user", "text": "hi"}]]}),
     ": column \"messages\" is list<\\w+: struct<role: string, text: string>>, not a list"),
    (pa.table({"text": ["a", None]}), ": row 1: \"text\" is null, not a string$"),
    (pa.table({"messages": [[{"role": "user", "content": "a"}],
                            [{"role": "bot", "content": "b"}]]}),
     ": row 1: message 0 has role 'bot', not one of"),
    (pa.table({"messages": pa.array([[{"role": "user", "content": None}]], MESSAGES)}),
     ": row 0: message 0's content is null, not a string$"),
    (pa.table({"messages": pa.array([None], MESSAGES)}),
     ": row 0: \"messages\" is not a non-empty list$"),
], ids=["no-form", "prompt-alone", "int-text", "list-completion", "string-messages",
        "no-content", "null-text", "bad-role", "null-content", "null-messages"])
def test_bad_tables_are_one_line_naming_the_file(tokenizer_folders, tmp_path, table, error):
  tok = tokens.load_tokenizer(tokenizer_folders["chatml"])
  for kind in ("bad.parquet", "bad.arrow"):
    path = write_table(tmp_path / kind, table)
    named = "data file " if "row" not in error else ""
    with pytest.raises(tokens.DataError, match=f"^{named}{re.escape(str(path))}{error}") as e:
      list(tokens.documents([path], tok))
    assert "\n" not in str(e.value)


def test_files_that_are_not_tables(tokenizer_folders, tmp_path):
  tok = tokens.load_tokenizer(tokenizer_folders["chatml"])
  for name, kind in (("x.parquet", "a parquet file"), ("x.arrow", "an Arrow IPC file or stream")):
    (tmp_path / name).write_text('{"text": "a JSONL line"}\n')
    with pytest.raises(tokens.DataError, match=f"^data file {tmp_path}/{name} is not {kind} "
                                               "pyarrow reads: .+$"):
      list(tokens.documents([tmp_path / name], tok))
  whole = write_table(tmp_path / "whole.stream.arrow", pa.Table.from_pylist(PROMPTS * 50),
                      row_group_size=10).read_bytes()
  (tmp_path / "cut.arrow").write_bytes(whole[:len(whole) // 2])
  with pytest.raises(tokens.DataError, match=f"^data file {tmp_path}/cut.arrow cannot be read: "):
    list(tokens.documents([tmp_path / "cut.arrow"], tok))


def test_without_pyarrow_one_line_says_how_to_install_it(tokenizer_folders, tmp_path,
                                                         monkeypatch):
  tok = tokens.load_tokenizer(tokenizer_folders["chatml"])
  path = write_table(tmp_path / "data.parquet", pa.Table.from_pylist(PROMPTS))
  for module in ("pyarrow", "pyarrow.parquet"):
    monkeypatch.setitem(sys.modules, module, None)  # an import of it fails, as uninstalled
  with pytest.raises(tokens.DataError, match=re.escape(
      f"data file {path}: reading parquet files needs pyarrow: pip install 'jzo[data]' (or pip "
      "install pyarrow)")):
    list(tokens.documents([path], tok))


@pytest.fixture(scope="module")
def checkpoint(tokenizer_folders, tmp_path_factory) -> pathlib.Path:
  """A tiny random Qwen2, saved by transformers, with the ChatML tokenizer."""
  import torch
  import transformers
  folder = tmp_path_factory.mktemp("qwen2-tiny")
  for f in tokenizer_folders["chatml"].iterdir():
    (folder / f.name).write_bytes(f.read_bytes())
  config = transformers.Qwen2Config(
      vocab_size=tokens.load_tokenizer(folder).vocab_size, hidden_size=32, intermediate_size=64,
      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
      max_position_embeddings=64)
  torch.manual_seed(0)
  transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
  return folder


def test_training_on_a_parquet_file_through_the_real_entry_point(checkpoint, tokenizer_folders,
                                                                 tmp_path):
  """`python -m jzo.train --init-from DIR --data FILE.parquet`: the run reads the tokens
  that the same records give as JSONL, and trains on them."""
  records = [{"messages": CHATS[i % 2]} for i in range(24)]
  path = write_table(tmp_path / "chats.parquet", pa.Table.from_pylist(records))
  tok = tokens.load_tokenizer(tokenizer_folders["chatml"])
  n_tokens = sum(len(ids) for ids, _ in documents(
      [write_jsonl(tmp_path / "chats.jsonl", records)], tok))
  done = subprocess.run(
      [sys.executable, "-m", "jzo.train", "--init-from", str(checkpoint),
       "--data", str(path), "--steps", "2", "--seq-len", "32", "--batch-size", "2",
       "--devices", "1", "--log-every", "1", "--eval-every", "2", "--eval-batches", "1",
       "--sample-tokens", "0", "--checkpoint-every", "0", "--out", str(tmp_path / "run")],
      capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-2000:]
  assert f", {n_tokens:,} tokens," in done.stdout
  lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [l["step"] for l in lines] == [1, 2] and all(np.isfinite(l["loss"]) for l in lines)


def test_parquet_without_a_tokenizer_is_one_line(tmp_path, capsys):
  folder = tmp_path / "shards"
  folder.mkdir()
  write_table(folder / "a.parquet", pa.Table.from_pylist(TEXTS))
  for data, form in ((folder, "parquet"), (folder / "a.parquet", "parquet"),
                     (write_table(tmp_path / "b.arrow", pa.Table.from_pylist(TEXTS)), "Arrow")):
    assert train.main(["--data", str(data), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --data {data}: {form} data is read with a tokenizer: --init-from a checkpoint "
        "that has one, or --tokenizer DIR")
  assert not (tmp_path / "out").exists()
