"""The engine's state to and from a tree of host arrays.

With jzo's Adam (offload on, any placement) the tree holds full-shape
float32 masters and moments, whatever lives where: a checkpoint loads into
any placement, device count or ZeRO stage of the same model. With another
optax transformation it holds the flat padded masters and that optimizer's
state as the devices keep them (same stage and device count to load).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jzo import step as step_lib
from jzo.offload import HostAdam
from jzo.partition import is_layout
from jzo.plan import Plan
from jzo.precision import LossScaleState
from jzo.step import EngineState


def _parts(plan: Plan, device_tree, host_tree, dtype):
  """Full-shape numpy leaves from each leaf's device part (global flat
  arrays, or None) and host part ((S, ..., k - c) numpy, or None)."""
  def one(layout, device, host):
    if device is None:
      device = np.zeros(layout.part_shape(0), dtype)
    if host is None:
      host = np.zeros((layout.shards,) + layout.local_shape[:-1] + (0,), dtype)
    return np.asarray(layout.unflatten(layout.join(jax.device_get(device), host)))
  none = jax.tree.map(lambda _: None, plan.layouts, is_leaf=is_layout)
  return jax.tree.map(one, plan.layouts, none if device_tree is None else device_tree,
                      none if host_tree is None else host_tree, is_leaf=is_layout)


def full_masters(plan: Plan, state: EngineState, host: HostAdam | None):
  """The float32 master weights in full shapes (numpy)."""
  if not plan.offload:
    flat = jax.device_get(state.master)
    return jax.tree.map(lambda l, m: np.asarray(l.unflatten(m)), plan.layouts, flat,
                        is_leaf=is_layout)
  return _parts(plan, state.master, host.master, np.float32)


def engine_state_dict(plan: Plan, state: EngineState, host: HostAdam | None,
                      steps_run: int) -> dict:
  """Host numpy arrays of everything needed to continue exactly: masters,
  optimizer state, loss scale and counters."""
  common = {"loss_scale": state.loss_scale.scale, "good_steps": state.loss_scale.good_steps,
            "step": state.step, "skipped": state.skipped,
            "steps_run": np.asarray(steps_run, np.int64)}
  if not plan.offload:
    return jax.device_get({**common, "master": state.master, "opt_state": state.opt_state})
  opt = state.opt_state
  count = host.count if plan.has_host_state else int(opt.count)
  return jax.device_get({
      **common, "master": full_masters(plan, state, host),
      "mu": _parts(plan, opt.mu if opt else None, host.mu, plan.mu_dtype),
      "nu": _parts(plan, opt.nu if opt else None, host.nu, host.hyper.nu_dtype),
      "count": np.asarray(count, np.int64)})


def _expected(plan: Plan, state: EngineState, host: HostAdam | None):
  """Shapes and dtypes `engine_state_dict` gives, without fetching anything."""
  scalars = {"loss_scale": np.float32, "good_steps": np.int32, "step": np.int32,
             "skipped": np.int32, "steps_run": np.int64}
  tree = {k: jax.ShapeDtypeStruct((), v) for k, v in scalars.items()}
  if not plan.offload:
    return {**tree, "master": state.master, "opt_state": state.opt_state}
  full = lambda dtype: jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape, dtype),
                                    plan.layouts, is_leaf=is_layout)
  return {**tree, "master": full(np.float32), "mu": full(host.hyper.mu_dtype),
          "nu": full(host.hyper.nu_dtype), "count": jax.ShapeDtypeStruct((), np.int64)}


def load_engine_state(plan: Plan, mesh: Mesh, tx, state: EngineState, host: HostAdam | None,
                      saved: dict) -> tuple[EngineState, int]:
  """The engine state (and steps run) from `engine_state_dict` output; host
  arrays are written in place.

  Raises:
    ValueError: the saved tree does not fit this engine, naming the entry.
  """
  mine = _expected(plan, state, host)
  if jax.tree.structure(mine) != jax.tree.structure(saved):
    raise ValueError("checkpoint does not match this engine's state: saved with other "
                     "options (stage, offload, optimizer or model)")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(mine), jax.tree.leaves(saved)):
    b = np.asarray(b)
    if np.shape(a) != b.shape or np.dtype(a.dtype) != b.dtype:
      raise ValueError(f"checkpoint entry {jax.tree_util.keystr(path)} is "
                       f"{b.dtype}{list(b.shape)}, this engine needs "
                       f"{np.dtype(a.dtype)}{list(np.shape(a))}")
  specs = step_lib.state_specs(plan, tx)
  put = lambda x, spec: jax.device_put(np.asarray(x), NamedSharding(mesh, spec))
  if plan.offload:
    flat = lambda tree: jax.tree.map(lambda l, x: l.flatten(np.asarray(x)), plan.layouts,
                                     tree, is_leaf=is_layout)
    masters = flat(saved["master"])
    master = opt_state = None
    device_parts = {}
    for name in ("master", "mu", "nu"):
      split = jax.tree.map(lambda l, x: l.split(x), plan.layouts, flat(saved[name]),
                           is_leaf=is_layout)
      device_parts[name] = jax.tree.map(lambda l, s: s[0], plan.layouts, split,
                                        is_leaf=is_layout)
      if host is not None:
        jax.tree.map(lambda l, dst, s: np.copyto(dst, s[1]), plan.layouts, getattr(host, name),
                     split, is_leaf=is_layout)
    count = int(saved["count"])
    if host is not None:
      host.count = count
    if plan.has_device_state:
      master = jax.tree.map(lambda x, s: put(np.array(x), s), device_parts["master"],
                            specs.master)
      mu_spec, nu_spec = specs.opt_state.mu, specs.opt_state.nu
      opt_state = state.opt_state._replace(
          count=put(np.int32(count), P()),
          mu=jax.tree.map(lambda x, s: put(np.array(x), s), device_parts["mu"], mu_spec),
          nu=jax.tree.map(lambda x, s: put(np.array(x), s), device_parts["nu"], nu_spec))
  else:
    masters = saved["master"]
    master = jax.tree.map(put, saved["master"], specs.master)
    opt_state = jax.tree.map(put, saved["opt_state"], specs.opt_state)
  lowp = jax.tree.map(lambda l, m, spec: put(step_lib.lowp_from_master(plan, l, m), spec),
                      plan.layouts, masters, specs.params, is_leaf=is_layout)
  scalar = lambda x: put(x, P())
  new = state._replace(
      params=lowp, master=master, opt_state=opt_state,
      loss_scale=LossScaleState(scalar(np.float32(saved["loss_scale"])),
                                scalar(np.int32(saved["good_steps"]))),
      step=scalar(np.int32(saved["step"])), skipped=scalar(np.int32(saved["skipped"])))
  return new, int(saved["steps_run"])
