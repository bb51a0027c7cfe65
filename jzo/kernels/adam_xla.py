"""Adam's arithmetic as XLA operations, in two forms: the C++ kernel's
(`xla_update`, `xla_step`: float32 arithmetic from float32, bfloat16 or int8
moments; what cpu_adamw runs traced for an accelerator, and the reference the
kernel is tested against) and optax's own (`optax_update`: in the leaf's
dtypes, for the float64, complex and float16 leaves the kernel does not take).
"""

import jax.numpy as jnp
import optax

from jzo.kernels import ops as kernels
from jzo.kernels import quant8


def _xla_moments(g, m, v, scalars):
  """The new moments in float32, before rounding to their storage dtype."""
  s = kernels.AdamScalars(*scalars)
  g = g.astype(jnp.float32) * s.grad_scale
  return (s.b1 * m.astype(jnp.float32) + s.one_minus_b1 * g,
          s.b2 * v.astype(jnp.float32) + s.one_minus_b2 * (g * g))


def xla_update_from_moments(g, m_new, v_new, p, scalars, *, nesterov: bool):
  """The float32 update from the new (float32) moments; p None: no weight decay."""
  s = kernels.AdamScalars(*scalars)
  if nesterov:
    m_hat = (s.b1 * (m_new * s.inv_bc1_next)
             + s.one_minus_b1 * (g.astype(jnp.float32) * s.grad_scale * s.inv_bc1))
  else:
    m_hat = m_new * s.inv_bc1
  x = m_hat / (jnp.sqrt(v_new * s.inv_bc2 + s.eps_root) + s.eps)
  if p is not None:
    x = x + s.weight_decay * p.astype(jnp.float32)
  return -s.lr * x


def xla_update(g, m, v, p, scalars, *, nesterov: bool):
  """The kernel's Adam update as plain XLA operations: what cpu_adamw runs
  traced for an accelerator, and the reference the kernel is tested against.

  Args:
    g, m, v: a leaf's gradient and moments (any shape; dtypes as the kernel's,
      or both `jzo.kernels.quant8.Int8Moment`s).
    p: its params (float32), or None for no weight decay.
    scalars: `jzo.kernels.adam_scalars(...)`.
    nesterov: Nesterov momentum.

  Returns:
    (float32 update, new mu, new nu), the moments in their own dtypes (or
    Int8Moments, as they came).
  """
  if isinstance(m, quant8.Int8Moment):
    m_new, v_new = _xla_moments(g, quant8.dequantize(m, signed=True),
                                quant8.dequantize(v, signed=False), scalars)
    u = xla_update_from_moments(g, m_new, v_new, p, scalars, nesterov=nesterov)
    return u, quant8.quantize(m_new, signed=True), quant8.quantize(v_new, signed=False)
  m_new, v_new = _xla_moments(g, m, v, scalars)
  u = xla_update_from_moments(g, m_new, v_new, p, scalars, nesterov=nesterov)
  return u, m_new.astype(m.dtype), v_new.astype(v.dtype)


def xla_step(g, m, v, p, scalars, *, nesterov: bool):
  """xla_update applied to p, as optax.apply_updates would."""
  u, m, v = xla_update(g, m, v, p, scalars, nesterov=nesterov)
  return p + u, m, v


def optax_update(g, m, v, p, *, lr, b1, b2, eps, eps_root, weight_decay, count,
                 nesterov: bool):
  """optax.adamw's own arithmetic for one leaf, in the leaf's dtypes: what
  cpu_adamw runs where the kernel does not take a leaf (float64, complex,
  float16 moments). Complex gradients fill nu with |g|^2, as optax's do.

  Args:
    g, m, v: a leaf's gradient and moments (any shape, float or complex).
    p: its params, or None for no weight decay.
    lr, weight_decay: their values at this step (floats or scalar arrays).
    b1, b2, eps, eps_root: Adam's hyperparameters.
    count: int32 step number after increment (1 on the first step).
    nesterov: Nesterov momentum.

  Returns:
    (update, new mu, new nu), the moments in their own dtypes, the update in
    the dtype the arithmetic gives it.
  """
  norm = g * g if jnp.isrealobj(g) else (g.conj() * g).real
  mu, nu = (1 - b1) * g + b1 * m, (1 - b2) * norm + b2 * v
  # Bias corrections formed in the count's float dtype, then divided in the moment's.
  debias = lambda t, b, t_count: t / (1 - b ** t_count).astype(t.dtype)
  if nesterov:
    mu_hat = (b1 * debias(mu, b1, optax.safe_increment(count))
              + (1 - b1) * debias(g, b1, count))
  else:
    mu_hat = debias(mu, b1, count)
  u = mu_hat / (jnp.sqrt(debias(nu, b2, count) + eps_root) + eps)
  if p is not None:
    u = u + weight_decay * p
  return jnp.asarray(-lr, u.dtype) * u, mu.astype(m.dtype), nu.astype(v.dtype)
