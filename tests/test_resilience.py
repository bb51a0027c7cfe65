"""`python -m jzo.train` stopped the hard ways, in real processes.

- SIGKILL at random moments (seeded), some during a checkpoint write, each
  followed by `--resume`: the losses logged and the final checkpoint's
  masters equal an uninterrupted run's bit for bit (offload and the delayed
  update; stage 3), and a resumed run starts from the last complete
  checkpoint, never from a partial one.
- SIGINT and SIGTERM: the step in flight finishes, a checkpoint is written
  (even with --checkpoint-every 0), the process names it and exits 130 or
  143; the same signal again, during the checkpoint write, exits at once.
- Unreadable checkpoints: an earlier one serves, with a warning; with none
  readable, --resume refuses and names them, --resume --fresh-start-ok starts
  over.
- A fault in the transfers of an offloading engine (in this process): the
  exception reaches the caller with its frames, then the engine refuses to
  go on; nothing hangs. (Faults in the host update's own thread:
  test_offload.py.)

Each run is a subprocess on 2 CPU devices. They share the session's
persistent compilation cache, so that after the first run of a configuration
a process starts in about 5 s (jax's import, the engine's build) rather than
10-20 s.
"""

import concurrent.futures
import dataclasses
import faulthandler
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback

import jax
import numpy as np
import pytest

import jzo
from jzo import checkpoint
from test_engine import batches, init_params, loss_fn, mesh_of
from test_offload import TX

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Seconds any one wait may take before the test fails: a run's first step
# waits for its start and compile, which took over 120 s on 2 cores while the
# other worker started test_benchmarks.py's dozen benchmark processes at once.
TIMEOUT = 300

# Tiny runs: a step takes ~50 ms, a checkpoint write ~100 ms.
SMALL = ["--warmup", "2", "--log-every", "1", "--eval-batches", "1", "--batch-size", "4",
         "--seq-len", "32", "--sample-tokens", "0", "--devices", "2"]


def delayed(steps: int) -> list[str]:
  """Offload and the delayed update, a checkpoint every 2 steps. Each kill
  may let the run get a checkpoint or two further: 20 kills need 48 steps
  (at 30, one sequence ran out), 5 kills 24."""
  return SMALL + ["--steps", str(steps), "--eval-every", "10", "--checkpoint-every", "2",
                  "--offload", "--delayed-update"]


STAGE3 = SMALL + ["--steps", "10", "--eval-every", "5", "--checkpoint-every", "2",
                  "--stage", "3", "--offload", "--delayed-update"]
# No delayed update where a signal picks the checkpoint's step: saving applies
# the update in flight, which an uninterrupted run does at its own checkpoints
# only, so the two would part there.
PLAIN = SMALL + ["--steps", "12", "--eval-every", "6", "--offload"]


@pytest.fixture(scope="module")
def env():
  """The recipe's environment: 2 CPU devices, and the session's compilation
  cache (tests/conftest.py), shared with the other files' runs."""
  return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2",
          "PYTHONUNBUFFERED": "1"}  # log lines as they happen: the tests wait for them


@dataclasses.dataclass
class Run:
  """One `python -m jzo.train` process, its stdout and stderr in `log`."""
  proc: subprocess.Popen
  log: pathlib.Path
  started: float

  def text(self) -> str:
    return self.log.read_text(errors="replace").replace("\r", "\n")

  def steps_logged(self) -> list[int]:
    """Steps whose log line this process printed."""
    return [int(s) for s in re.findall(r"^step (\d+):", self.text(), re.M)]

  def wait_for(self, condition, timeout: float = TIMEOUT) -> bool:
    """Polls `condition()` until true (True) or the process has ended (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
      if self.proc.poll() is not None:
        return False
      assert time.monotonic() < deadline, f"timed out; the run printed:\n{self.text()[-3000:]}"
      time.sleep(0.002)
    return True

  def exit_status(self) -> int:
    try:
      return self.proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      raise AssertionError(f"did not exit; the run printed:\n{self.text()[-3000:]}") from None


def start(out: pathlib.Path, args: list[str], env: dict, name: str) -> Run:
  log = out.parent / f"{out.name}.{name}.log"
  with open(log, "wb") as f:
    proc = subprocess.Popen([sys.executable, "-m", "jzo.train", *args, "--out", str(out)],
                            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
  return Run(proc, log, time.monotonic())


def finish(run: Run) -> Run:
  assert run.exit_status() == 0, run.text()[-3000:]
  return run


def losses(out: pathlib.Path) -> list[dict]:
  """metrics.jsonl without its wall-clock fields."""
  lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in l.items() if k not in ("tokens_per_s", "model_tflops", "step_s")}
          for l in lines]


def assert_same_weights(out: pathlib.Path, reference: pathlib.Path) -> None:
  """The last checkpoints of two runs hold the same float32 masters, bit for bit."""
  step, masters = checkpoint.read_masters(out / "checkpoints")
  ref_step, ref = checkpoint.read_masters(reference / "checkpoints")
  assert step == ref_step
  flat, ref_flat = (dict(jax.tree_util.tree_leaves_with_path(t)) for t in (masters, ref))
  assert flat.keys() == ref_flat.keys()
  for path, x in flat.items():
    assert x.dtype == np.float32 and x.tobytes() == ref_flat[path].tobytes(), path


def complete_steps(out: pathlib.Path) -> list[int]:
  folder = out / "checkpoints"
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() \
      else []


def partial_writes(out: pathlib.Path) -> set[tuple[str, int]]:
  """Orbax's temporary folders (a checkpoint being written), as (name, inode)."""
  folder = out / "checkpoints"
  if not folder.is_dir():
    return set()
  found = set()
  for p in folder.iterdir():
    if ".orbax-checkpoint-tmp" in p.name:
      try:
        found.add((p.name, p.stat().st_ino))
      except FileNotFoundError:  # renamed to its final name since the listing: complete
        pass
  return found


