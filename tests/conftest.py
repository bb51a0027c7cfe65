"""Eight fake CPU devices for the multi-device tests (set before JAX starts).

Tests run on the CPU unless JAX_PLATFORMS says otherwise (the GPU machine
runs the cpu_adam tests with JAX_PLATFORMS=cuda,cpu to cover the XLA path).
"""

import os
from unittest import mock

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
if "JAX_PLATFORMS" not in os.environ:
  jax.config.update("jax_platforms", "cpu")


# Each test, and each module's fixtures, leave os.environ as they found it.
# The recipe caps XLA's pinned pool for its whole process through an
# environment variable (jzo.plan.limit_pinned_pool, from jzo.train's main):
# left set, a later test's subprocess would inherit a small model's cap
# (test_export's module fixture runs the recipe in this process).

@pytest.fixture(autouse=True, scope="module")
def _environment_restored_per_module():
  with mock.patch.dict(os.environ):
    yield


@pytest.fixture(autouse=True)
def _environment_restored():
  with mock.patch.dict(os.environ):
    yield
