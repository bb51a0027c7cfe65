#!/usr/bin/env bash
# Session 7's GPU runs (issues 22 and 23) from a snapshot of a commit, so
# that work in progress in the checkout stays out. Here:
#   rm -rf .snap && mkdir .snap && git archive HEAD -o .snap/jzo.tar && git rev-parse --short HEAD >.snap/commit
# then, through the device tool, carrying .snap and .whl (DeepSpeed 0.19.8,
# tyro and their dependencies as wheels):
#   bash experiments/device_session7.sh PART [PART ...]
# Parts:
#   tests     the GPU tests, the fine-tuning tests on this Python, --help of the entry points
#   llama8b   jzo, llama-3.1-8b at seq 4096, micro-batch 4, offload auto + delayed update
#   llama8b14 the same with 14 of its 32 layers (the shape DeepSpeed fits)
#   ds14      DeepSpeed ZeRO-2 + offload_optimizer, transformers' LlamaForCausalLM, 14 layers
#   ds8b      the same, all 32 layers (host memory runs out, as arithmetic says)
#   qwen14    jzo, qwen2.5-14b with bf16 moments, micro-batch 1
# Output: $OUT/PART.json(l), $OUT/PART.log, $OUT/machine.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
dir=/tmp/jzo-$(cat .snap/commit)
if [ ! -d "$dir" ]; then
  mkdir -p "$dir" && tar -xf .snap/jzo.tar -C "$dir" && cp -r .whl "$dir/"
  (cd "$dir" && source experiments/device_setup.sh) || { rm -rf "$dir"; exit 1; }
fi
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  grep -m1 "model name" /proc/cpuinfo; nproc; free -g | head -2; python3 --version
  python3 -c "import jax, torch, transformers; print('jax', jax.__version__, 'torch',
torch.__version__, 'transformers', transformers.__version__)"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
cd "$dir" || exit 1
bench() {  # PART, then llama_bench's arguments
  local part=$1; shift
  python3 experiments/llama_bench.py "$@" --json "$OUT/$part.json" >"$OUT/$part.log" 2>&1
  echo "$part: exit $?"; grep -E '"status"|TFLOPS|refused|error' "$OUT/$part.log" | cut -c1-300 | tail -8
}
baseline() {  # PART, then hf_baselines' arguments
  local part=$1; shift
  python3 experiments/hf_baselines.py "$@" --out "$OUT/$part.jsonl" >"$OUT/$part.log" 2>&1
  echo "$part: exit $?"; tail -c 1500 "$OUT/$part.jsonl" 2>/dev/null; echo
}
for part in "$@"; do
  case $part in
    tests)
      for m in jzo.train jzo.estimate jzo.export; do
        python3 -m $m --help >/dev/null 2>&1; echo "$m --help: exit $?"
      done
      JAX_PLATFORMS=cuda,cpu timeout 200 python3 -m pytest -q -p no:cacheprovider \
        tests/test_offload_gpu.py tests/test_transfer.py 2>&1 | tail -3
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_finetune.py \
        tests/test_hf.py tests/test_tokens.py 2>&1 | tail -3 ;;
    llama8b) bench $part --model llama-3.1-8b --seq-len 4096 --batch 4 --configs auto_dpu \
               --steps 10 --timeout 260 ;;
    llama8b14) bench $part --model llama-3.1-8b --n-layer 14 --seq-len 4096 --batch 4 \
                 --configs auto_dpu --steps 10 --timeout 200 ;;
    ds14) baseline $part --shape llama-3.1-8b --n-layer 14 --system deepspeed --seq-len 4096 \
            --micro-batch 4 --steps 8 --timeout 260 ;;
    ds8b) baseline $part --shape llama-3.1-8b --system deepspeed --seq-len 4096 \
            --micro-batch 4 --steps 4 --timeout 200 ;;
    qwen14) bench $part --model qwen2.5-14b --seq-len 4096 --batch 1 --moments bf16 \
              --configs auto_dpu --steps 6 --timeout 200 ;;
    *) echo "unknown part $part" ;;
  esac
done
