#!/usr/bin/env bash
# The CPU Adam run on a GPU machine (device tool): build jzo there, run the
# tests on its host CPU and on its GPU, then the benchmark; writes to $OUT.
set -uo pipefail
source experiments/device_setup.sh || exit 1
python3 -c "import jzo; print('simd_level', jzo.kernels.simd_level(), 'threads', jzo.kernels.num_threads())"
echo "== tests, host CPU (the C++ kernel path)"
JAX_PLATFORMS=cpu python3 -m pytest -q tests 2>&1 | tail -4
echo "== tests of cpu_adam with the GPU as default backend (the XLA path)"
JAX_PLATFORMS=cuda,cpu python3 -m pytest -q tests/test_cpu_adam.py 2>&1 | tail -4
echo "== benchmark"
JAX_PLATFORMS=cpu python3 experiments/cpu_adam_bench.py --sizes 24 28 --json "$OUT/bench.json" \
  2>&1 | tee "$OUT/bench.txt"
