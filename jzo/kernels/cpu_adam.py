"""Adam and AdamW as optax transforms computed with jzo's C++ kernel.

`cpu_adam` and `cpu_adamw` take the arguments of `optax.adam` and
`optax.adamw`, with the same names and defaults, and keep optax's contract:
`update` takes (and ignores) the extra keyword arguments an optax chain
passes along (a `GradientTransformationExtraArgs`); `init` makes moments as
optax does (`mu_dtype`, else the params' dtype; uncommitted for uncommitted
params, so a jitted step compiles once); updates come back in the dtype
optax's arithmetic gives them (the gradients' where params, gradients and
moments share one); and every float or complex dtype optax trains is taken.

Where a leaf suits the kernel (float32, bfloat16 or float16 gradients and
params, float32 or bfloat16 moments) and the arrays live on the CPU (eagerly
or under `jit`), the fused host kernel updates the moments in place through
an XLA FFI custom call and XLA forms the update from them, in the same loop
as the caller's `optax.apply_updates` (36 bytes of memory traffic a float32
parameter; optax's own adamw moves 40). Traced for an accelerator, the same
math runs as ordinary XLA operations. With bfloat16 moments the kernel
writes the update out as well: it comes from the moments before rounding,
which only the kernel holds. Other leaves (float64, complex, float16
moments) run optax's own arithmetic as XLA operations, exactly.

`adamw_step` is the in-place variant for loops that own their step: update
and apply in one kernel pass (28 bytes a parameter).

Differences from optax on the kernel's leaves, deliberate:
  * Gradients are upcast to float32 before any arithmetic (optax forms
    `(1 - b1) * g` in the gradient's dtype); the update is rounded to its
    dtype once, at the end.
  * `mu_dtype`/`nu_dtype` int8 keeps block-wise quantized moments
    (`jzo.kernels.quant8`); `nu_dtype` is jzo's (optax keeps nu in the params'
    dtype).
  * Bias corrections are multiplied as reciprocals (one division per element
    instead of three); the result differs from optax by float32 rounding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jzo.kernels import ops as kernels
from jzo.kernels import quant8
from jzo.kernels.adam_xla import optax_update, xla_step, xla_update, xla_update_from_moments

# The moment dtypes by the names the recipe and the planner take (--moments).
MOMENT_DTYPES = {"fp32": jnp.dtype(jnp.float32), "bf16": jnp.dtype(jnp.bfloat16),
                 "int8": jnp.dtype(jnp.int8)}
# What the kernel takes: gradients and params (upcast), and float moments.
_KERNEL_GRADS = tuple(jnp.dtype(d) for d in kernels.GRAD_DTYPES)
_KERNEL_MOMENTS = tuple(jnp.dtype(d) for d in kernels.MOMENT_DTYPES)


@dataclasses.dataclass(frozen=True)
class AdamHyperparams:
  """cpu_adamw's arguments, kept for adamw_step and for the offload engine,
  which runs the same update itself on host-resident state (see jzo.host.update).

  `mu_dtype` and `nu_dtype` are the moments' dtypes over float32 params (the
  engine's float32 masters): those asked for, float32 where None was given.
  """
  learning_rate: optax.ScalarOrSchedule
  b1: float
  b2: float
  eps: float
  eps_root: float
  weight_decay: optax.ScalarOrSchedule
  mask: Any
  nesterov: bool
  mu_dtype: jnp.dtype
  nu_dtype: jnp.dtype
  mu_follows_params: bool = False  # mu_dtype None: mu takes each leaf's params' dtype
  nu_follows_params: bool = False

  def moment_dtype(self, name: str, params_dtype) -> jnp.dtype | None:
    """The dtype moment `name` ("mu" or "nu") holds over params of
    `params_dtype` (None where unknown: then None where it follows them)."""
    if getattr(self, f"{name}_follows_params"):
      return None if params_dtype is None else jnp.dtype(params_dtype)
    return getattr(self, f"{name}_dtype")


class CpuAdamTransform(optax.GradientTransformationExtraArgs):
  """What cpu_adam and cpu_adamw return: an optax GradientTransformationExtraArgs
  (the pair init, update; update takes and ignores extra keyword arguments)
  that also carries its arguments as `hyperparams`, for adamw_step and the
  offload engine, which run the same update themselves."""

  hyperparams: AdamHyperparams

  def __new__(cls, init, update, hyperparams: AdamHyperparams):
    tx = super().__new__(cls, init, update)
    tx.hyperparams = hyperparams
    return tx


class CpuAdamState(NamedTuple):
  """State of cpu_adam/cpu_adamw: the step count and both Adam moments."""
  count: jax.Array  # int32 scalar: updates applied so far
  mu: optax.Updates  # first moments, params' shapes, mu_dtype (None: params' dtype)
  nu: optax.Updates  # second moments, params' shapes, nu_dtype (None: params' dtype)


def _moment_dtype(name: str, dtype) -> jnp.dtype | None:
  """A moment dtype as asked for: None (the params'), int8 (quantized), or a
  float or complex dtype (canonical: float64 is float32 without x64)."""
  if dtype is None:
    return None
  try:
    canonical = jnp.dtype(jax.dtypes.canonicalize_dtype(dtype))
  except TypeError:
    canonical = None
  if canonical is None or not (quant8.is_int8(canonical)
                               or jnp.issubdtype(canonical, jnp.inexact)):
    raise TypeError(f"{name} must be a float or complex dtype, int8 or None, got {dtype!r}")
  return canonical


def _ffi(target: str, results, aliases: dict[int, int]):
  """The custom call `target` returning arrays shaped like `results`;
  `aliases` maps an operand's index to the output that overwrites it."""
  return jax.ffi.ffi_call(target, tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results),
                          input_output_aliases=aliases, vmap_method="sequential")


