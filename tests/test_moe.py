"""Mixtures of experts in the Llama family (Qwen3-MoE, Mixtral): tiny random
models made by transformers' own classes, their logits, losses (cross-entropy
plus the load-balancing loss) and greedy generation against transformers',
the export back into transformers, training through the ZeRO engine with the
optimizer on the host, the grouped expert matmuls against every expert on
every token, the planner's counts, and one-line refusals."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import Mesh

import jzo
from jzo.models import decoding, grouped, hf, llama, moe
from jzo.parallel import layer_scan

from test_hf import _assert_close, _torch_logits

_SHAPE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
# Qwen3-MoE with its top-k weights renormalised and not (k = 3 of 6), and
# Mixtral (always renormalised; its sliding window is refused past 64 tokens).
FAMILIES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        intermediate_size=112, moe_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
        head_dim=24, norm_topk_prob=True, router_aux_loss_coef=0.01)),
    "qwen3_moe-unnormalised": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        intermediate_size=112, moe_intermediate_size=40, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=False, router_aux_loss_coef=0.02)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        intermediate_size=40, num_local_experts=5, num_experts_per_tok=2,
        router_aux_loss_coef=0.02, sliding_window=64)),
}
TOKENS = np.random.default_rng(0).integers(0, 96, (2, 41))
PROMPTS = [[5, 17, 3, 44, 9], list(range(1, 12)), [60]]


@pytest.fixture(autouse=True)
def highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
  """(folder, transformers' float32 model, jzo config, float32 params): Mixtral saved in
  shards (its experts' tensors spread over several files)."""
  config_class, model_class, features = FAMILIES[request.param]
  torch.manual_seed(0)
  model = model_class(config_class(**_SHAPE, **features, attn_implementation="eager")).eval()
  folder = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(folder, max_shard_size="60KB" if "mixtral" in folder else "1GB")
  config, sources = hf.param_sources(folder)
  assert all(isinstance(x, jzo.HostLeaf) for x in jax.tree.leaves(sources))
  return folder, model, config, jax.tree.map(lambda leaf: leaf.load(), sources)


def test_logits_equal_transformers(checkpoint):
  folder, model, config, params = checkpoint
  E, I, D = config.n_experts, config.d_expert, config.d_model
  assert config.model_type == json.load(open(os.path.join(folder, "config.json")))["model_type"]
  shapes = jax.eval_shape(lambda: llama.init_params(config, jax.random.key(0)))
  assert jax.tree.map(np.shape, params) == jax.tree.map(lambda x: x.shape, shapes)
  assert params["layers"]["moe"]["gate_up"].shape == (2, E, D, 2 * I)
  assert params["layers"]["moe"]["down"].shape == (2, E, I, D)
  assert sum(x.size for x in jax.tree.leaves(params)) == config.n_params
  _assert_close(llama.forward(config, params, TOKENS), _torch_logits(model, TOKENS))
  if config.model_type == "mixtral":  # a window shorter than the sequence is refused
    with pytest.raises(ValueError, match="sliding window of 64"):
      llama.forward(config, params, np.zeros((1, 65), np.int32))


def test_loss_adds_the_load_balancing_loss_as_transformers_does(checkpoint):
  _, model, config, params = checkpoint
  inputs = torch.tensor(TOKENS[:, :-1])
  with torch.no_grad():
    theirs = model(inputs, labels=inputs, shift_labels=torch.tensor(TOKENS[:, 1:]),
                   output_router_logits=True)
  aux = llama.router_aux_loss(config, params, TOKENS[:, :-1])
  np.testing.assert_allclose(aux, theirs.aux_loss.numpy(), rtol=1e-5)
  batch = {"tokens": TOKENS}
  np.testing.assert_allclose(llama.loss_fn(config, params, batch), theirs.loss.numpy(), rtol=1e-5)
  plain = dataclasses.replace(config, router_aux_loss_coef=0.0)  # cross-entropy alone
  np.testing.assert_allclose(llama.loss_fn(plain, params, batch),
                             theirs.loss.numpy() - config.router_aux_loss_coef * aux, rtol=1e-5)


def test_export_loads_unchanged_in_transformers(checkpoint, tmp_path):
  _, _, config, params = checkpoint
  hf.save_pretrained(str(tmp_path), config, params, dtype="float32", max_shard_bytes=100_000)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), attn_implementation="eager", torch_dtype=torch.float32).eval()
  assert type(model).__name__ == llama.ARCHITECTURES[config.model_type]
  _assert_close(_torch_logits(model, TOKENS), llama.forward(config, params, TOKENS))
  again, sources = hf.param_sources(str(tmp_path))
  assert again == config
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(lambda x: x.load(), sources), params)


