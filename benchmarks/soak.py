"""A long run (soak) of the training recipe as users run it: host RSS, GPU
memory and steps/s over minutes of training with a checkpoint every minute.

Runs `python -m jzo.train --model MODEL` with every option this script does
not know passed through as given (e.g. --offload --delayed-update
--batch-size 16 --keep-checkpoints 1), --log-every 1, no evaluation and no
sample, in a process of its own, for --minutes of training counted from its
first step; then sends it SIGTERM, on which the recipe finishes the step in
flight, writes a checkpoint and exits 143 (the stop is measured too).
--steps (default 1,000,000) is more than the run reaches: a run that ends
its steps before the deadline fails.

A checkpoint every K steps (the recipe's --checkpoint-every): K is
--checkpoint-minutes of steps at the median step time (steps 1-2, which
compile, left out) of a calibration run first: the same command without
checkpoints, killed once it has logged --calibration-steps steps. Or
--checkpoint-every K, and no calibration run. A save's own time comes on
top of its K steps.

Every --interval seconds it samples the recipe's process and its children:
the host RSS (VmRSS); the GPU memory nvidia-smi lists for them, or where it
lists none of them (a container's process ids) the GPUs' used memory (none
on a CPU); the allocator's peak the recipe's log lines print ("device X
GiB"); metrics.jsonl's new lines (each step's step_s, its own seconds: the
recipe's clock restarts after a save); and the complete checkpoints in
checkpoints/. XLA takes its pool when it starts (95% of a GPU under the
recipe, XLA_PYTHON_CLIENT_MEM_FRACTION), so nvidia-smi's figure moves only
with what is allocated beside that pool; a leak inside it shows in the
allocator's peak.

Reported: each memory figure at the end of the first checkpoint, its largest
after it and its last before the stop, with their growth over the first (%),
and its value just before each later save begins (the run between saves,
without a save's transient buffers: a leak shows there) with the last's
growth over the first;
each checkpoint's step, end, save seconds (to within --interval) and memory;
in windows of --window-s from the first step, steps/s as 1 / the median
step_s (the first 2 steps left out) and as the steps the window completed,
saves included, over its length; the last full window's steps/s over the
first's; and the stop: seconds to exit, status, the checkpoint it wrote. The
record holds the samples every --record-every seconds and every step's time.

  python3 benchmarks/soak.py --model gpt2-1.5b --minutes 9 --checkpoint-minutes 1 \\
      --offload --offload-fraction 1 --delayed-update --batch-size 16 --seq-len 1024 \\
      --keep-checkpoints 1
  python3 benchmarks/soak.py --model tiny --minutes 0.3 --checkpoint-minutes 0.05 \\
      --window-s 6 --batch-size 2 --seq-len 32 --delayed-update   # a CPU
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import harness

WARMUP_STEPS = 2  # their step_s includes compiling
NEVER = 10**9  # --eval-every: no evaluation
# Recipe options that would make the run another one than the soak measures.
SET_HERE = ("--log-every", "--eval-every", "--sample-tokens", "--sample", "--resume")
# A log line's memory: "step N: ..., host X GiB[, device Y GiB]" (jzo.recipe.logs.log_line).
LOG_LINE = re.compile(r"step (\d+): .*host [\d.]+ GiB(?:, device ([\d.]+) GiB)?$")
COLUMNS = ("t_s", "rss_gib", "gpu_gib", "allocator_peak_gib")


class Failed(Exception):
  """The recipe did not run as the soak needs: `status` as harness's points
  say ("error", "oom", "killed", "timeout"), `detail` its last lines."""

  def __init__(self, status: str, detail: list[str], exit: int | None = None):
    super().__init__(status)
    self.status, self.detail, self.exit = status, detail, exit


def recipe(args, extra: list[str], out: pathlib.Path, steps: int, every: int) -> list[str]:
  """The recipe's command: --model, the options passed through, the soak's own."""
  return [sys.executable, "-m", "jzo.train", "--model", args.model, *extra, "--steps", str(steps),
          "--checkpoint-every", str(every), "--log-every", "1", "--eval-every", str(NEVER),
          "--sample-tokens", "0", "--out", str(out)]


def start(cmd: list[str], log: pathlib.Path) -> subprocess.Popen:
  """`cmd` in a process group of its own, its output (unbuffered) in `log`."""
  with open(log, "w") as f:
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def kill(proc: subprocess.Popen) -> None:
  """Kills `proc`'s process group, if it still runs."""
  if proc.poll() is None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def tail(log: pathlib.Path, n: int = 3) -> list[str]:
  """The last `n` lines of `log` (progress bars' carriage returns end lines too)."""
  lines = re.split(r"[\r\n]+", log.read_text(errors="replace")) if log.exists() else []
  return [line.strip() for line in lines if line.strip()][-n:]


