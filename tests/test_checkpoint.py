"""jzo.checkpoint: restored engines continue exactly; misfit or damaged checkpoints are refused."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jzo
from jzo import checkpoint
from jzo.checkpoint import files
from test_engine import (DOUT, HIDDEN, assert_close, batches, init_params, loss_fn, make_engine,
                         mesh_of)

# An engine per kind of state: host masters and moments updated by the C++
# kernel, with fp16's dynamic loss scale; optax's Adam on the devices (both
# saved in full shapes); and another optimizer's state as the devices keep it.
SETUPS = {
    "offload-cpu_adamw-fp16": dict(tx=lambda: jzo.cpu_adamw(1e-2, weight_decay=0.1),
                                   offload=True, stage=2, compute_dtype=jnp.float16),
    "device-optax.adam-bf16": dict(tx=lambda: optax.adam(1e-2), offload=False, stage=3,
                                   compute_dtype=jnp.bfloat16),
    "device-sgd-bf16": dict(tx=lambda: optax.sgd(1e-2, momentum=0.9), offload=False, stage=2,
                            compute_dtype=jnp.bfloat16),
}


def make(setup, devices=2, seed=0, **changes):
  options = {**SETUPS[setup], **changes}
  tx = options.pop("tx")()
  return make_engine(loss_fn, init_params(seed), tx, max_grad_norm=1.0, mesh=mesh_of(devices),
                     **options)


def copy(tree):
  """A snapshot (a state dict may share the engine's live host arrays)."""
  return jax.tree.map(np.array, tree)


def assert_same(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def trained(setup, steps, **changes):
  engine = make(setup, **changes)
  for b in batches(steps):
    engine.step(b)
  return engine


@pytest.mark.parametrize("setup", SETUPS)
def test_restore_continues_exactly(tmp_path, setup):
  data = batches(6)
  a = make(setup)
  for b in data[:3]:
    a.step(b)
  with checkpoint.open_manager(tmp_path) as manager:
    checkpoint.save(manager, a, 3)
  fresh = make(setup, seed=1)  # other weights, no step taken
  with pytest.raises(AssertionError):  # so that the comparisons below can fail
    assert_same(fresh.state_dict(), a.state_dict())
  with checkpoint.open_manager(tmp_path) as manager:  # a new manager, as a new process opens
    assert manager.all_steps() == [3]
    assert checkpoint.restore(manager, fresh) == 3
  assert_same(fresh.state_dict(), a.state_dict())
  for b in data[3:]:
    want, got = a.step(b), fresh.step(b)
    assert (float(got.loss), float(got.grad_norm), bool(got.skipped)) == \
           (float(want.loss), float(want.grad_norm), bool(want.skipped))
  assert_same(fresh.params, a.params)
  assert_same(fresh.state_dict(), a.state_dict())
  a.close()
  fresh.close()


def test_restore_a_given_step_and_keep_two(tmp_path):
  engine = make("offload-cpu_adamw-fp16")
  states = {}
  with checkpoint.open_manager(tmp_path) as manager:
    for step, b in enumerate(batches(3), start=1):
      engine.step(b)
      checkpoint.save(manager, engine, step)
      states[step] = copy(engine.state_dict())
    assert manager.all_steps() == [2, 3]  # max_to_keep=2: the oldest went
    assert checkpoint.restore(manager, engine, step=2) == 2
    assert_same(engine.state_dict(), states[2])
    assert checkpoint.restore(manager, engine) == 3
    assert_same(engine.state_dict(), states[3])
    with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint 1 in .*complete ones: "
                                                         r"\[2, 3\]"):
      checkpoint.restore(manager, engine, step=1)
    with pytest.raises(checkpoint.CheckpointError, match="not written: the latest there is "
                                                         "step 3"):
      checkpoint.save(manager, engine, 2)  # orbax alone would skip it silently
  engine.close()


def test_a_save_and_a_restore_hand_the_memory_they_freed_back(tmp_path, monkeypatch):
  """After each, malloc_trim returns the heap tensorstore's threads freed
  (on glibc, which this Linux has): the host's RSS does not stay higher
  for the rest of the run."""
  assert checkpoint.release_freed_memory()
  calls = []
  release = checkpoint.release_freed_memory
  # Counted where save and restore call it (the package's face re-exports it).
  monkeypatch.setattr(files, "release_freed_memory", lambda: calls.append(1) or release())
  engine = make("offload-cpu_adamw-fp16")
  engine.step(batches(1)[0])
  with checkpoint.open_manager(tmp_path) as manager:
    checkpoint.save(manager, engine, 1)
    assert len(calls) == 1
    checkpoint.restore(manager, engine)
    assert len(calls) == 2
  engine.close()


def test_adam_checkpoints_move_across_offload_device_counts_and_optimizers(tmp_path):
  """Offload on 8 devices -> optax.adamw without offload on 4 (stage 3, per
  layer) -> jzo.cpu_adamw with 0.4 offloaded on 2 (stage 1), through the
  disk: each continues the uninterrupted run to float32 rounding. The
  schedule's count in optax's chain comes back with Adam's."""
  data = batches(6)
  adamw = dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 6), weight_decay=0.1)
  kw = dict(compute_dtype=jnp.float32, max_grad_norm=1.0)
  run = make_engine(loss_fn, init_params(), jzo.cpu_adamw(**adamw), offload=True, stage=2,
                    mesh=mesh_of(8), **kw)
  relay = [
      (make_engine(loss_fn, init_params(1), optax.adamw(**adamw), stage=3, layers="blocks",
                   mesh=mesh_of(4), **kw), data[2:4]),
      (make_engine(loss_fn, init_params(1), jzo.cpu_adamw(**adamw), offload=0.4, stage=1,
                   mesh=mesh_of(2), **kw), data[4:])]
  for b in data[:2]:
    run.step(b)
  writer = run
  with checkpoint.open_manager(tmp_path) as manager:
    for engine, part in relay:
      step = int(run.state.step)
      checkpoint.save(manager, writer, step)
      with pytest.raises(AssertionError):  # so that the comparisons below can fail
        assert_close(engine.params, run.params)
      assert checkpoint.restore(manager, engine) == step
      for b in part:
        want, got = run.step(b), engine.step(b)
        assert_close([got.loss, got.grad_norm], [want.loss, want.grad_norm])
      assert_close(engine.params, run.params)
      writer = engine
  assert int(engine.state.step) == int(run.state.step) == 6
  for engine in (run, *(e for e, _ in relay)):
    engine.close()


