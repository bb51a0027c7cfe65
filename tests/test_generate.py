"""Generation with a KV cache (jzo.models.decoding) and `python -m jzo.generate`:
greedy tokens against transformers' `generate(do_sample=False)` on tiny random
Llama, Mistral, Qwen2, Qwen3 and GPT-2 models made here, the cache's logits
against the whole sequence's, sampling's distribution, and the command line as
users call it (a Hugging Face folder, a training run, chat, batches, errors)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jzo import train
from jzo.models import decoding, gpt, gpt2_hf, hf, llama
from jzo.recipe import generate as generate_cli

from test_finetune import save_tokenizer
from test_hf import _SHAPE, FAMILIES

# float32 matmuls as they are written, on a GPU too: greedy choices compared
# with transformers' float32 must not move by TF32 rounding.
HIGHEST = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest")
PROMPTS = [[5, 17, 3, 44, 9], list(range(1, 12)), [60]]


@pytest.fixture(autouse=True)
def highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def _greedy(model, prompt: list[int], n: int, eos=None) -> list[int]:
  """transformers' greedy continuation of `prompt` (n new tokens at most)."""
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                         eos_token_id=eos, pad_token_id=0)
  new = out[0, len(prompt):].tolist()
  return new[:-1] if eos is not None and new and new[-1] in eos else new


@pytest.fixture(scope="module", params=[*FAMILIES, "gpt2"])
def model(request, tmp_path_factory):
  """(jzo config, float32 params, transformers' model of the same weights)."""
  family = request.param
  folder = tmp_path_factory.mktemp(family)
  torch.manual_seed(0)
  if family == "gpt2":  # jzo's GPT, exported to transformers' GPT-2
    config = gpt.GPTConfig(vocab_size=96, seq_len=64, n_layer=2, n_head=4, d_model=64)
    params = gpt.init_params(config, jax.random.key(0))
    gpt2_hf.save_pretrained(str(folder), config, params)
    return config, params, transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
  config_class, model_class, features = FAMILIES[family]
  model_class(config_class(**_SHAPE, **features)).save_pretrained(folder)
  config, sources = hf.param_sources(str(folder))
  params = jax.tree.map(lambda leaf: leaf.load().astype(np.float32), sources)
  return config, params, transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def test_greedy_tokens_equal_transformers(model):
  config, params, theirs = model
  ours = decoding.generate(config, params, PROMPTS, 24)  # one batch, prompts of three lengths
  assert ours == [_greedy(theirs, prompt, 24) for prompt in PROMPTS]


def test_the_caches_logits_equal_the_whole_sequences(model):
  config, params, _ = model
  family = decoding.FAMILIES[type(config)]
  tokens = np.random.default_rng(1).integers(0, config.vocab_size, (2, 20), np.int32)
  whole = np.asarray(family.forward(config, params, tokens))  # (2, 20, V)
  lengths = np.array([7, 12])
  cache = family.init_cache(config, 2, 32, jnp.float32)
  prompts = np.where(np.arange(16) < lengths[:, None], tokens[:, :16], 0)  # right-padded
  logits, cache = family.prefill(config, params, prompts, lengths - 1, cache)
  np.testing.assert_allclose(logits, whole[[0, 1], lengths - 1], rtol=1e-4, atol=1e-4)
  for step in range(6):  # each row goes on with its own next tokens
    positions = lengths + step
    logits, cache = family.decode(config, params, tokens[[0, 1], positions], positions, cache)
    np.testing.assert_allclose(logits, whole[[0, 1], positions], rtol=1e-4, atol=1e-4)


def test_stop_tokens_end_each_row_on_its_own(model):
  config, params, _ = model
  full = decoding.generate(config, params, PROMPTS, 12)
  stop = full[0][4]
  cut = decoding.generate(config, params, PROMPTS, 12, stop_ids=[stop])
  for whole, ended in zip(full, cut):
    assert ended == (whole[:whole.index(stop)] if stop in whole else whole)


def test_sampling_is_reproduced_by_its_seed(model):
  config, params, _ = model
  sample = lambda **kw: decoding.generate(config, params, PROMPTS[:1], 16,
                                          decoding.Sampling(**kw))[0]
  assert sample(temperature=1.0, seed=3) == sample(temperature=1.0, seed=3)
  assert sample(temperature=1.0, seed=3) != sample(temperature=1.0, seed=4)
  greedy = sample()
  assert sample(temperature=1.5, top_k=1, seed=5) == greedy
  assert sample(temperature=0.7, top_p=1e-6, seed=6) == greedy


