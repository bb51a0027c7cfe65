"""Fine-tuning as a user does it: a Hugging Face checkpoint in, its own
tokenizer over chat data, `python -m jzo.train --init-from`, then
`python -m jzo.export --format hf`, which transformers loads unchanged.

The checkpoints are tiny random models made here with transformers' own
classes and save_pretrained; the tokenizer a small BPE trained here.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
import torch
import transformers

from jzo import train
from jzo.recipe import export
from jzo.models import llama
from jzo.recipe import data as data_lib

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "the quick brown fox jumps over a lazy dog and then it sleeps well all day long".split()


def chats(n: int, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  sentence = lambda: " ".join(rng.choice(WORDS, 6))
  return [{"messages": [{"role": "user", "content": sentence()},
                        {"role": "assistant", "content": sentence()}]} for _ in range(n)]


def save_tokenizer(folder: pathlib.Path, size: int = 300) -> int:
  """A byte-level BPE with ChatML's special tokens; returns its vocabulary size."""
  models, pre, trainers = tokenizers.models, tokenizers.pre_tokenizers, tokenizers.trainers
  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False,
                                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre.ByteLevel.alphabet())
  text = [" ".join(WORDS)] * 8 + ["user assistant"] + [f"w{i}" for i in range(size)]
  backend.train_from_iterator(text, trainer)
  backend.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": "<|endoftext|>", "chat_template": CHATML}))
  return backend.get_vocab_size()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
  """A tiny random Qwen2-style Llama (GQA, biases, untied) with its tokenizer, sharded."""
  folder = tmp_path_factory.mktemp("qwen2-tiny")
  vocab = save_tokenizer(folder)
  config = transformers.Qwen2Config(
      vocab_size=vocab + 20, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
      tie_word_embeddings=False)
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(config)
  model.save_pretrained(folder, max_shard_size="40KB")
  return folder


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> pathlib.Path:
  path = tmp_path_factory.mktemp("data") / "chat.jsonl"
  path.write_text("".join(json.dumps(c) + "\n" for c in chats(64)))
  return path


def fine_tune(checkpoint, data, out, *extra) -> list[str]:
  return ["--init-from", str(checkpoint), "--data", str(data), "--steps", "4",
          "--seq-len", "32", "--batch-size", "4", "--devices", "2", "--log-every", "2",
          "--eval-every", "4", "--eval-batches", "1", "--sample-tokens", "4",
          "--out", str(out), *extra]


@pytest.fixture(scope="module")
def run(checkpoint, chat_data, tmp_path_factory) -> pathlib.Path:
  out = tmp_path_factory.mktemp("run")
  assert train.main(fine_tune(checkpoint, chat_data, out, "--offload", "--delayed-update")) == 0
  return out


def test_fine_tuning_trains_and_keeps_the_model_files(run, checkpoint):
  lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  assert [l["step"] for l in lines] == [1, 2, 3, 4]
  assert all(np.isfinite(l["loss"]) and not l["skipped"] for l in lines)
  # The fine-tuning defaults: Qwen2.5's 7e-6; a run this short warms up over
  # half its steps (two), since 3% of 4 steps would be one; then it decays.
  assert [l["lr"] for l in lines] == pytest.approx([3.5e-6, 7e-6, 3.85e-6, 7e-7])
  kept = run / "model"
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
    assert (kept / name).is_file(), name
  assert json.loads((kept / "config.json").read_text())["model_type"] == "qwen2"
  assert (run / "data-cache").is_dir()


def test_export_loads_in_transformers_with_jzos_logits(run, tmp_path):
  done = export.export(run, tmp_path / "hf", format="hf")
  assert done.step == 4 and done.nnx_state is None
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
    assert (tmp_path / "hf" / name).is_file(), name
  step, config, params = export.read_run(run, None, run / "model" / "config.json")
  tokens = np.random.default_rng(1).integers(0, config.vocab_size, (2, 16), np.int32)
  ours = np.asarray(llama.forward(config, params, tokens), np.float32)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                             torch_dtype=torch.float32)
  with torch.no_grad():
    theirs = loaded(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
  fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
  assert fast.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) \
      == "<|im_start|>user\nhi<|im_end|>\n"


