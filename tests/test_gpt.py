"""The GPT presets: parameter counts against the formula, shapes, sampling."""

import jax
import numpy as np
import pytest

from models import gpt


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


def test_forward_is_causal_and_sampling_stays_in_vocab():
  config = gpt.PRESETS["tiny"]
  params = gpt.init_params(config, jax.random.PRNGKey(0))
  tokens = np.arange(16, dtype=np.int32)[None]
  changed = tokens.copy()
  changed[0, 10:] = 7  # a change at position 10 must not move earlier logits
  a, b = gpt.forward(config, params, tokens), gpt.forward(config, params, changed)
  np.testing.assert_allclose(a[0, :10], b[0, :10], rtol=1e-5, atol=1e-5)
  assert not np.allclose(a[0, 10:], b[0, 10:])
  out = gpt.generate(config, params, np.array([1, 2, 3]), 5, jax.random.PRNGKey(1))
  assert out.shape == (5,) and out.min() >= 0 and out.max() < config.vocab_size
  with pytest.raises(ValueError, match="longer than the model"):
    gpt.forward(config, params, np.zeros((1, config.seq_len + 1), np.int32))
