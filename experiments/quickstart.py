"""A first look at jzo: train a small MLP with jzo.cpu_adamw and with optax.adamw.

Fits y = sin(3x) + noise with a 3-layer MLP on the CPU, once with each
optimizer from the same initial weights and batches, and prints the loss
curves side by side. The two must agree to float32 rounding: cpu_adamw is a
drop-in for optax.adamw whose update runs in jzo's C++ kernel.

  python experiments/quickstart.py [--steps 300]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import jzo


def init_mlp(key, sizes=(1, 256, 256, 1)):
  keys = jax.random.split(key, len(sizes) - 1)
  return [{"w": jax.random.normal(k, (a, b)) / jnp.sqrt(a), "b": jnp.zeros((b,))}
          for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def mlp(params, x):  # x: (B, 1) -> (B, 1)
  for layer in params[:-1]:
    x = jax.nn.gelu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
  return jnp.mean((mlp(params, x) - y) ** 2)


def train(tx, params, steps, key):
  @jax.jit
  def step(params, state, key):
    x = jax.random.uniform(key, (256, 1), minval=-2, maxval=2)
    y = jnp.sin(3 * x) + 0.05 * jax.random.normal(jax.random.fold_in(key, 1), x.shape)
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state, losses = tx.init(params), []
  start = time.perf_counter()
  for i in range(steps):
    params, state, loss = step(params, state, jax.random.fold_in(key, i))
    losses.append(float(loss))  # host sync: fine for a demo
  return losses, (time.perf_counter() - start) / steps


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  args = parser.parse_args()
  params = init_mlp(jax.random.PRNGKey(0))
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, args.steps)
  runs = {
      "jzo.cpu_adamw": jzo.cpu_adamw(schedule, weight_decay=1e-4),
      "optax.adamw": optax.adamw(schedule, weight_decay=1e-4),
  }
  results = {name: train(tx, params, args.steps, jax.random.PRNGKey(1)) for name, tx in runs.items()}
  print(f"jzo kernel: {jzo.kernels.simd_level()}, {jzo.kernels.num_threads()} threads")
  print(f"{'step':>6} " + " ".join(f"{name:>15}" for name in results))
  for i in list(range(0, args.steps, max(1, args.steps // 10))) + [args.steps - 1]:
    print(f"{i:>6} " + " ".join(f"{losses[i]:>15.6f}" for losses, _ in results.values()))
  for name, (_, seconds) in results.items():
    print(f"{name}: {seconds * 1e3:.2f} ms/step")


if __name__ == "__main__":
  main()
