"""Can XLA stream a scanned stack of layers from pinned host memory, and
write each layer's gradient back over its weights there?

Three ways to run forward + backward of L residual MLP layers (T tokens,
width d, hidden f, bf16), timed side by side in one process:
  device:   the weights in device memory, a plain scan (the baseline);
  host:     the weights in pinned host memory, `device_put` to the device
            inside the scanned layer (JAX's parameter-offload pattern); the
            gradients come out in pinned host memory, a buffer of their own;
  in-place: the weights in pinned host memory, donated; a custom VJP whose
            backward reads layer i from the buffer and writes its gradient
            over it (the host buffer is the loop's carry);
  prefetch: in-place, with layer i + 1's weights (i - 1's going backward)
            fetched while layer i computes (carried to the next iteration),
            and going backward layer i + 1's gradient written while layer
            i computes (as jzo.scan_layers does).
Prints JSON lines: time per step, the compiled memory analysis, the largest
difference of the gradients from the baseline's.

  python experiments/param_offload_probe.py [--layers 16 --tokens 8192 16384]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def layer(x, w):
  w1, w2 = w
  return x + jax.nn.gelu(x @ w1) @ w2


def on_device(w):
  return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), w)


def on_host(w):
  return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Host), w)


def loss_device(ws, x):
  body = jax.checkpoint(lambda c, w: (layer(c, w), None))
  return jnp.sum(jax.lax.scan(body, x, ws)[0].astype(jnp.float32))


def loss_host(ws, x):
  body = jax.checkpoint(lambda c, w: (layer(c, on_device(w)), None))
  return jnp.sum(jax.lax.scan(body, x, ws)[0].astype(jnp.float32))


@jax.custom_vjp
def scan_in_place(x, ws):
  return jax.lax.scan(lambda c, w: (layer(c, on_device(w)), None), x, ws)[0]


def _fwd(x, ws):
  out, inputs = jax.lax.scan(lambda c, w: (layer(c, on_device(w)), c), x, ws)
  return out, (inputs, ws)


def _bwd(saved, d_out):
  inputs, ws = saved
  n = ws[0].shape[0]

  def one(j, acc):
    d, buf = acc
    i = n - 1 - j
    w = on_device(jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, i, 0, False), buf))
    x = jax.lax.dynamic_index_in_dim(inputs, i, 0, False)
    _, vjp = jax.vjp(layer, x, w)
    d, dw = vjp(d)
    buf = jax.tree.map(lambda b, g: jax.lax.dynamic_update_index_in_dim(b, g, i, 0),
                       buf, on_host(dw))
    return d, buf
  d, grads = jax.lax.fori_loop(0, n, one, (d_out, ws))
  return d, grads


scan_in_place.defvjp(_fwd, _bwd)


def loss_in_place(ws, x):
  return jnp.sum(scan_in_place(x, ws).astype(jnp.float32))


def _row(buf, i):
  return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, i, 0, False), buf)


@jax.custom_vjp
def scan_prefetch(x, ws):
  return _fwd_prefetch(x, ws)[0]


def _fwd_prefetch(x, ws):
  """Layer i runs on weights fetched in iteration i - 1; iteration i fetches
  layer i + 1's (the last fetches a copy of the last: never used)."""
  n = ws[0].shape[0]

  def body(carry, i):
    c, w = carry
    nxt = on_device(_row(ws, jnp.minimum(i + 1, n - 1)))
    return (layer(c, w), nxt), c
  (out, _), inputs = jax.lax.scan(body, (x, on_device(_row(ws, 0))), jnp.arange(n))
  return out, (inputs, ws)


def _bwd_prefetch(saved, d_out):
  """Iteration i writes layer i + 1's gradient (carried) over its weights,
  then fetches layer i - 1's weights from the buffer so written: a read of
  the buffer before its in-place write makes XLA copy it whole."""
  inputs, ws = saved
  n = ws[0].shape[0]

  def one(j, acc):
    d, buf, w, pending = acc
    i = n - 1 - j
    buf = jax.tree.map(
        lambda b, g: jax.lax.dynamic_update_index_in_dim(b, g, jnp.minimum(i + 1, n - 1), 0),
        buf, on_host(pending))
    nxt = on_device(_row(buf, jnp.maximum(i - 1, 0)))
    x = jax.lax.dynamic_index_in_dim(inputs, i, 0, False)
    _, vjp = jax.vjp(layer, x, w)
    d, dw = vjp(d)
    return d, buf, nxt, dw
  last = on_device(_row(ws, n - 1))
  d, grads, _, pending = jax.lax.fori_loop(0, n, one, (d_out, ws, last, last))
  grads = jax.tree.map(lambda b, g: jax.lax.dynamic_update_index_in_dim(b, g, 0, 0),
                       grads, on_host(pending))
  return d, grads


