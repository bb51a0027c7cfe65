"""The plan: what lives where (each leaf's layout and placement between
device and host), what it costs in bytes, whether it fits, and what the
machine offers (host RAM, the allocator's limit, pinned pools).

plan: the Plan, its bytes and its table; draws: what the build draws at
once; placement: the search for where each leaf's state lives and the check
that it fits; machine: what the machine offers (host RAM, device limits,
GPUs, pinned pools); fit: the planner users call from shapes alone
(`jzo.estimate`, `jzo.pick_micro_batch`)."""

from jzo.plan.machine import (BUILD_CHUNK_BYTES, HOST_RUNTIME_BYTES,
                              HOST_RUNTIME_BYTES_PER_DEVICE, MIN_POOL_HEADROOM,
                              PINNED_POOL_LIMIT_VAR, available_host_memory, device_memory_limit,
                              host_memory_for, host_runtime_bytes, limit_pinned_pool,
                              pinned_pool_bytes, pinned_pool_limit, pool_share, visible_gpus)
from jzo.plan.placement import DEVICE_HEADROOM, PlacementError, make_plan, save_bytes
from jzo.plan.draws import DRAW_GROUP_FLOOR, draw_groups
from jzo.plan.plan import STREAM_LANDING_BYTES, STREAM_SPANS, GiB, Plan, count_text, format_plan
from jzo.plan.fit import (Estimate, MicroBatch, batch_line, estimate, estimate_micro_batch,
                          pick_micro_batch)

__all__ = ["BUILD_CHUNK_BYTES", "DEVICE_HEADROOM", "DRAW_GROUP_FLOOR", "HOST_RUNTIME_BYTES",
           "HOST_RUNTIME_BYTES_PER_DEVICE", "MIN_POOL_HEADROOM", "PINNED_POOL_LIMIT_VAR",
           "STREAM_LANDING_BYTES", "STREAM_SPANS", "Estimate", "GiB", "MicroBatch", "Plan",
           "PlacementError", "available_host_memory", "batch_line", "count_text",
           "device_memory_limit", "draw_groups", "estimate", "estimate_micro_batch",
           "format_plan", "host_memory_for", "host_runtime_bytes", "limit_pinned_pool",
           "make_plan", "pick_micro_batch", "pinned_pool_bytes", "pinned_pool_limit",
           "pool_share", "save_bytes", "visible_gpus"]
