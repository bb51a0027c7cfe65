"""jzo's GPT in and out of transformers' GPT-2 format: jzo's folders load in
GPT2LMHeadModel with no key missing or left over and give jzo's logits,
transformers' own GPT-2 folders read into jzo with transformers' logits, and
every folder jzo's GPT cannot be is refused in one line."""

import json
import logging
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from jzo.models import gpt, gpt2_hf, hf_files

# A vocabulary that is no multiple of 128, and a context apart from the tokens' length.
CONFIG = gpt.GPTConfig(vocab_size=200, seq_len=48, n_layer=2, n_head=4, d_model=32)


def _random_params(config: gpt.GPTConfig, seed: int = 0) -> dict:
  """A GPT whose every leaf is random: LayerNorm scales and biases too
  (gpt.init_params makes them 1 and 0, which would hide a swapped pair)."""
  rng = np.random.default_rng(seed)
  params = jax.tree.map(np.asarray, gpt.init_params(config, jax.random.PRNGKey(seed)))
  return jax.tree.map(lambda x: (x + 0.1 * rng.standard_normal(x.shape)).astype(np.float32),
                      params)


def _tokens(vocab: int, length: int) -> np.ndarray:
  return np.random.default_rng(1).integers(0, vocab, (2, length))


def _jzo_logits(config, params, tokens) -> np.ndarray:
  with jax.default_matmul_precision("highest"):
    return np.asarray(gpt.forward(config, params, tokens))


