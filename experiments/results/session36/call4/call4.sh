# Session 36 call 4 (one H200): the build on one GPU (each leaf's copies written straight into their buffers): its peak against the plan; the GPU tests.
bash experiments/gpu_runs.sh >/dev/null 2>&1 || { echo setup failed; exit 1; }
cd /tmp/jzo-$(cat .snap/commit) || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
for model in gpt2-4b; do
  timeout 150 python3 experiments/offload_bench.py --config auto --model $model --gpus 1 --steps 2 \
    --no-breakdown >"$OUT/b1-$model.json" 2>"$OUT/b1-$model.log"
  echo "$model over 1: exit $?"; grep -E "^built|RESOURCE" "$OUT/b1-$model.log" | cut -c1-400
  grep -o '"planned_build_gib": [0-9.]*\|"peak_gpu_gib": [0-9.]*\|"planned_gpu_gib": [0-9.]*\|"step_s": [0-9.]*' "$OUT/b1-$model.json"
done
JAX_PLATFORMS=cuda,cpu timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_offload_gpu.py >"$OUT/tests-gpu.log" 2>&1
echo "tests-gpu: exit $?"; tail -3 "$OUT/tests-gpu.log"
