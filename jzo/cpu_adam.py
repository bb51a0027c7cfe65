"""Adam and AdamW as optax transforms whose update runs in jzo's C++ kernel.

`cpu_adam` and `cpu_adamw` take the arguments of `optax.adam` and
`optax.adamw`, with the same names and defaults, and compute the same
update. Where the arrays live on the CPU (eagerly or under `jit`), the update
is one pass of the fused host kernel through an XLA FFI custom call; traced
for an accelerator, the same math runs as ordinary XLA operations, so the
transform is a drop-in anywhere.

Differences from optax, all deliberate:
  * Gradients are upcast to float32 before any arithmetic (optax forms
    `(1 - b1) * g` in the gradient's dtype).
  * Moments are float32 unless `mu_dtype`/`nu_dtype` ask for bfloat16 (optax
    keeps them in the params' dtype).
  * Updates are float32 whatever the params' dtype.
  * Bias corrections are multiplied as reciprocals (one division per element
    instead of three); the result differs from optax by float32 rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jzo import kernels

_SUPPORTED_GRADS = tuple(jnp.dtype(d) for d in kernels.GRAD_DTYPES)
_SUPPORTED_MOMENTS = tuple(jnp.dtype(d) for d in kernels.MOMENT_DTYPES)


@dataclasses.dataclass(frozen=True)
class AdamHyperparams:
  """cpu_adamw's arguments, kept for the offload engine, which runs the same
  update itself on host-resident state (see jzo.offload)."""
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


class CpuAdamState(NamedTuple):
  """State of cpu_adam/cpu_adamw: the step count and both Adam moments."""
  count: jax.Array  # int32 scalar: updates applied so far
  mu: optax.Updates  # first moments, params' shapes, mu_dtype
  nu: optax.Updates  # second moments, params' shapes, nu_dtype


def _moment_dtype(name: str, dtype) -> jnp.dtype:
  dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
  if dtype not in _SUPPORTED_MOMENTS:
    raise TypeError(f"{name} must be float32 or bfloat16, got {dtype}")
  return dtype


def _xla_update(g, m, v, p, scalars, *, nesterov: bool):
  """The kernel's math as plain XLA operations (accelerators, reference)."""
  lr, b1, omb1, b2, omb2, eps, eps_root, wd, inv_bc1, inv_bc2, inv_bc1_next, grad_scale = scalars
  g = g.astype(jnp.float32) * grad_scale
  m_new = b1 * m.astype(jnp.float32) + omb1 * g
  v_new = b2 * v.astype(jnp.float32) + omb2 * (g * g)
  m_hat = b1 * (m_new * inv_bc1_next) + omb1 * (g * inv_bc1) if nesterov else m_new * inv_bc1
  x = m_hat / (jnp.sqrt(v_new * inv_bc2 + eps_root) + eps)
  if p is not None:
    x = x + wd * p.astype(jnp.float32)
  return -lr * x, m_new.astype(m.dtype), v_new.astype(v.dtype)


def _host_update(g, m, v, p, scalars, *, nesterov: bool):
  """The update through the C++ kernel (CPU backend only)."""
  p = jnp.zeros((0,), jnp.float32) if p is None else p.astype(jnp.float32)
  call = jax.ffi.ffi_call(
      kernels.ADAM_UPDATE_TARGET,
      (jax.ShapeDtypeStruct(g.shape, jnp.float32), jax.ShapeDtypeStruct(m.shape, m.dtype),
       jax.ShapeDtypeStruct(v.shape, v.dtype)),
      input_output_aliases={1: 1, 2: 2},  # moments updated in place
      vmap_method="sequential")
  return tuple(call(g, m, v, p, scalars, nesterov=nesterov))


def _update_leaf(g, m, v, p, scalars, nesterov: bool):
  def host(g, m, v, scalars, *p):
    return _host_update(g, m, v, p[0] if p else None, scalars, nesterov=nesterov)

  def xla(g, m, v, scalars, *p):
    return _xla_update(g, m, v, p[0] if p else None, scalars, nesterov=nesterov)

  args = (g, m, v, scalars) + (() if p is None else (p,))
  return jax.lax.platform_dependent(*args, cpu=host, default=xla)


def _check_leaf(path, g, m, v, p) -> None:
  where = jax.tree_util.keystr(path) or "<root>"
  if jnp.dtype(g.dtype) not in _SUPPORTED_GRADS:
    raise TypeError(f"gradient {where} has dtype {g.dtype}; cpu_adam takes float32, "
                    "bfloat16 or float16 gradients")
  for name, t in (("mu", m), ("nu", v)) + ((("params", p),) if p is not None else ()):
    if t.shape != g.shape:
      raise ValueError(f"gradient {where} has shape {g.shape} but {name} has {t.shape}")
  if p is not None and not jnp.issubdtype(p.dtype, jnp.floating):
    raise TypeError(f"params {where} has non-float dtype {p.dtype}")


