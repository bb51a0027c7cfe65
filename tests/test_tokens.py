"""The checkpoint tokenizer, the data formats with their loss masks, packing, the cache and
the batches (jzo.recipe.tokens, jzo.recipe.packing).

A tiny byte-level BPE is trained on the spot and saved with a ChatML-style and a
Llama-3-style chat template; transformers (a test dependency) renders the reference text.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jzo.recipe import packing, tokens

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Block tags on their own lines exercise trim_blocks and lstrip_blocks; tool results go
# through tojson (HTML left alone) and `continue`; a bad order through raise_exception.
CHATML = """{% for message in messages %}
  {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
  {% endif %}
  {% if message['role'] == 'tool' %}
<|im_start|>tool
{{ message['content'] | tojson }}<|im_end|>
    {% continue %}
  {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

LLAMA3 = """{% for message in messages %}
  {% if not loop.first and message['role'] == loop.previtem['role'] %}
    {{- raise_exception('roles must alternate') -}}
  {% endif %}
  {% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'
                   + message['content'] | trim + '<|eot_id|>' %}
  {% if loop.first %}
    {% set content = bos_token + content %}
  {% endif %}
  {{- content -}}
{% endfor %}
{% if add_generation_prompt %}
  {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{% endif %}"""

CHATS = [
    [{"role": "user", "content": "hello there"},
     {"role": "assistant", "content": "hello! how are you today?"}],
    [{"role": "system", "content": "be brief"},
     {"role": "user", "content": "the quick brown fox?"},
     {"role": "assistant", "content": "jumps over\n\nthe lazy dog."},
     {"role": "user", "content": "and then?"},
     {"role": "assistant", "content": "it sleeps <well> & long"}],
]
TOOL_CHAT = [{"role": "user", "content": "weather?"},
             {"role": "tool", "content": "<b>sunny</b> & 'warm'"},
             {"role": "assistant", "content": "sunny"}]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> pathlib.Path:
  """A byte-level BPE of ~400 ids with the ChatML and Llama 3 special tokens."""
  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  sentences = [m["content"] for chat in CHATS for m in chat] + ["assistant user system"]
  backend.train_from_iterator(sentences * 4, trainer)
  path = tmp_path_factory.mktemp("backend") / "tokenizer.json"
  backend.save(str(path))
  return path


def save_tokenizer(folder: pathlib.Path, tokenizer_json: pathlib.Path, config: dict,
                   jinja: str | None = None) -> pathlib.Path:
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  if jinja is not None:
    (folder / "chat_template.jinja").write_text(jinja)
  return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer_json) -> dict[str, pathlib.Path]:
  """Checkpoint folders: ChatML (template in chat_template.jinja, a base model's eos),
  Llama 3 (a list of named templates, AddedToken dicts) and one without a template."""
  root = tmp_path_factory.mktemp("checkpoints")
  return {
      "chatml": save_tokenizer(root / "chatml", tokenizer_json,
                               {"eos_token": "<|endoftext|>"}, jinja=CHATML),
      "llama3": save_tokenizer(root / "llama3", tokenizer_json, {
          "bos_token": {"content": "<|begin_of_text|>", "special": True},
          "eos_token": {"content": "<|eot_id|>", "special": True},
          "chat_template": [{"name": "tool_use", "template": "unused"},
                            {"name": "default", "template": LLAMA3}]}),
      "plain": save_tokenizer(root / "plain", tokenizer_json, {
          "bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}),
  }


def reference(folder: pathlib.Path, template: str, config: dict):
  return transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                              chat_template=template, **config)


@pytest.mark.parametrize("name,template,config", [
    ("chatml", CHATML, {"eos_token": "<|endoftext|>"}),
    ("llama3", LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
], ids=["chatml", "llama3"])
def test_rendering_matches_transformers(folders, name, template, config):
  tok = tokens.load_tokenizer(folders[name])
  ref = reference(folders[name], template, config)
  chats = CHATS + ([TOOL_CHAT] if name == "chatml" else [])
  for chat in chats:
    for prompt in (False, True):
      assert tok.render_chat(chat, add_generation_prompt=prompt) == ref.apply_chat_template(
          chat, tokenize=False, add_generation_prompt=prompt)
  assert "<b>sunny</b> & 'warm'" in tok.render_chat(TOOL_CHAT) if name == "chatml" else True


def test_tokenizer_fields(folders, tokenizer_json):
  llama, chatml, plain = (tokens.load_tokenizer(folders[n]) for n in ("llama3", "chatml", "plain"))
  backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
  assert llama.bos_id == backend.token_to_id("<|begin_of_text|>")
  assert llama.eos_id == backend.token_to_id("<|eot_id|>")
  assert llama.vocab_size == max(backend.get_vocab(True).values()) + 1
  assert not llama.add_bos  # tokenizer.json adds none, and the config says nothing
  assert chatml.bos_id is None and chatml.chat_template == CHATML
  assert plain.chat_template is None
  assert llama.encode("hello there") == backend.encode("hello there").ids
  assert len({llama.fingerprint, chatml.fingerprint, plain.fingerprint}) == 3


def test_missing_tokenizer_is_one_line(tmp_path):
  with pytest.raises(FileNotFoundError, match=f"^no tokenizer at {tmp_path}/tokenizer.json$"):
    tokens.load_tokenizer(tmp_path)


def write_jsonl(path: pathlib.Path, records: list) -> pathlib.Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def one_document(path: pathlib.Path, tok: tokens.Tokenizer):
  (doc, _), = [d for d in tokens.documents([path], tok) if d[0] is not None]
  return doc


def learned(doc, tok: tokens.Tokenizer) -> list[str]:
  """The decoded runs of consecutive tokens with the loss."""
  ids, mask = doc
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
  return [tok.backend.decode(ids[a:b].tolist(), skip_special_tokens=False)
          for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("name,end", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_chat_loss_is_the_answers_and_their_end(folders, tmp_path, name, end):
  tok = tokens.load_tokenizer(folders[name])
  for chat in CHATS:
    doc = one_document(write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}]), tok)
    answers = [m["content"] + end for m in chat if m["role"] == "assistant"]
    assert learned(doc, tok) == answers
    assert doc[0].dtype == np.uint32 and doc[1].dtype == np.uint8
    assert doc[0][-1] == tok.eos_id  # ChatML's base eos follows, Llama's <|eot_id|> is it
    rendered = tok.backend.decode(doc[0].tolist(), skip_special_tokens=False)
    assert rendered.startswith(tok.render_chat(chat))


@pytest.mark.parametrize("name,learned_text", [
    ("chatml", "jumps over<|im_end|>"), ("llama3", "jumps over<|eot_id|>"),
    ("plain", "jumps over<|endoftext|>")])
def test_prompt_completion_loss(folders, tmp_path, name, learned_text):
  tok = tokens.load_tokenizer(folders[name])
  path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "the quick brown fox ",
                                              "completion": "jumps over"}])
  doc = one_document(path, tok)
  assert learned(doc, tok) == [learned_text]
  if name == "plain":  # bos + prompt + completion + eos
    assert doc[0][0] == tok.bos_id and doc[0][-1] == tok.eos_id
    assert tok.backend.decode(doc[0][1:-1].tolist()) == "the quick brown fox jumps over"