def test_an_adam_engine_without_offload_loads_its_older_flat_checkpoints(tmp_path):
  """Before the full-shape format it saved its flat shards and optax state."""
  engine = trained("device-optax.adam-bf16", 2)
  full = engine.state_dict()
  older = {**{k: v for k, v in full.items() if k not in ("master", "mu", "nu", "count")},
           **jax.device_get({"master": engine.state.master, "opt_state": engine.state.opt_state})}
  with checkpoint.open_manager(tmp_path) as manager:
    assert manager.save(2, args=ocp.args.PyTreeSave(older))
    manager.wait_until_finished()
    fresh = make("device-optax.adam-bf16", seed=1)
    assert checkpoint.restore(manager, fresh) == 2
  assert_same(fresh.state_dict(), full)


def another_model(change):
  """init_params with a leaf renamed or reshaped."""
  params = init_params()
  if change == "renamed":
    params["tok"] = params.pop("embed")
  else:
    params["head"] = jnp.zeros((HIDDEN, DOUT + 1))
  return params


@pytest.mark.parametrize("change, first", [
    ("renamed", r"\['master'\]\['embed'\] only in the checkpoint; \['master'\]\['tok'\] only in "
                r"this engine; \['mu'\]\['embed'\] only in the checkpoint; .*; \.\.\.$"),
    ("reshaped", r"\['master'\]\['head'\] is float32\[12, 3\] in the checkpoint, "
                 r"float32\[12, 4\] in this engine; \['mu'\]\['head'\] is .*"),
], ids=["renamed", "reshaped"])
def test_a_checkpoint_of_another_model_is_refused_naming_the_first_difference(tmp_path, change,
                                                                              first):
  engine = trained("offload-cpu_adamw-fp16", 1)
  with checkpoint.open_manager(tmp_path) as manager:
    checkpoint.save(manager, engine, 1)
  # An Adam engine, which takes the checkpoint's format: only the model differs.
  other = jzo.ZeroEngine(loss_fn, another_model(change), optax.adam(1e-2), mesh=mesh_of(2))
  before = copy(other.state_dict())
  with pytest.raises(ValueError, match="^checkpoint does not fit this engine: " + first):
    other.load_state_dict(engine.state_dict())
  with checkpoint.open_manager(tmp_path) as manager:
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(
        f"checkpoint 1 in {tmp_path} does not fit this engine: ") + first):
      checkpoint.restore(manager, other)
  assert_same(other.state_dict(), before)  # nothing was loaded
  engine.close()