def _host_update(g, m, v, p, scalars, *, nesterov: bool):
  """The update through the C++ kernel (CPU backend only)."""
  if m.dtype == v.dtype == jnp.float32:
    # The kernel updates the moments in place (20 bytes a parameter) and XLA
    # forms the update from them in the loop of the caller's
    # optax.apply_updates (16 bytes): the update array is never written out
    # and read back, and needs no fresh buffer (whose first touch would cost
    # more than the pass itself).
    m, v = _ffi(kernels.ADAM_MOMENTS_TARGET, (m, v), {1: 0, 2: 1})(g, m, v, scalars)
    return xla_update_from_moments(g, m, v, p, scalars, nesterov=nesterov), m, v
  # bfloat16 moments: the update comes from the unrounded moments, which only
  # the kernel holds, so it writes the update out.
  p = jnp.zeros((0,), jnp.float32) if p is None else p.astype(jnp.float32)
  update = jax.ShapeDtypeStruct(g.shape, jnp.float32)
  return tuple(_ffi(kernels.ADAM_UPDATE_TARGET, (update, m, v), {1: 1, 2: 2})(
      g, m, v, p, scalars, nesterov=nesterov))


def _host_step(g, m, v, p, scalars, *, nesterov: bool):
  """p, m and v updated in place by the C++ kernel in one pass (CPU backend only)."""
  return tuple(_ffi(kernels.ADAM_STEP_TARGET, (p, m, v), {3: 0, 1: 1, 2: 2})(
      g, m, v, p, scalars, nesterov=nesterov))


# Compiled as one program when called eagerly (each operation of the XLA part
# would otherwise write its own fresh array); inlined under an outer jit.
@functools.partial(jax.jit, static_argnames=("host", "xla", "nesterov"))
def _on_platform(host, xla, g, m, v, p, scalars, nesterov: bool):
  """host(...) where the arrays live on the CPU, xla(...) elsewhere; p may be None."""
  def bind(fn):
    return lambda g, m, v, scalars, *p: fn(g, m, v, p[0] if p else None, scalars,
                                           nesterov=nesterov)

  args = (g, m, v, scalars) + (() if p is None else (p,))
  return jax.lax.platform_dependent(*args, cpu=bind(host), default=bind(xla))


