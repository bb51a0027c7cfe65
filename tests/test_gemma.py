"""Gemma 2 and Gemma 3 (text) against transformers' own models, made here
tiny and random (sequences longer than the sliding window, both layer
types, soft-capping where Gemma 2 has it, Gemma 3's own RoPE per layer
type): logits, loss, export back into transformers, training through the
ZeRO engine, greedy generation, and one-line refusals of what jzo does not
implement; and the text model of a Gemma 3 image-text checkpoint."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import Mesh

import jzo
from jzo.models import cross_entropy, decoding, gemma, hf
from jzo.models.gemma import GemmaConfig

from test_hf import _assert_close, _loaded, _torch_logits

_SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
              max_position_embeddings=128)
SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma 2 alternates (its default) with strong soft-caps; Gemma 3 with a
# layer order of its own, untied, its global layers' RoPE scaled linearly.
FAMILIES = {
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        num_hidden_layers=3, sliding_window=8, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0)),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        num_hidden_layers=4, sliding_window=6, layer_types=[SLIDING, FULL, SLIDING, SLIDING],
        final_logit_softcapping=3.0, tie_word_embeddings=False,
        rope_parameters={FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
                         SLIDING: {"rope_type": "default", "rope_theta": 50.0}})),
}
TOKENS = np.random.default_rng(0).integers(0, 96, (2, 40))  # 40 tokens: past every window
PROMPTS = [[5, 17, 3, 44, 9], list(range(1, 12)), [60]]


@pytest.fixture(autouse=True)
def highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def _jzo_logits(config, params, tokens=TOKENS) -> np.ndarray:
  return np.asarray(jax.jit(gemma.forward, static_argnums=0)(config, params, tokens))


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
  """(family, folder, transformers' float32 model of the folder's weights,
  jzo's config and float32 params of the folder): every weight drawn
  N(0, 0.3), the norms' too (so their 1 + scale matters), and gemma3_text
  saved in bfloat16."""
  family = request.param
  config_class, model_class, features = FAMILIES[family]
  torch.manual_seed(0)
  model = model_class(config_class(**_SHAPE, **features, attn_implementation="eager"))
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.3)
  folder = str(tmp_path_factory.mktemp(family))
  (model.to(torch.bfloat16) if family == "gemma3_text" else model).save_pretrained(folder)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, attn_implementation="eager", torch_dtype=torch.float32).eval()
  config, sources = hf.param_sources(folder)
  return family, folder, model, config, _loaded(sources)


def test_logits_equal_transformers(checkpoint):
  family, folder, model, config, params = checkpoint
  assert isinstance(config, GemmaConfig) and config.model_type == family
  assert set(config.layer_types) == {SLIDING, FULL} and TOKENS.shape[1] > config.sliding_window
  sources = hf.param_sources(folder)[1]
  leaves = jax.tree.leaves(sources)
  assert all(isinstance(x, jzo.HostLeaf) for x in leaves)
  assert {x.dtype.name for x in leaves} == {"bfloat16" if family == "gemma3_text" else "float32"}
  shapes = jax.eval_shape(lambda: gemma.init_params(config, jax.random.key(0)))
  assert jax.tree.map(lambda x: x.shape, sources) == jax.tree.map(lambda x: x.shape, shapes)
  assert config.n_params == sum(p.numel() for p in model.parameters())  # tied once
  theirs = _torch_logits(model, TOKENS)
  _assert_close(_jzo_logits(config, params), theirs)
  if config.final_softcap is not None:  # the cap is at work
    assert 0.9 * config.final_softcap < np.abs(theirs).max() < config.final_softcap


def test_loss_equals_transformers(checkpoint):
  _, _, model, config, params = checkpoint
  with torch.no_grad():
    theirs = float(model(torch.tensor(TOKENS), labels=torch.tensor(TOKENS)).loss)
  ours = float(jax.jit(gemma.loss_fn, static_argnums=0)(config, params, {"tokens": TOKENS}))
  assert abs(ours - theirs) <= 1e-4 * abs(theirs)


def test_export_loads_unchanged_in_transformers(checkpoint, tmp_path):
  family, _, _, config, params = checkpoint
  hf.save_pretrained(str(tmp_path), config, params, dtype="float32")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), attn_implementation="eager", torch_dtype=torch.float32).eval()
  assert type(model).__name__ == gemma.ARCHITECTURES[family]
  _assert_close(_torch_logits(model, TOKENS), _jzo_logits(config, params))
  again, sources = hf.param_sources(str(tmp_path))
  assert again == config
  jax.tree.map(np.testing.assert_array_equal, _loaded(sources), params)


# Stage 3 with grads_in_params (the engine's own layer scan): gemma3_text
# also with two micro-batches, whose layers run first.
ENGINE = {"gemma2": dict(remat="full"), "gemma3_text": dict(remat="dots", grad_accum=2)}


def test_engine_trains_from_lazy_leaves(checkpoint):
  family, folder, _, _, params = checkpoint
  kw = ENGINE[family]
  config, sources = hf.param_sources(folder, remat=kw["remat"])
  engine = jzo.ZeroEngine(lambda p, b: gemma.loss_fn(config, p, b), sources,
                          jzo.cpu_adamw(3e-3),
                          options=jzo.EngineOptions(stage=3, layers=gemma.LAYERS, offload=True,
                                                    grads_in_params=True,
                                                    grad_accum=kw.get("grad_accum", 1),
                                                    compute_dtype=np.float32),
                          mesh=Mesh(np.array(jax.devices()[:4]), ("data",)))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(a.dtype)), engine.params,
               params)
  rng = np.random.default_rng(1)
  batch = {"tokens": rng.integers(0, config.vocab_size, (8, 17)).astype(np.int32),
           "loss_weight": (rng.random((8, 16)) < 0.5).astype(np.float32) * 2}
  losses = [float(engine.step(batch).loss) for _ in range(4)]
  trained = engine.params
  engine.close()
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert not np.array_equal(trained["layers"]["qkv"]["kernel"],
                            params["layers"]["qkv"]["kernel"].astype(np.float32))


def _greedy(model, prompt: list[int], n: int) -> list[int]:
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def test_greedy_tokens_equal_transformers(checkpoint):
  _, _, model, config, params = checkpoint
  ours = decoding.generate(config, params, PROMPTS, 24)  # past the window: 35 positions
  assert ours == [_greedy(model, prompt, 24) for prompt in PROMPTS]


def test_soft_capped_loss_in_chunks_equals_the_whole():
  rng = np.random.default_rng(2)
  hidden = jnp.asarray(rng.normal(size=(2, 100, 16)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(50, 16)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 50, (2, 100)))
  weight = jnp.asarray(rng.random((2, 100)), jnp.float32)

  def loss(chunk, softcap):
    return jax.jit(jax.value_and_grad(lambda h, w: cross_entropy.cross_entropy(
        h, w, targets, weight, chunk=chunk, softcap=softcap), argnums=(0, 1)))(hidden, head)
  whole, chunked = loss(200, 2.0), loss(64, 2.0)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7), chunked,
               whole)
  logits = 2.0 * jnp.tanh(hidden @ head.T / 2.0)
  want = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(whole[0], (want * weight).mean(), rtol=1e-6)
  assert abs(float(loss(64, None)[0]) - float(whole[0])) > 0.1


def test_config_round_trips_and_layer_patterns():
  for config in gemma.PRESETS.values():
    assert GemmaConfig.from_hf(config.to_hf()) == config
  assert gemma.PRESETS["gemma-2-9b"].layer_types[:3] == (SLIDING, FULL, SLIDING)
  assert gemma.PRESETS["gemma-3-1b"].layer_types[:6] == (SLIDING,) * 5 + (FULL,)
  base = gemma.PRESETS["gemma-3-1b"].to_hf()
  del base["layer_types"]
  for key in ("sliding_window_pattern", "_sliding_window_pattern"):
    hf_config = {k: v for k, v in base.items() if "pattern" not in k} | {key: 3}
    assert hf.config_from_hf(hf_config).layer_types[:3] == (SLIDING, SLIDING, FULL)
  old = {k: v for k, v in base.items() if k != "rope_parameters"} | {
      "rope_theta": 1e5, "rope_local_base_freq": 20.0,
      "rope_scaling": {"type": "linear", "factor": 2.0}}
  read = hf.config_from_hf(old)
  assert (read.rope_theta, read.rope_factor, read.rope_local_theta, read.rope_local_factor) == (
      1e5, 2.0, 20.0, 1.0)
  # flops: 12 H hd per key, a sliding layer counting only its window
  config = gemma.PRESETS["gemma-2-2b"]
  assert config.flops_per_token(8192) - 6 * config.n_params == 12 * 8 * 256 * 13 * (8192 + 4096)


@pytest.mark.parametrize("edit, message", [
    (dict(model_type="gemma3"), "a gemma3 config has no text_config"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    (dict(attention_bias=True), "attention_bias true is not supported"),
    (dict(attention_dropout=0.1), "attention_dropout 0.1 is not supported"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention true is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn' is not supported"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor is not supported"),
    (dict(sliding_window=None), "sliding_window null is not supported"),
    (dict(layer_types=[SLIDING, "chunked_attention"]), "layer_types must give each of the 2"),
])
def test_bad_configs_are_named(edit, message):
  config = dataclasses.replace(gemma.PRESETS["gemma-2-2b"], n_layer=2, layer_types=())
  with pytest.raises(ValueError, match=message) as e:
    hf.config_from_hf(config.to_hf() | edit)
  assert "\n" not in str(e.value)


def test_features_a_format_cannot_say_are_refused():
  with pytest.raises(ValueError, match="cannot soft-cap the attention scores"):
    dataclasses.replace(gemma.PRESETS["gemma-2-2b"], attention="cudnn")
  with pytest.raises(ValueError, match="one RoPE for every layer"):
    dataclasses.replace(gemma.PRESETS["gemma-2-2b"], rope_local_theta=20.0).to_hf()
  with pytest.raises(ValueError, match="does not soft-cap attention scores"):
    dataclasses.replace(gemma.PRESETS["gemma-3-1b"], attn_softcap=50.0).to_hf()


def test_the_text_model_of_an_image_text_checkpoint(tmp_path):
  """Gemma 3 from 4B up: Gemma3ForConditionalGeneration, whose text model
  is read (the vision tower passed over) and written back as gemma3_text."""
  text = dict(_SHAPE, num_hidden_layers=3, sliding_window=6, sliding_window_pattern=3,
              rope_scaling={"rope_type": "linear", "factor": 2.0})
  vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=14)
  torch.manual_seed(0)
  model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
      text_config=text, vision_config=vision, mm_tokens_per_image=4,
      attn_implementation="eager"))
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.3)
  model.eval().save_pretrained(tmp_path / "image-text")
  config, sources = hf.param_sources(str(tmp_path / "image-text"))
  assert config.model_type == "gemma3" and config.layer_types == (SLIDING, SLIDING, FULL)
  params = _loaded(sources)
  ours = _jzo_logits(config, params)
  _assert_close(ours, _torch_logits(model, TOKENS))
  with pytest.raises(ValueError, match="written as its text model alone"):
    hf.save_pretrained(str(tmp_path / "out"), config, params)
  text_only = dataclasses.replace(config, model_type="gemma3_text")
  hf.save_pretrained(str(tmp_path / "text"), text_only, params, dtype="float32")
  exported = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "text"), attn_implementation="eager").eval()
  assert type(exported).__name__ == "Gemma3ForCausalLM"
  _assert_close(_torch_logits(exported, TOKENS), ours)
