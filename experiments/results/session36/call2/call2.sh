# Session 36 call 2: the build a piece at a time, untuned copies; then the 101-layer step over 4 GPUs.
bash experiments/gpu_runs.sh >/dev/null 2>&1 || { echo setup failed; exit 1; }
cp .snap/piece_check.py /tmp/
cd /tmp/jzo-$(cat .snap/commit) || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
python3 /tmp/piece_check.py 2>&1 | grep -v "^I1\|^W1" | tail -5
big() {  # NAME [env...]: the 101-layer run
  local name=$1; shift
  local start=$(date +%s)
  env "$@" TF_CPP_MIN_LOG_LEVEL=0 timeout 260 python3 experiments/offload_bench.py --config auto --model gpt2-20b \
    --n-layer 101 --gpus 4 --stage 3 --batch 8 --steps 2 --no-breakdown --live-arrays --compiled-memory \
    >"$OUT/$name.json" 2>"$OUT/$name.log"
  echo "$name: exit $? in $(( $(date +%s) - start )) s"
  grep -E "^built|^live|^compiled|^step|^result|RESOURCE|Could not get config|LargestFreeBlock|InUse:|rror" "$OUT/$name.log" | cut -c1-700 | head -30
}
big s101
if ! grep -q "^step 0" "$OUT/s101.log"; then
  big s101-nofusiontune XLA_FLAGS=--xla_gpu_experimental_enable_fusion_autotuner=false
else
  for g in 1 4; do
    timeout 150 python3 experiments/offload_bench.py --config auto --model gpt2-4b --gpus $g --stage 3 \
      --steps 2 --no-breakdown >"$OUT/b4-$g.json" 2>"$OUT/b4-$g.log"
    echo "b4 over $g: exit $?"; grep -E "^built|RESOURCE" "$OUT/b4-$g.log" | cut -c1-400
    grep -o '"planned_build_gib": [0-9.]*\|"peak_gpu_gib": [0-9.]*\|"planned_gpu_gib": [0-9.]*' "$OUT/b4-$g.json"
  done
fi
gzip -9 "$OUT"/*.log