def failure(proc: subprocess.Popen, log: pathlib.Path) -> Failed:
  """Why `proc`, which has exited, failed, from its status and `log`."""
  return Failed(harness.failure_status(proc.returncode, log.read_text(errors="replace")),
                tail(log), proc.returncode)


def calibrate(args, extra: list[str], out: pathlib.Path) -> float:
  """The median step_s of the recipe's first --calibration-steps steps
  without checkpoints, the first WARMUP_STEPS left out (s). The run's
  process group is killed once it has logged them."""
  folder, log = out / "calibration", out / "calibration.log"
  metrics = folder / "metrics.jsonl"
  lines = lambda: metrics.read_text().split("\n")[:-1] if metrics.exists() else []  # whole ones
  start_time = time.monotonic()
  proc = start(recipe(args, extra, folder, args.steps, 0), log)
  try:
    while len(lines()) < args.calibration_steps:
      if proc.poll() is not None:
        raise failure(proc, log)
      if time.monotonic() - start_time > args.start_timeout:
        raise Failed("timeout", [f"the calibration run had not logged {args.calibration_steps} "
                                 f"steps after {args.start_timeout:g} s"] + tail(log))
      time.sleep(0.5)
  finally:
    kill(proc)
  times = [r["step_s"] for r in map(json.loads, lines()) if r["step"] > WARMUP_STEPS]
  shutil.rmtree(folder)  # nothing the soak's run reads
  return statistics.median(times)


class Watch:
  """What polls of the running recipe saw, as series (t: seconds since its start).

  Attributes:
    samples: [t, host RSS GiB, GPU GiB or None, allocator peak GiB or None] a poll.
    steps: [step, t its metrics line was first seen, its step_s] a step.
    saved: step -> t its checkpoint was first seen complete.
    gpu_source: "process" or "device" (harness.gpu_memory_gib), None on a CPU.
    lines: the log's first line of each kind ("banner", "micro_batch", "stop").
    exited: t the process was seen to exit.
  """

  def __init__(self, proc: subprocess.Popen, out: pathlib.Path, log: pathlib.Path):
    self.proc, self.out, self.log = proc, out, log
    self.start = time.monotonic()
    self.samples, self.steps, self.saved = [], [], {}
    self.gpu_source, self.lines, self.exited = None, {}, None
    self._peak, self._read_to = None, {}

  def now(self) -> float:
    return time.monotonic() - self.start

  def _new_lines(self, path: pathlib.Path) -> list[str]:
    """The complete lines added to `path` since the last call."""
    offset = self._read_to.get(path, 0)
    try:
      with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    except FileNotFoundError:
      return []
    end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
    self._read_to[path] = offset + end
    return [line for line in re.split(r"[\r\n]+", data[:end].decode(errors="replace")) if line]

  def read(self, t: float) -> None:
    """Reads the log, metrics.jsonl and the checkpoints folder."""
    for line in self._new_lines(self.log):
      if match := LOG_LINE.search(line):
        self._peak = float(match[2]) if match[2] else None
      for kind, opening in (("stop", "jzo: interrupted"), ("banner", "jzo: "),
                            ("micro_batch", "micro-batch ")):
        if line.startswith(opening):
          self.lines.setdefault(kind, line)
          break
    self.steps += [[r["step"], t, r["step_s"]]
                   for r in map(json.loads, self._new_lines(self.out / "metrics.jsonl"))]
    folder = self.out / "checkpoints"
    if folder.is_dir():
      for path in folder.iterdir():
        if path.name.isdigit():  # complete: orbax writes a temporary folder, then renames it
          self.saved.setdefault(int(path.name), t)

  def poll(self) -> float:
    """Samples the process's memory and reads its files; the time (s)."""
    t = self.now()
    pids = harness.process_tree(self.proc.pid)
    rss = harness.process_rss_gib(pids)
    gpu, source = harness.gpu_memory_gib(pids)
    self.gpu_source = self.gpu_source or source
    self.read(t)
    self.samples.append([t, rss, gpu, self._peak])
    return t


