"""Phi-3 and Phi-4 in the Llama family: tiny random models made by
transformers' Phi3ForCausalLM (default RoPE with a sliding window; longrope
over sequences shorter and longer than its original context; longrope with
Phi-4-mini's partial rotation and tied embeddings), their logits and greedy
generation against transformers', the export back, training through the
ZeRO engine with the optimizer on the host, the phi-4 preset, and one-line
refusals."""

import dataclasses
import math

import jax
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import Mesh

import jzo
from jzo.models import decoding, hf, llama

from test_hf import _assert_close, _torch_logits

_SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_RNG = np.random.default_rng(0)


def _longrope(n: int, **extra) -> dict:
  """A longrope rope_scaling of n factors a list, original context 32 tokens."""
  return dict(original_max_position_embeddings=32, rope_scaling=dict(
      rope_type="longrope", short_factor=list(1 + _RNG.random(n)),
      long_factor=list(1 + 4 * _RNG.random(n)), **extra))


FAMILIES = {
    "phi3": dict(sliding_window=64),
    "phi3-longrope": _longrope(8),  # head_dim 16: 8 frequencies
    # Phi-4-mini's: 12 of the 16 dims rotate (6 frequencies), tied embeddings.
    "phi3-partial": dict(partial_rotary_factor=0.75, tie_word_embeddings=True,
                         **_longrope(6, partial_rotary_factor=0.75)),
}
# 20 tokens: within longrope's original 32 (its short factors); 40: past it (long).
SHORT, LONG = (_RNG.integers(0, 96, (2, n)) for n in (20, 40))
PROMPTS = [[5, 17, 3, 44, 9], list(range(1, 12)), [60]]


@pytest.fixture(autouse=True)
def highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
  """(name, folder, transformers' float32 model, jzo config, float32 params)."""
  torch.manual_seed(0)
  model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
      **_SHAPE, **FAMILIES[request.param], attn_implementation="eager")).eval()
  folder = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(folder)
  config, sources = hf.param_sources(folder)
  assert all(isinstance(x, jzo.HostLeaf) for x in jax.tree.leaves(sources))
  return request.param, folder, model, config, jax.tree.map(lambda leaf: leaf.load(), sources)


def test_logits_equal_transformers(checkpoint):
  name, _, model, config, params = checkpoint
  assert config.model_type == "phi3"
  assert config.rope_type == ("default" if name == "phi3" else "longrope")
  assert config.rotary_dim == (12 if name == "phi3-partial" else 16)
  shapes = jax.eval_shape(lambda: llama.init_params(config, jax.random.key(0)))
  assert jax.tree.map(np.shape, params) == jax.tree.map(lambda x: x.shape, shapes)
  assert sum(x.size for x in jax.tree.leaves(params)) == config.n_params
  # The fused qkv_proj (Q + 2 KV, D) and gate_up_proj (2 F, D) are jzo's kernels, transposed.
  np.testing.assert_array_equal(params["layers"]["qkv"]["kernel"][0],
                                model.model.layers[0].self_attn.qkv_proj.weight.detach().T)
  np.testing.assert_array_equal(params["layers"]["gate_up"]["kernel"][1],
                                model.model.layers[1].mlp.gate_up_proj.weight.detach().T)
  for tokens in (SHORT, LONG):
    _assert_close(llama.forward(config, params, tokens), _torch_logits(model, tokens))
  if name == "phi3":  # Phi-3-mini-4k's window: a longer sequence is refused
    with pytest.raises(ValueError, match="sliding window of 64"):
      llama.forward(config, params, np.zeros((1, 65), np.int32))


def test_longrope_picks_its_factors_by_the_sequence_length(checkpoint):
  """Past the original context the long factors rotate every position, so
  the first 20 positions' logits change with the sequence's length."""
  name, _, _, config, params = checkpoint
  within = np.asarray(llama.forward(config, params, LONG[:, :32]))[:, :20]
  past = np.asarray(llama.forward(config, params, LONG[:, :33]))[:, :20]
  if name == "phi3":
    np.testing.assert_allclose(within, past, rtol=1e-5, atol=1e-5)
  else:
    assert np.abs(within - past).max() > 1e-3


def test_export_loads_unchanged_in_transformers(checkpoint, tmp_path):
  _, _, _, config, params = checkpoint
  hf.save_pretrained(str(tmp_path), config, params, dtype="float32")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), attn_implementation="eager", torch_dtype=torch.float32).eval()
  assert type(model).__name__ == "Phi3ForCausalLM"
  for tokens in (SHORT, LONG):
    _assert_close(_torch_logits(model, tokens), llama.forward(config, params, tokens))
  again, sources = hf.param_sources(str(tmp_path))
  assert again == config
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(lambda x: x.load(), sources), params)


