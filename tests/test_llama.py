"""The Llama family: published sizes, the masked loss, GQA, RoPE configs, refusals."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jzo.models import llama

TINY = llama.PRESETS["llama-tiny"]


@pytest.fixture(scope="module")
def tiny_params():
  return llama.init_params(TINY, jax.random.PRNGKey(0))


# Parameter counts as the Hugging Face hub reports them (safetensors metadata).
KNOWN = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
         "llama-3.1-8b": 8_030_261_248, "llama-2-13b": 13_015_864_320,
         "mistral-7b": 7_248_023_552, "qwen2.5-7b": 7_615_616_512,
         "qwen2.5-14b": 14_770_033_664, "llama-3.1-70b": 70_553_706_496,
         "qwen2.5-72b": 72_706_203_648}


@pytest.mark.parametrize("name", list(KNOWN))
def test_presets_have_the_published_sizes(name):
  assert llama.PRESETS[name].n_params == KNOWN[name]


@pytest.mark.parametrize("variant", [{}, {"qkv_bias": True, "o_bias": True},
                                     {"qk_norm": True, "head_dim": 48, "tie_embeddings": True}])
def test_parameter_count_matches_the_params(variant):
  config = dataclasses.replace(TINY, **variant)
  shapes = jax.eval_shape(lambda: llama.init_params(config, jax.random.PRNGKey(0)))
  assert sum(x.size for x in jax.tree.leaves(shapes)) == config.n_params
  assert ("lm_head" in shapes) != config.tie_embeddings
  assert shapes[llama.LAYERS]["qkv"]["kernel"].shape == (2, 128, (4 + 2 * 2) * config.head_dim)


def test_flops_and_activation_bytes():
  config = llama.PRESETS["llama-3.1-8b"]
  assert config.flops_per_token(2048) == 6 * config.n_params + 12 * 32 * 4096 * 2048
  by_remat = [llama.activation_bytes(dataclasses.replace(config, remat=r), 2, 2048)
              for r in ("full", "dots", "none")]
  assert by_remat[0] < by_remat[1] < by_remat[2]
  # remat full: the loss is the peak. At 4096 tokens all the 128k-vocabulary
  # logits and their float32 gradient take fewer bytes than chunks of them
  # beside float32 gradients of the head and the hidden states.
  logits = 2 * 2048 * 128256 * 6
  assert by_remat[0] == 32 * 2 * 2048 * 4096 * 2 + logits
  # At 16 sequences the chunks (1024 positions' float32 logits at a time) take
  # fewer bytes than all the logits, and fewer than one layer's backward,
  # which is then the peak.
  tokens = 16 * 2048
  loss = 1024 * 128256 * (4 + 4 + 2) + 4 * 4096 * (tokens + 128256)
  layer = tokens * (9 * 4096 + 3 * 1024 + 6 * 14336) * 2
  assert loss < layer < tokens * 128256 * 6
  assert llama.activation_bytes(config, 16, 2048) == 32 * tokens * 4096 * 2 + layer


def test_forward_is_causal_bf16_and_checks_its_length(tiny_params):
  tokens = np.arange(16, dtype=np.int32)[None]
  changed = tokens.copy()
  changed[0, 10:] = 7  # a change at position 10 must not move earlier logits
  a, b = llama.forward(TINY, tiny_params, tokens), llama.forward(TINY, tiny_params, changed)
  np.testing.assert_allclose(a[0, :10], b[0, :10], rtol=1e-5, atol=1e-5)
  assert not np.allclose(a[0, 10:], b[0, 10:])
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_params)
  assert llama.forward(TINY, bf16, tokens).dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="longer than the model's 128"):
    llama.forward(TINY, tiny_params, np.zeros((1, 129), np.int32))
  windowed = dataclasses.replace(TINY, sliding_window=8)
  llama.forward(windowed, tiny_params, tokens[:, :8])
  with pytest.raises(ValueError, match="longer than the model's sliding window of 8"):
    llama.forward(windowed, tiny_params, tokens)


def test_masked_loss_is_the_weighted_mean_of_cross_entropies(tiny_params):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, TINY.vocab_size, (3, 13)).astype(np.int32)
  mask = (rng.random((3, 12)) < 0.3).astype(np.float32)
  weight = mask * mask.size / mask.sum()  # what the recipe passes: mean over answer tokens
  with jax.default_matmul_precision("highest"):
    logits = np.asarray(llama.forward(TINY, tiny_params, tokens[:, :-1]), np.float64)
    plain = llama.loss_fn(TINY, tiny_params, {"tokens": tokens})
    masked = llama.loss_fn(TINY, tiny_params, {"tokens": tokens, "loss_weight": weight})
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ce = -np.take_along_axis(log_probs, tokens[:, 1:, None], -1)[..., 0]  # (B, T)
  np.testing.assert_allclose(plain, ce.mean(), rtol=1e-5)
  np.testing.assert_allclose(masked, (ce * mask).sum() / mask.sum(), rtol=1e-5)


def test_grouped_query_attention_equals_repeated_heads(tiny_params):
  """K/V heads shared by n_head / n_kv_head query heads each, in order."""
  H, K, hd = TINY.n_head, TINY.n_kv_head, TINY.head_dim
  kernel = tiny_params["layers"]["qkv"]["kernel"]  # (L, D, (H + 2 K) hd)
  q, k, v = np.split(np.asarray(kernel), [H * hd, (H + K) * hd], axis=-1)
  repeat = lambda x: np.repeat(x.reshape(*x.shape[:2], K, 1, hd), H // K, 3).reshape(
      *x.shape[:2], H * hd)  # (L, D, H hd)
  mha = dataclasses.replace(TINY, n_kv_head=H)
  params = jax.tree.map(lambda x: x, tiny_params)
  params["layers"]["qkv"]["kernel"] = np.concatenate([q, repeat(k), repeat(v)], -1)
  tokens = np.arange(20, dtype=np.int32)[None]
  with jax.default_matmul_precision("highest"):
    np.testing.assert_allclose(llama.forward(TINY, tiny_params, tokens),
                               llama.forward(mha, params, tokens), rtol=1e-5, atol=1e-5)


def test_remat_policies_give_the_same_gradients(tiny_params):
  batch = {"tokens": jax.random.randint(jax.random.PRNGKey(1), (2, 17), 0, TINY.vocab_size)}
  with jax.default_matmul_precision("highest"):
    grads = {remat: jax.grad(functools.partial(
                 llama.loss_fn, dataclasses.replace(TINY, remat=remat)))(tiny_params, batch)
             for remat in llama.REMAT_POLICIES}
  for remat in ("dots", "none"):
    for a, b in zip(jax.tree.leaves(grads["full"]), jax.tree.leaves(grads[remat])):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


HF = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 112,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 128, "rms_norm_eps": 1e-5}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def test_both_rope_spellings_read_the_same_and_presets_round_trip():
  old = llama.LlamaConfig.from_hf(HF | {"rope_theta": 5e5,
                                        "rope_scaling": {"rope_type": "llama3", **LLAMA3}})
  new = llama.LlamaConfig.from_hf(HF | {"rope_parameters": {"rope_type": "llama3",
                                                            "rope_theta": 5e5, **LLAMA3}})
  assert old == new and new.rope_type == "llama3" and new.rope_theta == 5e5
  linear = llama.LlamaConfig.from_hf(HF | {"rope_scaling": {"type": "linear", "factor": 2.0}})
  assert (linear.rope_type, linear.rope_factor, linear.rope_theta) == ("linear", 2.0, 1e4)
  for config in llama.PRESETS.values():
    assert llama.LlamaConfig.from_hf(config.to_hf()) == config
  qwen = llama.LlamaConfig.from_hf(HF | {"model_type": "qwen2", "sliding_window": 131072,
                                         "use_sliding_window": False})
  assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None
  several_eos = llama.LlamaConfig.from_hf(HF | {"eos_token_id": [1, 2]})
  assert several_eos.eos_token_id == (1, 2) and several_eos.to_hf()["eos_token_id"] == [1, 2]
  assert llama.LlamaConfig.from_hf(HF, remat="dots", seq_len=64).seq_len == 64
  qwen3 = llama.LlamaConfig.from_hf(HF | {"model_type": "qwen3"})
  assert qwen3.qk_norm and qwen3.head_dim == 128  # transformers' Qwen3 default


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt_neox"},
     "model_type 'gpt_neox' is not supported (only llama, mistral, qwen2, qwen3, phi3, "
     "qwen3_moe, mixtral)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope type 'yarn' is not supported (only default, linear, llama3, longrope)"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope type 'dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor is not supported"),
    ({"num_key_value_heads": 3}, "n_head 4 is not a multiple of n_kv_head 3"),
])
def test_from_hf_refuses_what_it_cannot_run(change, message):
  with pytest.raises(ValueError) as e:
    llama.LlamaConfig.from_hf(HF | change)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_config_values():
  with pytest.raises(ValueError, match="remat must be one of full, dots, none"):
    llama.LlamaConfig(remat="all")
  with pytest.raises(ValueError, match="rope type 'ntk' is not supported"):
    llama.LlamaConfig(rope_type="ntk")
  with pytest.raises(ValueError, match="model_type mistral has no form for qkv_bias=True"):
    llama.LlamaConfig(model_type="mistral", qkv_bias=True).to_hf()
