"""The loss through the head in chunks against all the logits at once:
time and XLA's temporaries of the loss's value and gradients (hidden states
and head) alone, for the shapes of a model's micro-batch, side by side.

  python experiments/loss_bench.py --case gpt2-10b:96x1024 llama-3.1-8b:4x4096 \
    llama-3.1-8b:8x4096 --json out.json

--chunk-bytes also times the chunks at other sizes of a chunk's float32
logits (cross_entropy.CHUNK_LOGITS_BYTES, 2**29 by default).
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from jzo.models import cross_entropy as ce
from jzo.recipe.models import PRESETS


def measure(n: int, d: int, vocab: int, chunk: int, repeats: int) -> dict:
  """Seconds (median of `repeats` after a warm-up) and compiled temporaries
  (GiB) of value_and_grad of the loss of n positions in chunks of `chunk`."""
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  hidden = jax.random.normal(k[0], (1, n, d), jnp.bfloat16)
  head = (0.02 * jax.random.normal(k[1], (vocab, d))).astype(jnp.bfloat16)
  targets = jax.random.randint(k[2], (1, n), 0, vocab)
  fn = jax.jit(jax.value_and_grad(lambda h, w: ce.cross_entropy(h, w, targets, chunk=chunk),
                                  (0, 1)))
  compiled = fn.lower(hidden, head).compile()
  temps = compiled.memory_analysis().temp_size_in_bytes / 2**30
  jax.block_until_ready(compiled(hidden, head))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(hidden, head))
    times.append(time.perf_counter() - start)
  return {"seconds": statistics.median(times), "temporaries_gib": temps}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--case", nargs="+", default=["gpt2-10b:96x1024", "llama-3.1-8b:4x4096"],
                      help="MODEL:BATCHxSEQ (a preset of jzo.models)")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--chunk-bytes", type=int, nargs="*", default=[],
                      help="other sizes of a chunk's float32 logits to time (bytes)")
  parser.add_argument("--json")
  args = parser.parse_args()
  results = []
  for case in args.case:
    name, shape = case.split(":")
    batch, seq = map(int, shape.split("x"))
    config = PRESETS[name].config
    n, d, vocab = batch * seq, config.d_model, config.vocab_size
    chunk = ce.chunk_tokens(vocab, n)
    row = {"case": case, "tokens": n, "d_model": d, "vocab": vocab, "chunk": chunk,
           "all": measure(n, d, vocab, n, args.repeats),
           "chunks": measure(n, d, vocab, chunk, args.repeats),
           "loss_bytes_gib": ce.loss_bytes(n, vocab, d) / 2**30,
           "device": jax.devices()[0].device_kind}
    row["speed_ratio"] = row["all"]["seconds"] / row["chunks"]["seconds"]
    default = ce.CHUNK_LOGITS_BYTES
    for size in args.chunk_bytes:
      ce.CHUNK_LOGITS_BYTES = size
      other = ce.chunk_tokens(vocab, n)
      row[f"chunks of {other}"] = measure(n, d, vocab, other, args.repeats)
    ce.CHUNK_LOGITS_BYTES = default
    print(json.dumps(row), flush=True)
    results.append(row)
  if args.json:
    json.dump(results, open(args.json, "w"), indent=1)


if __name__ == "__main__":
  main()
