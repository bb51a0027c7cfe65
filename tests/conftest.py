"""Eight fake CPU devices for the multi-device tests (set before JAX starts).

Tests run on the CPU unless JAX_PLATFORMS says otherwise (the GPU machine
runs the cpu_adam tests with JAX_PLATFORMS=cuda,cpu to cover the XLA path).
"""

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)
if "JAX_PLATFORMS" not in os.environ:
  jax.config.update("jax_platforms", "cpu")
