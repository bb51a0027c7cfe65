"""The tokenizer of a run on bytes: a text's ids are its UTF-8 bytes, decoding
gives the text back, and the folder save_tokenizer writes reads back the same
in jzo (load_tokenizer) and in transformers (AutoTokenizer)."""

import random

import pytest
import transformers

from jzo.recipe import data, tokens


def _texts() -> list[str]:
  """Texts of every kind of character: ASCII with the spaces and punctuation
  transformers' clean-up would change, accents, CJK, emoji (4-byte UTF-8),
  controls, NUL, CRLF, and random code points (surrogates left out: no UTF-8)."""
  rng = random.Random(0)
  fixed = ["", "hello world", "  two  spaces ,then . ? ! 'quote' n't ", "tab\there\r\nnew\n\n",
           "h\u00e9llo na\u00efve \u00c5ngstr\u00f6m", "\u65e5\u672c\u8a9e\u306e\u6587",
           "\U0001f389 \U0001f1fa\U0001f1f8 \u200d", "\x00\x01\x7f\x80\u00ff", "<|endoftext|>"]
  def char(top):
    c = rng.randrange(top)
    return chr(c if not 0xD800 <= c < 0xE000 else c + 0x800)
  return fixed + ["".join(char(0x10F800 if k % 2 else 0x250) for _ in range(rng.randrange(1, 40)))
                  for k in range(200)]


@pytest.fixture(scope="module")
def tokenizer():
  return tokens.byte_level_tokenizer()


def test_ids_are_the_bytes(tokenizer):
  assert tokenizer.vocab_size == data.BYTE_VOCAB == 256
  assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos) == (None, None, False)
  assert tokenizer.special_ids == frozenset() and tokenizer.chat_template is None
  assert sorted(tokenizer.backend.get_vocab().values()) == list(range(256))
  for text in _texts():
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8")), text
    assert tokenizer.backend.decode(ids) == text


def test_any_bytes_decode_as_python_does(tokenizer):
  """Sampled ids need not be UTF-8: they decode as bytes.decode(errors="replace")."""
  rng = random.Random(1)
  for _ in range(300):
    ids = [rng.randrange(256) for _ in range(rng.randrange(1, 24))]
    assert tokenizer.backend.decode(ids) == bytes(ids).decode("utf-8", "replace"), ids


def test_saved_folder_reads_back_in_jzo_and_transformers(tokenizer, tmp_path):
  tokens.save_tokenizer(tokenizer, tmp_path)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
  again = tokens.load_tokenizer(tmp_path)
  assert again.fingerprint == tokenizer.fingerprint  # the same tokens in the data cache
  assert (again.vocab_size, again.bos_id, again.eos_id, again.add_bos) == (256, None, None, False)
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert isinstance(theirs, transformers.PreTrainedTokenizerFast)
  assert len(theirs) == 256 and theirs.bos_token is None and theirs.eos_token is None
  for text in _texts():
    ids = list(text.encode("utf-8"))
    assert again.encode(text) == ids
    assert theirs(text)["input_ids"] == ids, text
    assert theirs.decode(ids) == text
