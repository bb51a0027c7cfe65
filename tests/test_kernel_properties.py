"""Property-based tests (hypothesis) of the fused Adam kernel and its optax transforms.

Over sizes 0 to 10**5, every storage dtype, hyperparameters with their edge
values, SIMD levels, thread counts and memory layouts:
  * valid input: `jzo.kernels.adam_step_` (and `cpu_adam`/`cpu_adamw`/
    `adamw_step`, eagerly and under jit) lands within a stated bound of a
    float64 reference of optax.adamw, and writes no byte outside its outputs;
  * invalid input (non-contiguous, read-only, overlapping, wrong dtype, shape
    or type, NaN/infinite/negative/out-of-range hyperparameters) raises the
    TypeError or ValueError that names the argument, with every input byte
    as it was.

Crash isolation. A segfault in the kernel would kill pytest and the report of
everything it ran. So the property tests run only in a child process: in a
normal run they are skipped (the reason says where they ran), and
`test_properties_in_a_subprocess` runs this file again with
JZO_PROPERTY_CHILD=1 and fails, naming the signal, if the child dies. To run
them directly: `JZO_PROPERTY_CHILD=1 python -m pytest tests/test_kernel_properties.py`.

Reproducibility. Hypothesis is derandomized (the seed is a hash of the test)
and keeps no example database, so CI runs the same cases every time and a
failure reproduces with the command above (for a given hypothesis version).

Tolerance. `R` carries, beside each float64 intermediate of the reference, a
bound on how far a float32 evaluation of the same expression can be from it:
every float32 operation rounds to nearest (unit roundoff U = 2**-24), and the
bound propagates through each operation with its second-order terms, as in
running error analysis. A product-then-sum is bounded as two roundings, which
also covers a fused multiply-add. The bound assumes IEEE float32 arithmetic
(division and square root correctly rounded), which the kernel's SSE/AVX
instructions and its scalar path provide. It is rigorous, tight where the
step is well conditioned, and grows where it is not: cancellation in
b1*m + (1-b1)*g, and 1 - b**t for b near 1, whose float32 value can be off by
most of itself. The test allows that bound plus 2**-100 (subnormal results
round absolutely, not relatively). Moments stored in bfloat16 add their
rounding, at most 2**-8 of the value (half a bf16 ulp). The low-precision copy
must equal numpy's rounding of the kernel's own float32 weights, bit for bit.
b**t comes from XLA's float32 pow, whose error was measured at most
0.6 U * b**t * (1 + t |ln b|) for b in [0, 1) and t up to 2**31; 3 times that
is allowed, which also covers t rounded to float32. The reference starts from
the float32 scalars optax forms too (b1, lr, eps, ... rounded to float32;
1 - b1 formed in double, then rounded), so the comparison measures the
kernel's arithmetic, not the rounding of its inputs. optax itself, where
compared, must be within twice the bound of jzo. Observed errors reach 99.9%
of the bound where it is one rounding (a bf16 store half an ulp off); a change
of 1e-6 in one term of the reference, or 1 - b1 formed in float32, fails.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import jzo
from jzo import kernels

CHILD = os.environ.get("JZO_PROPERTY_CHILD") == "1"
child_only = pytest.mark.skipif(
    not CHILD, reason="runs in a child process, from test_properties_in_a_subprocess")

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
U = 2.0**-24  # float32 unit roundoff (round to nearest)
FLOOR = 2.0**-100  # absolute slack for subnormal results
BF16_HALF_ULP = 2.0**-8  # relative rounding of a bf16 store
ARRAYS = ("param", "grad", "mu", "nu", "lowp_out")
OUTPUTS = ("param", "mu", "nu", "lowp_out")  # what the kernel may write
GUARD = 64  # canary bytes before and after every array

SIMD_LEVELS = kernels.supported_simd_levels()

# Hypothesis examples per test; each valid kernel example runs CASES_PER_EXAMPLE cases.
VALID_EXAMPLES, CASES_PER_EXAMPLE = 30, 50
INVALID_EXAMPLES = 1000
EAGER_EXAMPLES, JIT_EXAMPLES = 200, 12
COUNTS: collections.Counter = collections.Counter()
WORST: dict = {}

# No shrinking: it reruns a failing test hundreds of times (compiling each time)
# and could outlast the child's time limit; the failing case is printed whole.
PROFILE = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                   phases=(Phase.explicit, Phase.generate),
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.large_base_example,
                                          HealthCheck.filter_too_much])


# --- the float64 reference with its float32 error bound ---------------------------------------


class R:
  """A float64 value `x` and a bound `e` on |float32 evaluation - x|."""

  def __init__(self, x, e=0.0):
    self.x = np.asarray(x, np.float64)
    self.e = np.asarray(e, np.float64)

  @staticmethod
  def rounded(x, e):
    """x computed exactly from operands within e, then rounded to float32."""
    return R(x, e + U * (np.abs(x) + e))

  def __add__(self, o):
    return R.rounded(self.x + o.x, self.e + o.e)

  def __sub__(self, o):
    return R.rounded(self.x - o.x, self.e + o.e)

  def __mul__(self, o):
    return R.rounded(self.x * o.x, np.abs(self.x) * o.e + np.abs(o.x) * self.e + self.e * o.e)

  def __truediv__(self, o):
    q = self.x / o.x
    margin = np.abs(o.x) - o.e  # the computed divisor is at least this far from 0
    e = np.where(margin > 0, (self.e + np.abs(q) * o.e) / np.where(margin > 0, margin, 1), np.inf)
    return R.rounded(q, e)

  def sqrt(self):
    r = np.sqrt(self.x)
    low = np.sqrt(np.maximum(self.x - self.e, 0))
    e = np.where(self.x > 0, self.e / np.where(self.x > 0, r + low, 1), np.sqrt(self.e))
    return R.rounded(r, e)

  def stored(self, dtype):
    """The value as stored in `dtype` (float32: as computed)."""
    if np.dtype(dtype) == BF16:
      return R(self.x, self.e + BF16_HALF_ULP * (np.abs(self.x) + self.e))
    return self


@dataclasses.dataclass(frozen=True)
class Hyper:
  """One step's hyperparameters as the caller passes them."""
  learning_rate: float = 1e-3
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  eps_root: float = 0.0
  weight_decay: float = 0.0
  nesterov: bool = False
  count: int = 1  # this step's 1-based index
  grad_scale: float = 1.0

  def kwargs(self):
    return dataclasses.asdict(self)