def decay_flags(mask, tree):
  """Per-leaf bools, shaped like `tree`, from an optax-style weight-decay mask:
  None (all leaves), a tree of bools or a prefix of one, or a callable of the
  params that returns one."""
  if mask is None:
    return jax.tree.map(lambda _: True, tree)
  flags = mask(tree) if callable(mask) else mask
  # A prefix of the tree: spread each flag over its subtree.
  return jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: bool(flag), sub), flags, tree)


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
) -> optax.GradientTransformation:
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
    mu_dtype: dtype of the first moment: float32 (None, default) or bfloat16.
    weight_decay: decoupled weight decay rate, a float or a schedule.
    mask: a tree of booleans (or a prefix of one, or a callable of the params
      returning one); weight decay applies where True.
    nesterov: Nesterov momentum, as in optax.
    nu_dtype: dtype of the second moment: float32 (None, default) or bfloat16.
      bfloat16 moments halve the optimizer memory; they are rounded to nearest
      even after each update.

  Returns:
    An optax GradientTransformation; its updates are float32, to be applied
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
  no_decay = isinstance(weight_decay, (int, float)) and weight_decay == 0

  def init_fn(params):
    def zeros(dtype):
      return lambda p: jnp.zeros(jnp.shape(p), dtype, device=getattr(p, "sharding", None))
    return CpuAdamState(count=jnp.zeros([], jnp.int32),
                        mu=jax.tree.map(zeros(mu_dtype), params),
                        nu=jax.tree.map(zeros(nu_dtype), params))

  def update_fn(updates, state, params=None):
    if not isinstance(state, CpuAdamState):
      raise TypeError(f"state must be a CpuAdamState from this transform's init, "
                      f"got {type(state).__name__}")
    if not no_decay and params is None:
      raise ValueError("cpu_adamw with weight decay needs params: call update(grads, state, params)")
    if jax.tree.structure(updates) != jax.tree.structure(state.mu):
      raise ValueError("gradients and optimizer state have different tree structures: "
                       f"{jax.tree.structure(updates)} vs {jax.tree.structure(state.mu)}")
    if params is not None and jax.tree.structure(params) != jax.tree.structure(updates):
      raise ValueError("params and gradients have different tree structures")
    for name, tree, want in (("mu", state.mu, mu_dtype), ("nu", state.nu, nu_dtype)):
      for leaf in jax.tree.leaves(tree):
        if jnp.dtype(leaf.dtype) != want:
          raise TypeError(f"state.{name} holds {leaf.dtype}, this transform keeps {want}")

    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    wd = weight_decay(state.count) if callable(weight_decay) else weight_decay
    count_inc = optax.safe_increment(state.count)
    common = dict(lr=lr, b1=b1, b2=b2, eps=eps, eps_root=eps_root, count=count_inc)
    with_decay = kernels.adam_scalars(weight_decay=wd, **common)
    without_decay = kernels.adam_scalars(weight_decay=0.0, **common)

    if no_decay:
      decays = jax.tree.map(lambda _: False, updates)
    else:  # params and updates share one structure (checked above)
      decays = decay_flags(mask, params)
    p_tree = params if params is not None else jax.tree.map(lambda _: None, updates)

    def leaf(path, g, m, v, p, decay):
      _check_leaf(path, g, m, v, p)
      if decay:
        return _update_leaf(g, m, v, p, with_decay, nesterov)
      return _update_leaf(g, m, v, None, without_decay, nesterov)

    out = jax.tree_util.tree_map_with_path(
        leaf, updates, state.mu, state.nu, p_tree, decays,
        is_leaf=lambda x: x is None)
    treedef = jax.tree.structure(updates)
    flat = treedef.flatten_up_to(out)
    new_updates = treedef.unflatten([u for u, _, _ in flat])
    mu = treedef.unflatten([m for _, m, _ in flat])
    nu = treedef.unflatten([v for _, _, v in flat])
    return new_updates, CpuAdamState(count=count_inc, mu=mu, nu=nu)

  update_fn.adam_hyperparams = AdamHyperparams(
      learning_rate, b1, b2, eps, eps_root, 0.0 if no_decay else weight_decay, mask, nesterov,
      mu_dtype, nu_dtype)
  return optax.GradientTransformation(init_fn, update_fn)


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
) -> optax.GradientTransformation:
  """Adam computed by jzo's fused C++ kernel; a drop-in for :func:`optax.adam`.

  It is :func:`cpu_adamw` with no weight decay: see there for the arguments.
  """
  return cpu_adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay=0.0,
                   nesterov=nesterov, nu_dtype=nu_dtype)


def cpu_adamw_with(hyper: AdamHyperparams, mask) -> optax.GradientTransformation:
  """cpu_adamw with the hyperparameters `hyper` and another weight-decay mask
  (the offload engine resolves a mask of the full params into per-leaf bools
  before its optimizer sees flat shards)."""
  return cpu_adamw(hyper.learning_rate, hyper.b1, hyper.b2, hyper.eps, hyper.eps_root,
                   hyper.mu_dtype, hyper.weight_decay, mask, nesterov=hyper.nesterov,
                   nu_dtype=hyper.nu_dtype)
