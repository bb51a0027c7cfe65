"""jzo: ZeRO and ZeRO-Offload for JAX.

Public API:
  ZeroEngine: data-parallel training with ZeRO stages 0-3 and optional offload.
  EngineOptions: its options, each documented and checked (what the plan is made from).
  HostLeaf: a lazy host array, one of the forms of ZeroEngine's params.
  estimate: the memory planner: what lives where, and whether it fits.
  pick_micro_batch: the largest micro-batch that fits a global batch.
  gather_layer: the hook a scan over layers calls for per-layer stage-3 gathers.
  scan_layers: the scan over stacked layers (whose gradients may replace the weights).
  LossScale: dynamic loss-scaling settings for float16.
  cpu_adam, cpu_adamw: optax transforms computed by the C++ host kernel.
  adamw_step: their update and apply_updates as one in-place pass.
  kernels: the fused in-place host kernel and its thread/SIMD settings.
  distributed: several processes (jax.distributed) from the environment.
  `python -m jzo.train`: the GPT training recipe.
"""

from jzo import kernels
from jzo.engine import ZeroEngine
from jzo.host.leaf import HostLeaf
from jzo.kernels.cpu_adam import CpuAdamState, CpuAdamTransform, adamw_step, cpu_adam, cpu_adamw
from jzo.options import EngineOptions
from jzo.parallel import distributed
from jzo.parallel.layer_scan import scan_layers
from jzo.parallel.partition import gather_layer
from jzo.plan import Plan, PlacementError, estimate, pick_micro_batch
from jzo.precision import LossScale
from jzo.step import EngineState, StepMetrics

__all__ = ["CpuAdamState", "CpuAdamTransform", "EngineOptions", "EngineState", "HostLeaf",
           "LossScale", "PlacementError", "Plan", "StepMetrics", "ZeroEngine", "adamw_step",
           "cpu_adam", "cpu_adamw", "distributed", "estimate", "gather_layer", "kernels",
           "pick_micro_batch", "scan_layers"]
__version__ = "0.1.0"
