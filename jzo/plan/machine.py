"""What the machine offers and what its runtime takes, in bytes: host RAM
still available, the devices' allocator limits, the GPUs a process sees,
the host runtime of a process, and XLA's pinned host pools (their cap,
each device's share and headroom).
"""

from __future__ import annotations

import math
import os

import psutil

# Host RAM of a process besides its state, its pinned pools and its GPUs'
# allocator tables (below): Python, jax, XLA's compiler, CUDA (measured with
# the resident set after start-up on H200s: 1.5 GiB on one GPU and 1.9 on
# two of a 32-core host, 1.9 on one and 2.6 on four of a 64-core host).
HOST_RUNTIME_BYTES = 2 * 2**30
# ... and for each more GPU the process drives.
HOST_RUNTIME_BYTES_PER_DEVICE = 2**28
# XLA's allocators (tsl's BFC) keep, in host RAM, an 8-byte handle for each
# 256 bytes they manage. A GPU's memory: made when the device first runs
# something, 4.19 GiB for 95% of an H200 (measured: one anonymous mapping of
# 4,288 MiB a GPU), 2.36 for an H100. A pinned host pool: made with each of
# its regions (measured: 0.74 GiB beside 24 GiB of pools).
BYTES_PER_TABLE_BYTE = 32


# XLA's pinned host pools on GPUs, one per device: the cap in GiB of each is
# read from this variable when JAX starts its GPU backend (XLA's default: 64).
PINNED_POOL_LIMIT_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
_XLA_PINNED_POOL_LIMIT_GIB = 64
# Pinned memory of a process besides the landing buffers: staging of the
# batches and checkpoint reads; each device's pool keeps its share of it, but
# at least MIN_POOL_HEADROOM (a chunk of the build, and room for the pool's
# fragments).
PINNED_POOL_HEADROOM = 2 * 2**30
MIN_POOL_HEADROOM = 2**30
# Bytes a leaf moves to the host at once while the engine is being built:
# the pinned bounce of a chunk is all the host holds beside the masters.
BUILD_CHUNK_BYTES = 256 * 2**20


def pinned_pool_limit() -> int:
  """Bytes each device's pinned host pool may hold (see PINNED_POOL_LIMIT_VAR)."""
  value = os.environ.get(PINNED_POOL_LIMIT_VAR, "")
  try:
    return int(value) * 2**30 if value else _XLA_PINNED_POOL_LIMIT_GIB * 2**30
  except ValueError:
    raise ValueError(f"{PINNED_POOL_LIMIT_VAR} must be a whole number of GiB, "
                     f"got {value!r}") from None


