"""Throughput of host (CPU) AdamW steps: jzo against torch, optax/XLA and DeepSpeed.

For N fp32 parameters, each system performs one AdamW step per call
(lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01) in host memory:

  * jzo fp32:       jzo.kernels.adam_step_ on numpy arrays, fp32 gradients;
  * jzo bf16 grad + bf16 out, M moments: as the offload engine runs it, bf16
                    gradients in and a bf16 copy of the new weights out (lowp_out),
                    with fp32, bf16 or int8 (jzo.quant8) moments: 28, 20 and 16
                    bytes a parameter;
  * torch fused:    torch.optim.AdamW(fused=True) on CPU tensors;
  * torch foreach:  torch.optim.AdamW(foreach=True);
  * DeepSpeed:      DeepSpeedCPUAdam(adamw_mode=True), skipped if unavailable;
                    its op is JIT-compiled on first use (a minute or two);
and, on the XLA CPU backend, one jitted function per step, called with the
params and state donated ("donated") or not:
  * jzo cpu_adamw:  the optax drop-in as users call it, `tx.update(grads,
                    state, params)` then `optax.apply_updates`;
  * jzo adamw_step: `jzo.adamw_step(tx, grads, state, params)`, the in-place
                    variant for loops that own their step;
  * optax.adamw:    the same user loop as the drop-in, with optax.adamw.
torch rows are skipped where torch is not installed.

Reported: parameters updated per second (Gparam/s, 1e9 params/s) and memory
traffic in GB/s (1e9 bytes/s) counting 28 bytes per parameter, the minimum a
fused step moves:

  * fp32 gradients: read param, grad, mu, nu (4 x 4 B), write param, mu, nu (3 x 4 B);
  * bf16 gradients: read param (4), grad (2), mu (4), nu (4), write param, mu,
    nu (12) and the bf16 weights (2).

The optax contract moves more: the update leaves `tx.update` and is added in
`apply_updates`. jzo's drop-in moves 36 bytes (the kernel reads grad, mu, nu
and writes mu, nu: 20; XLA reads param, mu, nu and writes param in
apply_updates' loop: 16); optax.adamw 40 (mu, nu and the update in three XLA
loops). Without donation XLA also writes every output to a fresh buffer, and
copies the moments the kernel updates in place first. The ratios the issue
names (12, and 26: jzo fp32 against torch's fused AdamW, int8 moments against
fp32 ones) are printed after the table. `--systems kernel` runs jzo's rows and
torch's fused AdamW only.

Each is the median of `--rounds` x `--steps` timed steps after WARMUP untimed
ones, each turn's after `--warm-in` ms of untimed steps. All systems of one
size are set up together and take turns, round after round, so that a drift
in the host's memory bandwidth (a VM shares it with other tenants) hits them
alike; the ratios are then side by side in time.
Holding all of them needs about 26 GB of RAM at N = 2^28.
Params and grads are random and non-zero; jzo's moments start random, the
others' are created (zero) by their optimizer on the first step, so every
buffer is touched and non-zero before timing.

The ceiling is the multi-threaded host copy bandwidth measured in the same
run: jzo.kernels.parallel_copy (4 MiB chunks, non-temporal stores, so the
destination is not read first) of a `--copy-gib` buffer, counting bytes read
plus bytes written.

The process is restricted to `--threads` CPUs (its affinity mask), and jzo and
torch are set to that many threads (DeepSpeed's op runs on torch's OpenMP
threads); XLA sizes its CPU thread pool from the mask.

  python experiments/cpu_adam_bench.py --sizes 24 28 --json results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import time
from importlib import metadata
from typing import Callable

import jax
import ml_dtypes
import numpy as np
import optax

import jzo
from jzo import kernels, quant8

try:
  import torch
except ImportError:  # the torch and DeepSpeed rows are skipped
  torch = None

BYTES_PER_PARAM = 28
WARMUP = 3
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
JZO_FP32 = "jzo fp32"  # the reference row
# The offload engine's pass: bf16 gradients in, bf16 weights out, by moment dtype.
JZO_ENGINE = {m: f"jzo bf16 grad + bf16 out, {m} moments" for m in ("fp32", "bf16", "int8")}
TORCH_FUSED = "torch AdamW fused"
DROP_IN, DROP_IN_DONATED = "jzo cpu_adamw", "jzo cpu_adamw donated"
OPTAX, OPTAX_DONATED = "optax.adamw", "optax.adamw donated"
ADAMW_STEP_DONATED = "jzo adamw_step donated"
# (system, against, target) of issue 12; None: reported, no target.
RATIOS = [(DROP_IN_DONATED, OPTAX_DONATED, 1.0), (DROP_IN_DONATED, JZO_FP32, 0.65),
          (DROP_IN, OPTAX, 0.9), (ADAMW_STEP_DONATED, JZO_FP32, None),
          (ADAMW_STEP_DONATED, OPTAX_DONATED, None), (DROP_IN + " eager", OPTAX + " eager", None),
          (JZO_FP32, TORCH_FUSED, 1.0),  # issue 26
          (JZO_ENGINE["int8"], JZO_ENGINE["fp32"], 1.2), (JZO_ENGINE["bf16"], JZO_ENGINE["fp32"], None)]


@dataclasses.dataclass
class Result:
  system: str
  n: int | None  # parameters per step; None for the copy row
  times: list[float]  # seconds of each timed step (or copy)
  bytes_moved: int  # per step: BYTES_PER_PARAM * n, or read + written for the copy

  @property
  def seconds(self) -> float:
    return statistics.median(self.times)

  @property
  def gparams(self) -> float | None:
    return None if self.n is None else self.n / self.seconds / 1e9

  @property
  def gbytes(self) -> float:
    return self.bytes_moved / self.seconds / 1e9


@dataclasses.dataclass
class System:
  """One optimizer set up on its own buffers: `step()` runs one update."""
  name: str
  step: Callable[[], object]
  bytes_moved: int


def random_state(n: int, seed: int) -> tuple[np.ndarray, ...]:
  """Random, non-zero fp32 param, grad, mu and nu (nu > 0), all pages written.

  Page-aligned, like torch's and XLA's own buffers: numpy would start them 16
  bytes into a cache line. torch and DeepSpeed wrap the same memory.
  """
  rng = np.random.default_rng(seed)

  def uniform(low, high):
    a = kernels.aligned_empty(n, np.float32)
    rng.random(dtype=np.float32, out=a)
    a *= high - low
    a += low
    return a

  return uniform(-1, 1), uniform(-1e-2, 1e-2), uniform(-1e-3, 1e-3), uniform(1e-8, 1e-6)


def jzo_system(n: int, *, engine_moments: str | None = None) -> System:
  """jzo's kernel on fp32 gradients (engine_moments None), or as the offload
  engine runs it: bf16 gradients, the new weights written out in bf16, and
  moments of the given dtype ("fp32", "bf16" or "int8", made from the
  same random values)."""
  param, grad, mu, nu = random_state(n, seed=0)
  lowp_out = None
  bytes_moved = BYTES_PER_PARAM * n
  if engine_moments is not None:
    grad_bf16 = kernels.aligned_empty(n, ml_dtypes.bfloat16)
    grad_bf16[...] = grad
    grad = grad_bf16
    lowp_out = kernels.aligned_empty(n, ml_dtypes.bfloat16)
    lowp_out.fill(1)  # touch every page before timing
    if engine_moments == "bf16":
      mu, nu = mu.astype(ml_dtypes.bfloat16), nu.astype(ml_dtypes.bfloat16)
      bytes_moved -= 8 * n
    elif engine_moments == "int8":
      mu, nu = quant8.quantize(mu, signed=True), quant8.quantize(nu, signed=False)
      bytes_moved = 16 * n + 2 * 2 * mu.scales.nbytes  # the codes 1 + 1 read and written
  steps = itertools.count(1)

  def step():
    kernels.adam_step_(param, grad, mu, nu, learning_rate=LR, count=next(steps),
                       b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY,
                       lowp_out=lowp_out)

  return System(JZO_ENGINE[engine_moments] if engine_moments else JZO_FP32, step, bytes_moved)


def torch_system(n: int, *, impl: str) -> System:
  """torch.optim.AdamW with impl 'fused' or 'foreach'; moments created on the first step."""
  param_np, grad_np, _, _ = random_state(n, seed=0)
  param = torch.nn.Parameter(torch.from_numpy(param_np))
  param.grad = torch.from_numpy(grad_np)
  opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                          **{impl: True})
  return System(TORCH_FUSED if impl == "fused" else f"torch AdamW {impl}", opt.step, BYTES_PER_PARAM * n)


def named_system(name: str, n: int) -> System:
  """A system by the short name the side-by-side scripts use: "jzo" (the fp32
  kernel), "torch" (fused AdamW) or "engine-M" (the kernel as the engine runs
  it, moments M: fp32, bf16 or int8)."""
  if name == "torch":
    return torch_system(n, impl="fused")
  return jzo_system(n, engine_moments=name.partition("engine-")[2] or None)


def optax_contract_step(tx, params, state, grads):
  """The user loop of the optax contract: the update, then apply_updates."""
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def adamw_step(tx, params, state, grads):
  return jzo.adamw_step(tx, grads, state, params)


def xla_system(name: str, n: int, tx: optax.GradientTransformation, step_fn, mode: str) -> System:
  """`step_fn(tx, params, state, grads)` on the XLA CPU backend; mode 'donated'
  (jitted, params and state donated), 'jit' (jitted) or 'eager' (op by op).
  Moments are zero until the warm-up steps."""
  cpu = jax.devices("cpu")[0]
  param_np, grad_np, _, _ = random_state(n, seed=0)
  carry = [jax.device_put(param_np, cpu)]
  grads = jax.device_put(grad_np, cpu)
  carry.append(tx.init(carry[0]))
  del param_np, grad_np
  update = functools.partial(step_fn, tx)
  if mode != "eager":
    update = jax.jit(update, donate_argnums=(0, 1) if mode == "donated" else ())

  def step():
    carry[:] = update(*carry, grads)
    jax.block_until_ready(carry)

  return System(name if mode == "jit" else f"{name} {mode}", step, BYTES_PER_PARAM * n)


def xla_systems(n: int) -> list[System]:
  """The optax drop-in, adamw_step and optax.adamw, with and without donation
  (and the two optax-contract loops eagerly, as the issue measured them)."""
  def jzo_tx():
    return jzo.cpu_adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)

  def optax_tx():
    return optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)

  return [xla_system(name, n, make_tx(), step_fn, mode)
          for name, make_tx, step_fn, modes in (
              (DROP_IN, jzo_tx, optax_contract_step, ("donated", "jit", "eager")),
              ("jzo adamw_step", jzo_tx, adamw_step, ("donated", "jit")),
              (OPTAX, optax_tx, optax_contract_step, ("donated", "jit", "eager")))
          for mode in modes]


def load_deepspeed_adam():
  """DeepSpeedCPUAdam, or the reason it cannot be used here."""
  if torch is None:
    return None, "torch is not installed"
  try:
    from deepspeed.ops.adam import DeepSpeedCPUAdam
  except Exception as e:  # ImportError, or any failure inside DeepSpeed's import
    return None, f"import failed: {type(e).__name__}: {e}"
  try:  # builds (or loads the cached) JIT op; small so a failure costs little
    DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])
  except Exception as e:
    return None, f"op build failed: {type(e).__name__}: {e}"
  return DeepSpeedCPUAdam, None


def deepspeed_system(n: int, optimizer_cls) -> System:
  param_np, grad_np, _, _ = random_state(n, seed=0)
  param = torch.nn.Parameter(torch.from_numpy(param_np))
  param.grad = torch.from_numpy(grad_np)
  opt = optimizer_cls([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                      adamw_mode=True)
  return System("DeepSpeedCPUAdam", opt.step, BYTES_PER_PARAM * n)


def copy_system(gib: float) -> System:
  """parallel_copy of a `gib` GiB buffer; bytes read + written."""
  src = np.full(int(gib * 2**30), 1, np.uint8)
  dst = np.full_like(src, 2)
  return System(f"parallel_copy {gib:g} GiB", lambda: kernels.parallel_copy(dst, src),
                2 * src.nbytes)


def measure(systems: list[System], n: int | None, rounds: int, steps: int,
            warm_in: float = 0.0) -> list[Result]:
  """Times every system in `rounds` rounds of `steps` steps each, after WARMUP.

  The systems take turns (in a rotated order each round), so a drift of the
  host's memory bandwidth, shared with other tenants, hits all of them alike.
  Each turn starts with untimed steps for `warm_in` seconds (at least one
  step where it is > 0): the last system's worker threads spin on the CPUs
  for a while after its step (torch's OpenMP ones for milliseconds), and on
  the GPU machines' Xeon jzo's first two steps at 2^20 after torch's ran 5-6x
  slower than its later ones (turns_probe.py, session 44).
  """
  for system in systems:
    for _ in range(WARMUP):
      system.step()
  times = {s.name: [] for s in systems}
  for r in range(rounds):
    for system in systems[r % len(systems):] + systems[:r % len(systems)]:
      start = time.perf_counter()
      while warm_in > 0 and time.perf_counter() - start < warm_in:
        system.step()
      for _ in range(steps):
        start = time.perf_counter()
        system.step()
        times[system.name].append(time.perf_counter() - start)
  results = [Result(s.name, n, times[s.name], s.bytes_moved) for s in systems]
  for r in results:
    print(f"  {r.system:<28} {r.seconds * 1e3:9.2f} ms/step (median; "
          f"min {min(r.times) * 1e3:.2f}, max {max(r.times) * 1e3:.2f})", flush=True)
  return results


def lscpu() -> dict[str, str]:
  """lscpu's fields by name ({} where lscpu is missing)."""
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return {}
  return dict((k.strip(), v.strip()) for k, _, v in
              (line.partition(":") for line in out.splitlines()))


def package_version(name: str) -> str:
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return "not installed"


def machine_info(threads: int) -> dict:
  cpu = lscpu()
  cores = int(cpu.get("Core(s) per socket", 0)) * int(cpu.get("Socket(s)", 0))
  return {
      "cpu": cpu.get("Model name", platform.processor() or "unknown"),
      "cores": cores or None,
      "cpus": os.cpu_count(),
      "threads": threads,
      "simd_level": kernels.simd_level(),
      "torch_threads": torch.get_num_threads() if torch is not None else None,
      "python": platform.python_version(),
      **{name: package_version(name) for name in
         ("jzo", "jax", "jaxlib", "optax", "numpy", "torch", "deepspeed")},
  }


def use_threads(threads: int) -> None:
  """Restricts the process to `threads` CPUs and sets every library to use them."""
  allowed = sorted(os.sched_getaffinity(0))
  if threads > len(allowed):
    raise SystemExit(f"--threads {threads}: only {len(allowed)} CPUs are available")
  os.sched_setaffinity(0, allowed[:threads])
  kernels.set_num_threads(threads)
  if torch is not None:
    torch.set_num_threads(threads)  # also DeepSpeed's op, which runs on torch's OpenMP


def print_table(results: list[Result], copy: Result) -> list[dict]:
  """Prints the results table; returns its rows as dicts (for --json)."""
  jzo_rate = {r.n: r.gparams for r in results if r.system == JZO_FP32}
  header = (f"{'system':<28} {'N':>5} {'Gparam/s':>9} {'GB/s':>7} "
            f"{'vs jzo fp32':>11} {'of copy BW':>10}")
  print("\n" + header + "\n" + "-" * len(header))
  rows = []
  for r in results:
    row = {"system": r.system, "n": r.n, "median_s": r.seconds, "times_s": r.times,
           "gparam_per_s": r.gparams,
           "gb_per_s": r.gbytes, "ratio_to_jzo_fp32": r.gparams / jzo_rate[r.n],
           "fraction_of_copy_bw": r.gbytes / copy.gbytes}
    rows.append(row)
    print(f"{r.system:<28} {'2^%d' % (r.n.bit_length() - 1):>5} {r.gparams:9.3f} "
          f"{r.gbytes:7.1f} {row['ratio_to_jzo_fp32']:11.2f} {row['fraction_of_copy_bw']:10.2f}")
  print(f"{copy.system:<28} {'':>5} {'':>9} {copy.gbytes:7.1f} {'':>11} {1:10.2f}")
  return rows


def print_ratios(results: list[Result]) -> list[dict]:
  """Prints the ratios of issues 12 and 26 (Gparam/s over Gparam/s) per size; returns them."""
  rate = {(r.system, r.n): r.gparams for r in results}
  print(f"\n{'ratio':<52} {'N':>5} {'value':>6} {'target':>7}")
  rows = []
  for n in sorted({r.n for r in results}):
    for system, against, target in RATIOS:
      if (system, n) not in rate or (against, n) not in rate:
        continue  # a system left out (--systems, torch missing)
      value = rate[system, n] / rate[against, n]
      rows.append({"system": system, "against": against, "n": n, "ratio": value,
                   "target": target, "met": None if target is None else value >= target})
      verdict = "" if target is None else f"{target:7.2f} {'met' if value >= target else 'MISSED'}"
      print(f"{system + ' / ' + against:<52} {'2^%d' % (n.bit_length() - 1):>5} {value:6.2f} "
            f"{verdict}")
  return rows


def print_machine(info: dict) -> None:
  print("\n" + ", ".join(f"{key}: {value}" for key, value in info.items()))


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", type=int, nargs="+", default=[24, 28],
                      help="log2 of the parameter counts (default: 24 28)")
  parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                      help="threads (and CPUs) for every system (default: all available)")
  parser.add_argument("--rounds", type=int, default=5,
                      help="rounds in which every system takes its turn")
  parser.add_argument("--steps", type=int, default=4, help="timed steps per system per round")
  parser.add_argument("--warm-in", type=float, default=20.0, metavar="MS",
                      help="untimed steps for this long (at least one) at the start of each "
                           "turn, while the last system's threads still spin (default: 20; 0: none)")
  parser.add_argument("--copy-gib", type=float, default=2.0,
                      help="size of the buffer copied for the bandwidth ceiling")
  parser.add_argument("--systems", choices=("all", "optax", "kernel"), default="all",
                      help="all, or optax: the kernel and the XLA rows only (the optax drop-in, "
                           "adamw_step and optax.adamw)")
  parser.add_argument("--simd", choices=("avx512", "avx2", "scalar"),
                      help="cap jzo's instruction set (default: the best this CPU has), e.g. to "
                           "see an AVX2 host's kernel on an AVX-512 one")
  parser.add_argument("--json", metavar="PATH", help="also write the results here")
  return parser.parse_args()