def f32(x) -> R:
  """A scalar as the kernel holds it: rounded to float32, then exact."""
  return R(float(np.float32(x)))


def inv_bias_correction(b: float, t: int) -> R:
  """1 / (1 - b**t) with b as float32; pow within 3 ulp plus t rounded to float32."""
  b32 = float(np.float32(b))
  power = b32**t
  log_term = t * abs(math.log(b32)) if b32 > 0 else 0.0
  return R(1.0) / (R(1.0) - R(power, 3 * U * power * (1 + log_term)))


def adamw_reference(p, g, m, v, h: Hyper):
  """optax.adamw's step (apply_updates included) in float64, with the float32 bounds.

  The operations are written in the order the kernel evaluates them: the
  values do not depend on it, the bounds do.

  Returns:
    R of the new params, first moment, second moment and the update.
  """
  with np.errstate(all="ignore"):
    g = R(g) * f32(h.grad_scale)
    m = f32(h.b1) * R(m) + f32(1 - h.b1) * g
    v = f32(h.b2) * R(v) + f32(1 - h.b2) * (g * g)
    inv_bc1 = inv_bias_correction(h.b1, h.count)
    if h.nesterov:
      m_hat = (f32(h.b1) * (m * inv_bias_correction(h.b1, h.count + 1))
               + f32(1 - h.b1) * (g * inv_bc1))
    else:
      m_hat = m * inv_bc1
    v_hat = v * inv_bias_correction(h.b2, h.count)
    x = m_hat / ((v_hat + f32(h.eps_root)).sqrt() + f32(h.eps))
    if h.weight_decay:
      x = f32(h.weight_decay) * R(p) + x
    u = f32(-h.learning_rate) * x
    return R(p) + u, m, v, u


def assert_within(name: str, got, want: R, *, factor: float = 1.0) -> None:
  """got within factor * want.e (+ FLOOR) of want.x; non-finite references exactly."""
  got = np.asarray(got, np.float64).ravel()
  x, e = want.x.ravel(), want.e.ravel()
  tol = factor * np.where(np.isnan(e), np.inf, e) + FLOOR
  finite = np.isfinite(x)
  with np.errstate(invalid="ignore"):
    ok = np.where(finite, np.abs(got - x) <= tol, (got == x) | (np.isnan(got) & np.isnan(x)))
  COUNTS["elements_compared"] += ok.size
  COUNTS["elements_unbounded"] += int((finite & ~np.isfinite(tol)).sum())
  COUNTS["outputs_unbounded"] += bool((finite & ~np.isfinite(tol)).any())
  COUNTS["outputs_compared"] += 1
  with np.errstate(invalid="ignore", divide="ignore"):
    used = np.where(finite & np.isfinite(tol), np.abs(got - x) / tol, 0)
  if used.size:  # the largest fraction of its bound an error used, for the report
    WORST[name] = max(WORST.get(name, 0.0), float(np.nanmax(used)))
  if not ok.all():
    i = int(np.argmin(ok))
    raise AssertionError(f"{name}[{i}] = {got[i]!r}, reference {x[i]!r} +- {tol[i]!r} "
                         f"({int((~ok).sum())} of {ok.size} elements off)")


