"""The ZeRO training engine: data parallelism with partitioned optimizer
state (stage 1), gradients (stage 2) and parameters (stage 3).

One step is one jitted `shard_map` over the data axis of a mesh:

  forward/backward on the local batch with low-precision params
    -> stage 0: all-reduce the gradients (plain data parallelism)
       stage 1: accumulate full local gradients, then reduce-scatter once
       stage 2: reduce-scatter each micro-batch's gradients
       stage 3: params are gathered inside the loss (per layer with
                `gather_layer`), so autodiff reduce-scatters the gradients
    -> global-norm clip and unscale, optimizer on this device's float32
       master shard (skipped if any gradient is not finite)
    -> stages 0-2: all-gather the new low-precision params; stage 3 keeps shards.

Memory per device for Psi params with Adam (ZeRO paper, K = 12): stage 0
16 Psi; stage 1 4 Psi + 12 Psi / Nd; stage 2 2 Psi + 14 Psi / Nd; stage 3
16 Psi / Nd (`memory_per_device` measures it from the arrays).

The optimizer sees each leaf as a flat shard (see jzo.partition), so it must
be elementwise (adam, adamw, jzo.cpu_adamw, sgd, ...), and global-norm
clipping belongs to the engine (`max_grad_norm`), not to the optax chain,
whose clip would see one shard only.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jzo import offload as offload_lib
from jzo import partition, transfer
from jzo.cpu_adam import decay_flags
from jzo.partition import LeafLayout, is_layout
from jzo.precision import (LossScaleState, init_loss_scale, resolve_precision,
                           update_loss_scale)


class EngineState(NamedTuple):
  """Everything the engine keeps between steps (a pytree of global arrays)."""
  params: Any  # compute-dtype params for the forward: full (stages 0-2) or flat shards (3)
  master: Any  # float32 master weights, flat padded per leaf, sharded (stages 1-3)
  opt_state: Any  # the optax state of the master shards
  grads: Any  # gradient buffer: reduced full (0), local full (1), reduced shard (2, 3)
  loss_scale: LossScaleState
  step: jax.Array  # int32: optimizer steps applied
  skipped: jax.Array  # int32: steps skipped for non-finite gradients


class StepMetrics(NamedTuple):
  """What one step reports (device scalars: reading them waits for the step)."""
  loss: jax.Array  # mean loss over the global batch
  grad_norm: jax.Array  # global L2 norm of the unscaled gradients, before clipping
  loss_scale: jax.Array  # the loss scale this step used
  skipped: jax.Array  # bool: gradients were not finite, nothing was updated


class ZeroEngine:
  """Trains `loss_fn(params, batch) -> scalar` with ZeRO over a data axis.

  Args:
    loss_fn: mean loss of a batch; params is the pytree given here (in the
      compute dtype), batch the local slice of what `step` gets.
    params: initial parameters (any float dtype; kept as float32 masters).
    tx: an elementwise optax transformation (e.g. optax.adamw, jzo.cpu_adamw).
    mesh: a Mesh with axis `axis`; default all devices on one axis.
    axis: name of the data-parallel axis.
    stage: ZeRO stage, 0 (plain data parallelism) to 3.
    compute_dtype: dtype of the forward/backward: bfloat16, float16 or float32.
    loss_scale: 'auto' (dynamic for float16, none otherwise), None, or LossScale.
    grad_accum: micro-batches per step; the batch splits evenly into them.
    max_grad_norm: clip the global gradient norm to this (None: no clipping).
    layers: stage 3 only: dotted key path of the subtree that holds the stack
      of layers (leading axis = layer), which the model's scan gathers one
      layer at a time with `jzo.gather_layer`. Default: gather all at once.
    offload: ZeRO-Offload (stages 1-3): float32 masters and Adam moments of
      every shard live in host RAM and `tx` (jzo.cpu_adam or jzo.cpu_adamw)
      runs there in the C++ kernel; devices keep low-precision param shards.
    delayed_update: with offload, the paper's one-step delayed parameter
      update: step t's host update overlaps the device's step t + 1, whose
      gradients are computed on weights that lack update t.
    dpu_warmup: plain (not delayed) steps before delayed_update starts.
    host_memory: bytes of host RAM offload may use (default: what the OS
      reports available); the state is refused up front if it does not fit.
  """

  def __init__(self, loss_fn: Callable, params, tx: optax.GradientTransformation, *,
               mesh: Mesh | None = None, axis: str = "data", stage: int = 2,
               compute_dtype=jnp.bfloat16, loss_scale="auto", grad_accum: int = 1,
               max_grad_norm: float | None = None, layers: str | None = None,
               offload: bool = False, delayed_update: bool = False, dpu_warmup: int = 10,
               host_memory: int | None = None):
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
      raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
      raise ValueError(f"grad_accum must be an integer >= 1, got {grad_accum!r}")
    if max_grad_norm is not None and not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
      raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm!r}")
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
      raise TypeError(f"tx must be an optax GradientTransformation, got {type(tx).__name__}")
    if layers is not None and stage != 3:
      raise ValueError("layers= only applies to stage 3")
    hyper = getattr(tx.update, "adam_hyperparams", None)
    if offload and stage == 0:
      raise ValueError("offload needs ZeRO stage 1, 2 or 3 (stage 0 replicates the state)")
    if offload and hyper is None:
      raise TypeError("offload runs the optimizer on the host: tx must be jzo.cpu_adam or "
                      "jzo.cpu_adamw (clip with max_grad_norm, not an optax chain)")
    if delayed_update and not offload:
      raise ValueError("delayed_update needs offload=True")
    if not isinstance(dpu_warmup, int) or dpu_warmup < 0:
      raise ValueError(f"dpu_warmup must be an integer >= 0, got {dpu_warmup!r}")
    mesh = mesh if mesh is not None else Mesh(np.array(jax.devices()), (axis,))
    if axis not in mesh.axis_names:
      raise ValueError(f"mesh has axes {mesh.axis_names}, no axis named {axis!r}")
    if offload and mesh.devices.size != mesh.shape[axis]:
      raise ValueError(f"offload takes a mesh whose only axis of size > 1 is {axis!r}, "
                       f"got {dict(mesh.shape)}")
    leaves = jax.tree.leaves(params)
    if not leaves:
      raise ValueError("params has no leaves")
    for path, x in jax.tree_util.tree_leaves_with_path(params):
      if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"params leaf {jax.tree_util.keystr(path)} is {jnp.result_type(x)}, "
                        "not floating point")

    self.loss_fn, self.tx, self.mesh, self.axis, self.stage = loss_fn, tx, mesh, axis, stage
    self.compute_dtype, self.loss_scale_config = resolve_precision(compute_dtype, loss_scale)
    self.grad_accum, self.max_grad_norm = grad_accum, max_grad_norm
    self.offload, self.delayed_update, self.dpu_warmup = offload, delayed_update, dpu_warmup
    self.n_devices = mesh.shape[axis]
    # Stage 3 devices hold low-precision param shards, gathered inside the step.
    self._sharded_lowp = stage == 3
    shards = 1 if stage == 0 else self.n_devices
    self._layouts = partition.make_layouts(params, shards, layers)
    self._layer_layouts = _subtree(self._layouts, layers) if layers else None
    # Several micro-batches are summed in fp32 (see _local_step), and the
    # on-device optimizer keeps that sum. Offload ships it to the host rounded
    # once to the compute dtype, the precision one large batch's gradient has,
    # at half the bytes: that copy runs after the last backward, not during it.
    keep_fp32 = grad_accum > 1 and not offload
    self._grad_dtype = jnp.float32 if keep_fp32 else self.compute_dtype
    self._state_specs = self._make_state_specs()
    # The flat float32 masters are built on the host, so a device never holds
    # a float32 copy beside its share of the masters (with offload, none at
    # all); np.array copies, since an unpadded leaf would be a view of the caller's.
    host_masters = jax.tree.map(lambda l, x: np.array(l.flatten(np.asarray(x, np.float32))),
                                self._layouts, params, is_leaf=is_layout)
    self.state = self._init_state(host_masters)
    self._step_fns: dict = {}
    self.host = None
    if offload:
      self.host = offload_lib.HostAdam(
          self._layouts, host_masters, hyper, decay_flags(hyper.mask, params),
          np.dtype(self.compute_dtype), self._grad_dtype, host_memory)
    self._pending = None  # delayed update in flight: a Future of new param shards
    # Seconds of the last host update: waiting for the gradients (device
    # compute and device-to-host copy), the C++ update (its uploads overlap
    # it, leaf by leaf), and the uploads and gather still left after it.
    self.host_timings = {"wait_grads": 0.0, "update": 0.0, "upload": 0.0}
    self._transfer = None
    if offload:
      self._transfer = transfer.ShardTransfer(
          mesh, axis, self._layouts, None if self._sharded_lowp else self._state_specs.params)
      if mesh.devices.flat[0].platform != "cpu":  # the CPU backend has no DMA mapping
        self._transfer.map_for_dma(self.host.lowp)
    self._steps = 0  # steps run (offload: decides when delayed updates start)
    self._executor = concurrent.futures.ThreadPoolExecutor(1, "jzo-host-update")

  # ----------------------------------------------------------------- layout
  def _lowp_spec(self, layout: LeafLayout) -> P:
    return layout.spec(self.axis) if self._sharded_lowp else P()

  def _grad_spec(self, layout: LeafLayout) -> P:
    if self.stage == 1 and not self.offload:
      return P(self.axis)  # (Nd, *shape): each device's own unreduced gradients
    return layout.spec(self.axis)  # stage 0: replicated full; 2-3: shards

  def _opt_state_specs(self):
    """Specs of tx's state: shard-shaped leaves like the master, scalars replicated."""
    if self.offload:
      return None
    local = jax.tree.map(lambda lay: jax.ShapeDtypeStruct(lay.local_shape, jnp.float32),
                         self._layouts, is_leaf=is_layout)
    shapes = jax.eval_shape(self.tx.init, local)
    by_shape = {lay.local_shape: lay.spec(self.axis)
                for lay in jax.tree.leaves(self._layouts, is_leaf=is_layout)}

    def spec(x):
      if x.ndim == 0:
        return P()
      if tuple(x.shape) not in by_shape:
        raise ValueError(f"tx keeps a state leaf of shape {x.shape} that does not mirror the "
                         "params' shards; the ZeRO engine takes elementwise optimizers")
      return by_shape[tuple(x.shape)]
    return jax.tree.map(spec, shapes)

  def _make_state_specs(self) -> EngineState:
    lay = self._layouts
    on_layout = lambda f: jax.tree.map(f, lay, is_leaf=is_layout)
    return EngineState(
        params=on_layout(self._lowp_spec),
        master=None if self.offload else on_layout(lambda l: l.spec(self.axis)),
        opt_state=self._opt_state_specs(),
        grads=on_layout(self._grad_spec),
        loss_scale=LossScaleState(P(), P()), step=P(), skipped=P())

  def _init_state(self, host_masters) -> EngineState:
    """The first state from the flat float32 masters (numpy, global layout).
    Every buffer is new: the state is donated each step and must never alias
    the caller's arrays."""
    shard = lambda spec: NamedSharding(self.mesh, spec)
    specs = self._state_specs
    # Rounded on the host, as the host kernel and load_state_dict round.
    lowp = jax.tree.map(lambda l, m, spec: jax.device_put(self._lowp_from_master(l, m),
                                                          shard(spec)),
                        self._layouts, host_masters, specs.params, is_leaf=is_layout)
    master = None if self.offload else jax.tree.map(
        lambda m, spec: jax.device_put(m, shard(spec)), host_masters, specs.master)
    opt_state = None
    if not self.offload:
      init = jax.jit(jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=(specs.master,),
                                   out_specs=specs.opt_state))
      opt_state = init(master)

    def zero_grads(l, s):
      if self.stage == 1 and not self.offload:
        shape = (self.n_devices,) + l.shape
      else:
        shape = l.shape if self.stage == 0 else l.flat_shape
      return jax.device_put(jnp.zeros(shape, self._grad_dtype), shard(s))
    grads = jax.tree.map(zero_grads, self._layouts, specs.grads, is_leaf=is_layout)
    replicated = shard(P())
    put = lambda x: jax.device_put(x, replicated)
    return EngineState(lowp, master, opt_state, grads,
                       jax.tree.map(put, init_loss_scale(self.loss_scale_config)),
                       put(jnp.int32(0)), put(jnp.int32(0)))

  # ------------------------------------------------------------------- step
  def step(self, batch) -> StepMetrics:
    """One optimizer step on a global batch (leading axis: examples).

    The leading size must divide into devices x grad_accum micro-batches.
    """
    fn = self._compiled_step(batch)
    if not self.offload:
      self.state, metrics, _ = fn(self.state, batch)
      return metrics
    delayed = self.delayed_update and self._steps >= self.dpu_warmup
    self.state, metrics, grad_scale = fn(self.state._replace(grads=None), batch)
    self._steps += 1
    self._install_pending()  # update t-1: the weights of step t + 1
    update = (self.state.grads, metrics.skipped, grad_scale)
    if delayed:  # step t's host update overlaps the device's step t + 1
      self._pending = self._executor.submit(self._host_update, *update)
    else:
      self._install(self._host_update(*update))
    return metrics

  def lower(self, batch) -> jax.stages.Lowered:
    """The lowered step for `batch` (to read its HLO or compile it ahead)."""
    state = self.state._replace(grads=None) if self.offload else self.state
    return self._compiled_step(batch).lower(state, batch)

  # ---------------------------------------------------------------- offload
  def _host_update(self, grads, skipped, grad_scale):
    """Runs tx on the host over every shard; returns the new device param
    shards, or None for a skipped step. Blocks until the gradients arrive."""
    start = time.perf_counter()
    if bool(skipped):
      return None
    pieces = self._transfer.download(grads)
    waited = time.perf_counter()
    done = [waited]  # when the last leaf's update finished

    def leaves():
      yield from self.host.update_leaves(pieces, float(grad_scale))
      done[0] = time.perf_counter()
    params = self._transfer.upload_as_ready(leaves())
    self.host_timings = {"wait_grads": waited - start, "update": done[0] - waited,
                         "upload": time.perf_counter() - done[0]}
    return params

  def close(self) -> None:
    """Finishes a delayed update in flight and releases the host buffers' DMA mappings."""
    self._install_pending()
    if self._transfer is not None:
      self._transfer.close()

  def _offload_out_shardings(self):
    """The step's output shardings with the gradient shards in pinned host
    memory, so XLA copies them out at PCIe speed as soon as they are ready
    (CPU devices have a pinned-host memory too, so the tests take this path)."""
    named = lambda spec, kind=None: NamedSharding(self.mesh, spec, memory_kind=kind)
    specs = self._state_specs
    state = EngineState(
        params=jax.tree.map(named, specs.params), master=None, opt_state=None,
        grads=jax.tree.map(lambda s: named(s, "pinned_host"), specs.grads),
        loss_scale=LossScaleState(named(P()), named(P())), step=named(P()),
        skipped=named(P()))
    return state, StepMetrics(*[named(P())] * 4), named(P())

  def _install(self, params) -> None:
    if params is not None:
      self.state = self.state._replace(params=params)

  def _install_pending(self) -> None:
    """Waits for the delayed update in flight, if any, and uses its weights."""
    if self._pending is not None:
      pending, self._pending = self._pending, None
      self._install(pending.result())

  def _compiled_step(self, batch):
    leaves = jax.tree.leaves(batch)
    if not leaves:
      raise ValueError("batch has no arrays")
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
      raise ValueError(f"every batch array needs the same leading (example) axis, got {sizes}")
    (size,) = sizes
    parts = self.n_devices * self.grad_accum
    if size % parts:
      raise ValueError(f"batch of {size} examples does not split into {self.n_devices} devices "
                       f"x {self.grad_accum} micro-batches")
    key = jax.tree.structure(batch)
    if key not in self._step_fns:
      batch_specs = jax.tree.map(lambda _: P(self.axis), batch)
      in_state = self._state_specs._replace(grads=None) if self.offload else self._state_specs
      # check_vma=False: the replicated outputs (all-gathered params, psum'd
      # metrics) are equal on every device by construction; the spelling of
      # the invariant all-gather that would prove it differs across JAX versions.
      fn = jax.shard_map(self._local_step, mesh=self.mesh,
                         in_specs=(in_state, batch_specs),
                         out_specs=(self._state_specs, StepMetrics(P(), P(), P(), P()), P()),
                         check_vma=False)
      # Offload: nothing donated, since a delayed host update still reads the
      # previous step's gradients while the next step runs.
      out_shardings = self._offload_out_shardings() if self.offload else None
      self._step_fns[key] = jax.jit(fn, donate_argnums=() if self.offload else 0,
                                    out_shardings=out_shardings)
    return self._step_fns[key]

  def _local_step(self, state: EngineState, batch):
    axis, stage, n_dev, accum = self.axis, self.stage, self.n_devices, self.grad_accum
    scale = state.loss_scale.scale
    grad_fn = jax.value_and_grad(self._scaled_loss, has_aux=True)

    def micro_grads(mb):
      (_, loss), g = grad_fn(state.params, mb, scale)
      if stage == 2:  # reduce-scatter now, keep only this device's shard
        g = jax.tree.map(lambda l, x: jax.lax.psum_scatter(l.flatten(x), axis, tiled=True),
                         self._layouts, g, is_leaf=is_layout)
      return g, loss

    if accum == 1:
      grads, loss = micro_grads(batch)
    else:
      micro = jax.tree.map(lambda x: x.reshape((accum, -1) + x.shape[1:]), batch)

      def body(acc, mb):
        g, loss = micro_grads(mb)
        return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g), loss
      zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), jax.eval_shape(
          lambda: micro_grads(jax.tree.map(lambda x: x[0], micro))[0]))
      grads, losses = jax.lax.scan(body, zeros, micro)
      loss = losses.mean()

    # The gradient this device's optimizer shard needs, flat like the master.
    if stage == 0:
      grads = jax.tree.map(lambda x: jax.lax.psum(x, axis), grads)
      shard = jax.tree.map(lambda l, x: l.flatten(x), self._layouts, grads, is_leaf=is_layout)
      buffer = grads
    elif stage == 1:
      shard = jax.tree.map(lambda l, x: jax.lax.psum_scatter(l.flatten(x), axis, tiled=True),
                           self._layouts, grads, is_leaf=is_layout)
      buffer = shard if self.offload else jax.tree.map(lambda x: x[None], grads)
    else:
      shard = buffer = grads
    buffer = jax.tree.map(lambda x: x.astype(self._grad_dtype), buffer)

    sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(shard))
    # Offload checks what it ships (an fp16 rounding of an fp32 sum may overflow).
    checked = buffer if self.offload else shard
    bad = sum(jnp.sum(~jnp.isfinite(x)) for x in jax.tree.leaves(checked)).astype(jnp.float32)
    if stage > 0:  # shards: sum over devices (stage 0 holds the full reduced gradient)
      sq, bad = jax.lax.psum((sq, bad), axis)
    finite = (bad == 0) & jnp.isfinite(sq)
    grad_norm = jnp.sqrt(sq) / scale
    factor = 1.0 / scale
    if self.max_grad_norm is not None:
      factor = factor * jnp.minimum(1.0, self.max_grad_norm / (grad_norm + 1e-6))
    metrics = StepMetrics(loss=jax.lax.psum(loss, axis) / n_dev, grad_norm=grad_norm,
                          loss_scale=scale, skipped=~finite)
    counters = dict(loss_scale=update_loss_scale(state.loss_scale, finite, self.loss_scale_config),
                    step=state.step + finite.astype(jnp.int32),
                    skipped=state.skipped + (~finite).astype(jnp.int32))
    if self.offload:  # the host applies tx: ship the gradient shards and the factor
      return EngineState(state.params, None, None, buffer, **counters), metrics, factor

    # A select rather than lax.cond: XLA then fuses unscaling, the update, the
    # skip and the low-precision copy into one pass over each leaf (a cond
    # would materialise the float32 gradients and re-read the new masters).
    g32 = jax.tree.map(lambda x: x.astype(jnp.float32) * factor, shard)
    updates, new_opt_state = self.tx.update(g32, state.opt_state, state.master)
    keep_if_skipped = lambda new, old: jnp.where(finite, new, old)
    master = jax.tree.map(keep_if_skipped, optax.apply_updates(state.master, updates),
                          state.master)
    opt_state = jax.tree.map(keep_if_skipped, new_opt_state, state.opt_state)
    params = jax.tree.map(self._new_lowp, self._layouts, master, is_leaf=is_layout)
    return EngineState(params, master, opt_state, buffer, **counters), metrics, factor

  def _scaled_loss(self, lowp_params, batch, scale):
    """Local loss, scaled so that summing gradients over devices and
    micro-batches gives the gradient of the global mean loss (times scale)."""
    gathered = [False]

    def gather_one_layer(layer):
      gathered[0] = True
      try:
        return jax.tree.map(lambda l, x: l.gather_inner(x, self.axis), self._layer_layouts,
                            layer, is_leaf=is_layout)
      except ValueError as e:
        raise ValueError("gather_layer got a tree unlike one layer of the `layers` subtree: "
                         f"{e}") from e

    params = jax.tree.map(self._full_params, self._layouts, lowp_params, is_leaf=is_layout)
    try:
      if self._layer_layouts is not None:
        with partition.layer_gathering(gather_one_layer):
          loss = self.loss_fn(params, batch)
      else:
        loss = self.loss_fn(params, batch)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
      hint = ""
      if self._layer_layouts is not None and not gathered[0]:
        hint = (" (with stage 3 and layers=, each layer's params reach the scan as flat "
                "shards: the model must call jzo.gather_layer on them)")
      raise ValueError(f"loss_fn failed on the engine's params and batch: "
                       f"{type(e).__name__}: {e}{hint}") from e
    if jnp.shape(loss) != ():
      raise ValueError(f"loss_fn must return a scalar, got shape {jnp.shape(loss)}")
    if self._layer_layouts is not None and not gathered[0]:
      raise ValueError("stage 3 with layers= needs the model to call jzo.gather_layer on each "
                       "layer's params inside its scan")
    loss = loss.astype(jnp.float32)
    return loss * scale / (self.n_devices * self.grad_accum), loss

  def _full_params(self, layout: LeafLayout, lowp):
    """What loss_fn sees: sharded params are gathered (per-layer ones by the model)."""
    if not self._sharded_lowp or layout.per_layer:
      return lowp
    return layout.gather_inner(lowp, self.axis)

  def _new_lowp(self, layout: LeafLayout, master):
    lowp = master.astype(self.compute_dtype)
    if self._sharded_lowp:
      return lowp
    if self.stage > 0:
      lowp = jax.lax.all_gather(lowp, self.axis, tiled=True)
    return layout.unflatten(lowp)

  # ---------------------------------------------------------------- outputs
  @property
  def params(self):
    """The float32 master weights, gathered to full shapes (numpy arrays)."""
    if self.offload:
      self._install_pending()
      flat = self.host.full_params()
    else:
      flat = jax.device_get(self.state.master)
    return jax.tree.map(lambda l, m: np.asarray(l.unflatten(m)), self._layouts, flat,
                        is_leaf=is_layout)

  def state_dict(self) -> dict:
    """Everything needed to continue training exactly, as host numpy arrays:
    float32 masters, optimizer state (on the host with offload), loss scale
    and counters. A delayed update in flight is applied first."""
    return jax.device_get(self._state_tree())

  def _state_tree(self) -> dict:
    """state_dict()'s tree, device arrays not yet fetched (offload's host
    arrays are the live ones)."""
    s = self.state
    common = {"loss_scale": s.loss_scale.scale, "good_steps": s.loss_scale.good_steps,
              "step": s.step, "skipped": s.skipped,
              "steps_run": np.asarray(self._steps, np.int64)}
    if self.offload:
      self._install_pending()
      return {**common, "master": self.host.master, "mu": self.host.mu, "nu": self.host.nu,
              "host_count": np.asarray(self.host.count, np.int64)}
    return {**common, "master": s.master, "opt_state": s.opt_state}

  def load_state_dict(self, saved: dict) -> None:
    """Restores `state_dict()` output into this engine (same model, devices and options).

    Raises:
      ValueError: the saved state does not fit this engine (other shapes,
        stage, device count or optimizer).
    """
    mine = self._state_tree()  # shapes and dtypes only: nothing is fetched
    if jax.tree.structure(mine) != jax.tree.structure(saved):
      raise ValueError("checkpoint does not match this engine's state: saved with other "
                       "options (stage, offload, optimizer or model)")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(mine), jax.tree.leaves(saved)):
      b = np.asarray(b)
      if np.shape(a) != b.shape or a.dtype != b.dtype:
        raise ValueError(f"checkpoint entry {jax.tree_util.keystr(path)} is "
                         f"{b.dtype}{list(b.shape)}, this engine needs "
                         f"{a.dtype}{list(np.shape(a))}")
    put = lambda x, spec: jax.device_put(np.asarray(x), NamedSharding(self.mesh, spec))
    if self.offload:
      for name in ("master", "mu", "nu"):
        jax.tree.map(np.copyto, getattr(self.host, name), saved[name])
      self.host.count = int(saved["host_count"])
      master = jax.tree.map(offload_lib.join_shards, self._layouts, self.host.master,
                            is_leaf=is_layout)
      opt_state = None
    else:
      master = jax.tree.map(put, saved["master"], self._state_specs.master)
      opt_state = jax.tree.map(put, saved["opt_state"], self._state_specs.opt_state)
    lowp = jax.tree.map(lambda l, m, spec: put(self._lowp_from_master(l, m), spec),
                        self._layouts, master, self._state_specs.params, is_leaf=is_layout)
    scalar = lambda x: put(x, P())
    self.state = self.state._replace(
        params=lowp, master=None if self.offload else master, opt_state=opt_state,
        loss_scale=LossScaleState(scalar(saved["loss_scale"]), scalar(saved["good_steps"])),
        step=scalar(saved["step"]), skipped=scalar(saved["skipped"]))
    self._steps = int(saved["steps_run"])

  def _lowp_from_master(self, layout: LeafLayout, master) -> np.ndarray:
    """The compute-dtype params the forward uses, from a flat float32 master
    (the same rounding as the step and the host kernel: to nearest even)."""
    lowp = np.asarray(master).astype(self.compute_dtype)
    return lowp if self._sharded_lowp else np.asarray(layout.unflatten(lowp))

  def memory_per_device(self) -> dict[str, int]:
    """Bytes device 0 holds in its own memory for params, gradients and
    optimizer state (master weights included), read from the arrays' shards."""
    def nbytes(tree):  # arrays in device memory (offload's gradients are in pinned host)
      return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)
                 if x.sharding.memory_kind != "pinned_host")
    s = self.state
    return {"params": nbytes(s.params), "grads": nbytes(s.grads),
            "optimizer": nbytes(s.master) + nbytes(s.opt_state)}

  def host_memory(self) -> int:
    """Bytes of host RAM the offloaded state holds (0 without offload)."""
    if self.host is None:
      return 0
    arrays = [self.host.master, self.host.mu, self.host.nu]
    if self.host.lowp is not self.host.master:
      arrays.append(self.host.lowp)
    return sum(x.nbytes for tree in arrays for x in jax.tree.leaves(tree))


def _subtree(tree, path: str):
  """The subtree at dotted key path `path` (dict keys or attributes)."""
  node = tree
  for name in path.split("."):
    if isinstance(node, dict) and name in node:
      node = node[name]
    elif hasattr(node, name):
      node = getattr(node, name)
    else:
      raise ValueError(f"layers={path!r}: no {name!r} in the params tree")
  return node
