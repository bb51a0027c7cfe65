"""int8 Adam moments (jzo.kernels.quant8): the maps, the kernel against the array
reference, determinism, the optax drop-in, the offload engine, checkpoints
and bad input."""

import contextlib
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jzo
from jzo import native
from jzo import kernels
from jzo.kernels import quant8
from jzo.kernels.cpu_adam import xla_update
from test_engine import batches, init_params, loss_fn, make_engine, mesh_of
from test_kernels import HYPER, prefetching, simd

INT8 = jnp.int8


def codes_of(signed):
  return native.quant8_map(signed)[0]


def test_the_maps_are_dynamic_trees():
  """Signed: sign and 128 magnitudes over 7 decades, 0 to 1; unsigned: 256
  over 8 decades; each decade holds twice the values of the one below it,
  at the middles of equal steps. The unsigned code 0 is the middle of what
  rounds to it, half the first midpoint, not 0."""
  signed = np.asarray(codes_of(True), np.float64)
  magnitudes = signed[:128]
  np.testing.assert_array_equal(signed[128:], -magnitudes)
  unsigned = np.asarray(codes_of(False), np.float64)
  assert unsigned[0] == np.float32(np.float32(unsigned[1] / 2) / 2) > 0
  unsigned[0] = 0
  for values, decades in ((magnitudes, 7), (unsigned, 8)):
    assert values[0] == 0 and values[-1] == 1 and np.all(np.diff(values) > 0)
    # Decades [10^-e, 10^(1-e)), e = decades .. 1 (1 itself is the last value).
    per_decade = [int(np.sum((values >= 10.0**-e) & (values < 10.0**(1 - e))))
                  for e in range(decades, 0, -1)]
    assert per_decade == [1 << k for k in range(decades - 1)] + [(1 << (decades - 1)) - 1]
    top = values[len(values) // 2:-1]  # the top decade but 1
    np.testing.assert_allclose(np.diff(top), 0.9 / (len(values) // 2), rtol=1e-5)


def random_moments(shape, seed=0):
  """Float moments spanning many orders of magnitude, as Adam's do."""
  rng = np.random.default_rng(seed)
  m = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-8, 0, shape)).astype(np.float32)
  v = (10.0 ** rng.uniform(-14, 0, shape)).astype(np.float32)
  return m, v


@pytest.mark.parametrize("shape", [(5,), (256,), (3, 700), (2, 3, 1000)], ids=str)
def test_quantize_picks_the_nearest_code_per_block(shape):
  m, v = random_moments(shape)
  for x, signed in ((m, True), (v, False)):
    q = quant8.quantize(x, signed=signed)
    assert q.codes.dtype == np.uint8 and q.scales.shape == quant8.scale_shape(shape)
    width = quant8.blocks(shape[-1]) * quant8.QUANT_BLOCK
    padded = np.pad(x, [(0, 0)] * (len(shape) - 1) + [(0, width - shape[-1])])
    blocks = padded.reshape(shape[:-1] + (-1, quant8.QUANT_BLOCK))
    np.testing.assert_array_equal(q.scales, np.abs(blocks).max(-1))
    # The nearest code: no code of the map lies closer to x / scale.
    y = (blocks / q.scales[..., None]).reshape(shape[:-1] + (-1,))[..., :shape[-1]]
    codes = np.asarray(codes_of(signed), np.float64)
    got = np.abs(codes[q.codes] - y)
    best = np.abs(codes[None, :] - y.reshape(-1, 1)).min(-1).reshape(shape)
    np.testing.assert_allclose(got, best, rtol=0, atol=1e-7)
    # The same through jax.numpy.
    qj = quant8.quantize(jnp.asarray(x), signed=signed)
    np.testing.assert_array_equal(np.asarray(qj.codes), q.codes)
    np.testing.assert_array_equal(quant8.dequantize(q, signed=signed),
                                  np.asarray(quant8.dequantize(qj, signed=signed)))


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_numpy_codes_by_index_equal_a_binary_search(signed):
  """quantize's numpy path looks codes up by the top 16 bits (as the
  kernel's quant8_exact); the jax path searches the midpoints. The same
  codes on every midpoint and its 3 neighbours each way, random
  magnitudes across the decades, 0 and 1."""
  mids = quant8.code_map(signed)[1]
  near, below, above = [mids], mids, mids
  for _ in range(3):
    below, above = np.nextafter(below, np.float32(0)), np.nextafter(above, np.float32(2))
    near += [below, above]
  rng = np.random.default_rng(0)
  m = np.concatenate(near + [rng.random(2**16, np.float32),
                             (10.0 ** rng.uniform(-9, 0, 2**16)).astype(np.float32),
                             np.float32([0, 1e-30, 2**-27, 1])])
  m = np.clip(m, 0, 1).astype(np.float32)
  np.testing.assert_array_equal(quant8.nearest_codes(m, signed),
                                np.searchsorted(mids, m, side="left"))


def test_zeros_and_non_finite_blocks():
  x = np.zeros((2, 300), np.float32)
  x[1, 260] = np.nan
  q = quant8.quantize(x, signed=True)
  np.testing.assert_array_equal(q.scales, [[0, 0], [0, np.nan]])
  back = quant8.dequantize(q, signed=True)
  assert np.all(back[0] == 0) and np.all(back[1, :256] == 0) and np.all(np.isnan(back[1, 256:]))


def kernel_steps(p, g, m, v, steps, **kw):
  """`steps` kernel steps from moments quantized from m and v, on copies;
  returns (param, mu, nu)."""
  p = p.copy()
  mu, nu = quant8.quantize(m, signed=True), quant8.quantize(v, signed=False)
  for t in range(1, steps + 1):
    kernels.adam_step_(p, g, mu, nu, count=t, **HYPER, **kw)
  return p, mu, nu


def reference_steps(p, g, m, v, steps):
  """The same steps as array operations (xla_update: dequantize, Adam in
  float32, quantize)."""
  p = jnp.asarray(p)
  mu = jax.tree.map(jnp.asarray, quant8.quantize(m, signed=True))
  nu = jax.tree.map(jnp.asarray, quant8.quantize(v, signed=False))
  for t in range(1, steps + 1):
    scalars = kernels.adam_scalars(lr=HYPER["learning_rate"], b1=HYPER["b1"], b2=HYPER["b2"],
                                   eps=HYPER["eps"], eps_root=0.0,
                                   weight_decay=HYPER["weight_decay"], count=t)
    u, mu, nu = xla_update(jnp.asarray(g, jnp.float32), mu, nu, p, scalars, nesterov=False)
    p = p + u
  return np.asarray(p), jax.tree.map(np.asarray, mu), jax.tree.map(np.asarray, nu)


def assert_moments_close(got, want, signed):
  """Codes equal but where float32 rounding put a value on the other side
  of a midpoint (fused multiply-adds in the kernel); values within a code."""
  assert np.mean(got.codes == want.codes) > 0.999
  np.testing.assert_allclose(got.scales, want.scales, rtol=1e-6)
  a, b = quant8.dequantize(got, signed=signed), quant8.dequantize(want, signed=signed)
  np.testing.assert_allclose(a, b, rtol=0.1, atol=1e-6 * np.max(np.abs(b)))


@pytest.mark.parametrize("shape", [(1,), (300,), (4, 700), (2, 1024)], ids=str)
@pytest.mark.parametrize("grad_dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_kernel_matches_the_array_reference(shape, grad_dtype):
  rng = np.random.default_rng(1)
  p = rng.standard_normal(shape, dtype=np.float32)
  g = (rng.standard_normal(shape, dtype=np.float32) * 1e-2).astype(grad_dtype)
  m, v = random_moments(shape)
  got = kernel_steps(p, g, m, v, 3)
  want = reference_steps(p, g, m, v, 3)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
  assert_moments_close(got[1], want[1], signed=True)
  assert_moments_close(got[2], want[2], signed=False)


def test_the_update_comes_from_the_unrounded_moments():
  """With bf16 weights written out too: the weights equal the float32
  moments' update, not the dequantized codes'."""
  rng = np.random.default_rng(2)
  p = rng.standard_normal(5000, dtype=np.float32)
  g = rng.standard_normal(5000, dtype=np.float32).astype(ml_dtypes.bfloat16)
  lowp = np.zeros(5000, ml_dtypes.bfloat16)
  zero = np.zeros(5000, np.float32)
  got, _, _ = kernel_steps(p, g, zero, zero, 1, lowp_out=lowp)
  want = p.copy()
  kernels.adam_step_(want, g, zero.copy(), zero.copy(), count=1, **HYPER)
  np.testing.assert_array_equal(got, want)  # step 1 from zero moments: the same arithmetic
  np.testing.assert_array_equal(lowp, got.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("jit", [False, True], ids=["kernel", "xla"])
def test_an_element_whose_gradient_stops_keeps_a_step_of_about_the_learning_rate(jit):
  """Elements whose gradients are up to 10^4 times smaller than their
  block's largest, zero on 70% of steps (a token absent from a batch, an
  expert no token chose): Adam's steps stay within about the learning rate
  with int8 moments as with float32 ones. (A second moment's code 0 decoded
  as 0 let such an element step by m / eps: 28 times the learning rate.)"""
  rng = np.random.default_rng(0)
  n = 256 * 512
  magnitude = 10.0 ** rng.uniform(-4, 0, n) * 1e-3
  largest = {}
  for name, moments in (("int8", dict(mu_dtype=INT8, nu_dtype=INT8)), ("fp32", {})):
    tx = jzo.cpu_adamw(1.0, weight_decay=0.0, **moments)
    update = jax.jit(tx.update) if jit else tx.update
    params = jnp.zeros(n, jnp.float32)
    state, draws, largest[name] = tx.init(params), np.random.default_rng(1), 0.0
    for _ in range(20):
      g = draws.standard_normal(n) * magnitude * (draws.random(n) < 0.3)
      u, state = update(jnp.asarray(g, jnp.float32), state, params)
      largest[name] = max(largest[name], float(jnp.abs(u).max()))
  assert largest["fp32"] < 1.01 and largest["int8"] < 3, largest


def test_the_first_steps_of_a_warm_up_move_as_with_float32_moments():
  """A GPT's first Adam steps from scratch, the learning rate rising from 0
  as the recipe's warm-up does: the second moments are at their smallest
  and most spread, and each step is about the learning rate on every
  element. int8 moments move the weights as float32 ones do (the same
  size, the same direction), so a loss that rises in those steps is not
  the moments' rounding."""
  from jzo.models import gpt
  config = gpt.GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=256)
  params = gpt.init_params(config, jax.random.key(0))
  grad = jax.jit(jax.grad(lambda p, b: gpt.loss_fn(config, p, b)))
  warm_up = lambda count: 1e-4 * count / 1000
  txs = {name: jzo.cpu_adamw(warm_up, weight_decay=0.0, mu_dtype=m, nu_dtype=m)
         for name, m in (("fp32", None), ("int8", INT8))}
  states = {name: tx.init(params) for name, tx in txs.items()}
  rng = np.random.default_rng(0)
  for step in range(1, 7):
    g = grad(params, {"tokens": jnp.asarray(rng.integers(0, 256, (8, 65)), jnp.int32)})
    updates = {}
    for name, tx in txs.items():
      updates[name], states[name] = tx.update(g, states[name], params)
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(updates[name])])
            for name in ("fp32", "int8"))
    if step > 1:  # the first learning rate is 0
      assert abs(np.linalg.norm(b) / np.linalg.norm(a) - 1) < 0.01, step
      assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.999, step
    params = optax.apply_updates(params, updates["fp32"])  # both see the same gradients