def _kernel_takes(g, m, v, p) -> bool:
  """Whether the C++ kernel (or its XLA twin) updates this leaf: float32,
  bfloat16 or float16 gradient and params (p None: no weight decay), and
  float32 or bfloat16 moments, or int8 ones."""
  if jnp.dtype(g.dtype) not in _KERNEL_GRADS:
    return False
  if p is not None and jnp.dtype(p.dtype) not in _KERNEL_GRADS:
    return False
  return _is_int8(m) or (m.dtype in _KERNEL_MOMENTS and v.dtype in _KERNEL_MOMENTS)


def _update_dtype(g, m, v, p) -> jnp.dtype:
  """The dtype optax's arithmetic gives a leaf's update: its gradient's,
  moments' and (where weight decay applies, p not None) params' promoted."""
  held = lambda t: jnp.float32 if _is_int8(t) else t.dtype
  return jnp.result_type(g.dtype, held(m), held(v), *(() if p is None else (p.dtype,)))


def _check_leaf(path, g, m, v, p, want: tuple) -> None:
  """Raises for a leaf the update cannot take; `want` holds the dtypes mu and
  nu must hold (None: any)."""
  where = jax.tree_util.keystr(path) or "<root>"
  if not jnp.issubdtype(g.dtype, jnp.inexact):
    raise TypeError(f"gradient {where} has dtype {g.dtype}; cpu_adam takes float or complex "
                    "gradients")
  if _is_int8(m) and jnp.dtype(g.dtype) not in _KERNEL_GRADS:
    raise TypeError(f"gradient {where} has dtype {g.dtype}; int8 moments take float32, "
                    "bfloat16 or float16 gradients")
  for name, t in (("mu", m), ("nu", v)) + ((("params", p),) if p is not None else ()):
    if isinstance(t, quant8.Int8Moment):
      if t.scales.shape != quant8.scale_shape(g.shape):
        raise ValueError(f"gradient {where} has shape {g.shape} but {name}.scales has "
                         f"{t.scales.shape}, not {quant8.scale_shape(g.shape)}")
      t = t.codes
    if t.shape != g.shape:
      raise ValueError(f"gradient {where} has shape {g.shape} but {name} has {t.shape}")
  if p is not None and not jnp.issubdtype(p.dtype, jnp.inexact):
    raise TypeError(f"params {where} has dtype {p.dtype}, neither float nor complex")
  for name, t, dtype in (("mu", m, want[0]), ("nu", v, want[1])):
    held = jnp.dtype(jnp.int8) if _is_int8(t) else jnp.dtype(t.dtype)
    if dtype is not None and held != dtype:
      raise TypeError(f"state.{name} holds {held} moments at {where}, this transform keeps "
                      f"{dtype} there")


def _is_int8(x) -> bool:
  return isinstance(x, quant8.Int8Moment)


def decay_flags(mask, tree):
  """Per-leaf bools, shaped like `tree`, from an optax-style weight-decay mask:
  None (all leaves), a tree of bools or a prefix of one, or a callable of the
  params that returns one."""
  if mask is None:
    return jax.tree.map(lambda _: True, tree)
  flags = mask(tree) if callable(mask) else mask
  # A prefix of the tree: spread each flag over its subtree.
  return jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: bool(flag), sub), flags, tree)


def _no_decay(weight_decay) -> bool:
  return isinstance(weight_decay, (int, float)) and weight_decay == 0


class _Step(NamedTuple):
  """What one update's leaves share."""
  count: jax.Array  # int32 step number after increment: 1 on the first update
  lr: Any  # the learning rate at this step
  weight_decay: Any  # the weight decay rate at this step
  with_decay: jax.Array  # the kernel's scalars (kernels.adam_scalars)
  without_decay: jax.Array  # the same with weight decay 0

  def scalars(self, decay: bool) -> jax.Array:
    return self.with_decay if decay else self.without_decay