def test_text_is_learned_everywhere(folders, tokenizer_json, tmp_path):
  tok = tokens.load_tokenizer(folders["plain"])
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "a.txt").write_text("hello there\n")
  write_jsonl(tmp_path / "data" / "b.jsonl", [{"text": "the lazy dog"}, {"text": "fox"}])
  docs = [d for d, _ in tokens.documents(tokens.data_files(tmp_path / "data"), tok)]
  assert [tok.backend.decode(ids.tolist()) for ids, _ in docs] == [
      "hello there\n", "the lazy dog", "fox"]
  for ids, mask in docs:
    assert ids[-1] == tok.eos_id and mask.all()  # add_bos is off: no bos, all learned
  with_bos = tokens.load_tokenizer(save_tokenizer(tmp_path / "bos", tokenizer_json, {
      "bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>", "add_bos_token": True}))
  ids, mask = one_document(tmp_path / "data" / "a.txt", with_bos)
  assert ids[0] == with_bos.bos_id and mask[0] == 0 and mask[1:].all()


@pytest.mark.parametrize("lines,error", [
    (['{"text": "a"}', '{"text": '], "invalid JSON"),
    (['{"input": "a", "output": "b"}'], "none of .*\\(its keys: 'input', 'output'\\)$"),
    (['{"messages": [{"role": "user"}]}'], "message 0 lacks \"role\" or \"content\""),
    (['{"messages": [{"role": "bot", "content": "a"}]}'], "message 0 has role 'bot'"),
    (['{"messages": [{"role": "user", "content": 3}]}'], "message 0's content is a int"),
    (['{"text": ["a"]}'], "\"text\" is a list, not a string"),
    (['{"prompt": "a", "completion": null}'], "\"completion\" is null, not a string"),
    (['["a"]'], "a list, not a JSON object"),
])
def test_bad_lines_are_one_line_naming_file_and_line(folders, tmp_path, lines, error):
  path = tmp_path / "bad.jsonl"
  path.write_text("\n".join(lines) + "\n")
  tok = tokens.load_tokenizer(folders["chatml"])
  with pytest.raises(tokens.DataError, match=f"^{path}:{len(lines)}: {error}") as e:
    list(tokens.documents([path], tok))
  assert "\n" not in str(e.value)


