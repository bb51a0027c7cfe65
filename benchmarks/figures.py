"""The points of the side-by-side figures: jzo, PyTorch alone and DeepSpeed
ZeRO-2 offload on the same GPT shapes, each point a process of its own with
a time limit, recorded however it ended.

  python3 benchmarks/figures.py PART [PART ...] [--gpus 1 2 4] [--rounds N] --json FILE

Each point is a child of benchmarks/train_gpt.py (jzo), peers_gpt.py (the
peers) or the recipe (`python -m jzo.train`, for loss curves). With
--rounds N every point of a part runs once a round, in turn, so that each
system sees the same drift of a shared machine; a point's figures are then
its median round's. A point that did not train says why in "status"
("refused" by jzo's planner before a weight was drawn, "oom" on the GPU,
"killed": the host out of memory, "timeout", "error") with its last lines.
benchmarks/plot.py draws the figures from the record.

Parts on one GPU (GPT-2 shapes, seq 1024, micro-batch 8, full remat, bf16):
  1.5b        gpt2-1.5b: jzo without offload, jzo with all of the optimizer
              state on the host + delayed update (DPU), PyTorch alone,
              DeepSpeed ZeRO-2 + offload_optimizer cpu
  4b          gpt2-4b: the same four; 38 layers of it (4.46B) for jzo
              without offload and PyTorch alone
  10b         gpt2-10b: jzo offload auto + DPU; PyTorch alone at 42 and 44
              layers of gpt2-4b; DeepSpeed at 30 layers of gpt2-10b (6.25B)
  13b         gpt2-13b, bf16 moments: jzo offload auto + DPU; DeepSpeed at
              34 layers of gpt2-10b (7.06B)
  edges       jzo offload auto + DPU at gpt2-4b and 38 layers of it;
              DeepSpeed at 44 layers of gpt2-4b (5.14B)
  dpu         gpt2-1.5b, all of the state on the host, with and without the
              delayed update at micro-batches 1, 2, 4, 8 (one engine each),
              and the loss of two 400-step recipe runs of gpt2-124m
  llama-1b    Llama-3.2-1B's shape at seq 4096, micro-batch 4: jzo with offload
              auto (as the recipe fine-tunes) against transformers'
              LlamaForCausalLM under PyTorch alone (peers_hf.py)
Parts over the GPU counts of --gpus (micro-batch 8 a GPU):
  scale-1.5b  gpt2-1.5b, jzo without offload at stages 1, 2 and 3
  scale-13b   gpt2-13b, jzo stage 2, all of the state on the host + DPU
  scale-ds    gpt2-13b, DeepSpeed ZeRO-2 offload, a process per GPU

--smoke runs every point at the tiny preset (seq 32, micro-batch 2, one
step): the parts' plumbing on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
JZO = {"device": "jzo, no offload", "offload": "jzo offload", "offload_dpu": "jzo offload + DPU",
       "auto": "jzo offload auto", "auto_dpu": "jzo offload auto + DPU"}
PEERS = {"torch": "PyTorch alone", "deepspeed": "DeepSpeed ZeRO-2 offload"}


@dataclasses.dataclass(frozen=True)
class Point:
  """One process to run: a system at one size."""
  system: str             # its name in the figures
  cmd: tuple[str, ...]    # the child's command line
  limit: float            # seconds before it is stopped
  about: tuple = ()       # (key, value) pairs recorded with a point that did not train


class Parts:
  """The parts' points; with `smoke`, at the tiny preset."""

  def __init__(self, smoke: bool):
    self.smoke = smoke

  def _size(self, model, n_layer, batch, steps):
    if self.smoke:
      return "tiny", None, (2,), 1, ["--seq-len", "32", "--no-breakdown",
                                     "--device-memory-gb", "1"]  # offload auto plans for it
    return model, n_layer, batch, steps, []

  def jzo(self, model, config, *, batch=(8,), n_layer=None, moments="fp32", steps=4,
          limit=300, gpus=1, stage=2, breakdown=True):
    model, n_layer, batch, steps, extra = self._size(model, n_layer, batch, steps)
    cmd = [sys.executable, os.path.join(HERE, "train_gpt.py"), "--child", config,
           "--model", model, "--batch", *map(str, batch), "--steps", str(steps),
           "--moments", moments, "--stage", str(stage), "--gpus", str(gpus), *extra]
    if not breakdown and "--no-breakdown" not in cmd:
      cmd.append("--no-breakdown")
    cmd += ["--n-layer", str(n_layer)] if n_layer else []
    return [Point(JZO[config], tuple(cmd), limit, self._about(model, n_layer, batch[0], gpus,
                                                               config=config, moments=moments,
                                                               stage=stage))]

  def peer(self, system, model, *, n_layer=None, steps=4, limit=240, gpus=1):
    model, n_layer, batch, steps, extra = self._size(model, n_layer, (8,), steps)
    cmd = [sys.executable, os.path.join(HERE, "peers_gpt.py"), "--child", "--system", system,
           "--model", model, "--batch", str(batch[0]), "--steps", str(steps), "--gpus", str(gpus),
           *extra[:2]]
    cmd += ["--n-layer", str(n_layer)] if n_layer else []
    return [Point(PEERS[system], tuple(cmd), limit, self._about(model, n_layer, batch[0], gpus))]

  def llama_pair(self, shape, *, seq_len=4096, batch=4, steps=6, limit=300):
    """jzo (train_llama.py, offload auto) and PyTorch alone (peers_hf.py) on
    one Llama-family shape."""
    smoke = ["--device-memory-gb", "1"] if self.smoke else []  # offload auto plans for it
    if self.smoke:
      shape, seq_len, batch, steps = "llama-tiny", 32, 2, 1
    size = ["--seq-len", str(seq_len), "--steps", str(steps)]
    jzo = [sys.executable, os.path.join(HERE, "train_llama.py"), "--child", "auto",
           "--model", shape, "--batch", str(batch), "--no-breakdown", *size, *smoke]
    torch = [sys.executable, os.path.join(HERE, "peers_hf.py"), "--child", "--system", "torch",
             "--shape", shape, "--micro-batch", str(batch), *size]
    about = (("model", shape), ("batch", batch), ("seq_len", seq_len), ("gpus", 1))
    return [Point(JZO["auto"], tuple(jzo), limit, about),
            Point(PEERS["torch"], tuple(torch), limit, about)]

  def loss_curve(self, name, *flags):
    size = (["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "2"]
            if self.smoke else ["--model", "gpt2-124m", "--seq-len", "512", "--batch-size", "16",
                                "--steps", "400"])
    cmd = [sys.executable, __file__, "--loss-curve", *size, "--lr", "6e-4", "--log-every", "50",
           "--eval-every", "100", "--checkpoint-every", "0", "--sample-tokens", "0", "--offload",
           "--offload-fraction", "1", *flags]
    return [Point(name, tuple(cmd), 240)]

  def _about(self, model, n_layer, batch, gpus, **more):
    from jzo.models.gpt import PRESETS  # shapes only
    n_layer = n_layer or PRESETS[model].n_layer
    config = dataclasses.replace(PRESETS[model], n_layer=n_layer,
                                 seq_len=32 if self.smoke else 1024)
    return tuple(dict(model=model, n_layer=n_layer, n_params=config.n_params, batch=batch,
                      gpus=gpus, **more).items())

  def points(self, part: str, counts: list[int]) -> list[Point]:
    jzo, peer = self.jzo, self.peer
    if part == "1.5b":
      return (jzo("gpt2-1.5b", "device") + jzo("gpt2-1.5b", "offload_dpu")
              + peer("torch", "gpt2-1.5b") + peer("deepspeed", "gpt2-1.5b"))
    if part == "4b":
      return (jzo("gpt2-4b", "device") + jzo("gpt2-4b", "offload_dpu") + peer("torch", "gpt2-4b")
              + peer("deepspeed", "gpt2-4b") + jzo("gpt2-4b", "device", n_layer=38, limit=150)
              + peer("torch", "gpt2-4b", n_layer=38, limit=150))
    if part == "10b":
      return (jzo("gpt2-10b", "auto_dpu", limit=330)
              + peer("torch", "gpt2-4b", n_layer=42, limit=120)
              + peer("torch", "gpt2-4b", n_layer=44, limit=120)
              + peer("deepspeed", "gpt2-10b", n_layer=30, limit=300))
    if part == "13b":
      return (jzo("gpt2-13b", "auto_dpu", moments="bf16", limit=360)
              + peer("deepspeed", "gpt2-10b", n_layer=34, limit=300))
    if part == "edges":
      return (jzo("gpt2-4b", "auto_dpu") + jzo("gpt2-4b", "auto_dpu", n_layer=38)
              + peer("deepspeed", "gpt2-4b", n_layer=44, limit=300))
    if part == "dpu":
      return (jzo("gpt2-1.5b", "offload", batch=(1, 2, 4, 8), steps=5)
              + jzo("gpt2-1.5b", "offload_dpu", batch=(1, 2, 4, 8), steps=5)
              + self.loss_curve("loss, no DPU") + self.loss_curve("loss, DPU", "--delayed-update"))
    if part == "llama-1b":
      return self.llama_pair("llama-3.2-1b")
    if part == "scale-1.5b":
      return [p for n in counts for stage in (1, 2, 3)
              for p in jzo("gpt2-1.5b", "device", stage=stage, gpus=n, steps=5, limit=240,
                           breakdown=False)]
    if part == "scale-13b":
      return [p for n in counts
              for p in jzo("gpt2-13b", "offload_dpu", gpus=n, steps=4, limit=420,
                           breakdown=False)]
    if part == "scale-ds":
      return [p for n in counts for p in peer("deepspeed", "gpt2-13b", steps=2, limit=420, gpus=n)]
    raise ValueError(part)


PARTS = ("1.5b", "4b", "10b", "13b", "edges", "dpu", "llama-1b", "scale-1.5b", "scale-13b",
         "scale-ds")


def median_round(rounds: list[list[dict]]) -> list[dict]:
  """One point's rounds (each a list: one point a micro-batch) as one list:
  at each micro-batch the round of the median step, with every round's
  step beside it; a point that never trained, its last round's failure."""
  trained = [r for r in rounds if r and all(p["status"] == "ok" for p in r)]
  if not trained or "step_s" not in trained[0][0]:  # a loss curve: its last round's
    return trained[-1] if trained else rounds[-1]
  result = []
  for i in range(len(trained[0])):
    ranked = sorted((r[i] for r in trained), key=lambda p: p["step_s"])
    result.append(dict(ranked[(len(ranked) - 1) // 2],
                       step_s_rounds=[p["step_s"] for p in ranked]))
  return result


def loss_curve(argv: list[str]) -> None:
  """In a child: the recipe with `argv`; its metrics (step, loss, held-out
  loss) as the point."""
  from jzo import train
  with tempfile.TemporaryDirectory() as out:
    status = train.main(argv + ["--out", out])
    with open(os.path.join(out, "metrics.jsonl")) as f:
      metrics = [json.loads(line) for line in f if line.strip()]
  keep = ("step", "loss", "eval_loss")
  harness.child_result({"status": "ok" if status == 0 else "error",
                        "metrics": [{k: m[k] for k in keep if k in m} for m in metrics]})


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("parts", nargs="*", metavar="PART", help=", ".join(PARTS))
  parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4],
                      help="the scaling parts' GPU counts")
  parser.add_argument("--rounds", type=int, default=1, help="runs of each point, in turn")
  parser.add_argument("--smoke", action="store_true",
                      help="every point at the tiny preset: the plumbing on a CPU")
  parser.add_argument("--loss-curve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.loss_curve is not None:
    loss_curve(args.loss_curve)
    return
  if not args.parts or set(args.parts) - set(PARTS):
    parser.error(f"name one PART or more of {', '.join(PARTS)}")
  parts = Parts(args.smoke)
  points = []
  for part in args.parts:
    todo = list(dict.fromkeys(parts.points(part, args.gpus)))  # --smoke makes some the same
    names = {f"{i}: {p.system}": p for i, p in enumerate(todo)}
    runs = {name: [] for name in names}
    for i in range(args.rounds):  # as harness.alternate, each point with its own limit
      for name, p in names.items():
        print(f"{part}, round {i + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
        runs[name].append(harness.run_child(p.cmd, timeout_s=p.limit))
    for name, p in names.items():
      for point in median_round(runs[name]):
        about = dict(p.about) if point["status"] != "ok" else {}
        points.append({**about, **point, "system": p.system, "part": part})
        print(json.dumps({k: v for k, v in points[-1].items() if k not in ("metrics", "times_s")}),
              flush=True)
    harness.write_record(args.json, "figures", args, points, with_devices=False)  # each part
  harness.child_result(points)


if __name__ == "__main__":
  main()
