"""What every benchmark shares: its command line, the machine it ran on,
children in processes of their own, rounds taken in turn, the memory a
process holds (host and GPU), and JSON records.

A benchmark is a script with a module docstring (its --help), a `--json PATH`
flag, and points: dicts of what one configuration measured. A point that did
not run says why in "status" ("refused" by jzo's planner, "oom" on the device,
"killed" by a signal (on the GPU machines, the host out of memory),
"timeout", "error") with the last lines it printed in "detail"; a point that
ran has "status": "ok". `write_record` puts the points beside the machine and
the command that made them; benchmarks/plot.py and docs/results.md read those
records.

A measurement that needs a fresh process (its own GPU peak and host RSS, or
no other system's threads beside it) runs as a child: the benchmark starts
itself again with `--child ...` and the child prints its points as JSON on
the last line of its stdout (`child_result`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parser(doc: str) -> argparse.ArgumentParser:
  """An argument parser whose --help is the benchmark's docstring, with --json."""
  summary, _, details = doc.strip().partition("\n")
  result = argparse.ArgumentParser(description=summary, epilog=details.strip() or None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  result.add_argument("--json", metavar="PATH", help="write the record (machine, command, "
                      "points) to PATH as JSON")
  return result


def _git_commit() -> str:
  try:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                         capture_output=True, timeout=10)
    return out.stdout.strip() or "unknown"
  except (OSError, subprocess.SubprocessError):
    return "unknown"


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _host_ram_gib() -> float:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  except (ValueError, OSError):
    return 0.0


def machine(*, with_devices: bool = True) -> dict:
  """The machine a record was measured on: date (UTC), jzo's commit, the host
  CPU, the cores this process may use, host RAM, versions and the devices.
  `with_devices=False` leaves JAX unimported (for a parent whose children
  hold the devices)."""
  info = {
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      "commit": _git_commit(), "hostname": platform.node(), "cpu": _cpu_model(),
      "cores": len(os.sched_getaffinity(0)), "host_ram_gib": round(_host_ram_gib(), 1),
      "python": platform.python_version(),
  }
  if with_devices:
    import jax
    devices = jax.devices()
    stats = devices[0].memory_stats() or {}
    info.update(jax=jax.__version__, platform=devices[0].platform,
                device=devices[0].device_kind, devices=len(devices),
                device_memory_gib=round(stats.get("bytes_limit", 0) / 2**30, 1))
  return info


def write_record(path: str | None, benchmark: str, args: argparse.Namespace,
                 points: list[dict], *, with_devices: bool = True) -> dict:
  """The record of one benchmark run; written to `path` as JSON if given."""
  record = {"benchmark": benchmark, "machine": machine(with_devices=with_devices),
            "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "points": points}
  if path:
    with open(path, "w") as f:
      f.write(dumps(record))
  return record


def dumps(record: dict) -> str:
  """A record as JSON text, a point a line (diffs and line counts stay small)."""
  head = json.dumps({k: v for k, v in record.items() if k != "points"})
  points = ",\n".join(json.dumps(p) for p in record["points"])
  return f'{head[:-1]}, "points": [\n{points}\n]}}\n'



def read_record(path: str) -> dict:
  """A record written by `write_record`."""
  with open(path) as f:
    return json.load(f)


def child_result(points) -> None:
  """In a child: prints its points as the last line of stdout."""
  sys.stdout.flush()
  print(json.dumps(points), flush=True)


def failure_status(returncode: int, output: str) -> str:
  """Why a process that exited with `returncode`, having printed `output`, failed:
  "killed", "refused", "oom" or "error" (the module docstring says which is which)."""
  if returncode < 0:
    return "killed"
  tail = output[-4000:]
  if "PlacementError" in tail or "does not fit" in tail:
    return "refused"
  if "RESOURCE_EXHAUSTED" in output or "out of memory" in output.lower():
    return "oom"
  return "error"


def run_child(cmd: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None,
              echo: bool = True) -> list[dict]:
  """Runs `cmd` in a process group of its own and returns the points it printed
  (a dict or a list of dicts as its last stdout line). A child that fails or
  outlasts `timeout_s` (its whole group is then killed) gives one point with its
  status and the last lines it printed. `echo` passes its stderr through."""
  full_env = dict(os.environ, **(env or {}))
  full_env.setdefault("PYTHONUNBUFFERED", "1")
  proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=full_env, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=timeout_s)
    status = None
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    status = "timeout"
  if echo and err:
    sys.stderr.write(err[-3000:])
  if status is None and proc.returncode == 0:
    lines = out.strip().splitlines()
    try:
      result = json.loads(lines[-1])
      return result if isinstance(result, list) else [result]
    except (IndexError, json.JSONDecodeError):
      status = "error"
  status = status or failure_status(proc.returncode, out + err)
  detail = (err or out).strip().splitlines()[-3:]
  return [{"status": status, "exit": proc.returncode, "detail": detail}]


