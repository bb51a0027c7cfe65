#!/usr/bin/env bash
# Session 8's GPU runs (issues 22 and 23) from a snapshot of a commit, so
# that work in progress in the checkout stays out. Here:
#   rm -rf .snap && mkdir .snap && git archive HEAD -o .snap/jzo.tar && git rev-parse --short HEAD >.snap/commit
# then, through the device tool, carrying .snap and .whl (DeepSpeed 0.19.8,
# tyro and their dependencies as wheels):
#   bash experiments/device_session8.sh PART [PART ...]
# Parts:
#   tests     the GPU tests, the fine-tuning and accumulation tests on this Python, --help
#   acc4b     gpt2-4b: no offload at micro-batch 8 (what fits), then offload=True with
#             4 x 8 summed on the host and on the device, both with the delayed update
#   acc10b    gpt2-10b, bf16 moments: offload auto + delayed update at 8 (no accumulation)
#             and at 4 x 8 summed on the host
#   acc10bhost  the second of those alone
#   ds8b      DeepSpeed ZeRO-2 + offload_optimizer, transformers' LlamaForCausalLM of
#             llama-3.1-8b's shape at seq 4096 (host memory runs out, as arithmetic says)
#   qwen14    jzo, qwen2.5-14b with bf16 moments, micro-batch 1 at seq 4096
#   hostbench the host accumulation's passes alone on the host (host_sums_bench.py)
#   segv      test_accumulation's case that crashed in XLA's CPU compiler on jax 0.11.2:
#             alone, without the compilation cache, with an HLO dump, then the whole file
#   bisect    segv_bisect.py: which option makes that crash; the crashing program's HLO;
#             test_accumulation without that case
#   cpu312    segv_bisect.py, then the CPU test files that build engines, on this Python and jax
#   passes    the crashing case with XLA's HLO dumped after every pass: $OUT/passes.tar.gz
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
  python3 -c "import jax, torch, transformers; print('jax', jax.__version__, 'torch',
