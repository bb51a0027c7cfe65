"""Mixed precision: compute dtype and dynamic loss scaling.

fp16 has 5 exponent bits, so small gradients underflow unless the loss is
multiplied by a large factor first. Dynamic loss scaling (Micikevicius et
al., 2018) starts high, halves the scale and skips the step when a gradient
overflows, and doubles it after `growth_interval` clean steps. bf16 has
float32's exponent range and needs no scaling.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LossScale:
  """Dynamic loss scaling settings (DeepSpeed's defaults)."""
  init_scale: float = 2.0**16
  growth_interval: int = 1000  # clean steps before the scale doubles
  min_scale: float = 1.0

  def __post_init__(self):
    if not (self.init_scale >= 1.0 and self.min_scale >= 1.0):
      raise ValueError(f"loss scales must be >= 1, got {self}")
    if self.growth_interval < 1:
      raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")


class LossScaleState(NamedTuple):
  """Current loss scale and the clean steps since it last changed."""
  scale: jax.Array  # float32 scalar
  good_steps: jax.Array  # int32 scalar


def init_loss_scale(config: LossScale | None) -> LossScaleState:
  scale = 1.0 if config is None else config.init_scale
  return LossScaleState(jnp.float32(scale), jnp.int32(0))


def update_loss_scale(state: LossScaleState, finite: jax.Array,
                      config: LossScale | None) -> LossScaleState:
  """Halves the scale after an overflow, doubles it after enough clean steps."""
  if config is None:
    return state
  good = jnp.where(finite, state.good_steps + 1, 0)
  grow = good >= config.growth_interval
  scale = jnp.where(finite, jnp.where(grow, state.scale * 2, state.scale),
                    jnp.maximum(state.scale / 2, config.min_scale))
  return LossScaleState(scale.astype(jnp.float32), jnp.where(grow, 0, good).astype(jnp.int32))


def resolve_precision(compute_dtype, loss_scale) -> tuple[jnp.dtype, LossScale | None]:
  """Checks the compute dtype; 'auto' loss scaling means dynamic for fp16 only."""
  dtype = jnp.dtype(compute_dtype)
  if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
    raise ValueError(f"compute_dtype must be bfloat16, float16 or float32, got {dtype}")
  if isinstance(loss_scale, str):
    if loss_scale != "auto":
      raise ValueError(f"loss_scale must be 'auto', None or a LossScale, got {loss_scale!r}")
    loss_scale = LossScale() if dtype == jnp.float16 else None
  elif loss_scale is not None and not isinstance(loss_scale, LossScale):
    raise TypeError(f"loss_scale must be 'auto', None or a LossScale, got {loss_scale!r}")
  return dtype, loss_scale
