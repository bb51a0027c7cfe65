#!/usr/bin/env bash
# Session 5's GPU runs (issue 11), one part per device call, from a snapshot
# of a commit (`git archive`) so that work in progress stays out:
#   A: build, GPU tests, gpt2-10b (fp32 moments) and gpt2-13b (bf16
#      moments) through the recipe with offload auto + delayed update.
#   B: offload_bench: gpt2-10b auto_dpu (the device step timed alone, which
#      ran out of memory in session 4), planned against measured memory at
#      1.56B and 4.24B (offload + delayed update).
#   C: gpt2-4b: jzo on the GPU alone and offload="auto", then DeepSpeed
#      ZeRO-2 + offload_optimizer cpu (wheels in .whl), side by side.
#   D: the command lines' tests on this machine's Python 3.12 (issue 12),
#      and offload_bench's gpt2-10b auto_dpu again (its transfer timing).
# Output: $OUT/<part>.log, metrics and JSON files.
set -uo pipefail
part=$1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
log=$OUT/$part.log
# A warm machine keeps the build of the previous part.
[ -f /tmp/jzo_built ] && export PYTHONPATH=/tmp/site OUT=${OUT:-/tmp/out} \
  || { source experiments/device_setup.sh || exit 1; touch /tmp/jzo_built; }
recipe() {  # model steps extra-flags...
  local model=$1 steps=$2; shift 2
  free -g | tee -a $log
  /usr/bin/time -v timeout ${LIMIT:-300} python3 -m jzo.train --model $model --seq-len 1024 \
    --batch-size 8 --steps $steps --warmup 2 --log-every 2 --eval-every 1000 \
    --checkpoint-every 0 --sample-tokens 0 --lr 1e-4 --delayed-update --out /tmp/run_$model "$@" \
    > $OUT/train_$model.out 2> $OUT/train_$model.err
  echo "exit $?" | tee -a $log
  grep -v "it/s\]" $OUT/train_$model.out | tail -30 | tee -a $log
  grep -E "Maximum resident|Elapsed" $OUT/train_$model.err | tee -a $log
  grep -v "it/s\]" $OUT/train_$model.err | grep -v "^\s" | tail -8 | tee -a $log
  cp /tmp/run_$model/metrics.jsonl $OUT/metrics_$model.jsonl 2>/dev/null
}
bench() {  # model configs steps [extra flags]
  local model=$1 configs=$2 steps=$3; shift 3
  timeout ${LIMIT:-200} python3 experiments/offload_bench.py --model $model --configs $configs \
    --steps $steps --json $OUT/bench_${model}_${configs// /_}.json "$@" 2>&1 | tail -12 | tee -a $log
}
case $part in
A)
  JAX_PLATFORMS=cuda,cpu timeout 150 python3 -m pytest -q tests/test_offload_gpu.py 2>&1 | tail -3 | tee -a $log
  LIMIT=200 recipe gpt2-10b 22
  LIMIT=260 recipe gpt2-13b 14 --moments bf16;;
B)
  LIMIT=300 bench gpt2-10b auto_dpu 4
  for model in gpt2-1.5b gpt2-4b; do LIMIT=120 bench $model offload_dpu 4; done;;
C)
  LIMIT=300 bench gpt2-4b "device auto" 4
  timeout 240 python3 experiments/torch_baselines.py --model gpt2-4b --system deepspeed --steps 4 \
    --json $OUT/deepspeed_4b.json 2>&1 | tail -5 | tee -a $log;;
D)
  python3 --version | tee -a $log
  for m in jzo.train jzo.estimate jzo.export; do
    python3 -m $m --help > $OUT/help_${m#jzo.}.txt 2>&1; echo "$m --help: exit $?" | tee -a $log
  done
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_train.py tests/test_export.py \
    tests/test_placement.py -k "help or bad_options or out_naming or preset or warmup_follows \
    or estimate_cli or cli_errors or cli_exports or real_entry_point" 2>&1 | tail -4 | tee -a $log
  LIMIT=300 bench gpt2-10b auto_dpu 4;;
esac
