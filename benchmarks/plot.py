"""Draws the published figures from the benchmarks' JSON records.

  python3 benchmarks/plot.py [--records benchmarks/records] [--out docs/figures]

Each figure reads the records named beside it (RECORDS:
--records/NAME.json, as harness.write_record writes them) and is written as
--out/NAME.png; a figure whose records are missing is skipped, said so.
  largest-model     the largest GPT each system trained on one GPU
                    (largest-model, throughput, gpt2-20b)
  throughput        model TFLOPS against model size on one GPU, and what did
                    not train (throughput, largest-model)
  delayed-update    step time with and without the delayed update against the
                    micro-batch, and the loss of two runs (delayed-update)
  scaling           tokens/s a GPU over GPU counts against linear (scaling)
  largest-per-gpus  the largest GPT the planner fits per GPU count, trained
                    (largest-per-gpus)
  planner-memory    GPU and host bytes a parameter, planned against measured
                    (planner-memory)
  moments-quality   held-out and training loss with fp32, bf16 and int8 Adam
                    moments (moments-quality)
Model TFLOPS count 6 N + 12 L D T a token (recomputation not counted).
"""

from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

import harness  # noqa: E402

RECORDS = {"largest-model": ("largest-model", "throughput", "gpt2-20b"),
           "throughput": ("throughput", "largest-model"),
           "delayed-update": ("delayed-update",),
           "scaling": ("scaling",),
           "largest-per-gpus": ("largest-per-gpus",),
           "planner-memory": ("planner-memory",),
           "moments-quality": ("moments-quality",)}
COLORS = {"jzo offload auto + DPU": "tab:blue", "jzo offload + DPU": "tab:cyan",
          "jzo stage 3 offload, grads in params": "tab:purple", "jzo, no offload": "tab:green",
          "PyTorch alone": "tab:orange", "DeepSpeed ZeRO-2 offload": "tab:red"}
FAILED = {"oom": "GPU out of memory", "killed": "killed: host out of memory",
          "refused": "refused by jzo's planner", "timeout": "no result in time"}


def footer(record: dict) -> str:
  """The machine, versions and date of a record, in a line."""
  m, point = record["machine"], next(iter(record["points"]), {})
  device = m.get("device") or point.get("device", "")
  parts = [m.get("name", ""), f"{m.get('devices', point.get('gpus', 1))} x {device}"]
  if "cores" in m:
    parts.append(f"{m['cores']}-core host, {m['host_ram_gib']} GiB")
  parts += [f"{k} {m[k]}" for k in ("jax", "torch", "deepspeed") if k in m]
  return "; ".join(p for p in parts if p) + f"; {m.get('date', '')[:10]}"


def save(fig, record: dict, path: str, extra: str = "") -> None:
  fig.text(0.01, 0.01, footer(record) + extra, fontsize=8)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  fig.savefig(path, dpi=130)
  plt.close(fig)


def size_b(p: dict) -> float:
  return p["n_params"] / 1e9


def label(p: dict) -> str:
  return p["system"] + (f", {p['moments']} moments" if p.get("moments") in ("bf16", "int8")
                        else "")


def micro_batch_8(*records: dict) -> list[dict]:
  """The single-GPU figures' points at micro-batch 8 (not gpt2-20b's 32)."""
  return [p for r in records for p in r["points"] if p.get("batch", 8) == 8]


