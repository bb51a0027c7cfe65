"""A checkpoint of a GPT whose optimizer state fills much of the host: the
time, disk and host memory of saving and restoring it, and that it restores
exactly.

Builds the preset (stage 3, --offload True or auto, --moments), trains
two steps, saves (jzo.checkpoint.save), trains step 3 (its loss L), restores
the checkpoint and runs step 3 again: its loss must be L exactly (it is
the forward pass of the restored weights). A checksum of every master and
moment (the sum of their bit patterns) is compared before the save and
after the restore. Host RSS is sampled every 2 ms while each runs; the
running peak also goes to PEAK_FILE, so that a run the host kills still
leaves what it reached.

  python experiments/checkpoint_bench.py --model gpt2-4b --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import shutil
import sys
import threading
import time


class PeakRSS:
  """Samples this process's RSS in a thread while a `with` block runs."""

  def __init__(self, peak_file: pathlib.Path | None):
    import psutil
    self.process, self.peak_file = psutil.Process(), peak_file
    self.before = self.peak = 0

  def __enter__(self):
    self.before = self.peak = self.process.memory_info().rss
    self.done = threading.Event()
    self.thread = threading.Thread(target=self._sample, daemon=True)
    self.thread.start()
    return self

  def _sample(self):
    last_written = 0.0
    while not self.done.wait(0.002):
      self.peak = max(self.peak, self.process.memory_info().rss)
      if self.peak_file and time.monotonic() - last_written > 0.5:
        self.peak_file.write_text(str(self.peak))
        last_written = time.monotonic()

  def __exit__(self, *exc):
    self.done.set()
    self.thread.join()


def checksum(engine) -> dict[str, int]:
  """Per entry saved (master, mu, nu; int8 moments' codes and scales), the
  sum of the bit patterns of every value, read span by span from the live state."""
  import jax
  import numpy as np
  from jzo import state_spans
  saved = engine.state_dict(streamed=True)
  sums = {}
  for name in ("master", "mu", "nu", "mu_codes", "mu_scales", "nu_codes", "nu_scales"):
    if name not in saved:
      continue
    total = 0
    for leaf in jax.tree.leaves(saved[name]):
      layout = leaf.pieces.layout
      for _, row, x0, x1 in state_spans.rectangles(layout, leaf.dtype.itemsize):
        values = leaf.pieces.read(row, x0, x1, leaf.dtype)
        total += int(values.view(f"u{values.dtype.itemsize}").sum(dtype=np.uint64))
    sums[name] = total
  return sums


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-4b")
  parser.add_argument("--offload", default="true", choices=("true", "auto"))
  parser.add_argument("--moments", default="fp32", choices=("fp32", "bf16", "int8"))
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--dir", default="/tmp/checkpoint-bench")
  parser.add_argument("--no-check", action="store_true",
                      help="no checksums (a commit without jzo.state_spans)")
  parser.add_argument("--peak-file", default=None)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()

  import jax
  import numpy as np
  import jzo
  from jzo import checkpoint
  from jzo.models import gpt
  from jzo.recipe.loop import claim_gpu_memory

  claim_gpu_memory()
  moments = {"fp32": None, "bf16": "bfloat16", "int8": "int8"}[args.moments]
  config = dataclasses.replace(gpt.PRESETS[args.model], seq_len=args.seq_len)
  jzo.plan.limit_pinned_pool(2 * config.n_params)
  engine = jzo.ZeroEngine(
      functools.partial(gpt.loss_fn, config),
      functools.partial(gpt.init_params, config, jax.random.PRNGKey(0)),
      jzo.cpu_adamw(3e-4, weight_decay=0.1, mu_dtype=moments, nu_dtype=moments),
      stage=3, layers="blocks",
      mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)), max_grad_norm=1.0,
      offload=True if args.offload == "true" else "auto",
      activation_memory=gpt.activation_bytes(config, args.batch, args.seq_len))
  rng = np.random.default_rng(0)
  batches = [{"tokens": rng.integers(0, config.vocab_size, (args.batch, args.seq_len + 1),
                                     dtype=np.int32)} for _ in range(3)]
  for b in batches[:2]:
    engine.step(b)
  result = {"model": args.model, "n_params": config.n_params, "offload": args.offload,
            "moments": args.moments,
            "on_device": round(1 - engine.plan.offloaded_fraction, 4),
            "host_state_gib": round(sum(engine.plan.host_bytes()[k] for k in ("master", "moments"))
                                    / 2**30, 2)}
  peak_file = pathlib.Path(args.peak_file) if args.peak_file else None
  folder = pathlib.Path(args.dir)
  shutil.rmtree(folder, ignore_errors=True)
  before = None if args.no_check else checksum(engine)

  def measured(name: str, fn) -> None:
    """Runs fn, adding its seconds and host RSS (before, peak) to result."""
    with PeakRSS(peak_file) as rss:
      start = time.perf_counter()
      fn()
      result[f"{name}_s"] = round(time.perf_counter() - start, 2)
    result[f"rss_before_{name}_gib"] = round(rss.before / 2**30, 2)
    result[f"rss_peak_{name}_gib"] = round(rss.peak / 2**30, 2)

  with checkpoint.open_manager(folder) as manager:
    measured("save", lambda: checkpoint.save(manager, engine, 2))
    du = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    result["disk_gib"] = round(du / 2**30, 2)
    loss = float(engine.step(batches[2]).loss)
    measured("restore", lambda: checkpoint.restore(manager, engine, 2))
  if before is not None:
    result["checksums_equal"] = checksum(engine) == before
  again = float(engine.step(batches[2]).loss)
  result.update(loss_step3=loss, loss_step3_restored=again, losses_equal=loss == again)
  engine.close()
  shutil.rmtree(folder, ignore_errors=True)
  print(json.dumps(result))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result) + "\n")
  sys.exit(0 if result["losses_equal"] and result.get("checksums_equal", True) else 1)


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  main()
