"""jzo: ZeRO and ZeRO-Offload for JAX.

Public API:
  cpu_adam, cpu_adamw: optax transforms computed by the C++ host kernel.
  kernels: the fused in-place host kernel and its thread/SIMD settings.
"""

from jzo import kernels
from jzo.cpu_adam import CpuAdamState, cpu_adam, cpu_adamw
from jzo.engine import EngineState, StepMetrics, ZeroEngine
from jzo.partition import gather_layer
from jzo.precision import LossScale

__all__ = ["CpuAdamState", "EngineState", "LossScale", "StepMetrics", "ZeroEngine", "cpu_adam",
           "cpu_adamw", "gather_layer", "kernels"]
__version__ = "0.1.0"
