"""What XLA allocates for one engine step, beside the planner's estimate:
lowers and compiles the step of a GPT preset on abstract arrays (nothing is
drawn or allocated) and prints the compiled program's memory analysis
(arguments, outputs, aliased, temporaries) for each placement asked for.

  python experiments/step_memory.py --model gpt2-10b --offload auto 1.0 --device-gb 75.6

With --pinned-grads, also the same step with the host parts' gradients as
outputs in pinned host memory (what the step did before session 4). With
--offload-params, stage 3 with the layers' weights in host memory and each
of --resident's counts of layers resident on the device; each line also
counts the instructions XLA rematerialized (".remat" in their names).

  python experiments/step_memory.py --model gpt2-10b --batch 96 --offload-params \
    --resident 0 10 25 --device-gb 75.22
"""

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jzo
from jzo import plan as plan_lib, state as state_lib, step as step_lib
from jzo.recipe import estimate as estimate_cli
from jzo.cpu_adam import cpu_adamw_with, decay_flags
from jzo.models import gpt
from jzo.partition import is_layout


def abstract_state(plan, tx, mesh):
  """The engine's first device state as ShapeDtypeStructs with their
  shardings (offloaded weights in pinned host memory): the engine's own
  builder, evaluated for shapes alone."""
  shapes = jax.eval_shape(functools.partial(state_lib.empty_device_state, plan, mesh, tx))
  specs = step_lib.state_specs(plan, tx)._replace(grads=None)
  state = jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), shapes._replace(grads=None), specs)
  kind = lambda l: "pinned_host" if plan.params_on_host(l) else None
  params = jax.tree.map(lambda l, x, spec: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, spec, memory_kind=kind(l))),
      plan.layouts, shapes.params, specs.params, is_leaf=is_layout)
  return state._replace(params=params)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt2-10b")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=1024)
  parser.add_argument("--offload", type=estimate_cli.parse_offload, nargs="+", default=["auto"])
  parser.add_argument("--device-gb", type=float, default=75.6)
  parser.add_argument("--pinned-grads", action="store_true")
  parser.add_argument("--offload-params", action="store_true",
                      help="stage 3, the layers' weights in host memory (offload=True)")
  parser.add_argument("--resident", type=int, nargs="+", default=[0],
                      help="with --offload-params: layers resident on the device, each a plan")
  parser.add_argument("--run", action="store_true",
                      help="also run the step once on zero-filled state and report the device's "
                           "peak memory (no host state is made)")
  args = parser.parse_args()
  config = dataclasses.replace(gpt.PRESETS[args.model], seq_len=args.seq_len)
  acts = gpt.activation_bytes(config, args.batch, args.seq_len)
  shapes = jax.eval_shape(functools.partial(gpt.init_params, config, jax.random.PRNGKey(0)))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  hyper = jzo.cpu_adamw(3e-4, weight_decay=0.1).hyperparams
  tx = cpu_adamw_with(hyper, decay_flags(hyper.mask, shapes))
  batch = {"tokens": jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), jnp.int32)}
  gib = lambda b: f"{b / 2**30:.2f}"
  if args.offload_params:
    options = jzo.EngineOptions(max_grad_norm=1.0, offload=True, stage=3, layers="blocks",
                                offload_params=True)
    base = plan_lib.make_plan(shapes, 8, options, n_devices=1, activations=acts)
    plans = {f"{r} resident": dataclasses.replace(base, resident_layers=r)
             for r in args.resident}
  else:
    plans = {}
    for offload in args.offload:
      options = jzo.EngineOptions(max_grad_norm=1.0, offload=offload, delayed_update=True,
                                  dpu_warmup=1)
      plans[f"offload={offload}"] = plan_lib.make_plan(
          shapes, 8, options, n_devices=1, device_memory=int(args.device_gb * 2**30),
          activations=acts)
  for label, plan in plans.items():
    print(plan)
    state = abstract_state(plan, tx, mesh)
    variants = {"grads on device": step_lib.make_step(
        plan, mesh, functools.partial(gpt.loss_fn, config), tx, batch)}
    if args.pinned_grads and not args.offload_params:
      specs = step_lib.state_specs(plan, tx)
      fn = jax.shard_map(lambda s, b: step_lib.local_step(
          plan, functools.partial(gpt.loss_fn, config), tx, s, b), mesh=mesh,
          in_specs=(specs._replace(grads=None), jax.tree.map(lambda _: P("data"), batch)),
          out_specs=(specs, step_lib.StepMetrics(P(), P(), P(), P()), P()), check_vma=False)
      named = lambda spec, kind=None: NamedSharding(mesh, spec, memory_kind=kind)
      out = (jax.tree.map(named, specs)._replace(
          grads=jax.tree.map(lambda s: named(s, "pinned_host"), specs.grads)),
          step_lib.StepMetrics(*[named(P())] * 4), named(P()))
      variants["grads to pinned host"] = jax.jit(fn, donate_argnums=0, out_shardings=out)
    for name, fn in variants.items():
      compiled = fn.lower(state, batch).compile()
      m = compiled.memory_analysis()
      remat = compiled.as_text().count(".remat")
      peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
              + m.temp_size_in_bytes)
      print(f"{label} {name}: arguments {gib(m.argument_size_in_bytes)}, outputs "
            f"{gib(m.output_size_in_bytes)}, aliased {gib(m.alias_size_in_bytes)}, temporaries "
            f"{gib(m.temp_size_in_bytes)}, in all {gib(peak)} GiB; planned "
            f"{gib(sum(plan.device_peak(acts).values()))} GiB; {remat} rematerialized",
            flush=True)
      if args.run and name == "grads on device":
        zeros = lambda x: jax.jit(lambda: jnp.zeros(x.shape, x.dtype), out_shardings=x.sharding)()
        real = jax.tree.map(zeros, state)
        tokens = jnp.zeros(batch["tokens"].shape, jnp.int32)
        stats = lambda: jax.devices()[0].memory_stats()
        before = stats()["bytes_in_use"]
        out = jax.block_until_ready(fn(real, {"tokens": tokens}))
        print(f"  ran: in use before {gib(before)}, peak {gib(stats()['peak_bytes_in_use'])}, "
              f"after {gib(stats()['bytes_in_use'])} GiB", flush=True)
        del out, real


if __name__ == "__main__":
  main()