def alternate(cmds: dict[str, Sequence[str]], rounds: int, *, timeout_s: float,
              env: dict[str, str] | None = None) -> dict[str, list[list[dict]]]:
  """Runs each named command once a round, in turn, for `rounds` rounds: on a
  shared machine whose speed drifts, each system then sees the same drift.
  Returns each name's points per round."""
  results: dict[str, list[list[dict]]] = {name: [] for name in cmds}
  for i in range(rounds):
    for name, cmd in cmds.items():
      print(f"round {i + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
      results[name].append(run_child(cmd, timeout_s=timeout_s, env=env))
  return results


def stats(values: Sequence[float]) -> dict:
  """Median and spread (min, max) of `values`, with their count."""
  values = list(values)
  if not values:
    return {"median": None, "min": None, "max": None, "n": 0}
  return {"median": statistics.median(values), "min": min(values), "max": max(values),
          "n": len(values)}


def timed(fn: Callable[[], object], repeats: int = 3) -> float:
  """Median wall time (s) of `fn()`, which must block until its work is done."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def host_rss_gib() -> float:
  """This process's resident set now (GiB)."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def host_peak_rss_gib() -> float:
  """This process's largest resident set so far (GiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def process_tree(pid: int) -> list[int]:
  """`pid` and its descendants (from /proc/PID/task/TID/children); [] once it is gone."""
  pids, todo = [], [pid]
  while todo:
    pid = todo.pop()
    try:
      tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # exited meanwhile
      continue
    for task in tasks:
      try:
        with open(f"/proc/{pid}/task/{task}/children") as f:
          todo += [int(child) for child in f.read().split()]
      except OSError:  # a thread that ended meanwhile (a checkpoint's writers do, often)
        pass
    pids.append(pid)
  return pids


def process_rss_gib(pids: Sequence[int]) -> float:
  """The resident sets of `pids` together (VmRSS of /proc/PID/status, GiB);
  a process gone or a zombie adds 0."""
  kib = 0
  for pid in pids:
    try:
      with open(f"/proc/{pid}/status") as f:
        kib += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
      pass
  return kib / 2**20


def nvidia_smi(query: str) -> list[list[str]]:
  """The rows of `nvidia-smi --query-QUERY` (e.g. "gpu=name"), each a list of
  its fields; [] where nvidia-smi is missing or fails."""
  try:
    out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line]


def gpu_memory_gib(pids: Sequence[int]) -> tuple[float | None, str | None]:
  """(GiB of GPU memory, where the figure comes from) by nvidia-smi: the
  memory `pids` hold ("process"), or where nvidia-smi lists none of them (a
  container's own process ids) the memory used on every GPU ("device");
  (None, None) without nvidia-smi (no NVIDIA GPU). "Every GPU" is those
  CUDA_VISIBLE_DEVICES lists by index, where it does: another job's GPU on the
  same machine is not counted."""
  if not shutil.which("nvidia-smi"):
    return None, None
  mib = [float(row[1]) for row in nvidia_smi("compute-apps=pid,used_memory")
         if len(row) == 2 and row[0].isdigit() and int(row[0]) in pids and row[1].isdigit()]
  if mib:
    return sum(mib) / 1024, "process"
  visible = [i.strip() for i in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
  mib = [float(row[1]) for row in nvidia_smi("gpu=index,memory.used")
         if len(row) == 2 and row[1].isdigit()
         and (not all(i.isdigit() for i in visible) or row[0] in visible)]
  return (sum(mib) / 1024, "device") if mib else (None, None)


def device_peak_gib(device=None) -> float:
  """The allocator's peak bytes in use on `device` (default: the first), GiB;
  0 where the backend keeps no such count (the CPU)."""
  import jax
  device = device or jax.devices()[0]
  return (device.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30
