"""The single-GPU points of the papers' figures (issue 14), each run in its
own process group with a time limit, recorded whatever happens.

  python experiments/figure_runs.py PART [PART ...] --out DIR

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
"""

from __future__ import annotations

import argparse
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


# A point to run: (system, command, time limit in seconds).

def jzo_points(model, configs, *, batch=(8,), n_layer=None, moments="fp32", steps=4,
               limit=300):
  """jzo's configurations of offload_bench.py (one process each, run by it)."""
  cmd = [sys.executable, os.path.join(HERE, "offload_bench.py"), "--model", model,
         "--configs", *configs, "--batch", *map(str, batch), "--steps", str(steps),
         "--moments", moments]
  return [("jzo", cmd + (["--n-layer", str(n_layer)] if n_layer else []), limit)]


def peer_point(system, model, *, n_layer=None, steps=4, limit=240):
  """PyTorch alone ("torch") or DeepSpeed ("deepspeed") on the same shapes."""
  cmd = [sys.executable, os.path.join(HERE, "torch_baselines.py"), "--model", model,
         "--system", system, "--steps", str(steps)]
  return [(system, cmd + (["--n-layer", str(n_layer)] if n_layer else []), limit)]


def loss_curve(name, *flags):
  """A 400-step recipe run of gpt2-124m with offload and `flags`."""
  cmd = [sys.executable, "-m", "jzo.train", "--model", "gpt2-124m", "--seq-len", "512",
         "--batch-size", "16", "--steps", "400", "--lr", "6e-4", "--log-every", "50",
         "--eval-every", "100", "--checkpoint-every", "0", "--sample-tokens", "0",
         "--offload", *flags]
  return [(name, cmd, 240)]


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
}


def run(system: str, cmd: list[str], limit: float) -> list[dict]:
  """Runs one point; returns its records (several for a multi-batch bench)."""
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
                            start_new_session=True)
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
      r.update(system=name, wall_s=wall)
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
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  for part in args.parts:
    records = []
    for system, cmd, limit in PARTS[part]():
      records += [dict(r, part=part) for r in run(system, cmd, limit)]
      with open(os.path.join(args.out, f"{part}.json"), "w") as f:  # after each point
        json.dump({"date": time.strftime("%Y-%m-%d"), "records": records}, f, indent=1)


if __name__ == "__main__":
  main()