def test_greedy_generation_equals_transformers(checkpoint):
  folder, model, config, params = checkpoint
  if "unnormalised" in folder:
    pytest.skip("the routers' weights differ alone: the other two generate here")
  theirs = []
  for prompt in PROMPTS:
    with torch.no_grad():
      out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16,
                           eos_token_id=None, pad_token_id=0)
    theirs.append(out[0, len(prompt):].tolist())
  assert decoding.generate(config, params, PROMPTS, 16) == theirs


def _batch(config, rows=8, seed=1):
  rng = np.random.default_rng(seed)
  return {"tokens": rng.integers(0, config.vocab_size, (rows, 17)).astype(np.int32),
          "loss_weight": (rng.random((rows, 16)) < 0.5).astype(np.float32) * 2}


def test_gradients_written_over_the_layers_equal_jax_grad(checkpoint):
  """The load-balancing statistics ride the layers' scan beside x: written
  over the layers (grads_in_params' backward), the gradients are jax.grad's."""
  folder, _, config, params = checkpoint
  if "mixtral" not in folder:
    pytest.skip("Qwen3-MoE's gradients are jax.grad's in the engine's test")
  batch, loss = _batch(config), lambda p, b: llama.loss_fn(config, p, b)
  plain = jax.jit(jax.grad(loss))(params, batch)

  def in_place(params, batch):
    with layer_scan.writing_grads_over_layers() as used:
      grads = jax.grad(loss)(params, batch)
    assert used
    return grads
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               jax.jit(in_place)(params, batch), plain)
  assert np.abs(plain["layers"]["moe"]["router"]["kernel"]).max() > 0


def test_engine_trains_as_one_device(checkpoint):
  """With the optimizer on the host over 4 devices at stage 3 (the layers'
  gradients written over their weights), the same gradient norm, losses and
  weights as jax.grad and the same AdamW on one device, of the mean of the
  4 devices' losses (each balances its own micro-batch's experts)."""
  folder, _, _, _ = checkpoint
  if not folder.endswith("qwen3_moe0"):
    pytest.skip("one model trains here (the others' gradients are jax.grad's as well)")
  config, sources = hf.param_sources(folder, remat="dots")

  def loss(params, batch):  # each device's 2 rows
    rows = [jax.tree.map(lambda x: x[2 * d:2 * d + 2], batch) for d in range(4)]
    return sum(llama.loss_fn(config, params, b) for b in rows) / 4
  engine = jzo.ZeroEngine(lambda p, b: llama.loss_fn(config, p, b), sources, jzo.cpu_adamw(3e-3),
                          options=jzo.EngineOptions(stage=3, offload=True, layers=llama.LAYERS,
                                                    grads_in_params=True,
                                                    compute_dtype=np.float32),
                          mesh=Mesh(np.array(jax.devices()[:4]), ("data",)))
  params = jax.tree.map(lambda leaf: leaf.load(), sources)
  tx = jzo.cpu_adamw(3e-3)
  state = tx.init(params)
  grad = jax.jit(jax.value_and_grad(loss))
  for step in range(2):
    batch = _batch(config, seed=step)
    metrics = engine.step(batch)
    want, grads = grad(params, batch)
    np.testing.assert_allclose(float(metrics.loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics.grad_norm), optax_norm(grads), rtol=1e-5)
    updates, state = tx.update(grads, state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
  got = engine.params
  engine.close()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got, params)
  assert np.isfinite(float(metrics.loss))


