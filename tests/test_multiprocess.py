"""Two processes over loopback, each with 2 CPU devices, train as one 4-device
mesh (jax.distributed, gloo): stages 2 and 3 with offload and the delayed
update match a single process's 4-device run to float32 rounding, and their
checkpoint, written by both, resumes in a new pair bit for bit (also with
int8 moments, saved as their codes and scales, and with the layers' weights
in host memory, one layer resident on the devices).

The pair runs tests/multiprocess_run.py; each process is started in a
session of its own and killed with its group when the test leaves, passed or
not, so nothing is left behind and nothing hangs past TIMEOUT.
"""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import multiprocess_run as run
from jzo import checkpoint
from jzo.kernels import quant8
from jzo.checkpoint import saved_leaf
from jzo.checkpoint.outline import outline
from jzo.parallel.partition import LeafLayout
from test_engine import HIDDEN, LAYERS, mesh_of

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 240  # seconds a pair may take, start-up and compilation included
# What a pair's processes must not print, as they run or as they end (cleanly, on a signal,
# or after another's death): tracebacks, errors, and the C++ logs of JAX's coordination
# service and gRPC (E/F/W lines, CANCELLED and UNAVAILABLE, "Terminating process", stack traces).
ALARMING = re.compile(r"Traceback|Error|error:|^[EFW]\d{4} |CANCELLED|UNAVAILABLE|WatchTasks|"
                      r"Terminating process|Source Location Trace|[Cc]heck fail", re.M)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_pair(out: pathlib.Path, cache: pathlib.Path, *args: str, devices: int = 2) -> None:
  """Runs multiprocess_run.py as processes 0 and 1 of a pair, `devices` CPU devices each."""
  env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2",
         # The resumed pair compiles nothing the first compiled.
         "JAX_COMPILATION_CACHE_DIR": str(cache)}
  command = [sys.executable, str(ROOT / "tests" / "multiprocess_run.py"), str(out), *args]
  run_processes([command, command], [{**env, "JAX_PROCESS_ID": str(i)} for i in range(2)],
                out, "".join(args[:1]) + str(devices), devices)


def run_processes(commands: list[list[str]], envs: list[dict], out: pathlib.Path,
                  name: str, devices: int = 2) -> list[str]:
  """Runs commands[i] as process i of `devices`-CPU-device processes side by
  side; fails with their output unless all exit 0 within TIMEOUT; returns
  their output."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  procs, logs = [], []
  try:
    for i, (command, extra) in enumerate(zip(commands, envs)):
      logs.append(open(out / f"process{i}{name}.log", "w+"))
      procs.append(subprocess.Popen(command, env={**env, **extra}, cwd=ROOT, stdout=logs[i],
                                    stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if any(p.poll() not in (None, 0) for p in procs):
        break  # one failed: the others would wait for it in a collective
      time.sleep(0.2)
    codes = [p.poll() for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  outputs = []
  for log in logs:
    log.seek(0)
    outputs.append(log.read())
    log.close()
  if codes != [0] * len(procs):
    pytest.fail(f"processes {name!r} did not finish (None: killed after {TIMEOUT} s):\n"
                + "\n".join(f"--- process {i} (exit {code}) ---\n{output[-3000:]}"
                            for i, (code, output) in enumerate(zip(codes, outputs))))
  return outputs


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  return tmp_path_factory.mktemp("jax-cache")


@pytest.fixture(scope="module")
def pair_out(tmp_path_factory, cache):
  """The folder of the pair's runs and checkpoints (checkpoints-<stage>)."""
  out = tmp_path_factory.mktemp("pair")
  run_pair(out, cache)
  run_pair(out, cache, "--resume")
  return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pair_out):
  """What the pair saw ("stage2", "stage3"), the resumed pair
  ("stage2-resumed", ...) and the single process ("single2", ...)."""
  seen = {f.stem: dict(np.load(f)) for f in pair_out.glob("stage*.npz")}
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
  for stage in run.STAGES:
    seen[f"single{stage}"] = run.train(stage, tmp_path_factory.mktemp("single"), mesh)
  return seen


