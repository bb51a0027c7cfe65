# Session 39 call 7 (nvidia-h100-x1): --help of the three commands on Python 3.12 with --overlap-forward, and jzo.estimate with and without it.
bash experiments/gpu_runs.sh >/dev/null 2>&1 || { echo setup failed; exit 1; }
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
cd /tmp/jzo-$(cat .snap/commit) || exit 1
python3 --version; for m in jzo.train jzo.estimate jzo.export; do python3 -m $m --help >/dev/null 2>&1; echo "$m --help: exit $?"; done
python3 -m jzo.train --help | grep -c "overlap-forward"
for f in "" --no-overlap-forward; do python3 -m jzo.estimate --model gpt2-10b --batch-size 32 --stage 3 --grads-in-params $f | sed -n 2p; done