def test_chat_refusals_are_one_line(folders, tmp_path):
  path = write_jsonl(tmp_path / "chat.jsonl", [{"text": "a"}, {"messages": CHATS[0]}])
  with pytest.raises(tokens.DataError, match=f"^{path}:2: chat data, but the tokenizer has "
                                             "no chat template$"):
    list(tokens.documents([path], tokens.load_tokenizer(folders["plain"])))
  path = write_jsonl(tmp_path / "order.jsonl", [{"messages": CHATS[0][:1] * 2}])
  with pytest.raises(tokens.DataError, match=f"^{path}:1: the chat template refuses it: "
                                             "roles must alternate"):
    list(tokens.documents([path], tokens.load_tokenizer(folders["llama3"])))


def test_empty_and_binary_data(folders, tmp_path):
  tok = tokens.load_tokenizer(folders["chatml"])
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "blank.jsonl").write_text("\n\n")
  with pytest.raises(tokens.DataError, match="holds no documents$"):
    packing.tokenize_cached(tmp_path / "empty", tok, tmp_path / "cache", progress=False)
  path = write_jsonl(tmp_path / "user.jsonl", [{"messages": CHATS[0][:1]}])
  with pytest.raises(tokens.DataError, match="no token carries the loss"):
    packing.tokenize_cached(path, tok, tmp_path / "cache", progress=False)
  (tmp_path / "x.bin").write_bytes(b"ab\0c")
  with pytest.raises(tokens.DataError, match=f"^{tmp_path}/x.bin: binary data"):
    list(tokens.documents([tmp_path / "x.bin"], tok))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    tokens.data_files(tmp_path / "nowhere")


def cache_entries(cache: pathlib.Path) -> dict[str, int]:
  """The cache's complete entries: each one's name and when its meta.json
  (written last, once the entry is whole) was written (ns)."""
  return {p.name: (p / "meta.json").stat().st_mtime_ns for p in cache.iterdir()
          if (p / "meta.json").is_file()}