@pytest.mark.parametrize("saved, other, message", [
    # Adam's full shapes against another optimizer's flat state, both ways.
    ("offload-cpu_adamw-fp16", dict(offload=False, tx=lambda: optax.sgd(1e-2, momentum=0.9)),
     r"\['count'\] only in the checkpoint; \['master'\]\['blocks'\]\['b'\] is float32\[3, 12\] "
     r"in the checkpoint, float32\[36\] in this engine"),
    ("device-sgd-bf16", dict(offload=True, tx=lambda: jzo.cpu_adam(1e-2)),
     r"\['count'\] only in this engine; \['master'\]\['blocks'\]\['b'\] is float32\[36\] "
     r"in the checkpoint, float32\[3, 12\] in this engine"),
    # sgd without momentum keeps an empty state where momentum keeps a trace.
    ("device-sgd-bf16", dict(tx=lambda: optax.sgd(1e-2)),
     r"\['opt_state'\]\[0\] is a dict of 1 entry in the checkpoint, empty in this engine$"),
    # Flat state padded for 2 devices, for an engine over 8.
    ("device-sgd-bf16", dict(devices=8),
     r"\['master'\]\['blocks'\]\['b'\] is float32\[36\] in the checkpoint, float32\[40\] in this "
     r"engine"),
], ids=["adam-to-sgd", "sgd-to-adam", "momentum-to-none", "2-to-8-devices"])
def test_a_checkpoint_of_another_optimizer_or_device_count_is_refused(tmp_path, saved, other,
                                                                      message):
  engine = trained(saved, 2)
  with checkpoint.open_manager(tmp_path) as manager:
    checkpoint.save(manager, engine, 2)
  engine.close()
  other_engine = make(saved, **other)
  with checkpoint.open_manager(tmp_path) as manager:
    with pytest.raises(checkpoint.CheckpointError, match=message) as e:
      checkpoint.restore(manager, other_engine)
  assert str(e.value).startswith(f"checkpoint 2 in {tmp_path} does not fit this engine: ")
  assert e.value.step == 2 and e.value.directory == tmp_path
  assert len(str(e.value)) < 600, str(e.value)  # names the problem, dumps no arrays
  other_engine.close()


def damage(folder, how):
  """Damages checkpoint `folder` like a failing disk or a careless hand."""
  files = sorted(f for f in folder.rglob("*") if f.is_file())
  data = [f for f in files if f.parent.name == "d"]  # tensorstore's array chunks
  assert data, files
  if how == "truncate":
    for f in data:
      f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 2])
  elif how == "delete":  # the largest chunk file: the tree's metadata stays readable
    max(data, key=lambda f: f.stat().st_size).unlink()
  elif how == "overwrite":
    for f in files:
      f.write_bytes(b"corrupt")
  else:  # the tree's metadata: names, shapes and dtypes of the arrays
    (metadata,) = [f for f in files if f.name == "_METADATA"]
    metadata.write_text("{")


@pytest.mark.parametrize("how", ["truncate", "delete", "overwrite", "metadata"])
def test_a_damaged_checkpoint_is_unreadable(tmp_path, how):
  engine = trained("offload-cpu_adamw-fp16", 2)
  before = copy(engine.state_dict())
  with checkpoint.open_manager(tmp_path) as manager:
    checkpoint.save(manager, engine, 2)
  damage(tmp_path / "2", how)
  with checkpoint.open_manager(tmp_path) as manager:
    with pytest.raises(checkpoint.CheckpointError,
                       match=re.escape(f"checkpoint 2 in {tmp_path} is unreadable: ")) as e:
      checkpoint.restore(manager, engine)
  assert e.value.step == 2 and len(str(e.value)) < 600
  assert_same(engine.state_dict(), before)  # nothing was loaded
  engine.close()


def test_no_checkpoint(tmp_path):
  engine = make("device-optax.adam-bf16")
  # What a run killed while writing its first checkpoint leaves behind.
  (tmp_path / "1.orbax-checkpoint-tmp-1234567").mkdir()
  (tmp_path / "1.orbax-checkpoint-tmp-1234567" / "garbage").write_bytes(b"\0" * 100)
  with checkpoint.open_manager(tmp_path) as manager:
    assert manager.latest_step() is None
    with pytest.raises(checkpoint.CheckpointError,
                       match=re.escape(f"no checkpoint in {tmp_path}") + "$") as e:
      checkpoint.restore(manager, engine)
  assert e.value.step is None and isinstance(e.value, ValueError)
  empty = tmp_path / "new"
  with checkpoint.open_manager(empty) as manager:  # created, and empty
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint in"):
      checkpoint.restore(manager, engine)
  assert empty.is_dir()
  engine.close()