# --- memory: arrays carved out of canary-filled arenas ---------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything one kernel call is built from (drawn by hypothesis)."""
  n: int
  shape: tuple
  dtypes: dict  # array name -> dtype; lowp_out None: no copy-out
  placement: dict  # array name -> (arena, byte offset); equal entries alias
  readonly_grad: bool
  seed: int
  scales: tuple  # log10 of the params' and the gradients' magnitudes
  pattern: str  # "normal", "zeros" (zero gradients and moments), "specials" (NaN/inf gradients)
  hyper: Hyper
  num_threads: int | None
  simd: str


def nbytes(plan: Plan, name: str) -> int:
  return plan.n * plan.dtypes[name].itemsize


def carve(sizes: dict, rng) -> dict:
  """Page-aligned arenas of random bytes, GUARD of them after the last array of each."""
  bufs = {a: kernels.aligned_empty(end + GUARD, np.uint8) for a, end in sizes.items()}
  for buf in bufs.values():
    buf[...] = rng.integers(0, 256, buf.size, dtype=np.uint8)
  return bufs


def view(buf, offset: int, dtype, shape) -> np.ndarray:
  size = math.prod(shape) * np.dtype(dtype).itemsize
  return buf[offset:offset + size].view(dtype).reshape(shape)


def build(plan: Plan):
  """The arrays of `plan` (filled with its values) and the arenas holding them."""
  rng = np.random.default_rng(plan.seed)
  names = [k for k in ARRAYS if plan.dtypes[k] is not None]
  ends = collections.defaultdict(int)
  for k in names:
    arena, offset = plan.placement[k]
    ends[arena] = max(ends[arena], offset + nbytes(plan, k))
  bufs = carve(ends, rng)
  arrays = {k: view(bufs[plan.placement[k][0]], plan.placement[k][1], plan.dtypes[k], plan.shape)
            for k in names}
  n = plan.n
  scale_p, scale_g = (10.0**s for s in plan.scales)
  values = {"param": rng.standard_normal(n) * scale_p,
            "grad": rng.standard_normal(n) * scale_g,
            "mu": rng.standard_normal(n) * scale_g * 0.3,
            "nu": (rng.standard_normal(n) * scale_g) ** 2 * rng.random(n)}
  if plan.pattern == "zeros":
    zero = rng.random(n) < 0.3
    for k in ("grad", "nu"):
      values[k][zero] = 0.0
    values["mu"][zero & (rng.random(n) < 0.5)] = 0.0
  if plan.dtypes["grad"] == F16:
    values["grad"] = np.clip(values["grad"], -6e4, 6e4)
  if plan.pattern == "specials" and n:
    at = rng.integers(0, n, size=min(n, 3))
    values["grad"][at] = rng.choice([np.nan, np.inf, -np.inf], size=at.size)
  for k in ("param", "grad", "mu", "nu"):  # grad before lowp_out: the copy-out may alias it
    if k in arrays:
      arrays[k][...] = values[k].reshape(plan.shape).astype(plan.dtypes[k])
  if plan.readonly_grad:
    arrays["grad"] = arrays["grad"].view()
    arrays["grad"].flags.writeable = False
  return arrays, bufs


def regions(plan: Plan, names) -> dict:
  """arena -> list of (start, end) byte ranges the arrays `names` occupy."""
  out = collections.defaultdict(list)
  for k in names:
    if plan.dtypes.get(k) is not None:
      arena, offset = plan.placement[k]
      out[arena].append((offset, offset + nbytes(plan, k)))
  return out


@contextlib.contextmanager
def simd(level: str):
  kernels.set_simd_level(level)
  try:
    yield
  finally:
    kernels.set_simd_level(SIMD_LEVELS[0])


def call(arrays: dict, plan: Plan, **overrides):
  kwargs = dict(plan.hyper.kwargs(), lowp_out=arrays.get("lowp_out"),
                num_threads=plan.num_threads)
  kwargs.update(overrides)
  with simd(plan.simd):
    kernels.adam_step_(arrays["param"], arrays["grad"], arrays["mu"], arrays["nu"], **kwargs)


# --- strategies -------------------------------------------------------------------------------


def log_uniform(lo: float, hi: float):
  """10**x for x uniform in [lo, hi]."""
  return st.floats(lo, hi).map(lambda x: 10.0**x)


SMALL_SIZES = st.one_of(st.integers(0, 40),  # empty, one, every tail of a 16-wide vector
                        st.integers(41, 3000))
LARGE_SIZES = st.one_of(
    st.sampled_from([2**16 - 1, 2**16, 2**16 + 1, 2**16 + 15, 10**5]),  # a thread's chunk: 2**16
    st.integers(3001, 10**5))