def test_the_weights_moved_from_the_checkpoint(run, checkpoint):
  """Four steps changed the imported weights (the run started from them, not from new ones)."""
  _, config, params = export.read_run(run, None, run / "model" / "config.json")
  start = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
  before = start.model.embed_tokens.weight.detach().numpy()
  after = params["embed"]
  assert after.shape == before.shape
  change = np.abs(after - before).max()
  assert 0 < change < 1e-3  # a few steps at 7e-6: small, yet not zero


def test_loss_weight_counts_each_answer_token_once():
  mask = np.zeros((4, 8), np.float32)
  mask[0, :3] = mask[2, 5:] = 1  # 6 answer tokens in 32 positions
  weight = data_lib.loss_weight(mask)
  losses = np.random.default_rng(0).random((4, 8)).astype(np.float32)
  want = (losses * mask).sum() / 6
  # Whole batch, or two micro-batches (or devices) averaged, as the engine does.
  assert np.mean(weight * losses) == pytest.approx(want, rel=1e-6)
  halves = [np.mean(weight[i:i + 2] * losses[i:i + 2]) for i in (0, 2)]
  assert np.mean(halves) == pytest.approx(want, rel=1e-6)


def test_bad_checkpoints_and_data_are_one_line(checkpoint, chat_data, tmp_path, capsys):
  def error(*args) -> str:
    assert train.main(list(args)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]  # after the tokenizer's progress bar, if any
    assert last.startswith("error: "), err
    return last
  out = tmp_path / "out"
  assert "no/such/folder" in error(*fine_tune(tmp_path / "no/such/folder", chat_data, out))
  # An unknown model_type.
  odd = tmp_path / "odd"
  odd.mkdir()
  (odd / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
  assert "model_type 'bert'" in error(*fine_tune(odd, chat_data, out))
  # A tokenizer with more ids than the model's vocabulary, and weights unlike the config.
  bigger = tmp_path / "bigger"
  bigger.mkdir()
  size = save_tokenizer(bigger, 600)
  assert f"has {size} ids" in error(*fine_tune(checkpoint, chat_data, out, "--tokenizer",
                                               str(bigger)))
  small = tmp_path / "small"
  small.mkdir()
  for f in checkpoint.iterdir():
    (small / f.name).write_bytes(f.read_bytes())
  hf = json.loads((small / "config.json").read_text())
  (small / "config.json").write_text(json.dumps({**hf, "vocab_size": 50}))
  assert "model.embed_tokens.weight has shape [320, 64], expected [50, 64]" in error(
      *fine_tune(small, chat_data, out))
  # Empty data, and JSONL with no tokenizer to read it.
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  assert "empty.jsonl" in error(*fine_tune(checkpoint, empty, out))
  assert "JSONL data is read with a tokenizer" in error(
      "--model", "llama-tiny", "--data", str(chat_data), "--out", str(out))
  assert not out.exists()  # nothing written by any of them


def test_the_real_entry_points(checkpoint, chat_data, tmp_path):
  """`python -m jzo.train --init-from` and `python -m jzo.export --format hf` in subprocesses."""
  out = tmp_path / "run"
  two_cpus = {**os.environ, "JAX_PLATFORMS": "cpu",
              "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  trained = subprocess.run([sys.executable, "-m", "jzo.train",
                            *fine_tune(checkpoint, chat_data, out, "--steps", "2")],
                           capture_output=True, text=True, timeout=600, env=two_cpus)
  assert trained.returncode == 0, trained.stderr[-2000:]
  exported = subprocess.run([sys.executable, "-m", "jzo.export", "--run", str(out), "--out",
                             str(tmp_path / "hf"), "--format", "hf", "--dtype", "bfloat16"],
                            capture_output=True, text=True, timeout=600)
  assert exported.returncode == 0, exported.stderr[-2000:]
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
  wrong = subprocess.run([sys.executable, "-m", "jzo.export", "--run", str(out), "--out",
                          str(tmp_path / "jzo"), "--format", "jzo"], capture_output=True, text=True,
                         timeout=600)
  assert wrong.returncode == 2 and "--format hf" in wrong.stderr
