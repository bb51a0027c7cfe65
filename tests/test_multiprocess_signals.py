"""`python -m jzo.train` as two processes over loopback (2 CPU devices each,
offload and the delayed update), stopped the hard ways:

- SIGTERM to one process or to both, at start-up, during the first step's
  compilation, mid-run and mid-checkpoint: every process stops at the same
  step with one complete checkpoint of it (status 143), or, before the
  first step, all exit at once without one; none hangs.
- SIGKILL of one process: the other exits within seconds naming it, and
  `--resume` continues bit for bit (the losses logged and the final
  masters equal an uninterrupted pair's).
- Whichever way a pair ends (cleanly, on SIGTERM, after a death), no
  process prints anything alarming: no traceback, no C++ log of JAX's
  coordination service or gRPC; at a clean end process 0, which hosts
  that service, exits last.

Every pair is started in sessions of its own and killed with its groups when
a test leaves, so nothing outlives the test.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jzo import checkpoint
from test_multiprocess import ALARMING, free_port
from test_resilience import env  # noqa: F401  (the recipe's environment, a fixture)

ROOT = pathlib.Path(__file__).resolve().parents[1]
WAIT = 120  # seconds any wait may take before the test fails
STOPPED_WITHIN = 15  # seconds from a process's death to the other's exit
STEPS = 16  # checkpoints at 4, 8, 12 and 16: the kills and signals come by step 10
ARGS = ["--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--steps", str(STEPS),
        "--log-every", "1", "--eval-every", "1000", "--eval-batches", "1",
        "--checkpoint-every", "4", "--sample-tokens", "0", "--offload", "--delayed-update"]


class Pair:
  """Processes 0 and 1 of one recipe run; their output in out/process<i>.log."""

  def __init__(self, out: pathlib.Path, env: dict, *extra: str, name: str = ""):
    self.out, self.run = out, out / "run"
    port = free_port()
    self.logs = [out / f"process{i}{name}.log" for i in range(2)]
    self.procs = []
    self.ended: dict[int, float] = {}  # process -> when its exit was seen (monotonic s)
    for i, log in enumerate(self.logs):
      command = [sys.executable, "-m", "jzo.train", *ARGS, "--out", str(self.run),
                 "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                 "--process-id", str(i), *extra]
      with open(log, "wb") as f:
        self.procs.append(subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT,
                                           env=env, cwd=ROOT, start_new_session=True))

  def text(self, i: int) -> str:
    return self.logs[i].read_text(errors="replace").replace("\r", "\n")

  def steps_logged(self) -> list[int]:
    return [int(s) for s in re.findall(r"^step (\d+):", self.text(0), re.M)]

  def wait_for(self, condition) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
      assert all(p.poll() is None for p in self.procs), f"a process ended:\n{self.tails()}"
      assert time.monotonic() < deadline, f"timed out:\n{self.tails()}"
      time.sleep(0.002)

  def signal(self, which: list[int], sig: int) -> float:
    for i in which:
      self.procs[i].send_signal(sig)
    return time.monotonic()

  def exits(self) -> list[int]:
    """Both exit statuses, the pair given WAIT seconds at most; `ended`
    holds when each was seen to end (to a few milliseconds)."""
    deadline = time.monotonic() + WAIT
    while len(self.ended) < len(self.procs) and time.monotonic() < deadline:
      for i, p in enumerate(self.procs):
        if i not in self.ended and p.poll() is not None:
          self.ended[i] = time.monotonic()
      time.sleep(0.002)
    codes = [p.poll() for p in self.procs]
    assert None not in codes, f"hung (None: still running after {WAIT} s):\n{self.tails()}"
    return codes

  def tails(self) -> str:
    return "\n".join(f"--- process {i} (exit {p.poll()}) ---\n{self.text(i)[-2500:]}"
                     for i, p in enumerate(self.procs))

  def assert_quiet(self, *which: int) -> None:
    """The processes `which` (default: both) printed nothing alarming."""
    for i in which or range(len(self.procs)):
      assert not ALARMING.search(self.text(i)), f"process {i} printed:\n{self.tails()}"

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.fixture
def pairs():
  """Starts pairs (pairs(out, *extra)); kills what is left of them after the test."""
  started = []

  def start(out, env, *extra, name=""):
    started.append(Pair(out, env, *extra, name=name))
    return started[-1]
  yield start
  for pair in started:
    pair.kill()


@pytest.fixture(scope="module")
def whole(tmp_path_factory, env):
  """An uninterrupted pair's run folder, after checking that it ended cleanly."""
  out = tmp_path_factory.mktemp("whole")
  pair = Pair(out, env)
  try:
    assert pair.exits() == [0, 0], pair.tails()
  finally:
    pair.kill()
  pair.assert_quiet()
  # Process 0 hosts JAX's coordination service: it ends last, so that no
  # other process's agent is left talking to a service that is gone.
  assert pair.ended[1] <= pair.ended[0], pair.ended
  return pair.run


def test_a_clean_run_ends_quietly(whole):
  assert [l["step"] for l in losses(whole)] == list(range(1, STEPS + 1))
  assert complete_steps(whole)[-1] == STEPS


