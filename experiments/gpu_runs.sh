#!/usr/bin/env bash
# jzo's runs on a GPU machine (the device tool), one named part after another,
# from a snapshot of a commit so that work in progress in the checkout stays
# out. Here:
#   rm -rf .snap && mkdir .snap && git archive HEAD -o .snap/jzo.tar && git rev-parse --short HEAD >.snap/commit
# then, through the device tool, carrying .snap and .whl (DeepSpeed, tyro and
# their dependencies as wheels):
#   bash experiments/gpu_runs.sh PART [PART ...]
# A second snapshot in .snap-base (made the same way from another commit)
# makes offload-steps time that commit first, in the same call.
#
# Parts on one GPU (gpt2 shapes at seq 1024, micro-batch 8; llama shapes at seq 4096):
#   tests          --help of each command; the GPU tests; the CPU tests that depend most
#                  on the Python and jax versions, on this machine's
#   multiprocess   the CPU tests of several processes (pairs over loopback): training,
#                  checkpoints across process and device counts, signals and deaths
#   cpu-adam       the optax drop-in's tests with the GPU as default backend; the C++
#                  Adam kernel against torch's fused AdamW on the host CPU
#   offload-steps  gpt2-1.5b and gpt2-4b, all the state on the host + delayed update:
#                  step times (before and after a change, with .snap-base)
#   recipe-10b     gpt2-10b, fp32 moments, through `python -m jzo.train` (offload auto +
#                  delayed update); BATCH, STEPS override 8 and 22
#   recipe-13b     gpt2-13b, bf16 moments, the same
#   sample-check   gpt2-350m through the recipe at stage 3, 4 steps, with --grads-in-params
#                  then --offload-params: the evaluation and the sample on the GPU
#   recipe-13b-32  gpt2-13b, bf16 moments, global batch 32 in the micro-batch the planner
#                  picks, stage 3 + --grads-in-params, the state placed by the planner
#   bench-10b      gpt2-10b in offload_bench.py: the step's parts, planned against measured
#   peers-4b       gpt2-4b: jzo on the GPU alone and offload auto; DeepSpeed ZeRO-2 offload
#   figure-P       experiments/figure_runs.py's part P (1.5b 4b 10b 13b edges check dpu):
#                  the single-GPU figures, each system in its own process; its scale-*
#                  parts (on a machine of several GPUs) over the GPU counts GPUS (1 2 4)
#   llama8b        llama-3.1-8b, micro-batch 4, offload auto + delayed update
#   loss-tests     --help of each command; the loss's tests with the GPU as default backend
#                  (and the GPU tests of offload), and the models' CPU tests on this Python
#   loss-chunks    the loss in chunks against all the logits (loss_bench.py), then llama8b
#                  at micro-batches BATCH (4); with .snap-base, that commit first (each
#                  with this tree's scripts); SKIP_LOSS,
#                  SKIP_LLAMA skip either; CHUNK_BYTES: other chunk sizes to time
#   llama8b-14l    the same cut to 14 layers (a shape DeepSpeed fits), and DeepSpeed
#                  ZeRO-2 offload training transformers' LlamaForCausalLM of that shape
#   ds-llama8b     DeepSpeed on llama-3.1-8b's full shape
#   qwen14b        qwen2.5-14b, bf16 moments, offload auto, micro-batch 1 and 2
#   stream8b       llama-3.1-8b, bf16 moments, micro-batch 2: one set of landing
#                  buffers against the streamed update, offload auto then all on the host
#   streamed-check one leaf past 2**31 elements through 1 GiB of spans: every weight
#                  equals its master
#   accum-4b       gpt2-4b: no offload at 8, then all on the host with 4 x 8 summed on
#                  the device and on the host
#   accum-10b      gpt2-10b, bf16 moments: 8, then 4 x 8 summed on the host
#   host-sums      the host accumulation's passes alone on the host CPU
#   int8-tests     --help of each command; the int8 moments' and the kernel's tests, and
#                  the optax drop-in's with the GPU as default backend (its XLA path)
#   kernel-moments the C++ kernel by moment dtype (fp32, bf16, int8) and against torch's
#                  fused AdamW, 2^SIZES (16 18 .. 28) parameters, on the host CPU; with
#                  .snap-base, that commit first
#   quant8-exhaustive the AVX-512 kernel's int8 codes against the index on every float32
#                  in [0, 1] (tests/quant8_exhaustive.cc)
#   gather-cost    the host CPU's Gather Data Sampling mitigation, and what a vector
#                  gather costs there beside a permute (experiments/gather_cost.cc)
#   moments-quality gpt2-124m, 2000 steps (STEPS) on the embedded corpus, fp32, bf16 and
#                  int8 moments side by side (three processes at once), all on the host
#   grads-check    grads_in_params' tests on this machine's Python; gpt2-350m through the
#                  recipe at stage 3 with and without it (the same losses)
#   grads-20b      gpt2-20b, int8 moments, stage 3 + grads_in_params, micro-batches BATCH
#                  (default 16 32) in offload_bench.py: step, TFLOPS, peaks against the plan
#                  (LIMIT: seconds, default 540)
#   params-gpu     the GPU tests of offload (tests/test_offload_gpu.py)
#   params-check   offload_params' GPU test and CPU tests on this machine's Python;
#                  gpt2-350m through the recipe with the layers' weights on the GPU, then
#                  on the host, then on the host with 4 of 24 layers resident (the same losses)
#   resident-memory gpt2-10b, the layers' weights on the host: the step's memory (compiled,
#                  rematerialized, run once on zeros) for RUNS of micro-batch:resident layers
#   params-10b     gpt2-10b, int8 moments, stage 3 + offload_params (FLAG=--grads-in-params:
#                  the weights on the GPU; FLAG="--offload-params auto": as many layers
#                  resident as the largest micro-batch leaves room for), micro-batches BATCH
#                  (default 32 96); with .snap-base, that commit first (with BASE_FLAG)
#   accum-layers   stage 3 + grads_in_params, MODEL (gpt2-10b) with MOMENTS (fp32), RUNS of
#                  accumulation:micro-batch (default 4:8 1:32): accumulation summed in the
#                  layers' backward pass; each engine in its own process; CONFIGS of
#                  offload_bench.py (default offload: all the state on the host; auto: as
#                  much of it on the GPU as fits), each run in each, once for each of
#                  FORWARD (default overlap: the next step's forward overlaps the host
#                  update where it can; after: the update first, --no-overlap-forward)
#                  and of ACCUMULATION (default auto: the layers first where they fit;
#                  device: the layers' float32 sums)
#   kernel-torch   the C++ kernel (fp32) against torch's fused AdamW on the host CPU, each
#                  in a process of its own, in PAIRS (5) alternating pairs, 2^SIZES; PAIR
#                  names two other systems (kernel_vs_torch.py), e.g. "engine-int8 engine-fp32"
#   kernel-ceiling the C++ kernel (fp32) against a loop that moves the same 28 bytes a
#                  parameter without Adam's arithmetic, and prefetching or not
#                  (kernel_ceiling.cc), 2^SIZES (26 28), on THREADS (every CPU), ROUNDS (8)
#   suite          the README's test command (CPU only) on this machine's Python, with
#                  WORKERS (8) workers, the slow cases too (MARKS, default all: -m "")
#   params-schedule gpt2-10b cut to LAYERS (4) layers, offload_params, micro-batch 8: XLA's
#                  optimized HLO of the step (where the host-to-device copies start and
#                  end among the compute), in $OUT/hlo/, with XLA_EXTRA flags if set
#   params-flags   params-10b at micro-batch BATCH (32), once for each set of XLA flags in
#                  FLAGSETS (';' between sets; default: none, the while loop double-buffered,
#                  the host offload pipelined, no command buffers), each in its own process
#   checkpoint     checkpoint_bench.py: MODEL (gpt2-4b), OFFLOAD (true: all the state on
#                  the host; auto), MOMENTS (fp32) trained 2 steps, saved, restored: time,
#                  disk, host RSS, exact; with .snap-base, that commit first (this tree's script)
#   checkpoint-tests the checkpoints' CPU tests on this machine's Python and orbax
#   checkpoint-host gpt2-10b, fp32 moments, all the state on the host at stage 3 with
#                  --grads-in-params: jzo.estimate with and without a checkpoint's save
#                  counted, and the recipe saving every step (refused before drawing)
#   checkpoint-io  checkpoint_io_probe.py: GIB (12) of Adam-like state written and read by
#                  tensorstore alone in jzo's spans, zstd and uncompressed, and dd's write speed
#   probe          param_offload_probe.py: a scanned stack streamed from pinned host
#                  memory, fetched in the layer's iteration and a layer ahead
# Parts on several GPUs (nvidia-h200-x2; x4 for 4-GPU counts); the scaling figure's are
# figure-scale-* above (jzo stages 1-3 with and without offload, DeepSpeed, over GPUS):
#   pair-recipe    gpt2-1.5b through the recipe: one process over both GPUs, then one
#                  process per GPU (--coordinator), stage 2, offload + delayed update
#   pair-save      gpt2-1.5b through the recipe, one process per GPU, 4 steps: each
#                  process's peak host memory without checkpoints and saving at steps 2 and 4,
#                  for RUNS of moments:host share (default fp32:auto, fp32:1, int8:1); the
#                  pairs' CPU tests on this machine's Python; the logs in $OUT/pair-save.tar
#   scale-flags    gpt2-1.5b without offload at STAGES (3 2) on GPUS (4) GPUs and on one,
#                  for each set of XLA flags in FLAGSETS (collectives overlapped or not)
#   largest        experiments/largest_model.py: the largest GPT the planner fits with
#                  offload on each of GPUS (1 2 4) GPUs, each trained 2 steps (figure 5)
#   pair-runtime   a process's runtime alone (runtime_probe.py), one process on one GPU
#                  and each of a pair; then gpt2-1.5b through the recipe for RUNS of
#                  moments:host share (default int8:1 fp32:1), 4 steps, no checkpoints, one
#                  process on one GPU (micro-batch 8) and a pair: peak host memory against
#                  the plan's host total, alone and in a pair
# Output: $OUT/PART.json(l), $OUT/PART.log, $OUT/machine.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95