def follow(args, proc: subprocess.Popen, watcher: Watch) -> float:
  """Polls every --interval s until the recipe exits, sending it SIGTERM
  --minutes after its first step; the time of the signal (s)."""
  signalled = None
  while proc.poll() is None:
    t = watcher.poll()
    if signalled is None:
      if watcher.steps and t >= watcher.steps[0][1] + args.minutes * 60:
        proc.send_signal(signal.SIGTERM)
        signalled = t
      elif not watcher.steps and t > args.start_timeout:
        kill(proc)
        raise Failed("timeout", [f"no step in {args.start_timeout:g} s"] + tail(watcher.log))
    elif t - signalled > args.stop_timeout:
      kill(proc)
      raise Failed("timeout", [f"still running {args.stop_timeout:g} s after SIGTERM"]
                   + tail(watcher.log))
    try:
      proc.wait(timeout=max(0.0, t + args.interval - watcher.now()))
    except subprocess.TimeoutExpired:
      pass
  watcher.exited = watcher.now()
  watcher.read(watcher.exited)
  if signalled is None:
    if proc.returncode == 0:
      raise Failed("error", [f"the run finished its {args.steps} steps before the deadline: "
                             "a larger --steps"], 0)
    raise failure(proc, watcher.log)
  if proc.returncode != 128 + signal.SIGTERM:
    raise failure(proc, watcher.log)
  return signalled


def rounded(value, digits: int = 4):
  return None if value is None else round(value, digits)


def growth(samples: list[list], column: int, first: float, stop: float) -> dict | None:
  """A sampled figure from the first checkpoint's end (`first`) to the signal
  (`stop`): its value there, largest and last, GiB, and their growth (%)."""
  values = [row[column] for row in samples if first <= row[0] <= stop and row[column] is not None]
  if not values or not values[0]:
    return None
  base, top, end = values[0], max(values), values[-1]
  return {"first_checkpoint_gib": rounded(base), "max_gib": rounded(top), "end_gib": rounded(end),
          "growth_max_pct": rounded(100 * (top - base) / base, 3),
          "growth_end_pct": rounded(100 * (end - base) / base, 3)}


def before_saves(samples: list[list], column: int, starts: list[float]) -> dict | None:
  """A sampled figure in the last sample before each of the `starts` (the
  saves after the first): the run's settled state between saves, where a
  save's own transient buffers are gone. Its values (GiB) and the last's
  growth over the first (%); None with fewer than two."""
  values = []
  for start in starts:
    seen = [row[column] for row in samples if row[0] < start and row[column] is not None]
    if seen:
      values.append(seen[-1])
  if len(values) < 2 or not values[0]:
    return None
  return {"gib": [rounded(v) for v in values],
          "growth_pct": rounded(100 * (values[-1] - values[0]) / values[0], 3)}