def _torch_logits(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


class _Warnings(logging.Handler):
  """transformers' warnings while it is attached (missing or unexpected keys, ids out of range)."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def _from_pretrained(folder, model_class=transformers.GPT2LMHeadModel):
  """transformers' float32 model of `folder`, eager attention; asserts it
  loads with no key missing, unexpected or mismatched, and no warning."""
  caught = _Warnings()
  transformers.logging.add_handler(caught)
  try:
    model, info = model_class.from_pretrained(str(folder), output_loading_info=True,
                                              attn_implementation="eager",
                                              torch_dtype=torch.float32)
  finally:
    transformers.logging.remove_handler(caught)
  assert {k: v for k, v in info.items() if v} == {}, info
  assert caught.messages == []
  return model.eval()


def test_jzo_gpt_loads_in_transformers_with_its_logits(tmp_path):
  params = _random_params(CONFIG)
  gpt2_hf.save_pretrained(str(tmp_path), CONFIG, params)
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
  written = json.loads((tmp_path / "config.json").read_text())
  assert {k: written[k] for k in ("model_type", "architectures", "n_embd", "n_layer", "n_head",
                                  "n_positions", "vocab_size", "activation_function",
                                  "layer_norm_epsilon", "tie_word_embeddings", "bos_token_id",
                                  "eos_token_id", "torch_dtype")} == {
      "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 2,
      "n_head": 4, "n_positions": 48, "vocab_size": 200, "activation_function": "gelu_new",
      "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "bos_token_id": None,
      "eos_token_id": None, "torch_dtype": "float32"}
  names = set(load_file(tmp_path / "model.safetensors"))
  assert "lm_head.weight" not in names  # tied: transformers makes it from wte
  assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.bias",
          "transformer.h.1.attn.c_attn.weight", "transformer.h.0.mlp.c_proj.bias"} <= names

  model = _from_pretrained(tmp_path)
  assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
  tokens = _tokens(CONFIG.vocab_size, 40)
  want = _jzo_logits(CONFIG, params, tokens)
  initial = _jzo_logits(CONFIG, gpt.init_params(CONFIG, jax.random.PRNGKey(0)), tokens)
  assert np.abs(want - initial).max() > 0.1  # the comparison can fail
  np.testing.assert_allclose(_torch_logits(model, tokens), want, rtol=0, atol=1e-5)
  # AutoModelForCausalLM finds the class from config.json alone.
  auto = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
  assert type(auto) is transformers.GPT2LMHeadModel

  assert gpt2_hf.read_config(str(tmp_path)) == CONFIG
  assert gpt2_hf.read_config(str(tmp_path), remat="dots").remat == "dots"
  jax.tree.map(np.testing.assert_array_equal, gpt2_hf.load_params(str(tmp_path)), params)


def test_bfloat16_in_shards(tmp_path):
  params = _random_params(CONFIG)
  gpt2_hf.save_pretrained(str(tmp_path), CONFIG, params, dtype="bfloat16", bos_token_id=3,
                          eos_token_id=7, max_shard_bytes=20_000)
  index = json.loads((tmp_path / hf_files.INDEX).read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 1 and shards == sorted(f for f in os.listdir(tmp_path)
                                              if f.startswith("model-"))
  written = json.loads((tmp_path / "config.json").read_text())
  assert (written["torch_dtype"], written["bos_token_id"], written["eos_token_id"]) == (
      "bfloat16", 3, 7)
  rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), params)
  jax.tree.map(np.testing.assert_array_equal,
               gpt2_hf.load_params(str(tmp_path), ml_dtypes.bfloat16), rounded)
  as_float32 = gpt2_hf.load_params(str(tmp_path))
  assert {x.dtype for x in jax.tree.leaves(as_float32)} == {np.dtype(np.float32)}
  model = _from_pretrained(tmp_path)
  tokens = _tokens(CONFIG.vocab_size, 48)
  np.testing.assert_allclose(_torch_logits(model, tokens),
                             _jzo_logits(CONFIG, as_float32, tokens), rtol=0, atol=1e-5)


# transformers' own GPT-2s: GPT-2's vocabulary size, positions apart from
# the context; the variants of its config jzo's GPT is the same function for.
TRANSFORMERS = {
    "gpt2": dict(vocab_size=251, n_positions=50, n_embd=48, n_layer=3, n_head=4),
    "pytorch-tanh": dict(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                         activation_function="gelu_pytorch_tanh", n_inner=128,
                         reorder_and_upcast_attn=True),
}


@pytest.fixture(scope="module", params=list(TRANSFORMERS))
def transformers_gpt2(request, tmp_path_factory):
  """(transformers' GPT2LMHeadModel with every weight random, the folder
  its save_pretrained wrote)."""
  torch.manual_seed(0)
  config = transformers.GPT2Config(**TRANSFORMERS[request.param], bos_token_id=0,
                                   eos_token_id=1, attn_implementation="eager")
  model = transformers.GPT2LMHeadModel(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  folder = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(str(folder))
  return model, folder


def test_transformers_gpt2_reads_into_jzo(transformers_gpt2):
  model, folder = transformers_gpt2
  config = gpt2_hf.read_config(str(folder))
  hf = model.config
  assert (config.vocab_size, config.seq_len, config.d_model, config.n_layer, config.n_head) == (
      hf.vocab_size, hf.n_positions, hf.n_embd, hf.n_layer, hf.n_head)
  params = gpt2_hf.load_params(str(folder))
  shapes = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  assert jax.tree.map(np.shape, params) == jax.tree.map(lambda x: x.shape, shapes)
  tokens = _tokens(config.vocab_size, config.seq_len - 3)
  np.testing.assert_allclose(_jzo_logits(config, params, tokens), _torch_logits(model, tokens),
                             rtol=0, atol=1e-5)


def test_older_gpt2_folders(transformers_gpt2, tmp_path):
  """OpenAI's upload: GPT2Model's names (no "transformer."), the causal-mask
  buffers older transformers saved, an lm_head.weight, n_ctx beside n_positions."""
  model, folder = transformers_gpt2
  old = tmp_path / "old"
  shutil.copytree(folder, old)
  tensors = load_file(old / "model.safetensors")
  renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
  n, T = model.config.n_layer, model.config.n_positions
  for i in range(n):
    renamed[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, T, T), np.float32))
    renamed[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
  renamed["lm_head.weight"] = renamed["wte.weight"]
  save_file(renamed, old / "model.safetensors", metadata={"format": "pt"})
  config = json.loads((old / "config.json").read_text())
  (old / "config.json").write_text(json.dumps(config | {"n_ctx": 1024}))
  jax.tree.map(np.testing.assert_array_equal, gpt2_hf.load_params(str(old)),
               gpt2_hf.load_params(str(folder)))


def _edited(folder, tmp_path, config=None, drop=(), add=None):
  """A copy of `folder` with config.json's keys updated (None: removed) and tensors edited."""
  out = tmp_path / "edited"
  shutil.copytree(folder, out)
  if config is not None:
    saved = json.loads((out / "config.json").read_text())
    saved.update(config)
    saved = {k: v for k, v in saved.items() if v is not None}
    (out / "config.json").write_text(json.dumps(saved))
  if drop or add:
    tensors = load_file(out / "model.safetensors")
    for name in drop:
      del tensors[name]
    save_file(tensors | (add or {}), out / "model.safetensors", metadata={"format": "pt"})
  return str(out)


@pytest.fixture(scope="module")
def jzo_folder(tmp_path_factory):
  folder = tmp_path_factory.mktemp("jzo")
  gpt2_hf.save_pretrained(str(folder), CONFIG, _random_params(CONFIG))
  return folder


def _refused(folder, kind=ValueError) -> str:
  with pytest.raises(kind) as e:
    gpt2_hf.load_params(folder)
  assert "\n" not in str(e.value)
  return str(e.value)


@pytest.mark.parametrize("edit, message", [
    ({"activation_function": "gelu"}, "activation_function 'gelu': jzo's GPT has GELU's tanh "
                                      "approximation (gelu_new, gelu_pytorch_tanh, gelu_fast)"),
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx: jzo's GPT "
                                                "scales no layer's attention apart"),
    ({"scale_attn_weights": False}, "scale_attn_weights false"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings false: jzo's GPT ties the output"),
    ({"n_inner": 64}, "n_inner 64: jzo's GPT has an MLP 4 x n_embd = 128 wide"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon 1e-06: jzo's GPT has LayerNorm eps 1e-5"),
    ({"add_cross_attention": True}, "add_cross_attention: jzo's GPT has no cross-attention"),
    ({"model_type": "llama"}, "model_type 'llama' is not GPT-2's 'gpt2'"),
    ({"model_type": None}, "model_type None is not GPT-2's 'gpt2'"),
    ({"n_embd": "32"}, "n_embd is '32', not a positive integer"),
    ({"n_head": 5}, "d_model 32 is not a multiple of n_head 5"),
])
def test_what_jzo_cannot_express_is_refused(jzo_folder, tmp_path, edit, message):
  error = _refused(_edited(jzo_folder, tmp_path, config=edit))
  assert error.startswith(str(tmp_path / "edited" / "config.json") + ": ") and message in error


def test_gpt2_defaults_fill_what_config_json_leaves_out(jzo_folder, tmp_path):
  # transformers 5 writes only what differs from GPT2Config's defaults.
  folder = _edited(jzo_folder, tmp_path, config=dict(
      activation_function=None, layer_norm_epsilon=None, tie_word_embeddings=None,
      scale_attn_weights=None, n_inner=None))
  assert gpt2_hf.read_config(folder) == CONFIG
  folder = _edited(jzo_folder, tmp_path / "aliases", config=dict(
      n_embd=None, n_layer=None, n_head=None, n_positions=None, hidden_size=32,
      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=48))
  assert gpt2_hf.read_config(folder) == CONFIG


def test_bad_files_are_named(jzo_folder, tmp_path):
  folder = _edited(jzo_folder, tmp_path / "a")
  os.remove(os.path.join(folder, "config.json"))
  assert _refused(folder, FileNotFoundError) == f"{folder}/config.json is missing"
  folder = _edited(jzo_folder, tmp_path / "b")
  os.remove(os.path.join(folder, "model.safetensors"))
  assert _refused(folder, FileNotFoundError) == (
      f"{folder} has neither model.safetensors nor model.safetensors.index.json")
  folder = _edited(jzo_folder, tmp_path / "c")
  (tmp_path / "c" / "edited" / "config.json").write_text("{not json")
  assert "config.json is not JSON" in _refused(folder)
  name = "transformer.h.1.ln_2.bias"
  assert _refused(_edited(jzo_folder, tmp_path / "d", drop=[name])) == (
      f"{tmp_path / 'd' / 'edited'}: tensor {name} is missing (expected shape [32])")
  assert _refused(_edited(jzo_folder, tmp_path / "e", add={name: np.zeros(31, np.float32)})) == (
      f"model.safetensors: tensor {name} has shape [31], expected [32] from config.json")
  assert _refused(_edited(jzo_folder, tmp_path / "f", config={"vocab_size": 201})) == (
      "model.safetensors: tensor transformer.wte.weight has shape [200, 32], expected [201, 32] "
      "from config.json")
  error = _refused(_edited(jzo_folder, tmp_path / "g", add={
      "transformer.h.0.crossattention.c_attn.weight": np.zeros((32, 64), np.float32)}))
  assert error == ("model.safetensors: unexpected tensor transformer.h.0.crossattention.c_attn."
                   "weight [32, 64]: a GPT-2 of this config.json has none")


def test_save_refuses_params_that_do_not_fit(tmp_path):
  params = _random_params(CONFIG)
  wrong = jax.tree.map(lambda x: x, params)
  wrong["lnf"]["bias"] = np.zeros(31, np.float32)
  with pytest.raises(ValueError, match=r"^params leaf lnf/bias has shape \[31\], expected \[32\]$"):
    gpt2_hf.save_pretrained(str(tmp_path), CONFIG, wrong)
  del wrong["lnf"]["bias"]
  with pytest.raises(ValueError, match=r"^params has no leaf lnf/bias \(expected shape \[32\]\)$"):
    gpt2_hf.save_pretrained(str(tmp_path), CONFIG, wrong)
  with pytest.raises(ValueError, match="^dtype must be one of bfloat16, float16, float32, got "
                                       "'int8'$"):
    gpt2_hf.save_pretrained(str(tmp_path), CONFIG, params, dtype="int8")
  assert os.listdir(tmp_path) == []