scan_prefetch.defvjp(_fwd_prefetch, _bwd_prefetch)


def loss_prefetch(ws, x):
  return jnp.sum(scan_prefetch(x, ws).astype(jnp.float32))


def timed(fn, make_args, reps=5):
  out = fn(*make_args())
  jax.block_until_ready(out)
  times = []
  for _ in range(reps):
    args = make_args()
    jax.block_until_ready(args)
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times)), out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=16)
  ap.add_argument("--width", type=int, default=4096)
  ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
  ap.add_argument("--hlo-dir", default=None, help="write each compiled step's HLO here")
  args = ap.parse_args()
  L, d, f = args.layers, args.width, 4 * args.width
  dev = jax.devices()[0]
  s_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  s_host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  key = jax.random.key(0)
  w0 = (jax.random.normal(key, (L, d, f), jnp.bfloat16) * 0.02,
        jax.random.normal(jax.random.fold_in(key, 1), (L, f, d), jnp.bfloat16) * 0.02)
  w_host = jax.device_put(w0, s_host)
  nbytes = sum(a.nbytes for a in w0)
  print(json.dumps({"device": str(dev), "jax": jax.__version__, "layers": L, "width": d,
                    "weights_gb": nbytes / 1e9}), flush=True)

  for T in args.tokens:
    x = jax.random.normal(jax.random.fold_in(key, 2), (T, d), jnp.bfloat16)
    flops = 3 * 2 * T * 2 * d * f * L + 2 * T * 2 * d * f * L  # fwd + bwd + recompute
    grad_dev = jax.jit(jax.grad(loss_device), out_shardings=s_dev)
    grad_host = jax.jit(jax.grad(loss_host), out_shardings=s_host)
    grad_inplace = jax.jit(jax.grad(loss_in_place), donate_argnums=0, out_shardings=s_host)
    grad_prefetch = jax.jit(jax.grad(loss_prefetch), donate_argnums=0, out_shardings=s_host)
    results = {}
    for name, fn, make in (
        ("device", grad_dev, lambda: (w0, x)),
        ("host", grad_host, lambda: (w_host, x)),
        ("in-place", grad_inplace, lambda: (jax.device_put(w0, s_host), x)),
        ("prefetch", grad_prefetch, lambda: (jax.device_put(w0, s_host), x))):
      row = {"tokens": T, "variant": name}
      try:
        compiled = fn.lower(*make()).compile()
        m = compiled.memory_analysis()
        row.update(arg_gb=m.argument_size_in_bytes / 1e9, out_gb=m.output_size_in_bytes / 1e9,
                   temp_gb=m.temp_size_in_bytes / 1e9, alias_gb=m.alias_size_in_bytes / 1e9,
                   host_arg_gb=getattr(m, "host_argument_size_in_bytes", 0) / 1e9,
                   host_out_gb=getattr(m, "host_output_size_in_bytes", 0) / 1e9,
                   host_temp_gb=getattr(m, "host_temp_size_in_bytes", 0) / 1e9)
        hlo = compiled.as_text()
        if args.hlo_dir:
          with open(f"{args.hlo_dir}/{name}_{T}.hlo", "w") as fh:
            fh.write(hlo)
        row["hlo_copy_start"] = hlo.count("copy-start")
        row["hlo_host_ds"] = hlo.count("S(5)")
        seconds, out = timed(fn, make)
        row.update(seconds=seconds, tflops=flops / seconds / 1e12,
                   memory_kind=out[0].sharding.memory_kind)
        results[name] = [np.asarray(jax.device_put(g, s_dev), np.float32) for g in out]
        ref = results.get("device")
        if ref is not None and name != "device":
          row["max_rel_diff"] = max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))
                                    for a, b in zip(results[name], ref))
        stats = dev.memory_stats() or {}
        row["gpu_peak_gb"] = stats.get("peak_bytes_in_use", 0) / 1e9
      except Exception as e:  # record the failure and go on to the next variant
        row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
      print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