def optax_norm(tree) -> float:
  return float(jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))))


@pytest.mark.parametrize("float32_weights", [False, True], ids=["qwen3", "mixtral"])
def test_grouped_experts_equal_each_tokens_experts(float32_weights):
  """moe.experts_mlp (rows sorted by expert, grouped matmuls) and its
  gradient against every expert applied to every token, each token's
  chosen ones then weighed and summed."""
  N, D, I, E, k = 7, 6, 5, 4, 2
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (N, D))
  gate_up = jax.random.normal(keys[1], (E, D, 2 * I)) * 0.3
  down = jax.random.normal(keys[2], (E, I, D)) * 0.3
  weights, experts, probs = moe.route(jax.random.normal(keys[3], (N, E)), k, True)
  assert np.allclose(weights.sum(-1), 1) and experts.dtype == jnp.int32
  np.testing.assert_allclose(probs.sum(-1), 1, rtol=1e-6)

  def dense(x, gate_up, down):
    gate, up = jnp.split(jnp.einsum("nd,edf->enf", x, gate_up), 2, axis=-1)
    every = jnp.einsum("enf,efd->ned", jax.nn.silu(gate) * up, down)  # (N, E, D)
    chosen = jnp.take_along_axis(every, experts[..., None], axis=1)  # (N, k, D)
    return jnp.sum(weights[..., None] * chosen, axis=1)
  grouped = lambda *a: moe.experts_mlp(a[0], weights, experts, *a[1:], float32_weights)
  np.testing.assert_allclose(*[jax.jit(f)(x, gate_up, down) for f in (grouped, dense)],
                             rtol=1e-5, atol=1e-6)
  cotangent = jax.random.normal(jax.random.key(5), (N, D))
  grads = [jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * cotangent), argnums=(0, 1, 2)))(
      x, gate_up, down) for f in (grouped, dense)]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), *grads)
  stats = moe.balance_statistics(experts, probs)
  np.testing.assert_array_equal(stats[0], np.bincount(np.asarray(experts).ravel(), minlength=E))


@pytest.mark.parametrize("rows, experts, K, N", [(1000, 8, 256, 512), (4096, 128, 2048, 1536)])
def test_grouped_matmul_kernels_equal_ragged_dot(rows, experts, K, N):
  """On a Hopper GPU, grouped_matmul's kernels and their gradients against
  jax.lax.ragged_dot in float32, with an empty group and groups that share
  the kernels' tiles of rows."""
  x = jnp.zeros((rows, K), jnp.bfloat16)
  if jax.default_backend() != "gpu" or not grouped.runs_kernels(x, x[None, :, :N]):
    pytest.skip("needs a Hopper GPU: the Mosaic GPU kernels run only there (elsewhere "
                "grouped_matmul is jax.lax.ragged_dot, which the other tests cover)")
  keys = jax.random.split(jax.random.key(1), 4)
  x = jax.random.normal(keys[0], (rows, K), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (experts, K, N)) * 0.05).astype(jnp.bfloat16)
  cuts = jnp.sort(jax.random.randint(keys[2], (experts - 1,), 0, rows))
  cuts = cuts.at[2].set(cuts[1])  # group 2 is empty
  sizes = jnp.diff(cuts, prepend=0, append=rows).astype(jnp.int32)
  cotangent = jax.random.normal(keys[3], (rows, N), jnp.float32)

  def value_and_grads(f, dtype):
    y, vjp = jax.vjp(lambda x, w: f(x.astype(dtype), w.astype(dtype), sizes), x, w)
    return (y,) + vjp(cotangent.astype(y.dtype))
  ours = jax.jit(lambda: value_and_grads(grouped.grouped_matmul, jnp.bfloat16))()
  reference = jax.jit(lambda: value_and_grads(jax.lax.ragged_dot, jnp.float32))()
  for name, a, b in zip(["product", "x's gradient", "w's gradient"], ours, reference):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    error = np.abs(a - b).max() / np.abs(b).max()
    assert error < 1e-2, f"{name}: {error:.1e} of the largest value"  # bf16 rounding: 4e-3