def losses(run: pathlib.Path) -> list[dict]:
  return [{k: v for k, v in json.loads(l).items() if k in ("step", "loss", "lr", "grad_norm")}
          for l in (run / "metrics.jsonl").read_text().splitlines()]


def complete_steps(run: pathlib.Path) -> list[int]:
  folder = run / "checkpoints"
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) \
      if folder.is_dir() else []


def partial_writes(run: pathlib.Path) -> set[str]:
  return {p.name for p in (run / "checkpoints").glob("*.orbax-checkpoint-tmp*")}


def catches_sigterm(pid: int) -> bool:
  """Whether the process has a handler for SIGTERM (Linux: /proc's SigCgt
  mask): before it does, a SIGTERM ends it outright."""
  status = pathlib.Path(f"/proc/{pid}/status").read_text()
  caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M)[1], 16)
  return bool(caught >> (signal.SIGTERM - 1) & 1)


def stopped_at_one_step(pair: Pair) -> int:
  """The step both processes name in their exit line; its checkpoint is
  complete (0: none, nothing saved)."""
  found = [re.findall(r"^jzo: interrupted by SIGTERM after step (\d+): (?:checkpoint (\d+) in "
                      r"|no step done, nothing to save)", pair.text(i), re.M) for i in range(2)]
  assert all(len(f) == 1 for f in found), pair.tails()
  (step, again), = set(found[0] + found[1])
  if step == "0":
    assert again == "" and complete_steps(pair.run) == [], pair.tails()
  else:
    assert step == again and int(step) in complete_steps(pair.run), pair.tails()
  return int(step)


@pytest.mark.parametrize("moment,which", [
    ("start-up", [1]), ("first step", [0]), ("mid-run", [1]), ("mid-checkpoint", [1]),
    pytest.param("mid-run", [0, 1], marks=pytest.mark.slow)], ids=str)
def test_sigterm_stops_every_process_at_one_step(tmp_path, env, pairs, moment, which):
  pair = pairs(tmp_path, env)
  if moment == "start-up":  # once its handler is in place: from the start of main
    pair.wait_for(lambda: all(catches_sigterm(p.pid) for p in pair.procs))
  elif moment == "first step":  # the plan is out: the first step compiles
    pair.wait_for(lambda: "micro-batch" in pair.text(0))
  elif moment == "mid-run":
    pair.wait_for(lambda: 6 in pair.steps_logged())
  else:
    pair.wait_for(lambda: partial_writes(pair.run))
    written = int(min(partial_writes(pair.run)).split(".")[0])
  pair.signal(which, signal.SIGTERM)
  assert pair.exits() == [143, 143], pair.tails()
  pair.assert_quiet()
  if moment == "start-up":
    assert "SIGTERM before the first step: exiting at once" in pair.text(1), pair.tails()
    assert "process 1: interrupted by SIGTERM; stopping process 0 too" in pair.text(0)
    assert complete_steps(pair.run) == []
    return
  step = stopped_at_one_step(pair)
  # Signalled once the plan is out, the first step may not have begun: step 0.
  assert step == (pair.steps_logged() or [0])[-1] and (step >= 1 or moment == "first step")
  if moment == "mid-checkpoint":  # the one being written was finished, not cut short
    assert written in complete_steps(pair.run) and step >= written


# Process 1's death is the default case: process 0, which hosts JAX's
# coordination service, must notice it through jzo's own watch.
@pytest.mark.parametrize("killed", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_a_killed_process_stops_the_other_and_resume_continues_bit_for_bit(
    tmp_path, env, pairs, whole, killed):
  pair = pairs(tmp_path, env)
  pair.wait_for(lambda: 10 in pair.steps_logged())
  killed_at = pair.signal([killed], signal.SIGKILL)
  other = 1 - killed
  try:
    pair.procs[other].wait(STOPPED_WITHIN)
  except subprocess.TimeoutExpired:
    pytest.fail(f"process {other} still ran {STOPPED_WITHIN} s after {killed} was killed:\n"
                + pair.tails())
  assert time.monotonic() - killed_at < STOPPED_WITHIN
  assert pair.procs[killed].poll() == -signal.SIGKILL
  assert pair.procs[other].poll() == 1, pair.tails()
  # Process 0 hosts JAX's coordination service: its death reaches the other's
  # JAX agent too, which would report it (and end the process) before the
  # watch, but for jzo.parallel.hold_open.
  said = f"process {killed} ended without a word (killed, or out of memory?)"
  assert said in pair.text(other), pair.tails()
  pair.assert_quiet(other)

  resumed = pairs(tmp_path, env, "--resume", name="-resumed")
  assert resumed.exits() == [0, 0], resumed.tails()
  resumed.assert_quiet()
  assert losses(pair.run) == losses(whole)
  _, mine = checkpoint.read_masters(pair.run / "checkpoints", STEPS)
  _, reference = checkpoint.read_masters(whole / "checkpoints", STEPS)
  assert jax.tree.structure(mine) == jax.tree.structure(reference)
  for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(a, b)
