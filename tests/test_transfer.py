"""Host transfers: chunked copies of a device array (or a part of it) into
host arrays; the portable path (no pinned host memory) against the fast one."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzo
from jzo.host import transfer
from test_engine import batches, init_params, loss_fn, make_engine, mesh_of


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "portable"])
@pytest.mark.parametrize("n", [5, 1 << 16, 3 * (1 << 16) + 17, 300_000])
def test_copy_to_host_in_chunks_with_a_tail(monkeypatch, n, pinned):
  monkeypatch.setattr(transfer, "BUILD_CHUNK_BYTES", 4 * 70_000)  # several chunks of rows
  x = jnp.arange(n, dtype=jnp.float32)
  out = np.empty(n, np.float32)
  transfer.copy_to_host(x, out, pinned=pinned)
  np.testing.assert_array_equal(out, np.arange(n))
  part = np.empty((n - 3,), np.float32)
  transfer.copy_to_host(x, part, lambda v: v[3:], pinned=pinned)
  np.testing.assert_array_equal(part, np.arange(3, n))
  with pytest.raises(ValueError, match="elements into"):
    transfer.copy_to_host(x, np.empty(n + 1, np.float32), pinned=pinned)


def test_writable_view_is_the_arrays_own_memory():
  x = jnp.arange(8, dtype=jnp.bfloat16) + 0  # a buffer of its own
  view = transfer.writable_view(x)
  view[0] = 42
  assert float(np.asarray(x)[0]) == 42


def offload_engine(**kw):
  return make_engine(loss_fn, init_params(), jzo.cpu_adamw(1e-2, weight_decay=0.1), stage=2,
                     max_grad_norm=1.0, delayed_update=True, dpu_warmup=2, mesh=mesh_of(2), **kw)


@pytest.mark.parametrize("offload", [True, 0.5], ids=["all", "split"])
def test_the_portable_path_trains_as_the_pinned_one(offload):
  """Forced on the CPU (which has pinned host memory), the portable path's
  numpy landing buffers give the fast path's results bit for bit, whole
  leaves and split ones."""
  fast = offload_engine(offload=offload, host_transfer="pinned")
  portable = offload_engine(offload=offload, host_transfer="portable")
  assert fast.host_update.transfer.pinned and not portable.host_update.transfer.pinned
  for b in batches(6):
    want, got = fast.step(b), portable.step(b)
    assert float(got.loss) == float(want.loss)
    landing = portable.host_update.landing_buffers()
    assert all(isinstance(x, transfer.HostLanding) for x in landing.values())
  for name in ("master", "mu", "nu"):
    jax.tree.map(np.testing.assert_array_equal, portable.state_dict()[name],
                 fast.state_dict()[name])
  for a, b in zip(jax.tree.leaves(portable.state.params), jax.tree.leaves(fast.state.params)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert portable.host_bytes_in_use() == fast.host_bytes_in_use()
  fast.close()
  portable.close()


def test_a_device_without_pinned_memory_takes_the_portable_path_with_one_warning(monkeypatch):
  monkeypatch.setattr(transfer, "has_pinned_host", lambda device: False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine = offload_engine(offload=True)
    for b in batches(4):
      engine.step(b)
    engine.close()
  assert not engine.host_update.transfer.pinned
  messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
  assert len(messages) == 1, messages
  assert "no 'pinned_host' memory" in messages[0] and "pageable" in messages[0]
  with pytest.raises(ValueError, match="host_transfer='pinned': cpu device 0 has no "
                                       "'pinned_host' memory"):
    offload_engine(offload=True, host_transfer="pinned")


def test_an_unknown_host_transfer_is_refused():
  with pytest.raises(ValueError, match="host_transfer must be one of"):
    offload_engine(offload=True, host_transfer="dma")


def test_each_device_reserves_its_share_in_its_own_pinned_pool(monkeypatch):
  """XLA keeps a pinned pool per device, where that device's shards of the
  landing buffers live: each of the process's devices reserves its share
  (one device's pool reserving them all left the others to grow regions
  of doubling size, 26 GiB more for gpt2-13b over four GPUs)."""
  reserved = []
  real_zeros = transfer.zeros

  def zeros(shape, dtype, sharding):
    pieces = {d: sharding.shard_shape(shape) for d in sharding.device_set}
    reserved.append((sharding.memory_kind, pieces))
    return real_zeros(shape, dtype, sharding)

  monkeypatch.setattr(transfer, "zeros", zeros)
  mesh = mesh_of(4)
  transfer.ShardTransfer(mesh, "data", [], jnp.bfloat16).reserve(10 * 2**20 + 3)
  share = -(-(10 * 2**20 + 3) // 4)
  assert reserved == [("pinned_host", {d: (share,) for d in mesh.devices.flat})]
  reserved.clear()
  transfer.ShardTransfer(mesh, "data", [], jnp.bfloat16, pinned=False).reserve(2**20)
  assert reserved == []  # the portable path pins nothing
