"""Disk faults that checkpoints survive, made for real.

- A save the disk refuses: a full disk (ENOSPC) on a small tmpfs mounted in
  a mount namespace of the test's own (skipped where none can be made: it
  needs unprivileged user namespaces or root), and a file-size limit
  (RLIMIT_FSIZE, set on the running process with prlimit: EFBIG, "File too
  large", the same path through tensorstore and orbax) that always runs.
  The run stops with one line naming the checkpoint that failed, the OS's
  reason and the one to continue from; that one is intact, nothing partial
  is left, and `--resume` continues bit for bit: at a periodic save, the
  save at the end and the save on SIGINT.
- Bytes changed on disk without changing a file's size (a flipped byte in
  an array file, or in a checkpoint's checksums): caught at `--resume` by
  the CRC32s written with each chunk; the checkpoint before serves, or none
  does and the run is refused naming each.

The recipe's runs are subprocesses on 2 CPU devices, as tests/test_resilience.py's.
"""

import contextlib
import json
import os
import pathlib
import re
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

from jzo import checkpoint
from jzo.checkpoint import checksums
from test_checkpoint import assert_same, copy, trained
from test_resilience import (PLAIN, ROOT, Run, assert_same_weights, complete_steps, finish,
                             losses, partial_writes, resumed_from, start)
from test_resilience import env, plain_run  # noqa: F401  (fixtures)

# A file-size limit that the run's own small files stay under (its log line
# appends, config.json) and a checkpoint's array files do not (100 KiB to 1 MiB).
FILE_LIMIT = 64 * 1024


def flip_byte(path: pathlib.Path, at: float = 0.5) -> None:
  """Changes one bit of the byte at fraction `at` of the file; its size stays."""
  data = bytearray(path.read_bytes())
  data[int(len(data) * at)] ^= 0x01
  path.write_bytes(bytes(data))


