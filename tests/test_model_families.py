"""Each Hugging Face family beyond the Llama models, as a user fine-tunes it:
a tiny random checkpoint made by transformers' own class, with a tokenizer,
`jzo.train --init-from` it with the optimizer on the host, then the export,
which transformers loads unchanged with jzo's logits. The families' own
numerics (logits, losses, generation against transformers) are tested in
test_gemma.py, test_phi3.py and test_moe.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from jzo import train
from jzo.models import hf
from jzo.recipe import export

from test_finetune import chats, fine_tune, save_tokenizer

_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
# model_type -> (transformers' config and model classes, the family's own fields).
FAMILIES = {
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(head_dim=16, sliding_window=8)),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                    dict(head_dim=16, sliding_window=8, num_hidden_layers=3,
                         layer_types=["sliding_attention", "full_attention",
                                      "sliding_attention"])),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(pad_token_id=0)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       head_dim=16, norm_topk_prob=True)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> pathlib.Path:
  path = tmp_path_factory.mktemp("data") / "chat.jsonl"
  path.write_text("".join(json.dumps(c) + "\n" for c in chats(64)))
  return path


def checkpoint(model_type: str, folder: pathlib.Path) -> pathlib.Path:
  """A tiny random model of `model_type` with a ChatML tokenizer, in `folder`."""
  folder.mkdir()
  vocab = save_tokenizer(folder)
  config_class, model_class, fields = FAMILIES[model_type]
  config = config_class(**{**_SHAPE, **fields, "vocab_size": vocab + 20, "bos_token_id": 0,
                           "eos_token_id": 0})
  torch.manual_seed(0)
  model_class(config).save_pretrained(folder)
  return folder


def _logits(folder: pathlib.Path, tokens: np.ndarray) -> np.ndarray:
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  with torch.no_grad():
    return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_fine_tune_and_export(model_type, chat_data, tmp_path):
  folder = checkpoint(model_type, tmp_path / "checkpoint")
  run = tmp_path / "run"
  assert train.main(fine_tune(folder, chat_data, run, "--offload", "--steps", "2",
                              "--log-every", "1", "--eval-every", "100", "--sample-tokens",
                              "0")) == 0
  lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
  assert [l["step"] for l in lines] == [1, 2]
  assert all(np.isfinite(l["loss"]) for l in lines)
  done = export.export(run, tmp_path / "hf", format="hf")
  assert done.step == 2
  saved = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert saved["model_type"] == model_type
  assert saved["architectures"] == [hf.ARCHITECTURES[model_type]]
  _, config, params = export.load_run(run)
  tokens = np.random.default_rng(1).integers(0, config.vocab_size, (2, 24), np.int32)
  ours = np.asarray(hf.family(config).forward(config, params, tokens), np.float32)
  np.testing.assert_allclose(ours, _logits(tmp_path / "hf", tokens), rtol=1e-4, atol=1e-4)
  # The weights moved from the checkpoint's: the run trained them.
  assert np.abs(_logits(folder, tokens) - ours).max() > 0


def test_the_real_entry_points_train_a_mixture_of_experts(chat_data, tmp_path):
  """`python -m jzo.train --init-from` a Qwen3-MoE folder, with stage 3 gathering
  a layer's experts at a time and their optimizer state on the host, then
  `python -m jzo.export` and `python -m jzo.estimate` of its preset."""
  folder = checkpoint("qwen3_moe", tmp_path / "checkpoint")
  two_cpus = {**os.environ, "JAX_PLATFORMS": "cpu",
              "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}

  def cli(*args):
    done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=600, env=two_cpus)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
  out = cli("jzo.train", *fine_tune(folder, chat_data, tmp_path / "run", "--steps", "2",
                                    "--stage", "3", "--offload"))
  assert "ZeRO stage 3" in out and "M active a token (TFLOPS count these)" in out
  cli("jzo.export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf"))
  assert transformers.AutoConfig.from_pretrained(tmp_path / "hf").model_type == "qwen3_moe"
  # Two H200s and their host: every expert's int8 state fits in host memory.
  plan = cli("jzo.estimate", "--model", "qwen3-30b-a3b", "--devices", "2", "--stage", "3",
             "--grads-in-params", "--offload", "true", "--moments", "int8", "--seq-len", "4096",
             "--batch-size", "8", "--device-gb", "139", "--host-gb", "251")
  assert "30.532B params" in plan and plan.rstrip().endswith("fits"), plan