@contextlib.contextmanager
def int8_codes(way):
  """The kernel's int8 codes found by `way` ('gather' or 'computed')."""
  before = kernels.int8_codes()
  kernels.set_int8_codes(way)
  try:
    yield
  finally:
    if before != "unchosen":
      kernels.set_int8_codes(before)


WAYS = kernels.INT8_CODES


@pytest.mark.parametrize("options", [{}, dict(nesterov=True, eps_root=1e-12, grad_scale=0.5)],
                         ids=["adamw", "nesterov"])
def test_bitwise_the_same_on_every_instruction_set_thread_count_and_prefetch(options):
  """Rows of 100,000 (short last blocks) over several tasks, and one long
  row: every ISA, thread count, way to the codes and prefetch setting writes
  the same bits, bfloat16 copy included."""
  for shape in [(3, 100_000), (300_001,)]:
    rng = np.random.default_rng(3)
    p = rng.standard_normal(shape, dtype=np.float32)
    g = rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
    m, v = random_moments(shape)
    results = []
    for level in kernels.supported_simd_levels():
      for threads, way, above in [(1, "gather", -1), (2, "computed", 0), (3, "gather", 0),
                                  (3, "computed", -1)]:
        out = kernels.aligned_empty(shape, ml_dtypes.bfloat16)
        with simd(level), int8_codes(way), prefetching(above):
          p1, mu, nu = kernel_steps(p, g, m, v, 2, num_threads=threads, lowp_out=out, **options)
        results.append((f"{level} on {threads} threads, codes {way}, prefetch above {above}",
                        p1, mu, nu, out))
    first = results[0]
    for name, *arrays in results[1:]:
      for a, b in zip(jax.tree.leaves(arrays), jax.tree.leaves(first[1:])):
        np.testing.assert_array_equal(a, b, err_msg=name)


