"""The points of the papers' figures (issue 14), each run in its own process
group with a time limit, recorded whatever happens.

  python experiments/figure_runs.py PART [PART ...] --out DIR [--gpus 1 2 4]

writes DIR/PART.json: the date and a list of point records, each the
benchmark's own JSON (experiments/offload_bench.py for jzo,
experiments/torch_baselines.py for PyTorch alone and DeepSpeed, the
recipe's metrics.jsonl for loss curves) plus "system", "part" and
"wall_s"; a point that did not train has a
"status" saying why ("refused" by jzo's planner before anything was drawn,
"oom" on the GPU, "killed" by a signal, which on these machines is the host
out of memory, "timeout", "error") and the last lines it printed.
experiments/plot_figures.py draws the figures from these files.

Parts (model TFLOPS at micro-batch 8, seq 1024, full remat, bf16):
  1.5b    gpt2-1.5b: jzo on the GPU alone, jzo offload (all of the state on
          the host) + DPU, PyTorch alone, DeepSpeed ZeRO-2 + CPU offload
  4b      gpt2-4b: the same four, and the next size up (38 layers, 4.46B)
          for jzo on the GPU alone and PyTorch alone: their largest models
  10b     gpt2-10b: jzo offload auto + DPU; PyTorch alone at 42 and 44
          layers of gpt2-4b (4.92B, 5.14B; 38 layers fitted); DeepSpeed at
          6.25B (30 x 4096)
  13b     gpt2-13b, bf16 moments: jzo offload auto + DPU; DeepSpeed at
          7.06B (34 x 4096)
  edges   jzo offload auto + DPU at gpt2-4b and at 38 layers (4.46B, which
          jzo without offload refused); DeepSpeed at 44 layers (5.14B)
  check   gpt2-1.5b, jzo offload + DPU again (after a change to the engine)
  dpu     gpt2-1.5b, jzo offload with and without the delayed update at
          micro-batches 1, 2, 4, 8 (one engine each), and the loss of two
          400-step recipe runs of gpt2-124m with and without it

Scaling over --gpus GPU counts (figure 3; micro-batch 8 per GPU, one process
over the GPUs for jzo, one per GPU for DeepSpeed under torchrun):
  scale-1.5b     gpt2-1.5b, jzo without offload at stages 1, 2 and 3
  scale-1.5b-offload  gpt2-1.5b, jzo offload + DPU at stages 1, 2 and 3
  scale-13b      gpt2-13b, jzo offload + DPU at stage 2 (fp32 moments)
  scale-ds       gpt2-13b, DeepSpeed ZeRO-2 offload
  scale-ds-1.5b  gpt2-1.5b, DeepSpeed ZeRO-2 offload
Points without offload run side by side on disjoint GPUs (CUDA_VISIBLE_DEVICES),
as many at once as the GPUs hold: they hardly touch the host. A point that
uses the host (offload, DeepSpeed) runs alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
JZO = {"device": "jzo, no offload", "offload_dpu": "jzo offload + DPU",
       "auto_dpu": "jzo offload auto + DPU", "offload": "jzo offload"}
PEERS = {"torch": "PyTorch alone", "deepspeed": "DeepSpeed ZeRO-2 offload"}


@dataclasses.dataclass
class Point:
  """A benchmark command to run and record."""
  system: str      # "jzo", "torch", "deepspeed" or "loss, ..."
  cmd: list[str]
  limit: float     # seconds before it is stopped
  gpus: int = 0    # GPUs it is given (CUDA_VISIBLE_DEVICES); 0: the environment's
  alone: bool = True  # nothing runs beside it (it uses the host's memory and cores)
  env: dict[str, str] = dataclasses.field(default_factory=dict)  # set for its process


def jzo_points(model, configs, *, batch=(8,), n_layer=None, moments="fp32", steps=4,
               limit=300, gpus=0, stage=None):
  """jzo's configurations of offload_bench.py (one process each, run by it);
  with `gpus`, one engine over that many GPUs, without the timings apart."""
  cmd = [sys.executable, os.path.join(HERE, "offload_bench.py"), "--model", model,
         "--configs", *configs, "--batch", *map(str, batch), "--steps", str(steps),
         "--moments", moments]
  cmd += ["--n-layer", str(n_layer)] if n_layer else []
  cmd += ["--stage", str(stage)] if stage else []
  cmd += ["--gpus", str(gpus), "--no-breakdown"] if gpus else []
  return [Point("jzo", cmd, limit, gpus, alone=configs != ["device"])]


def peer_point(system, model, *, n_layer=None, steps=4, limit=240, gpus=0):
  """PyTorch alone ("torch") or DeepSpeed ("deepspeed") on the same shapes;
  with `gpus` > 1, a process per GPU under torchrun, each with its share of
  the host's cores for DeepSpeed's CPU Adam (torchrun's default of one
  OpenMP thread a process ran it 2-4x slower: RESULTS.md, session 34)."""
  script = os.path.join(HERE, "torch_baselines.py")
  launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(gpus), script] if gpus > 1 else [sys.executable, script])
  cmd = launch + ["--model", model, "--system", system, "--steps", str(steps)]
  env = {"OMP_NUM_THREADS": str(max(1, os.cpu_count() // gpus))} if gpus > 1 else {}
  return [Point(system, cmd + (["--n-layer", str(n_layer)] if n_layer else []), limit, gpus,
                env=env)]


def loss_curve(name, *flags):
  """A 400-step recipe run of gpt2-124m with offload and `flags`."""
  cmd = [sys.executable, "-m", "jzo.train", "--model", "gpt2-124m", "--seq-len", "512",
         "--batch-size", "16", "--steps", "400", "--lr", "6e-4", "--log-every", "50",
         "--eval-every", "100", "--checkpoint-every", "0", "--sample-tokens", "0",
         "--offload", *flags]
  return [Point(name, cmd, 240)]


PARTS = {
    "1.5b": lambda: (jzo_points("gpt2-1.5b", ["device", "offload_dpu"])
                     + peer_point("torch", "gpt2-1.5b") + peer_point("deepspeed", "gpt2-1.5b")),
    "4b": lambda: (jzo_points("gpt2-4b", ["device", "offload_dpu"])
                   + peer_point("torch", "gpt2-4b") + peer_point("deepspeed", "gpt2-4b")
                   + jzo_points("gpt2-4b", ["device"], n_layer=38, limit=150)
                   + peer_point("torch", "gpt2-4b", n_layer=38, limit=150)),
    "10b": lambda: (jzo_points("gpt2-10b", ["auto_dpu"], limit=330)
                    + peer_point("torch", "gpt2-4b", n_layer=42, limit=120)
                    + peer_point("torch", "gpt2-4b", n_layer=44, limit=120)
                    + peer_point("deepspeed", "gpt2-10b", n_layer=30, limit=300)),
    "13b": lambda: (jzo_points("gpt2-13b", ["auto_dpu"], moments="bf16", limit=360)
                    + peer_point("deepspeed", "gpt2-10b", n_layer=34, limit=300)),
    "edges": lambda: (jzo_points("gpt2-4b", ["auto_dpu"])
                      + jzo_points("gpt2-4b", ["auto_dpu"], n_layer=38)
                      + peer_point("deepspeed", "gpt2-4b", n_layer=44, limit=300)),
    "check": lambda: jzo_points("gpt2-1.5b", ["offload_dpu"]),
    "dpu": lambda: (jzo_points("gpt2-1.5b", ["offload", "offload_dpu"], batch=(1, 2, 4, 8),
                               steps=5)
                    + loss_curve("loss, no DPU") + loss_curve("loss, DPU", "--delayed-update")),
    # Scaling: the largest GPU counts last, so that the smaller ones share waves.
    "scale-1.5b": lambda counts: [p for n in counts for stage in (1, 2, 3)
                                  for p in jzo_points("gpt2-1.5b", ["device"], stage=stage,
                                                      gpus=n, steps=5, limit=240)],
    "scale-1.5b-offload": lambda counts: [
        p for n in counts for stage in (1, 2, 3)
        for p in jzo_points("gpt2-1.5b", ["offload_dpu"], stage=stage, gpus=n, steps=5,
                            limit=240)],
    "scale-13b": lambda counts: [p for n in counts
                                 for p in jzo_points("gpt2-13b", ["offload_dpu"], stage=2,
                                                     gpus=n, steps=4, limit=420)],
    "scale-ds": lambda counts: [p for n in counts
                                for p in peer_point("deepspeed", "gpt2-13b", steps=2,
                                                    limit=420, gpus=n)],
    "scale-ds-1.5b": lambda counts: [p for n in counts
                                     for p in peer_point("deepspeed", "gpt2-1.5b", steps=4,
                                                         gpus=n)],
}
SCALING = {part for part in PARTS if part.startswith("scale-")}


def waves(points: list[Point], gpu_ids: list[str]) -> list[list[tuple[Point, list[str]]]]:
  """Groups the points, in order, into runs side by side on disjoint GPUs:
  a point that must run alone, or needs no GPUs of its own, is a wave."""
  result, free = [], []
  for point in points:
    if point.alone or not point.gpus:
      result.append([(point, gpu_ids[:point.gpus])])
      free = []
      continue
    if point.gpus > len(free):
      result.append([])
      free = list(gpu_ids)
    result[-1].append((point, free[:point.gpus]))
    free = free[point.gpus:]
  return result


def run(point: Point, gpu_ids: list[str]) -> list[dict]:
  """Runs one point on `gpu_ids` (none: the environment's); returns its
  records (several for a multi-batch bench)."""
  system, cmd, limit = point.system, point.cmd, point.limit
  env = dict(os.environ, **point.env)
  if gpu_ids:
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
  with tempfile.TemporaryDirectory() as tmp:
    out_json = os.path.join(tmp, "out.json")
    if system.startswith("loss"):
      cmd = cmd + ["--out", os.path.join(tmp, "run")]
    else:
      cmd = cmd + ["--json", out_json]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    # A group of its own, so a time-out also stops the benchmark's children
    # (which hold the GPU and the pinned memory).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
      output, _ = proc.communicate(timeout=limit)
      status = None if proc.returncode == 0 else ("killed" if proc.returncode < 0 else "error")
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      output, _ = proc.communicate()
      status = "timeout"
    finally:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    wall = time.perf_counter() - start
    print(output[-2500:], flush=True)
    records = read_records(system, tmp, out_json)
    if not records or status == "timeout":  # the process ended before it wrote a record
      records.append({"status": status or "error", "exit": proc.returncode, "cmd": cmd[1:],
                      "detail": output.strip().splitlines()[-4:]})
    for r in records:
      name = JZO.get(r.get("config"), PEERS.get(system, system))
      r.update(system=name, wall_s=wall, gpu_ids=gpu_ids)
    return records


def read_records(system: str, tmp: str, out_json: str) -> list[dict]:
  if system.startswith("loss"):
    path = os.path.join(tmp, "run", "metrics.jsonl")
    if not os.path.exists(path):
      return []
    with open(path) as f:
      return [{"status": "ok", "metrics": [json.loads(line) for line in f]}]
  if not os.path.exists(out_json):
    return []
  with open(out_json) as f:
    data = json.load(f)
  return data if isinstance(data, list) else [data]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("parts", nargs="+", choices=PARTS)
  parser.add_argument("--out", required=True, help="folder for PART.json")
  parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4],
                      help="the scaling parts' GPU counts")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  gpu_ids = visible_gpus()
  for part in args.parts:
    points = PARTS[part](args.gpus) if part in SCALING else PARTS[part]()
    records = []
    for wave in waves(points, gpu_ids):
      with concurrent.futures.ThreadPoolExecutor(len(wave)) as pool:
        for done in list(pool.map(lambda job: run(*job), wave)):
          records += [dict(r, part=part) for r in done]
      with open(os.path.join(args.out, f"{part}.json"), "w") as f:  # after each wave
        json.dump({"date": time.strftime("%Y-%m-%d"), "records": records}, f, indent=1)


def visible_gpus() -> list[str]:
  """The GPUs' ids the points may take: CUDA_VISIBLE_DEVICES's, else
  nvidia-smi's (none on a machine without it)."""
  if os.environ.get("CUDA_VISIBLE_DEVICES"):
    return os.environ["CUDA_VISIBLE_DEVICES"].split(",")
  try:
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
  except FileNotFoundError:
    return []
  return [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]


if __name__ == "__main__":
  main()
