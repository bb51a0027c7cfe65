# Session 36 call 3: the 101-layer step over 4 GPUs with XLA's default flags (fusion autotuner on); then the autotuner's effect on a step's time.
bash experiments/gpu_runs.sh >/dev/null 2>&1 || { echo setup failed; exit 1; }
cd /tmp/jzo-$(cat .snap/commit) || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
t0=$(date +%s)
TF_CPP_MIN_LOG_LEVEL=0 timeout 420 python3 experiments/offload_bench.py --config auto --model gpt2-20b \
  --n-layer 101 --gpus 4 --stage 3 --batch 8 --steps 2 --no-breakdown --live-arrays \
  >"$OUT/s101-default.json" 2>"$OUT/s101-default.log"
echo "s101-default: exit $? in $(( $(date +%s) - t0 )) s"
grep -E "^built|^live|^step|RESOURCE|Could not get config|LargestFreeBlock|InUse:" "$OUT/s101-default.log" | cut -c1-500 | head -20
grep -o '"step_s": [0-9.]*\|"tflops": [0-9.]*' "$OUT/s101-default.json"
for flags in "" "--xla_gpu_experimental_enable_fusion_autotuner=false" "" "--xla_gpu_experimental_enable_fusion_autotuner=false"; do
  [ $(( $(date +%s) - t0 )) -gt 470 ] && break
  XLA_FLAGS="$flags" timeout 90 python3 experiments/offload_bench.py --config device --model gpt2-1.5b --gpus 4 \
    --stage 3 --batch 8 --steps 6 --no-breakdown 2>/dev/null | grep -o '"step_s": [0-9.]*' | sed "s/^/1.5b s3 x4 [$flags] /"
done
gzip -9 "$OUT"/*.log