def test_drawn_tokens_follow_temperature_top_k_and_top_p():
  logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))
  keys = jax.random.split(jax.random.key(0), 20000)

  def frequencies(**kw):
    pick = jax.vmap(lambda key: decoding.pick_tokens(logits, key, decoding.Sampling(**kw))[0])
    return np.bincount(np.asarray(pick(keys)), minlength=4) / len(keys)
  np.testing.assert_allclose(frequencies(temperature=1.0), [0.5, 0.25, 0.15, 0.1], atol=0.015)
  hot = np.array([0.5, 0.25, 0.15, 0.1]) ** 0.5
  np.testing.assert_allclose(frequencies(temperature=2.0), hot / hot.sum(), atol=0.015)
  np.testing.assert_allclose(frequencies(temperature=1.0, top_k=2), [2 / 3, 1 / 3, 0, 0],
                             atol=0.015)
  # 0.5 + 0.25 reach 0.7: the nucleus is the first two (transformers' rule).
  np.testing.assert_allclose(frequencies(temperature=1.0, top_p=0.7), [2 / 3, 1 / 3, 0, 0],
                             atol=0.015)
  assert frequencies(temperature=1.0, top_p=0.5)[0] == 1.0


@pytest.mark.parametrize("call, message", [
    (lambda g: list(g.stream([], 4)), "at least one prompt"),
    (lambda g: list(g.stream([[1], []], 4)), "at least one token"),
    (lambda g: list(g.stream([[1]], 0)), "max_new_tokens must be >= 1"),
    (lambda g: list(g.stream([[1] * 64], 4)), "a prompt of 64 tokens leaves no room in the "
                                              "model's context of 64"),
])
def test_bad_requests_are_named(call, message):
  config = gpt.GPTConfig(vocab_size=32, seq_len=64, n_layer=1, n_head=2, d_model=16)
  generator = decoding.Generator(config, gpt.init_params(config, jax.random.key(0)))
  with pytest.raises(ValueError, match=message):
    call(generator)


@pytest.mark.parametrize("fields, message", [(dict(temperature=-1), "temperature must be >= 0"),
                                             (dict(top_k=-2), "top_k must be >= 0"),
                                             (dict(top_p=0), r"top_p must be in \(0, 1\]")])
def test_bad_sampling_is_named(fields, message):
  with pytest.raises(ValueError, match=message):
    decoding.Sampling(**fields)


def test_generation_ends_at_the_context_and_the_sliding_window():
  config = llama.PRESETS["llama-tiny"]  # a context of 128
  params = llama.init_params(config, jax.random.key(0))
  assert [len(new) for new in decoding.generate(config, params, [[1] * 100, [2]], 50)] == [28, 28]
  windowed = dataclasses.replace(config, sliding_window=32)
  assert len(decoding.generate(windowed, params, [[1] * 20], 50)[0]) == 12


# The command line, as users call it.

def _cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
  """`python -m jzo.generate ARGS` (compiling into the suite's cache); stdout
  and stderr as written (no newline translation)."""
  out = subprocess.run([sys.executable, "-m", "jzo.generate", *map(str, args)],
                       input=None if stdin is None else stdin.encode(), capture_output=True,
                       timeout=300, env=HIGHEST)
  out.stdout, out.stderr = out.stdout.decode(), out.stderr.decode()
  return out


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
  """(folder, tokenizer of transformers, model): a tiny Qwen2 with a ChatML BPE tokenizer."""
  folder = tmp_path_factory.mktemp("qwen2-chat")
  vocab = save_tokenizer(folder)
  config = transformers.Qwen2Config(
      vocab_size=vocab + 20, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
  torch.manual_seed(0)
  transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  # tokenizer.json as it is (AutoTokenizer would give Qwen2's class, which
  # splits digits its own way, not as this file says).
  return folder, transformers.PreTrainedTokenizerFast.from_pretrained(folder), model


def _their_reply(chat_model, messages: list[dict] | str, n: int) -> str:
  folder, tokenizer, model = chat_model
  if isinstance(messages, str):
    ids = tokenizer(messages)["input_ids"]
  else:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
  eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
  return tokenizer.decode(_greedy(model, ids, n, eos), skip_special_tokens=True)


def test_a_prompt_streams_only_the_completion(chat_model, tmp_path):
  args = ("--hf", chat_model[0], "--prompt", "the quick brown fox", "--max-new-tokens", 20,
          "--dtype", "float32")
  out = _cli(*args, "--compile-cache", tmp_path)
  assert out.returncode == 0, out.stderr
  assert out.stdout == _their_reply(chat_model, "the quick brown fox", 20) + "\n"
  compiled = {p.name.split("-")[0] for p in tmp_path.iterdir()}
  assert {"jit__decode", "jit__prefill"} <= compiled  # a later run reads them
  assert _cli(*args, "--compile-cache", tmp_path).stdout == out.stdout


def test_a_conversation_keeps_its_turns(chat_model):
  out = _cli("--hf", chat_model[0], "--chat", "--system", "be brief", "--max-new-tokens", 12,
             "--dtype", "float32", stdin="the lazy dog\n\nand the fox\n")
  assert out.returncode == 0, out.stderr
  messages = [{"role": "system", "content": "be brief"},
              {"role": "user", "content": "the lazy dog"}]
  first = _their_reply(chat_model, messages, 12)
  messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "and the fox"}]
  assert out.stdout == first + "\n" + _their_reply(chat_model, messages, 12) + "\n"


