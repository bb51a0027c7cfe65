"""The GPT presets: parameter counts against the formula, shapes, sampling."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jzo.models import gpt


@pytest.mark.parametrize("name", list(gpt.PRESETS))
def test_parameter_count_matches_formula(name):
  config = gpt.PRESETS[name]
  shapes = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  assert sum(x.size for x in jax.tree.leaves(shapes)) == config.n_params
  assert config.vocab_size % 128 == 0


def test_known_sizes():
  assert round(gpt.PRESETS["gpt2-1.5b"].n_params / 1e9, 2) == 1.56
  assert round(gpt.PRESETS["gpt2-4b"].n_params / 1e9, 2) == 4.24
  assert round(gpt.PRESETS["gpt2-10b"].n_params / 1e9, 1) == 10.3
  assert round(gpt.PRESETS["gpt2-20b"].n_params / 1e9, 2) == 20.25


def test_forward_is_causal_and_checks_its_length():
  config = gpt.PRESETS["tiny"]
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  tokens = np.arange(16, dtype=np.int32)[None]
  changed = tokens.copy()
  changed[0, 10:] = 7  # a change at position 10 must not move earlier logits
  a, b = gpt.forward(config, params, tokens), gpt.forward(config, params, changed)
  np.testing.assert_allclose(a[0, :10], b[0, :10], rtol=1e-5, atol=1e-5)
  assert not np.allclose(a[0, 10:], b[0, 10:])
  with pytest.raises(ValueError, match="longer than the model"):
    gpt.forward(config, params, np.zeros((1, config.seq_len + 1), np.int32))


def test_remat_policies_give_the_same_gradients():
  base = gpt.PRESETS["tiny"]
  params = gpt.init_params(base, jax.random.PRNGKey(0))
  batch = {"tokens": jax.random.randint(jax.random.PRNGKey(1), (2, 33), 0, base.vocab_size)}
  with jax.default_matmul_precision("highest"):  # GPUs would round float32 matmuls to TF32
    grads = {remat: jax.grad(functools.partial(
                 gpt.loss_fn, dataclasses.replace(base, remat=remat)))(params, batch)
             for remat in gpt.REMAT_POLICIES}
  for remat in ("dots", "none"):
    for a, b in zip(jax.tree.leaves(grads["full"]), jax.tree.leaves(grads[remat])):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bad_config_values():
  with pytest.raises(ValueError, match="remat must be one of full, dots, none"):
    gpt.GPTConfig(remat="all")
  with pytest.raises(ValueError, match="attention must be auto, cudnn or xla"):
    gpt.GPTConfig(attention="flash")
  with pytest.raises(ValueError, match="not a multiple of n_head"):
    gpt.GPTConfig(d_model=100, n_head=3)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs a GPU")
def test_cudnn_attention_matches_xla_on_gpu():
  base = dataclasses.replace(gpt.PRESETS["tiny"], n_head=2)  # head size 64
  params = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16),
                        gpt.init_params(base, jax.random.PRNGKey(0)))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 128), 0, base.vocab_size)
  logits = {impl: jax.jit(functools.partial(
                gpt.forward, dataclasses.replace(base, attention=impl)))(params, tokens)
            for impl in ("cudnn", "xla")}
  assert gpt.attention_implementation(base.attention, 64, jax.numpy.bfloat16) == "cudnn"
  np.testing.assert_allclose(np.asarray(logits["cudnn"], np.float32),
                             np.asarray(logits["xla"], np.float32), atol=0.05, rtol=0.05)


def test_loss_is_the_mean_next_token_cross_entropy():
  """The fused form (logsumexp - target logit) against log_softmax + gather."""
  config = gpt.PRESETS["tiny"]
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 33), 0, config.vocab_size)

  def reference(params):
    logp = jax.nn.log_softmax(gpt.forward(config, params, tokens[:, :-1]).astype(np.float32))
    return -jax.numpy.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()
  loss, grads = jax.value_and_grad(gpt.loss_fn, argnums=1)(config, params, {"tokens": tokens})
  want, want_grads = jax.value_and_grad(reference)(params)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_the_nnx_module_and_the_functions_are_one_model():
  config = gpt.PRESETS["tiny"]
  key = jax.random.PRNGKey(0)
  model = gpt.GPT(config, rngs=nnx.Rngs(key))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, config.vocab_size)
  np.testing.assert_array_equal(model(tokens),
                                gpt.forward(config, gpt.init_params(config, key), tokens))
  params = gpt.init_params(config, key)
  assert params["blocks"]["qkv"]["kernel"].shape == (config.n_layer, 128, 384)
  # GPT-2 initialisation: residual projections at 0.02 / sqrt(2 L), the rest at 0.02.
  assert np.std(params["blocks"]["fc"]["kernel"]) == pytest.approx(0.02, rel=0.05)
  assert np.std(params["blocks"]["out"]["kernel"]) == pytest.approx(0.02 / 2, rel=0.05)


def test_forward_computes_in_the_params_dtype():
  """bf16 params give bf16 activations (cuDNN attention needs them; a float32
  promotion would also double the activations' memory)."""
  config = gpt.PRESETS["tiny"]
  params = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16),
                        gpt.init_params(config, jax.random.PRNGKey(0)))
  seen = []
  jaxpr = jax.make_jaxpr(functools.partial(gpt.forward, config))(
      params, np.zeros((1, 8), np.int32))
  for eqn in jaxpr.eqns:
    seen += [v.aval.dtype for v in eqn.outvars if eqn.primitive.name == "dot_general"]
  assert jaxpr.out_avals[0].dtype == jax.numpy.bfloat16
  assert seen and set(seen) == {np.dtype(jax.numpy.bfloat16)}
