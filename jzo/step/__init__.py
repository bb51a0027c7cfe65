"""The device step: pure functions of (plan, state, batch), jitted over the
mesh (shard_map), and the device state's layout (EngineState and its
shardings).

One step is one jitted `shard_map` over the data axis (jzo.step.plain):

  forward/backward on the local batch with low-precision params
    -> stage 0: all-reduce the gradients (plain data parallelism)
       stage 1: accumulate full local gradients, then reduce-scatter once
       stage 2: reduce-scatter each micro-batch's gradients
       stage 3: params are gathered inside the loss (per layer with
                `gather_layer`), so autodiff reduce-scatters the gradients
    -> finite check, global-norm clip factor, loss-scale update
    -> the device part of every shard: unscale and clip, the optimizer on its
       float32 masters, the new low-precision weights written into the params
       (stages 0-2 all-gather them; stage 3 keeps shards) (jzo.step.update)
    -> every shard's gradient of each leaf with a host part stays on the
       device as an output (the whole shard: a slice would copy it at the
       step's peak), with the factor the host kernel unscales and clips by;
       jzo.host.transfer copies the host parts down after the step.

With offload, grad_accum = K > 1 and the host part accumulated on the host
(`plan.host_accumulation`), a step is K + 1 calls the engine drives instead
(jzo.step.accumulated): `make_micro_step` runs one micro-batch (stages 1-2
reduce-scatter its gradients at once), adds the device part into a float32
accumulator carried in the state (`acc`; the first micro-batch writes it)
and outputs the host parts' gradients in the compute dtype for the host to
sum; `make_finish` then takes the host's sum of squares and non-finite
count per device and ends the step as above. So a device holds one
micro-batch's gradients and the device part's accumulator, never a float32
sum of the host part.

With grads_in_params, grad_accum > 1 stays one call (jzo.step.layers_first):
the layers run first (`Plan.layers_first`: every micro-batch's forward
through the layers, a layer at a time, then each layer's backward over
every micro-batch, its float32 sum written over its weights), or the
layers' float32 sums are added to in their backward passes
(jzo.parallel.layer_scan) and the last micro-batch writes them over the
weights.

With grads_in_params and one micro-batch or the layers first the step may
overlap the host update (`Plan.overlaps_update`): it takes the stacked
leaves' landing buffers, where the host is still writing the last update's
weights, and its forward fetches each layer's as the host finishes it
(`wait`, jzo.parallel.layer_scan), so the forward runs beside the host update; its
backward writes those leaves' host parts' gradients back into them.

`host_part_installer` writes a leaf's host part's new weights, once
uploaded, into the params in place (jzo.step.install). Nothing here keeps
Python state but caches of programs: the engine holds the state and calls
these.

Modules: specs (the state's layout), install (weights written in place),
programs (shard_map_without_empty, compiler_options), loss (scaled_loss),
update (end_step), plain (make_step), layers_first, accumulated
(make_micro_step, make_finish), evaluation (make_eval, make_full_params).
"""

from jzo.step.accumulated import make_finish, make_micro_step
from jzo.step.evaluation import make_eval, make_full_params
from jzo.step.install import host_part_installer, resident_copier, write_part
from jzo.step.plain import make_step
from jzo.step.programs import compiler_options, shard_map_without_empty
from jzo.step.specs import (EngineState, StepMetrics, grad_buffer_shape, lowp_from_master,
                            state_specs)

__all__ = ["EngineState", "StepMetrics", "compiler_options", "grad_buffer_shape",
           "host_part_installer", "lowp_from_master", "make_eval", "make_finish",
           "make_full_params", "make_micro_step", "make_step", "resident_copier",
           "shard_map_without_empty", "state_specs", "write_part"]
