#!/usr/bin/env bash
# Session 4's GPU runs (issue 11), one part per device call:
#   A: build, GPU tests, gpt2-10b (fp32 moments) through the recipe with
#      offload auto + delayed update, micro-batch ${BATCH:-8}.
#   B: gpt2-13b with bf16 moments through the recipe; the planner against
#      measured memory at 1.56B and 4.24B (offload + delayed update).
#   C: gpt2-10b in offload_bench (the step's breakdown, planned vs measured).
# Output: $OUT/<part>.log, metrics and JSON files.
set -uo pipefail
part=$1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
log=$OUT/$part.log
build() { source experiments/device_setup.sh || exit 1; }
recipe() {  # model steps extra-flags...
  local model=$1 steps=$2; shift 2
  free -g | tee -a $log
  /usr/bin/time -v timeout ${LIMIT:-300} python3 -m jzo.train --model $model --seq-len 1024 \
    --batch-size ${BATCH:-8} --steps $steps --warmup 2 --log-every 2 --eval-every 1000 \
    --checkpoint-every 0 --sample-tokens 0 --lr 1e-4 --delayed-update --out /tmp/run_$model "$@" \
    > $OUT/train_$model.out 2> $OUT/train_$model.err
  echo "exit $?" | tee -a $log
  grep -v "it/s\]" $OUT/train_$model.out | tail -40 | tee -a $log
  grep -E "Maximum resident|Elapsed" $OUT/train_$model.err | tee -a $log
  grep -v "it/s\]" $OUT/train_$model.err | grep -v "^\s" | tail -15 | tee -a $log
  cp /tmp/run_$model/metrics.jsonl $OUT/metrics_$model.jsonl 2>/dev/null
}
case $part in
A)
  build > $log; cat $log
  JAX_PLATFORMS=cuda,cpu timeout 150 python3 -m pytest -q tests/test_offload_gpu.py 2>&1 | tail -5 | tee -a $log
  timeout 100 python3 experiments/draw_memory.py gpt2-10b 2>&1 | tail -1 | tee -a $log
  LIMIT=300 recipe gpt2-10b ${STEPS:-24}
  [ -n "${BENCH:-}" ] && timeout 260 python3 experiments/offload_bench.py --model gpt2-10b --configs auto_dpu --steps 4 --json $OUT/bench_10b.json 2>&1 | tail -4 | tee -a $log;;
B)
  build
  LIMIT=300 recipe gpt2-13b 14 --moments bf16
  for model in gpt2-1.5b gpt2-4b; do
    timeout 120 python3 experiments/offload_bench.py --model $model --configs offload_dpu --steps 4 --json $OUT/bench_$model.json 2>&1 | tail -3 | tee -a $log
  done;;
C)
  build
  timeout 500 python3 experiments/offload_bench.py --model gpt2-10b --configs auto_dpu --steps 6 --batch ${BATCH:-8} --json $OUT/bench_10b.json 2>&1 | tail -8 | tee $log;;
esac