def fig_largest_model(largest: dict, throughput: dict, gpt2_20b: dict, path: str) -> None:
  best, failed = {}, {}
  for p in (p for r in (largest, throughput, gpt2_20b) for p in r["points"]):
    if p["system"] == "jzo offload + DPU":  # all on the host: not searched for its largest
      continue
    key = label(p)
    if p["status"] == "ok" and (size_b(p), p["tflops"]) > best.get(key, (0, 0))[:2]:
      best[key] = (size_b(p), p["tflops"], p)
    elif p["status"] != "ok":
      failed.setdefault(key, []).append((size_b(p), FAILED.get(p["status"], p["status"])))
  names = sorted(best, key=lambda k: best[k][0])
  fig, ax = plt.subplots(figsize=(10, 4.8))
  for y, name in enumerate(names):
    size, tflops, p = best[name]
    ax.barh(y, size, color=COLORS.get(p["system"], "gray"),
            alpha=0.6 if p.get("moments") == "bf16" else 1)
    note = f"{size:.2f}B at {tflops:.0f} TFLOPS"
    note += f" (micro-batch {p['batch']})" if p["batch"] != 8 else ""
    above = sorted(f for f in failed.get(name, []) if f[0] > size)
    note += f"; {above[0][0]:.2f}B: {above[0][1]}" if above else ""
    ax.text(size + 0.1, y, note, va="center", fontsize=9)
  ax.set_yticks(range(len(names)), names)
  ax.set_xlabel("largest GPT that trained (billions of parameters)")
  ax.set_xlim(0, max(b[0] for b in best.values()) * 1.9)
  ax.set_title("The largest model that trains on one GPU (seq 1024, full remat, micro-batch 8 "
               "unless marked)", fontsize=10)
  save(fig, largest, path, f"; gpt2-20b {gpt2_20b['machine'].get('date', '')[:10]}")


def fig_throughput(throughput: dict, largest: dict, path: str) -> None:
  fig, ax = plt.subplots(figsize=(10, 5.5))
  systems: dict[str, list[dict]] = {}
  for p in micro_batch_8(throughput, largest):
    systems.setdefault(p["system"], []).append(p)
  for system, points in sorted(systems.items()):
    color = COLORS.get(system, "gray")
    ok = sorted((size_b(p), p["tflops"], p.get("moments")) for p in points if p["status"] == "ok")
    ax.plot([s for s, _, _ in ok], [t for _, t, _ in ok], "o-", color=color, label=system)
    for s, t, moments in ok:
      ax.annotate(f"{t:.0f}" + (" (bf16 moments)" if moments == "bf16" else ""), (s, t),
                  textcoords="offset points", xytext=(4, 6), fontsize=8, color=color)
    for p in (p for p in points if p["status"] != "ok"):
      ax.plot(size_b(p), 0, "x", color=color, markersize=10, mew=2)
      ax.annotate(f"{size_b(p):.2f}B: {FAILED.get(p['status'], p['status'])}", (size_b(p), 0),
                  textcoords="offset points", xytext=(-10, 12 + 12 * (system[0] == "D")),
                  fontsize=7, color=color, rotation=20)
  ax.set_xlabel("model size (billions of parameters)")
  ax.set_ylabel("model TFLOPS (6N + 12LDT per token)")
  ax.set_ylim(bottom=-20)
  ax.set_title("Throughput on one GPU against model size (x: did not train)", fontsize=11)
  ax.legend(loc="upper right", fontsize=9)
  ax.grid(alpha=0.3)
  save(fig, throughput, path, "; seq 1024, micro-batch 8, full remat, bf16")


