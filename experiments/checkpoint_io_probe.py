"""Where a checkpoint's time goes: tensorstore alone writing and reading
float32 arrays shaped like Adam state (masters ~N(0, 0.02), first moments
~N(0, 1e-4), second moments 1e-8 * chi-square) the way jzo.state_spans does,
in chunks of SPAN_BYTES with SPANS_IN_FLIGHT at once, as zarr with orbax's
compressor (zstd, level 1) and with none; and the disk's own write speed
(`dd` of zeros with fdatasync, after the page cache is dropped where allowed).

  python experiments/checkpoint_io_probe.py --gib 8 --dir /tmp/probe

Prints GiB/s of each and the bytes on disk. The arrays are made once, before
any timing; the folder is removed after each case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import time

import numpy as np
import tensorstore as ts

from jzo.state_spans import SPAN_BYTES, SPANS_IN_FLIGHT


def adam_like(gib: float, seed: int = 0) -> list[np.ndarray]:
  """Three float32 arrays (master, mu, nu) of gib / 3 GiB each."""
  rng = np.random.default_rng(seed)
  n = int(gib * 2**30 / 4 / 3) // (SPAN_BYTES // 4) * (SPAN_BYTES // 4)
  master = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
  mu = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-4)
  nu = np.square(rng.standard_normal(n, dtype=np.float32)) * np.float32(1e-8)
  return [master, mu, nu]


def spec(path: str, n: int, compressor) -> dict:
  return {"driver": "zarr", "kvstore": {"driver": "file", "path": path},
          "metadata": {"shape": [n], "chunks": [SPAN_BYTES // 4], "dtype": "<f4",
                       "compressor": compressor}}


async def write(arrays, folder: str, compressor) -> None:
  limit = asyncio.Semaphore(SPANS_IN_FLIGHT)
  loop = asyncio.get_running_loop()
  writes = []
  for k, a in enumerate(arrays):
    store = await ts.open(ts.Spec(spec(f"{folder}/{k}", a.size, compressor)), create=True,
                          delete_existing=True)
    for lo in range(0, a.size, SPAN_BYTES // 4):
      await limit.acquire()
      w = store[lo:lo + SPAN_BYTES // 4].write(a[lo:lo + SPAN_BYTES // 4])
      w.add_done_callback(lambda _: loop.call_soon_threadsafe(limit.release))
      writes.append(w)
  for w in writes:
    await w


async def read(arrays, folder: str, compressor) -> None:
  """Reads every chunk back (SPANS_IN_FLIGHT ahead) and checks it."""
  for k, a in enumerate(arrays):
    store = await ts.open(ts.Spec(spec(f"{folder}/{k}", a.size, compressor)), open=True)
    step = SPAN_BYTES // 4
    starts = list(range(0, a.size, step))
    for i in range(0, len(starts), SPANS_IN_FLIGHT):
      batch = starts[i:i + SPANS_IN_FLIGHT]
      got = await asyncio.gather(*(store[lo:lo + step].read() for lo in batch))
      for lo, g in zip(batch, got):
        if not np.array_equal(g, a[lo:lo + step]):
          raise SystemExit(f"chunk at {lo} of array {k} reads back different")


def drop_page_cache() -> bool:
  try:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")
    return True
  except OSError:
    return False


def disk_bytes(folder: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--gib", type=float, default=4.0, help="GiB of state (three arrays)")
  parser.add_argument("--dir", default="/tmp/checkpoint-io-probe")
  parser.add_argument("--json", help="also write the results here")
  args = parser.parse_args()
  arrays = adam_like(args.gib)
  total = sum(a.nbytes for a in arrays)
  results = {"state_gib": total / 2**30, "cpus": os.cpu_count(), "spans_in_flight": SPANS_IN_FLIGHT,
             "span_mib": SPAN_BYTES / 2**20}
  dd = f"{args.dir}-dd"
  os.makedirs(args.dir, exist_ok=True)
  start = time.perf_counter()
  subprocess.run(["dd", "if=/dev/zero", f"of={dd}", "bs=64M", f"count={max(1, total // 2**26)}",
                  "conv=fdatasync"], check=True, capture_output=True)
  results["dd_write_gib_s"] = total / 2**30 / (time.perf_counter() - start)
  os.remove(dd)
  for name, compressor in [("zstd1", {"id": "zstd", "level": 1}), ("none", None)]:
    shutil.rmtree(args.dir, ignore_errors=True)
    start = time.perf_counter()
    asyncio.run(write(arrays, args.dir, compressor))
    os.sync()
    wrote = time.perf_counter() - start
    dropped = drop_page_cache()
    start = time.perf_counter()
    asyncio.run(read(arrays, args.dir, compressor))
    results[name] = {"write_gib_s": total / 2**30 / wrote, "read_gib_s":
                     total / 2**30 / (time.perf_counter() - start),
                     "disk_over_state": disk_bytes(args.dir) / total,
                     "read_after_dropping_the_page_cache": dropped}
    print(name, json.dumps(results[name]), flush=True)
  shutil.rmtree(args.dir, ignore_errors=True)
  print(json.dumps(results))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
