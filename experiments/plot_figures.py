"""Draws the figures of issue 14 from the records that
experiments/figure_runs.py wrote (default: experiments/results/session6/ for
the single-GPU ones, SCALING_RUNS for figure 3).

  python experiments/plot_figures.py [--results DIR] [--out experiments/figures]

  fig1_largest_model.png  the largest GPT each system trained on one GPU
                          (with the runs since session 6 in LARGEST_SINCE)
  fig_memory_per_param.png  GPU and host bytes per parameter of the largest
                          runs, the planner's against measured
  fig2_throughput.png     model TFLOPS against model size, and what did not fit
  fig3_scaling.png        tokens/s per GPU over 1, 2 and 4 GPUs against linear:
                          gpt2-1.5b without offload at stages 1-3, gpt2-13b
                          with offload beside DeepSpeed
  fig4_dpu.png            the delayed parameter update: step time against
                          micro-batch, and the loss of two runs
  fig5_largest_per_gpus.png  the largest GPT the planner fits with offload on
                          1, 2 and 4 H200s, each trained (LARGEST_PER_GPUS)

Model TFLOPS count 6 N + 12 L D T flops a token (recomputation not counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jzo.models.gpt import PRESETS  # noqa: E402  (shapes only)

HERE = os.path.dirname(os.path.abspath(__file__))
MACHINE = ("nvidia-h100-x1: one H100 80GB, 16-core Xeon, 125 GiB host; jax 0.11.2, "
           "torch 2.11, DeepSpeed 0.19.8")
COLORS = {"jzo offload auto + DPU": "tab:blue", "jzo offload + DPU": "tab:cyan",
          "jzo stage 3 offload, grads in params": "tab:purple",
          "jzo, no offload": "tab:green", "PyTorch alone": "tab:orange",
          "DeepSpeed ZeRO-2 offload": "tab:red"}
# Runs of offload_bench.py since session 6 that trained larger models: (records
# under results/, the system's name in figure 1, the date they ran).
LARGEST_SINCE = [("session38/call2-e7b287b/grads-20b.json",
                  "jzo stage 3 offload, grads in params", "2026-11-27")]
# The runs of figure "memory per parameter": (records under results/, model).
MEMORY_RUNS = [("session6/h100_10b.json", "gpt2-10b"), ("session7/llama8b.json", "llama-3.1-8b"),
               ("session38/call2-e7b287b/grads-20b.json", "gpt2-20b")]
# The runtime the planner counted beside the state when the older MEMORY_RUNS
# ran (sessions 6-7), whose records have no planned_host_gib; it now counts the
# pinned pools' headroom and the allocators' tables too.
RUNTIME_PLANNED_THEN_GIB = 4.5
# Figure 3's runs (nvidia-h200-x4, session 34), under results/: figure_runs.py's
# scale-1.5b and scale-13b, DeepSpeed with each process's share of the cores
# (torch_baselines.py's own records), and DeepSpeed under torchrun's default of
# one OpenMP thread a process (figure_runs.py's scale-ds before that was set).
SCALING_RUNS = {"jzo": ["session34/call1/scale-1.5b.json", "session34/call1/scale-13b.json"],
                "deepspeed": ["session34/call3/ds1.json", "session34/call4/ds2.json",
                              "session34/call4/ds4.json"],
                "deepspeed, 1 thread": ["session34/call2/scale-ds.json"]}
SCALING_MACHINE = ("nvidia-h200-x4: 4 H200 141GB (NVLink), 64-core Xeon, 503 GiB host; jax "
                   "0.11.2, DeepSpeed 0.19.8; 2026-11-27")
# Figure 5's runs (session 37), under results/: largest_model.py's record of
# each GPU count, and the machine it ran on with its host RAM.
LARGEST_PER_GPUS = [
    ("session37/call7-84ee353/largest1.json", "nvidia-h200-x2, 251 GiB host"),
    ("session37/call6-84ee353/largest2.json", "nvidia-h200-x2, 251 GiB host"),
    ("session37/call9-84ee353/largest4.json", "nvidia-h200-x4, 503 GiB host")]
FAILED = {"oom": "GPU out of memory", "killed": "killed: host out of memory",
          "refused": "refused by jzo's planner", "timeout": "no result in time"}


def load(results: str) -> tuple[list[dict], str]:
  """Every record of the folder's PART.json files, and the date they ran."""
  records, dates = [], set()
  for path in sorted(glob.glob(os.path.join(results, "*.json"))):
    with open(path) as f:
      data = json.load(f)
    dates.add(data["date"])
    records += data["records"]
  return records, ", ".join(sorted(dates))