def largest_file(step_folder: pathlib.Path) -> pathlib.Path:
  """The largest file of a checkpoint: one of its arrays' data files."""
  return max((f for f in step_folder.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def checksums_file(step_folder: pathlib.Path) -> pathlib.Path:
  (found,) = step_folder.glob(f"*/{checksums.FOLDER}/*.json")
  return found


@contextlib.contextmanager
def stopped(run: Run):
  """The run's process stopped (SIGSTOP) for the body, then let go on."""
  os.kill(run.proc.pid, signal.SIGSTOP)
  try:
    yield
  finally:
    os.kill(run.proc.pid, signal.SIGCONT)


def refused_write(run: Run, folder: pathlib.Path, reason: str, latest: int) -> int:
  """The step of the checkpoint that the run's one error line says failed."""
  assert run.exit_status() == 2, run.text()[-3000:]
  found = re.findall(rf"^error: checkpoint (\d+) could not be written to {re.escape(str(folder))}"
                     rf": {reason} \([\d.]+ [MG]iB free there\); checkpoint {latest} there is "
                     r"intact: --resume continues from it$", run.text(), re.M)
  assert len(found) == 1, run.text()[-3000:]
  assert "Traceback" not in run.text() and "ERROR:" not in run.text(), run.text()[-3000:]
  return int(found[0])


# ------------------------------------------------------------ a save the disk refuses
@contextlib.contextmanager
def small_disk(where: pathlib.Path, size: str):
  """A tmpfs of `size` on the folder `where`, in a mount namespace of its
  own held by a waiting shell: yields (the command prefix that runs a
  program in that namespace, the path by which this process reaches the
  tmpfs). Skips where no namespace can be made."""
  where.mkdir()
  if not (shutil.which("unshare") and shutil.which("nsenter")):
    pytest.skip("no small filesystem: util-linux's unshare and nsenter are not installed")
  tried = []
  # A user namespace lets any user mount a tmpfs; root may also mount without one.
  for make, enter in ((["--user", "--map-root-user", "--mount"],
                       ["--user", "--mount", "--preserve-credentials"]),
                      (["--mount"], ["--mount"])):
    holder = subprocess.Popen(["unshare", *make, "sh", "-c",
                               'mount -t tmpfs -o size="$1" tmpfs "$2" && echo mounted && read _',
                               "sh", size, str(where)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    if holder.stdout.readline().strip() == "mounted":
      break
    holder.wait(30)
    tried.append(holder.stderr.read().strip().splitlines()[-1:])
  else:
    pytest.skip("no small filesystem can be mounted here (it takes unprivileged user "
                f"namespaces or root): {tried}")
  try:
    yield (["nsenter", f"--target={holder.pid}", *enter, f"--wd={ROOT}"],
           pathlib.Path(f"/proc/{holder.pid}/root{where}"))
  finally:
    holder.stdin.close()  # its `read` ends, and the namespace with it
    holder.wait(30)


def start_in(prefix: list[str], out: pathlib.Path, args: list[str], env: dict,
             log: pathlib.Path) -> Run:
  """`python -m jzo.train` run through `prefix` (its stdout and stderr in `log`)."""
  with open(log, "wb") as f:
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "jzo.train", *args, "--out", str(out)],
                            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
  return Run(proc, log, time.monotonic())


def test_a_full_disk_stops_the_run_in_one_line_and_resume_continues(tmp_path, env, plain_run):
  """The disk fills while the final checkpoint (12) is written: one line,
  checkpoint 6 intact and nothing partial left; once there is room,
  --resume continues from 6 as if nothing happened."""
  args = PLAIN + ["--checkpoint-every", "6"]
  disk = tmp_path / "disk"
  with small_disk(disk, "64m") as (inside, view):
    run = start_in(inside, disk / "run", args, env, tmp_path / "full.log")
    assert run.wait_for(lambda: 6 in complete_steps(view / "run")), run.text()[-3000:]
    with stopped(run):  # another writer takes all but 256 KiB of the disk
      with open(view / "filler", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(view).free - 256 * 1024)
    folder = disk / "run" / "checkpoints"
    assert refused_write(run, folder, "No space left on device", 6) == 12
    assert complete_steps(view / "run") == [6] and not partial_writes(view / "run")

    (view / "filler").unlink()
    run = finish(start_in(inside, disk / "run", args + ["--resume"], env, tmp_path / "again.log"))
    assert resumed_from(run) == 6
    whole = plain_run()
    assert losses(view / "run") == losses(whole)
    assert_same_weights(view / "run", whole)


def test_a_refused_save_mid_run_or_on_sigint_stops_in_one_line(tmp_path, env, plain_run):
  """A file-size limit set on the running process (EFBIG): the periodic
  checkpoint 8, then in a resumed run the checkpoint SIGINT asks for, fail
  in one line each; checkpoint 4 serves both times, and the last --resume
  ends as an uninterrupted run."""
  out, args = tmp_path / "run", PLAIN + ["--checkpoint-every", "4"]
  folder = (out / "checkpoints").absolute()
  limit = lambda run: resource.prlimit(run.proc.pid, resource.RLIMIT_FSIZE,
                                       (FILE_LIMIT, FILE_LIMIT))
  run = start(out, args, env, "periodic")
  assert run.wait_for(lambda: 4 in complete_steps(out))
  with stopped(run):
    limit(run)
  assert refused_write(run, folder, "File too large", 4) == 8
  assert complete_steps(out) == [4] and not partial_writes(out)

  run = start(out, args + ["--resume"], env, "sigint")
  assert run.wait_for(lambda: 5 in run.steps_logged())
  with stopped(run):  # the signal is handled once it goes on: the step in flight ends
    limit(run)
    run.proc.send_signal(signal.SIGINT)
  assert refused_write(run, folder, "File too large", 4) in (5, 6)
  assert "jzo: SIGINT: finishing the step in flight, then writing a checkpoint" in run.text()
  assert "interrupted by" not in run.text()
  assert complete_steps(out) == [4] and not partial_writes(out)

  run = finish(start(out, args + ["--resume"], env, "last"))
  assert resumed_from(run) == 4
  whole = plain_run()
  assert losses(out) == losses(whole)
  assert_same_weights(out, whole)


SAVE_SCRIPT = textwrap.dedent("""
    import json, os, resource, subprocess, sys
    import numpy as np
    from jzo import checkpoint

    class Engine:  # what checkpoint.save reads of an engine
      def state_dict(self, streamed=False):
        return {"w": np.arange(200_000, dtype=np.float32), "step": np.int32(3)}

    folder, fault, where = sys.argv[1:]
    with checkpoint.open_manager(folder) as manager:
      checkpoint.save(manager, Engine(), 1)
      if fault == "file size":
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(where), resource.RLIM_INFINITY))
      else:  # the filesystem made read-only under the run
        subprocess.run(["mount", "-o", "remount,ro", where], check=True)
      try:
        checkpoint.save(manager, Engine(), 2)
      except checkpoint.CheckpointWriteError as e:
        print(json.dumps({"error": str(e), "reason": e.reason, "latest": e.latest,
                          "step": e.step, "steps": manager.all_steps(),
                          "left": sorted(os.listdir(folder))}))
""")


@pytest.mark.parametrize("fault, reason", [("file size", "File too large"),
                                           ("read-only", "Read-only file system")])
def test_a_save_the_disk_refuses_raises_one_error_and_keeps_the_earlier(tmp_path, fault, reason):
  """jzo.checkpoint.save under a file-size limit, or on a filesystem made
  read-only (a tmpfs of the test's own): CheckpointWriteError with the OS's
  words, the earlier checkpoint kept, nothing partial left, and none of
  orbax's tracebacks."""
  with contextlib.ExitStack() as stack:
    if fault == "file size":
      inside, folder, view, where = [], tmp_path / "ckpt", tmp_path / "ckpt", str(FILE_LIMIT)
    else:
      disk = tmp_path / "disk"
      inside, view = stack.enter_context(small_disk(disk, "16m"))
      folder, where, view = disk / "ckpt", str(disk), view / "ckpt"
    done = subprocess.run([*inside, sys.executable, "-c", SAVE_SCRIPT, str(folder), fault, where],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert re.fullmatch(rf"checkpoint 2 could not be written to {re.escape(str(folder))}: "
                        rf"{reason} \([\d.]+ [MG]iB free there\); checkpoint 1 there is intact",
                        got["error"]), got
    assert (got["reason"], got["latest"], got["step"]) == (reason, 1, 2)
    assert got["steps"] == [1] and got["left"] == ["1"] == sorted(os.listdir(view))
    assert "Traceback" not in done.stderr and "ERROR" not in done.stderr, done.stderr[-3000:]


def test_os_errors_are_named_in_the_oss_words():
  """The reason of an OSError, or of tensorstore's status that carries one."""
  assert checkpoint.os_error_text(OSError(28, "x")) == os.strerror(28)
  status = ValueError("RESOURCE_EXHAUSTED: Error writing \"a/0\": Failed to write 9 bytes to "
                      "file 11: No space left on device [os_error_code='122']")
  assert checkpoint.os_error_text(status) == os.strerror(122)  # EDQUOT
  try:
    try:
      raise OSError(5, "Input/output error")
    except OSError as e:
      raise RuntimeError("orbax's wrapper") from e
  except RuntimeError as e:
    assert checkpoint.os_error_text(e) == os.strerror(5)
  assert checkpoint.os_error_text(ValueError("a bug")) is None


# ------------------------------------------------------------ bytes changed on disk
def test_changed_bytes_are_caught_at_resume(tmp_path, env, plain_run):
  """A flipped byte in the middle of checkpoint 12's largest array file:
  --resume warns and continues from 6, bit for bit. Then a flipped byte in
  both (12's array file, 6's checksums): refused, naming each."""
  whole = plain_run()
  out = tmp_path / "run"
  shutil.copytree(whole, out)
  args = PLAIN + ["--checkpoint-every", "6", "--resume"]
  folder = (out / "checkpoints").absolute()

  flip_byte(largest_file(out / "checkpoints" / "12"))
  run = finish(start(out, args, env, "flipped"))
  assert re.search(rf"^warning: checkpoint 12 in {folder} is unreadable: ChecksumError: .+ do not "
                   r"match the CRC32 written with them .+; moved to "
                   rf"{out.absolute()}/checkpoints-unreadable/12$", run.text(), re.M), run.text()
  assert resumed_from(run) == 6
  assert losses(out) == losses(whole)
  assert_same_weights(out, whole)

  flip_byte(largest_file(out / "checkpoints" / "12"))
  flip_byte(checksums_file(out / "checkpoints" / "6"))
  run = start(out, args, env, "refused")
  assert run.exit_status() == 2
  assert re.search(rf"^error: --resume: no checkpoint can be read: checkpoint 12 in {folder} is "
                   rf"unreadable: ChecksumError: .+; checkpoint 6 in {folder} is unreadable: "
                   r"ChecksumError: .+ \(to start at step 0, with them moved to .+, add "
                   r"--fresh-start-ok\)$", run.text(), re.M), run.text()[-3000:]
  assert complete_steps(out) == [6, 12]
  assert "Traceback" not in run.text()


def test_checked_reads_cross_chunk_edges_and_catch_a_changed_chunk():
  """ArraySums.read: boxes across chunk edges read whole chunks and give
  the box's values; a chunk whose values changed fails the reads that
  touch it, and only those."""
  values = np.arange(2 * 64, dtype=np.float32).reshape(2, 64)
  store = ts.open({"driver": "zarr", "kvstore": {"driver": "memory"},
                   "metadata": {"shape": [2, 64], "chunks": [1, 16], "dtype": "<f4"}},
                  create=True).result()
  store.write(values).result()
  sums = checksums.Recorder().array("w", values.shape, values.dtype)
  for row in range(2):
    for a in range(0, 64, 16):
      start, stop = checksums.flat_range((slice(row, row + 1), slice(a, a + 16)), values.shape)
      sums.add(start, stop - start, checksums.crc32(values[row, a:a + 16]))
  for box in [(slice(0, 1), slice(5, 37)), (slice(1, 2), slice(0, 64)),
              (slice(1, 2), slice(63, 64))]:
    np.testing.assert_array_equal(sums.read(store, box).result(), values[box])
  store[1, 20].write(-1.0).result()  # in row 1's chunk [16, 32)
  with pytest.raises(checksums.ChecksumError, match=r"^w: values \[80, 96\) do not match"):
    sums.read(store, (slice(1, 2), slice(30, 40))).result()
  np.testing.assert_array_equal(sums.read(store, (slice(1, 2), slice(32, 64))).result(),
                                values[1:, 32:])
  with pytest.raises(checksums.ChecksumError, match="do not match"):
    sums.check_whole(store.read().result())


class Weights:
  """What checkpoint.save reads of an engine: 800 KB of float32 masters."""

  def state_dict(self, streamed=False):
    rng = np.random.default_rng(0)
    return {"master": {"w": rng.normal(size=200_000).astype(np.float32)}, "step": np.int32(2)}


@pytest.mark.parametrize("how", ["array", "checksums", "no checksums"])
def test_a_changed_checkpoint_is_unreadable(tmp_path, how):
  """From Python: read_masters refuses a checkpoint with a flipped byte in
  its array file or in its checksums, or whose checksums are gone."""
  with checkpoint.open_manager(tmp_path) as manager:
    checkpoint.save(manager, Weights(), 2)
  assert checkpoint.read_masters(tmp_path)[1]["w"].tobytes() == \
      Weights().state_dict()["master"]["w"].tobytes()
  if how == "array":
    flip_byte(largest_file(tmp_path / "2"))
  elif how == "checksums":
    flip_byte(checksums_file(tmp_path / "2"))
  else:
    shutil.rmtree(checksums_file(tmp_path / "2").parent)
  detail = {"array": r"master.w: values \[0, 200000\) do not match the CRC32 written with them",
            "checksums": "", "no checksums": r"its checksums \(jzo_checksums\) are missing"}[how]
  with pytest.raises(checkpoint.UnreadableCheckpointError,
                     match=re.escape(f"checkpoint 2 in {tmp_path} is unreadable: ChecksumError: ")
                     + detail):
    checkpoint.read_masters(tmp_path)


def test_a_checkpoint_without_checksums_restores_unchecked(tmp_path):
  """One written before the checksums (orbax's own numpy arrays) restores."""
  engine = trained("offload-cpu_adamw-fp16", 2)
  before = copy(engine.state_dict())
  with ocp.CheckpointManager(tmp_path, item_handlers=ocp.PyTreeCheckpointHandler()) as manager:
    manager.save(2, args=ocp.args.PyTreeSave(before))
  assert not list(tmp_path.rglob(checksums.FOLDER))
  fresh = trained("offload-cpu_adamw-fp16", 0)
  with checkpoint.open_manager(tmp_path) as manager:
    assert checkpoint.restore(manager, fresh) == 2
  assert_same(fresh.state_dict(), before)
  engine.close()
  fresh.close()