def resumed_from(run: Run) -> int:
  """The checkpoint step a `--resume` run said it continues from (0: none)."""
  found = re.findall(r"^resuming from checkpoint (\d+) in ", run.text(), re.M)
  return int(found[0]) if found else 0


AIMS = ("start-up", "training", "write", "after a write")


def kill_at_random_moments(out: pathlib.Path, args: list[str], env: dict, kills: int,
                           rng: random.Random, aims: list[str] | None = None) -> list[str]:
  """Runs `args --resume --fresh-start-ok` again and again, each process
  killed with SIGKILL: during start-up (after a random delay), during
  training (a random while after a random step's log line), during a
  checkpoint write (once the next checkpoint's or the one after's temporary
  folder exists, plus a few ms) or just after one (once it is renamed into
  place); the kind drawn at random, or kill i's from `aims`. Returns where
  each kill landed, as seen after it: "write" (a temporary folder it made
  is left), "training" (it had logged a step) or "start-up"."""
  every = int(args[args.index("--checkpoint-every") + 1])
  steps = int(args[args.index("--steps") + 1])
  landed = []
  for i in range(kills):
    before, partial = complete_steps(out), partial_writes(out)
    run = start(out, args + ["--resume", "--fresh-start-ok"], env, f"kill{i}")
    first = before[-1] if before else 0
    aim = aims[i] if aims else rng.choice(AIMS)
    ahead = rng.randint(1, 2) if aim == "write" else 1
    target = min(first - first % every + every * ahead, steps)  # a checkpoint's step
    if aim == "start-up":
      at = run.started + rng.uniform(0.3, 4.0)
      run.wait_for(lambda: time.monotonic() > at)
    elif aim == "training":
      step = min(first + rng.randint(1, 3), steps)
      if run.wait_for(lambda: step in run.steps_logged()):
        time.sleep(rng.uniform(0.0, 0.15))
    elif aim == "write":
      tmp = f"{target}.orbax-checkpoint-tmp"
      if run.wait_for(lambda: any(n.startswith(tmp) for n, _ in partial_writes(out) - partial)):
        time.sleep(rng.uniform(0.0, 0.02))
    else:  # between a checkpoint's rename and what follows it (old ones deleted, the next step)
      if run.wait_for(lambda: target in complete_steps(out)):
        time.sleep(rng.uniform(0.0, 0.01))
    assert run.proc.poll() is None, f"kill {i}: the run ended first:\n{run.text()[-3000:]}"
    run.proc.kill()
    assert run.exit_status() == -signal.SIGKILL
    # Never from a partial checkpoint: from the latest complete one.
    assert resumed_from(run) in (0, first), run.text()[-3000:]
    assert "unreadable" not in run.text()  # a kill never damages a complete checkpoint
    if partial_writes(out) - partial:
      landed.append("write")
    else:
      landed.append("training" if run.steps_logged() else "start-up")
    print(f"kill {i}: aimed at {aim}, landed in {landed[-1]} after "
          f"{time.monotonic() - run.started:.1f} s; checkpoints {complete_steps(out)}")
  return landed


def finish_after_kills(out: pathlib.Path, args: list[str], env: dict) -> Run:
  last = complete_steps(out)
  run = finish(start(out, args + ["--resume", "--fresh-start-ok"], env, "last"))
  assert resumed_from(run) == (last[-1] if last else 0)
  assert not partial_writes(out)  # the last run removed what the kills left
  return run


