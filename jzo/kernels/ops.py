"""Host kernels of jzo: the fused C++ Adam step and multi-threaded copies.

These work on numpy arrays in host memory and update them in place; the
offload engine calls them on the fp32 master weights and moments it owns.
`jzo.cpu_adam`/`jzo.cpu_adamw` are the optax face of the same kernel.

bf16 arrays are numpy arrays of `ml_dtypes.bfloat16` (what `np.asarray` of a
JAX bf16 array gives).
"""

from __future__ import annotations

import collections
import functools
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jzo import native
from jzo.kernels import quant8

# XLA FFI targets of the CPU backend (ext/ffi_adam.cc): the update for
# optax's contract, the moments alone, and the in-place step.
ADAM_UPDATE_TARGET = "jzo_adam_update"
ADAM_MOMENTS_TARGET = "jzo_adam_moments"
ADAM_STEP_TARGET = "jzo_adam_step"
for _target, _handler in ((ADAM_UPDATE_TARGET, native.adam_update_ffi),
                          (ADAM_MOMENTS_TARGET, native.adam_moments_ffi),
                          (ADAM_STEP_TARGET, native.adam_step_ffi)):
  jax.ffi.register_ffi_target(_target, _handler(), platform="cpu")

# The C++ side reads JZO_INT8_CODES as it loads (int8_codes); a name it does
# not know would leave the choice to the first int8 step's timing unnoticed.
INT8_CODES = ("gather", "computed")
if os.environ.get("JZO_INT8_CODES", INT8_CODES[0]) not in INT8_CODES:
  raise ValueError(f"JZO_INT8_CODES must be 'gather' or 'computed', got "
                   f"{os.environ['JZO_INT8_CODES']!r}")

# The C++ side's dtype codes (DType in ext/adam_kernel.h), by numpy dtype;
# 8-bit moments (Int8Moment) have their own.
_DTYPE_CODES = {np.dtype(jnp.dtype(name)): code for name, code in native.DTYPE_CODES.items()
                if name != quant8.INT8}
_INT8_CODE = native.DTYPE_CODES[quant8.INT8]
GRAD_DTYPES = tuple(_DTYPE_CODES)
# One Adam step's float32 scalars by name, in the order the kernel reads
# them (JZO_ADAM_SCALARS in ext/adam_kernel.h): `adam_scalars` lays them out,
# `AdamScalars(*scalars)` reads them back.
AdamScalars = collections.namedtuple("AdamScalars", native.ADAM_SCALARS)
MOMENT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))
LOWP_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def simd_level() -> str:
  """Instruction set the kernel runs with here: 'avx512', 'avx2' or 'scalar'."""
  return native.simd_level()


def supported_simd_levels() -> tuple[str, ...]:
  """The instruction sets the kernel can run with on this CPU, best first
  (the level in use is left as it is)."""
  current = simd_level()
  levels = tuple(level for level in ("avx512", "avx2", "scalar") if native.set_simd_level(level))
  native.set_simd_level(current)
  return levels


def set_simd_level(level: str) -> None:
  """Caps the instruction set (tests, benchmarks); the default is the best one.

  Raises:
    ValueError: the name is unknown or this CPU lacks that instruction set.
  """
  if not native.set_simd_level(level):
    raise ValueError(f"SIMD level {level!r} is unknown or unsupported on this CPU")


def int8_codes() -> str:
  """How the AVX-512 kernel finds int8 moments' codes here: 'gather' (from
  the index) or 'computed' (from the map's parts); 'unchosen' until the
  first int8 step, which times both on all its threads and keeps the faster.
  Both give the same codes."""
  return native.int8_codes()


def set_int8_codes(way: str) -> None:
  """Sets how the AVX-512 kernel finds int8 codes ('gather' or 'computed';
  JZO_INT8_CODES does the same for a whole process). For tests and
  benchmarks: the results are the same either way.

  Raises:
    ValueError: the name is neither.
  """
  if not native.set_int8_codes(way):
    raise ValueError(f"int8 codes are 'gather' or 'computed', got {way!r}")


def prefetch_above() -> int:
  """Bytes above which the kernel asks for its arrays' lines ahead of its
  loop (the int8 pass: the next block's), counting all its arrays together;
  default 32 MiB. The results are the same either way."""
  return native.prefetch_above()


