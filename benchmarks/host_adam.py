"""The host AdamW step's throughput: jzo's kernel against torch, DeepSpeed and optax.

For 2^N float32 parameters (--sizes N ...) each system runs one AdamW step a
call in host memory (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01):

  jzo          jzo.kernels.adam_step_ on float32 gradients;
  engine-M     the same kernel as the offload engine runs it: bfloat16 gradients
               in, a bfloat16 copy of the new weights out, moments M (fp32, bf16
               or int8, jzo.kernels.quant8): 28, 20 and 16 bytes a parameter;
  torch        torch.optim.AdamW(fused=True) on CPU tensors;
  deepspeed    DeepSpeedCPUAdam(adamw_mode=True), skipped where DeepSpeed is not
               installed (its op is compiled on first use: a minute or two);
  optax        optax.adamw jitted on XLA's CPU backend, params and state donated.

Two ways to time them:

  turns (default)  every system of one size in one process, set up together,
                   taking turns for --rounds rounds of --steps timed steps, each
                   turn after 20 ms of untimed steps (the last system's worker
                   threads spin on the same CPUs for a while after its step), so
                   that a drift in the host's memory bandwidth hits all alike;
  --pairs P        each system in a process of its own, holding nothing else,
                   one after another, for P rounds in alternating order; a ratio
                   is taken within a round (side by side in time), and its
                   median and spread over the rounds is the figure. A process
                   times at least --steps steps and at least 1 s of them. By
                   default jzo against torch (--systems names others).

Reported: Gparam/s (1e9 parameters a second); GB/s at the bytes a step must
move (float32 grads and moments: read param, grad, mu, nu and write param, mu,
nu, 28 B; bfloat16 grads read 2 B and a 2-byte copy is written); and the ratios
jzo / torch, jzo / deepspeed, jzo / optax, engine-int8 / engine-fp32 and
engine-bf16 / engine-fp32 (parameters a second over parameters a second) of
the systems that ran: their median, spread and count over the rounds (in
turns also the ratio of the two systems' median steps, "of_medians"). Params and grads are random and non-zero, jzo's moments
too; the others' moments are made by their first (untimed) steps.

Every process is held to --threads CPUs (its affinity mask), and jzo and torch
(whose OpenMP threads DeepSpeed's op uses) run that many threads; XLA sizes its
pool from the mask. Holding all systems at 2^28 takes about 26 GB of RAM.

  python3 benchmarks/host_adam.py --sizes 24 28
  python3 benchmarks/host_adam.py --sizes 16 18 20 22 24 26 28 --pairs 9
  python3 benchmarks/host_adam.py --systems engine-int8 engine-fp32 --sizes 26 28 --pairs 5
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SYSTEMS = ("jzo", "engine-fp32", "engine-bf16", "engine-int8", "torch", "deepspeed", "optax")
RATIOS = (("jzo", "torch"), ("jzo", "deepspeed"), ("jzo", "optax"),
          ("engine-int8", "engine-fp32"), ("engine-bf16", "engine-fp32"))
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
WARMUP = 3  # untimed steps after set-up (the others' moments are made here)
WARM_IN_S = 0.02  # untimed steps at the start of each turn
MIN_SECONDS = 1.0  # a child times at least this long


def random_state(n: int, seed: int = 0):
  """Random, non-zero float32 param, grad, mu and nu (nu > 0), page-aligned,
  every page written; torch and DeepSpeed wrap the same kind of memory."""
  import numpy as np
  from jzo import kernels
  rng = np.random.default_rng(seed)

  def uniform(low, high):
    a = kernels.aligned_empty(n, np.float32)
    rng.random(dtype=np.float32, out=a)
    a *= high - low
    a += low
    return a

  return uniform(-1, 1), uniform(-1e-2, 1e-2), uniform(-1e-3, 1e-3), uniform(1e-8, 1e-6)


def jzo_system(n: int, moments: str | None):
  """jzo's kernel: (step, bytes a step). moments None: float32 grads, no copy
  out; else the engine's pass with moments of that dtype."""
  import ml_dtypes
  from jzo import kernels
  from jzo.kernels import quant8
  param, grad, mu, nu = random_state(n)
  lowp_out, nbytes = None, 28 * n
  if moments is not None:
    grad16 = kernels.aligned_empty(n, ml_dtypes.bfloat16)
    grad16[...] = grad
    grad = grad16
    lowp_out = kernels.aligned_empty(n, ml_dtypes.bfloat16)
    lowp_out.fill(1)  # every page touched before timing
    if moments == "bf16":
      mu, nu = mu.astype(ml_dtypes.bfloat16), nu.astype(ml_dtypes.bfloat16)
      nbytes -= 8 * n
    elif moments == "int8":
      mu, nu = quant8.quantize(mu, signed=True), quant8.quantize(nu, signed=False)
      nbytes = 16 * n + 2 * 2 * mu.scales.nbytes  # codes and scales read and written
  counts = itertools.count(1)

  def step():
    kernels.adam_step_(param, grad, mu, nu, learning_rate=LR, count=next(counts), b1=BETAS[0],
                       b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY, lowp_out=lowp_out)

  return step, nbytes


