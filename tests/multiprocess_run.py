"""The training run of tests/test_multiprocess.py: test_engine's residual MLP
(a scan over stacked layers, sizes that do not divide the devices; four
leaves, so that a run compiles in seconds) with the optimizer offloaded and
the delayed update, in float32 (so that runs over other reduction orders
agree to float32 rounding), checkpointed as it goes.

`python multiprocess_run.py OUT [--resume]` is one process of a pair (its
place from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID): it
trains at stages 2 and 3 and process 0 writes what each run saw to
OUT/stage<N>.npz. The test runs `train` in its own process for the
single-process reference.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jzo
from jzo import checkpoint, distributed
from test_engine import batches, init_params, loss_fn

STEPS = 10
SAVE_AT = (5, STEPS)  # checkpoints; a resumed run starts from the first
STAGES = (2, 3)


def train(stage: int, out: pathlib.Path, mesh=None, resume: bool = False) -> dict:
  """Trains STEPS steps, saving at SAVE_AT (or, if `resume`, from checkpoint
  SAVE_AT[0], saving none); returns {"loss", "grad_norm"} (the steps run) and "master"
  (the final float32 weights, flat, in jax.tree.leaves order)."""
  engine = jzo.ZeroEngine(
      loss_fn, init_params(), jzo.cpu_adamw(1e-3, b2=0.95, weight_decay=0.1), mesh=mesh,
      stage=stage,
      compute_dtype=jnp.float32, max_grad_norm=1.0, offload=True, delayed_update=True,
      dpu_warmup=2, layers="blocks" if stage == 3 else None)
  losses, norms = [], []
  data = [jax.tree.map(np.asarray, b) for b in batches(STEPS)]  # global, (16, ...)
  with checkpoint.open_manager(out / f"checkpoints-{stage}") as manager:
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


def main(out: str, resume: bool) -> None:
  distributed.initialize_from_environment()
  for stage in STAGES:
    seen = train(stage, pathlib.Path(out), resume=resume)
    if distributed.is_primary():
      np.savez(pathlib.Path(out) / f"stage{stage}{'-resumed' if resume else ''}.npz", **seen)


if __name__ == "__main__":
  main(sys.argv[1], "--resume" in sys.argv[2:])