def set_prefetch_above(nbytes: int) -> None:
  """Sets prefetch_above (for tests and benchmarks): 0 always prefetches, -1 never.

  Raises:
    ValueError: not an integer >= -1.
  """
  if not isinstance(nbytes, (int, np.integer)) or isinstance(nbytes, bool) or nbytes < -1:
    raise ValueError(f"prefetch_above must be an integer >= -1, got {nbytes!r}")
  native.set_prefetch_above(int(nbytes))


def num_threads() -> int:
  """Threads the host kernels use (the caller's thread included)."""
  return native.num_threads()


def set_num_threads(n: int) -> None:
  """Sets the threads the host kernels use; the default is the CPUs this process may use."""
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
    raise ValueError(f"num_threads must be an integer >= 1, got {n!r}")
  native.set_num_threads(int(n))


# The kernel computes in float32: a larger value would be inf there.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = 2**31 - 1  # the step count is int32, as in optax


def _real(name: str, value) -> float:
  """value as a float; TypeError unless it is a real number (a string is not)."""
  if isinstance(value, (str, bytes)):
    raise TypeError(f"{name} must be a real number, got {value!r}")
  try:
    return float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a real number, got {value!r}") from None


def _check_hyperparameter(name: str, value, *, upper: float | None = None) -> None:
  """Rejects NaN, infinite or negative concrete values, and values that
  become infinite or reach `upper` in float32 (traced ones pass)."""
  if isinstance(value, jax.core.Tracer) or callable(value):
    return
  x = _real(name, value)
  if not 0 <= x <= _FLOAT32_MAX:
    too_big = " (over float32's largest, 3.4e38)" if math.isfinite(x) and x > 0 else ""
    raise ValueError(f"{name} must be finite and >= 0, got {value!r}{too_big}")
  if upper is not None and np.float32(x) >= upper:
    in_f32 = f" ({np.float32(x)} in float32, the kernel's precision)" if x < upper else ""
    raise ValueError(f"{name} must be < {upper}, got {value!r}{in_f32}")


def check_adam_hyperparameters(*, learning_rate, b1, b2, eps, eps_root, weight_decay) -> None:
  """Validates Adam's hyperparameters; schedules and traced values are not checked."""
  _check_hyperparameter("learning_rate", learning_rate)
  _check_hyperparameter("b1", b1, upper=1.0)
  _check_hyperparameter("b2", b2, upper=1.0)
  _check_hyperparameter("eps", eps)
  _check_hyperparameter("eps_root", eps_root)
  _check_hyperparameter("weight_decay", weight_decay)


def adam_scalars(*, lr, b1, b2, eps, eps_root, weight_decay, count, grad_scale=1.0) -> jax.Array:
  """The float32 scalars of one Adam step, as the C++ kernel reads them
  (`AdamScalars` names them, in order).

  Bias corrections follow optax, bc = 1 - b ** count with count the 1-based
  step, but are passed as reciprocals (the kernel multiplies by them).

  Args:
    lr, b1, b2, eps, eps_root, weight_decay: hyperparameters (floats or arrays).
    count: int32 step number after increment (1 on the first step).
    grad_scale: factor applied to gradients first (1 / loss scale * clip).

  Returns:
    float32[len(AdamScalars._fields)]: lr, b1, 1-b1, b2, 1-b2, eps,
    eps_root, weight_decay, 1/bc1, 1/bc2, 1/bc1_next (for nesterov), grad_scale.
  """
  inv_bc1, inv_bc2, inv_bc1_next = _inverse_bias_corrections(b1, b2, count)
  # `1 - b` is formed before the cast, like optax's `(1 - b1) * g`.
  values = AdamScalars(
      lr=lr, b1=b1, one_minus_b1=1 - b1, b2=b2, one_minus_b2=1 - b2, eps=eps,
      eps_root=eps_root, weight_decay=weight_decay, inv_bc1=inv_bc1, inv_bc2=inv_bc2,
      inv_bc1_next=inv_bc1_next, grad_scale=grad_scale)
  return jnp.stack([jnp.asarray(v, jnp.float32) for v in values])


def _inverse_bias_corrections(b1, b2, count):
  """1 / (1 - b1 ** t), 1 / (1 - b2 ** t) and 1 / (1 - b1 ** (t + 1)) in
  float32 for int32 step counts t (any shape)."""
  # A float exponent, as jit makes of a traced count anyway: called eagerly,
  # an integer one would compile a new program for every step count.
  t = jnp.asarray(count, jnp.int32).astype(jnp.float32)
  return 1 / (1 - b1**t), 1 / (1 - b2**t), 1 / (1 - b1**(t + 1))


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _require_host_array(name: str, a, *, writable: bool) -> np.ndarray:
  if not isinstance(a, np.ndarray):
    raise TypeError(f"{name} must be a numpy array in host memory, got {type(a).__name__}")
  if not a.flags.c_contiguous:
    raise ValueError(f"{name} must be C-contiguous (got strides {a.strides})")
  if writable and not a.flags.writeable:
    raise ValueError(f"{name} is read-only; the kernel writes it in place")
  return a


