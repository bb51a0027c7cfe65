#!/usr/bin/env bash
# The benchmarks behind the published figures, on a GPU machine: one named part after
# another, from the checkout this runs in, each record as $OUT/NAME.json (copy them to
# benchmarks/records/ and run benchmarks/plot.py), each part's output in $OUT/PART.log.
#
#   OUT=/tmp/out bash benchmarks/gpu.sh PART [PART ...]
#
# It builds jzo from this checkout (an editable install) and installs the wheels of .whl/, if
# any (DeepSpeed, tyro and their dependencies), into /tmp/site. GPUS sets the GPU counts of
# the parts over several GPUs (default 1 2 4).
#
# Parts:
#   tests              --help of each command; the GPU tests; the CPU tests that depend most
#                      on the Python and jax versions, on this machine's
#   throughput         model TFLOPS against size on one GPU: jzo without offload, with all of
#                      the state on the host + delayed update, PyTorch alone, DeepSpeed ZeRO-2
#                      offload at gpt2-1.5b and gpt2-4b (figures.py 1.5b 4b)
#   largest-model      each system at the sizes around its largest on one GPU (figures.py 10b
#                      13b edges)
#   gpt2-20b           gpt2-20b, int8 moments, stage 3 + grads_in_params, micro-batch 32
#   largest-per-gpus   the largest GPT the planner fits with offload on each of GPUS GPUs,
#                      each trained 2 steps (largest_model.py)
#   delayed-update     gpt2-1.5b with and without the delayed update at micro-batches 1-8, and
#                      two 400-step loss curves (figures.py dpu)
#   scaling            over GPUS: jzo stages 1-3 without offload at gpt2-1.5b, jzo offload +
#                      delayed update and DeepSpeed at gpt2-13b (figures.py scale-*)
#   zero-stages        ZeRO stages 0-3 without offload over GPUS, gpt2-1.5b
#   llama-1b           the Llama-3.2-1B shape at 4 x 4096: jzo (offload auto, as the recipe
#                      fine-tunes) against transformers' model under PyTorch alone, 3 rounds
#                      in turn (figures.py llama-1b)
#   llama-finetune     llama-3.1-8b (micro-batch 4 x 4096) and qwen2.5-14b (bf16 moments) in jzo
#   families           gemma-2-9b and phi-4 at 4096 tokens on an H200 held to 75.6 GiB (an 80 GB
#                      card): model TFLOPS, GPU and host memory against the plan
#   moe                Qwen3-30B-A3B on 2 GPUs (stage 3, int8 moments on the host) in jzo, and
#                      cut to 16 layers in jzo and in transformers' Qwen3MoeForCausalLM under
#                      DeepSpeed ZeRO-3 + CPU offload, 3 rounds in turn
#   deepspeed-llama8b  llama-3.1-8b cut to 14 layers in jzo and in DeepSpeed; DeepSpeed on the
#                      full shape
#   llama-70b          on 4 GPUs, a full fine-tune of llama-3.1-70b's shape (a folder of random
#                      bf16 weights) through the recipe: chat data, seq 4096, global batch 32,
#                      stage 3 + grads_in_params, int8 moments, --export (finetune_hf.py)
#   deepspeed-70b      on 4 GPUs, DeepSpeed ZeRO-3 with its weights and optimizer on the CPU
#                      training transformers' Llama of llama-3.1-70b's shape, then cut to 40
#                      and 20 layers
#   global-batch-32    gpt2-10b (fp32 moments) and gpt2-13b (bf16) at global batch 32, stage 3
#                      + grads_in_params: 4 x 8 the layers first and with float32 sums, 1 x 32
#                      with the forward overlapping the host update and with the update first
#   params-offload     gpt2-10b, int8 moments, the layers' weights in pinned host memory where
#                      the GPU needs it, micro-batch 96
#   planner-memory     GPU peak and host RSS against the plan at gpt2-10b, 4 x 8 the layers
#                      first (every train_gpt.py and train_llama.py record has both)
#   host-adam          the host AdamW kernel against torch's fused AdamW, DeepSpeedCPUAdam and
#                      optax; int8 against fp32 moments
#   moments-quality    gpt2-124m's loss with fp32, bf16 and int8 moments, 2000 steps
#   checkpoint-io      save and restore of gpt2-10b's int8 state and gpt2-4b's fp32 state
#   reproducibility    the GPU case of tests/test_deterministic.py; runs of the recipe with
#                      --deterministic against each other, against one without it, and against
#                      runs stopped by SIGKILL and SIGTERM then resumed, on one GPU (and with a
#                      process per GPU on 2 when GPUS names 2); the cost of deterministic steps
#                      at gpt2-1.5b and llama-3.1-8b's layer shape (reproducibility.py)
#   short-runs         20 steps of gpt2-10b and of gpt2-20b from scratch with the recipe's
#                      default learning rate and warm-up (docs/getting-started.md's commands)
#   soak               gpt2-1.5b, offload + delayed update, 9 minutes of the recipe with a
#                      checkpoint every minute, then SIGTERM: host RSS, GPU memory and steps/s
#                      over time (soak.py)
#   generate           llama-3.1-8b in bfloat16, a 2,048-token prompt then 256 tokens: jzo's
#                      KV-cache decoding against transformers' generate, 3 rounds in turn
#   smoke-jzo          each jzo benchmark (train_gpt, train_llama, largest_model, zero_stages,
#                      moments_quality, checkpoint_io) at one small point on this machine
#   smoke-peers        each peer and host benchmark (peers_gpt and peers_hf under DeepSpeed,
#                      host_adam in turns and in pairs) at one small point; plot.py
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
GPUS=${GPUS:-1 2 4}
mkdir -p "$OUT"
# An environment's own fraction (0.538: an H200 held to an 80 GB card's 75.6 GiB) is kept.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    .whl/*.whl >"$OUT/wheels.log" 2>&1 || { tail -20 "$OUT/wheels.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
{ date -u; git rev-parse --short HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  grep -m1 "model name" /proc/cpuinfo; nproc; free -g | head -2; python3 --version
  python3 -c "import jax; print('jax', jax.__version__)"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

bench() {  # PART NAME SCRIPT ARGS...: benchmarks/SCRIPT with --json $OUT/NAME.json
  local part=$1 name=$2 script=$3; shift 3
  python3 "benchmarks/$script" "$@" --json "$OUT/$name.json" >>"$OUT/$part.log" 2>&1
  echo "$part: $script $*: exit $?"
}
pytests() {  # NAME TIMEOUT ARGS...: one pytest call, its log in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $? ($(tail -1 "$OUT/$name.log"))"
}
b32() {  # NAME MODEL MOMENTS ACCUM MICRO FLAGS...: train_gpt.py at stage 3 + grads_in_params
  local name=$1 model=$2 moments=$3 accum=$4 micro=$5; shift 5
  bench "$part" "$part-$name" train_gpt.py --configs auto --model "$model" --moments "$moments" \
    --stage 3 --grads-in-params --grad-accum "$accum" --batch "$micro" --steps 3 \
    --compiled-memory "$@"
}

for part in "$@"; do
  case $part in
    tests)
      for m in jzo.train jzo.estimate jzo.export jzo.generate; do
        python3 -m $m --help >/dev/null 2>&1; echo "$m --help: exit $?"
      done
      JAX_PLATFORMS=cuda,cpu pytests tests-gpu 300 tests/test_offload_gpu.py \
        tests/test_moe.py::test_grouped_matmul_kernels_equal_ragged_dot
      pytests tests-cpu 900 tests/test_transfer.py tests/test_streaming.py tests/test_offload.py \
        tests/test_accumulation.py tests/test_placement.py tests/test_engine.py \
        tests/test_cpu_adam.py tests/test_quant8.py tests/test_benchmarks.py \
        tests/test_generate.py ;;
    throughput) bench $part $part figures.py 1.5b 4b ;;
    largest-model) bench $part $part figures.py 10b 13b edges ;;
    gpt2-20b)
      bench $part $part train_gpt.py --configs offload --model gpt2-20b --moments int8 --stage 3 \
        --grads-in-params --batch 32 --steps 3 --compiled-memory --timeout 540 ;;
    largest-per-gpus)
      bench $part $part largest_model.py --gpus $GPUS --moments fp32 int8 --run --limit 450 ;;
    delayed-update) bench $part $part figures.py dpu ;;
    llama-1b) bench $part $part figures.py llama-1b --rounds 3 ;;
    scaling) bench $part $part figures.py scale-1.5b scale-13b scale-ds --gpus $GPUS ;;
    zero-stages)
      bench $part $part zero_stages.py --model gpt2-1.5b --gpus $GPUS --stages 0 1 2 3 --steps 5 ;;
    llama-finetune)
      bench $part $part train_llama.py --model llama-3.1-8b --seq-len 4096 --batch 4 \
        --configs auto_dpu --steps 8
      bench $part $part-qwen train_llama.py --model qwen2.5-14b --seq-len 4096 --batch 1 2 \
        --moments bf16 --configs auto --steps 5 ;;
    families)
      # An 80 GB card's 75.6 GiB of an H200: gemma-2-9b and phi-4 at 4096 tokens.
      for model in gemma-2-9b phi-4; do
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.538 bench $part $part-$model train_llama.py \
          --model $model --seq-len 4096 --batch 1 2 --stage 3 --grads-in-params \
          --moments int8 --configs auto --steps 5 --compiled-memory
      done ;;
    moe)
      # Qwen3-30B-A3B on 2 GPUs with int8 moments on the host. DeepSpeed ZeRO-3 with its
      # optimizer on the CPU keeps 22.6 bytes a parameter there (measured): of the 251 GiB
      # host, a cut to 16 of the 48 layers (10.6B parameters) is the largest it trains. Both
      # train that cut in three rounds, in turn; then jzo with the update before the forward,
      # and jzo on the whole shape.
      cut="--model qwen3-30b-a3b --n-layer 16 --gpus 2 --seq-len 4096 --batch 4 --stage 3
        --grads-in-params --moments int8 --configs auto --steps 5"
      for round in 1 2 3; do
        bench $part $part-jzo-cut16-$round train_llama.py $cut
        bench $part $part-deepspeed-cut16-$round peers_hf.py --shape qwen3-30b-a3b --n-layer 16 \
          --system deepspeed --zero-stage 3 --gpus 2 --seq-len 4096 --micro-batch 4 --steps 4 \
          --timeout 900
      done
      bench $part $part-jzo-cut16-update-first train_llama.py $cut --no-overlap-forward
      bench $part $part-jzo train_llama.py --model qwen3-30b-a3b --gpus 2 --seq-len 4096 \
        --batch 4 --stage 3 --grads-in-params --moments int8 --configs auto --steps 4 ;;
    deepspeed-llama8b)
      bench $part $part-jzo train_llama.py --model llama-3.1-8b --n-layer 14 --seq-len 4096 \
        --batch 4 --configs auto_dpu --steps 10
      bench $part $part peers_hf.py --shape llama-3.1-8b --n-layer 14 --system deepspeed \
        --seq-len 4096 --micro-batch 4 --steps 8
      bench $part $part-full peers_hf.py --shape llama-3.1-8b --system deepspeed --seq-len 4096 \
        --micro-batch 4 --steps 4 ;;
    llama-70b)  # the input's shards go once the run has them: the disk holds the model once
      bench $part $part finetune_hf.py --model llama-3.1-70b --steps 6 --drop-input \
        --work /tmp/llama-70b --seq-len 4096 --batch-size 32 --stage 3 --grads-in-params \
        --moments int8
      rm -rf /tmp/llama-70b ;;
    deepspeed-70b)
      for layers in 80 40 20; do
        bench $part $part-$layers peers_hf.py --shape llama-3.1-70b --n-layer $layers \
          --system deepspeed --zero-stage 3 --offload-param --gpus 4 --seq-len 4096 \
          --micro-batch 1 --steps 3 --timeout 1200
      done ;;
    global-batch-32)
      b32 10b-4x8 gpt2-10b fp32 4 8
      b32 10b-4x8-sums gpt2-10b fp32 4 8 --accumulation device
      b32 10b-1x32 gpt2-10b fp32 1 32
      b32 13b-1x32 gpt2-13b bf16 1 32
      b32 13b-1x32-update-first gpt2-13b bf16 1 32 --no-overlap-forward
      b32 13b-4x8 gpt2-13b bf16 4 8 ;;
    params-offload)
      bench $part $part train_gpt.py --configs offload --model gpt2-10b --moments int8 --stage 3 \
        --offload-params auto --batch 96 --steps 3 --compiled-memory ;;
    planner-memory)
      bench $part $part train_gpt.py --configs auto --model gpt2-10b --moments fp32 --stage 3 \
        --grads-in-params --grad-accum 4 --batch 8 --steps 3 ;;
    host-adam)  # the host's CPU alone: JAX on the CPU, the GPU untouched
      JAX_PLATFORMS=cpu bench $part $part host_adam.py --sizes 16 18 20 22 24 26 28 --pairs 9
      JAX_PLATFORMS=cpu bench $part $part-int8 host_adam.py --pair engine-int8 engine-fp32 \
        --sizes 26 28 --pairs 5
      JAX_PLATFORMS=cpu bench $part $part-turns host_adam.py --sizes 24 28 --rounds 5 ;;
    moments-quality) bench $part $part moments_quality.py --steps 2000 ;;
    checkpoint-io)
      bench $part $part checkpoint_io.py --model gpt2-10b --offload true --moments int8
      bench $part $part-fp32 checkpoint_io.py --model gpt2-4b --offload true --moments fp32 ;;
    reproducibility)
      JAX_PLATFORMS=cuda,cpu pytests $part-tests 300 tests/test_deterministic.py
      bench $part $part-bitwise reproducibility.py bitwise
      if [[ " $GPUS " == *" 2 "* ]] && (( $(nvidia-smi -L | wc -l) >= 2 )); then
        bench $part $part-bitwise-2 reproducibility.py bitwise --processes 2
      fi
      bench $part $part-cost reproducibility.py cost --rounds 5 ;;
    short-runs)  # the recipe's metrics.jsonl of each run is its record
      for args in "gpt2-10b --stage 3 --grads-in-params" \
                  "gpt2-20b --stage 3 --grads-in-params --moments int8"; do
        model=${args%% *}
        python3 -m jzo.train --model $args --batch-size 32 --seq-len 1024 --steps 20 \
          --log-every 1 --checkpoint-every 0 --sample-tokens 0 --out "$OUT/$part-$model" \
          >>"$OUT/$part.log" 2>&1
        echo "$part: $model: exit $?"
      done ;;
    soak)  # one checkpoint kept (16 GiB of fp32 state a checkpoint), a second while one is written;
      # all of the optimizer state on the host (the default offloads only what does not fit)
      bench $part $part soak.py --model gpt2-1.5b --minutes 9 --checkpoint-minutes 1 --offload \
        --offload-fraction 1 --delayed-update --batch-size 16 --seq-len 1024 --micro-batch auto \
        --keep-checkpoints 1 ;;
    generate)
      bench $part $part generate_speed.py --shape llama-3.1-8b --prompt 2048 --new-tokens 256 \
        --rounds 3 ;;
    smoke-jzo)
      bench $part $part-train-gpt train_gpt.py --model gpt2-124m --configs device offload_dpu \
        --batch 8 --steps 3
      bench $part $part-train-llama train_llama.py --model llama-3.2-1b --seq-len 1024 --batch 2 \
        --configs offload_dpu --steps 3
      bench $part $part-largest largest_model.py --base gpt2-350m --gpus 1 --device-gb 6 \
        --host-gb 24 --run --steps 2
      bench $part $part-zero-stages zero_stages.py --model gpt2-124m --gpus 1 --stages 0 3 \
        --steps 3
      bench $part $part-moments-quality moments_quality.py --steps 60 --eval-every 30
      bench $part $part-checkpoint-io checkpoint_io.py --model gpt2-350m --offload true \
        --moments int8 ;;
    smoke-peers)
      bench $part $part-peers-gpt peers_gpt.py --model gpt2-124m --system deepspeed --batch 8 \
        --steps 3
      bench $part $part-peers-hf peers_hf.py --shape llama-3.2-1b --system deepspeed \
        --seq-len 1024 --micro-batch 2 --steps 3
      JAX_PLATFORMS=cpu bench $part $part-host-adam host_adam.py --sizes 24 --pairs 2
      JAX_PLATFORMS=cpu bench $part $part-host-adam-turns host_adam.py --sizes 24 --rounds 2
      python3 benchmarks/plot.py --out "$OUT/figures" >>"$OUT/$part.log" 2>&1
      echo "$part: plot.py: exit $?" ;;
    *) echo "unknown part $part (the parts are listed at the top of benchmarks/gpu.sh)"; exit 2 ;;
  esac
done
