"""A checkpoint's own tokenizer and chat template, and the documents of a
data path as token ids with a loss mask.

`load_tokenizer(folder)` reads tokenizer.json through the `tokenizers`
library and tokenizer_config.json (or chat_template.jinja) for the chat
template and the special tokens; the template renders with jinja2 the way
transformers' `apply_chat_template` does, so the text is the one the model
meets at inference. `byte_level_tokenizer()` is the tokenizer of a run on
bytes (ids 0-255), which `save_tokenizer` writes beside an export.

`documents(path, tokenizer)` yields each document of a text file, a folder,
a JSONL file or a parquet or Arrow file (jzo.recipe.parquet: a row a record,
as a JSONL line) as (ids uint32, mask uint8): text is learned everywhere,
prompt/completion and chat data only on the answers and the token that ends
them. jzo.recipe.packing packs, caches and batches them.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import pathlib
from typing import Iterator

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import tokenizers

from jzo.recipe import parquet

# Roles a chat message may have: the common ones of chat templates (OpenAI's, Llama 3.1's
# "ipython"); another is more likely a typo than a role the template knows.
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "ipython"})


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
  """What the recipe needs of a checkpoint's tokenizer.

  Attributes:
    backend: the `tokenizers.Tokenizer` of tokenizer.json.
    chat_template: jinja2 source of the chat template, or None.
    bos_token, eos_token: their text, or None where the checkpoint has none.
    bos_id, eos_id: their ids, or None.
    add_bos: whether a plain document starts with bos (add_bos_token, else
      whatever tokenizer.json's post-processor does).
    vocab_size: largest id + 1, added tokens included: rows the embedding needs.
    special_ids: ids of the added tokens marked special (<|im_end|>, <|eot_id|>, ...).
    fingerprint: sha256 (hex) of everything above that changes the tokens.
    special_tokens: bos_token, eos_token, unk_token, pad_token as the config names them:
      the variables the template sees, as transformers passes them.
    template: the compiled chat template, or None.
  """
  backend: tokenizers.Tokenizer
  chat_template: str | None
  bos_token: str | None
  eos_token: str | None
  bos_id: int | None
  eos_id: int | None
  add_bos: bool
  vocab_size: int
  special_ids: frozenset[int]
  fingerprint: str
  special_tokens: dict = dataclasses.field(default_factory=dict, repr=False)
  template: jinja2.Template | None = dataclasses.field(default=None, repr=False, compare=False)

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without the special tokens the post-processor adds."""
    return self.backend.encode(text, add_special_tokens=False).ids

  def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of `text` and each token's [start, end) in characters of it."""
    encoding = self.backend.encode(text, add_special_tokens=False)
    return encoding.ids, encoding.offsets

  def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages`, as transformers' apply_chat_template(...,
    tokenize=False) writes it.

    Raises:
      ValueError: the tokenizer has no chat template.
      jinja2.TemplateError: the template refuses the messages (raise_exception).
    """
    if self.template is None:
      raise ValueError("the tokenizer has no chat template")
    return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                tools=None, documents=None, **self.special_tokens)


def load_tokenizer(folder: str | pathlib.Path) -> Tokenizer:
  """The tokenizer saved in a checkpoint folder (tokenizer.json, tokenizer_config.json,
  optionally chat_template.jinja).

  Raises:
    FileNotFoundError: no tokenizer.json in `folder`.
    ValueError: tokenizer_config.json is not JSON, or its chat template does not compile.
  """
  folder = pathlib.Path(folder)
  path = folder / "tokenizer.json"
  if not path.is_file():
    raise FileNotFoundError(f"no tokenizer at {path}")
  backend = tokenizers.Tokenizer.from_file(str(path))
  config = _read_config(folder / "tokenizer_config.json")
  return _tokenizer(backend, path.read_bytes(), config, _chat_template(folder, config), folder)


def _tokenizer(backend: tokenizers.Tokenizer, raw: bytes, config: dict, template: str | None,
               folder: pathlib.Path | None) -> Tokenizer:
  """The Tokenizer of a backend, its tokenizer.json `raw`, its tokenizer_config.json and
  chat template (`folder`: where they are, for the template's errors)."""
  specials = {name: text for name in ("bos_token", "eos_token", "unk_token", "pad_token")
              if (text := _token_text(config.get(name))) is not None}
  bos, eos = specials.get("bos_token"), specials.get("eos_token")
  bos_id = backend.token_to_id(bos) if bos else None
  eos_id = backend.token_to_id(eos) if eos else None
  add_bos = config.get("add_bos_token")
  if add_bos is None:
    # Llama 3's tokenizer.json adds bos in its post-processor and says so nowhere else.
    add_bos = bos_id is not None and backend.encode("a").ids[:1] == [bos_id]
  add_bos = bool(add_bos) and bos_id is not None
  return Tokenizer(
      backend=backend, chat_template=template, bos_token=bos, eos_token=eos, bos_id=bos_id,
      eos_id=eos_id, add_bos=add_bos,
      vocab_size=max(backend.get_vocab(with_added_tokens=True).values()) + 1,
      special_ids=frozenset(t["id"] for t in json.loads(raw).get("added_tokens", [])
                            if t.get("special")),
      fingerprint=hashlib.sha256(raw + json.dumps(
          [template, specials, add_bos], sort_keys=True).encode()).hexdigest(),
      special_tokens=specials, template=_compile(template, folder) if template else None)


def byte_level_tokenizer() -> Tokenizer:
  """The tokenizer of a run on bytes (no --tokenizer: jzo.recipe.data.BYTE_VOCAB): a text's
  ids are its UTF-8 bytes, 0-255, and decoding ids gives their bytes back as text (a sequence
  that is not UTF-8 as U+FFFD, as bytes.decode(errors="replace")). No special tokens.

  GPT-2's byte-level tokenizer without its merges: each byte is the character GPT-2's
  byte-to-unicode map gives it, not split on words nor given a leading space.
  """
  vocab = {char: byte for byte, char in enumerate(_byte_characters())}
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                              use_regex=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  return _tokenizer(backend, backend.to_str().encode(), {}, None, None)


def _byte_characters() -> list[str]:
  """The character GPT-2's byte-level map gives each byte 0-255: itself where it is printable
  and not a space, else 256 + its rank among the others."""
  kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  others = [b for b in range(256) if b not in kept]
  return [chr(b) if b in kept else chr(256 + others.index(b)) for b in range(256)]


def save_tokenizer(tokenizer: Tokenizer, folder: str | pathlib.Path) -> None:
  """Writes tokenizer.json and tokenizer_config.json into `folder` (which exists), which
  `load_tokenizer` and transformers' AutoTokenizer (PreTrainedTokenizerFast) read back with
  the same ids, special tokens and chat template; decoding leaves spaces as they are.
  Meant for the tokenizers jzo builds (`byte_level_tokenizer`): a checkpoint's own is
  better copied with its files, which may say more (a slow tokenizer's, generation's)."""
  folder = pathlib.Path(folder)
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            **tokenizer.special_tokens}
  if tokenizer.bos_id is not None:
    config["add_bos_token"] = tokenizer.add_bos
  if tokenizer.chat_template is not None:
    config["chat_template"] = tokenizer.chat_template
  (folder / "tokenizer.json").write_text(tokenizer.backend.to_str(), encoding="utf-8")
  (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                                encoding="utf-8")


def _read_config(path: pathlib.Path) -> dict:
  """tokenizer_config.json as a dict; {} where there is none."""
  if not path.is_file():
    return {}
  try:
    return json.loads(path.read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not JSON: {e}") from None


def _token_text(value) -> str | None:
  """A special token as the config writes it: a string or an AddedToken dict."""
  return value.get("content") if isinstance(value, dict) else value


def _chat_template(folder: pathlib.Path, config: dict) -> str | None:
  """The template's source: chat_template.jinja (newer transformers save it there), else
  the config's chat_template, a string or a list of named ones (the "default")."""
  jinja_file = folder / "chat_template.jinja"
  if jinja_file.is_file():
    return jinja_file.read_text(encoding="utf-8")
  template = config.get("chat_template")
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template}
    return named.get("default")
  return template


def _compile(source: str, folder: pathlib.Path) -> jinja2.Template:
  """The template in transformers' environment: sandboxed, blocks trimmed, loop controls,
  `raise_exception`, `strftime_now` and a `tojson` that leaves HTML alone."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"the chat template of {folder} does not compile: line {e.lineno}: "
                     f"{e.message}") from None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  """jinja2's tojson escapes <, > and & for HTML, which would change the prompt."""
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _raise_exception(message: str):
  raise jinja2.TemplateError(message)


class DataError(ValueError):
  """A data file the recipe cannot train on; the message is one line naming it."""


def data_files(path: str | pathlib.Path) -> list[pathlib.Path]:
  """`path` itself, or the files under it sorted (recursively), hidden ones left out; of a
  folder that holds .parquet or .arrow files (a Hugging Face dataset, whose README.md,
  dataset_info.json and state.json describe it), those alone.

  Raises:
    FileNotFoundError: `path` does not exist.
  """
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"data path {path} does not exist")
  if not path.is_dir():
    return [path]
  files = sorted(p for p in path.rglob("*") if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts))
  return [p for p in files if p.suffix in parquet.SUFFIXES] or files


Document = tuple[np.ndarray, np.ndarray]  # ids uint32 (n,), loss mask uint8 (n,)


def documents(files: list[pathlib.Path],
              tokenizer: Tokenizer) -> Iterator[tuple[Document | None, int]]:
  """Every document of `files` with the bytes of the file it took (for a progress bar);
  None for a blank line or an empty file.

  A .jsonl file holds a document a line, a .parquet or .arrow file a document a row (its
  records as a JSONL line's); any other file is one text document.

  Raises:
    DataError: one line naming the file (and line or row) that cannot be used.
  """
  for f in files:
    if f.suffix in parquet.SUFFIXES:
      yield from _table_documents(f, tokenizer)
      continue
    data = f.read_bytes()
    if f.suffix == ".jsonl":
      for number, line in enumerate(data.splitlines(keepends=True), 1):
        if line.strip():
          yield _json_document(line, tokenizer, f"{f}:{number}"), len(line)
        else:
          yield None, len(line)
    else:
      yield (_text_document(_decode(data, str(f)), tokenizer) if data else None), len(data)


def _table_documents(path: pathlib.Path,
                     tokenizer: Tokenizer) -> Iterator[tuple[Document | None, int]]:
  """The rows of a parquet or Arrow file as documents; row i (from 0, as `datasets`
  indexes it) is named "FILE: row i" in errors."""
  try:
    for i, (record, n_bytes) in enumerate(parquet.records(path)):
      yield (None if record is None
             else _record_document(record, tokenizer, f"{path}: row {i}")), n_bytes
  except parquet.TableError as e:
    raise DataError(str(e)) from None


def _decode(data: bytes, where: str) -> str:
  """UTF-8 text; a NUL byte means a binary file (an image, a token .bin), which no text holds."""
  if (nul := data.find(0)) >= 0:
    raise DataError(f"{where}: binary data (a NUL byte at offset {nul}), not text")
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{where}: not UTF-8 text (byte offset {e.start})") from None


def _text_document(text: str, tokenizer: Tokenizer) -> Document:
  """bos (where the tokenizer adds one) + text + eos, learned everywhere but the bos: nothing
  predicts the start of a document."""
  ids = tokenizer.encode(text)
  head = [tokenizer.bos_id] if tokenizer.add_bos else []
  tail = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
  mask = [0] * len(head) + [1] * (len(ids) + len(tail))
  return np.array(head + ids + tail, np.uint32), np.array(mask, np.uint8)


def _json_document(line: bytes, tokenizer: Tokenizer, where: str) -> Document:
  """One JSONL line: {"text"}, {"prompt", "completion"} or {"messages"}."""
  try:
    record = json.loads(line)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise DataError(f"{where}: invalid JSON ({e})") from None
  if not isinstance(record, dict):
    raise DataError(f"{where}: a {type(record).__name__}, not a JSON object")
  return _record_document(record, tokenizer, where)


def _record_document(record: dict, tokenizer: Tokenizer, where: str) -> Document:
  """A record of a JSONL line or a table's row, by the first of its keys' forms."""
  if "messages" in record:
    return _chat_document(_messages(record["messages"], where), tokenizer, where)
  if "prompt" in record and "completion" in record:
    prompt, completion = _string(record, "prompt", where), _string(record, "completion", where)
    if tokenizer.template is not None:
      turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
      return _chat_document(turns, tokenizer, where)
    return _completion_document(prompt, completion, tokenizer)
  if "text" in record:
    return _text_document(_string(record, "text", where), tokenizer)
  raise DataError(f"{where}: none of \"text\", \"prompt\"+\"completion\" or \"messages\" "
                  f"(its keys: {', '.join(map(repr, record)) or 'none'})")


def _string(record: dict, key: str, where: str) -> str:
  if not isinstance(record[key], str):
    raise DataError(f"{where}: \"{key}\" is {_kind(record[key])}, not a string")
  return record[key]


def _kind(value) -> str:
  """What a value is, in an error: "null" (JSON's, and a table's empty cell) or "a list"."""
  return "null" if value is None else f"a {type(value).__name__}"


def _messages(messages, where: str) -> list[dict]:
  """The messages checked: a non-empty list of {"role": known role, "content": str}."""
  if not isinstance(messages, list) or not messages:
    raise DataError(f"{where}: \"messages\" is not a non-empty list")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
      raise DataError(f"{where}: message {i} lacks \"role\" or \"content\"")
    if m["role"] not in ROLES:
      raise DataError(f"{where}: message {i} has role {m['role']!r}, not one of "
                      f"{', '.join(sorted(ROLES))}")
    if not isinstance(m["content"], str):
      raise DataError(f"{where}: message {i}'s content is {_kind(m['content'])}, not a string")
  return messages


def _completion_document(prompt: str, completion: str, tokenizer: Tokenizer) -> Document:
  """bos + prompt + completion + eos, learned on the completion and the eos.

  The two are tokenized as one text, so the boundary tokenizes as at inference.
  """
  text = prompt + completion
  ids, offsets = tokenizer.encode_offsets(text)
  mask = _mark(offsets, [(len(prompt), len(text))])
  head = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
  tail = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
  return (np.array(head + ids + tail, np.uint32),
          np.concatenate([np.zeros(len(head), np.uint8), mask, np.ones(len(tail), np.uint8)]))


def _chat_document(messages: list[dict], tokenizer: Tokenizer, where: str) -> Document:
  """The rendered conversation, learned on each assistant turn and its end-of-turn token.

  An assistant turn's text starts where the conversation before it, rendered with the
  generation prompt, ends, and ends where the conversation through it ends; what the
  template writes after the turn's last special token (ChatML's newline) stays out.
  eos follows, without the loss, where the conversation does not end with it.
  """
  if tokenizer.template is None:
    raise DataError(f"{where}: chat data, but the tokenizer has no chat template")
  try:
    text = tokenizer.render_chat(messages)
    spans = [_turn_span(messages, i, text, tokenizer, where)
             for i, m in enumerate(messages) if m["role"] == "assistant"]
  except jinja2.TemplateError as e:
    raise DataError(f"{where}: the chat template refuses it: {e}") from None
  ids, offsets = tokenizer.encode_offsets(text)
  mask = _mark(offsets, spans)
  for start, end in spans:
    _drop_after_end_of_turn(ids, offsets, mask, text, start, end, tokenizer.special_ids)
  if tokenizer.eos_id is not None and _last_word(ids, offsets, text) != tokenizer.eos_id:
    ids, mask = ids + [tokenizer.eos_id], np.append(mask, np.uint8(0))
  return np.array(ids, np.uint32), mask


def _turn_span(messages: list[dict], i: int, text: str, tokenizer: Tokenizer,
               where: str) -> tuple[int, int]:
  """[start, end) in characters of `text` of assistant message `i`, header excluded."""
  before = tokenizer.render_chat(messages[:i], add_generation_prompt=True)
  through = tokenizer.render_chat(messages[:i + 1])
  if not (text.startswith(before) and text.startswith(through)):
    raise DataError(f"{where}: the chat template renders a conversation's start differently "
                    "from the whole, so its answers cannot be found")
  return len(before), len(through)


def _mark(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
  """uint8 mask of the tokens that overlap a span; a token with empty offsets (whitespace
  that a post-processor trimmed) counts as covering its start."""
  starts = np.array([s for s, _ in offsets], np.int64).reshape(-1)
  ends = np.maximum(np.array([e for _, e in offsets], np.int64).reshape(-1), starts + 1)
  mask = np.zeros(len(offsets), bool)
  for a, b in spans:
    mask |= (starts < b) & (ends > a)
  return mask.astype(np.uint8)


def _drop_after_end_of_turn(ids, offsets, mask, text, start, end, special_ids) -> None:
  """Takes out of the turn's loss the whitespace after its last special token (the newline
  ChatML writes after <|im_end|>): the template's layout, not the model's answer."""
  inside = [k for k, (s, _) in enumerate(offsets) if mask[k] and start <= s < end]
  specials = [k for k in inside if ids[k] in special_ids]
  if specials:
    for k in inside:
      if k > specials[-1] and not text[offsets[k][0]:offsets[k][1]].strip():
        mask[k] = 0


def _last_word(ids: list[int], offsets, text: str) -> int | None:
  """The id of the last token that is not whitespace."""
  for k in range(len(ids) - 1, -1, -1):
    if text[offsets[k][0]:offsets[k][1]].strip():
      return ids[k]
  return None