def _payload(a: np.ndarray) -> np.ndarray:
  """The array as the C++ side takes it: float32 as is, 16-bit floats as uint16."""
  return a if a.dtype == np.float32 else a.view(np.uint16)


def adam_step_(param: np.ndarray, grad: np.ndarray, mu: np.ndarray | quant8.Int8Moment,
               nu: np.ndarray | quant8.Int8Moment, *,
               learning_rate: float, count: int, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, eps_root: float = 0.0, weight_decay: float = 0.0,
               nesterov: bool = False, grad_scale: float = 1.0,
               lowp_out: np.ndarray | None = None, num_threads: int | None = None) -> None:
  """One fused Adam(W) step on host arrays, in place.

  In one pass over memory: g = grad * grad_scale; Adam moments; update
  -lr * (m_hat / (sqrt(v_hat + eps_root) + eps) + weight_decay * param);
  param += update; optionally lowp_out = bf16/fp16(param). The result equals
  optax.adamw followed by optax.apply_updates on float32 gradients.

  Args:
    param: float32 master weights, any shape; updated in place.
    grad: gradients of param's size, float32, bfloat16 or float16.
    mu, nu: first and second moments of param's shape, float32 or bfloat16
      arrays, or both `jzo.kernels.quant8.Int8Moment`s of numpy arrays (8-bit codes
      and their blocks' scales along the last axis); updated in place.
    learning_rate, b1, b2, eps, eps_root, weight_decay, nesterov: as optax.adamw.
    count: 1-based index of this step (for the bias corrections), at most
      2**31 - 1 (int32, as optax counts).
    grad_scale: multiplies the gradients first (unscale and clip factor); any
      value finite in float32.
    lowp_out: optional bfloat16/float16 array of param's size that receives
      the new weights (for the device copy). It may be `grad` itself (the
      same memory, 16-bit): each gradient is read before its weight is
      written over it, so the landing buffer doubles as the staging buffer.
      Any other overlap between arrays is an error.
    num_threads: threads to use (default: `num_threads()`).

  Raises:
    TypeError, ValueError: naming the offending argument, before anything is
      written. Hyperparameters must stay finite (and b1, b2 below 1) in
      float32, the precision the kernel computes in.
  """
  _require_host_array("param", param, writable=True)
  _require_host_array("grad", grad, writable=False)
  if param.dtype != np.float32:
    raise TypeError(f"param must be float32 master weights, got {param.dtype}")
  if grad.dtype not in GRAD_DTYPES:
    raise TypeError(f"grad must be float32, bfloat16 or float16, got {grad.dtype}")
  int8 = [isinstance(x, quant8.Int8Moment) for x in (mu, nu)]
  if any(int8) and not all(int8):
    raise TypeError("int8 moments come in pairs: mu and nu must both be Int8Moments or neither")
  codes = lambda x: x.codes if isinstance(x, quant8.Int8Moment) else x
  if all(int8):
    for name, q in (("mu", mu), ("nu", nu)):
      _require_host_array(f"{name}.codes", q.codes, writable=True)
      _require_host_array(f"{name}.scales", q.scales, writable=True)
      if q.codes.dtype != np.uint8 or q.scales.dtype != np.float32:
        raise TypeError(f"{name} must hold uint8 codes and float32 scales, got "
                        f"{q.codes.dtype} and {q.scales.dtype}")
      if q.scales.shape != quant8.scale_shape(param.shape):
        raise ValueError(f"{name}.scales has shape {q.scales.shape}, param of shape "
                         f"{param.shape} needs {quant8.scale_shape(param.shape)}")
  else:
    for name, a in (("mu", mu), ("nu", nu)):
      _require_host_array(name, a, writable=True)
      if a.dtype not in MOMENT_DTYPES:
        raise TypeError(f"{name} must be float32 or bfloat16 (or an Int8Moment), got {a.dtype}")
  for name, a in (("grad", grad), ("mu", codes(mu)), ("nu", codes(nu))):
    if a.shape != param.shape:
      raise ValueError(f"{name} has shape {a.shape}, param has shape {param.shape}")
  if lowp_out is not None:
    _require_host_array("lowp_out", lowp_out, writable=True)
    if lowp_out.dtype not in LOWP_DTYPES:
      raise TypeError(f"lowp_out must be bfloat16 or float16, got {lowp_out.dtype}")
    if lowp_out.shape != param.shape:
      raise ValueError(f"lowp_out has shape {lowp_out.shape}, param has shape {param.shape}")
  hyper = dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
               weight_decay=weight_decay)
  for name, value in hyper.items():
    if callable(value):  # check_adam_hyperparameters lets schedules pass
      raise TypeError(f"{name} must be this step's value, not a schedule: got {value!r}")
  check_adam_hyperparameters(**hyper)
  if not _is_int(count) or not 1 <= count <= _INT32_MAX:
    raise ValueError(f"count must be an integer in [1, 2**31 - 1], got {count!r}")
  if not abs(_real("grad_scale", grad_scale)) <= _FLOAT32_MAX:
    raise ValueError(f"grad_scale must be finite in float32, got {grad_scale!r}")
  if num_threads is not None and (not _is_int(num_threads) or not 1 <= num_threads <= _INT32_MAX):
    raise ValueError(f"num_threads must be an integer in [1, 2**31 - 1], got {num_threads!r}")

  scalars = _host_scalars(float(learning_rate), float(b1), float(b2), float(eps),
                          float(eps_root), float(weight_decay), int(count), float(grad_scale))
  if all(int8):
    moments = (mu.codes, _INT8_CODE, nu.codes, _INT8_CODE, mu.scales, nu.scales,
               param.shape[-1] if param.ndim else 1)
  else:
    moments = (_payload(mu), _DTYPE_CODES[mu.dtype], _payload(nu), _DTYPE_CODES[nu.dtype],
               None, None, 1)
  native.adam_step(
      param, _payload(grad), _DTYPE_CODES[grad.dtype], *moments,
      None if lowp_out is None else _payload(lowp_out),
      _DTYPE_CODES[lowp_out.dtype] if lowp_out is not None else 1,
      scalars, bool(nesterov), int(num_threads or 0))