# About one case in eight is large: the reference costs 30 ms there, 2 ms on a small one.
SIZES = st.integers(0, 7).flatmap(lambda k: LARGE_SIZES if k == 7 else SMALL_SIZES)
# b in [0, 1) as float32 (b that rounds to 1.0 is refused: see INVALID_HYPER).
BETA_EDGES = st.sampled_from([0.0, 1 - 2**-24, 0.9, 0.999, 1e-8, 0.5, 0.99, 0.99999])
BETA_FLOATS = st.floats(0.0, 1.0, exclude_max=True).filter(lambda b: np.float32(b) < 1)
BETAS = st.integers(0, 2).flatmap(lambda k: BETA_FLOATS if k == 2 else BETA_EDGES)
EPS = st.one_of(st.sampled_from([0.0, 1e-30, 1e-8, 1e-3, 1.0]), log_uniform(-12, 2))
EPS_ROOT = st.one_of(st.sampled_from([0.0, 1e-30, 1e-16, 1e-8, 1.0]), log_uniform(-20, 0))
DECAY = st.one_of(st.sampled_from([0.0, 1e-8, 1e-4, 0.1, 1.0, 10.0]), log_uniform(-8, 1))
LR = st.one_of(st.sampled_from([0.0, 1e-40, 1e-8, 1e-3, 1.0, 10.0]), log_uniform(-8, 1))
COUNT = st.one_of(st.integers(1, 20), st.sampled_from([1000, 2**24 + 1, 2**31 - 2, 2**31 - 1]))
GRAD_SCALE = st.one_of(st.sampled_from([1.0, 0.0, 2.0**-16, 0.5, -1.0]), log_uniform(-6, 2))
STATIC = st.fixed_dictionaries(  # the hyperparameters jzo compiles its scalars for
    {"b1": BETAS, "b2": BETAS, "eps": EPS, "eps_root": EPS_ROOT, "weight_decay": DECAY})


