"""Can a running step wait on the host a layer at a time? (issue 23's
forward-first schedule: the next step's forward runs layer by layer as the
host update brings each layer's new weights up.)

A scan over --layers synthetic layers, each three bf16 matmuls over 32
sequences of 1024 (gpt2-10b's width: D 4096, 4D and 3D wide; about its
layer's forward FLOPs), whose weights come from host memory through a host
callback (`jax.experimental.io_callback`) that returns a layer only once a
host thread has marked it ready. Times, on one GPU (median of --repeats):

  device     the weights stacked on the device: the compute alone
  callback   each layer's weights from the callback, every layer ready
             (what the mechanism costs: its copy up and its wait)
  ahead      the same, the callback fetching the next layer while this one
             computes (if XLA overlaps them)
  signal     the callback only waits (it returns the layer's index), and the
             step fetches the layer from a stacked copy in pinned host memory
             (as jzo.scan_layers fetches offloaded weights)
  paced      each of `ahead` and `signal` while the host marks layer l ready
             at (l + 1) x --pace s, an update of --pace s a layer: the best
             end is one layer's compute after the last layer is ready

  python experiments/layer_wait_probe.py --layers 50 --pace 0.04
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import threading
import time


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=50)
  parser.add_argument("--pace", type=float, default=0.04, help="host seconds a layer")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--d-model", type=int, default=4096)
  parser.add_argument("--tokens", type=int, default=32 * 1024)
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp
  import ml_dtypes
  import numpy as np
  from jax.experimental import io_callback

  L, D = args.layers, args.d_model
  shapes = ((D, 3 * D), (D, 4 * D), (4 * D, D))
  # Distinct host buffers a layer, touched (np.full), as the host's new weights would be.
  host = [tuple(np.full(s, 0.01, ml_dtypes.bfloat16) for s in shapes) for _ in range(L)]
  ready = [threading.Event() for _ in range(L)]
  layer_bytes = sum(a.nbytes for a in host[0])

  def fetch(i):
    i = int(i)
    ready[i].wait()
    return host[i]

  out_shapes = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes)

  def layer(x, w):
    wq, w1, w2 = w
    return x + jax.nn.gelu(x @ w1) @ w2 + (x @ wq)[:, :D]

  @jax.jit
  def on_device(x, stacked):
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, stacked)[0]

  @jax.jit
  def by_callback(x):
    return jax.lax.scan(lambda x, i: (layer(x, io_callback(fetch, out_shapes, i)), None), x,
                        jnp.arange(L))[0]

  @jax.jit
  def ahead(x):
    def body(carry, i):
      x, w = carry
      nxt = io_callback(fetch, out_shapes, jnp.minimum(i + 1, L - 1))
      return (layer(x, w), nxt), None
    first = io_callback(fetch, out_shapes, 0)
    return jax.lax.scan(body, (x, first), jnp.arange(L))[0][0]

  def wait(i):
    ready[int(i)].wait()
    return np.int32(i)

  @jax.jit
  def by_signal(x, pinned):
    def body(x, i):
      j = io_callback(wait, jax.ShapeDtypeStruct((), jnp.int32), i)  # the fetch waits on it
      w = tuple(jax.device_put(jax.lax.dynamic_index_in_dim(p, j, 0, False),
                               jax.memory.Space.Device) for p in pinned)
      return layer(x, w), None
    return jax.lax.scan(body, x, jnp.arange(L))[0]

  x = jnp.full((args.tokens, D), 0.01, jnp.bfloat16)
  stacks = [np.stack([h[k] for h in host]) for k in range(3)]
  stacked = tuple(jnp.asarray(s) for s in stacks)
  in_pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  pinned = tuple(jax.device_put(s, in_pinned) for s in stacks)
  del stacks

  def timed(fn, pace=None):
    times = []
    for _ in range(args.repeats + 1):  # the first compiles
      for e in ready:  # paced: the thread below sets each; else all are ready now
        if pace:
          e.clear()
        else:
          e.set()
      start = time.perf_counter()
      if pace:
        def mark():
          for i, e in enumerate(ready):
            time.sleep(max(0.0, start + (i + 1) * pace - time.perf_counter()))
            e.set()
        threading.Thread(target=mark, daemon=True).start()
      jax.block_until_ready(fn())
      times.append(time.perf_counter() - start)
    return statistics.median(times[1:])

  results = {"device": timed(functools.partial(on_device, x, stacked))}
  del stacked  # the GPU's copy of every layer: the callbacks bring them up
  results["callback"] = timed(lambda: by_callback(x))
  results["ahead"] = timed(lambda: ahead(x))
  results["signal"] = timed(functools.partial(by_signal, x, pinned))
  results["ahead, paced"] = timed(lambda: ahead(x), pace=args.pace)
  results["signal, paced"] = timed(functools.partial(by_signal, x, pinned), pace=args.pace)
  per_layer = results["device"] / L
  print(json.dumps({"layers": L, "pace_s": args.pace, "layer_bytes": layer_bytes,
                    "gpu": jax.devices()[0].device_kind, "seconds": results}))
  print(f"{L} layers of {layer_bytes / 2**20:.0f} MiB; compute {1e3 * per_layer:.1f} ms a layer")
  for name, seconds in results.items():
    print(f"{name:<14} {seconds:7.3f} s  ({1e3 * seconds / L:6.1f} ms a layer)")
  print(f"paced: best {L * args.pace + per_layer:.3f} s (the last layer ready at "
        f"{L * args.pace:.2f} s, then its compute)")


if __name__ == "__main__":
  main()
