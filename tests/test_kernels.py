"""The fused host kernel (jzo.kernels.adam_step_): results, determinism, bad input."""

import contextlib
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jzo
from jzo import native
from jzo import kernels

BF16 = ml_dtypes.bfloat16
X86_LEVELS = list(kernels.supported_simd_levels())
BEST = X86_LEVELS[0]


@contextlib.contextmanager
def simd(level):
  kernels.set_simd_level(level)
  try:
    yield
  finally:
    kernels.set_simd_level(BEST)


def host_state(n, grad_dtype=np.float32, moment_dtype=np.float32, seed=0):
  rng = np.random.default_rng(seed)
  p = rng.standard_normal(n, dtype=np.float32)
  g = rng.standard_normal(n, dtype=np.float32).astype(grad_dtype)
  m = (0.1 * rng.standard_normal(n, dtype=np.float32)).astype(moment_dtype)
  v = (0.01 * rng.random(n, dtype=np.float32)).astype(moment_dtype)
  return p, g, m, v


def copies(*arrays):
  return [a.copy() for a in arrays]


def to_jax(a):
  """A JAX array of a's current values. jnp.asarray may alias a numpy array or
  copy it asynchronously, so hand it a private copy: the kernel writes `a`."""
  return jnp.asarray(a.copy())


HYPER = dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05)