def test_presets_count_every_expert_and_the_active_ones():
  """Parameter counts as the Hugging Face hub reports them; FLOPs from the
  active parameters; the planner's activations grow with the experts a token
  takes."""
  qwen, mixtral = llama.PRESETS["qwen3-30b-a3b"], llama.PRESETS["mixtral-8x7b"]
  assert (qwen.n_params, qwen.n_active_params) == (30_532_122_624, 3_353_032_704)
  assert (mixtral.n_params, mixtral.n_active_params) == (46_702_792_704, 12_879_925_248)
  attention = 12 * 48 * 32 * 128 * 4096
  assert qwen.flops_per_token(4096) == 6 * qwen.n_active_params + attention
  for config in (qwen, mixtral):
    assert llama.LlamaConfig.from_hf(config.to_hf()) == config
    by_remat = [llama.activation_bytes(dataclasses.replace(config, remat=r), 2, 2048)
                for r in ("full", "dots", "none")]
    assert by_remat[0] < by_remat[1] < by_remat[2]
  # remat none: per token and layer, attention's 6 D + 3 Q + 3 KV and the
  # experts' 3 k D + 4 k I + E in bf16, plus float32 probabilities, weights
  # and int32 indices; the layer's backward (the gate_ups' gradient) beside them.
  # At 16 sequences of 2048 the layer's backward is the peak, not the loss.
  none = dataclasses.replace(qwen, remat="none")
  tokens, D, k, I, E = 16 * 2048, 2048, 8, 768, 128
  per_layer = (6 * D + 3 * 4096 + 3 * 512 + 3 * k * D + 4 * k * I + E) * 2 + 4 * (E + 4 * k)
  layer = tokens * (per_layer + 2 * k * I * 2)
  assert llama.activation_bytes(none, 16, 2048) == 48 * tokens * per_layer + layer
  more = dataclasses.replace(none, experts_per_token=16)
  assert llama.activation_bytes(more, 16, 2048) > llama.activation_bytes(none, 16, 2048)


_BASE = {"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 112,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.mark.parametrize("change, message", [
    ({"mlp_only_layers": [1]}, r"mlp_only_layers \[1\] is not supported"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step 2 is not supported"),
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size 64 is not"),
    ({"model_type": "mixtral", "router_jitter_noise": 0.1}, "router_jitter_noise 0.1 is not"),
    ({"num_experts": 0}, "num_experts 0 is not supported"),
    ({"attention_dropout": 0.1}, "attention_dropout 0.1 is not supported"),
    ({"num_experts_per_tok": 5}, "needs 1 <= experts_per_token <= n_experts"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"partial_rotary_factor": 0.5},
     r"partial_rotary_factor is not supported for qwen3_moe \(only 1.0, got 0.5\)"),
])
def test_refused_fields_are_named(change, message):
  with pytest.raises(ValueError, match=message) as e:
    llama.LlamaConfig.from_hf(_BASE | change)
  assert "\n" not in str(e.value)


def test_configs_their_model_type_cannot_express_are_refused():
  mixtral = llama.LlamaConfig.from_hf(_BASE | {"model_type": "mixtral", "intermediate_size": 32})
  assert mixtral.norm_topk_prob and mixtral.d_expert == 32 and mixtral.router_aux_loss_coef == 0.001
  for wrong in (dataclasses.replace(mixtral, norm_topk_prob=False),
                dataclasses.replace(mixtral, model_type="llama"),
                dataclasses.replace(llama.PRESETS["llama-tiny"], model_type="qwen3_moe")):
    with pytest.raises(ValueError, match="has no form for"):
      wrong.to_hf()