def values_next_to_every_midpoint(signed, ulps=2048):
  """Every float32 within `ulps` of each midpoint of the map (where the
  AVX-512 kernel's arithmetic could pick the wrong code), every 4099th one
  in [2^-30, 1] (its tables' parts), and 0 and 1."""
  mids = np.asarray(native.quant8_map(signed)[1], np.float32).view(np.int32)
  near = (mids[:, None] + np.arange(-ulps, ulps + 1, dtype=np.int32)).ravel()
  sweep = np.arange(np.float32(2.0**-30).view(np.int32), np.float32(1).view(np.int32), 4099,
                    dtype=np.int32)
  values = np.concatenate([near, sweep]).view(np.float32)
  return np.concatenate([[0, 1], values[(values > 0) & (values <= 1)]]).astype(np.float32)


def kernel_codes(g):
  """The kernel's new codes for moments that equal g (mu) and g * g (nu):
  b1 = b2 = 0 leaves nothing of the old moments, and a 1 at the start of
  each block of g makes every scale 1, so the kernel quantizes the values
  themselves."""
  n = len(g)
  g = np.insert(g, np.arange(0, n, quant8.QUANT_BLOCK - 1), np.float32(1))
  mu, nu = quant8.zeros(g.shape), quant8.zeros(g.shape)
  kernels.adam_step_(np.zeros_like(g), g, mu, nu, count=1, learning_rate=1e-3, b1=0.0, b2=0.0)
  np.testing.assert_array_equal(mu.scales, 1)
  return g, mu.codes, nu.codes