def size_b(r: dict) -> float:
  """Parameters of a record's model in billions; a run killed before it
  printed anything has only its command, whose preset and --n-layer say."""
  if "n_params" not in r:
    cmd = r["cmd"]
    config = PRESETS[cmd[cmd.index("--model") + 1]]
    if "--n-layer" in cmd:
      config = dataclasses.replace(config, n_layer=int(cmd[cmd.index("--n-layer") + 1]))
    return config.n_params / 1e9
  return r["n_params"] / 1e9


def label(r: dict) -> str:
  return r["system"] + (f", {r['moments']} moments" if r.get("moments") in ("bf16", "int8")
                        else "")


def records_since(path: str, system: str) -> list[dict]:
  """offload_bench.py's records of a later session, named for figure 1."""
  with open(os.path.join(HERE, "results", path)) as f:
    return [dict(r, system=system, part=path) for r in json.load(f)]


def throughput_records(records: list[dict]) -> list[dict]:
  """Records of full-size steps: micro-batch 8, seq 1024 (the DPU sweep and
  its loss curves, and the re-run after a change to the engine, excluded)."""
  return [r for r in records if r["part"] not in ("dpu", "check") and r.get("batch", 8) == 8]


def fig_largest(records: list[dict], date: str, out: str) -> None:
  best, failed = {}, {}
  # jzo's forced all-on-the-host placement was run at 1.5B and 4B only, for
  # figure 2: its largest model was not looked for.
  for r in (r for r in throughput_records(records) if r["system"] != "jzo offload + DPU"):
    key = label(r)
    if r["status"] == "ok" and size_b(r) > best.get(key, {"size": 0})["size"]:
      best[key] = {"size": size_b(r), "tflops": r["tflops"], "system": r["system"], "batch": 8}
    elif r["status"] != "ok":
      failed.setdefault(key, []).append((size_b(r), FAILED.get(r["status"], r["status"])))
  for r in (r for path, system, _ in LARGEST_SINCE for r in records_since(path, system)):
    key = label(r)
    if r["status"] == "ok" and (size_b(r), r["tflops"]) > (best.get(key, {"size": 0})["size"],
                                                          best.get(key, {"tflops": 0})["tflops"]):
      best[key] = {"size": size_b(r), "tflops": r["tflops"], "system": r["system"],
                   "batch": r["batch"]}
  names = sorted(best, key=lambda k: best[k]["size"])
  fig, ax = plt.subplots(figsize=(10, 4.8))
  for y, name in enumerate(names):
    b = best[name]
    ax.barh(y, b["size"], color=COLORS.get(b["system"], "gray"),
            alpha=0.6 if name.endswith("bf16 moments") else 1)
    above = sorted(s for s in failed.get(name, []) if s[0] > b["size"])
    note = f"{b['size']:.2f}B at {b['tflops']:.0f} TFLOPS"
    if b["batch"] != 8:
      note += f" (micro-batch {b['batch']})"
    if above:
      note += f"; {above[0][0]:.2f}B: {above[0][1]}"
    ax.text(b["size"] + 0.1, y, note, va="center", fontsize=9)
  ax.set_yticks(range(len(names)), names)
  ax.set_xlabel("largest GPT that trained (billions of parameters)")
  ax.set_xlim(0, max(b["size"] for b in best.values()) * 1.9)
  ax.set_title("Largest model that trains on one GPU (seq 1024, full remat, micro-batch 8 "
               "unless marked)", fontsize=10)
  later = "".join(f", {system}: {when}" for _, system, when in LARGEST_SINCE)
  fig.text(0.01, 0.01, f"{MACHINE}; {date}{later}", fontsize=8)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  fig.savefig(os.path.join(out, "fig1_largest_model.png"), dpi=130)