def assert_matches_one_process(pair: dict, single: dict) -> None:
  """What a pair saw is what one process saw to float32 rounding, and it trained."""
  assert len(pair["loss"]) == run.STEPS
  # The same sums in another order (gloo's across processes): float32 rounding.
  np.testing.assert_allclose(pair["loss"], single["loss"], rtol=2e-6)
  np.testing.assert_allclose(pair["grad_norm"], single["grad_norm"], rtol=2e-5)
  # Adam divides by sqrt(v): where a gradient is itself at rounding level (a
  # weight near zero) its step may turn; 1e-5 is 1% of the learning rate.
  np.testing.assert_allclose(pair["master"], single["master"], rtol=1e-5, atol=1e-5)
  assert_trained(single)


def assert_trained(seen: dict) -> None:
  initial = np.concatenate([x.ravel() for x in jax.tree.leaves(run.init_params())])
  assert np.abs(seen["master"] - initial).max() > 1e-3  # the weights moved


def assert_resumed_bit_for_bit(resumed: dict, first: dict) -> None:
  """A run resumed from checkpoint SAVE_AT[0] saw what the first saw from there."""
  start = run.SAVE_AT[0]
  assert len(resumed["loss"]) == run.STEPS - start
  np.testing.assert_array_equal(resumed["loss"], first["loss"][start:])
  np.testing.assert_array_equal(resumed["grad_norm"], first["grad_norm"][start:])
  np.testing.assert_array_equal(resumed["master"], first["master"])


@pytest.mark.parametrize("stage", run.STAGES)
def test_two_processes_match_one_to_float32_rounding(runs, stage):
  assert_matches_one_process(runs[f"stage{stage}"], runs[f"single{stage}"])


@pytest.mark.parametrize("stage", run.STAGES)
def test_a_pairs_checkpoint_resumes_in_a_new_pair_bit_for_bit(runs, stage):
  assert_resumed_bit_for_bit(runs[f"stage{stage}-resumed"], runs[f"stage{stage}"])


def assert_same_state(loaded: dict, reference: dict) -> None:
  for name in ("master", "mu", "nu", "count"):
    np.testing.assert_array_equal(loaded[name], reference[name], err_msg=name)


@pytest.mark.parametrize("stage", run.STAGES)
def test_a_pairs_checkpoint_loads_into_other_device_counts_in_one_process(pair_out, stage):
  """Written by 2 processes of 2 devices (flat, padded for 4): the same
  masters and moments load over 1, 3 and 4 devices."""
  reference = run.load(stage, pair_out, mesh_of(4))
  assert reference["count"] == run.STEPS and np.abs(reference["mu"]).max() > 0
  np.testing.assert_array_equal(reference["master"],
                                np.load(pair_out / f"stage{stage}.npz")["master"])
  for devices in (1, 3):
    assert_same_state(run.load(stage, pair_out, mesh_of(devices)), reference)


def test_checkpoints_load_into_pairs_of_other_device_counts(pair_out, cache, tmp_path):
  """A pair of 1-device processes loads the 2 x 2 pair's checkpoint; a 2 x 2
  pair loads one that a single process wrote over 8 devices."""
  run_pair(tmp_path, cache, "--load", str(pair_out), devices=1)
  for stage in run.STAGES:
    assert_same_state(dict(np.load(tmp_path / f"loaded{stage}.npz")),
                      run.load(stage, pair_out, mesh_of(4)))
  single = tmp_path / "single"
  for stage in run.STAGES:
    run.train(stage, single, mesh_of(8))
  run_pair(tmp_path, cache, "--load", str(single))
  for stage in run.STAGES:
    assert_same_state(dict(np.load(tmp_path / f"loaded{stage}.npz")),
                      run.load(stage, single, mesh_of(4)))


@pytest.fixture(scope="module")
def int8_out(tmp_path_factory, cache):
  """The folder of an int8 pair's runs at stage 3, trained and resumed."""
  out = tmp_path_factory.mktemp("int8-pair")
  run_pair(out, cache, "--int8")
  run_pair(out, cache, "--int8", "--resume")
  return out


