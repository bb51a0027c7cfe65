"""`ZeroEngine`: the object users hold. It makes the plan (jzo.plan), builds
the state leaf by leaf (jzo.state), picks the host update's mode once
(jzo.host.update), and drives each step: the jitted device step (jzo.step),
then the host update; the state lives in `engine.trained` (device part
`engine.state`, host part `engine.host`).

Memory per device for Psi params with Adam (ZeRO paper, K = 12): stage 0
16 Psi; stage 1 4 Psi + 12 Psi / Nd; stage 2 2 Psi + 14 Psi / Nd; stage 3
16 Psi / Nd (`memory_per_device` measures it from the arrays). With offload
the optimizer state of each shard is split between device and host memory
as the plan says (`engine.plan`, printable).

Under JAX's multi-process runtime the mesh spans every process's devices;
each process runs this same object over its own devices' shards (host
state, batches, checkpoint shards: see jzo.parallel.distributed).

The optimizer sees each leaf as a flat shard (see jzo.parallel.partition), so
it must be elementwise (adam, adamw, jzo.cpu_adamw, sgd, ...), and global-norm
clipping belongs to the engine (`max_grad_norm`), not to the optax chain,
whose clip would see one shard only.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jzo import plan as plan_lib, step as step_lib
from jzo.checkpoint import state_dict
from jzo.engine import batches
from jzo.engine.sources import leaf_sources, state_bytes_per_param
from jzo.host.accumulated import AccumulatedUpdate
from jzo.host.adam import HostAdam
from jzo.host.overlapped import OverlappedUpdate
from jzo.host.params_on_host import ParamsOnHostUpdate, StreamedParamsOnHostUpdate
from jzo.host.streamed import StreamedUpdate
from jzo.host.transfer import ShardTransfer, resolve_host_transfer
from jzo.host.update import HostUpdate
from jzo.host.whole import WholeUpdate
from jzo.kernels import quant8
from jzo.kernels.cpu_adam import MOMENT_DTYPES, CpuAdamTransform, cpu_adamw_with, decay_flags
from jzo.options import EngineOptions
from jzo.parallel import distributed
from jzo.state import build as state_lib
from jzo.step import EngineState, StepMetrics

class ZeroEngine:
  """Trains `loss_fn(params, batch) -> scalar` with ZeRO over a data axis.

  Args:
    loss_fn: mean loss of a batch; params is the pytree given here (in the
      compute dtype), batch one device's slice of the global batch.
    params: initial parameters (any float dtype; kept as float32 masters), or
      a function of no arguments that returns them: the engine then reads
      their shapes first (nothing drawn), checks the plan fits, and draws one
      leaf at a time on this process's first device, largest first (while
      its memory is emptiest), so no float32 copy of the model is ever whole
      and the host holds nothing but the state; or a tree of `jzo.HostLeaf`
      (lazy host arrays, e.g. a checkpoint's, see jzo.models.hf): the plan
      reads their shapes without loading, then each leaf is loaded, put on
      that device and let go before the next. Every process must give the
      same values.
    tx: an elementwise optax transformation (e.g. optax.adamw, jzo.cpu_adamw).
    options: what the engine does (jzo.EngineOptions: stage, offload,
      accumulation, ...; each field's documentation is there); default
      EngineOptions(). With int8 moments, offload "auto" is True.
    mesh: a Mesh with axis `axis`; default all devices (of all processes,
      each process's together) on one axis.
    axis: name of the data-parallel axis.
    host_memory: bytes of host RAM offload may use (default: what the OS
      reports available, plus the part of this process's runtime it already
      holds); the state is refused up front if it does not fit.
    checkpoint_memory: bytes of host RAM to count beside the offloaded state
      for a checkpoint's save while it writes (`jzo.checkpoint.SAVE_HOST_BYTES`
      where the engine will be saved; 0: not counted).
    device_memory: bytes of one device's memory (default: what its
      allocator reports; none on CPU, where nothing is checked).
    activation_memory: bytes one device needs at the step's peak besides
      params, gradients and optimizer state (activations, temporaries), for
      offload="auto" and the fit check (`jzo.estimate` computes it for GPTs).

  Attributes:
    plan: the layouts and placement (printable).
    options: the checked options (jzo.EngineOptions).
    tx: the optimizer as given.
    trained: the state (jzo.state.build.ZeroState): `state` is its device part,
      `host` its host part, and its step counter the only one.
    host_update: the mode of the host update the engine picked (a
      jzo.host.update.HostUpdate; None without state on the host): its
      `timings`, `landing_peak` and `in_flight` tell what it does.

  Raises:
    ValueError, TypeError: a bad option, naming it.
    MemoryError (jzo.plan.PlacementError): the plan does not fit the device
      or host memory; raised before any weight is drawn or state allocated.
  """

  def __init__(self, loss_fn: Callable, params, tx: optax.GradientTransformation,
               options: EngineOptions | None = None, *, mesh: Mesh | None = None,
               axis: str = "data", host_memory: int | None = None,
               device_memory: int | None = None, activation_memory: int = 0,
               checkpoint_memory: int = 0):
    options = EngineOptions() if options is None else options
    if not isinstance(options, EngineOptions):
      raise TypeError(f"options must be a jzo.EngineOptions, got {type(options).__name__}")
    int8 = isinstance(tx, CpuAdamTransform) and quant8.is_int8(tx.hyperparams.mu_dtype)
    if int8 and options.offload == "auto":
      options = dataclasses.replace(options, offload=True)  # int8 moments live on the host
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
      raise TypeError(f"tx must be an optax GradientTransformation, got {type(tx).__name__}")
    hyper = tx.hyperparams if isinstance(tx, CpuAdamTransform) else None
    offloading = options.offloading
    if offloading and hyper is None:
      raise TypeError("offload runs the optimizer on the host: tx must be jzo.cpu_adam or "
                      "jzo.cpu_adamw (clip with max_grad_norm, not an optax chain)")
    if offloading and not all(d in MOMENT_DTYPES.values()
                              for d in (np.dtype(hyper.mu_dtype), np.dtype(hyper.nu_dtype))):
      raise ValueError(f"offload's host Adam keeps float32, bfloat16 or int8 moments, got "
                       f"mu_dtype {np.dtype(hyper.mu_dtype)}, nu_dtype {np.dtype(hyper.nu_dtype)}")
    mesh = mesh if mesh is not None else distributed.default_mesh(axis)
    if axis not in mesh.axis_names:
      raise ValueError(f"mesh has axes {mesh.axis_names}, no axis named {axis!r}")
    if offloading and mesh.devices.size != mesh.shape[axis]:
      raise ValueError(f"offload takes a mesh whose only axis of size > 1 is {axis!r}, "
                       f"got {dict(mesh.shape)}")
    distributed.check_mesh(mesh, axis)
    # This process's devices: their shards' host state, batch rows and draws.
    self.positions = distributed.local_positions(mesh)
    device = mesh.devices.flat[self.positions[0]]
    shapes, draw_leaves, sliced_draws = leaf_sources(params, device)
    if offloading:
      state_bytes = np.dtype(hyper.mu_dtype).itemsize + np.dtype(hyper.nu_dtype).itemsize
    else:
      state_bytes = state_bytes_per_param(tx)
    limit = plan_lib.device_memory_limit(device)  # the allocator's, whatever the plan may use
    runtime = plan_lib.host_runtime_bytes(len(self.positions), device.platform, limit or 0)
    self.plan = plan_lib.make_plan(
        shapes, state_bytes, options, n_devices=mesh.shape[axis], axis=axis,
        device_memory=device_memory or limit,
        host_memory=(host_memory or plan_lib.host_memory_for(runtime)) if offloading else None,
        activations=activation_memory, processes=mesh.devices.size // len(self.positions),
        checkpoint_memory=checkpoint_memory, runtime_bytes=runtime, sliced_draws=sliced_draws)
    if int8 and self.plan.has_device_state:
      # The engine's device state is flat shards of float moments; int8
      # moments are for host RAM, where the C++ kernel runs them.
      raise ValueError("int8 moments are kept in host memory by the C++ kernel: use "
                       "offload=True (or 'auto'); this plan keeps optimizer state on the "
                       f"devices (offload={options.offload!r})")
    self.loss_fn, self.mesh, self.options = loss_fn, mesh, options
    self.tx = tx
    self.host_update: HostUpdate | None = None  # the host side, when the host holds state
    adam = None
    device_tx = tx
    if offloading:
      # The device part runs cpu_adamw with the mask resolved on the full
      # params (the step sees flat shards); the host part the same flags.
      decay = decay_flags(hyper.mask, shapes)
      device_tx = cpu_adamw_with(hyper, decay)
      adam = HostAdam(self.plan, hyper, decay, self.positions)
    pinned = False  # host copies through pinned host memory (jzo.host.transfer)
    if self.plan.has_host_state:
      pinned = resolve_host_transfer(options.host_transfer, device) == "pinned"
      if self.plan.offload_params and not pinned:
        raise ValueError(f"offload_params keeps the layers' weights in pinned host memory: "
                         f"{device.platform} devices have none here (host_transfer="
                         f"{options.host_transfer!r})")
      transfer = ShardTransfer(mesh, axis, self.plan.layouts, self.plan.grad_dtype,
                               pinned=pinned)
      transfer.reserve(self.plan.pinned_bytes())  # before the build pins its chunks
    self.trained = state_lib.build_state(self.plan, mesh, device_tx, draw_leaves, adam,
                                         pinned=pinned)
    # The step takes the stacked layers' new weights from pinned landing
    # buffers. Not on CPU devices: there XLA's runtime was seen to read them
    # before the step's callback allowed (tests/test_grads_in_params.py), and
    # the devices run on the cores the host update needs anyway.
    overlap = self.plan.overlaps_update and pinned and device.platform != "cpu"
    if self.plan.has_host_state:
      self.host_update = _host_update_for(self.plan, overlap)(self.trained, transfer)
    self._step_fns: dict = {}
    self._eval_fns: dict = {}
    self._full_params = None  # compute_params' gather, made at its first call
    self._closed = False

  @property
  def state(self) -> EngineState:
    """The device state (global arrays; see jzo.step.EngineState)."""
    return self.trained.device

  @property
  def overlaps_update(self) -> bool:
    """Each step's forward runs beside the last host update (see
    `overlap_forward`): `plan.overlaps_update`, with pinned transfers, on
    an accelerator."""
    return isinstance(self.host_update, OverlappedUpdate)

  @property
  def host(self) -> HostAdam | None:
    """The host parts' state and kernel (None without offload)."""
    return self.trained.host

  # ---------------------------------------------------------------- step
  def step(self, batch) -> StepMetrics:
    """One optimizer step on a batch (leading axis: examples): the global
    batch, or with several processes this process's rows of it (its
    devices' block; global arrays pass as they are).

    The leading size must divide into (this process's) devices x
    grad_accum micro-batches.

    Raises:
      RuntimeError: the engine is closed, or an earlier host update failed
        (its exception is the cause; the engine cannot go on).
    """
    if self.plan.host_accumulation:
      return self._accumulated_step(batch)
    delayed = self._delayed() if self.host_update is not None else False
    metrics, grad_scale = self._device_step(batch)
    if self.host_update is not None:
      grads = jax.tree.leaves(self.state.grads)
      self._set_device(grads=None)  # each freed once it is down
      self.host_update.after_step(grads, metrics.skipped, grad_scale, delayed=delayed)
    return metrics

  def _accumulated_step(self, batch) -> StepMetrics:
    """A step under host accumulation: a device call per micro-batch, each
    followed by its host parts' trip down and their sums on the host; then
    the end of the step on the devices with the host's sums of squares; then
    the host update (see jzo.step.accumulated and jzo.host.accumulated)."""
    delayed = self._delayed()
    metrics, grad_scale = self._micro_calls(batch, self.host_update)
    self.host_update.after_step(metrics.skipped, grad_scale, delayed=delayed)
    return metrics

  def _delayed(self) -> bool:
    """Whether the step about to run leaves its host update in flight: the
    delayed update, after dpu_warmup plain steps. (The devices' counters
    are read before the step starts: the last step's exchange waited for
    them already.)"""
    return self.plan.delayed_update and self.trained.steps_run + 1 > self.plan.dpu_warmup

  def _set_device(self, **parts) -> None:
    """Replaces parts of the device state."""
    self.trained.device = self.trained.device._replace(**parts)

  def _micro_calls(self, batch, host: AccumulatedUpdate | None
                   ) -> tuple[StepMetrics, jax.Array]:
    """The device calls of a host-accumulated step; host None drops the host
    parts' gradients (the device alone, as if they summed to zero)."""
    if self._closed:
      raise RuntimeError("this engine is closed: it runs no more steps")
    first, rest, finish = self._step_fn(batch)
    losses = []
    for j, micro in enumerate(self._micro_batches(batch)):
      self.trained.device, loss = (first if j == 0 else rest)(self.state,
                                                              self._on_mesh(micro))
      losses.append(loss)
      grads = jax.tree.leaves(self.state.grads)
      self._set_device(grads=None)
      if host is not None:
        host.accumulate(grads, first=j == 0)
      del grads
    n = len(self.positions)
    sq, bad = host.host_sums() if host is not None else (np.zeros(n, np.float32),) * 2
    per_device = NamedSharding(self.mesh, P(self.plan.axis))
    on_devices = lambda x: jax.make_array_from_process_local_data(per_device, x)
    self.trained.device, metrics, grad_scale = finish(
        self.state, on_devices(sq), on_devices(bad), sum(losses) / len(losses))
    return metrics, grad_scale

  def run_device_step(self, batch) -> tuple[StepMetrics, jax.Array]:
    """The device part of one step alone: forward, backward, the update of
    the device-resident state; the host parts' gradients stay in
    `state.grads` (under host accumulation they are dropped, each
    micro-batch's as the next one starts); returns (metrics, the host's
    grad scale). `step` calls it, then the host side; called alone (to
    time the device), the host parts' weights are not updated (with
    grads_in_params they are remade from the masters, which this waits for)."""
    if self.plan.host_accumulation:
      return self._micro_calls(batch, None)
    out = self._device_step(batch)
    if self.plan.grads_in_params:
      self._set_device(grads=None)
      self.host_update.restore_weights()
    return out

  def _device_step(self, batch) -> tuple[StepMetrics, jax.Array]:
    """run_device_step without host accumulation; with grads_in_params the
    params' layers then hold the step's gradients (the same arrays as
    `state.grads`' leaves) until the host side writes the weights back."""
    if self._closed:
      raise RuntimeError("this engine is closed: it runs no more steps")
    fn = self._step_fn(batch)
    batch = self._on_mesh(batch)
    if self.plan.cpu_adam:
      # The engine lets go of gradients not taken down (a step run alone)
      # before the step allocates its own: gpt2-10b has no room for two sets.
      self._set_device(grads=None)
    if self.overlaps_update:  # the last update's stacked leaves come up in the step
      with self.host_update.guard():  # the step's error may be the update's
        landing = self.host_update.landing_for_step()
        # (The state is read once the update's other leaves are installed.)
        self.trained.device, metrics, grad_scale, landed = fn(self.state, batch, landing)
        self.host_update.step_returned(landed)
    else:
      self.trained.device, metrics, grad_scale = fn(self.state, batch)
    if self.plan.grads_in_params:  # the layers' params are in their gradients' memory
      self._set_device(params=jax.tree.map(lambda p, g: g if p is None else p, self.state.params,
                                           self.state.grads, is_leaf=lambda x: x is None))
    return metrics, grad_scale

  def wait(self) -> None:
    """Applies the host update in flight, if any: its weights are written
    into the params (a no-op without offload)."""
    if self.host_update is not None:
      self.host_update.finish()

  def lower(self, batch) -> jax.stages.Lowered:
    """The lowered step for `batch` (to read its HLO or compile it ahead);
    under host accumulation, its first micro-batch's call."""
    state = self.state._replace(grads=None) if self.plan.cpu_adam else self.state
    if self.plan.host_accumulation:
      micro = self._micro_batches(batch)[0]
      return self._step_fn(batch)[0].lower(state, self._on_mesh(micro))
    if self.overlaps_update:
      transfer = self.host_update.transfer
      landing = [transfer.landing_struct(i) for i in self.plan.overlapped_leaves()]
      return self._step_fn(batch).lower(state, self._on_mesh(batch), landing)
    return self._step_fn(batch).lower(state, self._on_mesh(batch))

  def close(self) -> None:
    """Applies a delayed update in flight (unless an earlier host update
    failed) and stops the update thread. Later calls do nothing; `step`
    then raises, while the params and `state_dict` stay readable (unless a
    host update failed: they raise its error)."""
    if self._closed:
      return
    self._closed = True
    if self.host_update is not None:
      try:
        if self.host_update.failure is None:
          self.wait()
      finally:
        self.host_update.close()

  def _step_fn(self, batch):
    self._check_batch(batch)
    key = jax.tree.structure(batch)
    if key in self._step_fns:
      return self._step_fns[key]
    if self.plan.host_accumulation:  # (first micro-batch, the others, the end)
      micro = self._micro_batches(batch)[0]
      make = lambda first: step_lib.make_micro_step(self.plan, self.mesh, self.loss_fn,
                                                    self.trained.tx, micro, first)
      self._step_fns[key] = (make(True), make(False),
                             step_lib.make_finish(self.plan, self.mesh, self.trained.tx))
    else:
      wait = self.host_update.wait_for_layer if self.overlaps_update else None
      self._step_fns[key] = step_lib.make_step(self.plan, self.mesh, self.loss_fn,
                                               self.trained.tx, batch, wait)
    return self._step_fns[key]

  def evaluate(self, batch) -> jax.Array:
    """The mean loss of `batch` (as `step` takes it) under the current
    weights, without a step: the compute-dtype params as the step uses
    them (stage 3 gathers them a layer at a time), so no float32 copy of
    the model is made on the host or a device; the rows run in grad_accum
    micro-batches. A delayed update in flight is applied first."""
    if self._closed:
      raise RuntimeError("this engine is closed: it evaluates no more batches")
    self._check_batch(batch)
    self.wait()
    key = jax.tree.structure(batch)
    if key not in self._eval_fns:
      self._eval_fns[key] = step_lib.make_eval(self.plan, self.mesh, self.loss_fn, batch)
    return self._eval_fns[key](self.state.params, self._on_mesh(batch))

  def local_batch(self, batch):
    """This process's rows of a global batch (leading axis: examples), what
    `step` takes: its devices' block (with one process, the whole batch)."""
    return batches.local_rows(batch, self.plan.n_devices, self.positions)

  def _check_batch(self, batch) -> None:
    batches.check(batch, len(self.positions), self.plan.n_devices, self.plan.grad_accum)

  def _micro_batches(self, batch) -> list:
    return batches.micro_batches(batch, len(self.positions), self.plan.grad_accum)

  def _on_mesh(self, batch):
    return batches.on_mesh(batch, self.mesh, self.plan.axis)

  # ------------------------------------------------------------- outputs
  @property
  def params(self):
    """The float32 master weights, gathered to full shapes (numpy arrays;
    with several processes every process must read them together)."""
    self.wait()
    return state_dict.full_masters(self.trained)

  def compute_params(self):
    """The weights as the step computes with them (the compute dtype), in
    full shapes on the devices, replicated: what a generation outside the
    engine takes, without the float32 copy `params` makes on the host
    (48 GiB for gpt2-13b). Stages 0-2 hold them so already; stage 3
    gathers its shards into a second copy of the weights on each device."""
    self.wait()
    if not self.plan.sharded_lowp:
      return self.state.params
    if self._full_params is None:
      self._full_params = step_lib.make_full_params(self.plan, self.mesh)
    return self._full_params(self.state.params)

  def state_dict(self, streamed: bool = False) -> dict:
    """Everything needed to continue training exactly, as host numpy arrays:
    with Adam (jzo's or optax's) masters and moments in the params' full
    shapes, with another optimizer as the devices keep them (see
    jzo.checkpoint.state_dict). With several processes, what each process holds: the
    masters and moments as global arrays, flat and padded, whose shards
    each process wrote from its own. A delayed update in flight is applied
    first.

    streamed: in one process, Adam's masters and moments as
    `jzo.checkpoint.spans.StreamedArray`s that read the live state a span at a
    time when written (no copy of the state on the host: what
    jzo.checkpoint saves), valid until the next step."""
    self.wait()
    return state_dict.engine_state_dict(self.trained, streamed=streamed)

  def load_state_dict(self, saved: dict) -> None:
    """Restores `state_dict()` output into this engine: the same model; an
    Adam engine's into any Adam engine (any stage, device count, placement,
    offload on or off), another optimizer's into the same optimizer, stage
    and device count.

    Raises:
      ValueError: the saved state does not fit this engine, naming the
        first entries that differ.
    """
    self.wait()
    self.trained.device = state_dict.load_engine_state(self.trained, saved)
    self.trained.refresh_resident()

  @property
  def host_timings(self) -> dict[str, float]:
    """Seconds of the last host update (see the timings of jzo.host.update.HostUpdate)."""
    if self.host_update is None:
      return {"wait_grads": 0.0, "update": 0.0, "upload": 0.0}
    return dict(self.host_update.timings)

  def memory_per_device(self) -> dict[str, int]:
    """Bytes device 0 holds in its own memory for params, gradients and
    optimizer state (master weights included), read from the arrays' shards
    (offloaded weights, in host memory, are not counted; resident layers'
    copies of them are params)."""
    in_device = lambda x: x.sharding.memory_kind not in ("pinned_host", "unpinned_host")
    nbytes = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)
                              if in_device(x))
    s = self.state
    return {"params": nbytes(s.params) + nbytes(s.resident), "grads": nbytes(s.grads),
            "optimizer": nbytes(s.master) + nbytes(s.opt_state)}

  def host_bytes_in_use(self) -> int:
    """Bytes of host RAM the offloaded state holds (0 without offload):
    masters, moments, offloaded weights and the most that the landing
    buffers, which carry gradients down and weights up, have held at once
    (0 before a step)."""
    if self.host is None:
      return 0
    landing = self.host_update.landing_peak if self.host_update is not None else 0
    weights = sum(s.data.nbytes for x in jax.tree.leaves(self.state.params)
                  if x.sharding.memory_kind == "pinned_host" for s in x.addressable_shards)
    return sum(x.nbytes for x in self.host.arrays()) + landing + weights


def _host_update_for(plan: plan_lib.Plan, overlap: bool) -> type[HostUpdate]:
  """The mode of the host update this engine runs (see jzo.host.update):
  chosen once, from the plan and whether the next step's forward may
  overlap the update (pinned transfers, accelerators)."""
  if plan.host_accumulation:
    return AccumulatedUpdate
  if plan.offload_params:
    return StreamedParamsOnHostUpdate if plan.streamed else ParamsOnHostUpdate
  if plan.streamed:
    return StreamedUpdate
  return OverlappedUpdate if overlap else WholeUpdate
