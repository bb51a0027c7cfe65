#!/usr/bin/env bash
# Session 6's GPU runs (issue 14's single-GPU figures) from a snapshot of a
# commit, so that work in progress in the checkout stays out. Here:
#   rm -rf .snap && mkdir .snap && git archive HEAD -o .snap/jzo.tar && git rev-parse --short HEAD >.snap/commit
# then, through the device tool, carrying .snap and .whl (DeepSpeed 0.19.8,
# tyro and their dependencies as wheels):
#   bash experiments/device_session6.sh PART [PART ...]
# (parts: experiments/figure_runs.py's, and 'tests': the GPU tests and --help)
# The snapshot is unpacked and built once per machine in /tmp/jzo-COMMIT;
# output: $OUT/PART.json, $OUT/PART.log, $OUT/machine.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
dir=/tmp/jzo-$(cat .snap/commit)
if [ ! -d "$dir" ]; then
  mkdir -p "$dir" && tar -xf .snap/jzo.tar -C "$dir" && cp -r .whl "$dir/"
  (cd "$dir" && source experiments/device_setup.sh) || { rm -rf "$dir"; exit 1; }
fi
export PYTHONPATH=/tmp/site
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  grep -m1 "model name" /proc/cpuinfo; nproc; free -g | head -2; python3 --version
  python3 -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__)"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
cd "$dir" || exit 1
for part in "$@"; do
  if [ "$part" = tests ]; then  # the GPU tests, and the entry points on this Python
    for m in jzo.train jzo.estimate jzo.export; do
      python3 -m $m --help >/dev/null 2>&1; echo "$m --help: exit $?"
    done
    JAX_PLATFORMS=cuda,cpu timeout 240 python3 -m pytest -q -p no:cacheprovider \
      tests/test_offload_gpu.py tests/test_transfer.py 2>&1 | tail -5
    continue
  fi
  python3 experiments/figure_runs.py "$part" --out "$OUT" >"$OUT/$part.log" 2>&1
  echo "$part: exit $?"; grep -E '^\{|status|^\$' "$OUT/$part.log" | cut -c1-300 | tail -20
done
