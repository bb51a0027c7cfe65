"""The host kernels: the fused in-place Adam step and its helpers, computed by
the C++ extension (jzo.native), with their thread and SIMD settings (ops);
the optax transforms over them (cpu_adam); Adam's arithmetic as XLA
operations, the kernel's and optax's (adam_xla); int8 block quantization of
the moments (quant8).

`jzo.kernels.adam_step_(...)`, `jzo.kernels.set_num_threads(n)` and the
rest of ops' public names are this package's."""

from jzo.kernels.ops import (ADAM_MOMENTS_TARGET, ADAM_STEP_TARGET, ADAM_UPDATE_TARGET,
                             GRAD_DTYPES, HUGE_PAGE, INT8_CODES, LOWP_DTYPES, MOMENT_DTYPES, accumulate_, adam_scalars,
                             adam_step_, aligned_empty, cast_, check_adam_hyperparameters,
                             int8_codes, num_threads, parallel_copy, prefetch_above,
                             set_int8_codes, set_num_threads, set_prefetch_above,
                             set_simd_level, simd_level, supported_simd_levels)

__all__ = ["ADAM_MOMENTS_TARGET", "ADAM_STEP_TARGET", "ADAM_UPDATE_TARGET", "GRAD_DTYPES",
           "HUGE_PAGE", "INT8_CODES", "LOWP_DTYPES", "MOMENT_DTYPES", "accumulate_", "adam_scalars",
           "adam_step_", "aligned_empty", "cast_", "check_adam_hyperparameters", "int8_codes",
           "num_threads", "parallel_copy", "prefetch_above", "set_int8_codes", "set_num_threads",
           "set_prefetch_above", "set_simd_level", "simd_level", "supported_simd_levels"]
