"""A checkpoint of a GPT whose optimizer state fills much of the host: save and
restore time, disk bytes, host memory while saving, and an exact restore.

Builds the preset (--model) at stage 3 with the optimizer state offloaded
(--offload true: all of it on the host; auto: what does not fit the device)
and moments of --moments, trains two steps, saves (jzo.checkpoint.save),
trains step 3 (its loss L), restores that checkpoint and runs step 3 again.
The restore is exact when step 3's loss is L again (the forward pass of the
restored weights) and a checksum of every master and moment (int8: codes and
scales), the sum of their bit patterns read span by span from the live state,
equals the one taken before the save.

Reported: save and restore seconds, the checkpoint's bytes on disk (GiB), and
the host RSS before and at its peak (sampled every 2 ms) while each runs. The
measurement is a process of its own: one the host kills leaves a point with
status "killed" (harness.run_child).

  python3 benchmarks/checkpoint_io.py --model gpt2-4b --moments fp32
  python3 benchmarks/checkpoint_io.py --model gpt2-10b --moments int8
  python3 benchmarks/checkpoint_io.py --model tiny --batch 2 --seq-len 32
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

MOMENT_DTYPES = {"fp32": None, "bf16": "bfloat16", "int8": "int8"}
SAVED = ("master", "mu", "nu", "mu_codes", "mu_scales", "nu_codes", "nu_scales")


def checksum(engine) -> dict[str, int]:
  """Per saved entry, the sum of the bit patterns of every value, read span by
  span from the live state (as a save reads it)."""
  import jax
  import numpy as np
  from jzo.checkpoint import spans
  saved = engine.state_dict(streamed=True)
  sums = {}
  for name in SAVED:
    if name in saved:
      total = 0
      for leaf in jax.tree.leaves(saved[name]):
        for _, row, x0, x1 in spans.rectangles(leaf.pieces.layout, leaf.dtype.itemsize):
          values = leaf.pieces.read(row, x0, x1, leaf.dtype)
          total += int(values.view(f"u{values.dtype.itemsize}").sum(dtype=np.uint64))
      sums[name] = total
  return sums


def sampled(fn) -> tuple[float, float, float]:
  """Runs fn; its seconds, and this process's RSS before and at its peak
  (GiB, sampled every 2 ms in a thread)."""
  before = peak = harness.host_rss_gib()
  done = threading.Event()

  def sample():
    nonlocal peak
    while not done.wait(0.002):
      peak = max(peak, harness.host_rss_gib())

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  start = time.perf_counter()
  try:
    fn()
  finally:
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
  return seconds, before, max(peak, harness.host_rss_gib())


def measure(args) -> dict:
  """Builds, trains, saves and restores; the point."""
  import jax
  import numpy as np
  from importlib import metadata
  import jzo
  from jzo import checkpoint
  from jzo.models import gpt
  from jzo.recipe.loop import claim_gpu_memory

  claim_gpu_memory()
  config = dataclasses.replace(gpt.PRESETS[args.model], seq_len=args.seq_len)
  jzo.plan.limit_pinned_pool(2 * config.n_params)
  dtype = MOMENT_DTYPES[args.moments]
  engine = jzo.ZeroEngine(functools.partial(gpt.loss_fn, config),
                          functools.partial(gpt.init_params, config, jax.random.PRNGKey(0)),
                          jzo.cpu_adamw(3e-4, weight_decay=0.1, mu_dtype=dtype, nu_dtype=dtype),
                          options=jzo.EngineOptions(stage=3, layers="blocks", max_grad_norm=1.0,
                                                    offload=True if args.offload == "true" else "auto"),
                          mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
                          activation_memory=gpt.activation_bytes(config, args.batch, args.seq_len))
  rng = np.random.default_rng(0)
  batches = [{"tokens": rng.integers(0, config.vocab_size, (args.batch, args.seq_len + 1),
                                     dtype=np.int32)} for _ in range(3)]
  for batch in batches[:2]:
    engine.step(batch)
  host = engine.plan.host_bytes()
  point = {"status": "ok", "model": args.model, "n_params": config.n_params,
           "moments": args.moments, "offload": args.offload,
           "on_device": round(1 - engine.plan.offloaded_fraction, 4),
           "host_state_gib": round((host["master"] + host["moments"]) / 2**30, 3),
           "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "orbax": metadata.version("orbax-checkpoint")}
  folder = pathlib.Path(args.dir) / "checkpoints"
  shutil.rmtree(folder, ignore_errors=True)
  before = checksum(engine)

  def record(name, fn):
    seconds, rss_before, rss_peak = sampled(fn)
    point.update({f"{name}_s": round(seconds, 2), f"rss_before_{name}_gib": round(rss_before, 2),
                  f"rss_peak_{name}_gib": round(rss_peak, 2),
                  f"rss_rise_{name}_gib": round(rss_peak - rss_before, 2)})

  with checkpoint.open_manager(folder) as manager:
    record("save", lambda: checkpoint.save(manager, engine, 2))
    point["disk_gib"] = round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
                              / 2**30, 3)
    loss = float(engine.step(batches[2]).loss)
    record("restore", lambda: checkpoint.restore(manager, engine, 2))
  point["checksums_equal"] = checksum(engine) == before
  again = float(engine.step(batches[2]).loss)
  point.update(loss_step3=loss, loss_step3_restored=again, losses_equal=loss == again,
               exact=loss == again and point["checksums_equal"])
  engine.close()
  shutil.rmtree(folder, ignore_errors=True)
  return point


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--model", default="gpt2-4b", help="a preset of jzo.models.gpt "
                      "(default: gpt2-4b)")
  parser.add_argument("--offload", default="true", choices=("true", "auto"),
                      help="true: all the optimizer state on the host; auto: what does not fit "
                           "the device (default: true)")
  parser.add_argument("--moments", default="fp32", choices=tuple(MOMENT_DTYPES),
                      help="the Adam moments' dtype (default: fp32)")
  parser.add_argument("--batch", type=int, default=8, help="sequences a step (default: 8)")
  parser.add_argument("--seq-len", type=int, default=1024, help="tokens a sequence "
                      "(default: 1024)")
  parser.add_argument("--dir", default="", help="where the checkpoint goes (default: a "
                      "temporary folder; the disk it is on is what is measured)")
  parser.add_argument("--timeout", type=float, default=1800, help="seconds the measurement "
                      "may take")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return harness.child_result(measure(args))
  temporary = not args.dir
  args.dir = args.dir or tempfile.mkdtemp(prefix="checkpoint-io-")
  cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dir", args.dir]
  for name in ("model", "offload", "moments", "batch", "seq_len"):
    cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
  try:
    [point] = harness.run_child(cmd, timeout_s=args.timeout)
  finally:
    if temporary:
      shutil.rmtree(args.dir, ignore_errors=True)
  point.update(model=args.model, moments=args.moments, offload=args.offload)
  if point["status"] == "ok":
    print(f"{args.model}, {args.moments} moments, {point['host_state_gib']} GiB of state on "
          f"the host: save {point['save_s']} s (RSS +{point['rss_rise_save_gib']} GiB), "
          f"{point['disk_gib']} GiB on disk, restore {point['restore_s']} s "
          f"(RSS +{point['rss_rise_restore_gib']} GiB); exact: {point['exact']}")
  else:
    print(f"{args.model}: {point['status']}: {' '.join(point['detail'])}")
  del args.child
  harness.write_record(args.json, "checkpoint_io", args, [point], with_devices=False)
  sys.exit(0 if point.get("exact") else 1)


if __name__ == "__main__":
  main()
