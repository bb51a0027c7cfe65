# Sourced at the start of a device-tool run: puts the DeepSpeed wheels of
# .whl/ (see experiments/RESULTS.md) on PYTHONPATH, builds jzo in place and
# prints the machine. Output files go to $OUT.
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; return 1; }
lscpu >"$OUT/lscpu.txt"; grep -E "Model name|^CPU\(s\)" "$OUT/lscpu.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
