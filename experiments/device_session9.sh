#!/usr/bin/env bash
# Session 9's GPU runs (issue 22: the streamed host update) from a snapshot of
# a commit, so that work in progress in the checkout stays out. Here:
#   rm -rf .snap && mkdir .snap && git archive HEAD -o .snap/jzo.tar && git rev-parse --short HEAD >.snap/commit
# then, through the device tool, carrying .snap and .whl:
#   bash experiments/device_session9.sh PART [PART ...]
# Parts:
#   tests     --help of each CLI; the GPU tests; the CPU tests of the streamed update,
#             offload, accumulation and placement on this Python and jax
#   check     streamed_check.py: one leaf of 2**31 + 2**28 elements through 1 GiB of spans;
#             every weight equals its master in bf16 after each step
#   qwen14    qwen2.5-14b, bf16 moments, offload auto (not delayed), micro-batch 1 and 2 at
#             seq 4096: the plan streams the update through 2 GiB
#   stream8b  llama-3.1-8b, bf16 moments, offload auto (not delayed), micro-batch 2 at seq
#             4096: one set of landing buffers, then streamed through 2 GiB
#   stream8ball  the same with offload=True (all the state on the host)
# Output: $OUT/PART.json(l), $OUT/PART.log, $OUT/machine.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
dir=/tmp/jzo-$(cat .snap/commit)
if [ ! -d "$dir" ]; then
  mkdir -p "$dir" && tar -xf .snap/jzo.tar -C "$dir" && cp -r .whl "$dir/"
  (cd "$dir" && source experiments/device_setup.sh) || { rm -rf "$dir"; exit 1; }
fi
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
{ date -u; cat .snap/commit; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  grep -m1 "model name" /proc/cpuinfo; nproc; free -g | head -2; python3 --version
  python3 -c "import jax; print('jax', jax.__version__)"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
cd "$dir" || exit 1
llama() {  # PART, then llama_bench's arguments; appends to PART.jsonl
  local part=$1; shift
  python3 experiments/llama_bench.py "$@" --json "$OUT/$part.tmp.json" >>"$OUT/$part.log" 2>&1
  echo "$part $*: exit $?"; cat "$OUT/$part.tmp.json" >>"$OUT/$part.jsonl" 2>/dev/null
  echo >>"$OUT/$part.jsonl"; grep -E "TFLOPS|refused|rror|failed" "$OUT/$part.log" | cut -c1-400 | tail -4
}
for part in "$@"; do
  case $part in
    tests)
      for m in jzo.train jzo.estimate jzo.export; do
        python3 -m $m --help >/dev/null 2>&1; echo "$m --help: exit $?"
      done
      JAX_PLATFORMS=cuda,cpu timeout 200 python3 -m pytest -q -p no:cacheprovider \
        tests/test_offload_gpu.py >"$OUT/tests-gpu.log" 2>&1
      echo "GPU tests: exit $?"; tail -3 "$OUT/tests-gpu.log"
      for t in test_streaming test_offload test_accumulation test_placement; do
        timeout 300 python3 -X faulthandler -m pytest -q -p no:cacheprovider tests/$t.py \
          >"$OUT/$t.log" 2>&1
        echo "$t: exit $?"; tail -1 "$OUT/$t.log"; grep -m3 -E "Fatal|FAILED" "$OUT/$t.log"
      done ;;
    check) timeout 300 python3 experiments/streamed_check.py --steps 2 2>&1 | tee "$OUT/check.log"
           echo "check: exit $?" ;;
    qwen14) llama $part --model qwen2.5-14b --seq-len 4096 --batch 1 2 --moments bf16 \
              --configs auto --steps 5 --timeout 420 ;;
    stream8b)
      llama $part --model llama-3.1-8b --seq-len 4096 --batch 2 --moments bf16 --configs auto \
        --steps 5 --timeout 280
      llama $part --model llama-3.1-8b --seq-len 4096 --batch 2 --moments bf16 --configs auto \
        --steps 5 --timeout 280 --landing-limit-gb 2 ;;
    stream8ball)
      llama $part --model llama-3.1-8b --seq-len 4096 --batch 2 --moments bf16 \
        --configs offload --steps 5 --timeout 280
      llama $part --model llama-3.1-8b --seq-len 4096 --batch 2 --moments bf16 \
        --configs offload --steps 5 --timeout 280 --landing-limit-gb 2 ;;
    *) echo "unknown part $part" ;;
  esac
done