def fig_throughput(records: list[dict], date: str, out: str) -> None:
  fig, ax = plt.subplots(figsize=(10, 5.5))
  by_system: dict[str, list[dict]] = {}
  for r in throughput_records(records):
    by_system.setdefault(r["system"], []).append(r)
  for system, rs in sorted(by_system.items()):
    color = COLORS.get(system, "gray")
    ok = sorted((size_b(r), r["tflops"], r.get("moments")) for r in rs if r["status"] == "ok")
    ax.plot([s for s, _, _ in ok], [t for _, t, _ in ok], "o-", color=color, label=system)
    for s, t, moments in ok:
      ax.annotate(f"{t:.0f}" + (" (bf16 moments)" if moments == "bf16" else ""), (s, t),
                  textcoords="offset points", xytext=(4, 6), fontsize=8, color=color)
    for r in rs:
      if r["status"] != "ok":
        ax.plot(size_b(r), 0, "x", color=color, markersize=10, mew=2)
        ax.annotate(f"{size_b(r):.2f}B: {FAILED.get(r['status'], r['status'])}", (size_b(r), 0),
                    textcoords="offset points", xytext=(-10, 12 + 12 * (system[0] == "D")),
                    fontsize=7, color=color, rotation=20)
  ax.set_xlabel("model size (billions of parameters)")
  ax.set_ylabel("model TFLOPS (6N + 12LDT per token)")
  ax.set_ylim(bottom=-20)
  ax.set_title("Throughput on one GPU against model size (x: did not train)", fontsize=11)
  ax.legend(loc="upper right", fontsize=9)
  ax.grid(alpha=0.3)
  fig.text(0.01, 0.01, f"{MACHINE}; seq 1024, micro-batch 8, full remat, bf16; {date}",
           fontsize=8)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  fig.savefig(os.path.join(out, "fig2_throughput.png"), dpi=130)


def fig_dpu(records: list[dict], date: str, out: str) -> None:
  sweep = [r for r in records if r.get("part") == "dpu" and "metrics" not in r]
  curves = [r for r in records if "metrics" in r]
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
  for system, style in (("jzo offload", "o-"), ("jzo offload + DPU", "s-")):
    rs = sorted((r for r in sweep if r["system"] == system), key=lambda r: r["batch"])
    left.plot([r["batch"] for r in rs], [r["step_s"] for r in rs], style,
              label=system.replace("jzo offload", "step") + ("" if "DPU" in system else ", no DPU"))
  rs = sorted((r for r in sweep if r["system"] == "jzo offload"), key=lambda r: r["batch"])
  left.plot([r["batch"] for r in rs], [r["device_step_s"] for r in rs], "k--", lw=1,
            label="device step alone")
  left.plot([r["batch"] for r in rs], [r["host_update_s"] for r in rs], "k:", lw=1,
            label="host update alone")
  left.set_xscale("log", base=2)
  left.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
  left.set_xlabel("micro-batch (sequences of 1024 tokens)")
  left.set_ylabel("seconds per step")
  left.set_ylim(bottom=0)
  model = sweep[0]["model"] if sweep else ""
  left.set_title(f"{model}, all optimizer state on the host", fontsize=10)
  left.legend(fontsize=9)
  left.grid(alpha=0.3)
  for r in curves:
    steps = [m["step"] for m in r["metrics"]]
    evals = [(m["step"], m["eval_loss"]) for m in r["metrics"] if "eval_loss" in m]
    right.plot(steps, [m["loss"] for m in r["metrics"]], lw=0.8, alpha=0.8,
               label=f"{r['system']} (held-out {evals[-1][1]:.3f} at step {evals[-1][0]})")
    right.plot(*zip(*evals), "o", ms=4, color=right.lines[-1].get_color())
  right.set_xlabel("step")
  right.set_ylabel("training loss (dots: held-out)")
  right.set_title("gpt2-124m, seq 512, batch 16, lr 6e-4, offload", fontsize=10)
  right.set_ylim(top=6)
  right.legend(fontsize=9)
  right.grid(alpha=0.3)
  fig.suptitle("Delayed parameter update (DPU): the host update overlaps the next device step",
               fontsize=11)
  fig.text(0.01, 0.01, f"{MACHINE}; {date}", fontsize=8)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  fig.savefig(os.path.join(out, "fig4_dpu.png"), dpi=130)


def scaling_records() -> dict[str, list[dict]]:
  """SCALING_RUNS' records by line of figure 3, each a list sorted by GPUs."""
  def read(path):
    with open(os.path.join(HERE, "results", path)) as f:
      data = json.load(f)
    return data["records"] if "records" in data else [data]
  runs = {name: [r for path in paths for r in read(path) if r["status"] == "ok"]
          for name, paths in SCALING_RUNS.items()}
  lines = {f"jzo stage {stage}, no offload": [r for r in runs["jzo"] if r["config"] == "device"
                                              and r["stage"] == stage] for stage in (1, 2, 3)}
  lines["jzo stage 2 offload + DPU"] = [r for r in runs["jzo"] if r["config"] == "offload_dpu"]
  lines["DeepSpeed ZeRO-2 offload"] = runs["deepspeed"]
  lines["DeepSpeed, torchrun's 1 OpenMP thread a process"] = runs["deepspeed, 1 thread"]
  return {name: sorted(rs, key=lambda r: r["gpus"]) for name, rs in lines.items()}