@pytest.mark.parametrize("grad_dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("n", [1, 7, 15, 17, 1023, 2**20 + 3])
def test_fused_step_matches_optax(n, grad_dtype):
  """Several in-place steps equal optax.adamw + apply_updates on float32 grads."""
  p, g, m, v = host_state(n, grad_dtype)
  opt = optax.adamw(HYPER["learning_rate"], weight_decay=HYPER["weight_decay"])
  ref_p = to_jax(p)
  ref_state = opt.init(ref_p)
  ref_state = (ref_state[0]._replace(mu=to_jax(m), nu=to_jax(v)),) + ref_state[1:]
  update = jax.jit(opt.update)
  lowp = np.empty(n, BF16)
  for count in range(1, 6):
    kernels.adam_step_(p, g, m, v, count=count, lowp_out=lowp, **HYPER)
    u, ref_state = update(jnp.asarray(g, jnp.float32), ref_state, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
  np.testing.assert_allclose(p, ref_p, rtol=1e-6, atol=1e-7)
  # Absolute terms: float32 rounding at the operands' scale (|g| ~ 1), since
  # fused multiply-adds round differently where b1 * m and (1 - b1) * g cancel.
  np.testing.assert_allclose(m, ref_state[0].mu, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(v, ref_state[0].nu, rtol=1e-6, atol=1e-9)
  np.testing.assert_array_equal(lowp, p.astype(BF16))


def test_fused_step_matches_cpu_adamw_bitwise(optimized_xla):
  """The offload kernel and the optax transform compute the same bits."""
  n = 70_001
  p, g, m, v = host_state(n, BF16)
  tx = jzo.cpu_adamw(3e-4, weight_decay=0.1, nesterov=True)
  state = jzo.CpuAdamState(jnp.int32(0), to_jax(m), to_jax(v))
  u, state = jax.jit(tx.update)(jnp.asarray(g), state, to_jax(p))
  kernels.adam_step_(p_k := p.copy(), g, m, v, learning_rate=3e-4, weight_decay=0.1,
                     nesterov=True, count=1)
  np.testing.assert_array_equal(p_k, np.asarray(optax.apply_updates(jnp.asarray(p), u)))
  np.testing.assert_array_equal(m, np.asarray(state.mu))
  np.testing.assert_array_equal(v, np.asarray(state.nu))


def test_step_at_any_count_matches_cpu_adamw_bitwise():
  """adam_step_ takes its bias corrections a block of counts at a time from
  one XLA call: its step equals cpu_adamw's at the same count, bit for bit,
  at the first counts, on either side of the powers of two a block could end
  at, past float32's exact integers and at the last count. bfloat16 moments
  keep cpu_adamw's update in the kernel too (float32 ones would have XLA form
  it), so only the scalars could differ; the weights start near zero with a
  learning rate of 1, so that a bias correction one ulp off shows in the new
  weights' bits."""
  n = 4099
  counts = [1, 2, 3, 1023, 1024, 1025, 4095, 4096, 4097, 5 * 1024 + 7, 2**24 + 1, 2**31 - 1]
  hyper = dict(eps=1e-8, eps_root=1e-12, weight_decay=0.05, nesterov=True)
  for b1, b2 in [(0.9, 0.999), (0.8, 0.95), (0.5, 0.9999)]:
    tx = jzo.cpu_adamw(1.0, b1=b1, b2=b2, mu_dtype=BF16, nu_dtype=BF16, **hyper)
    update = jax.jit(tx.update)
    for count in counts:
      p, g, m, v = host_state(n, moment_dtype=BF16, seed=count)
      p *= np.float32(1e-6)
      state = jzo.CpuAdamState(jnp.int32(count - 1), to_jax(m), to_jax(v))
      u, _ = update(jnp.asarray(g), state, to_jax(p))
      kernels.adam_step_(p_k := p.copy(), g, m, v, learning_rate=1.0, b1=b1, b2=b2,
                         count=count, **hyper)
      np.testing.assert_array_equal(p_k, np.asarray(optax.apply_updates(jnp.asarray(p), u)),
                                    err_msg=f"b1 {b1}, b2 {b2}, count {count}")


def test_grad_scale_is_applied_first():
  p, g, m, v = host_state(5000)
  p2, m2, v2 = copies(p, m, v)
  kernels.adam_step_(p, g, m, v, count=3, grad_scale=0.25, **HYPER)
  kernels.adam_step_(p2, g * np.float32(0.25), m2, v2, count=3, **HYPER)
  np.testing.assert_array_equal(p, p2)
  np.testing.assert_array_equal(m, m2)
  np.testing.assert_array_equal(v, v2)


@contextlib.contextmanager
def prefetching(nbytes):
  before = kernels.prefetch_above()
  kernels.set_prefetch_above(nbytes)
  try:
    yield
  finally:
    kernels.set_prefetch_above(before)


# Hyperparameters beyond HYPER: each turns on another path of the update, where a
# compiler allowed to fuse a multiply and an add (-ffp-contract) would change bits.
PATHS = {"adamw": {}, "nesterov, eps_root, grad_scale": dict(nesterov=True, eps_root=1e-12,
                                                             grad_scale=0.5)}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("lowp_dtype", [BF16, np.float16])
@pytest.mark.parametrize("moment_dtype", [np.float32, BF16])
@pytest.mark.parametrize("grad_dtype", [np.float32, BF16, np.float16])
def test_same_bits_for_any_thread_count_simd_level_and_prefetch(grad_dtype, moment_dtype,
                                                                lowp_dtype, path):
  n = 5 * kernels_chunk() + 13  # several tasks and a ragged tail
  results = []
  for level, threads, above in itertools.product(X86_LEVELS, (1, 2, 3), (-1, 0)):
    p, g, m, v = host_state(n, grad_dtype, moment_dtype, seed=1)
    out = kernels.aligned_empty(n, lowp_dtype)  # aligned: the streamed copy, as the engine's
    with simd(level), prefetching(above):
      kernels.adam_step_(p, g, m, v, count=2, lowp_out=out, num_threads=threads, **HYPER,
                         **PATHS[path])
    results.append((level, threads, above, p, m, v, out))
  _, _, _, *first = results[0]
  for level, threads, above, *arrays in results[1:]:
    for a, b in zip(arrays, first):
      assert a.tobytes() == b.tobytes(), (level, threads, above)


def kernels_chunk():
  return 1 << 16  # kAdamChunk in ext/host_ops.h


@pytest.mark.parametrize("level", X86_LEVELS)
@pytest.mark.parametrize("lowp_dtype", [BF16, np.float16])
def test_low_precision_copy_rounds_like_numpy(level, lowp_dtype):
  """With lr = 0 the copy-out is a plain conversion: check the hard values."""
  f32 = np.finfo(np.float32)
  special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, f32.tiny, f32.tiny / 3,
                      -f32.tiny / 7, f32.max, 65504.0, 65520.0, 1e-7, 6e-8, 3e-8,
                      1.00390625, 1.01171875, 1.0 + 2**-9, 1.0 + 3 * 2**-9], np.float32)
  rng = np.random.default_rng(3)
  p = np.concatenate([special, rng.standard_normal(1000, dtype=np.float32) * 100])
  n = p.size
  g = np.zeros(n, np.float32)
  m = np.zeros(n, np.float32)
  v = np.zeros(n, np.float32)
  out = np.empty(n, lowp_dtype)
  with simd(level):
    kernels.adam_step_(p, g, m, v, count=1, learning_rate=0.0, lowp_out=out)
  with np.errstate(over="ignore"):  # f32 max overflows to inf in fp16, as expected
    want = p.astype(lowp_dtype)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
  ok = ~np.isnan(want)
  assert out[ok].view(np.uint16).tolist() == want[ok].view(np.uint16).tolist()


@pytest.mark.parametrize("level", X86_LEVELS)
@pytest.mark.parametrize("lowp_dtype", [BF16, np.float16])
def test_new_weights_written_over_the_gradient_equal_a_separate_copy(level, lowp_dtype):
  """lowp_out may be the gradient array itself (offload's landing buffer):
  every gradient is read before its weight is stored, at any alignment."""
  rng = np.random.default_rng(5)
  n = 3 * kernels_chunk() + 37  # several threads' ranges, a vector tail
  for offset in (0, 1, 7):
    base = rng.standard_normal(n + offset).astype(lowp_dtype)
    p0 = rng.standard_normal(n).astype(np.float32)
    m0 = np.abs(rng.standard_normal(n)).astype(np.float32) * 1e-2
    v0 = np.abs(rng.standard_normal(n)).astype(np.float32) * 1e-3
    (p1, m1, v1), (p2, m2, v2) = ([x.copy() for x in (p0, m0, v0)] for _ in range(2))
    grad = base[offset:].copy()
    separate = np.empty(n, lowp_dtype)
    in_place = base.copy()[offset:]  # a misaligned view, written over
    want_grad = in_place.copy()
    with simd(level):
      kernels.adam_step_(p1, grad, m1, v1, count=3, learning_rate=1e-2, weight_decay=0.1,
                         lowp_out=separate)
      kernels.adam_step_(p2, in_place, m2, v2, count=3, learning_rate=1e-2, weight_decay=0.1,
                         lowp_out=in_place)
    np.testing.assert_array_equal(grad, want_grad)  # same gradients went in
    for a, b in ((p1, p2), (m1, m2), (v1, v2)):
      np.testing.assert_array_equal(a, b)
    assert in_place.view(np.uint16).tolist() == separate.view(np.uint16).tolist()


def test_lowp_out_overlapping_the_gradient_in_part_is_refused():
  n = 64
  p, m, v = (np.zeros(n, np.float32) for _ in range(3))
  buf = np.ones(2 * n, BF16)
  with pytest.raises(ValueError, match="overlap"):
    kernels.adam_step_(p, buf[:n], m, v, count=1, learning_rate=1e-2, lowp_out=buf[n // 2:][:n])
  assert not p.any() and (buf == 1).all()


@pytest.mark.parametrize("level", X86_LEVELS)
def test_alignment_does_not_change_results(level):
  """Arrays starting at any element offset give the bits of aligned ones,
  whether or not the copy-out is aligned for streaming stores."""
  n = 3000
  p0, g0, m0, v0 = host_state(n, BF16)
  want = None
  with simd(level):
    for offset, lowp_shift in itertools.product(range(17), (0, 1)):
      arrays = []
      for a in (p0, g0, m0, v0):
        buf = kernels.aligned_empty(n + 16, a.dtype)[offset:offset + n]
        buf[...] = a
        arrays.append(buf)
      start = offset + lowp_shift
      lowp = kernels.aligned_empty(n + 17, BF16)[start:start + n]
      kernels.adam_step_(*arrays, count=4, lowp_out=lowp, **HYPER)
      got = [a.tobytes() for a in arrays + [lowp]]
      want = want or got
      assert got == want, (offset, lowp_shift)


def test_aligned_empty():
  for shape, dtype in (((3, 5), np.float32), (2**20 + 1, BF16), ((), np.float16)):
    a = kernels.aligned_empty(shape, dtype)
    assert a.ctypes.data % 4096 == 0 and a.flags.c_contiguous and a.flags.writeable
    assert a.shape == (shape if isinstance(shape, tuple) else (shape,)) and a.dtype == dtype
  assert kernels.aligned_empty(10, np.float32, alignment=64).ctypes.data % 64 == 0
  # An array of a huge page or more starts on one, so huge pages cover all of it.
  for count in (kernels.HUGE_PAGE // 4, 3 * kernels.HUGE_PAGE):
    assert kernels.aligned_empty(count, np.float32).ctypes.data % kernels.HUGE_PAGE == 0
  assert kernels.aligned_empty(kernels.HUGE_PAGE // 4 - 1, np.float32).ctypes.data % 4096 == 0
  with pytest.raises(ValueError, match="power of two"):
    kernels.aligned_empty(10, np.float32, alignment=48)


def test_parallel_copy():
  src = np.random.default_rng(0).standard_normal(3_000_001).astype(np.float32)
  dst = np.empty_like(src)
  kernels.parallel_copy(dst, src)
  np.testing.assert_array_equal(dst, src)
  # Misaligned ends and a ragged last chunk go through the streaming path too.
  raw_src = np.random.default_rng(1).integers(0, 255, 9 << 20, np.uint8)
  raw_dst = np.zeros_like(raw_src)
  kernels.parallel_copy(raw_dst[3:-5], raw_src[1:-7])
  np.testing.assert_array_equal(raw_dst[3:-5], raw_src[1:-7])
  assert not raw_dst[:3].any() and not raw_dst[-5:].any()
  with pytest.raises(ValueError, match="bytes"):
    kernels.parallel_copy(dst[:10], src)
  with pytest.raises(ValueError, match="read-only"):
    ro = src.copy()
    ro.setflags(write=False)
    kernels.parallel_copy(ro, src)


def test_thread_and_simd_settings():
  before = kernels.num_threads()
  kernels.set_num_threads(1)
  assert kernels.num_threads() == 1
  kernels.set_num_threads(before)
  for bad in (0, -2, 1.5, True):
    with pytest.raises(ValueError, match="num_threads"):
      kernels.set_num_threads(bad)
  with pytest.raises(ValueError, match="SIMD level"):
    kernels.set_simd_level("sse9")
  assert kernels.prefetch_above() == 32 << 20
  for bad in (-2, 1.5, True, "1"):
    with pytest.raises(ValueError, match="prefetch_above"):
      kernels.set_prefetch_above(bad)
  with prefetching(0):
    assert kernels.prefetch_above() == 0
  assert kernels.simd_level() in ("avx512", "avx2", "scalar")


def readonly(a):
  a = a.copy()
  a.setflags(write=False)
  return a


def bad_inputs():
  """(description, argument builder, error, message) for each bad input."""
  n = 100

  def case(**changes):
    def build():
      p, g, m, v = host_state(n)
      args = dict(param=p, grad=g, mu=m, nu=v, count=1, learning_rate=1e-3)
      args.update({k: (c(args) if callable(c) else c) for k, c in changes.items()})
      return args
    return build

  return [
      ("grad shape", case(grad=np.zeros(n + 1, np.float32)), ValueError, "grad has shape"),
      ("mu shape", case(mu=np.zeros((n, 1), np.float32)), ValueError, "mu has shape"),
      ("param dtype", case(param=np.zeros(n, np.float16)), TypeError, "param must be float32"),
      ("grad dtype", case(grad=np.zeros(n, np.int32)), TypeError, "grad must be"),
      ("grad float64", case(grad=np.zeros(n, np.float64)), TypeError, "grad must be"),
      ("nu dtype", case(nu=np.zeros(n, np.float16)), TypeError, "nu must be"),
      ("strided mu", case(mu=np.zeros(2 * n, np.float32)[::2]), ValueError, "mu must be C-contiguous"),
      ("read-only param", case(param=lambda a: readonly(a["param"])), ValueError, "param is read-only"),
      ("read-only nu", case(nu=lambda a: readonly(a["nu"])), ValueError, "nu is read-only"),
      ("jax array", case(mu=lambda a: jnp.asarray(a["mu"])), TypeError, "mu must be a numpy array"),
      ("list", case(grad=[0.0] * n), TypeError, "grad must be a numpy array"),
      ("nan lr", case(learning_rate=float("nan")), ValueError, "learning_rate"),
      ("negative lr", case(learning_rate=-1.0), ValueError, "learning_rate"),
      ("b1 = 1", case(b1=1.0), ValueError, "b1"),
      ("negative b2", case(b2=-0.5), ValueError, "b2"),
      ("nan eps", case(eps=float("nan")), ValueError, "eps"),
      ("negative decay", case(weight_decay=-0.1), ValueError, "weight_decay"),
      ("count 0", case(count=0), ValueError, "count"),
      ("inf grad_scale", case(grad_scale=float("inf")), ValueError, "grad_scale"),
      ("lowp dtype", case(lowp_out=np.zeros(n, np.float32)), TypeError, "lowp_out must be"),
      ("lowp shape", case(lowp_out=np.zeros(n - 1, BF16)), ValueError, "lowp_out has shape"),
      ("lowp overlaps param", case(lowp_out=lambda a: a["param"].view(BF16)[:n]),
       ValueError, "overlap"),
      ("mu is nu", case(nu=lambda a: a["mu"]), ValueError, "overlap"),
      ("zero threads", case(num_threads=0), ValueError, "num_threads"),
  ]


@pytest.mark.parametrize("build, error, message",
                         [c[1:] for c in bad_inputs()], ids=[c[0] for c in bad_inputs()])
def test_bad_input_is_refused_before_any_write(build, error, message):
  args = build()
  before = {k: np.array(v) for k, v in args.items() if isinstance(v, np.ndarray)}
  with pytest.raises(error, match=message):
    kernels.adam_step_(**args)
  for k, v in before.items():
    np.testing.assert_array_equal(np.asarray(args[k]), v)


def test_extension_refuses_read_only_and_converted_arrays():
  """The C++ boundary itself never takes a temporary copy of an output."""
  p, g, m, v = host_state(10)
  scalars = np.zeros(native.NUM_ADAM_SCALARS, np.float32)
  with pytest.raises(TypeError):  # read-only mu: no silent copy
    native.adam_step(p, g, 0, readonly(m), 0, v, 0, None, None, 1, None, 1, scalars, False, 0)
  with pytest.raises(TypeError):  # float64 param would need a converted copy
    native.adam_step(p.astype(np.float64), g, 0, m, 0, v, 0, None, None, 1, None, 1, scalars, False, 0)
  with pytest.raises(TypeError, match="storage"):  # f32 storage declared as bf16
    native.adam_step(p, g, 1, m, 0, v, 0, None, None, 1, None, 1, scalars, False, 0)
  with pytest.raises(ValueError, match="scalars"):
    native.adam_step(p, g, 0, m, 0, v, 0, None, None, 1, None, 1, scalars[:3], False, 0)


def ffi_case(target, aliases, n_scalars=native.NUM_ADAM_SCALARS):
  """Arguments and outputs of one call of `target` on 10 elements."""
  x = jnp.ones((10,), jnp.float32)
  scalars = jnp.zeros((n_scalars,), jnp.float32)
  if target == kernels.ADAM_MOMENTS_TARGET:
    args, results = (x, x, x, scalars), (x, x)
  else:  # update (update, mu, nu) and step (param, mu, nu): param is operand 3
    args, results = (x, x, x, x, scalars), (x, x, x)
  call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results],
                          input_output_aliases=aliases)
  kwargs = {} if target == kernels.ADAM_MOMENTS_TARGET else {"nesterov": False}
  return lambda: jax.block_until_ready(jax.jit(lambda *a: call(*a, **kwargs))(*args))


@pytest.mark.parametrize("target, aliases, n_scalars, message", [
    (kernels.ADAM_MOMENTS_TARGET, {}, 12, "mu and nu must alias"),
    (kernels.ADAM_MOMENTS_TARGET, {1: 0, 2: 1}, 3, "12 scalars"),
    (kernels.ADAM_UPDATE_TARGET, {}, 12, "mu and nu must alias"),
    (kernels.ADAM_STEP_TARGET, {1: 1, 2: 2}, 12, "param must alias"),
    (kernels.ADAM_STEP_TARGET, {3: 0, 1: 1, 2: 2}, 11, "12 scalars"),
])
def test_ffi_targets_refuse_calls_that_break_their_contract(target, aliases, n_scalars, message):
  """A custom call whose outputs would not overwrite their inputs fails
  naming the target, instead of writing where XLA does not expect."""
  with pytest.raises(jax.errors.JaxRuntimeError, match=f"{target}: .*{message}"):
    ffi_case(target, aliases, n_scalars)()