def pool_share(nbytes: int, devices: int) -> int:
  """Bytes of each device's pinned pool for `nbytes` of landing buffers
  spread evenly over `devices` (rounded up)."""
  return -(-nbytes // devices)


def pool_headroom(devices: int) -> int:
  """Bytes of each of `devices` pinned pools beyond its share of the landing
  buffers (PINNED_POOL_HEADROOM)."""
  return max(PINNED_POOL_HEADROOM // devices, MIN_POOL_HEADROOM)


def pinned_pool_bytes(landing: int, devices: int = 1) -> int:
  """Host bytes XLA's pinned pools take for `landing` bytes of landing
  buffers of a process spread evenly over its `devices`, each device's
  share reserved in one piece in its own pool (`ShardTransfer.reserve`).
  Pinned pages are resident, and a pool never shrinks: its first region is
  the share rounded up to a power of two, up to what its cap leaves
  (gpt2-13b's 21.6 GiB of landing buffers took a 32 GiB region under the
  default 64 GiB cap), and what else is pinned beside the landing buffers
  grows it by its headroom (measured: 4.1 GiB for a streamed update's 2 GiB
  of spans, on one GPU and on two). Each pool's allocator keeps a table of
  1/32 of it (BYTES_PER_TABLE_BYTE)."""
  if not landing:
    return 0
  share = pool_share(landing, devices)
  region = max(1 << (share - 1).bit_length(), share + pool_headroom(devices))
  pool = min(region, pinned_pool_limit())
  return devices * (pool + pool // BYTES_PER_TABLE_BYTE)


def limit_pinned_pool(landing: int, devices: int = 1) -> int:
  """Caps each device's pinned pool at its share of `landing` bytes (the
  most landing buffers a process can hold, e.g. every parameter's gradient
  in the compute dtype, spread over at least `devices` devices) plus its
  headroom, so that the pool does not round its share up to a power of two
  (it would be resident: 32 GiB for 21.6 GiB at gpt2-13b). Takes effect
  only before JAX starts its GPU backend, and leaves a cap the user set
  alone. `devices` must not be more than the devices the run spreads the
  landing buffers over (a cap too small fails allocations). Returns the cap
  in bytes."""
  if PINNED_POOL_LIMIT_VAR not in os.environ:
    share = pool_share(landing, devices) + pool_headroom(devices)
    os.environ[PINNED_POOL_LIMIT_VAR] = str(math.ceil(share / 2**30))
  return pinned_pool_limit()


def visible_gpus() -> int:
  """GPUs this process can see, counted without starting JAX's GPU backend
  (where the pinned pools' cap must be set): CUDA_VISIBLE_DEVICES's up to
  its first invalid entry (where CUDA stops), else the NVIDIA driver's; at
  least 1."""
  listed = os.environ.get("CUDA_VISIBLE_DEVICES")
  if listed is None:
    try:
      return max(1, len(os.listdir("/proc/driver/nvidia/gpus")))
    except OSError:
      return 1
  count = 0
  for entry in listed.split(","):
    if not entry.strip() or entry.strip().startswith("-"):
      break
    count += 1
  return max(1, count)


def host_runtime_bytes(devices: int, platform: str = "gpu", device_memory: int = 0) -> int:
  """Host RAM of a process that drives `devices` devices of `platform`, each
  with an allocator of `device_memory` bytes, besides its state and pinned
  pools (CUDA, XLA, Python): more for each more accelerator, and a GPU's
  allocator's table; CPU devices add none."""
  if platform == "cpu":
    return HOST_RUNTIME_BYTES
  table = device_memory // BYTES_PER_TABLE_BYTE if platform == "gpu" else 0
  return HOST_RUNTIME_BYTES + HOST_RUNTIME_BYTES_PER_DEVICE * (devices - 1) + devices * table


def available_host_memory() -> int:
  """Bytes this process may still allocate: MemAvailable, capped by a cgroup limit."""
  available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          available = int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    with open("/sys/fs/cgroup/memory.max") as f:
      limit = f.read().strip()
    with open("/sys/fs/cgroup/memory.current") as f:
      used = int(f.read())
    if limit != "max":
      available = min(available, int(limit) - used)
  except (OSError, ValueError):
    pass
  return available


def host_memory_for(runtime_bytes: int, available: int | None = None,
                    held: int | None = None) -> int:
  """Host bytes a plan that counts `runtime_bytes` for this process's runtime
  may use: what is `available` (default: `available_host_memory()`), plus
  what this process already `held` (default: its resident set) up to that
  runtime. Once JAX has run anything on a GPU, the process holds most
  of its runtime (4.2 GiB for each H200, mostly its allocator's table),
  which the available memory no longer includes; without this the plan
  would count it twice, and a plan made in another process (jzo.estimate)
  would fit what the run refuses."""
  if available is None:
    available = available_host_memory()
  if held is None:
    held = psutil.Process().memory_info().rss
  return available + min(held, runtime_bytes)


def device_memory_limit(device) -> int | None:
  """Bytes the allocator of `device` may hand out (None where it reports none, as on CPU)."""
  return (device.memory_stats() or {}).get("bytes_limit")