def fig_scaling(out: str) -> None:
  """Figure 3: tokens/s per GPU against GPU count, each line's 1-GPU point
  times the count being linear; the ratio to linear at each point, and
  jzo's to DeepSpeed's on the offload panel."""
  lines = scaling_records()
  fig, panels = plt.subplots(1, 2, figsize=(13, 5.2))
  styles = {"jzo stage 1, no offload": ("tab:olive", "o", "-"),
            "jzo stage 2, no offload": ("tab:green", "s", "-"),
            "jzo stage 3, no offload": ("tab:cyan", "^", "-"),
            "jzo stage 2 offload + DPU": ("tab:blue", "o", "-"),
            "DeepSpeed ZeRO-2 offload": ("tab:red", "s", "-"),
            "DeepSpeed, torchrun's 1 OpenMP thread a process": ("tab:red", "x", ":")}
  for ax, names, title in (
      (panels[0], [n for n in lines if "no offload" in n], "gpt2-1.5b (1.56B), no offload"),
      (panels[1], [n for n in lines if "no offload" not in n],
       "gpt2-13b (12.8B), all optimizer state on the host")):
    for name in names:
      rs = lines[name]
      if not rs:
        continue
      color, marker, style = styles[name]
      gpus = [r["gpus"] for r in rs]
      per_gpu = [r["tokens_per_s"] / r["gpus"] for r in rs]
      label = name
      if rs[0]["gpus"] == 1:
        ax.plot(gpus, [per_gpu[0]] * len(gpus), ls="--", lw=0.8, color=color, alpha=0.6)
        label += "\n" + ", ".join(f"{g} GPUs {v / per_gpu[0]:.3f}x"
                                  for g, v in zip(gpus[1:], per_gpu[1:])) + " linear"
      ax.plot(gpus, per_gpu, marker=marker, ls=style, color=color, label=label)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("GPUs (micro-batch 8 a GPU, seq 1024)")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_xticks([1, 2, 4])
    ax.set_xlim(0.7, 4.6)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    flops = PRESETS["gpt2-1.5b" if ax is panels[0] else "gpt2-13b"].flops_per_token()
    right = ax.secondary_yaxis("right", functions=(lambda t, f=flops: t * f / 1e12,
                                                   lambda x, f=flops: x * 1e12 / f))
    right.set_ylabel("model TFLOPS per GPU")
  jzo, ds = lines["jzo stage 2 offload + DPU"], lines["DeepSpeed ZeRO-2 offload"]
  for a, b in zip(jzo, ds):
    if a["gpus"] == b["gpus"]:
      panels[1].annotate(f"jzo {a['tokens_per_s'] / b['tokens_per_s']:.2f}x DeepSpeed",
                         (a["gpus"], a["tokens_per_s"] / a["gpus"]), textcoords="offset points",
                         xytext=(-20, -14), fontsize=8, color="tab:blue")
  fig.suptitle("Scaling over GPUs: tokens/s per GPU against linear (dashed: the 1-GPU point "
               "times the count)", fontsize=11)
  fig.text(0.01, 0.01, f"{SCALING_MACHINE}; jzo: one process over the GPUs; DeepSpeed: a "
           "process per GPU (torchrun)", fontsize=8)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  fig.savefig(os.path.join(out, "fig3_scaling.png"), dpi=130)


def fig_largest_per_gpus(out: str) -> None:
  """Figure 5: the largest GPT (gpt2-20b's layers, fp32 moments, micro-batch
  8 a GPU) the planner fits with offload on each GPU count, as trained: its
  parameters, model TFLOPS a GPU, and the host's and GPU's peaks against the
  plan's (the GPU's: its step's or its build's, whichever is more)."""
  rows = []
  for path, machine in LARGEST_PER_GPUS:
    with open(os.path.join(HERE, "results", path)) as f:
      (record,) = json.load(f)
    rows.append((record, record["trained"], machine))
  fig, ax = plt.subplots(figsize=(9, 5))
  xs = range(len(rows))
  sizes = [r["n_params"] / 1e9 for r, _, _ in rows]
  ax.bar(xs, sizes, 0.55, color="tab:blue", alpha=0.85, edgecolor="black", lw=0.5)
  for x, (record, run, machine) in zip(xs, rows):
    planned_gpu = max(run.get("planned_gpu_gib", 0), run.get("planned_build_gib", 0))  # step, build
    trained = (f"trained: {run['tflops']:.0f} model TFLOPS a GPU\n"
               f"host RSS {run['host_rss_peak_gib']:.1f} GiB (plan {run['planned_host_gib']:.1f})\n"
               f"GPU peak {run['peak_gpu_gib']:.1f} GiB (plan {planned_gpu:.1f})"
               if run["status"] == "ok" else FAILED.get(run["status"], run["status"]))
    ax.text(x, record["n_params"] / 1e9 + 0.8,
            f"{record['n_params'] / 1e9:.2f}B, {record['n_layer']} layers\n"
            f"{100 * run.get('offloaded_fraction', 1):.0f}% of the state on the host\n{trained}",
            ha="center", va="bottom", fontsize=8)
  ax.set_xticks(list(xs), [f"{r['gpus']} GPU{'s' * (r['gpus'] > 1)}\n{m}" for r, _, m in rows],
                fontsize=9)
  ax.set_ylabel("largest GPT trained (billions of parameters)")
  ax.set_ylim(0, max(sizes) * 1.45)
  ax.grid(axis="y", alpha=0.3)
  ax.set_title("Largest model per GPU count with offload: the planner's answer, trained",
               fontsize=11)
  fig.text(0.01, 0.01, "H200 141GB; gpt2-20b's layers (d_model 6144), ZeRO stage 3, offload "
           "'auto', fp32 moments, micro-batch 8 a GPU, seq 1024; jax 0.11.2; 2026-11-27",
           fontsize=8)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  fig.savefig(os.path.join(out, "fig5_largest_per_gpus.png"), dpi=130)