unpack() {  # SNAPSHOT-FOLDER -> prints the built tree's path (built once per machine), the
            # jzo python imports now (an earlier call may have installed another tree)
  local dir=/tmp/jzo-$(cat "$1/commit")
  if [ ! -d "$dir" ]; then
    mkdir -p "$dir" && tar -xf "$1/jzo.tar" -C "$dir" && cp -r .whl "$dir/"
    (cd "$dir" && source experiments/device_setup.sh >&2) || { rm -rf "$dir"; return 1; }
  else
    use "$dir"
  fi
  echo "$dir"
}
use() {  # TREE: makes it the jzo that python imports (an editable install)
  (cd "$1" && python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1)
}
base=""
[ -d .snap-base ] && { base=$(unpack .snap-base) || exit 1; }
dir=$(unpack .snap) || exit 1  # the last built: the one imported
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
{ date -u; cat .snap/commit; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  grep -m1 "model name" /proc/cpuinfo; nproc; free -g | head -2; python3 --version
  python3 -c "import jax; print('jax', jax.__version__)"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
cd "$dir" || exit 1

record() {  # PART SCRIPT ARGS...: runs an experiments/ script that writes --json; appends
  local part=$1 script=$2; shift 2
  python3 "experiments/$script" "$@" --json "$OUT/$part.tmp.json" >>"$OUT/$part.log" 2>&1
  echo "$part $script $*: exit $?"; cat "$OUT/$part.tmp.json" >>"$OUT/$part.jsonl" 2>/dev/null
  echo >>"$OUT/$part.jsonl"; rm -f "$OUT/$part.tmp.json"
  grep -E "TFLOPS|refused|rror|status" "$OUT/$part.log" | cut -c1-300 | tail -4
}
hf() {  # PART ARGS...: hf_baselines.py (transformers' models under DeepSpeed)
  local part=$1; shift
  python3 experiments/hf_baselines.py "$@" --out "$OUT/$part.jsonl" >>"$OUT/$part.log" 2>&1
  echo "$part hf_baselines $*: exit $?"; tail -c 1200 "$OUT/$part.jsonl" 2>/dev/null; echo
}
recipe() {  # PART MODEL STEPS FLAGS...: the recipe, with its peak host memory
  local part=$1 model=$2 steps=$3; shift 3
  /usr/bin/time -v timeout 560 python3 -m jzo.train --model "$model" --seq-len 1024 \
    --batch-size "${BATCH:-8}" --steps "$steps" --warmup 2 --log-every 2 --eval-every 1000 \
    --checkpoint-every 0 --sample-tokens 0 --lr 1e-4 ${DPU---delayed-update} --out "/tmp/run-$part" \
    "$@" >"$OUT/$part.log" 2>&1
  echo "$part: exit $?"; grep -v "step/s\]" "$OUT/$part.log" | grep -E "^step|Maximum resident" | tail -4
  cp "/tmp/run-$part/metrics.jsonl" "$OUT/$part-metrics.jsonl" 2>/dev/null
}
pytests() {  # NAME TIMEOUT FILES...: one pytest call; its log in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -X faulthandler -m pytest -q -p no:cacheprovider "$@" \
    >"$OUT/$name.log" 2>&1
  local status=$?
  echo "$name: exit $status"; tail -1 "$OUT/$name.log"
  grep -m3 -E "Fatal|FAILED" "$OUT/$name.log" || true
  return $status  # pytest's, not grep's: `PART && NEXT` goes on when the tests pass
}

for part in "$@"; do
  case $part in
    tests)
      for m in jzo.train jzo.estimate jzo.export; do
        python3 -m $m --help >/dev/null 2>&1; echo "$m --help: exit $?"
      done
      JAX_PLATFORMS=cuda,cpu pytests tests-gpu 240 tests/test_offload_gpu.py
      for t in test_transfer test_streaming test_offload test_accumulation test_placement \
               test_finetune test_engine test_cpu_adam test_quant8; do
        pytests "$t" 300 "tests/$t.py"
      done ;;
    multiprocess)
      JAX_PLATFORMS=cpu pytests multiprocess 500 tests/test_multiprocess.py \
        tests/test_multiprocess_signals.py ;;
    cpu-adam)
      JAX_PLATFORMS=cuda,cpu pytests cpu-adam-xla 240 tests/test_cpu_adam.py  # the XLA path
      JAX_PLATFORMS=cpu python3 experiments/cpu_adam_bench.py --sizes 24 28 \
        --json "$OUT/cpu-adam.json" 2>&1 | tee "$OUT/cpu-adam.log" ;;
    int8-tests)
      for m in jzo.train jzo.estimate jzo.export; do
        python3 -m $m --help >/dev/null 2>&1; echo "$m --help: exit $?"
      done
      pytests int8-kernels 300 tests/test_quant8.py tests/test_kernels.py
      JAX_PLATFORMS=cuda,cpu pytests int8-xla 300 tests/test_cpu_adam.py \
        tests/test_quant8.py -k "not engine and not streamed" ;;
    kernel-moments)
      for tree in $base "$dir"; do
        [ -n "$base" ] && use "$tree"
        name=$part-$(basename "$tree")
        (cd "$tree" && JAX_PLATFORMS=cpu python3 experiments/cpu_adam_bench.py --systems kernel \
          --sizes ${SIZES:-16 18 20 22 24 26 28} --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1)
        echo "$name: exit $?"; grep -A12 "^ratio" "$OUT/$name.log"
      done ;;
    checkpoint-tests)
      JAX_PLATFORMS=cpu pytests "$part" 400 tests/test_state_spans.py tests/test_checkpoint.py ;;
    checkpoint)
      for tree in $base "$dir"; do
        [ -n "$base" ] && use "$tree"
        name=$part-${MOMENTS:-fp32}-$(basename "$tree"); check=""
        [ "$tree" = "$base" ] && check=--no-check
        (cd "$tree" && timeout 500 python3 "$dir/experiments/checkpoint_bench.py" \
          --model "${MODEL:-gpt2-4b}" --offload "${OFFLOAD:-true}" --moments "${MOMENTS:-fp32}" $check \
          --peak-file "$OUT/$name.peak" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1)
        echo "$name: exit $?, peak RSS $(cat "$OUT/$name.peak" 2>/dev/null) B"
        tail -c 700 "$OUT/$name.log"; echo; free -g | head -2
      done ;;
    checkpoint-host)
      on_host="--model gpt2-10b --stage 3 --grads-in-params --batch-size 32 --seq-len 1024"
      for counted in --checkpoints --no-checkpoints; do
        timeout 120 python3 -m jzo.estimate $on_host --offload true $counted >"$OUT/$part$counted.log" 2>&1
        echo "estimate $counted: exit $?"; tail -4 "$OUT/$part$counted.log"
      done
      start=$SECONDS
      timeout 300 python3 -m jzo.train $on_host --offload-fraction 1 --steps 2 \
        --checkpoint-every 1 --sample-tokens 0 --out "/tmp/run-$part" >"$OUT/$part.log" 2>&1
      echo "recipe: exit $?, $((SECONDS - start)) s"; tail -c 1500 "$OUT/$part.log" ;;
    checkpoint-io)
      timeout 500 python3 experiments/checkpoint_io_probe.py --gib "${GIB:-12}" \
        --json "$OUT/$part.json" 2>&1 | tee "$OUT/$part.log"; df -h /tmp | tail -1 ;;
    quant8-exhaustive)
      g++ -O2 -std=c++17 -ffp-contract=off -Iext -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c \
        tests/quant8_exhaustive.cc ext/quant8.cc -o /tmp/quant8_exhaustive 2>/dev/null &&
        /tmp/quant8_exhaustive 2>&1 | tee "$OUT/$part.log" ;;
    gather-cost)
      { cat /sys/devices/system/cpu/vulnerabilities/gather_data_sampling; grep -m1 microcode /proc/cpuinfo
        g++ -O2 -mavx512f -mavx2 experiments/gather_cost.cc -o /tmp/gather_cost && /tmp/gather_cost
      } 2>&1 | tee "$OUT/$part.log" ;;
    moments-quality)
      for moments in fp32 bf16 int8; do
        (XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 560 python3 -m jzo.train --model gpt2-124m \
           --seq-len 256 --batch-size 16 --steps "${STEPS:-2000}" --moments $moments \
           --offload-fraction 1 --eval-every 100 --eval-batches 16 --log-every 100 \
           --checkpoint-every 0 --sample-tokens 0 --out "/tmp/run-$part-$moments" \
           >"$OUT/$part-$moments.log" 2>&1
         echo "$part $moments: exit $?"
         cp "/tmp/run-$part-$moments/metrics.jsonl" "$OUT/$part-$moments.jsonl") &
      done
      wait
      grep -h "eval" "$OUT"/$part-*.log | tail -6 ;;
    grads-check)
      pytests grads-tests 240 tests/test_grads_in_params.py
      for flag in "" --grads-in-params; do
        timeout 200 python3 -m jzo.train --model gpt2-350m --stage 3 $flag --seq-len 512 \
          --batch-size 8 --steps 30 --warmup 2 --log-every 5 --eval-every 1000 \
          --checkpoint-every 0 --sample-tokens 0 --out "/tmp/run-$part$flag" \
          >"$OUT/$part$flag.log" 2>&1
        echo "$part $flag: exit $?"; grep -v "step/s\]" "$OUT/$part$flag.log" | grep "^step" | tail -3
      done ;;
    grads-20b)
      # One process (--config): the time limit stops the run itself, each
      # micro-batch's result already in the log ("result:").
      timeout ${LIMIT:-540} python3 experiments/offload_bench.py --config offload --model gpt2-20b \
        --moments int8 --stage 3 --grads-in-params --batch ${BATCH:-16 32} --steps 3 \
        --compiled-memory >"$OUT/$part.json" 2>"$OUT/$part.log"
      echo "$part: exit $?"; grep -E "^result|compiled|^step|^offload|rror" "$OUT/$part.log" | cut -c1-400 | tail -12 ;;
    params-gpu)
      JAX_PLATFORMS=cuda,cpu pytests params-gpu 240 tests/test_offload_gpu.py ;;
    params-check)
      JAX_PLATFORMS=cuda,cpu pytests params-gpu 240 tests/test_offload_gpu.py
      JAX_PLATFORMS=cpu pytests params-tests 300 tests/test_offload_params.py
      # --offload-params offloads what the GPU needs: a plan for 1.6 GiB
      # keeps no layer resident, one for 1.8 GiB 4 of 24.
      for flag in --grads-in-params "--offload-params --device-memory-gb 1.6" \
                  "--offload-params --device-memory-gb 1.8"; do
        name=$part$(echo $flag | tr -d ' ')
        timeout 200 python3 -m jzo.train --model gpt2-350m --stage 3 $flag --seq-len 512 \
          --batch-size 8 --steps 30 --warmup 2 --log-every 5 --eval-every 1000 \
          --checkpoint-every 0 --sample-tokens 0 --out "/tmp/run-$name" >"$OUT/$name.log" 2>&1
        echo "$part $flag: exit $?"; grep -m1 "weight" "$OUT/$name.log" | cut -c1-200
        grep -o "step [0-9]*: loss [0-9.]*\(, eval [0-9.]*\)\?" "$OUT/$name.log" | tr '\n' ' '; echo
      done ;;
    resident-memory)
      # gpt2-10b, int8 moments, the layers' weights on the host: the step's
      # compiled memory, XLA's rematerializations and its peak run once on
      # zeros, for RUNS of micro-batch:resident layers, each in its own process.
      for run in ${RUNS:-96:0 96:10 96:20 80:39}; do
        timeout 200 python3 experiments/step_memory.py --model gpt2-10b --batch ${run%:*} \
          --offload-params --resident ${run#*:} --run >"$OUT/$part-${run/:/-}.log" 2>&1
        echo "$part $run: exit $?"; grep -E "resident grads|ran:|rror" "$OUT/$part-${run/:/-}.log"
      done ;;
    params-10b)
      # gpt2-10b, int8 moments, stage 3, the layers' weights on the host
      # (FLAG: --grads-in-params keeps them on the GPU), micro-batches BATCH.
      # BASE_FLAG: the base tree's flags, where they differ.
      for tree in $base "$dir"; do
        [ -n "$base" ] && use "$tree"
        flag=${FLAG:---offload-params}
        [ "$tree" = "$base" ] && flag=${BASE_FLAG:-$flag}
        name=$part$(echo $flag | tr -d ' ')-$(basename "$tree")
        (cd "$tree" && timeout 540 python3 experiments/offload_bench.py --config offload \
          --model gpt2-10b --moments int8 --stage 3 $flag \
          --batch ${BATCH:-32 96} --steps 3 --compiled-memory >"$OUT/$name.json" 2>"$OUT/$name.log")
        echo "$name: exit $?"; grep -E "^result|compiled|^step|^offload|rror" "$OUT/$name.log" | cut -c1-400 | tail -12
      done ;;
    accum-layers)
      model=${MODEL:-gpt2-10b}; moments=${MOMENTS:-fp32}
      for run in ${RUNS:-4:8 1:32}; do
      for config in ${CONFIGS:-offload}; do
      for forward in ${FORWARD:-overlap}; do
      for accumulation in ${ACCUMULATION:-auto}; do
        accum=${run%:*} micro=${run#*:}
        name=$part-$model-$moments-${accum}x$micro-$config-$forward-$accumulation
        flag=""; [ "$forward" = after ] && flag=--no-overlap-forward
        timeout 500 python3 experiments/offload_bench.py --config $config --model $model \
          --moments $moments --stage 3 --grads-in-params --grad-accum $accum --batch $micro \
          --accumulation $accumulation --steps 3 --compiled-memory $flag \
          ${BENCH_FLAGS:-} >"$OUT/$name.json" 2>"$OUT/$name.log"
        echo "$name: exit $?"; grep -E "^result|compiled|^step|^offload|rror|optimizer state" \
          "$OUT/$name.log" | cut -c1-400 | tail -12
      done; done; done; done ;;
    kernel-ceiling)
      flags="-O3 -std=c++17 -ffp-contract=off -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mavx2 -mfma -mf16c"
      g++ $flags -Iext -c ext/adam_avx512.cc -o /tmp/k.o &&
        g++ $flags -Iext experiments/kernel_ceiling.cc ext/quant8.cc /tmp/k.o \
          -o /tmp/kernel_ceiling -lpthread || continue
      for e in ${SIZES:-26 28}; do /tmp/kernel_ceiling "$e" "${ROUNDS:-8}" "${THREADS:-$(nproc)}"; done \
        | tee "$OUT/$part.log" ;;
    suite)
      # (the notebook's test needs nbformat, which this machine's Python lacks;
      # XLA at its default optimization, where the README's command asks for
      # little: OPT=1 for the README's level)
      JAX_PLATFORMS=cpu JAX_DISABLE_MOST_OPTIMIZATIONS=${OPT:-0} pytests "$part" 560 -n "${WORKERS:-8}" --dist loadfile --durations=15 \
        -m "${MARKS:-}" \
        $(python3 -c "import nbformat" 2>/dev/null || echo --ignore=tests/test_notebook.py) ;;
    kernel-torch)
      JAX_PLATFORMS=cpu python3 experiments/kernel_vs_torch.py --pairs ${PAIRS:-5} --pair ${PAIR:-jzo torch} \
        --sizes ${SIZES:-16 18 20 22 24 26 28} --json "$OUT/$part.json" 2>&1 | tee "$OUT/$part.log" ;;
    params-flags)
      default=";--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_DOUBLE_BUFFER"
      default+=";--xla_gpu_enable_pipelined_host_offloading=true;--xla_gpu_enable_command_buffer="
      IFS=';' read -ra sets <<<"${FLAGSETS-$default}"
      for i in "${!sets[@]}"; do
        name=$part-$i; echo "$name: XLA_FLAGS=${sets[$i]}"
        XLA_FLAGS="${sets[$i]}" timeout 240 python3 experiments/offload_bench.py --config offload \
          --model gpt2-10b --moments int8 --stage 3 --offload-params --batch ${BATCH:-32} \
          --steps 3 --compiled-memory >"$OUT/$name.json" 2>"$OUT/$name.log"
        echo "$name: exit $?"; grep -E "^result|compiled|rror" "$OUT/$name.log" | cut -c1-400 | tail -4
      done ;;
    scale-flags)
      # Does XLA overlap the ZeRO collectives with compute? gpt2-1.5b without
      # offload at STAGES (3 2) over GPUS (4) GPUs, once for each set of XLA
      # flags in FLAGSETS (';' between sets; default: none, the stage-3
      # all-gather pipelined across the layers' loop, that and the loop
      # double-buffered, that and larger combine thresholds), then on 1 GPU.
      default=";--xla_gpu_enable_pipelined_all_gather=true"
      default+=";--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_DOUBLE_BUFFER"
      default+=";--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_all_gather_combine_threshold_bytes=134217728 --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728"
      IFS=';' read -ra sets <<<"${FLAGSETS-$default}"
      for stage in ${STAGES:-3 2}; do
        for n in ${GPUS:-4} 1; do
          for i in "${!sets[@]}"; do
            [ "$n" = 1 ] && [ "$i" != 0 ] && continue  # one GPU has no collectives
            name=$part-s$stage-g$n-$i; echo "$name: XLA_FLAGS=${sets[$i]}"
            XLA_FLAGS="${sets[$i]}" timeout 200 python3 experiments/offload_bench.py --config device \
              --model gpt2-1.5b --stage $stage --gpus $n --no-breakdown --steps 5 \
              >"$OUT/$name.json" 2>"$OUT/$name.log"
            echo "$name: exit $?"; grep -o '"step_s": [0-9.]*\|rror.*' "$OUT/$name.log" | head -2
          done
        done
      done ;;
    largest)
      python3 experiments/largest_model.py --gpus ${GPUS:-1 2 4} --run --json "$OUT/$part.json" \
        >"$OUT/$part.log" 2>&1
      echo "$part: exit $?"; grep -E "GPU\(s\)|trained" "$OUT/$part.log" ;;
    params-schedule)
      rm -rf /tmp/hlo
      XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text ${XLA_EXTRA:-}" timeout 200 python3 \
        experiments/offload_bench.py --config offload --model gpt2-10b --n-layer ${LAYERS:-4} \
        --moments int8 --stage 3 --offload-params --batch 8 --steps 1 >"$OUT/$part.json" \
        2>"$OUT/$part.log"
      echo "$part: exit $?"; mkdir -p "$OUT/hlo"
      for f in $(grep -lE "copy-start|slice-start" /tmp/hlo/*after_optimizations.txt); do
        gzip -c "$f" >"$OUT/hlo/$(basename "$f").gz"
        echo "$(basename "$f"): $(grep -c "copy-start" "$f") copy-start," \
          "$(grep -c "dynamic-slice-start" "$f") dynamic-slice-start, $(grep -c " while(" "$f") while"
      done ;;
    probe)
      timeout ${LIMIT:-300} python3 experiments/param_offload_probe.py --tokens ${TOKENS:-8192 32768} \
        >"$OUT/$part.jsonl" 2>"$OUT/$part.log"
      echo "$part: exit $?"; cut -c1-300 "$OUT/$part.jsonl"; tail -3 "$OUT/$part.log" ;;
    offload-steps)
      for tree in $base "$dir"; do
        [ -n "$base" ] && use "$tree"
        for model in gpt2-1.5b gpt2-4b; do
          (cd "$tree" && record "$part" offload_bench.py --model $model --configs offload_dpu \
            --steps 6)
        done
      done ;;
    recipe-10b) recipe $part gpt2-10b "${STEPS:-22}" ;;
    recipe-13b) recipe $part gpt2-13b "${STEPS:-14}" --moments bf16 ;;
    sample-check)
      for flag in --grads-in-params --offload-params; do
        timeout 100 python3 -m jzo.train --model gpt2-350m --stage 3 $flag --steps 4 \
          --batch-size 8 --seq-len 512 --eval-every 4 --eval-batches 1 --checkpoint-every 0 \
          --sample-tokens 20 --out "/tmp/run-$part$flag" >"$OUT/$part$flag.log" 2>&1
        echo "$part $flag: exit $?"; tr '\r' '\n' <"$OUT/$part$flag.log" | grep -E "^step|sample|rror" | tail -3
      done ;;
    recipe-13b-32) BATCH=32 DPU= recipe $part gpt2-13b "${STEPS:-10}" --moments bf16 --stage 3 \
                     --grads-in-params ;;
    bench-10b) record $part offload_bench.py --model gpt2-10b --configs auto_dpu --steps 6 ;;
    peers-4b)
      record $part offload_bench.py --model gpt2-4b --configs device auto --steps 4
      record $part torch_baselines.py --model gpt2-4b --system deepspeed --steps 4 ;;
    figure-*)
      python3 experiments/figure_runs.py "${part#figure-}" --out "$OUT" ${GPUS:+--gpus $GPUS} \
        >"$OUT/$part.log" 2>&1
      echo "$part: exit $?"; grep -E '^\{|status' "$OUT/$part.log" | cut -c1-300 | tail -12 ;;
    loss-tests)
      for m in jzo.train jzo.estimate jzo.export; do
        python3 -m $m --help >/dev/null 2>&1; echo "$m --help: exit $?"
      done
      JAX_PLATFORMS=cuda,cpu pytests loss-gpu 300 tests/test_cross_entropy.py -k "not engine" \
        tests/test_offload_gpu.py
      JAX_PLATFORMS=cpu pytests loss-cpu 400 -n 8 tests/test_cross_entropy.py \
        tests/test_llama.py tests/test_gpt.py tests/test_hf.py ;;
    loss-chunks)
      # The loss through the head in chunks against all the logits: the loss
      # alone (loss_bench.py), then llama-3.1-8b, offload auto + delayed
      # update, micro-batches BATCH (4): with .snap-base, that commit first
      # (its jzo, this tree's llama_bench.py: the one before 32af19c fails).
      for tree in $base "$dir"; do
        [ -n "${SKIP_LOSS:-}" ] && break
        [ -n "$base" ] && use "$tree"
        name=$part-loss-$(basename "$tree")
        (cd "$tree" && python3 "$dir/experiments/loss_bench.py" --case gpt2-10b:96x1024 \
          llama-3.1-8b:4x4096 llama-3.1-8b:8x4096 --chunk-bytes ${CHUNK_BYTES:-} \
          --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1)
        echo "$name: exit $?"; tail -8 "$OUT/$name.log" | cut -c1-300
      done
      [ -n "${SKIP_LLAMA:-}" ] && continue
      for tree in $base "$dir"; do
        [ -n "$base" ] && use "$tree"
        name=$part-llama8b-$(basename "$tree")
        (cd "$tree" && timeout 260 python3 "$dir/experiments/llama_bench.py" --model llama-3.1-8b \
          --seq-len 4096 --batch ${BATCH:-4} --configs auto_dpu --steps 8 --timeout 250 \
          --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1)
        echo "$name: exit $?"; grep -E "TFLOPS|refused|rror" "$OUT/$name.log" | cut -c1-300 | tail -4
      done ;;
    llama8b) record $part llama_bench.py --model llama-3.1-8b --seq-len 4096 --batch 4 \
               --configs auto_dpu --steps 10 --timeout 260 ;;
    llama8b-14l)
      record $part llama_bench.py --model llama-3.1-8b --n-layer 14 --seq-len 4096 --batch 4 \
        --configs auto_dpu --steps 10 --timeout 200
      hf $part --shape llama-3.1-8b --n-layer 14 --system deepspeed --seq-len 4096 \
        --micro-batch 4 --steps 8 --timeout 260 ;;
    ds-llama8b) hf $part --shape llama-3.1-8b --system deepspeed --seq-len 4096 \
                  --micro-batch 4 --steps 4 --timeout 200 ;;
    qwen14b) record $part llama_bench.py --model qwen2.5-14b --seq-len 4096 --batch 1 2 \
               --moments bf16 --configs auto --steps 5 --timeout 420 ;;
    stream8b)
      for config in auto offload; do
        for limit in 0 2; do  # 0: one set of landing buffers
          record $part llama_bench.py --model llama-3.1-8b --seq-len 4096 --batch 2 \
            --moments bf16 --configs $config --steps 5 --timeout 280 --landing-limit-gb $limit
        done
      done ;;
    streamed-check) timeout 300 python3 experiments/streamed_check.py --steps 2 2>&1 \
                      | tee "$OUT/$part.log" ;;
    accum-4b)
      record $part offload_bench.py --model gpt2-4b --batch 8 --configs device --steps 6
      for where in device host; do
        record $part offload_bench.py --model gpt2-4b --batch 8 --grad-accum 4 \
          --accumulation $where --configs offload_dpu --steps 6
      done ;;
    accum-10b)
      record $part offload_bench.py --model gpt2-10b --moments bf16 --batch 8 \
        --configs auto_dpu --steps 6
      record $part offload_bench.py --model gpt2-10b --moments bf16 --batch 8 --grad-accum 4 \
        --accumulation host --configs auto_dpu --steps 5 ;;
    host-sums) python3 experiments/host_sums_bench.py --log2n 30 2>&1 | tee "$OUT/$part.log" ;;
    pair-recipe)
      common=(--model gpt2-1.5b --seq-len 1024 --batch-size 16 --steps 30 --warmup 2
              --log-every 10 --eval-every 1000 --checkpoint-every 0 --sample-tokens 0
              --offload --delayed-update)
      # GPUs 0 and 1 both ways, whatever the machine has.
      CUDA_VISIBLE_DEVICES=0,1 timeout 400 python3 -m jzo.train "${common[@]}" --out /tmp/run-one \
        >"$OUT/$part-one.log" 2>&1
      echo "one process: exit $?"; grep -o "step 30: [^%]*%" "$OUT/$part-one.log"
      port=$((20000 + RANDOM % 20000))
      for i in 0 1; do
        CUDA_VISIBLE_DEVICES=$i timeout 400 python3 -m jzo.train "${common[@]}" \
          --out /tmp/run-pair --coordinator 127.0.0.1:$port --num-processes 2 --process-id $i \
          >"$OUT/$part-pair$i.log" 2>&1 &
      done
      wait; echo "a process per GPU: $(grep -c "" "$OUT/$part-pair0.log") lines"
      grep -o "step 30: [^%]*%" "$OUT/$part-pair0.log"
      cp /tmp/run-one/metrics.jsonl "$OUT/$part-one.jsonl"
      cp /tmp/run-pair/metrics.jsonl "$OUT/$part-pair.jsonl" ;;
    pair-save)
      JAX_PLATFORMS=cpu pytests pair-tests 400 tests/test_multiprocess.py
      mkdir -p /tmp/pair-save
      for run in ${RUNS:-fp32:auto fp32:1 int8:1}; do
        for every in 0 2; do
          name=${run/:/-}-every$every; port=$((20000 + RANDOM % 20000))
          for i in 0 1; do
            CUDA_VISIBLE_DEVICES=$i /usr/bin/time -v timeout 400 python3 -m jzo.train \
              --model gpt2-1.5b --seq-len 1024 --batch-size 16 --steps 4 --warmup 2 \
              --log-every 1 --eval-every 1000 --checkpoint-every $every --sample-tokens 0 \
              --moments ${run%:*} --offload-fraction ${run#*:} --out /tmp/run-$name \
              --coordinator 127.0.0.1:$port --num-processes 2 --process-id $i \
              >"/tmp/pair-save/$name-$i.log" 2>&1 &
          done
          wait; echo "$name: checkpoints $(ls /tmp/run-$name/checkpoints 2>/dev/null | tr '\n' ' ')"
          grep -h -E "optimizer state|Maximum resident|^  total  |checkpoint writes|rror" \
            /tmp/pair-save/$name-[01].log | cut -c1-160 | sort | uniq -c
          grep -h -o "step [24]: loss [0-9.]*\|host [0-9.]* GiB" /tmp/pair-save/$name-0.log | tr '\n' ' '
          echo; du -sh /tmp/run-$name/checkpoints/* 2>/dev/null; rm -rf /tmp/run-$name
        done
      done
      tar -cf "$OUT/$part.tar" -C /tmp pair-save ;;
    pair-runtime)
      for n in 1 2; do
        port=$((20000 + RANDOM % 20000))
        for i in $(seq 0 $((n - 1))); do
          CUDA_VISIBLE_DEVICES=$i python3 experiments/runtime_probe.py --processes $n \
            --process-id $i --coordinator 127.0.0.1:$port >"$OUT/probe-$n-$i.json" 2>"$OUT/probe-$n-$i.err" &
        done
        wait; cat "$OUT"/probe-$n-*.json
      done
      for run in ${RUNS:-int8:1 fp32:1}; do
        for n in 1 2; do
          name=${run/:/-}-x$n; port=$((20000 + RANDOM % 20000))
          for i in $(seq 0 $((n - 1))); do
            dist=""
            [ "$n" -gt 1 ] && dist="--coordinator 127.0.0.1:$port --num-processes $n --process-id $i"
            CUDA_VISIBLE_DEVICES=$i /usr/bin/time -v timeout 300 python3 -m jzo.train \
              --model gpt2-1.5b --seq-len 1024 --batch-size $((8 * n)) --steps 4 --warmup 2 \
              --log-every 1 --eval-every 1000 --checkpoint-every 0 --sample-tokens 0 \
              --moments ${run%:*} --offload-fraction ${run#*:} --out /tmp/run-$name $dist \
              >"$OUT/$name-$i.log" 2>&1 &
          done
          wait
          echo "$name: $(grep -h -E "^  total  |Maximum resident|rror" "$OUT"/$name-[01].log | cut -c1-120 | tr -s ' ' | tr '\n' ';')"
          rm -rf /tmp/run-$name
        done
      done ;;
    *) echo "unknown part $part" ;;
  esac
done