def fig_delayed_update(record: dict, path: str) -> None:
  sweep = [p for p in record["points"] if "metrics" not in p and p["status"] == "ok"]
  curves = [p for p in record["points"] if "metrics" in p]
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
  by_batch = lambda system: sorted((p for p in sweep if p["system"] == system),
                                   key=lambda p: p["batch"])
  for system, style, name in (("jzo offload", "o-", "step, no DPU"),
                              ("jzo offload + DPU", "s-", "step, DPU")):
    points = by_batch(system)
    left.plot([p["batch"] for p in points], [p["step_s"] for p in points], style, label=name)
  alone = [p for p in by_batch("jzo offload") if "device_step_s" in p]
  left.plot([p["batch"] for p in alone], [p["device_step_s"] for p in alone], "k--", lw=1,
            label="device step alone")
  left.plot([p["batch"] for p in alone], [p["host_update_s"] for p in alone], "k:", lw=1,
            label="host update alone")
  batches = sorted({p["batch"] for p in sweep})
  left.set_xscale("log", base=2)
  left.set_xticks(batches, [str(b) for b in batches])
  left.set_xlabel("micro-batch (sequences)")
  left.set_ylabel("seconds per step")
  left.set_ylim(bottom=0)
  left.set_title(f"{sweep[0]['model'] if sweep else ''}, all optimizer state on the host",
                 fontsize=10)
  left.legend(fontsize=9)
  left.grid(alpha=0.3)
  for p in curves:
    steps = [m["step"] for m in p["metrics"]]
    evals = [(m["step"], m["eval_loss"]) for m in p["metrics"] if "eval_loss" in m]
    name = p["system"] + (f" (held-out {evals[-1][1]:.3f} at step {evals[-1][0]})" if evals
                          else "")
    right.plot(steps, [m["loss"] for m in p["metrics"]], lw=0.8, alpha=0.8, label=name)
    if evals:
      right.plot(*zip(*evals), "o", ms=4, color=right.lines[-1].get_color())
  right.set_xlabel("step")
  right.set_ylabel("training loss (dots: held-out)")
  right.set_title("gpt2-124m, seq 512, batch 16, lr 6e-4, offload", fontsize=10)
  right.legend(fontsize=9)
  right.grid(alpha=0.3)
  fig.suptitle("Delayed parameter update (DPU): the host update overlaps the next device step",
               fontsize=11)
  save(fig, record, path)


def scaling_lines(record: dict) -> dict[str, list[dict]]:
  """The scaling figure's lines, each sorted by GPU count."""
  ok = [p for p in record["points"] if p["status"] == "ok"]
  lines = {f"jzo stage {s}, no offload": [p for p in ok if p["system"] == "jzo, no offload"
                                          and p["stage"] == s] for s in (1, 2, 3)}
  lines["jzo stage 2 offload + DPU"] = [p for p in ok if p["system"] == "jzo offload + DPU"]
  for system in sorted({p["system"] for p in ok if p["system"].startswith("DeepSpeed")}):
    lines[system] = [p for p in ok if p["system"] == system]
  return {name: sorted(points, key=lambda p: p["gpus"]) for name, points in lines.items()}


def fig_scaling(record: dict, path: str) -> None:
  """Tokens/s a GPU against the GPU count, each line's 1-GPU point times the
  count being linear (dashed)."""
  lines = scaling_lines(record)
  fig, panels = plt.subplots(1, 2, figsize=(13, 5.2))
  colors = {"jzo stage 1, no offload": "tab:olive", "jzo stage 2, no offload": "tab:green",
            "jzo stage 3, no offload": "tab:cyan", "jzo stage 2 offload + DPU": "tab:blue"}
  for ax, offload in zip(panels, (False, True)):
    names = [n for n in lines if lines[n] and ("no offload" not in n) == offload]
    for name in names:
      points = lines[name]
      gpus = [p["gpus"] for p in points]
      per_gpu = [p["tokens_per_s"] / p["gpus"] for p in points]
      color = colors.get(name, "tab:red")
      text = name
      if gpus[0] == 1:
        ax.plot(gpus, [per_gpu[0]] * len(gpus), ls="--", lw=0.8, color=color, alpha=0.6)
        text += "\n" + ", ".join(f"{g} GPUs {v / per_gpu[0]:.3f}x"
                                 for g, v in zip(gpus[1:], per_gpu[1:])) + " linear"
      ax.plot(gpus, per_gpu, marker="x" if "thread" in name else "o",
              ls=":" if "thread" in name else "-", color=color, label=text)
    model = lines[names[0]][0] if names else {}
    ax.set_title(f"{model.get('model', '')} ({model.get('n_params', 0) / 1e9:.2f}B), "
                 + ("all optimizer state on the host" if offload else "no offload"), fontsize=10)
    ax.set_xlabel("GPUs (micro-batch 8 a GPU, seq 1024)")
    ax.set_ylabel("tokens/s per GPU")
    counts = sorted({p["gpus"] for n in names for p in lines[n]})
    ax.set_xticks(counts)
    if counts:
      ax.set_xlim(counts[0] - 0.3, counts[-1] + 0.6)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
  jzo, ds = lines["jzo stage 2 offload + DPU"], lines.get("DeepSpeed ZeRO-2 offload", [])
  for a in jzo:
    for b in (b for b in ds if b["gpus"] == a["gpus"]):
      panels[1].annotate(f"jzo {a['tokens_per_s'] / b['tokens_per_s']:.2f}x DeepSpeed",
                         (a["gpus"], a["tokens_per_s"] / a["gpus"]), textcoords="offset points",
                         xytext=(-20, -14), fontsize=8, color="tab:blue")
  fig.suptitle("Scaling over GPUs: tokens/s per GPU against linear (dashed: the 1-GPU point "
               "times the count)", fontsize=11)
  save(fig, record, path, "; jzo: one process over the GPUs; DeepSpeed: a process a GPU")