def test_an_int8_pairs_checkpoint_keeps_codes_and_resumes_bit_for_bit(int8_out):
  """Two processes save int8 moments as their codes (flat, padded for 4
  devices) and each shard's scales, not float32 values; a new pair resumes
  from them exactly."""
  with checkpoint.open_manager(int8_out / run.folder(3, "int8")) as manager:
    saved = outline(manager.item_metadata(run.STEPS).tree)
    lazy = ocp.RestoreArgs(restore_type=saved_leaf.SavedLeaf)
    codes = manager.restore(run.STEPS, args=ocp.args.PyTreeRestore(
        {"mu_codes": saved["mu_codes"]}, restore_args={"mu_codes": jax.tree.map(
            lambda _: lazy, saved["mu_codes"])}, partial_restore=True))["mu_codes"]
  assert "mu" not in saved and "nu" not in saved
  # Written by each process a chunk at a time, its shards' (StreamedShards), not by orbax.
  w = codes["blocks"]["w"].store.chunk_layout.read_chunk.shape
  assert tuple(w) == (1, LeafLayout((LAYERS, HIDDEN, HIDDEN), shards=4, per_layer=True).shard_size)
  layout = LeafLayout((LAYERS, HIDDEN, HIDDEN), shards=4, per_layer=True, device_size=0)
  assert saved["mu_codes"]["blocks"]["w"] == f"uint8{list(layout.flat_shape)}"
  assert saved["nu_scales"]["blocks"]["w"] == (
      f"float32{list(quant8.scale_shape(layout.host_shape))}")
  first = dict(np.load(int8_out / "int8-stage3.npz"))
  assert_resumed_bit_for_bit(dict(np.load(int8_out / "int8-stage3-resumed.npz")), first)
  assert_trained(first)


def test_an_int8_pairs_checkpoint_loads_into_one_process_and_other_pairs(int8_out, cache,
                                                                         tmp_path):
  """The same blocks (one process of 4 devices) take the codes and scales as
  they are; other device counts quantize their values in their own blocks,
  the same in one process (2 devices) as in a pair of 1-device processes."""
  reference = run.load(3, int8_out, mesh_of(4), "int8")
  assert reference["count"] == run.STEPS and np.abs(reference["mu"]).max() > 0
  np.testing.assert_array_equal(reference["master"],
                                np.load(int8_out / "int8-stage3.npz")["master"])
  two = run.load(3, int8_out, mesh_of(2), "int8")
  np.testing.assert_array_equal(two["master"], reference["master"])
  # Quantized again in other blocks: near the saved values, not equal to them.
  for name in ("mu", "nu"):
    assert not np.array_equal(two[name], reference[name])
    np.testing.assert_allclose(two[name], reference[name], rtol=0.05,
                               atol=0.01 * np.abs(reference[name]).max())
  run_pair(tmp_path, cache, "--int8", "--load", str(int8_out), devices=1)
  assert_same_state(dict(np.load(tmp_path / "int8-loaded3.npz")), two)


def test_a_pair_with_resident_layers_trains_as_one_process_and_resumes(tmp_path_factory,
                                                                      cache):
  """offload_params with the first layer resident on each process's
  devices: the pair trains as one process of 4 devices, to float32
  rounding, and a new pair resumes from its checkpoint bit for bit."""
  out = tmp_path_factory.mktemp("resident-pair")
  run_pair(out, cache, "--resident")
  run_pair(out, cache, "--resident", "--resume")
  pair = dict(np.load(out / "resident-stage3.npz"))
  single = run.train(3, tmp_path_factory.mktemp("single"), mesh_of(4), variant="resident")
  assert_matches_one_process(pair, single)
  assert_resumed_bit_for_bit(dict(np.load(out / "resident-stage3-resumed.npz")), pair)