def shape_options(n: int) -> list:
  options = [(n,)]
  options += [(d, n // d) for d in (2, 3, 4, 7, 16) if n % d == 0]
  options += [(1, n, 1)] if n < 100 else []
  options += [()] if n == 1 else [(0, 3), (3, 0)] if n == 0 else []
  return options


# Strategies are built once: hypothesis validates each new one, which costs
# more than the draw (and a plan makes about 15 draws).
DTYPE_SETS = [{"param": F32, "grad": g, "mu": m, "nu": v, "lowp_out": low}
              for g in (F32, BF16, F16) for m in (F32, BF16) for v in (F32, BF16)
              for low in (None, BF16, F16)]
DTYPES = {lowp: st.sampled_from([d for d in DTYPE_SETS
                                 if lowp is None or (d["lowp_out"] is not None) == lowp])
          for lowp in (None, True, False)}
LAYOUT = st.integers(0, 7)  # bits: packed in one arena, lowp_out over grad, read-only grad
SEED = st.integers(0, 2**32 - 1)
SCALES = st.tuples(st.integers(-3, 3), st.integers(-4, 4))
PATTERN = st.sampled_from(["normal", "normal", "zeros", "specials"])
RUNNER = st.sampled_from([(t, s) for t in (None, 1, 2, 3) for s in SIMD_LEVELS])


@st.composite
def plans(draw, *, static=None, n=None, shape=None, lowp=None, sizes=SIZES):
  """A valid kernel call: sizes, dtypes, values, hyperparameters, layout."""
  n = draw(sizes) if n is None else n
  if shape is None:
    options = shape_options(n)
    shape = options[draw(st.integers(0, len(options) - 1))]
  dtypes = dict(draw(DTYPES[lowp]))
  names = [k for k in ARRAYS if dtypes[k] is not None]
  layout, seed = draw(LAYOUT), draw(SEED)
  # The new weights may be written over 16-bit gradients (the offload landing buffer).
  alias = dtypes["lowp_out"] is not None and dtypes["grad"] != F32 and layout & 2
  placed = [k for k in names if not (alias and k == "lowp_out")]
  rng = np.random.default_rng(seed)
  # Half the arrays start on a cache line, the others at any byte (misaligned too).
  offsets = [GUARD + (0 if rng.random() < 0.5 else int(rng.integers(0, 71))) for _ in placed]
  if layout & 1:  # packed back to back in one arena, in any order, touching
    placement, offset = {}, offsets[0]
    for k in map(str, rng.permutation(placed)):
      placement[k] = (0, offset)
      offset += n * dtypes[k].itemsize
  else:  # an arena each
    placement = {k: (i, offset) for i, (k, offset) in enumerate(zip(placed, offsets))}
  if alias:
    placement["lowp_out"] = placement["grad"]
  static = draw(STATIC) if static is None else static
  hyper = Hyper(learning_rate=draw(LR), count=draw(COUNT), grad_scale=draw(GRAD_SCALE),
                nesterov=draw(st.booleans()), **static)
  num_threads, simd_level = draw(RUNNER)
  return Plan(n=n, shape=shape, dtypes=dtypes, placement=placement,
              readonly_grad=bool(layout & 4), seed=seed, scales=draw(SCALES),
              pattern=draw(PATTERN), hyper=hyper, num_threads=num_threads, simd=simd_level)


# --- valid input: results within the bound, nothing else written ------------------------------


def check_valid(plan: Plan) -> None:
  arrays, bufs = build(plan)
  before = {a: b.copy() for a, b in bufs.items()}
  p, g, m, v = (np.array(arrays[k], np.float64) for k in ("param", "grad", "mu", "nu"))
  call(arrays, plan)
  want_p, want_m, want_v, _ = adamw_reference(p, g, m, v, plan.hyper)
  assert_within("param", arrays["param"], want_p)
  assert_within("mu", arrays["mu"], want_m.stored(plan.dtypes["mu"]))
  assert_within("nu", arrays["nu"], want_v.stored(plan.dtypes["nu"]))
  if plan.dtypes["lowp_out"] is not None:
    with np.errstate(over="ignore"):  # fp16 overflows to inf, as numpy does
      want = arrays["param"].astype(plan.dtypes["lowp_out"])
    got = arrays["lowp_out"]
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got.view(np.uint16)[~np.isnan(want)],
                          want.view(np.uint16)[~np.isnan(want)]), "lowp_out != rounded param"
  # No byte outside the outputs changed: canaries, gaps and the gradients.
  written = regions(plan, OUTPUTS)
  for a, buf in bufs.items():
    keep = np.ones(buf.size, bool)
    for lo, hi in written[a]:
      keep[lo:hi] = False
    assert np.array_equal(buf[keep], before[a][keep]), f"bytes outside the outputs of arena {a}"
  COUNTS["kernel_valid"] += 1


@child_only
@settings(PROFILE, max_examples=VALID_EXAMPLES)
@given(STATIC.flatmap(lambda s: st.lists(plans(static=s), min_size=CASES_PER_EXAMPLE,
                                         max_size=CASES_PER_EXAMPLE)))
def test_kernel_matches_float64_reference(cases):
  """Each example shares b1, b2, eps, eps_root and weight decay between its
  cases: jzo compiles the step's scalars for each such set (0.2 s)."""
  for plan in cases:
    try:
      check_valid(plan)
    except AssertionError as e:  # the case, not the 50 of the example
      raise AssertionError(f"{e}\nin {plan}") from None


# --- invalid input: the named error, every byte unchanged -------------------------------------

NON_REAL = ["0.1", b"1", None, 1j, np.array([0.1, 0.2]), [0.1]]
INVALID_HYPER = (
    [(k, x, ValueError) for k in ("learning_rate", "eps", "eps_root", "weight_decay", "b1", "b2")
     for x in (math.nan, math.inf, -math.inf, -1e-30, -1.0, 1e39)]
    + [(k, x, TypeError) for k in ("learning_rate", "eps", "eps_root", "weight_decay", "b1", "b2")
       for x in NON_REAL]
    # b1 and b2 must be < 1 as the kernel holds them: 1 - 1e-9 is 1.0 in float32.
    + [(k, x, ValueError) for k in ("b1", "b2") for x in (1.0, 1.5, 1 - 1e-9, 1 - 2**-26)]
    + [("count", x, ValueError) for x in (0, -1, 2**31, 2**40, 1.0, 1.5, True, "1", None)]
    + [("grad_scale", x, ValueError) for x in (math.nan, math.inf, -math.inf, 1e39, -1e39)]
    + [("grad_scale", x, TypeError) for x in ("2", None, 1j)]
    # adam_step_ takes this step's values; cpu_adamw is the one that takes schedules.
    + [("learning_rate", optax.constant_schedule(1e-3), TypeError),
       ("weight_decay", optax.linear_schedule(0.1, 0.0, 10), TypeError)]
    + [("num_threads", x, ValueError) for x in (0, -1, 1.5, True, 2**31)]
)
BAD_DTYPES = {
    "param": [np.float64, np.float16, BF16, np.int32, ">f4", np.complex64],
    "grad": [np.float64, np.int32, np.int16, np.uint16, np.bool_, ">f4", ">f2", np.complex64],
    "mu": [np.float16, np.float64, np.int32, np.uint16, ">f4"],
    "nu": [np.float16, np.float64, np.uint32, np.int16, ">f4"],
    "lowp_out": [np.float32, np.float64, np.int16, np.uint16, ">f2"],
}


@st.composite
def invalid_calls(draw):
  """(plan, mutation, expected error): a valid call with one thing wrong."""
  kind = draw(st.sampled_from(["strided", "readonly", "overlap", "dtype", "shape", "type",
                               "hyper"]))
  # Fixed: each new set compiles (see the valid test); small: the checks come before any pass.
  plans_ = functools.partial(plans, static={"b1": 0.9, "b2": 0.999, "eps": 1e-8, "eps_root": 0.0,
                                            "weight_decay": 0.01}, sizes=SMALL_SIZES)
  if kind == "strided":
    name = draw(st.sampled_from(ARRAYS))
    how = draw(st.sampled_from(["step2", "reversed", "transposed"]))
    if how == "transposed":  # a (b, a) array's transpose: non-contiguous when a, b >= 2
      a, b = draw(st.integers(2, 40)), draw(st.integers(2, 40))
      n, shape = a * b, (a, b)
    else:
      n = draw(st.integers(2, 3000))
      shape = (n,)
    plan = draw(plans_(n=n, shape=shape, lowp=name == "lowp_out" or None))
    return plan, (kind, name, how), ValueError
  if kind == "readonly":
    name = draw(st.sampled_from(OUTPUTS))
    plan = draw(plans_(lowp=name == "lowp_out" or None))
    return plan, (kind, name), ValueError
  if kind == "overlap":
    # Any two arrays sharing a byte, except exactly the same bytes as grad and lowp_out.
    plan = draw(plans_(n=draw(st.integers(1, 3000)), lowp=True))
    a, b = draw(st.permutations(ARRAYS))[:2]
    na, nb = nbytes(plan, a), nbytes(plan, b)
    delta = draw(st.integers(-nb + 1, na - 1))  # b starts delta bytes after a
    if {a, b} == {"grad", "lowp_out"} and delta == 0 and na == nb:
      delta = 1 if na > 1 else -1
    return plan, (kind, a, b, delta), ValueError
  if kind == "dtype":
    name = draw(st.sampled_from(ARRAYS))
    plan = draw(plans_(lowp=name == "lowp_out" or None))
    return plan, (kind, name, np.dtype(draw(st.sampled_from(BAD_DTYPES[name])))), TypeError
  if kind == "shape":
    name = draw(st.sampled_from(ARRAYS))
    plan = draw(plans_(lowp=name == "lowp_out" or None))
    n = plan.n
    options = [(n + 1,), plan.shape + (1,), (1,) + plan.shape]
    options += [(n - 1,)] if n >= 1 else []
    options += [(n,)] if plan.shape != (n,) else [(1, n)]  # same size, another shape
    return plan, (kind, name, draw(st.sampled_from(options))), ValueError
  if kind == "type":
    name = draw(st.sampled_from(ARRAYS))
    plan = draw(plans_(lowp=name == "lowp_out" or None))
    other = ["list", "jax", "memoryview", "scalar"] + ([] if name == "lowp_out" else ["none"])
    return plan, (kind, name, draw(st.sampled_from(other))), TypeError
  name, value, error = draw(st.sampled_from(INVALID_HYPER))
  plan = draw(plans_())
  return plan, ("hyper", name, value), error


def mutate(plan: Plan, arrays: dict, bufs: dict, mutation) -> tuple[dict, dict]:
  """Applies `mutation` to the arrays of `plan`; returns (arrays, call overrides)."""
  kind, name = mutation[:2]
  rng = np.random.default_rng(plan.seed + 1)
  arrays = dict(arrays)
  shape, dtype = plan.shape, plan.dtypes.get(name)
  if kind == "strided":
    how = mutation[2]
    full = shape[:-1] + (2 * shape[-1],) if how == "step2" else shape[::-1]
    bufs["strided"] = carve({"strided": GUARD + math.prod(full) * dtype.itemsize},
                            rng)["strided"]
    base = view(bufs["strided"], GUARD, dtype, full)
    arrays[name] = {"step2": lambda: base[..., ::2], "reversed": lambda: base[::-1],
                    "transposed": lambda: base.T}[how]()
  elif kind == "readonly":
    arrays[name] = arrays[name].view()
    arrays[name].flags.writeable = False
  elif kind == "overlap":
    # Rebuild a's and b's arena: a at GUARD + nb, b delta bytes after it.
    a, b, delta = mutation[1:]
    na, nb = nbytes(plan, a), nbytes(plan, b)
    buf = carve({"overlap": GUARD + na + 2 * nb}, rng)["overlap"]
    bufs["overlap"] = buf
    arrays[a] = view(buf, GUARD + nb, plan.dtypes[a], shape)
    arrays[b] = view(buf, GUARD + nb + delta, plan.dtypes[b], shape)
  elif kind in ("dtype", "shape"):
    dtype, shape = (mutation[2], shape) if kind == "dtype" else (dtype, mutation[2])
    bufs[kind] = carve({kind: GUARD + math.prod(shape) * dtype.itemsize + 8}, rng)[kind]
    arrays[name] = view(bufs[kind], GUARD, dtype, shape)
  elif kind == "type":
    a = np.array(arrays[name])
    arrays[name] = {"list": lambda: a.tolist(), "jax": lambda: jnp.asarray(a),
                    "memoryview": lambda: memoryview(bytearray(a.tobytes())),
                    "scalar": lambda: 0.5, "none": lambda: None}[mutation[2]]()
  elif kind == "hyper":
    return arrays, {name: mutation[2]}
  return arrays, {}


def check_invalid(plan: Plan, mutation, error) -> None:
  arrays, bufs = build(plan)
  arrays, overrides = mutate(plan, arrays, bufs, mutation)
  before = {a: b.copy() for a, b in bufs.items()}
  with pytest.raises(error) as info:
    call(arrays, plan, **overrides)
  for a, buf in bufs.items():
    assert np.array_equal(buf, before[a]), f"{mutation}: arena {a} changed before the error"
  names = [m for m in mutation[1:3] if isinstance(m, str) and m in ARRAYS + tuple(Hyper().kwargs())
           + ("num_threads",)]
  for m in names if mutation[0] != "overlap" else mutation[1:3]:
    assert m in str(info.value), f"{mutation}: {info.value!r} does not name {m}"
  COUNTS["kernel_invalid"] += 1
  COUNTS[f"invalid_{mutation[0]}"] += 1


@child_only
@settings(PROFILE, max_examples=INVALID_EXAMPLES)
@given(invalid_calls())
def test_invalid_input_is_refused_with_every_byte_unchanged(case):
  check_invalid(*case)


@child_only
def test_every_invalid_hyperparameter_is_refused():
  """Each row of INVALID_HYPER once (the property test samples them), on
  misaligned bf16 gradients that the new weights are written over."""
  plan = Plan(n=37, shape=(37,), dtypes={"param": F32, "grad": BF16, "mu": F32, "nu": BF16,
                                         "lowp_out": BF16},
              placement={"param": (0, 64), "grad": (1, 65), "mu": (2, 64), "nu": (3, 66),
                         "lowp_out": (1, 65)},
              readonly_grad=False, seed=0, scales=(0, 0), pattern="normal",
              hyper=Hyper(weight_decay=0.01), num_threads=None, simd=SIMD_LEVELS[0])
  for name, value, error in INVALID_HYPER:
    check_invalid(plan, ("hyper", name, value), error)


# --- the optax transforms against the reference and optax -------------------------------------

CPU = jax.devices("cpu")[0]  # the kernel's path: on an accelerator XLA computes the step
T_SHAPES = [(), (9,), (4, 33)]  # each shape compiles the step once per dtype set


@dataclasses.dataclass(frozen=True)
class TransformCase:
  adam: bool  # cpu_adam (no weight decay) instead of cpu_adamw
  step: bool  # jzo.adamw_step instead of tx.update + optax.apply_updates
  decay_mask: bool | None
  plan: Plan


@st.composite
def transform_cases(draw):
  shape = draw(st.sampled_from(T_SHAPES))
  static = draw(STATIC)
  plan = draw(plans(static=static, n=math.prod(shape), shape=shape, lowp=False))
  hyper = dataclasses.replace(plan.hyper, grad_scale=1.0, count=draw(st.integers(1, 30)))
  adam = draw(st.booleans())
  if adam:
    hyper = dataclasses.replace(hyper, weight_decay=0.0)
  return TransformCase(adam=adam, step=draw(st.booleans()),
                       decay_mask=None if adam else draw(st.sampled_from([None, True, False])),
                       plan=dataclasses.replace(plan, hyper=hyper))


def check_transform(case: TransformCase, *, jit: bool) -> None:
  plan, h = case.plan, case.plan.hyper
  arrays, _ = build(plan)
  p, g, m, v = (np.array(arrays[k]) for k in ("param", "grad", "mu", "nu"))
  mu_dtype, nu_dtype = (jnp.dtype(plan.dtypes[k]) for k in ("mu", "nu"))
  common = dict(b1=h.b1, b2=h.b2, eps=h.eps, eps_root=h.eps_root, nesterov=h.nesterov)
  if case.adam:
    tx = jzo.cpu_adam(h.learning_rate, mu_dtype=mu_dtype, nu_dtype=nu_dtype, **common)
    ref_tx = optax.adam(h.learning_rate, **common)
  else:
    mask = None if case.decay_mask is None else {"w": case.decay_mask}
    tx = jzo.cpu_adamw(h.learning_rate, mu_dtype=mu_dtype, nu_dtype=nu_dtype,
                       weight_decay=h.weight_decay, mask=mask, **common)
    ref_tx = optax.adamw(h.learning_rate, weight_decay=h.weight_decay, mask=mask, **common)

  def step(params, state, grads):
    if case.step:
      params, state = jzo.adamw_step(tx, grads, state, params)
      return params, None, state
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), updates, state

  def ref_step(params, state, grads):
    updates, state = ref_tx.update(grads, state, params)
    return optax.apply_updates(params, updates), updates, state

  with jax.default_device(CPU):
    put = lambda x: {"w": jnp.asarray(x)}  # noqa: E731
    state = jzo.CpuAdamState(jnp.int32(h.count - 1), put(m), put(v))
    got_p, got_u, got_state = (jax.jit(step) if jit else step)(put(p), state, put(g))
    f64 = lambda t: np.asarray(t["w"], np.float64)  # noqa: E731
    decays = not case.adam and case.decay_mask is not False
    want_p, want_m, want_v, want_u = adamw_reference(
        p.astype(np.float64), g.astype(np.float64), m.astype(np.float64), v.astype(np.float64),
        dataclasses.replace(h, weight_decay=h.weight_decay if decays else 0.0))
    assert int(got_state.count) == h.count
    if got_u is not None and got_u["w"].dtype != jnp.float32:
      # optax's contract: the updates come in the dtype the gradients and moments share
      # (bfloat16 here, without weight decay), so the new weights carry that rounding too.
      stored_u = want_u.stored(got_u["w"].dtype)
      want_p, want_u = R(want_p.x, want_p.e + stored_u.e - want_u.e), stored_u
    assert_within("param", f64(got_p), want_p)
    assert_within("mu", f64(got_state.mu), want_m.stored(mu_dtype))
    assert_within("nu", f64(got_state.nu), want_v.stored(nu_dtype))
    if got_u is not None:
      assert_within("update", f64(got_u), want_u)
    if mu_dtype == nu_dtype == jnp.float32 and not jit:
      # optax on float32 gradients: within the bound of the reference too, so the
      # two are within twice the bound of each other (plus each one's last rounding).
      ref_state = ref_tx.init(put(p))
      ref_state = (ref_state[0]._replace(count=state.count, mu=put(m), nu=put(v)),) + ref_state[1:]
      ref_p, ref_u, ref_state = ref_step(put(p), ref_state, put(g.astype(np.float32)))
      for name, got, ref, want in (("param", got_p, ref_p, want_p),
                                   ("update", got_u, ref_u, want_u),
                                   ("mu", got_state.mu, ref_state[0].mu, want_m)):
        if got is not None:
          both = R(f64(ref), want.e + U * np.abs(want.x))
          assert_within(f"{name} vs optax", f64(got), both, factor=2.0)
      COUNTS["optax_compared"] += 1
  COUNTS["transform_jit" if jit else "transform_eager"] += 1


