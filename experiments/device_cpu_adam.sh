#!/usr/bin/env bash
# The CPU Adam run on a GPU machine (device tool): build jzo there, run the
# tests on its host CPU and on its GPU, then the benchmark. Expects the
# DeepSpeed wheels in .whl/ (see experiments/RESULTS.md) and writes to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
lscpu >"$OUT/lscpu.txt"; grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|L3" "$OUT/lscpu.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jzo; print('simd_level', jzo.kernels.simd_level(), 'threads', jzo.kernels.num_threads())"
echo "== tests, host CPU (the C++ kernel path)"
JAX_PLATFORMS=cpu python3 -m pytest -q tests 2>&1 | tail -4
echo "== tests of cpu_adam with the GPU as default backend (the XLA path)"
JAX_PLATFORMS=cuda,cpu python3 -m pytest -q tests/test_cpu_adam.py 2>&1 | tail -4
echo "== benchmark"
JAX_PLATFORMS=cpu python3 experiments/cpu_adam_bench.py --sizes 24 28 --json "$OUT/bench.json" \
  2>&1 | tee "$OUT/bench.txt"
