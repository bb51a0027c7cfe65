"""The offload data path on a GPU: gradients land in pinned host memory, bf16
shards return from DMA-registered buffers, results match on-device training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzo
from test_engine import assert_close, batches, init_params, loss_fn

try:
  GPUS = jax.devices("gpu")
except RuntimeError:
  GPUS = []
pytestmark = pytest.mark.skipif(not GPUS, reason="needs a GPU: the pinned-host and DMA "
                                "transfer path exists only there (CPU tests cover the rest)")


def test_offload_on_gpu_matches_device_training():
  mesh = jax.sharding.Mesh(np.array(GPUS[:1]), ("data",))
  params, data = init_params(), batches(10)
  kw = dict(stage=2, mesh=mesh, compute_dtype=jnp.float32, max_grad_norm=1.0)
  with jax.default_device(GPUS[0]):
    on_device = jzo.ZeroEngine(loss_fn, params, jzo.cpu_adamw(1e-2), **kw)
    offloaded = jzo.ZeroEngine(loss_fn, params, jzo.cpu_adamw(1e-2), offload=True, **kw)
    for b in data:
      on_device.step(b)
      offloaded.step(b)
  grads = jax.tree.leaves(offloaded.state.grads)
  assert all(g.sharding.memory_kind == "pinned_host" for g in grads)
  assert offloaded.host_update.transfer.mapped  # staging buffers registered
  # On the GPU, on-device cpu_adamw runs as XLA ops, offload in the C++ kernel.
  assert_close(offloaded.params, on_device.params, rtol=1e-4, atol=1e-5)
  offloaded.close()
  assert not offloaded.host_update.transfer.mapped


def test_pinned_gradient_buffers_are_reused_across_steps():
  """XLA writes each step's gradients into pinned host memory from its
  allocator's pool: every step's buffer lies in the same small region (on an
  H100: 4 addresses within 2 KiB over 8 steps), where a fresh pinned
  allocation per step would map new pages each time."""
  mesh = jax.sharding.Mesh(np.array(GPUS[:1]), ("data",))
  engine = jzo.ZeroEngine(loss_fn, init_params(), jzo.cpu_adamw(1e-2), stage=2, mesh=mesh,
                          offload=True, delayed_update=True, dpu_warmup=1)
  addresses = []
  for b in batches(10):
    engine.step(b)
    addresses.append(jax.tree.leaves(engine.state.grads)[0].addressable_shards[0].data
                     .unsafe_buffer_pointer())
  engine.close()
  assert max(addresses) - min(addresses) < 64 * 1024, addresses