@child_only
@settings(PROFILE, max_examples=EAGER_EXAMPLES)
@given(transform_cases())
def test_transforms_eagerly_match_reference_and_optax(case):
  check_transform(case, jit=False)


@child_only
@settings(PROFILE, max_examples=JIT_EXAMPLES)
@given(transform_cases())
def test_transforms_under_jit_match_reference(case):
  """Each example compiles (its hyperparameters are constants of the program)."""
  check_transform(case, jit=True)


@child_only
def test_report_case_counts():
  """Last in the file: the counts of the cases run above, for the parent."""
  report = os.environ.get("JZO_PROPERTY_REPORT")
  if report:
    pathlib.Path(report).write_text(json.dumps({"counts": COUNTS, "error/bound": WORST}))
  assert COUNTS["kernel_valid"] + COUNTS["kernel_invalid"] >= 2000, COUNTS
  # Infinite bounds (1 - b**t within a few float32 ulps of 0: b = 1 - 2**-24
  # and t < 4) must stay rare, or the comparison would say little.
  assert COUNTS["outputs_unbounded"] <= 0.05 * COUNTS["outputs_compared"], COUNTS


# --- the parent: run the above in a child so that a crash fails a test -------------------------


@pytest.mark.skipif(CHILD, reason="this is the child")
def test_properties_in_a_subprocess(tmp_path):
  report = tmp_path / "counts.json"
  env = dict(os.environ, JZO_PROPERTY_CHILD="1", JZO_PROPERTY_REPORT=str(report))
  try:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, cwd=pathlib.Path(__file__).parent.parent, capture_output=True, text=True,
        timeout=600)
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"") + (e.stderr or b"")
    pytest.fail(f"the property tests ran over 600 s:\n{out[-6000:].decode(errors='replace')}")
  tail = (proc.stdout + proc.stderr)[-6000:]
  if proc.returncode < 0:
    pytest.fail(f"the property tests' process died of {signal.Signals(-proc.returncode).name}:"
                f"\n{tail}")
  assert proc.returncode == 0, tail
  counts = json.loads(report.read_text())["counts"]
  assert counts["kernel_valid"] >= VALID_EXAMPLES * CASES_PER_EXAMPLE, counts
  assert counts["kernel_valid"] + counts["kernel_invalid"] >= 2000, counts
  assert counts["transform_eager"] + counts["transform_jit"] >= 200, counts
  print(counts)