def fig_memory(out: str) -> None:
  """GPU and host bytes per parameter of MEMORY_RUNS (the largest micro-batch
  of each), planned against measured: the GPU's process peak against the
  planner's peak (its step, or its build where that is higher), the host's
  peak RSS against the planner's state plus the runtime it assumes."""
  rows = []
  for path, model in MEMORY_RUNS:
    with open(os.path.join(HERE, "results", path)) as f:
      data = json.load(f)
    r = max((r for r in (data if isinstance(data, list) else data["records"])
             if r.get("model") == model and r["status"] == "ok"), key=lambda r: r["batch"])
    per = lambda gib: gib * 2**30 / r["n_params"]
    grads_in_params = "grads" in path
    # Records from before offload_bench wrote the build's peak (sessions 6-7)
    # planned more for their steps than for their builds.
    planned_gpu = max(r["planned_gpu_gib"], r.get("planned_build_gib", 0))
    planned_host = r.get("planned_host_gib") or (r["planned_host_state_gib"]
                                                 + RUNTIME_PLANNED_THEN_GIB)
    label = (f"{model} ({r['n_params'] / 1e9:.1f}B), {r['moments']} moments,\n"
             f"{r['config']}{', grads in params' if grads_in_params else ''}, "
             f"micro-batch {r['batch']}")
    rows.append((label, per(planned_gpu), per(r["peak_gpu_gib"]), per(planned_host),
                 per(r["host_rss_peak_gib"])))
  fig, ax = plt.subplots(figsize=(10, 4.8))
  width = 0.2
  for k, (name, color, hatch) in enumerate((("GPU, planned", "tab:green", "//"),
                                            ("GPU, measured", "tab:green", ""),
                                            ("host, planned", "tab:blue", "//"),
                                            ("host, measured", "tab:blue", ""))):
    xs = [i + (k - 1.5) * width for i in range(len(rows))]
    values = [row[1 + k] for row in rows]
    ax.bar(xs, values, width, label=name, color=color, hatch=hatch,
           alpha=0.55 if hatch else 0.9, edgecolor="black", lw=0.5)
    for x, v in zip(xs, values):
      ax.text(x, v + 0.1, f"{v:.1f}", ha="center", fontsize=8)
  ax.set_xticks(range(len(rows)), [row[0] for row in rows], fontsize=8)
  ax.set_ylabel("bytes per parameter")
  ax.set_title("Memory per parameter on one GPU, the planner's against measured", fontsize=11)
  ax.legend(fontsize=9)
  ax.grid(axis="y", alpha=0.3)
  fig.text(0.01, 0.01, f"{MACHINE}; GPU: process peak; host: peak RSS", fontsize=8)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  fig.savefig(os.path.join(out, "fig_memory_per_param.png"), dpi=130)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--results", default=os.path.join(HERE, "results", "session6"))
  parser.add_argument("--out", default=os.path.join(HERE, "figures"))
  args = parser.parse_args()
  records, date = load(args.results)
  os.makedirs(args.out, exist_ok=True)
  fig_largest(records, date, args.out)
  fig_throughput(records, date, args.out)
  fig_dpu(records, date, args.out)
  fig_scaling(args.out)
  fig_largest_per_gpus(args.out)
  fig_memory(args.out)
  print("wrote", ", ".join(sorted(os.listdir(args.out))), "in", args.out)


if __name__ == "__main__":
  main()