@pytest.mark.parametrize("level", kernels.supported_simd_levels())
def test_every_instruction_set_picks_the_nearest_code_next_to_every_midpoint(level):
  """The kernel's codes equal the reference's (the count of midpoints below
  the value) on values packed around each midpoint, signs mixed: the
  AVX-512 kernel computes most codes rather than looking them up, and redoes
  those too close to a midpoint to trust, or gathers them (the other way)."""
  rng = np.random.default_rng(4)
  signed = values_next_to_every_midpoint(True)
  signed = signed * rng.choice(np.float32([-1, 1]), signed.shape)
  signed[signed == 0] = 0  # no -0: its code would be the sign's alone
  squares = np.sqrt(values_next_to_every_midpoint(False).astype(np.float64)).astype(np.float32)
  for way in WAYS:
    with simd(level), int8_codes(way):
      g, mu_codes, _ = kernel_codes(signed)
      np.testing.assert_array_equal(mu_codes, quant8.quantize(g, signed=True).codes, err_msg=way)
      g, _, nu_codes = kernel_codes(squares)
      np.testing.assert_array_equal(nu_codes, quant8.quantize(g * g, signed=False).codes,
                                    err_msg=way)


CHOICE = """
import numpy as np
from jzo import kernels
from jzo.kernels import quant8
print(kernels.int8_codes())
p = np.zeros(1 << 16, np.float32)
kernels.adam_step_(p, np.ones_like(p), quant8.zeros(p.shape), quant8.zeros(p.shape), count=1,
                   learning_rate=1e-3)
print(kernels.int8_codes())
"""


def test_the_first_int8_step_chooses_how_to_find_codes():
  """A process starts with the way to int8 codes unchosen; its first int8
  step (on AVX-512) times both and keeps one; JZO_INT8_CODES sets it."""
  run = lambda **env: subprocess.run([sys.executable, "-c", CHOICE], env={**os.environ, **env},
                                     capture_output=True, text=True)
  before, after = run().stdout.split()
  assert before == "unchosen" and after in WAYS
  for way in WAYS:
    assert run(JZO_INT8_CODES=way).stdout.split() == [way, way]
  bad = run(JZO_INT8_CODES="fast")
  assert bad.returncode == 1
  assert "ValueError: JZO_INT8_CODES must be 'gather' or 'computed', got 'fast'" in bad.stderr
  with pytest.raises(ValueError, match="'gather' or 'computed', got 'fast'"):
    kernels.set_int8_codes("fast")


