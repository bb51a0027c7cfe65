"""Generation speed: jzo's KV-cache decoding (jzo.models.decoding, what
`python -m jzo.generate` runs) against transformers' `generate`, on the same
random weights and GPU, in rounds taken in turn.

The model: one of benchmarks/peers_hf.py's shapes, made by transformers from
random weights in bfloat16 and saved, then read by jzo from that folder.
Each round times, for each system, a generation of --new-tokens tokens,
greedy, no stop token, each token's arrival on the host stamped: the
prefill's tokens/s is the prompt's length over the time to the first new
token, the decode's (new - 1) over the time from the first to the last. transformers runs with its static
cache (`cache_implementation="static"`, which its generate compiles with
torch.compile) and with its default dynamic cache. Reported: each system's
median and spread over the rounds, jzo's ratio to each, and the decode's
limit from memory bandwidth: tokens/s were every token to read the weights
once (bytes of the params) at the GPU's copy bandwidth, measured here.

  python3 benchmarks/generate_speed.py --shape llama-3.1-8b --prompt 2048 --new-tokens 256
  python3 benchmarks/generate_speed.py --shape llama-tiny --prompt 16 --new-tokens 8 \\
      --rounds 1 --caches dynamic  # CPU
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np

import harness
import peers_hf


def copy_bandwidth() -> float:
  """Bytes/s the default device copies (a read and a write of 2 GiB, or 64 MiB on a CPU)."""
  import jax
  import jax.numpy as jnp
  n = (2 << 30 if jax.default_backend() != "cpu" else 64 << 20) // 4
  x = jnp.ones(n, jnp.float32)
  copy = jax.jit(lambda x: x + 1)
  seconds = harness.timed(lambda: copy(x).block_until_ready(), repeats=5)
  return 2 * x.nbytes / seconds


def torch_model(shape: str, device: str):
  """transformers' model of a shape, random, bfloat16 on `device` (float32 on a CPU)."""
  import torch
  import transformers
  family, config = peers_hf.shape_config(shape)
  classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
  config_cls, model_cls = classes[family]
  dtype = torch.bfloat16 if device == "cuda" else torch.float32
  torch.manual_seed(0)
  default = torch.get_default_dtype()
  torch.set_default_dtype(dtype)  # the weights drawn in bfloat16 at once, not float32 first
  try:
    with torch.device(device):
      return model_cls(config_cls(**config)).eval()
  finally:
    torch.set_default_dtype(default)


def transformers_timer(model, prompt: np.ndarray, cache: str):
  """generate(n) -> (seconds to the first new token, seconds from it to the
  last) of transformers' generate, greedy, exactly n new tokens."""
  import torch
  ids = torch.from_numpy(prompt[None].astype(np.int64)).to(model.device)
  kwargs = {} if cache == "dynamic" else {"cache_implementation": cache}

  class Clock:  # generate's streamer: put() gets the prompt, then each new token
    def __init__(self):
      self.times = []

    def put(self, tokens):
      tokens.cpu()  # waits for the token
      self.times.append(time.perf_counter())

    def end(self):
      pass

  def generate(n: int) -> tuple[float, float]:
    clock = Clock()
    start = time.perf_counter()
    with torch.no_grad():
      out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0, streamer=clock, **kwargs)
    assert out.shape[1] == len(prompt) + n and len(clock.times) == n + 1, out.shape
    return clock.times[1] - start, clock.times[-1] - clock.times[1]
  return generate


def jzo_timer(folder: str, prompt: np.ndarray):
  """generate(n) as transformers_timer's, for jzo; and the params' bytes."""
  import jax
  import ml_dtypes
  from jzo.models import decoding, hf
  config, sources = hf.param_sources(folder)
  dtype = np.float32 if jax.default_backend() == "cpu" else ml_dtypes.bfloat16
  params = jax.tree.map(lambda leaf: jax.numpy.asarray(leaf.load().astype(dtype)), sources)
  generator = decoding.Generator(config, params)

  def generate(n: int) -> tuple[float, float]:
    start = time.perf_counter()
    times = [time.perf_counter() for _ in generator.stream([prompt.tolist()], n)]
    assert len(times) == n, len(times)
    return times[0] - start, times[-1] - times[0]
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  return generate, nbytes


