"""The sampling loop the models share (jzo.models.sampling), on a toy model
whose next token is the sum of the tokens it sees: the tokens drawn show
exactly which ones were in the window."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jzo.models import sampling

VOCAB = 97


def sum_model(params, tokens):
  """Logits (1, T, VOCAB) that put all the mass on (tokens[:t + 1].sum() % VOCAB)."""
  return 1e4 * jax.nn.one_hot(jnp.cumsum(tokens, axis=1) % VOCAB, VOCAB)


def expected(prompt, n_tokens, window):
  seq = list(prompt)
  for _ in range(n_tokens):
    seq.append(sum(seq[-(window - 1):]) % VOCAB)
  return seq[len(prompt):]


@pytest.mark.parametrize("prompt, n_tokens, window", [([5], 3, 16), ([1, 2, 3], 20, 6),
                                                      (list(range(1, 12)), 4, 5)])
def test_each_token_sees_the_last_window_less_one(prompt, n_tokens, window):
  out = sampling.generate(sum_model, {}, np.array(prompt), n_tokens, window,
                          jax.random.PRNGKey(0), temperature=1.0)
  assert out.dtype == np.int32
  assert out.tolist() == expected(prompt, n_tokens, window)


def test_an_empty_prompt_is_refused():
  with pytest.raises(ValueError, match="at least one token"):
    sampling.generate(sum_model, {}, np.array([], np.int32), 3, 8, jax.random.PRNGKey(0), 1.0)