def test_the_recipe_runs_as_two_processes_from_its_flags(tmp_path):
  """python -m jzo.train with --coordinator, --num-processes and --process-id:
  the pair trains with offload and the delayed update, writes a checkpoint
  together, and process 0 alone logs."""
  run = tmp_path / "run"
  command = [sys.executable, "-m", "jzo.train", "--model", "tiny", "--seq-len", "32",
             "--batch-size", "4", "--steps", "4", "--log-every", "2", "--checkpoint-every", "4",
             "--sample-tokens", "0", "--offload", "--delayed-update", "--out", str(run),
             "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
  outputs = run_processes([command + ["--process-id", str(i)] for i in range(2)], [{}, {}],
                          tmp_path, "recipe")
  lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [line["step"] for line in lines] == [1, 2, 3, 4]
  assert all(np.isfinite(line["loss"]) for line in lines)
  assert (run / "checkpoints" / "4").is_dir()
  assert "step 4: loss" in outputs[0] and "step 4: loss" not in outputs[1]
  for output in outputs:
    assert not ALARMING.search(output.replace("\r", "\n")), output[-3000:]


def test_export_at_the_end_is_refused_for_several_processes_at_start(tmp_path):
  """--export reads the live weights in one process: a pair asked for it
  exits at once, before any step runs, each process with one line that
  says how to export (the first to refuse says it; the other names it)."""
  run = tmp_path / "run"
  command = [sys.executable, "-m", "jzo.train", "--model", "tiny", "--seq-len", "32",
             "--batch-size", "4", "--steps", "2", "--sample-tokens", "0", "--out", str(run),
             "--export", str(tmp_path / "export"), "--coordinator",
             f"127.0.0.1:{free_port()}", "--num-processes", "2"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"}
  procs = [subprocess.Popen(command + ["--process-id", str(i)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True) for i in range(2)]
  try:
    outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  refusal = ("error: --export reads the live weights in one process; with several, export a "
             "checkpoint: python -m jzo.export --run DIR --out DIR --dtype bfloat16")
  lines = [[line for line in err.splitlines() if line] for _, err in outputs]
  assert [p.returncode for p in procs] == [2, 2], outputs
  assert all(len(own) == 1 and refusal in own[0] for own in lines), lines
  assert any(own == [refusal] for own in lines), lines
  assert not (run / "metrics.jsonl").exists() and not (tmp_path / "export").exists()


# Process 0 of a pair starts the peer watch, whose other process never connects.
_LONE_WATCH = """
import os, time
from jzo.parallel import distributed
from jzo.parallel.peer_watch import PeerWatch
distributed.initialize_from_environment()
if distributed.is_primary():
  try:
    PeerWatch.start(connect_s=2)
  except ConnectionError as e:
    print("refused:", e, flush=True)
  time.sleep(4)  # the other goes first: its JAX client aborts once this one's service is gone
else:
  time.sleep(3)
os._exit(0)  # past JAX's shutdown barrier, which would wait for the other
"""


def test_a_process_that_never_joins_the_peer_watch_is_named(tmp_path):
  env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2"}
  command = [sys.executable, "-c", _LONE_WATCH]
  first, _ = run_processes([command, command],
                           [{**env, "JAX_PROCESS_ID": str(i)} for i in range(2)], tmp_path, "watch",
                           devices=1)
  assert "refused: peer watch: process 1 did not connect to process 0 within 2 s" in first, first


# Process 1's end of a watch whose hub (process 0) dies while process 1
# waits for news before reporting an error of its own (`sys.argv[1]`: "dies"
# or "lives").
_AWAITING_NEWS = """
import socket, sys, threading
from jzo.parallel.peer_watch import PeerWatch
mine, hub = socket.socketpair()
watch = PeerWatch(1, {0: mine})
if sys.argv[1] == "dies":
  threading.Timer(0.2, hub.close).start()
watch.await_news(5.0 if sys.argv[1] == "dies" else 0.3)
print("no news: the error is this process's own", flush=True)
"""


# Process 1's end of a watch whose hub (process 0) stops with `sys.argv[1]`.
_HEARING_A_STOP = """
import socket, sys
from jzo.parallel.peer_watch import PeerWatch
mine, hub = socket.socketpair()
watch = PeerWatch(1, {0: mine})
hub.sendall(f"stop {sys.argv[1]} process 0: the reason\\n".encode())
watch.await_news(30.0)
"""


@pytest.mark.parametrize("status", [1, 2])
def test_a_peers_stop_is_named_and_resume_offered_unless_it_was_an_error(status):
  """A crashed peer (1): --resume is the way on. A peer's error (2: its
  options, data or disk): its own line says what to do, the other's does not
  offer a resume that would meet the same error."""
  result = subprocess.run([sys.executable, "-c", _HEARING_A_STOP, str(status)],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == status, result.stderr
  then = " (--resume continues from the last complete checkpoint)" if status == 1 else ""
  assert result.stderr.strip() == f"jzo: process 0: the reason; stopping process 1 too{then}"


@pytest.mark.parametrize("hub", ["dies", "lives"])
def test_an_error_waits_for_news_of_a_peer_that_caused_it(hub):
  result = subprocess.run([sys.executable, "-c", _AWAITING_NEWS, hub], capture_output=True,
                          text=True, timeout=60)
  if hub == "dies":  # the watch names the dead peer and exits; the error is never reported
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    assert result.stderr.strip() == ("jzo: process 0 ended without a word (killed, or out of "
                                     "memory?); stopping process 1 too (--resume continues from "
                                     "the last complete checkpoint)"), result.stderr
  else:
    assert result.returncode == 0, result.stderr
    assert result.stdout == "no news: the error is this process's own\n"
