"""A non-finite gradient in one element of one device's shard: the step is
skipped on every device, counted, and changes no weight or moment; training
goes on. On and off offload, with and without the delayed update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzo
from test_engine import batches, init_params, loss_fn, make_engine, mesh_of
from test_offload import TX

MODES = {"on device": {}, "offload": dict(offload=True),
         "offload + delayed": dict(offload=True, delayed_update=True, dpu_warmup=0)}


def poisoned_loss(params, batch):
  """loss_fn plus a term whose gradient is batch["poison"]'s mean in one
  element of the head only (0 where the poison is 0): after the
  reduce-scatter a non-finite value sits in one shard of one device."""
  return loss_fn(params, batch) + jnp.mean(batch["poison"]) * params["head"][0, 0]


def with_poison(batch, value=0.0, example=None):
  poison = jnp.zeros(batch["x"].shape[0])
  return dict(batch, poison=poison if example is None else poison.at[example].set(value))


def optimizer_state(engine) -> dict:
  """Masters and moments, gathered to host arrays (counters left out)."""
  saved = engine.state_dict()
  return {k: saved[k] for k in ("master", "opt_state", "mu", "nu", "count") if k in saved}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype, bad", [(jnp.bfloat16, np.nan), (jnp.float16, np.inf)],
                         ids=["bf16-nan", "fp16-inf"])
def test_a_non_finite_gradient_in_one_shard_skips_the_step_everywhere(mode, dtype, bad):
  # fp16: a scale that does not overflow by itself, so only the poison skips
  scale = jzo.LossScale(init_scale=2.0**8) if dtype == jnp.float16 else None
  engine = make_engine(poisoned_loss, init_params(), TX(), stage=2, compute_dtype=dtype,
                       loss_scale=scale, max_grad_norm=1.0, mesh=mesh_of(4), **MODES[mode])
  data = [with_poison(b) for b in batches(8)]
  data[3] = with_poison(data[3], bad, example=5)  # the second device's micro-batch
  losses = []
  for t, b in enumerate(data):
    if t == 3:
      before, skipped_before = optimizer_state(engine), int(engine.state.skipped)
      step_before = int(engine.state.step)
    metrics = engine.step(b)
    losses.append(float(metrics.loss))
    assert bool(metrics.skipped) == (t == 3), t
    if t == 3:
      jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), optimizer_state(engine),
                   before)
      assert int(engine.state.skipped) == skipped_before + 1
      assert int(engine.state.step) == step_before
      if scale is not None:
        assert float(engine.state.loss_scale.scale) == scale.init_scale / 2
  engine.close()
  # training went on: finite losses, still falling after the skipped step
  after = losses[4:]
  assert np.isfinite(after).all() and after[-1] < after[0] < losses[0]
  assert int(engine.state.skipped) == 1 and int(engine.state.step) == 7
