"""Hugging Face folders in and out: logits against transformers' own models,
export back into transformers, lazy leaves into the ZeRO engine, and one-line
errors for every bad input."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import Mesh
from safetensors.numpy import load_file, save_file

import jzo
from jzo.models import hf, llama

_SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5)
# Each family's features, in the older rope_theta/rope_scaling spelling that
# every transformers version reads. Mistral and Qwen3 set head_dim apart from
# hidden / heads (24 and 32, not 16).
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        num_key_value_heads=2, head_dim=24, sliding_window=64, rope_theta=1e6)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        num_key_value_heads=1, tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
}
TOKENS = np.random.default_rng(0).integers(0, 96, (2, 40))


def _torch_logits(model, tokens=TOKENS) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def _jzo_logits(config, params, tokens=TOKENS) -> np.ndarray:
  with jax.default_matmul_precision("highest"):
    return np.asarray(llama.forward(config, params, tokens))


def _assert_close(a, b, rtol=1e-4):
  a, b = np.asarray(a), np.asarray(b)
  assert np.abs(a - b).max() <= rtol * np.abs(b).max()


def _loaded(sources) -> dict:
  return jax.tree.map(lambda leaf: leaf.load().astype(np.float32), sources)


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
  """(family, folder, transformers' float32 model of the folder's weights):
  llama saved in shards, qwen3 in bfloat16, the others whole in float32."""
  family = request.param
  config_class, model_class, features = FAMILIES[family]
  torch.manual_seed(0)
  model = model_class(config_class(**_SHAPE, **features, attn_implementation="eager")).eval()
  folder = str(tmp_path_factory.mktemp(family))
  if family == "qwen3":
    model = model.to(torch.bfloat16)
  model.save_pretrained(folder, max_shard_size="40KB" if family == "llama" else "1GB")
  # Read back in float32 (torch_dtype: the spelling every transformers
  # version reads); the bf16 model's RoPE frequencies were rounded to bf16.
  return family, folder, transformers.AutoModelForCausalLM.from_pretrained(
      folder, attn_implementation="eager", torch_dtype=torch.float32).eval()


def test_logits_equal_transformers(checkpoint):
  family, folder, model = checkpoint
  config, sources = hf.param_sources(folder)
  assert config.model_type == family
  leaves = jax.tree.leaves(sources)
  assert all(isinstance(x, jzo.HostLeaf) for x in leaves)
  assert {x.dtype.name for x in leaves} == {"bfloat16" if family == "qwen3" else "float32"}
  shapes = jax.eval_shape(lambda: llama.init_params(config, jax.random.PRNGKey(0)))
  assert jax.tree.map(lambda x: x.shape, sources) == jax.tree.map(lambda x: x.shape, shapes)
  if family == "llama":
    assert os.path.exists(os.path.join(folder, hf.INDEX))
  params = _loaded(sources)
  # A stacked leaf's layers read apart, as the engine's build reads a large one.
  stacked = jax.tree.leaves(sources["layers"])
  assert all(x.load_rows is not None for x in stacked)
  for x, whole in zip(stacked, jax.tree.leaves(params["layers"])):
    np.testing.assert_array_equal(x.rows(1, 2).astype(np.float32), whole[1:2])
  _assert_close(_jzo_logits(config, params), _torch_logits(model))
  if family == "mistral":  # a window shorter than the sequence is refused, not ignored
    assert config.sliding_window == 64
    with pytest.raises(ValueError, match="sliding window of 64"):
      llama.forward(config, params, np.zeros((1, 65), np.int32))


def test_export_loads_unchanged_in_transformers(checkpoint, tmp_path):
  family, folder, _ = checkpoint
  config, sources = hf.param_sources(folder)
  params = _loaded(sources)
  sharded = family == "mistral"
  hf.save_pretrained(str(tmp_path), config, params, dtype="float32",
                     max_shard_bytes=50_000 if sharded else 5 * 2**30)
  files = sorted(os.listdir(tmp_path))
  if sharded:
    index = json.load(open(tmp_path / hf.INDEX))
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f for f in files if f.startswith("model-")] and len(shards) > 1
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
  else:
    assert files == ["config.json", "model.safetensors"]
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), attn_implementation="eager", torch_dtype=torch.float32).eval()
  assert type(model).__name__ == llama.ARCHITECTURES[family]
  _assert_close(_torch_logits(model), _jzo_logits(config, params))
  again, sources = hf.param_sources(str(tmp_path))
  assert again == config
  jax.tree.map(np.testing.assert_array_equal, _loaded(sources), params)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
  """A float32 tiny Llama in jzo's own export: the base the bad inputs edit."""
  config = dataclasses.replace(llama.PRESETS["llama-tiny"], vocab_size=64, d_model=32, d_ff=48)
  params = jax.tree.map(np.asarray, llama.init_params(config, jax.random.PRNGKey(0)))
  folder = str(tmp_path_factory.mktemp("base"))
  hf.save_pretrained(folder, config, params, dtype="float32")
  return folder, config, params


