"""Several processes, one per host or one per accelerator: JAX's multi-process
runtime (`jax.distributed`) as jzo uses it.

Every process runs the same program over one global mesh. A process owns a
contiguous block of the data axis (its addressable devices): it feeds their
rows of each batch, keeps the host part of their shards' optimizer state in
its own RAM and updates it with its own kernel threads, and writes their
shards of a checkpoint. With one process all of this is the whole mesh.

    jzo.distributed.initialize_from_environment()   # before any other JAX call
    engine = jzo.ZeroEngine(...)                    # the mesh: every process's devices
    engine.step(local_batch)                        # this process's rows

`initialize_from_environment` takes the coordinator's address (host:port of
process 0), the process count and this process's id as arguments (the
recipe's --coordinator, --num-processes, --process-id) or from
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID; with
JZO_DISTRIBUTED=auto alone, JAX's cluster detection (Slurm, Open MPI, Cloud
TPU pods) finds them.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_AUTO = "JZO_DISTRIBUTED"
_ABSL_FATAL = 3  # absl's severities: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL


def initialize_from_environment(address: str | None = None, processes: int | None = None,
                                process_id: int | None = None) -> bool:
  """Starts JAX's multi-process runtime when the arguments or the
  environment ask for it (see the module docstring); returns whether it did.
  Each argument given wins over its variable. Call it before any other JAX
  call. On CPUs the processes' collectives go through gloo.

  Raises:
    ValueError: a variable that is not a number, or a process id outside
      [0, process count), naming it.
  """
  address = address or os.environ.get(ENV_ADDRESS) or None
  processes = processes if processes is not None else _int_from_env(ENV_PROCESSES)
  process_id = process_id if process_id is not None else _int_from_env(ENV_PROCESS_ID)
  auto = os.environ.get(ENV_AUTO, "")
  if auto not in ("", "auto"):
    raise ValueError(f"{ENV_AUTO} must be 'auto' or unset, got {auto!r}")
  if address is None and processes is None and process_id is None and not auto:
    return False
  if processes is not None and processes < 1:
    raise ValueError(f"the process count must be >= 1, got {processes}")
  if process_id is not None and processes is not None and not 0 <= process_id < processes:
    raise ValueError(f"process id {process_id} is outside [0, {processes}), the process count")
  # CPU devices of several processes reduce through gloo (jax's CPU
  # collectives); the setting is read when the CPU backend starts.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # JAX's preemption service takes over SIGTERM in C++ at initialize (and
  # orbax then saves at steps of its own choosing); jzo's signal handling
  # (the recipe's Interrupts) stops every process at one step itself.
  jax.config.update("jax_enable_preemption_service", False)
  # What is still None, JAX's cluster detection fills in (or names as missing).
  jax.distributed.initialize(address, processes, process_id)
  return True


def quiet_native_logs() -> None:
  """From now on, drops the C++ log lines of JAX's runtime below FATAL
  (absl's INFO, WARNING and ERROR; lines already printed stay). For a
  process on its way out: the coordination service's shutdown and a
  peer's end make its agent print warnings, errors and gRPC traces that
  say nothing the run's own lines do not."""
  try:
    from jax._src.lib import utils  # no public switch; checked against jaxlib 0.10.2
    utils.absl_set_min_log_level(_ABSL_FATAL)
  except Exception:  # another jaxlib: its lines stay, as before
    pass


def shut_down_client() -> None:
  """This process's part of JAX's multi-process shutdown at exit: its
  client enters the shutdown barrier (returning once every process's has)
  and leaves. What JAX's exit handler does after it stays to it: in
  process 0, stopping the coordination service, once nobody talks to it
  (jzo.parallel.peer_watch waits for the other processes to exit first).
  Failures are dropped: the run has ended, and JAX's handler would only
  report them as an exception at exit."""
  from jax._src import distributed  # checked against jax 0.10.2: global_state.client
  client, distributed.global_state.client = distributed.global_state.client, None
  try:
    if client is not None:
      client.shutdown()
  except Exception:  # the barrier failed (a process that exited without it): nothing to add
    pass


def _int_from_env(name: str) -> int | None:
  value = os.environ.get(name, "")
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{name} must be a whole number, got {value!r}") from None


def is_primary() -> bool:
  """This process writes the run's logs and plots (process 0)."""
  return jax.process_index() == 0


def own_device(devices) -> jax.Device:
  """This process's first device among `devices` (where it can measure and query)."""
  return next(d for d in devices if d.process_index == jax.process_index())


def local_positions(mesh: Mesh) -> range:
  """Positions along the mesh's devices (flat order: the data axis, where
  the other axes have size 1) of this process's devices: a contiguous range
  (`check_mesh` refuses others). With one process, all of them."""
  mine = [d for d, device in enumerate(mesh.devices.flat)
          if device.process_index == jax.process_index()]
  if not mine:
    raise ValueError(f"the mesh has none of process {jax.process_index()}'s devices")
  return range(mine[0], mine[-1] + 1)


def check_mesh(mesh: Mesh, axis: str) -> None:
  """Refuses a mesh that does not span the processes the way the engine
  feeds batches and keeps host state: every process that takes part holds
  the same number of its devices, as one contiguous block of the data
  axis (the other axes of size 1), and every process takes part.

  Raises:
    ValueError: naming the processes and how the mesh holds their devices.
  """
  if jax.process_count() == 1:
    return
  if mesh.devices.size != mesh.shape[axis]:
    raise ValueError(f"with several processes the mesh's only axis of size > 1 must be "
                     f"{axis!r}, got {dict(mesh.shape)}")
  owners = [device.process_index for device in mesh.devices.flat]
  blocks = [owners[0]] + [b for a, b in zip(owners, owners[1:]) if a != b]
  counts = {p: owners.count(p) for p in set(owners)}
  if len(blocks) != len(set(blocks)):
    raise ValueError(f"each process's devices must be one contiguous block of the {axis!r} "
                     f"axis; the mesh's devices belong to processes {owners}")
  if len(set(counts.values())) != 1:
    raise ValueError(f"every process must hold as many devices of the mesh: processes "
                     f"hold {counts}")
  if len(counts) != jax.process_count():
    missing = sorted(set(range(jax.process_count())) - set(counts))
    raise ValueError(f"the mesh has no device of process(es) {missing}: every process runs "
                     "the step, so every one needs devices in it")


def default_mesh(axis: str) -> Mesh:
  """Every device of every process on one axis, each process's together."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return Mesh(np.array(devices), (axis,))