def test_cache_is_reused_and_rebuilt(folders, tmp_path):
  """An entry is written once and read after; a change of the data or the
  tokenizer writes a new one in the old one's place, as does an entry
  that lost its meta.json (killed before the rename)."""
  tok, cache = tokens.load_tokenizer(folders["chatml"]), tmp_path / "cache"
  data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
  first = packing.tokenize_cached(data, tok, cache, progress=False)
  written = cache_entries(cache)
  again = packing.tokenize_cached(data, tok, cache, progress=False)
  assert cache_entries(cache) == written and len(written) == 1 and first.n_documents == 2
  assert isinstance(again.tokens, np.memmap) and again.tokens.dtype == np.uint32
  assert again.loss_mask.dtype == np.uint8
  np.testing.assert_array_equal(first.tokens, np.concatenate([
      d[0] for d, _ in tokens.documents([data], tok)]))
  write_jsonl(data, [{"messages": CHATS[1]}])
  changed = packing.tokenize_cached(data, tok, cache, progress=False)
  rewritten = cache_entries(cache)
  assert changed.n_documents == 1 and len(rewritten) == 1 and rewritten.keys() != written.keys()
  assert len(list(cache.iterdir())) == 1  # the old entry is gone
  (cache / next(iter(rewritten)) / "meta.json").unlink()  # as if killed before the rename
  assert cache_entries(cache) == {}
  packing.tokenize_cached(data, tok, cache, progress=False)
  assert cache_entries(cache).keys() == rewritten.keys()  # written again
  packing.tokenize_cached(data, tokens.load_tokenizer(folders["llama3"]), cache, progress=False)
  assert len(cache_entries(cache)) == 1 and cache_entries(cache).keys() != rewritten.keys()


def test_data_files_sorted_recursively_without_hidden(tmp_path):
  for name in ("b/z.txt", "a.jsonl", "b/a.txt", ".git/x", "b/.hidden.txt"):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text("x")
  assert tokens.data_files(tmp_path) == [tmp_path / n for n in ("a.jsonl", "b/a.txt", "b/z.txt")]
  assert tokens.data_files(tmp_path / "a.jsonl") == [tmp_path / "a.jsonl"]


def stream(n: int) -> tuple[np.ndarray, np.ndarray]:
  return np.arange(n, dtype=np.uint32), (np.arange(n) % 3 == 0).astype(np.uint8)


def test_split_rows():
  assert packing.split_rows(4 * 100 + 1, 4) == (range(95), range(95, 100))
  assert packing.split_rows(4 * 3 + 1, 4) == (range(2), range(2, 3))  # at least one held out
  with pytest.raises(tokens.DataError, match="too few for two rows"):
    packing.split_rows(8, 4)


def test_batches_shapes_determinism_and_epochs():
  ids, mask = stream(4 * 10 + 1)
  train, _ = packing.split_rows(len(ids), 4)
  batches = packing.PackedBatches(ids, mask, batch_size=3, seq_len=4, seed=7, rows=train)
  batch = batches[5]
  assert batch["tokens"].shape == (3, 5) and batch["tokens"].dtype == np.int32
  assert batch["loss_mask"].shape == (3, 4) and batch["loss_mask"].dtype == np.float32
  np.testing.assert_array_equal(batch["loss_mask"], mask[batch["tokens"][:, 1:]])
  np.testing.assert_array_equal(batch["tokens"][:, 1:], batch["tokens"][:, :-1] + 1)
  resumed = packing.PackedBatches(ids, mask, batch_size=3, seq_len=4, seed=7, rows=train)
  for step in range(6):
    np.testing.assert_array_equal(resumed[step]["tokens"], batches[step]["tokens"])
  # 9 rows in batches of 3: every 3 steps cover each row once, in a new order each epoch.
  epochs = [np.concatenate([batches[s]["tokens"][:, 0] // 4 for s in range(e, e + 3)])
            for e in (0, 3)]
  for rows in epochs:
    assert sorted(rows) == list(range(9))
  assert not np.array_equal(epochs[0], epochs[1])
  other = packing.PackedBatches(ids, mask, batch_size=3, seq_len=4, seed=8, rows=train)
  assert not np.array_equal(other[0]["tokens"], batches[0]["tokens"])
  assert batches.loss_tokens == int(mask[1:37].sum())
