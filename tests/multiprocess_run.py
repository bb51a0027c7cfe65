"""The training run of tests/test_multiprocess.py: test_engine's residual MLP
(a scan over stacked layers, sizes that do not divide the devices; four
leaves, so that a run compiles in seconds) with the optimizer offloaded and
the delayed update, in float32 (so that runs over other reduction orders
agree to float32 rounding), checkpointed as it goes.

`python multiprocess_run.py OUT [--resume]` is one process of a pair (its
place from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID): it
trains at stages 2 and 3 and process 0 writes what each run saw to
OUT/stage<N>.npz. `python multiprocess_run.py OUT --load DIR` loads the
latest checkpoint of DIR/checkpoints-<N> instead, and process 0 writes the
state it loaded to OUT/loaded<N>.npz. A variant runs the same at stage 3
alone, its files named with its prefix (int8-stage3, checkpoints-int8-3,
int8-loaded3): `--int8`, with int8 moments; `--resident`, with the layers'
weights in host memory (offload_params, so no delayed update), the first
of them resident on the devices. The test runs `train` and `load` in its
own process for the single-process references.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import jzo
from jzo import checkpoint
from jzo.parallel import distributed
from jzo.checkpoint import engine_parts, saved_leaf
from jzo.parallel.partition import is_layout
from jzo.recipe.quick_exit import quick_exit
from test_engine import batches, init_params, loss_fn, make_engine
from test_grads_in_params import loss_fn as scanned_loss_fn

STEPS = 10
SAVE_AT = (5, STEPS)  # checkpoints; a resumed run starts from the first
STAGES = (2, 3)
VARIANTS = ("int8", "resident")  # besides the plain run ("")


def engine_of(stage: int, mesh=None, variant: str = "") -> jzo.ZeroEngine:
  moments = "int8" if variant == "int8" else None
  tx = jzo.cpu_adamw(1e-3, b2=0.95, weight_decay=0.1, mu_dtype=moments, nu_dtype=moments)
  kw = dict(mesh=mesh, stage=stage, compute_dtype=jnp.float32, max_grad_norm=1.0, offload=True,
            layers="blocks" if stage == 3 else None)
  if variant == "resident":
    return make_engine(scanned_loss_fn, init_params(), tx, offload_params=True, resident_layers=1,
                       **kw)
  return make_engine(loss_fn, init_params(), tx, delayed_update=True, dpu_warmup=2, **kw)


def folder(stage: int, variant: str = "") -> str:
  """The checkpoints folder of a run at `stage`."""
  return f"checkpoints-{variant + '-' if variant else ''}{stage}"


def train(stage: int, out: pathlib.Path, mesh=None, resume: bool = False,
          variant: str = "") -> dict:
  """Trains STEPS steps, saving at SAVE_AT (or, if `resume`, from checkpoint
  SAVE_AT[0], saving none); returns {"loss", "grad_norm"} (the steps run) and "master"
  (the final float32 weights, flat, in jax.tree.leaves order)."""
  engine = engine_of(stage, mesh, variant)
  losses, norms = [], []
  data = [jax.tree.map(np.asarray, b) for b in batches(STEPS)]  # global, (16, ...)
  with checkpoint.open_manager(out / folder(stage, variant)) as manager:
    first = checkpoint.restore(manager, engine, SAVE_AT[0]) if resume else 0
    for step in range(first, STEPS):
      metrics = engine.step(engine.local_batch(data[step]))
      losses.append(float(metrics.loss))
      norms.append(float(metrics.grad_norm))
      if step + 1 in SAVE_AT and not resume:
        checkpoint.save(manager, engine, step + 1)
  master = np.concatenate([x.ravel() for x in jax.tree.leaves(engine.params)])
  engine.close()
  return {"loss": np.array(losses), "grad_norm": np.array(norms), "master": master}


def load(stage: int, where: pathlib.Path, mesh=None, variant: str = "") -> dict:
  """The state an engine over `mesh` loads from the latest checkpoint in
  `where`/folder(stage, variant): "master", "mu" and "nu" (float32, in full
  shapes, flat and joined in jax.tree.leaves order; int8 moments' values)
  and "count"."""
  engine = engine_of(stage, mesh, variant)
  with checkpoint.open_manager(where / folder(stage, variant)) as manager:
    checkpoint.restore(manager, engine)
  saved = engine.state_dict()
  layouts = jax.tree.leaves(engine.plan.layouts, is_leaf=is_layout)

  def whole(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # several processes' shards
      return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)

  def full(layout, x):
    x = np.asarray(whole(x), np.float32)
    return x if x.shape == layout.shape else np.asarray(layout.unflatten(x))
  for name in ("mu", "nu"):
    if engine_parts.codes_entry(name) in saved:  # int8: their values, in the codes' shapes
      saved[name] = jax.tree.map(
          lambda c, s: saved_leaf.Int8Blocks(whole(s), c.shape, signed=name == "mu").values(
              whole(c), 0).reshape(c.shape),
          saved[engine_parts.codes_entry(name)], saved[engine_parts.scales_entry(name)])
  state = {name: np.concatenate([full(l, x).ravel() for l, x in
                                 zip(layouts, jax.tree.leaves(saved[name]))])
           for name in ("master", "mu", "nu")}
  engine.close()
  return {**state, "count": np.asarray(saved["count"])}


def main(out: str, args: list[str]) -> None:
  distributed.initialize_from_environment()
  out = pathlib.Path(out)
  variant = next((v for v in VARIANTS if f"--{v}" in args), "")
  prefix = variant + "-" if variant else ""
  for stage in (3,) if variant else STAGES:
    if "--load" in args:
      seen = load(stage, pathlib.Path(args[args.index("--load") + 1]), variant=variant)
      name = f"{prefix}loaded{stage}"
    else:
      resume = "--resume" in args
      seen = train(stage, out, resume=resume, variant=variant)
      name = f"{prefix}stage{stage}{'-resumed' if resume else ''}"
    if distributed.is_primary():
      np.savez(out / f"{name}.npz", **seen)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
  quick_exit(0)  # as the recipe ends: without the modules' teardown