def assert_same_run(out: pathlib.Path, whole: pathlib.Path, steps: int) -> None:
  """Every step's logged loss (and the rest but times) and the last checkpoint's masters agree."""
  assert [l["step"] for l in losses(out)] == list(range(1, steps + 1))
  assert losses(out) == losses(whole)
  assert_same_weights(out, whole)


def test_sigkill_at_moments_of_each_kind(tmp_path, env):
  """5 SIGKILLs, two during checkpoint writes and one at each other kind of
  moment (their times within it seeded), with offload and the delayed
  update; beside them the uninterrupted run. (The 20 random ones below are
  a slow case.)"""
  args = delayed(24)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    whole = pool.submit(lambda: finish(start(tmp_path / "whole", args, env, "run")))
    aims = ["write", "training", "after a write", "start-up", "write"]
    landed = kill_at_random_moments(tmp_path / "killed", args, env, len(aims),
                                    random.Random(5), aims)
    finish_after_kills(tmp_path / "killed", args, env)
    whole.result()
  print("kills landed:", landed)
  # A kill aimed at training may land in the write that follows a step: at
  # least one cuts a write short.
  assert "write" in landed, landed
  assert_same_run(tmp_path / "killed", tmp_path / "whole", 24)


@pytest.mark.slow
def test_sigkill_at_random_moments(tmp_path, env):
  """20 SIGKILLs at random moments (seeded) with offload and the delayed
  update; beside them (a process starting keeps one core busy) the
  uninterrupted run, then 3 kills at stage 3 and its uninterrupted run."""
  args = delayed(48)

  def beside():
    finish(start(tmp_path / "whole", args, env, "run"))
    landed = kill_at_random_moments(tmp_path / "stage3", STAGE3, env, 3, random.Random(3))
    finish_after_kills(tmp_path / "stage3", STAGE3, env)
    finish(start(tmp_path / "stage3-whole", STAGE3, env, "run"))
    return landed

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    stage3 = pool.submit(beside)
    landed = kill_at_random_moments(tmp_path / "killed", args, env, 20, random.Random(13))
    finish_after_kills(tmp_path / "killed", args, env)
    print("stage 3 kills landed:", stage3.result())
  print("kills landed:", {k: landed.count(k) for k in sorted(set(landed))})
  assert len(landed) >= 20 and landed.count("write") >= 3 and landed.count("training") >= 3
  assert_same_run(tmp_path / "killed", tmp_path / "whole", 48)
  assert_same_run(tmp_path / "stage3", tmp_path / "stage3-whole", 10)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, env):
  """An uninterrupted PLAIN run (checkpoints 6 and 12), started at once."""
  out = tmp_path_factory.mktemp("plain") / "whole"
  run = start(out, PLAIN + ["--checkpoint-every", "6"], env, "run")
  yield lambda: finish(run) and out
  run.proc.kill()


def interrupted(run: Run, out: pathlib.Path, name: str) -> int:
  """The step of the checkpoint the run's exit message names (asserted to exist)."""
  found = re.findall(rf"^jzo: interrupted by {name} after step (\d+): checkpoint (\d+) in (\S+); "
                     r"--resume continues from it$", run.text(), re.M)
  assert len(found) == 1, run.text()[-3000:]
  step, again, path = found[0]
  assert step == again and path == str((out / "checkpoints" / step).absolute())
  assert f"jzo: {name}: finishing the step in flight, then writing a checkpoint" in run.text()
  assert int(step) in complete_steps(out)
  return int(step)


def test_sigint_and_sigterm_write_a_checkpoint_and_a_second_sigint_exits_at_once(
    tmp_path, env, plain_run):
  out = tmp_path / "run"
  # SIGINT once the first step's line is out; --checkpoint-every 0: the
  # signal's checkpoint is the only one.
  run = start(out, PLAIN + ["--checkpoint-every", "0"], env, "sigint")
  assert run.wait_for(lambda: 1 in run.steps_logged())
  run.proc.send_signal(signal.SIGINT)
  assert run.exit_status() == 130
  first = interrupted(run, out, "SIGINT")
  assert complete_steps(out) == [first] and first == run.steps_logged()[-1]
  assert [l["step"] for l in losses(out)] == list(range(1, first + 1))

  # SIGTERM, as a scheduler sends before it kills.
  args = PLAIN + ["--checkpoint-every", "6", "--resume"]
  run = start(out, args, env, "sigterm")
  assert run.wait_for(lambda: first + 1 in run.steps_logged())
  run.proc.send_signal(signal.SIGTERM)
  assert run.exit_status() == 143
  second = interrupted(run, out, "SIGTERM")
  assert resumed_from(run) == first and second > first

  # SIGINT, then SIGINT again once a checkpoint write has begun.
  run = start(out, args, env, "twice")
  assert run.wait_for(lambda: second + 1 in run.steps_logged())
  partial = partial_writes(out)
  run.proc.send_signal(signal.SIGINT)
  assert run.wait_for(lambda: "jzo: SIGINT: finishing the step in flight" in run.text())
  assert run.wait_for(lambda: partial_writes(out) - partial)
  run.proc.send_signal(signal.SIGINT)
  assert run.exit_status() == 130
  assert ("jzo: SIGINT again: exiting at once, without a checkpoint of the step reached "
          "(--resume continues from the last complete one)") in run.text()
  assert "interrupted by" not in run.text()
  assert partial_writes(out) - partial, "the write was finished, not cut short"

  run = finish(start(out, args, env, "last"))
  assert "removed 1 unfinished checkpoint(s) of a run stopped while writing" in run.text()
  whole = plain_run()
  assert losses(out) == losses(whole)
  assert_same_weights(out, whole)


