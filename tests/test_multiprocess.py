"""Two processes over loopback, each with 2 CPU devices, train as one 4-device
mesh (jax.distributed, gloo): stages 2 and 3 with offload and the delayed
update match a single process's 4-device run to float32 rounding, and their
checkpoint, written by both, resumes in a new pair bit for bit.

The pair runs tests/multiprocess_run.py; each process is started in a
session of its own and killed with its group when the test leaves, passed or
not, so nothing is left behind and nothing hangs past TIMEOUT.
"""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import multiprocess_run as run

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 240  # seconds a pair may take, start-up and compilation included


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_pair(out: pathlib.Path, cache: pathlib.Path, *args: str) -> None:
  """Runs multiprocess_run.py as processes 0 and 1 of a pair; fails with
  their output unless both exit 0 within TIMEOUT."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2",
         "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2",
         # The resumed pair compiles nothing the first compiled.
         "JAX_COMPILATION_CACHE_DIR": str(cache),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  procs, logs = [], []
  try:
    for i in range(2):
      logs.append(open(out / f"process{i}{''.join(args)}.log", "w+"))
      procs.append(subprocess.Popen(
          [sys.executable, str(ROOT / "tests" / "multiprocess_run.py"), str(out), *args],
          env={**env, "JAX_PROCESS_ID": str(i)}, cwd=ROOT, stdout=logs[i],
          stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if any(p.poll() not in (None, 0) for p in procs):
        break  # one failed: the other would wait for it in a collective
      time.sleep(0.2)
    codes = [p.poll() for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  if codes != [0, 0]:
    tails = []
    for i, log in enumerate(logs):
      log.seek(0)
      tails.append(f"--- process {i} (exit {codes[i]}) ---\n" + log.read()[-3000:])
    pytest.fail(f"pair {args} did not finish (None: killed after {TIMEOUT} s):\n"
                + "\n".join(tails))
  for log in logs:
    log.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """What the pair saw ("stage2", "stage3"), the resumed pair
  ("stage2-resumed", ...) and the single process ("single2", ...)."""
  out = tmp_path_factory.mktemp("pair")
  cache = tmp_path_factory.mktemp("jax-cache")
  run_pair(out, cache)
  run_pair(out, cache, "--resume")
  seen = {f.stem: dict(np.load(f)) for f in out.glob("*.npz")}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
  for stage in run.STAGES:
    seen[f"single{stage}"] = run.train(stage, tmp_path_factory.mktemp("single"), mesh)
  return seen


@pytest.mark.parametrize("stage", run.STAGES)
def test_two_processes_match_one_to_float32_rounding(runs, stage):
  pair, single = runs[f"stage{stage}"], runs[f"single{stage}"]
  assert len(pair["loss"]) == run.STEPS
  # The same sums in another order (gloo's across processes): float32 rounding.
  np.testing.assert_allclose(pair["loss"], single["loss"], rtol=2e-6)
  np.testing.assert_allclose(pair["grad_norm"], single["grad_norm"], rtol=2e-5)
  # Adam divides by sqrt(v): where a gradient is itself at rounding level (a
  # weight near zero) its step may turn; 1e-5 is 1% of the learning rate.
  np.testing.assert_allclose(pair["master"], single["master"], rtol=1e-5, atol=1e-5)
  initial = np.concatenate([x.ravel() for x in jax.tree.leaves(run.init_params())])
  assert np.abs(single["master"] - initial).max() > 1e-3  # it trains: weights moved


@pytest.mark.parametrize("stage", run.STAGES)
def test_a_pairs_checkpoint_resumes_in_a_new_pair_bit_for_bit(runs, stage):
  first, resumed = runs[f"stage{stage}"], runs[f"stage{stage}-resumed"]
  start = run.SAVE_AT[0]
  assert len(resumed["loss"]) == run.STEPS - start
  np.testing.assert_array_equal(resumed["loss"], first["loss"][start:])
  np.testing.assert_array_equal(resumed["grad_norm"], first["grad_norm"][start:])
  np.testing.assert_array_equal(resumed["master"], first["master"])