# Step counts whose bias corrections one XLA call computes: a call costs
# about as much as the kernel's pass over 2**16 parameters.
_COUNTS_PER_CALL = 1024


@functools.partial(jax.jit, static_argnames=("b1", "b2"))
def _bias_corrections_jit(first, *, b1, b2):
  counts = first + jnp.arange(_COUNTS_PER_CALL, dtype=jnp.int32)
  return jnp.stack(_inverse_bias_corrections(b1, b2, counts), axis=1)


@functools.lru_cache(maxsize=8)
def _bias_corrections(b1: float, b2: float, block: int) -> np.ndarray:
  """adam_scalars' inv_bc1, inv_bc2 and inv_bc1_next computed by XLA on the
  CPU, as cpu_adamw computes them, for the counts block x _COUNTS_PER_CALL
  onwards: float32 (_COUNTS_PER_CALL, 3). b1 and b2 stay Python floats
  (static), as in the optax path."""
  with jax.default_device(jax.local_devices(backend="cpu")[0]):  # this process's
    return np.asarray(_bias_corrections_jit(np.int32(block * _COUNTS_PER_CALL), b1=b1, b2=b2))


def _host_scalars(lr, b1, b2, eps, eps_root, weight_decay, count, grad_scale) -> np.ndarray:
  """adam_scalars for Python floats and an int count, without an XLA call
  for each new count: the bias corrections come a block of counts at a time
  (_bias_corrections), the rest are float32 roundings, as in adam_scalars."""
  inv_bc = _bias_corrections(b1, b2, count // _COUNTS_PER_CALL)[count % _COUNTS_PER_CALL]
  values = AdamScalars(
      lr=lr, b1=b1, one_minus_b1=1 - b1, b2=b2, one_minus_b2=1 - b2, eps=eps,
      eps_root=eps_root, weight_decay=weight_decay, inv_bc1=inv_bc[0], inv_bc2=inv_bc[1],
      inv_bc1_next=inv_bc[2], grad_scale=grad_scale)
  return np.array(values, np.float64).astype(np.float32)  # each rounded once, as by XLA


def accumulate_(acc: np.ndarray, grad: np.ndarray, *, add: bool,
                num_threads: int | None = None) -> tuple[float, bool]:
  """Sums one micro-batch's gradient into a float32 accumulator, in place.

  In one pass: acc = acc + float32(grad) (add=True), or acc = float32(grad)
  (add=False: the first micro-batch writes, so the accumulator needs no
  zeroing pass). The sums are float32, as the device's accumulation.

  Args:
    acc: float32 accumulator, any shape; written.
    grad: the gradient, of acc's size: float32, bfloat16 or float16.
    add: add into acc's values (else overwrite them).
    num_threads: threads to use (default: `num_threads()`).

  Returns:
    (sum of the new acc's squares, each square in float32 and summed in
    double across vectors; whether every new value is finite). The sum does
    not depend on the thread count; its last bits depend on the instruction
    set (the order of summation).

  Raises:
    TypeError, ValueError: naming the offending argument, before anything is
      written (dtype, size, non-contiguous or read-only acc, overlap).
  """
  _require_host_array("acc", acc, writable=True)
  _require_host_array("grad", grad, writable=False)
  if acc.dtype != np.float32:
    raise TypeError(f"acc must be float32, got {acc.dtype}")
  if grad.dtype not in GRAD_DTYPES:
    raise TypeError(f"grad must be float32, bfloat16 or float16, got {grad.dtype}")
  if grad.size != acc.size:
    raise ValueError(f"grad has {grad.size} elements, acc has {acc.size}")
  return native.accumulate(acc, _payload(grad), _DTYPE_CODES[grad.dtype], bool(add), None, 1,
                         _threads(num_threads))


def cast_(dst: np.ndarray, src: np.ndarray, *, num_threads: int | None = None) -> None:
  """dst = src rounded to dst's dtype (bfloat16 or float16, to nearest even,
  as the Adam kernel's `lowp_out`), from float32, in one multi-threaded pass.

  Raises:
    TypeError, ValueError: a wrong dtype or size, a read-only dst, overlap.
  """
  _require_host_array("dst", dst, writable=True)
  _require_host_array("src", src, writable=False)
  if src.dtype != np.float32:
    raise TypeError(f"src must be float32, got {src.dtype}")
  if dst.dtype not in LOWP_DTYPES:
    raise TypeError(f"dst must be bfloat16 or float16, got {dst.dtype}")
  if dst.size != src.size:
    raise ValueError(f"dst has {dst.size} elements, src has {src.size}")
  native.accumulate(None, src, _DTYPE_CODES[src.dtype], False, _payload(dst),
                  _DTYPE_CODES[dst.dtype], _threads(num_threads))


def _threads(num_threads) -> int:
  """num_threads checked, as the C++ side takes it (0: the default)."""
  if num_threads is not None and (not _is_int(num_threads) or not 1 <= num_threads <= _INT32_MAX):
    raise ValueError(f"num_threads must be an integer in [1, 2**31 - 1], got {num_threads!r}")
  return int(num_threads or 0)


HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page


def aligned_empty(shape, dtype, *, alignment: int = 4096) -> np.ndarray:
  """An uninitialized C-contiguous numpy array whose data starts on an
  `alignment`-byte boundary (a power of two; default one page), or on a
  huge page's (HUGE_PAGE) where the array spans one or more.

  numpy starts large arrays 16 bytes into a cache line, so every 64-byte
  vector access of the kernel would touch two lines; page alignment also
  suits pinning the buffer for DMA. numpy advises its large allocations
  into transparent huge pages, which cover only the huge-page-aligned part
  of an array: started on one, the whole array is covered, and the kernel
  ran 1.2x faster on arrays of 16-64 MiB on a 2-core EPYC (no change at 4
  and 256 MiB; docs/performance.md).
  """
  if alignment < 1 or alignment & (alignment - 1):
    raise ValueError(f"alignment must be a power of two, got {alignment}")
  dtype = np.dtype(dtype)
  count = math.prod(shape) if isinstance(shape, (tuple, list)) else int(shape)
  if count * dtype.itemsize >= HUGE_PAGE:
    alignment = max(alignment, HUGE_PAGE)
  raw = np.empty(count * dtype.itemsize + alignment, np.uint8)
  start = -raw.ctypes.data % alignment
  return raw[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


def parallel_copy(dst: np.ndarray, src: np.ndarray, *, num_threads: int | None = None) -> None:
  """Copies src into dst (same byte size, both C-contiguous) on several threads."""
  _require_host_array("dst", dst, writable=True)
  _require_host_array("src", src, writable=False)
  native.parallel_copy(dst, src, int(num_threads or 0))
