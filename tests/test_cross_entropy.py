"""The loss through the head in chunks: torch's cross-entropy as the reference,
its gradients' dtypes under loss scaling, its memory, and the models and the
engine training with it as with all the logits at once."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh

import jzo
from jzo.models import cross_entropy as ce, llama

B, T, D, V = 3, 45, 32, 200


def _inputs(dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  hidden = jax.random.normal(k[0], (B, T, D)).astype(dtype)
  head = (0.3 * jax.random.normal(k[1], (V, D))).astype(dtype)
  targets = jax.random.randint(k[2], (B, T), 0, V)
  weight = 2 * jax.random.uniform(k[3], (B, T))
  return hidden, head, targets, weight


def _torch(hidden, head, targets, weight):
  """Loss and gradients (hidden, head) by torch.nn.functional.cross_entropy."""
  h = torch.tensor(np.asarray(hidden), requires_grad=True)
  w = torch.tensor(np.asarray(head), requires_grad=True)
  labels = torch.tensor(np.asarray(targets)).long().reshape(-1)
  per = torch.nn.functional.cross_entropy((h @ w.T).reshape(-1, V), labels, reduction="none")
  if weight is not None:
    per = per * torch.tensor(np.asarray(weight)).reshape(-1)
  loss = per.mean()
  loss.backward()
  return loss.item(), h.grad.numpy(), w.grad.numpy()


@pytest.mark.parametrize("chunk", [B * T, 16, 50], ids=["all", "16", "50"])
@pytest.mark.parametrize("weighted", [False, True])
def test_loss_and_gradients_match_torch(chunk, weighted):
  hidden, head, targets, weight = _inputs()
  weight = weight if weighted else None
  with jax.default_matmul_precision("highest"):
    loss, (d_hidden, d_head) = jax.value_and_grad(
        lambda h, w: ce.cross_entropy(h, w, targets, weight, chunk=chunk), (0, 1))(hidden, head)
    value = ce.cross_entropy(hidden, head, targets, weight, chunk=chunk)  # no gradient
  want = _torch(hidden, head, targets, weight)
  np.testing.assert_allclose([float(loss), float(value)], want[0], rtol=1e-6)
  np.testing.assert_allclose(d_hidden, want[1], rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(d_head, want[2], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_gradients_keep_their_dtype_under_a_loss_scale(dtype):
  """fp16's loss scale multiplies the chunks' float32 gradients before they
  are rounded: the same gradients as float32, scaled, in the inputs' dtype."""
  hidden, head, targets, weight = _inputs()
  scale = 2.0**14
  low = jax.grad(lambda h, w: scale * ce.cross_entropy(h, w, targets, weight, chunk=16),
                 (0, 1))(hidden.astype(dtype), head.astype(dtype))
  with jax.default_matmul_precision("highest"):
    wide = jax.grad(lambda h, w: scale * ce.cross_entropy(h, w, targets, weight),
                    (0, 1))(hidden.astype(dtype).astype(jnp.float32),
                            head.astype(dtype).astype(jnp.float32))
  for got, want in zip(low, wide):
    assert got.dtype == dtype and bool(jnp.all(jnp.isfinite(got)))
    err = jnp.abs(got.astype(jnp.float32) - want).max() / jnp.abs(want).max()
    assert err < 2e-2, err