def test_greedy_generation_equals_transformers(checkpoint):
  """Within longrope's original context (transformers recomputes its cache
  past it, jzo does not)."""
  _, _, model, config, params = checkpoint
  theirs = []
  for prompt in PROMPTS:
    with torch.no_grad():
      out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16,
                           eos_token_id=None, pad_token_id=0)
    theirs.append(out[0, len(prompt):].tolist())
  assert decoding.generate(config, params, PROMPTS, 16) == theirs


def test_engine_trains_at_stage_3_with_the_gradients_over_the_weights(checkpoint):
  name, folder, _, _, _ = checkpoint
  if name != "phi3-partial":
    pytest.skip("one model trains here")
  config, sources = hf.param_sources(folder, remat="dots")
  loss = lambda p, b: llama.loss_fn(config, p, b)
  engine = jzo.ZeroEngine(loss, sources, jzo.cpu_adamw(3e-3),
                          options=jzo.EngineOptions(stage=3, layers=llama.LAYERS, offload=True,
                                                    grads_in_params=True,
                                                    compute_dtype=np.float32),
                          mesh=Mesh(np.array(jax.devices()[:4]), ("data",)))
  params = jax.tree.map(lambda leaf: leaf.load(), sources)
  rng = np.random.default_rng(1)
  batch = {"tokens": rng.integers(0, config.vocab_size, (8, 41)).astype(np.int32)}  # long
  want, grads = jax.jit(jax.value_and_grad(loss))(params, batch)
  losses = [engine.step(batch) for _ in range(3)]
  np.testing.assert_allclose(float(losses[0].loss), want, rtol=1e-5)
  norm = math.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(grads)))
  np.testing.assert_allclose(float(losses[0].grad_norm), norm, rtol=1e-5)
  trained = engine.params
  engine.close()
  assert float(losses[-1].loss) < float(losses[0].loss)
  assert not np.allclose(trained["layers"]["qkv"]["kernel"], params["layers"]["qkv"]["kernel"])


def test_older_longrope_spellings_and_transformers_defaults():
  """Phi-3-mini-128k's config.json: rope_scaling of type "su" beside a
  top-level rope_theta; factor max / original, attention factor
  sqrt(1 + ln factor / ln original)."""
  short, long = [1.0] * 8, [2.0] * 8
  hf_config = dict(model_type="phi3", vocab_size=96, hidden_size=64, intermediate_size=112,
                   num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                   original_max_position_embeddings=32, rope_theta=5e4,
                   rope_scaling={"type": "su", "short_factor": short, "long_factor": long})
  config = llama.LlamaConfig.from_hf(hf_config)
  assert (config.rope_type, config.rope_theta, config.rope_original_seq_len) == (
      "longrope", 5e4, 32)
  assert config.rope_factor == 4.0 and config.n_kv_head == 4 and config.sliding_window is None
  assert config.rope_attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))
  assert llama.LlamaConfig.from_hf(config.to_hf()) == config
  given = llama.LlamaConfig.from_hf(hf_config | {"rope_scaling": hf_config["rope_scaling"] | {
      "attention_factor": 1.5, "factor": 8.0}})
  assert (given.rope_attention_factor, given.rope_factor) == (1.5, 8.0)


def test_the_phi4_preset_has_the_published_size():
  phi4 = llama.PRESETS["phi-4"]
  assert phi4.n_params == phi4.n_active_params == 14_659_507_200
  assert llama.LlamaConfig.from_hf(phi4.to_hf()) == phi4
  assert phi4.to_hf()["architectures"] == ["Phi3ForCausalLM"]


_BASE = dict(model_type="phi3", vocab_size=96, hidden_size=64, intermediate_size=112,
             num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("change, message", [
    ({"resid_pdrop": 0.1}, r"resid_pdrop 0.1 is not supported \(jzo trains without dropout\)"),
    ({"embd_pdrop": 0.1}, "embd_pdrop 0.1 is not supported"),
    ({"attention_dropout": 0.1}, "attention_dropout 0.1 is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not supported"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8}},
     "longrope's rope_short_factor must hold rotary_dim / 2 = 8 factors"),
    ({"partial_rotary_factor": 0.2}, "the rotated part of each head .* must be even"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"model_type": "llama", "partial_rotary_factor": 0.5},
     "partial_rotary_factor is not supported for llama"),
])
def test_refused_fields_are_named(change, message):
  with pytest.raises(ValueError, match=message) as e:
    llama.LlamaConfig.from_hf(_BASE | change)
  assert "\n" not in str(e.value)


def test_a_phi3_config_with_biases_has_no_form():
  config = llama.LlamaConfig.from_hf(_BASE)
  with pytest.raises(ValueError, match="model_type phi3 has no form for qkv_bias=True"):
    dataclasses.replace(config, qkv_bias=True).to_hf()