torch.__version__, 'transformers', transformers.__version__)"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
cd "$dir" || exit 1
gpt() {  # PART, then offload_bench's arguments; appends to PART.jsonl
  local part=$1; shift
  python3 experiments/offload_bench.py "$@" --json "$OUT/$part.tmp.json" >>"$OUT/$part.log" 2>&1
  echo "$part $*: exit $?"; cat "$OUT/$part.tmp.json" >>"$OUT/$part.jsonl" 2>/dev/null
  echo >>"$OUT/$part.jsonl"; grep -E "TFLOPS|refused|rror" "$OUT/$part.log" | cut -c1-300 | tail -4
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
      for t in test_finetune test_accumulation test_transfer test_offload; do
        timeout 300 python3 -X faulthandler -m pytest -v -p no:cacheprovider tests/$t.py \
          >"$OUT/$t.log" 2>&1
        echo "$t: exit $?"; tail -2 "$OUT/$t.log"
      done ;;
    acc4b)
      gpt $part --model gpt2-4b --batch 8 --configs device --steps 6
      gpt $part --model gpt2-4b --batch 8 --grad-accum 4 --accumulation host \
        --configs offload_dpu --steps 6
      gpt $part --model gpt2-4b --batch 8 --grad-accum 4 --accumulation device \
        --configs offload_dpu --steps 6 ;;
    acc10b)
      gpt $part --model gpt2-10b --moments bf16 --batch 8 --configs auto_dpu --steps 6
      gpt $part --model gpt2-10b --moments bf16 --batch 8 --grad-accum 4 --accumulation host \
        --configs auto_dpu --steps 5 ;;
    acc10bhost)
      gpt $part --model gpt2-10b --moments bf16 --batch 8 --grad-accum 4 --accumulation host \
        --configs auto_dpu --steps 5 ;;
    ds8b) python3 experiments/hf_baselines.py --shape llama-3.1-8b --system deepspeed \
            --seq-len 4096 --micro-batch 4 --steps 4 --timeout 200 --out "$OUT/ds8b.jsonl" \
            >"$OUT/ds8b.log" 2>&1
          echo "ds8b: exit $?"; tail -c 1500 "$OUT/ds8b.jsonl" 2>/dev/null; echo ;;
    qwen14) python3 experiments/llama_bench.py --model qwen2.5-14b --seq-len 4096 --batch 1 \
              --moments bf16 --configs auto --steps 6 --timeout 240 --json "$OUT/qwen14.json" \
              >"$OUT/qwen14.log" 2>&1
            echo "qwen14: exit $?"; grep -E "TFLOPS|refused|rror" "$OUT/qwen14.log" | tail -5 ;;
    hostbench) python3 experiments/host_sums_bench.py --log2n 30 2>&1 | tee "$OUT/hostbench.log" ;;
    segv)
      id="tests/test_accumulation.py::test_host_accumulation_equals_device_accumulation[1-None-half-host-plain]"
      run() { local name=$1; shift
        env "$@" timeout 150 python3 -X faulthandler -m pytest -q -p no:cacheprovider "$id" \
          >"$OUT/segv-$name.log" 2>&1
        echo "segv $name: exit $?"; grep -m3 -E "passed|failed|Fatal" "$OUT/segv-$name.log"; }
      run alone
      run nocache JAX_ENABLE_COMPILATION_CACHE=false
      run dump XLA_FLAGS="--xla_dump_to=/tmp/segv-dump --xla_dump_hlo_pass_re=^$"
      mkdir -p "$OUT/segv-dump" && ls -t /tmp/segv-dump 2>/dev/null | head -8 | \
        while read -r f; do cp "/tmp/segv-dump/$f" "$OUT/segv-dump/"; done
      timeout 400 python3 -X faulthandler -m pytest -v -p no:cacheprovider \
        tests/test_accumulation.py >"$OUT/segv-file.log" 2>&1
      echo "test_accumulation: exit $?"; tail -2 "$OUT/segv-file.log"
      grep -E "Fatal|FAILED" "$OUT/segv-file.log" | head -3 ;;
    bisect)
      timeout 300 python3 experiments/segv_bisect.py 2>&1 | tee "$OUT/bisect.log"
      XLA_FLAGS=--xla_dump_to=/tmp/base-dump JAX_ENABLE_COMPILATION_CACHE=false timeout 120 \
        python3 experiments/segv_bisect.py base
      mkdir -p "$OUT/hlo" && ls -S /tmp/base-dump/*before_optimizations.txt | head -2 | \
        while read -r f; do cp "$f" "$OUT/hlo/"; done
      id="tests/test_accumulation.py::test_host_accumulation_equals_device_accumulation[1-None-half-host-plain]"
      timeout 400 python3 -X faulthandler -m pytest -q -p no:cacheprovider --deselect "$id" \
        tests/test_accumulation.py >"$OUT/accumulation-rest.log" 2>&1
      echo "test_accumulation without it: exit $?"; tail -2 "$OUT/accumulation-rest.log"
      grep -E "Fatal|FAILED|::test" "$OUT/accumulation-rest.log" | head -5 ;;
    cpu312)
      timeout 300 python3 experiments/segv_bisect.py 2>&1 | tee "$OUT/bisect.log"
      for t in test_cpu_adam test_accumulation test_offload test_engine; do
        timeout 300 python3 -X faulthandler -m pytest -q -p no:cacheprovider tests/$t.py \
          >"$OUT/$t.log" 2>&1
        echo "$t: exit $?"; tail -1 "$OUT/$t.log"; grep -m3 -E "Fatal|FAILED" "$OUT/$t.log"
      done ;;
    passes)
      rm -rf /tmp/passes && XLA_FLAGS="--xla_dump_to=/tmp/passes --xla_dump_hlo_pass_re=.*" \
        timeout 200 python3 experiments/segv_bisect.py base
      last=$(ls -t /tmp/passes | head -1); echo "newest: $last"
      module=${last%%.*}; ls -t /tmp/passes | grep "^$module\." | head -5
      tar -czf "$OUT/passes.tar.gz" -C /tmp/passes $(ls /tmp/passes | grep "^$module\.") ;;
    empty) timeout 300 python3 experiments/segv_bisect.py base empty-sharded empty-replicated \
             no-accum-empty-replicated 2>&1 | tee "$OUT/empty.log" ;;
    *) echo "unknown part $part" ;;
  esac
done