def damage(step_folder: pathlib.Path, how: str) -> None:
  """Overwrites every file of a checkpoint, or cuts its array files short."""
  files = [f for f in step_folder.rglob("*") if f.is_file()]
  for f in files:
    if how == "overwrite":
      f.write_bytes(b"damaged")
    elif "/d/" in f.as_posix():
      f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])


def test_unreadable_checkpoints(tmp_path, env, plain_run):
  whole = plain_run()
  out = tmp_path / "run"
  shutil.copytree(whole, out)
  args = PLAIN + ["--checkpoint-every", "6", "--resume"]
  folder = (out / "checkpoints").absolute()

  # The latest unreadable: the one before serves, with a warning.
  damage(out / "checkpoints" / "12", "cut")
  run = finish(start(out, args, env, "earlier"))
  assert re.search(rf"^warning: checkpoint 12 in {folder} is unreadable: .+; moved to "
                   rf"{out.absolute()}/checkpoints-unreadable/12$", run.text(), re.M), run.text()
  assert resumed_from(run) == 6
  assert losses(out) == losses(whole)
  assert_same_weights(out, whole)

  # None readable: refused, naming each, and nothing moved.
  damage(out / "checkpoints" / "12", "overwrite")
  damage(out / "checkpoints" / "6", "cut")
  run = start(out, args, env, "refused")
  assert run.exit_status() == 2
  assert re.search(rf"^error: --resume: no checkpoint can be read: checkpoint 12 in {folder} is "
                   rf"unreadable: .+; checkpoint 6 in {folder} is unreadable: .+ \(to start at "
                   r"step 0, with them moved to .+, add --fresh-start-ok\)$", run.text(), re.M), \
      run.text()[-3000:]
  assert complete_steps(out) == [6, 12]
  assert "Traceback" not in run.text()

  # Asked to: starts over, the unreadable ones moved aside.
  run = finish(start(out, args + ["--fresh-start-ok"], env, "over"))
  assert f"--resume: no checkpoint in {folder} can be read: starting at step 0" in run.text()
  assert sorted(p.name for p in (out / "checkpoints-unreadable").iterdir()) == ["12", "12-2", "6"]
  assert losses(out) == losses(whole)
  assert_same_weights(out, whole)


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
@pytest.mark.parametrize("where", ["upload", "download"])
def test_a_fault_in_a_transfer_surfaces_and_stops_the_engine(where, delayed):
  """The second upload of new weights (one leaf already installed), or
  download of gradients, after the first step raises: the caller sees it
  with the frame that raised, at that step; later steps and state_dict
  refuse (the params may hold some leaves' new weights only); close() stops
  the update thread without raising, twice."""
  faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the run, with the stacks
  engine = jzo.ZeroEngine(loss_fn, init_params(), TX(),
                          options=jzo.EngineOptions(offload=True, delayed_update=delayed,
                                                    dpu_warmup=0),
                          mesh=mesh_of(2))
  data = batches(4)
  engine.step(data[0])
  transfer = engine.host_update.transfer
  moves, calls = getattr(transfer, where), []

  def failing(i, x):
    calls.append(i)
    if len(calls) == 2:
      raise OSError(f"injected fault in the {where}")
    return moves(i, x)
  setattr(transfer, where, failing)
  with pytest.raises(OSError, match=f"injected fault in the {where}") as caught:
    engine.step(data[1])
  assert traceback.extract_tb(caught.value.__traceback__)[-1].name == "failing"
  with pytest.raises(RuntimeError, match="earlier host update failed.*OSError.*checkpoint"):
    engine.step(data[2])
  with pytest.raises(RuntimeError, match="earlier host update failed"):
    engine.state_dict()
  engine.close()
  engine.close()
  with pytest.raises(RuntimeError, match="closed"):
    engine.step(data[3])
  faulthandler.cancel_dump_traceback_later()
