# Session 36 call 1: the 47B step's OOM over 4 GPUs, with the allocator's full dump.
bash experiments/gpu_runs.sh >/dev/null 2>&1 || { echo setup failed; exit 1; }
cd /tmp/jzo-$(cat .snap/commit) || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
python3 --version
for m in jzo.train jzo.estimate jzo.export; do python3 -m $m --help >/dev/null 2>&1; echo "$m --help: exit $?"; done
start=$(date +%s)
TF_CPP_MIN_LOG_LEVEL=0 timeout 330 python3 experiments/offload_bench.py --config auto --model gpt2-20b \
  --n-layer 101 --gpus 4 --stage 3 --batch 8 --steps 1 --no-breakdown --live-arrays --compiled-memory \
  >"$OUT/oom101.json" 2>"$OUT/oom101.log"
echo "oom101: exit $? in $(( $(date +%s) - start )) s"
grep -E "^built|^live|^compiled|^step|RESOURCE|Sum Total|^Stats|Limit:|InUse:|MaxInUse|LargestAllocSize|Fragmentation" "$OUT/oom101.log" | cut -c1-600 | head -40
grep -c "InUse at\|Free  at" "$OUT/oom101.log"
gzip -k "$OUT/oom101.log"; ls -la $OUT