def measure(args) -> list[dict]:
  import torch
  device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
  model = torch_model(args.shape, device)
  prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt)
  with tempfile.TemporaryDirectory() as folder:
    model.save_pretrained(folder)
    jzo_generate, nbytes = jzo_timer(folder, prompt)
  timers = {"jzo": jzo_generate}
  timers |= {f"transformers {cache} cache": transformers_timer(model, prompt, cache)
             for cache in args.caches}
  for generate in timers.values():  # compile and warm up, outside the rounds
    generate(args.new_tokens)
  rounds = {name: [] for name in timers}
  for _ in range(args.rounds):
    for name, generate in timers.items():
      first, rest = generate(args.new_tokens)
      rounds[name].append({"prefill_tokens_per_s": args.prompt / first,
                           "decode_tokens_per_s": (args.new_tokens - 1) / rest})
  bandwidth = copy_bandwidth()
  limit = bandwidth / nbytes
  import transformers
  points = []
  for name, measured in rounds.items():
    point = {"system": name, "status": "ok", "shape": args.shape, "prompt": args.prompt,
             "new_tokens": args.new_tokens, "device": device, "torch": torch.__version__,
             "transformers": transformers.__version__}
    for field in ("prefill_tokens_per_s", "decode_tokens_per_s"):
      values = [r[field] for r in measured]
      point[field] = statistics.median(values)
      point[field + "_rounds"] = values
    points.append(point)
  ours = points[0]
  ours.update(param_bytes=nbytes, copy_bandwidth_gb_s=bandwidth / 1e9,
              decode_limit_tokens_per_s=limit,
              decode_fraction_of_limit=ours["decode_tokens_per_s"] / limit)
  for peer in points[1:]:
    for field in ("prefill", "decode"):
      ratios = [a[f"{field}_tokens_per_s"] / b[f"{field}_tokens_per_s"]
                for a, b in zip(rounds["jzo"], rounds[peer["system"]])]
      ours[f"{field}_vs_{peer['system'].replace(' ', '_')}"] = harness.stats(ratios)
  return points


def main():
  parser = harness.parser(__doc__)
  parser.add_argument("--shape", default="llama-3.1-8b", choices=list(peers_hf.SHAPES))
  parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
  parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated")
  parser.add_argument("--rounds", type=int, default=3, help="rounds taken in turn")
  parser.add_argument("--caches", nargs="+", default=["static", "dynamic"],
                      choices=["static", "dynamic"], help="transformers' caches to time")
  parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda where there is one")
  args = parser.parse_args()
  points = measure(args)
  harness.write_record(args.json, "generate_speed", args, points)
  ours = points[0]
  for point in points:
    print(f"{point['system']:>28}: prefill {point['prefill_tokens_per_s']:9.1f} tokens/s, "
          f"decode {point['decode_tokens_per_s']:7.1f} tokens/s")
  print(f"decode limit from bandwidth ({ours['copy_bandwidth_gb_s']:.0f} GB/s over "
        f"{ours['param_bytes'] / 1e9:.2f} GB): {ours['decode_limit_tokens_per_s']:.1f} tokens/s; "
        f"jzo at {ours['decode_fraction_of_limit']:.2f} of it")
  for key, value in ours.items():
    if "_vs_" in key:
      print(f"jzo {key}: median {value['median']:.2f}x ({value['min']:.2f}-{value['max']:.2f})")
  sys.stdout.flush()


if __name__ == "__main__":
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
  # torch holds its copy of the model on the same GPU: JAX takes memory as it needs it.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  main()