def _leaf_update(hyper: AdamHyperparams, step: _Step, g, m, v, p, decay: bool):
  """One leaf's (update, mu, nu): the kernel's where it takes the leaf, else
  optax's arithmetic; the update in optax's dtype (see _update_dtype)."""
  p = p if decay else None
  if _kernel_takes(g, m, v, p):
    host = xla_update if _is_int8(m) else _host_update
    u, m, v = _on_platform(host, xla_update, g, m, v, p, step.scalars(decay), hyper.nesterov)
  else:
    u, m, v = optax_update(g, m, v, p, lr=step.lr, b1=hyper.b1, b2=hyper.b2, eps=hyper.eps,
                           eps_root=hyper.eps_root, weight_decay=step.weight_decay,
                           count=step.count, nesterov=hyper.nesterov)
  return u.astype(_update_dtype(g, m, v, p)), m, v


def _apply_leaves(hyper: AdamHyperparams, leaf_fn, grads, state, params):
  """Checks the inputs, then runs one Adam step leaf by leaf.

  `leaf_fn(step, g, m, v, p, decay)` returns a leaf's (result, mu, nu),
  the result being its update or its new params; step is a `_Step`, p None
  where params were not given.

  Returns:
    (tree of the results, the new CpuAdamState).
  """
  if not isinstance(state, CpuAdamState):
    raise TypeError(f"state must be a CpuAdamState from this transform's init, "
                    f"got {type(state).__name__}")
  no_decay = _no_decay(hyper.weight_decay)
  if not no_decay and params is None:
    raise ValueError("cpu_adamw with weight decay needs params: call update(grads, state, params)")
  structure = lambda tree: jax.tree.structure(tree, is_leaf=_is_int8)
  if jax.tree.structure(grads) != structure(state.mu):
    raise ValueError("gradients and optimizer state have different tree structures: "
                     f"{jax.tree.structure(grads)} vs {structure(state.mu)}")
  if params is not None and jax.tree.structure(params) != jax.tree.structure(grads):
    raise ValueError("params and gradients have different tree structures")

  def at_count(value):
    return value(state.count) if callable(value) else value

  count_inc = optax.safe_increment(state.count)
  lr, weight_decay = at_count(hyper.learning_rate), at_count(hyper.weight_decay)
  common = dict(lr=lr, b1=hyper.b1, b2=hyper.b2, eps=hyper.eps, eps_root=hyper.eps_root,
                count=count_inc)
  step = _Step(count_inc, lr, weight_decay,
               kernels.adam_scalars(weight_decay=weight_decay, **common),
               kernels.adam_scalars(weight_decay=0.0, **common))

  if no_decay:
    decays = jax.tree.map(lambda _: False, grads)
  else:  # params and grads share one structure (checked above)
    decays = decay_flags(hyper.mask, params)
  p_tree = params if params is not None else jax.tree.map(lambda _: None, grads)

  def leaf(path, g, m, v, p, decay):
    p_dtype = None if p is None else p.dtype
    want = (hyper.moment_dtype("mu", p_dtype), hyper.moment_dtype("nu", p_dtype))
    _check_leaf(path, g, m, v, p, want)
    return leaf_fn(step, g, m, v, p, decay)

  out = jax.tree_util.tree_map_with_path(leaf, grads, state.mu, state.nu, p_tree, decays,
                                         is_leaf=lambda x: x is None)
  treedef = jax.tree.structure(grads)
  flat = treedef.flatten_up_to(out)
  results, mu, nu = ([leaf[i] for leaf in flat] for i in range(3))
  return treedef.unflatten(results), CpuAdamState(
      count=count_inc, mu=treedef.unflatten(mu), nu=treedef.unflatten(nu))