def fig_largest_per_gpus(record: dict, path: str) -> None:
  """The largest GPT the planner fits with offload on each GPU count, as
  trained, a bar for each dtype of the Adam moments: its parameters, model
  TFLOPS a GPU, and the host's and GPU's peaks against the plan's (the
  GPU's: its step's or its build's)."""
  points = record["points"]
  counts = sorted({p["gpus"] for p in points})
  moments = list(dict.fromkeys(p.get("moments", "fp32") for p in points))
  width = 0.8 / len(moments)
  fig, ax = plt.subplots(figsize=(min(3 + 2.5 * len(counts) * len(moments) ** 0.5, 12), 5.5))
  sizes = [size_b(p) for p in points]
  for k, dtype in enumerate(moments):
    for p in (p for p in points if p.get("moments", "fp32") == dtype):
      x = counts.index(p["gpus"]) + (k - (len(moments) - 1) / 2) * width
      ax.bar(x, size_b(p), width * 0.9, color=f"C{k}", alpha=0.85, edgecolor="black", lw=0.5,
             label=f"{dtype} moments" if p["gpus"] == min(counts) else None)
      run = p.get("trained", {"status": "not run"})
      trained = (f"{run['tflops']:.0f} TFLOPS a GPU\n"
                 f"host {run['host_rss_peak_gib']:.0f} GiB ({run['planned_host_gib']:.0f})\n"
                 f"GPU {run['peak_gpu_gib']:.1f} GiB "
                 f"({max(run['planned_gpu_gib'], run.get('planned_build_gib', 0)):.1f})"
                 if run["status"] == "ok" else FAILED.get(run["status"], run["status"]))
      ax.text(x, size_b(p) + max(sizes) * 0.02,
              f"{size_b(p):.2f}B\n{p['n_layer']} layers\n{trained}",
              ha="center", va="bottom", fontsize=7)
  ax.set_xticks(range(len(counts)), [f"{n} GPU{'s' * (n > 1)}" for n in counts], fontsize=9)
  ax.set_ylabel("largest GPT trained (billions of parameters)")
  ax.set_ylim(0, max(sizes, default=1) * 1.6)
  ax.grid(axis="y", alpha=0.3)
  ax.legend(loc="upper left", fontsize=8)
  base = points[0] if points else {}
  ax.set_title("The largest model per GPU count with offload: the planner's answer, trained\n"
               f"({base.get('base', '')}'s layers, stage 3, micro-batch {base.get('batch', '')} "
               "a GPU; in brackets: the plan)", fontsize=10)
  save(fig, record, path)