def main() -> None:
  args = parse_args()
  if args.simd:
    kernels.set_simd_level(args.simd)
  use_threads(args.threads)
  info = machine_info(args.threads)
  print_machine(info)
  deepspeed_adam, deepspeed_skip = (load_deepspeed_adam() if args.systems == "all"
                                    else (None, "not in --systems optax"))
  if deepspeed_skip:
    print(f"DeepSpeedCPUAdam skipped: {deepspeed_skip}")
  if torch is None:
    print("torch AdamW skipped: torch is not installed")

  results = []
  for log2_n in args.sizes:
    n = 2**log2_n
    print(f"\nN = 2^{log2_n} ({n * 4 / 2**30:.3g} GiB per fp32 array)", flush=True)
    systems = [jzo_system(n)]
    if args.systems in ("all", "kernel"):
      systems += [jzo_system(n, engine_moments=m) for m in JZO_ENGINE]
      if torch is not None:
        systems += [torch_system(n, impl="fused")]
    if args.systems == "all":
      if torch is not None:
        systems += [torch_system(n, impl="foreach")]
    if args.systems != "kernel":
      systems += xla_systems(n)
    if deepspeed_adam is not None:
      systems.append(deepspeed_system(n, deepspeed_adam))
    results += measure(systems, n, args.rounds, args.steps, args.warm_in / 1e3)
    del systems
    gc.collect()

  print(f"\nhost copy bandwidth ({args.copy_gib:g} GiB buffer)", flush=True)
  [copy] = measure([copy_system(args.copy_gib)], None, args.rounds, args.steps)
  rows = print_table(results, copy)
  ratios = print_ratios(results)
  print_machine(info)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"machine": info, "bytes_per_param": BYTES_PER_PARAM, "warmup": WARMUP,
                 "rounds": args.rounds, "steps_per_round": args.steps, "warm_in_ms": args.warm_in,
                 "deepspeed_skipped": deepspeed_skip,
                 "copy": {"system": copy.system, "bytes": copy.bytes_moved,
                          "median_s": copy.seconds, "times_s": copy.times,
                          "gb_per_s": copy.gbytes},
                 "results": rows, "ratios": ratios}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