def torch_system(n: int, optimizer):
  import torch
  param_np, grad_np, _, _ = random_state(n)
  param = torch.nn.Parameter(torch.from_numpy(param_np))
  param.grad = torch.from_numpy(grad_np)
  return optimizer([param]).step, 28 * n


def deepspeed_optimizer():
  """DeepSpeedCPUAdam's constructor, or the reason it cannot run here."""
  if importlib.util.find_spec("deepspeed") is None:
    return None, "DeepSpeed is not installed"
  try:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])  # builds (or loads) its op
  except Exception as e:  # any failure inside DeepSpeed's import or build
    return None, f"{type(e).__name__}: {e}"
  return functools.partial(DeepSpeedCPUAdam, lr=LR, betas=BETAS, eps=EPS,
                           weight_decay=WEIGHT_DECAY, adamw_mode=True), None


def optax_system(n: int):
  import jax
  import optax
  cpu = jax.devices("cpu")[0]
  param_np, grad_np, _, _ = random_state(n)
  tx = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
  params = jax.device_put(param_np, cpu)
  carry = [params, tx.init(params)]
  grads = jax.device_put(grad_np, cpu)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def update(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def step():
    carry[:] = update(*carry, grads)
    jax.block_until_ready(carry)

  return step, 28 * n


def make_system(name: str, n: int, deepspeed=None):
  """`name`'s (step, bytes a step) on 2^log2 n parameters."""
  if name == "jzo" or name.startswith("engine-"):
    return jzo_system(n, name.partition("engine-")[2] or None)
  if name == "torch":
    import torch
    return torch_system(n, functools.partial(torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS,
                                             weight_decay=WEIGHT_DECAY, fused=True))
  if name == "deepspeed":
    return torch_system(n, deepspeed)
  return optax_system(n)


def use_threads(threads: int, systems) -> None:
  """Holds this process to `threads` CPUs, and jzo and torch to as many threads."""
  allowed = sorted(os.sched_getaffinity(0))
  if threads > len(allowed):
    raise SystemExit(f"--threads {threads}: only {len(allowed)} CPUs are available")
  os.sched_setaffinity(0, allowed[:threads])
  from jzo import kernels
  kernels.set_num_threads(threads)
  if {"torch", "deepspeed"} & set(systems):
    import torch
    torch.set_num_threads(threads)


def available(systems: list[str]) -> list[str]:
  """`systems` less those whose library is missing, each named on a line."""
  missing = {"torch": "torch", "deepspeed": "deepspeed", "optax": "optax"}
  kept = []
  for name in systems:
    lib = missing.get(name)
    if lib and importlib.util.find_spec(lib) is None:
      print(f"{name} skipped: {lib} is not installed", flush=True)
    else:
      kept.append(name)
  return kept


def rate_point(mode: str, name: str, log2_n: int, nbytes: int, seconds: list[float]) -> dict:
  median = statistics.median(seconds)
  return {"status": "ok", "mode": mode, "system": name, "log2_n": log2_n,
          "gparam_per_s": 2**log2_n / median / 1e9, "gb_per_s": nbytes / median / 1e9,
          "step_s": harness.stats(seconds)}


def ratio_points(mode: str, log2_n: int, rounds: list[dict[str, float]],
                 medians: dict[str, float] | None = None) -> list[dict]:
  """RATIOS of the systems in `rounds` (each: a system's step seconds in one
  round); with `medians` (each system's median step over all rounds) also
  their ratio, "of_medians"."""
  points = []
  for a, b in RATIOS:
    values = [r[b] / r[a] for r in rounds if a in r and b in r]
    if values:
      points.append({"status": "ok", "mode": mode, "ratio": f"{a} / {b}", "log2_n": log2_n,
                     **harness.stats(values), "values": values})
      if medians:
        points[-1]["of_medians"] = medians[b] / medians[a]
  return points


def turns(args) -> list[dict]:
  """Every system of each size in this process, taking turns."""
  systems = available(args.systems)
  use_threads(args.threads, systems)
  deepspeed = None
  if "deepspeed" in systems:
    deepspeed, reason = deepspeed_optimizer()
    if deepspeed is None:
      print(f"deepspeed skipped: {reason}", flush=True)
      systems.remove("deepspeed")
  points = []
  for log2_n in args.sizes:
    made = {name: make_system(name, 2**log2_n, deepspeed) for name in systems}
    for step, _ in made.values():
      for _ in range(WARMUP):
        step()
    rounds = []
    for r in range(args.rounds):
      order = systems[r % len(systems):] + systems[:r % len(systems)]
      times = {name: [] for name in order}
      for name in order:
        step = made[name][0]
        start = time.perf_counter()
        while time.perf_counter() - start < WARM_IN_S:
          step()
        for _ in range(args.steps):
          start = time.perf_counter()
          step()
          times[name].append(time.perf_counter() - start)
      rounds.append(times)
    seconds = {name: [t for r in rounds for t in r[name]] for name in systems}
    points += [rate_point("turns", name, log2_n, made[name][1], seconds[name])
               for name in systems]
    points += ratio_points("turns", log2_n, [{k: statistics.median(v) for k, v in r.items()}
                                             for r in rounds],
                           {k: statistics.median(v) for k, v in seconds.items()})
    del made
    gc.collect()
  return points


def child(args) -> None:
  """One system, one size, in this process: prints its median step."""
  use_threads(args.threads, [args.child])
  deepspeed = None
  if args.child == "deepspeed":
    deepspeed, reason = deepspeed_optimizer()
    if deepspeed is None:
      raise SystemExit(f"deepspeed: {reason}")
  step, nbytes = make_system(args.child, 2**args.sizes[0], deepspeed)
  for _ in range(WARMUP):
    step()
  times = []
  while len(times) < args.steps or sum(times) < MIN_SECONDS:
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  harness.child_result({"status": "ok", "system": args.child, "bytes": nbytes,
                        "step_s": statistics.median(times), "steps": len(times)})


def pairs(args) -> list[dict]:
  """Each system in a process of its own, in alternating order each round."""
  systems = available(args.systems)
  if "deepspeed" in systems and importlib.util.find_spec("torch") is None:
    print("deepspeed skipped: torch is not installed", flush=True)
    systems.remove("deepspeed")
  points = []
  for log2_n in args.sizes:
    rounds, seconds, nbytes = [], {name: [] for name in systems}, {}
    for r in range(args.pairs):
      this_round = {}
      for name in systems if r % 2 == 0 else systems[::-1]:
        print(f"2^{log2_n}, round {r + 1}/{args.pairs}: {name}", file=sys.stderr, flush=True)
        [result] = harness.run_child(
            [sys.executable, os.path.abspath(__file__), "--child", name, "--sizes", str(log2_n),
             "--threads", str(args.threads), "--steps", str(args.steps)], timeout_s=args.timeout)
        if result["status"] != "ok":
          points.append(dict(result, mode="processes", system=name, log2_n=log2_n))
          continue
        this_round[name] = result["step_s"]
        seconds[name].append(result["step_s"])
        nbytes[name] = result["bytes"]
      rounds.append(this_round)
    points += [rate_point("processes", name, log2_n, nbytes[name], seconds[name])
               for name in systems if seconds[name]]
    points += ratio_points("processes", log2_n, rounds)
  return points


def report(points: list[dict]) -> None:
  print(f"\n{'mode':<10} {'system':<12} {'N':>5} {'Gparam/s':>9} {'GB/s':>7}")
  for p in points:
    if "system" in p and p["status"] == "ok":
      print(f"{p['mode']:<10} {p['system']:<12} {'2^%d' % p['log2_n']:>5} "
            f"{p['gparam_per_s']:9.3f} {p['gb_per_s']:7.1f}")
    elif "system" in p:
      print(f"{p['mode']:<10} {p['system']:<12} {'2^%d' % p['log2_n']:>5} {p['status']}: "
            f"{' '.join(p.get('detail', []))[-200:]}")
  print(f"\n{'mode':<10} {'ratio':<28} {'N':>5} {'median':>7} {'min':>6} {'max':>6} {'>= 1':>9}"
        f" {'of medians':>10}")
  for p in points:
    if "ratio" in p:
      print(f"{p['mode']:<10} {p['ratio']:<28} {'2^%d' % p['log2_n']:>5} {p['median']:7.2f} "
            f"{p['min']:6.2f} {p['max']:6.2f} {sum(v >= 1 for v in p['values']):>3} of "
            f"{p['n']:<2} {p.get('of_medians', float('nan')):10.2f}")


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--systems", "--pair", nargs="+", choices=SYSTEMS, metavar="SYSTEM",
                      help="which systems, of: %(choices)s (default: all in turns, jzo and "
                           "torch with --pairs)")
  parser.add_argument("--sizes", type=int, nargs="+", default=[24, 28], metavar="N",
                      help="log2 of the parameter counts (default: 24 28)")
  parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                      help="CPUs (and threads) of every system (default: all this process may use)")
  parser.add_argument("--rounds", type=int, default=5, help="turns: rounds of turns (default: 5)")
  parser.add_argument("--steps", type=int, default=None,
                      help="timed steps a turn (default: 4), or at least this many a process "
                           "with --pairs (default: 50)")
  parser.add_argument("--pairs", type=int, default=0, metavar="P",
                      help="each system in a process of its own, P rounds (default: 0, turns)")
  parser.add_argument("--timeout", type=float, default=600, help="seconds a process may take")
  parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
  args = parser.parse_args()
  args.systems = list(dict.fromkeys(args.systems or (["jzo", "torch"] if args.pairs
                                                      else SYSTEMS)))
  if args.steps is None:
    args.steps = 50 if args.pairs or args.child else 4
  if args.child:
    return child(args)
  points = pairs(args) if args.pairs else turns(args)
  report(points)
  del args.child
  harness.write_record(args.json, "host_adam", args, points, with_devices=False)


if __name__ == "__main__":
  main()