def windows(steps: list[list], first: float, stop: float, length: float) -> list[dict]:
  """Steps/s in each full window of `length` s from `first` to `stop`."""
  out = []
  for i in range(int((stop - first) // length)):
    lo = first + i * length
    inside = [row for row in steps if lo <= row[1] < lo + length]
    timed = [step_s for step, _, step_s in inside if step > WARMUP_STEPS]
    median = statistics.median(timed) if timed else None
    out.append({"start_s": round(lo, 1), "steps": len(inside), "median_step_s": rounded(median),
                "steps_per_s": rounded(median and 1 / median),
                "wall_steps_per_s": rounded(len(inside) / length)})
  return out


def summary(args, watcher: Watch, every: int, signalled: float) -> dict:
  """The point's figures from what the watcher saw."""
  first_step = watcher.steps[0][1]
  line_seen = {step: t for step, t, _ in watcher.steps}
  samples = {row[0]: row for row in watcher.samples}
  periodic = sorted(s for s in watcher.saved if s % every == 0 and watcher.saved[s] <= signalled)
  checkpoints = [{"step": s, "end_s": round(watcher.saved[s], 1),
                  "save_s": round(watcher.saved[s] - line_seen.get(s, watcher.saved[s]), 1),
                  "rss_gib": rounded(samples[watcher.saved[s]][1]),
                  "gpu_gib": rounded(samples[watcher.saved[s]][2])} for s in periodic]
  first_end = watcher.saved[periodic[0]] if periodic else None
  # A save begins once its step's metrics line is written.
  starts = [line_seen[s] for s in periodic[1:] if s in line_seen]
  memory = {}
  for name, column in (("host_rss", 1), ("gpu_memory", 2), ("allocator_peak", 3)):
    figure = None if first_end is None else growth(watcher.samples, column, first_end, signalled)
    if figure:
      figure["before_saves"] = before_saves(watcher.samples, column, starts)
    memory[name] = figure
  if memory["gpu_memory"]:
    memory["gpu_memory"]["source"] = watcher.gpu_source
  by_window = windows(watcher.steps, first_step, signalled, args.window_s)
  rates = [w["steps_per_s"] for w in by_window]
  last = watcher.steps[-1][0]
  kept, decimated = -args.record_every, []
  for row in watcher.samples:
    if row[0] >= kept + args.record_every:
      kept = row[0]
      decimated.append([round(row[0], 1)] + [rounded(v) for v in row[1:]])
  return {
      "first_step_s": round(first_step, 1), "trained_s": round(signalled - first_step, 1),
      "steps_done": last, "checkpoints": checkpoints, **memory,
      "window_s": args.window_s, "windows": by_window,
      "steps_per_s_last_vs_first": rounded(rates[-1] / rates[0], 3)
      if len(rates) > 1 and rates[0] and rates[-1] else None,
      "stop": {"signal_s": round(signalled, 1), "exit": watcher.proc.returncode,
               "exit_after_s": round(watcher.exited - signalled, 1), "step": last,
               "checkpoint": last if (watcher.out / "checkpoints" / str(last)).is_dir() else None,
               "line": watcher.lines.get("stop")},
      "banner": watcher.lines.get("banner"), "micro_batch": watcher.lines.get("micro_batch"),
      "series": {"every_s": args.record_every, "columns": COLUMNS, "rows": decimated},
      "step_series": {"columns": ("step", "t_s", "step_s"),
                      "rows": [[s, round(t, 1), round(dt, 4)] for s, t, dt in watcher.steps]},
  }


def soak(args, extra: list[str], out: pathlib.Path) -> dict:
  """Calibrates (unless --checkpoint-every), runs and watches the recipe; its point."""
  point = {"status": "ok", "model": args.model, "recipe_options": extra}
  if args.checkpoint_every:
    every = args.checkpoint_every
  else:
    step_s = calibrate(args, extra, out)
    every = max(1, round(args.checkpoint_minutes * 60 / step_s))
    point["calibration"] = {"steps": args.calibration_steps, "step_s": rounded(step_s)}
  cmd = recipe(args, extra, out / "run", args.steps, every)
  point.update(checkpoint_every=every, recipe=" ".join(["python"] + cmd[1:]))
  log = out / "run.log"
  proc = start(cmd, log)
  watcher = Watch(proc, out / "run", log)
  try:
    signalled = follow(args, proc, watcher)
  finally:
    kill(proc)
  return point | summary(args, watcher, every, signalled)


def report(point: dict) -> None:
  """The summary on stdout."""
  if point["status"] != "ok":
    print(f"{point['model']}: {point['status']}: {' '.join(point['detail'])}")
    return
  saves = [c["save_s"] for c in point["checkpoints"]]
  print(f"{point['model']}: {point['trained_s']:.0f} s of training after "
        f"{point['first_step_s']:.0f} s of start-up, {point['steps_done']} steps, "
        f"{len(saves)} checkpoints every {point['checkpoint_every']} steps"
        + (f" (save {statistics.median(saves):.1f} s)" if saves else ""))
  for name in ("host_rss", "gpu_memory", "allocator_peak"):
    if g := point[name]:
      print(f"{name}: {g['first_checkpoint_gib']:.3f} GiB at the first checkpoint's end, max "
            f"{g['max_gib']:.3f} ({g['growth_max_pct']:+.2f}%), end {g['end_gib']:.3f} "
            f"({g['growth_end_pct']:+.2f}%)" + (f" [{g['source']}]" if "source" in g else ""))
      if settled := g["before_saves"]:
        print(f"  before each later save: {settled['gib'][0]:.3f} to {settled['gib'][-1]:.3f} "
              f"GiB ({settled['growth_pct']:+.2f}%)")
  rates = " ".join(f"{w['steps_per_s']:.2f}" if w["steps_per_s"] else "-"
                   for w in point["windows"])
  print(f"steps/s per {point['window_s']:g} s: {rates}; last/first "
        f"{point['steps_per_s_last_vs_first']}")
  stop = point["stop"]
  print(f"SIGTERM at step {stop['step']}: exit {stop['exit']} after {stop['exit_after_s']} s, "
        f"checkpoint {stop['checkpoint']}")


def main() -> None:
  parser = harness.parser(__doc__)
  parser.allow_abbrev = False  # a recipe option must not pass for a prefix of one of these
  parser.add_argument("--model", default="gpt2-1.5b", help="the recipe's --model (default: "
                      "gpt2-1.5b)")
  parser.add_argument("--minutes", type=float, default=9, help="training time, from the first "
                      "step to SIGTERM (default: 9)")
  parser.add_argument("--checkpoint-minutes", type=float, default=1, help="minutes of steps "
                      "between checkpoints (default: 1)")
  parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between "
                      "checkpoints, instead of a calibration run (default: 0, calibrate)")
  parser.add_argument("--calibration-steps", type=int, default=10, help="steps of the "
                      "calibration run (default: 10)")
  parser.add_argument("--steps", type=int, default=1_000_000, help="the recipe's --steps "
                      "(default: 1,000,000)")
  parser.add_argument("--interval", type=float, default=1, help="seconds between samples "
                      "(default: 1)")
  parser.add_argument("--record-every", type=float, default=5, help="seconds between the "
                      "samples the record keeps (default: 5)")
  parser.add_argument("--window-s", type=float, default=60, help="seconds of each steps/s "
                      "window (default: 60)")
  parser.add_argument("--out", default="", help="the runs' folder, kept (default: a temporary "
                      "one, removed)")
  parser.add_argument("--start-timeout", type=float, default=1800, help="seconds a run may "
                      "take to its first step (the calibration run: to its last)")
  parser.add_argument("--stop-timeout", type=float, default=600, help="seconds the run may "
                      "take to exit after SIGTERM")
  args, extra = parser.parse_known_args()
  for flag in extra:
    if flag.split("=")[0] in SET_HERE:
      parser.error(f"{flag.split('=')[0]} is soak.py's to set: the recipe logs every step, "
                   "evaluates never, samples nothing and starts afresh")
  for name in ("minutes", "checkpoint_minutes", "interval", "record_every", "window_s"):
    if not getattr(args, name) > 0:
      parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
  if args.calibration_steps <= WARMUP_STEPS or args.checkpoint_every < 0:
    parser.error(f"--calibration-steps must be > {WARMUP_STEPS} and --checkpoint-every >= 0")
  out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="soak-"))
  out.mkdir(parents=True, exist_ok=True)
  try:
    point = soak(args, extra, out)
  except Failed as e:
    point = {"status": e.status, "model": args.model, "recipe_options": extra, "exit": e.exit,
             "detail": e.detail}
  finally:
    if not args.out:
      shutil.rmtree(out, ignore_errors=True)
  report(point)
  gpus = harness.nvidia_smi("gpu=name")
  point["gpu"] = gpus[0][0] if gpus else None
  harness.write_record(args.json, "soak", args, [point], with_devices=False)
  sys.exit(0 if point["status"] == "ok" else 1)


if __name__ == "__main__":
  main()