@pytest.mark.parametrize("remat, stage", [("full", 2), ("dots", 3)])
def test_engine_trains_from_lazy_leaves(llama_folder, remat, stage):
  folder, _, params = llama_folder
  config, sources = hf.param_sources(folder, remat=remat)
  assert config.remat == remat
  loads = []

  def counted(i, leaf):
    def load():
      loads.append(i)
      return leaf.load()
    return jzo.HostLeaf(leaf.shape, leaf.dtype, load)
  leaves, treedef = jax.tree.flatten(sources)
  sources = jax.tree.unflatten(treedef, [counted(i, x) for i, x in enumerate(leaves)])
  engine = jzo.ZeroEngine(lambda p, b: llama.loss_fn(config, p, b), sources, jzo.cpu_adamw(3e-3),
                          options=jzo.EngineOptions(stage=stage,
                                                    layers=llama.LAYERS if stage == 3 else None,
                                                    offload=True, compute_dtype=np.float32),
                          mesh=Mesh(np.array(jax.devices()[:4]), ("data",)))
  assert sorted(loads) == list(range(len(leaves)))  # each leaf read once
  jax.tree.map(np.testing.assert_array_equal, engine.params, params)
  rng = np.random.default_rng(1)
  batch = {"tokens": rng.integers(0, config.vocab_size, (8, 17)).astype(np.int32),
           "loss_weight": (rng.random((8, 16)) < 0.5).astype(np.float32) * 2}
  losses = [float(engine.step(batch).loss) for _ in range(4)]
  engine.close()
  assert losses[-1] < losses[0]


def test_bfloat16_export_rounds_each_weight_once(llama_folder, tmp_path):
  _, config, params = llama_folder
  hf.save_pretrained(str(tmp_path), config, params)
  assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == "bfloat16"
  _, again = hf.param_sources(str(tmp_path))
  rounded = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), params)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(lambda x: x.load(), again), rounded)


def _rewrite(base, tmp_path, edit=None, config_edit=None) -> str:
  """A copy of the base folder with its tensors (a dict) and config edited."""
  folder = tmp_path / "edited"
  shutil.copytree(base, folder)
  if edit is not None:
    tensors = load_file(folder / hf.SINGLE)
    edit(tensors)
    save_file(tensors, folder / hf.SINGLE, metadata={"format": "pt"})
  if config_edit is not None:
    hf_config = json.load(open(folder / "config.json"))
    config_edit(hf_config)
    json.dump(hf_config, open(folder / "config.json", "w"))
  return str(folder)


def _error(folder, kind=ValueError) -> str:
  with pytest.raises(kind) as e:
    hf.param_sources(folder)
  assert "\n" not in str(e.value)
  return str(e.value)


