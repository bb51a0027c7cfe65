"""Eight fake CPU devices for the multi-device tests (set before JAX starts).

Tests run on the CPU unless JAX_PLATFORMS says otherwise (the GPU machine
runs the cpu_adam tests with JAX_PLATFORMS=cuda,cpu to cover the XLA path).

The session shares one persistent compilation cache, in a fresh folder, with
every process it starts: the recipe's subprocesses (resumed runs, kills, CLI
paths) compile the same few programs again and again, and loading them took
the recipe's tests from 441 s to 147 s (2 cores, beside other work). The
cache holds XLA's executables only: what a program computes is the same
whether it was compiled or loaded.

On the CPU alone, the session and its processes also ask XLA for little
optimization (JAX_DISABLE_MOST_OPTIMIZATIONS, jax's own switch: LLVM at
-O0), unless the environment sets it: compiling is most of the suite's CPU
time, and the tests' programs are tiny. It changes no HLO, so two programs
the tests compare still compute alike; but LLVM at -O0 fuses no
multiply-add, so the tests that compare XLA's bits with the C++ kernel's
(which fuses them) take the `optimized_xla` fixture, as do the few that run
more than they compile. The GPU machines' suite (benchmarks/gpu.sh tests)
runs everything at XLA's default level.
"""

import atexit
import os
import shutil
import tempfile
from unittest import mock

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # read when JAX is imported
  _cache = tempfile.mkdtemp(prefix="jzo-tests-xla-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":  # not for the GPU tests' kernels
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # read when JAX is imported

import jax  # noqa: E402  (after the cache's environment)
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
if "JAX_PLATFORMS" not in os.environ:
  jax.config.update("jax_platforms", "cpu")


# Each test, and each module's fixtures, leave os.environ as they found it.
# The recipe caps XLA's pinned pool for its whole process through an
# environment variable (jzo.plan.limit_pinned_pool, from jzo.train's main):
# left set, a later test's subprocess would inherit a small model's cap
# (test_export's module fixture runs the recipe in this process).

# The files that take longest, longest first (seconds in the README's run,
# 2 cores); the rest, each under 45 s, follow in their own order. Under
# `-n 2 --dist loadfile` (with pyproject's --no-loadscope-reorder: xdist's
# own order is by the number of tests in a file) each worker takes the next
# file as the one it runs has two tests left: started last, a long file kept
# one worker busy for minutes after the other had run out of files.
SLOWEST_FILES = ("test_docs.py",  # every example of README.md and docs/
                 "test_train.py",  # ~240 s
                 "test_cli.py",  # ~230 s
                 "test_multiprocess.py",  # ~205 s
                 "test_grads_in_params.py",  # ~195 s
                 "test_multiprocess_signals.py",  # ~180 s
                 "test_resilience.py",  # ~180 s
                 "test_model_families.py",  # ~150 s
                 "test_benchmarks.py",  # ~150 s
                 "test_accumulation.py",  # ~125 s
                 "test_engine.py",  # ~125 s
                 "test_cpu_adam.py",  # ~120 s
                 "test_moe.py",  # ~105 s
                 "test_state_spans.py",  # ~105 s
                 "test_benchmarks_host.py",  # ~90 s
                 "test_placement.py",  # ~90 s
                 "test_offload.py",  # ~85 s
                 "test_export.py",  # ~75 s
                 "test_quant8.py",  # ~70 s
                 "test_cross_entropy.py",  # ~65 s
                 "test_gemma.py",  # ~60 s
                 "test_kernel_properties.py",  # ~55 s
                 "test_phi3.py",  # ~55 s
                 "test_gpt.py",  # ~50 s
                 "test_streaming.py",  # ~50 s
                 "test_finetune.py")  # ~45 s


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture
def optimized_xla():
  """XLA's default optimization for the programs this test compiles (fresh
  jits: one compiled before at -O0 would be reused)."""
  saved = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", saved)


@pytest.fixture(autouse=True, scope="module")
def _environment_restored_per_module():
  with mock.patch.dict(os.environ):
    yield


@pytest.fixture(autouse=True)
def _environment_restored():
  with mock.patch.dict(os.environ):
    yield
