"""The quality of jzo's Adam moments by dtype (issue 26): held-out and
training loss of gpt2-124m trained with fp32, bf16 and int8 moments, side by
side, from the metrics.jsonl files of `experiments/gpu_runs.sh moments-quality`.

  python experiments/plot_moments.py --results experiments/results/session12/run2-60e4e3f \\
      [--out experiments/figures/fig_moments_quality.png]

Reads moments-quality-{fp32,bf16,int8}.jsonl; prints the held-out loss at
each evaluation and the final one against fp32's.
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

HERE = os.path.dirname(os.path.abspath(__file__))
MOMENTS = {"fp32": "tab:blue", "bf16": "tab:orange", "int8": "tab:green"}


def read(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def smooth(values: list[float], window: int = 50) -> list[float]:
  """Trailing mean over `window` steps."""
  out, total = [], 0.0
  for i, v in enumerate(values):
    total += v - (values[i - window] if i >= window else 0.0)
    out.append(total / min(i + 1, window))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--results", default=os.path.join(HERE, "results", "session12", "run2-60e4e3f"))
  parser.add_argument("--out", default=os.path.join(HERE, "figures", "fig_moments_quality.png"))
  args = parser.parse_args()
  runs = {m: read(os.path.join(args.results, f"moments-quality-{m}.jsonl")) for m in MOMENTS}
  fig, (train, held_out) = plt.subplots(1, 2, figsize=(12, 4.5))
  for moments, color in MOMENTS.items():
    records = runs[moments]
    train.plot([r["step"] for r in records], smooth([r["loss"] for r in records]),
               color=color, label=f"{moments} moments")
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    held_out.plot(*zip(*evals), "o-", color=color, markersize=3, label=f"{moments} moments")
  final = {m: [r["eval_loss"] for r in runs[m] if "eval_loss" in r][-1] for m in MOMENTS}
  for moments, loss in final.items():
    print(f"{moments}: final held-out loss {loss:.4f} ({100 * (loss / final['fp32'] - 1):+.2f}% "
          "against fp32)")
  train.set(title="training loss (mean of 50 steps)", xlabel="step", ylabel="loss (nats/byte)")
  held_out.set(title="held-out loss", xlabel="step", ylabel="loss (nats/byte)")
  last = min(min(smooth([r["loss"] for r in runs[m]])) for m in MOMENTS)
  train.set_ylim(last - 0.05, last + 1.2)
  held_out.set_ylim(min(final.values()) - 0.05, min(final.values()) + 0.6)
  for ax in (train, held_out):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle("gpt2-124m, 2000 steps of 16 x 256 bytes, AdamW with the host kernel (offload), "
               "nvidia-h100-x1")
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