def _shapes(n, vocab, d):
  """Abstract bf16 hidden states (1, n, d) and head (vocab, d), int targets."""
  return (jax.ShapeDtypeStruct((1, n, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((vocab, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, n), jnp.int32))


def _value_and_grad(chunk):
  """The loss and its gradients with respect to the hidden states and head."""
  return jax.value_and_grad(lambda h, w, t: ce.cross_entropy(h, w, t, chunk=chunk), (0, 1))


def _temporaries(chunk, n, vocab, d):
  """XLA's temporaries (bytes, default backend) of _value_and_grad(chunk)."""
  compiled = jax.jit(_value_and_grad(chunk)).lower(*_shapes(n, vocab, d)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunks_hold_a_fraction_of_the_logits():
  """Compiled value and gradients (XLA's temporaries on the default backend)
  in chunks of 512 of 8192 positions: within what loss_bytes counts for
  them, which is less than the logits in bf16 that all at once take."""
  n, vocab, d = 8192, 8192, 64
  counted = 512 * vocab * 10 + 4 * d * (n + vocab)
  assert _temporaries(512, n, vocab, d) <= counted < n * vocab * 2 <= _temporaries(n, n, vocab, d)


def test_chunks_that_do_not_divide_the_positions_pad_nothing():
  """Chunks of 640 and 896 of 8192 positions (multiples of 128, as
  chunk_tokens picks): the last one overlaps the one before rather than
  padding the positions. No pad in the program, and no more temporaries
  than chunks of 1024 that divide them, but for one chunk's float32 rows:
  less than a copy of the hidden states. (Not 1920 against 2048: there XLA
  on the GPU splits the head's gradient matmul four ways, with a workspace
  of 32 MiB.)"""
  n, vocab, d = 8192, 1024, 512
  for chunk, dividing in ((640, 1024), (896, 1024)):
    assert "pad" not in str(jax.make_jaxpr(_value_and_grad(chunk))(*_shapes(n, vocab, d)))
    assert (_temporaries(chunk, n, vocab, d)
            <= _temporaries(dividing, n, vocab, d) + chunk * d * 4)


@pytest.mark.parametrize("n, scans", [(1024, False), (8192, True)])
def test_the_default_takes_the_way_of_fewer_bytes(n, scans):
  """V = 65,536 and D = 64: chunks of 2048 positions (2**29 bytes of float32
  logits); at 1024 positions all the logits are fewer bytes."""
  vocab = 2**16
  assert ce.chunk_tokens(vocab, n) == min(2048, n)
  plain = n * vocab * 6
  assert (ce.loss_bytes(n, vocab, 64) < plain) == scans
  jaxpr = jax.make_jaxpr(_value_and_grad(None))(*_shapes(n, vocab, 64))
  assert ("scan" in str(jaxpr)) == scans


def test_bad_shapes_are_named():
  hidden, head, targets, weight = _inputs()
  with pytest.raises(ValueError, match=r"head must be \(vocab, 32\).*got \(200, 31\)"):
    ce.cross_entropy(hidden, head[:, :31], targets)
  with pytest.raises(ValueError, match=r"targets must be \(3, 45\).*got \(3, 44\)"):
    ce.cross_entropy(hidden, head, targets[:, :44])
  with pytest.raises(ValueError, match=r"weight must be \(3, 45\).*got \(135,\)"):
    ce.cross_entropy(hidden, head, targets, weight.reshape(-1))


def _batch(config, rows=8, seed=1):
  rng = np.random.default_rng(seed)
  return {"tokens": rng.integers(0, config.vocab_size, (rows, 65)).astype(np.int32),
          "loss_weight": (rng.random((rows, 64)) < 0.7) * rng.random((rows, 64), np.float32) * 2}


def test_the_model_loss_in_chunks_matches_all_logits(monkeypatch):
  config = llama.PRESETS["llama-tiny"]
  params = llama.init_params(config, jax.random.PRNGKey(0))
  batch = _batch(config)
  value_and_grad = jax.jit(jax.value_and_grad(functools.partial(llama.loss_fn, config)))
  with jax.default_matmul_precision("highest"):
    plain = value_and_grad(params, batch)
    monkeypatch.setattr(ce, "CHUNK_LOGITS_BYTES", 128 * 4 * 256)
    assert "scan" in str(jax.make_jaxpr(functools.partial(ce.cross_entropy, chunk=None))(
        jnp.zeros((8, 64, config.d_model)), params["embed"], batch["tokens"][:, 1:]))
    chunked = jax.jit(jax.value_and_grad(functools.partial(llama.loss_fn, config)))(
        params, batch)
  np.testing.assert_allclose(chunked[0], plain[0], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
               chunked[1], plain[1])


@pytest.mark.parametrize("stage", [2, 3])
def test_the_engine_trains_with_chunks_as_with_all_logits(monkeypatch, stage):
  config = dataclasses.replace(llama.PRESETS["llama-tiny"], remat="full")
  params = llama.init_params(config, jax.random.PRNGKey(0))
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))

  def losses():
    engine = jzo.ZeroEngine(functools.partial(llama.loss_fn, config), params, jzo.cpu_adamw(3e-3),
                            options=jzo.EngineOptions(stage=stage,
                                                      layers=llama.LAYERS if stage == 3 else None,
                                                      compute_dtype=jnp.float32),
                            mesh=mesh)
    out = [float(engine.step(_batch(config, rows=32, seed=s)).loss) for s in range(3)]
    engine.close()
    return out
  with jax.default_matmul_precision("highest"):
    plain = losses()
    # 4 devices x 8 rows x 64 positions: 512 a device, four chunks of 128.
    monkeypatch.setattr(ce, "CHUNK_LOGITS_BYTES", 128 * 4 * 256)
    chunked = losses()
  np.testing.assert_allclose(chunked, plain, rtol=2e-5)
  assert chunked[-1] < chunked[0]
