"""Where an engine keeps what its checkpoint holds, as jzo.checkpoint's
saving and loading modules both find it: Adam's state in an optax tree,
int8 moments on the host and their entries' names, each leaf's masters and
moments as `spans.Pieces`, and the process count that picks the format."""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from jzo.checkpoint.spans import Pieces
from jzo.host.transfer import host_memory_kind
from jzo.kernels import quant8
from jzo.kernels.cpu_adam import CpuAdamState
from jzo.parallel.partition import LeafLayout
from jzo.plan import Plan
from jzo.state.build import ZeroState
from jzo.step import EngineState


def several_processes() -> bool:
  """Whether the state is in several processes' format (ADAM_FLAT: global
  arrays of each process's shards). The saving and loading modules look it
  up on this module, so that replacing it here has one process write and
  read that format (the tests do)."""
  return jax.process_count() > 1


def is_adam(node) -> bool:
  """An Adam state node of an optax tree (optax's or jzo.cpu_adam's)."""
  return isinstance(node, (optax.ScaleByAdamState, CpuAdamState))


def is_count(path, x) -> bool:
  """A step count: an integer scalar in a field named count (a schedule's)."""
  return (bool(path) and getattr(path[-1], "name", None) == "count" and x.ndim == 0
          and np.issubdtype(x.dtype, np.integer))


def adam_on_devices(plan: Plan, state: EngineState):
  """The Adam state (count, mu and nu over flat shards) of an engine without
  offload whose optimizer keeps one Adam state beside step counts at most
  (jzo.cpu_adam(w), optax.adam/adamw, with a schedule); else None: other
  state (another optimizer's, injected hyperparameters) has no place in the
  full-shape format."""
  if plan.cpu_adam:
    return None
  leaves = jax.tree_util.tree_leaves_with_path(state.opt_state, is_leaf=is_adam)
  adams = [x for _, x in leaves if is_adam(x)]
  if len(adams) == 1 and all(is_adam(x) or is_count(path, x) for path, x in leaves):
    return adams[0]
  return None


def int8_moments(trained: ZeroState) -> bool:
  """The engine keeps int8 moments (on the host, with jzo's Adam)."""
  return trained.plan.cpu_adam and quant8.is_int8(trained.host.hyper.mu_dtype)


def codes_entry(name: str) -> str:
  """The entry of an int8 moment's codes in the ADAM format (name: mu or nu)."""
  return f"{name}_codes"


def scales_entry(name: str) -> str:
  """The entry of an int8 moment's scales in the ADAM format."""
  return f"{name}_scales"


def saved_moment_dtype(host, name: str) -> np.dtype:
  """The dtype moment `name` of a host state is saved in as values (int8: float32)."""
  dtype = getattr(host.hyper, f"{name}_dtype")
  return np.dtype(np.float32) if quant8.is_int8(dtype) else np.dtype(dtype)


def shard_sharding(plan: Plan, mesh: Mesh, layout: LeafLayout) -> NamedSharding:
  """Where a flat padded leaf's shards wait for orbax: in host memory when
  the devices have some (a GPU has no room for the offloaded state)."""
  kind = host_memory_kind(mesh.devices.flat[0])
  return NamedSharding(mesh, layout.spec(plan.axis), memory_kind=kind)


def adam_pieces(trained: ZeroState) -> dict:
  """ADAM's masters and moments as the engine holds them: per name, a list
  of `Pieces` a leaf, and the dtype each is saved in."""
  plan, state, host = trained.plan, trained.device, trained.host
  if plan.cpu_adam:
    opt = state.opt_state
    device = {"master": state.master, "mu": opt.mu if opt else None,
              "nu": opt.nu if opt else None}
    hosts = {name: quant8.leaves(getattr(host, name)) for name in ("master", "mu", "nu")}
    dtypes = {"master": np.dtype(np.float32),
              **{name: saved_moment_dtype(host, name) for name in ("mu", "nu")}}
  else:
    adam = adam_on_devices(plan, state)
    device = {"master": state.master, "mu": adam.mu, "nu": adam.nu}
    hosts = {name: [None] * len(plan.leaves) for name in device}
    dtypes = {name: np.dtype(jax.tree.leaves(device[name])[0].dtype) for name in device}
  out = {}
  for name, tree in device.items():
    leaves = jax.tree.leaves(tree) if tree is not None else [None] * len(plan.leaves)
    out[name] = ([Pieces(l, d if l.on_device else None, h, signed=name == "mu")
                  for l, d, h in zip(plan.leaves, leaves, hosts[name])], dtypes[name])
  return out
