"""Host transfers: chunked copies of a device array (or a part of it) into host arrays."""

import jax.numpy as jnp
import numpy as np
import pytest

from jzo import transfer


@pytest.mark.parametrize("n", [5, 1 << 16, 3 * (1 << 16) + 17, 300_000])
def test_copy_to_host_in_chunks_with_a_tail(monkeypatch, n):
  monkeypatch.setattr(transfer, "BUILD_CHUNK_BYTES", 4 * 70_000)  # several chunks of rows
  x = jnp.arange(n, dtype=jnp.float32)
  out = np.empty(n, np.float32)
  transfer.copy_to_host(x, out)
  np.testing.assert_array_equal(out, np.arange(n))
  part = np.empty((n - 3,), np.float32)
  transfer.copy_to_host(x, part, lambda v: v[3:])
  np.testing.assert_array_equal(part, np.arange(3, n))
  with pytest.raises(ValueError, match="elements into"):
    transfer.copy_to_host(x, np.empty(n + 1, np.float32))


def test_writable_view_is_the_arrays_own_memory():
  x = jnp.arange(8, dtype=jnp.bfloat16) + 0  # a buffer of its own
  view = transfer.writable_view(x)
  view[0] = 42
  assert float(np.asarray(x)[0]) == 42