def test_the_avx512_codes_are_exact_on_every_float32(tmp_path):
  """quant8_exhaustive.cc: the AVX-512 kernel's quantizer, both ways, against
  the index on every float32 in [0, 1], both maps."""
  if "avx512" not in kernels.supported_simd_levels():
    pytest.skip("this CPU has no AVX-512")
  compiler = shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    pytest.skip("no C++ compiler to build tests/quant8_exhaustive.cc")
  root = pathlib.Path(__file__).resolve().parent.parent
  program = tmp_path / "quant8_exhaustive"
  subprocess.run([compiler, "-O2", "-std=c++17", "-ffp-contract=off", f"-I{root / 'ext'}",
                  "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c",
                  str(root / "tests" / "quant8_exhaustive.cc"), str(root / "ext" / "quant8.cc"),
                  "-o", str(program)], check=True, capture_output=True)
  run = subprocess.run([str(program)], capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout + run.stderr
  assert len(re.findall(r"values in \[0, 1\], 0 codes differ", run.stdout)) == 4, run.stdout


def bad_int8_inputs():
  p = np.zeros((2, 300), np.float32)
  g = np.zeros_like(p)
  q = lambda: quant8.zeros(p.shape)
  bf16 = np.zeros(p.shape, ml_dtypes.bfloat16)
  read_only = quant8.zeros(p.shape)
  read_only.codes.setflags(write=False)
  return [
      ("int8 mu, bf16 nu", dict(mu=q(), nu=bf16), TypeError, "pairs"),
      ("int8 codes", dict(mu=quant8.Int8Moment(np.zeros(p.shape, np.int8),
                                               np.zeros((2, 2), np.float32)), nu=q()),
       TypeError, "uint8 codes"),
      ("flat scales", dict(mu=quant8.Int8Moment(np.zeros(p.shape, np.uint8),
                                                np.zeros(4, np.float32)), nu=q()),
       ValueError, r"mu.scales has shape \(4,\).*needs \(2, 2\)"),
      ("codes shape", dict(mu=quant8.zeros((600,)), nu=q()), ValueError, "mu"),
      ("read-only codes", dict(mu=read_only, nu=q()), ValueError, "read-only"),
  ], p, g


@pytest.mark.parametrize("case", range(5))
def test_bad_int8_input_is_refused_before_any_write(case):
  cases, p, g = bad_int8_inputs()
  _, moments, error, message = cases[case]
  with pytest.raises(error, match=message):
    kernels.adam_step_(p, g, count=1, **moments, **HYPER)


def test_the_extension_checks_int8_arguments_itself():
  p, g = np.zeros(300, np.float32), np.zeros(300, np.float32)
  q = quant8.zeros((300,))
  scalars = np.zeros(native.NUM_ADAM_SCALARS, np.float32)
  int8 = native.DTYPE_CODES["int8"]
  with pytest.raises(TypeError, match="pairs"):
    native.adam_step(p, g, 0, q.codes, int8, p.copy(), 0, q.scales, q.scales.copy(), 300,
                     None, 1, scalars, False, 0)
  with pytest.raises(ValueError, match="mu_scale has 1 scales"):
    native.adam_step(p, g, 0, q.codes, int8, q.codes.copy(), int8, q.scales[:1],
                     q.scales.copy(), 300, None, 1, scalars, False, 0)
  with pytest.raises(ValueError, match="row must divide"):
    native.adam_step(p, g, 0, q.codes, int8, q.codes.copy(), int8, q.scales, q.scales.copy(),
                     7, None, 1, scalars, False, 0)
  with pytest.raises(ValueError, match="overlap"):
    native.adam_step(p, g, 0, q.codes, int8, q.codes, int8, q.scales, q.scales.copy(), 300,
                     None, 1, scalars, False, 0)
  with pytest.raises(TypeError, match="grad cannot be int8"):
    native.adam_step(p, q.codes.copy(), int8, q.codes, int8, q.codes.copy(), int8, q.scales,
                     q.scales.copy(), 300, None, 1, scalars, False, 0)


def test_the_optax_drop_in_keeps_int8_moments():
  """cpu_adamw(mu_dtype=int8, nu_dtype=int8): Int8Moment state, the
  reference's update eagerly and under jit, close to float32 moments'
  training; refused unpaired."""
  params = {"w": jnp.ones((3, 300)), "b": jnp.zeros((5,))}
  tx = jzo.cpu_adamw(1e-2, mu_dtype=INT8, nu_dtype=INT8, weight_decay=0.1)
  state = tx.init(params)
  assert isinstance(state.mu["w"], quant8.Int8Moment)
  assert state.mu["w"].codes.dtype == jnp.uint8 and state.nu["b"].scales.shape == (1,)
  fp32 = jzo.cpu_adamw(1e-2, weight_decay=0.1)
  p8, p32, state32 = params, params, fp32.init(params)
  rng = np.random.default_rng(0)
  update = jax.jit(tx.update)
  for _ in range(10):
    g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
    u, state = update(g, state, p8)
    p8 = optax.apply_updates(p8, u)
    u, state32 = fp32.update(g, state32, p32)
    p32 = optax.apply_updates(p32, u)
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), p32, params)
  apart = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), p8, p32)
  assert all(apart[k] < 0.05 * moved[k] for k in params)
  with pytest.raises(TypeError, match="pairs"):
    jzo.cpu_adamw(1e-3, mu_dtype=INT8)
  with pytest.raises(TypeError, match="holds float32 moments"):
    tx.update(g, fp32.init(params), params)


