"""The device step: pure functions of the state and a batch, jitted over the
mesh (shard_map): forward, backward, reduce-scatter, the update of the
device-resident state; and the device state's layout (EngineState and its
shardings)."""

from jzo.step.step import (EngineState, StepMetrics, compiler_options, grad_buffer_shape,
                           host_part_installer, lowp_from_master, make_eval, make_finish,
                           make_full_params, make_micro_step, make_step, resident_copier,
                           state_specs)

__all__ = ["EngineState", "StepMetrics", "compiler_options", "grad_buffer_shape",
           "host_part_installer", "lowp_from_master", "make_eval", "make_finish",
           "make_full_params", "make_micro_step", "make_step", "resident_copier", "state_specs"]