def fig_planner_memory(record: dict, path: str) -> None:
  """GPU and host bytes a parameter of each run, planned against measured
  (the GPU's plan: its step's peak or its build's, whichever is more)."""
  rows = [p for p in record["points"] if p["status"] == "ok" and p.get("peak_gpu_gib")
          and p.get("planned_host_gib")]
  planned_gpu = lambda p: max(p["planned_gpu_gib"], p.get("planned_build_gib", 0))
  bars = (("GPU, planned", planned_gpu, "tab:green", "//"),
          ("GPU, measured", lambda p: p["peak_gpu_gib"], "tab:green", ""),
          ("host, planned", lambda p: p["planned_host_gib"], "tab:blue", "//"),
          ("host, measured", lambda p: p["host_rss_peak_gib"], "tab:blue", ""))
  fig, ax = plt.subplots(figsize=(12, 5))
  width = 0.2
  for k, (name, gib, color, hatch) in enumerate(bars):
    xs = [i + (k - 1.5) * width for i in range(len(rows))]
    values = [gib(p) * 2**30 / p["n_params"] for p in rows]
    ax.bar(xs, values, width, label=name, color=color, hatch=hatch,
           alpha=0.55 if hatch else 0.9, edgecolor="black", lw=0.5)
    for x, v in zip(xs, values):
      ax.text(x, v + 0.1, f"{v:.1f}", ha="center", fontsize=7)
  names = [p.get("run") or f"{p['model']}, {p['moments']}, {p['grad_accum']} x {p['batch']}"
           for p in rows]
  ax.set_xticks(range(len(rows)), [f"{n}\n{p.get('machine', '')}" for n, p in zip(names, rows)],
                fontsize=7)
  ax.set_ylabel("bytes per parameter")
  ax.set_title("Memory per parameter, the planner's against measured (GPU: the process's peak; "
               "host: peak RSS)", fontsize=11)
  ax.legend(fontsize=9)
  ax.grid(axis="y", alpha=0.3)
  save(fig, record, path)


def fig_moments_quality(record: dict, path: str) -> None:
  """Held-out loss (left) and training loss, a trailing mean of 50 steps
  (right), of one run a moment dtype."""
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
  colors = {"fp32": "tab:blue", "bf16": "tab:orange", "int8": "tab:green"}
  for p in (p for p in record["points"] if p["status"] == "ok"):
    color = colors.get(p["moments"], "gray")
    against = p.get("against_fp32_pct")
    left.plot(p["eval_steps"], p["eval_loss"], "o-", ms=3, color=color,
              label=p["moments"] + (f" ({against:+.2f}% against fp32 at the end)"
                                    if against is not None and p["moments"] != "fp32" else ""))
    losses, window = p["train_loss"], 50
    mean = [sum(losses[max(0, i - window + 1):i + 1]) / min(i + 1, window)
            for i in range(len(losses))]
    right.plot(p["steps"], mean, lw=0.9, color=color, label=p["moments"])
  left.set_title("held-out loss", fontsize=10)
  right.set_title("training loss, mean of the last 50 steps", fontsize=10)
  for ax in (left, right):
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats a byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
  fig.suptitle("Adam moments in fp32, bf16 and int8, all on the host: the loss side by side",
               fontsize=11)
  save(fig, record, path)


DRAW = {"largest-model": fig_largest_model, "throughput": fig_throughput,
        "delayed-update": fig_delayed_update, "scaling": fig_scaling,
        "largest-per-gpus": fig_largest_per_gpus, "planner-memory": fig_planner_memory,
        "moments-quality": fig_moments_quality}


def main():
  here = os.path.dirname(os.path.abspath(__file__))
  figures = os.path.normpath(os.path.join(here, "..", "docs", "figures"))
  parser = harness.parser(__doc__)
  parser.add_argument("--records", default=os.path.join(here, "records"),
                      help="the folder of NAME.json records")
  parser.add_argument("--out", default=figures,
                      help="the folder of the PNGs")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  drawn = []
  for name, draw in DRAW.items():
    paths = [os.path.join(args.records, f"{r}.json") for r in RECORDS[name]]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
      print(f"{name}: skipped, no {', '.join(missing)}", file=sys.stderr)
      continue
    draw(*map(harness.read_record, paths), os.path.join(args.out, f"{name}.png"))
    drawn.append(name)
  print(f"drew {', '.join(drawn) or 'nothing'} in {args.out}")
  if args.json:
    harness.write_record(args.json, "plot", args, [{"status": "ok", "figure": name}
                                                   for name in drawn], with_devices=False)


if __name__ == "__main__":
  main()