def cpu_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any | None = None,
    *,
    nesterov: bool = False,
    nu_dtype: Any | None = None,
) -> CpuAdamTransform:
  r"""AdamW with decoupled weight decay, computed by jzo's fused C++ kernel.

  Same arguments, defaults and update as :func:`optax.adamw`:

  .. math::
    m_t = b_1 m_{t-1} + (1 - b_1) g_t, \quad v_t = b_2 v_{t-1} + (1 - b_2) g_t^2 \\
    u_t = -\eta_t \left(\frac{m_t / (1 - b_1^t)}
          {\sqrt{v_t / (1 - b_2^t) + \epsilon_{root}} + \epsilon} + \lambda_t\, p_{t-1}\right)

  Args:
    learning_rate: a float or an optax schedule of the step count.
    b1, b2: decay rates of the first and second moments, in [0, 1).
    eps, eps_root: added outside and inside the square root.
    mu_dtype: dtype of the first moment: None (default) for the params'
      dtype, as optax; any float or complex dtype; or int8 (with nu_dtype
      int8 too).
    weight_decay: decoupled weight decay rate, a float or a schedule.
    mask: a tree of booleans (or a prefix of one, or a callable of the params
      returning one); weight decay applies where True.
    nesterov: Nesterov momentum, as in optax.
    nu_dtype: dtype of the second moment (optax has no such argument): None
      (default) for the params' dtype, as optax; a float or complex dtype; or
      int8. bfloat16 moments of float32 params halve the optimizer memory;
      they are rounded to nearest even after each update. int8 moments (both) quarter it: each
      moment is a `jzo.kernels.quant8.Int8Moment`, one byte a value and a float32
      scale per block of 256 along the last axis, quantized block-wise and
      dynamically (Dettmers et al. 2022; see jzo.kernels.quant8). The update comes
      from the moments before quantization.

  Returns:
    An optax GradientTransformationExtraArgs (a `CpuAdamTransform`, which
    keeps these arguments as `hyperparams`). Its updates have the dtype
    optax's would: the gradients', moments' and (where weight decay applies)
    params' promoted, so the gradients' dtype where all share it; apply them
    with `optax.apply_updates`.

  Example:
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0), jzo.cpu_adamw(3e-4))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)

  References:
    Loshchilov and Hutter, Decoupled Weight Decay Regularization, 2019.
    Ren et al., ZeRO-Offload: Democratizing Billion-Scale Model Training, 2021.
  """
  kernels.check_adam_hyperparameters(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                                     eps_root=eps_root, weight_decay=weight_decay)
  mu_dtype = _moment_dtype("mu_dtype", mu_dtype)
  nu_dtype = _moment_dtype("nu_dtype", nu_dtype)
  if quant8.is_int8(mu_dtype) != quant8.is_int8(nu_dtype):
    raise TypeError(f"int8 moments come in pairs: mu_dtype is {mu_dtype}, nu_dtype {nu_dtype}")
  float32 = jnp.dtype(jnp.float32)
  hyper = AdamHyperparams(learning_rate, b1, b2, eps, eps_root,
                          0.0 if _no_decay(weight_decay) else weight_decay, mask, nesterov,
                          mu_dtype or float32, nu_dtype or float32,
                          mu_follows_params=mu_dtype is None, nu_follows_params=nu_dtype is None)

  def init_fn(params):
    def zeros(dtype):
      def leaf(p):
        if quant8.is_int8(dtype):
          device = p.sharding if getattr(p, "committed", False) else None
          return quant8.zeros(jnp.shape(p), jnp, device=device)
        # As optax's: placed (and committed) as p is, so that uncommitted
        # params give uncommitted state and a jitted step compiles once.
        return jnp.zeros_like(p, dtype=dtype)
      return leaf
    return CpuAdamState(count=jnp.zeros([], jnp.int32),
                        mu=jax.tree.map(zeros(mu_dtype), params),
                        nu=jax.tree.map(zeros(nu_dtype), params))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # what an optax chain passes along for the transforms that want it
    def leaf(step, g, m, v, p, decay):
      return _leaf_update(hyper, step, g, m, v, p, decay)
    return _apply_leaves(hyper, leaf, updates, state, params)

  return CpuAdamTransform(init_fn, update_fn, hyper)


