#!/usr/bin/env bash
# Session 3's GPU runs (issues 10 and 11), one part per device call:
#   A: build jzo and the pre-refactor tree (.baseline: `git worktree add --detach
#      .baseline 206cb48`, carried to the device), GPU
#      tests, offload + delayed update at 1.56B and 4.24B, before and after.
#   B: gpt2-4b: jzo on the GPU alone, offload="auto", and DeepSpeed ZeRO-2 +
#      offload_optimizer cpu (wheels in .whl), side by side.
#   C: gpt2-10b with offload="auto" through the recipe.
#   D: gpt2-13b with bf16 moments through the recipe.
# Output: $OUT/<part>.log and JSON files.
set -uo pipefail
part=$1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
log=$OUT/$part.log
build() {
  python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
}
case $part in
A)
  # Before: the pre-refactor tree installed editable, then this tree.
  (cd .baseline && python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/build_baseline.log 2>&1) || tail -5 $OUT/build_baseline.log
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $log
  for model in gpt2-1.5b gpt2-4b; do
    echo "== before: $model" | tee -a $log
    (cd .baseline && timeout 170 python3 experiments/offload_bench.py --model $model --configs offload_dpu --steps 4 --json $OUT/before_$model.json 2>&1 | tail -3) | tee -a $log
  done
  build
  JAX_PLATFORMS=cuda,cpu timeout 120 python3 -m pytest -q tests/test_offload_gpu.py 2>&1 | tail -3 | tee -a $log
  for model in gpt2-1.5b gpt2-4b; do
    echo "== after: $model" | tee -a $log
    timeout 170 python3 experiments/offload_bench.py --model $model --configs offload_dpu --steps 4 --json $OUT/after_$model.json 2>&1 | tail -3 | tee -a $log
  done;;
B)
  build
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  timeout 330 python3 experiments/offload_bench.py --model gpt2-4b --configs device auto --steps 4 --json $OUT/jzo_4b.json 2>&1 | tail -30 | tee $log
  PYTHONPATH=/tmp/site timeout 240 python3 experiments/torch_baselines.py --model gpt2-4b --system deepspeed --steps 4 --json $OUT/deepspeed_4b.json 2>&1 | tail -5 | tee -a $log;;
C)
  build
  timeout 560 python3 -m jzo.train --model gpt2-10b --seq-len 1024 --batch-size ${BATCH:-8} --steps ${STEPS:-22} --warmup 2 \
    --log-every 2 --eval-every 1000 --checkpoint-every 1000 --sample-tokens 0 --lr 1e-4 \
    --out /tmp/run10b 2>&1 | grep -v "it/s\]" | tail -40 | tee $log
  cp /tmp/run10b/metrics.jsonl $OUT/metrics_10b.jsonl;;
D)
  build
  timeout 560 python3 -m jzo.train --model gpt2-13b --seq-len 1024 --batch-size 8 --steps 12 --warmup 2 \
    --log-every 2 --eval-every 1000 --checkpoint-every 1000 --sample-tokens 0 --lr 1e-4 \
    --moments bf16 --out /tmp/run13b 2>&1 | grep -v "it/s\]" | tail -40 | tee $log
  cp /tmp/run13b/metrics.jsonl $OUT/metrics_13b.jsonl;;
esac