def test_the_engine_trains_with_int8_moments_and_resumes_exactly():
  """Offload with int8 host moments: training close to float32 moments'; a
  checkpoint loads into a new engine giving back the same codes and scales,
  and both continue alike. Device state is refused."""
  tx = lambda moments: jzo.cpu_adamw(1e-2, weight_decay=0.1, mu_dtype=moments,
                                     nu_dtype=moments)
  make = lambda moments, **kw: make_engine(loss_fn, init_params(), tx(moments), stage=2,
                                           mesh=mesh_of(8), **kw)
  int8, fp32 = make(INT8, offload="auto"), make(None, offload=True)
  assert isinstance(int8.host.mu["embed"], quant8.Int8Moment)
  data = batches(8)
  losses = [(float(int8.step(b).loss), float(fp32.step(b).loss)) for b in data[:6]]
  np.testing.assert_allclose(*zip(*losses), rtol=0.05)
  again = make(INT8, offload=True)
  again.load_state_dict(int8.state_dict())
  for a, b in zip(int8.host.arrays(), again.host.arrays()):
    np.testing.assert_array_equal(a, b)
  for b in data[6:]:
    assert float(int8.step(b).loss) == float(again.step(b).loss)
  with pytest.raises(ValueError, match="int8 moments are kept in host memory"):
    make(INT8, offload=0.5)


def test_a_streamed_update_of_int8_moments_equals_the_whole_one():
  """Spans of whole blocks of scales (ShardTransfer.spans with the block),
  many to a leaf, give the same weights and moments as one set of landing
  buffers."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((64, 300)) * 0.1, jnp.float32)}
  data = [{"x": jnp.asarray(rng.standard_normal((8, 64)), jnp.float32),
           "y": jnp.asarray(rng.standard_normal((8, 300)), jnp.float32)} for _ in range(3)]
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
  make = lambda limit: jzo.ZeroEngine(loss, params,
                                      jzo.cpu_adamw(1e-2, mu_dtype=INT8, nu_dtype=INT8),
                                      options=jzo.EngineOptions(stage=2, offload=True,
                                                                landing_limit=limit),
                                      mesh=mesh_of(2))
  whole, streamed = make(None), make(1024)
  assert streamed.plan.streamed
  spans = streamed.host_update.transfer.spans(0, 256, quant8.QUANT_BLOCK)
  assert len(spans) > 10 and all(lo % quant8.QUANT_BLOCK == 0 for lo, _ in spans)
  for b in data:
    assert float(whole.step(b).loss) == float(streamed.step(b).loss)
  for a, b in zip(whole.host.arrays(), streamed.host.arrays()):
    np.testing.assert_array_equal(a, b)


def test_the_planner_counts_two_bytes_of_int8_moments():
  shapes = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  kw = dict(device_memory=2**34, host_memory=2**34)
  int8 = jzo.estimate(shapes, moments="int8", **kw)
  fp32 = jzo.estimate(shapes, moments="fp32", offload=True, **kw)
  assert int8.plan.cpu_adam and not int8.plan.has_device_state
  assert int8.plan.host_bytes()["moments"] == 2 * 1024 * 1024
  assert fp32.plan.host_bytes()["moments"] == 8 * 1024 * 1024
  with pytest.raises(ValueError, match="int8 moments are kept in host memory"):
    jzo.estimate(shapes, moments="int8", offload=False, **kw)