def cpu_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    *,
    nesterov: bool = False,
    nu_dtype: Any | None = None,
) -> CpuAdamTransform:
  """Adam computed by jzo's fused C++ kernel; a drop-in for :func:`optax.adam`.

  It is :func:`cpu_adamw` with no weight decay: see there for the arguments.
  """
  return cpu_adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay=0.0,
                   nesterov=nesterov, nu_dtype=nu_dtype)


def adamw_step(tx: optax.GradientTransformation, grads, state: CpuAdamState, params):
  r"""`tx.update` and `optax.apply_updates` as one in-place pass over memory.

  For loops that own their step: the same result as

  .. code-block:: python

    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)

  but on the CPU the C++ kernel reads each parameter's gradient, moments and
  weight once and writes the new weight and moments over the old ones (28
  bytes a float32 parameter, against 36 through the optax contract, which
  hands the update to `apply_updates`). Under `jax.jit` with params and state
  donated nothing is copied. Without donation XLA copies params and moments
  into fresh buffers first, and `tx.update` with `apply_updates` is faster:
  donate them. Traced for an accelerator, the same math runs as XLA
  operations.

  Args:
    tx: the transform returned by :func:`cpu_adamw` or :func:`cpu_adam` (not
      a chain: its hyperparameters, schedules and mask are used).
    grads: gradients, params' tree and shapes; float32, bfloat16 or float16.
    state: `tx.init(params)` or a state this function or `tx.update` returned.
    params: float32 params (the kernel updates float32 weights).

  Returns:
    (new params, new CpuAdamState).

  Raises:
    TypeError: `tx` is not a jzo Adam transform, or a dtype is unsupported.
    ValueError: trees or shapes do not match.

  Example:
    >>> tx = jzo.cpu_adamw(3e-4, weight_decay=0.1)
    >>> state = tx.init(params)
    >>> step = jax.jit(lambda p, s, g: jzo.adamw_step(tx, g, s, p), donate_argnums=(0, 1))
    >>> params, state = step(params, state, grads)
  """
  if not isinstance(tx, CpuAdamTransform):
    raise TypeError("adamw_step takes the transform jzo.cpu_adamw or jzo.cpu_adam returned "
                    f"(not an optax chain), got {type(tx).__name__}")
  if params is None:
    raise ValueError("adamw_step needs params: it returns them updated")
  for path, p in jax.tree_util.tree_leaves_with_path(params):
    if jnp.dtype(p.dtype) != jnp.float32:
      raise TypeError(f"params {jax.tree_util.keystr(path) or '<root>'} has dtype {p.dtype}; "
                      "adamw_step updates float32 params")

  hyper = tx.hyperparams

  def leaf(step, g, m, v, p, decay):
    if not _kernel_takes(g, m, v, p):  # moments of a dtype the kernel does not take
      u, m, v = _leaf_update(hyper, step, g, m, v, p, decay)
      return (p + u).astype(p.dtype), m, v  # as optax.apply_updates
    # The scalars carry weight decay 0 where the mask is False.
    host_step = xla_step if _is_int8(m) else _host_step
    return _on_platform(host_step, xla_step, g, m, v, p, step.scalars(decay), hyper.nesterov)
  return _apply_leaves(hyper, leaf, grads, state, params)


def cpu_adamw_with(hyper: AdamHyperparams, mask) -> CpuAdamTransform:
  """cpu_adamw with the hyperparameters `hyper` and another weight-decay mask
  (the offload engine resolves a mask of the full params into per-leaf bools
  before its optimizer sees flat shards)."""
  return cpu_adamw(hyper.learning_rate, hyper.b1, hyper.b2, hyper.eps, hyper.eps_root,
                   None if hyper.mu_follows_params else hyper.mu_dtype, hyper.weight_decay,
                   mask, nesterov=hyper.nesterov,
                   nu_dtype=None if hyper.nu_follows_params else hyper.nu_dtype)