def test_a_batch_of_prompts_from_jsonl(chat_model, tmp_path):
  records = [{"prompt": "the quick"}, {"messages": [{"role": "user", "content": "a dog"}]},
             {"prompt": "over the lazy dog and", "id": 7}]
  source = tmp_path / "prompts.jsonl"
  source.write_text("".join(json.dumps(r) + "\n" for r in records))
  out = _cli("--hf", chat_model[0], "--input", source, "--output", tmp_path / "out.jsonl",
             "--batch-size", 2, "--max-new-tokens", 10, "--dtype", "float32")
  assert out.returncode == 0 and out.stdout == "", out.stderr
  written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
  assert [{k: v for k, v in w.items() if k not in ("completion", "finish_reason")}
          for w in written] == records
  for record, line in zip(records, written):
    assert line["completion"] == _their_reply(chat_model, record.get("messages")
                                              or record["prompt"], 10)
    assert line["finish_reason"] in ("stop", "length")


def test_a_training_run_and_its_export_generate_alike(tmp_path):
  """A GPT trained on bytes: --run reads its checkpoint; its GPT-2 export
  generates the same text in jzo (--hf) and in transformers."""
  run = tmp_path / "run"
  assert train.main(["--steps", "2", "--seq-len", "32", "--batch-size", "2", "--devices", "1",
                     "--sample-tokens", "0", "--out", str(run)]) == 0
  assert subprocess.run([sys.executable, "-m", "jzo.export", "--run", run, "--out",
                         tmp_path / "hf"], capture_output=True).returncode == 0
  from_run = _cli("--run", run, "--prompt", "import os\n", "--max-new-tokens", 16)
  from_export = _cli("--hf", tmp_path / "hf", "--prompt", "import os\n", "--max-new-tokens", 16)
  assert from_run.returncode == 0, from_run.stderr
  assert from_run.stdout == from_export.stdout
  model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
  new = _greedy(model, list(b"import os\n"), 16)
  assert from_run.stdout == bytes(new).decode("utf-8", "replace") + "\n"


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi"], "give one model: --run DIR"),
    (["--run", "{tmp}", "--prompt", "hi"], "no checkpoints folder"),
    (["--hf", "{tmp}", "--prompt", "hi"], "config.json"),
    (["--hf", "{model}", "--tokenizer", "{tmp}", "--prompt", "hi"], "has no tokenizer.json"),
    (["--hf", "{model}", "--prompt", "fox " * 200], "leaves no room in the model's context"),
    (["--hf", "{model}", "--input", "{tmp}/bad.jsonl"], 'line 2: each line needs a "prompt"'),
    (["--hf", "{model}", "--prompt", "hi", "--top-p", "0"], "--top-p must be in"),
    (["--hf", "{model}", "--output", "x.jsonl"], "--output needs --input"),
])
def test_bad_input_is_one_line(chat_model, tmp_path, capsys, args, message):
  (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
  args = [a.format(tmp=tmp_path, model=chat_model[0]) for a in args]
  assert generate_cli.main(args) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_errors_from_the_real_entry_point(tmp_path):
  out = _cli("--run", tmp_path, "--prompt", "hi")
  assert out.returncode == 2 and out.stdout == ""
  assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