def test_harmless_buffers_are_ignored(llama_folder, tmp_path):
  base, config, _ = llama_folder
  inv_freq = np.ones(config.head_dim // 2, np.float32)
  folder = _rewrite(base, tmp_path, lambda t: t.update(
      {"model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq}))
  assert hf.param_sources(folder)[0] == config


def test_bad_tensors_are_named(llama_folder, tmp_path):
  base, _, _ = llama_folder
  up = "model.layers.1.mlp.up_proj.weight"
  assert _error(_rewrite(base, tmp_path / "a", lambda t: t.pop(up))).endswith(
      f"tensor {up} is missing (expected shape [48, 32])")
  assert _error(_rewrite(base, tmp_path / "b", lambda t: t.update({up: np.zeros((48, 31),
                                                                  np.float32)}))) == (
      f"model.safetensors: tensor {up} has shape [48, 31], expected [48, 32] from config.json")
  message = _error(_rewrite(base, tmp_path / "c", lambda t: t.update(
      {"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})))
  assert "unexpected tensor model.layers.0.mlp.extra.weight [3]" in message
  assert _error(_rewrite(base, tmp_path / "d", lambda t: t.update({up: t[up].astype(
      np.float64)}))) == f"model.safetensors: tensor {up} is F64, not one of BF16, F16, F32"


def test_bad_files_are_named(llama_folder, tmp_path):
  base, _, _ = llama_folder
  folder = _rewrite(base, tmp_path / "a", config_edit=lambda c: c.update(model_type="gpt2"))
  assert "model_type 'gpt2' is not supported (only llama, mistral, qwen2, qwen3, " in _error(folder)
  folder = _rewrite(base, tmp_path / "b", config_edit=lambda c: c.update(
      rope_scaling={"rope_type": "yarn", "factor": 4.0}))
  assert "rope type 'yarn' is not supported" in _error(folder)
  folder = _rewrite(base, tmp_path / "c")
  os.remove(os.path.join(folder, "config.json"))
  assert _error(folder, FileNotFoundError).endswith("config.json is missing")
  folder = _rewrite(base, tmp_path / "d")
  os.remove(os.path.join(folder, hf.SINGLE))
  assert _error(folder, FileNotFoundError).endswith(
      "has neither model.safetensors nor model.safetensors.index.json")
  folder = _rewrite(base, tmp_path / "e")
  with open(os.path.join(folder, hf.SINGLE), "r+b") as f:
    f.truncate(os.path.getsize(f.name) - 4)
  assert "model.safetensors: tensor" in _error(folder)


def test_bad_shards_are_named(llama_folder, tmp_path):
  _, config, params = llama_folder
  folder = tmp_path / "sharded"
  hf.save_pretrained(str(folder), config, params, dtype="float32", max_shard_bytes=20_000)
  index = json.load(open(folder / hf.INDEX))
  last = sorted(set(index["weight_map"].values()))[-1]
  os.rename(folder / last, folder / "elsewhere")
  assert _error(str(folder), FileNotFoundError).endswith(f"{last} is missing")
  os.rename(folder / "elsewhere", folder / last)
  name = "model.norm.weight"
  first = sorted(set(index["weight_map"].values()))[0]
  json.dump({"weight_map": index["weight_map"] | {name: first}}, open(folder / hf.INDEX, "w"))
  assert _error(str(folder)).endswith(f"puts tensor {name} in {first}, which does not hold it")
  (folder / hf.INDEX).write_text("{not json")
  assert "model.safetensors.index.json is not a safetensors index" in _error(str(folder))


def test_save_refuses_params_that_do_not_fit(llama_folder, tmp_path):
  _, config, params = llama_folder
  wrong = jax.tree.map(lambda x: x, params)
  wrong["norm"]["scale"] = np.ones(31, np.float32)
  with pytest.raises(ValueError, match=r"params leaf norm/scale has shape \[31\], expected \[32\]"):
    hf.save_pretrained(str(tmp_path), config, wrong)
  with pytest.raises(ValueError, match="dtype must be one of bfloat16, float16, float32"):
    hf.save_pretrained(str(tmp_path), config, params, dtype="int8")
