"""Optimizer state split between device and host memory, and the planner."""

import dataclasses
import functools
import math
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
import pytest

import jzo
from jzo import checkpoint
from jzo.parallel import partition
from jzo import plan as plan_lib
from jzo.recipe import estimate as estimate_cli
from test_engine import (HIDDEN, LAYERS, assert_close, batches, init_params, loss_fn,
                         make_engine, mesh_of)
from test_offload import TX

PLACEMENTS = [0.0, 0.4, True]


@pytest.mark.parametrize("offload", PLACEMENTS, ids=lambda x: f"offload={x}")
@pytest.mark.parametrize("n_dev, stage, layers", [(1, 2, None), (8, 2, None), (8, 1, None),
                                                  (8, 3, "blocks")], ids=str)
def test_placement_matches_on_device_training(offload, n_dev, stage, layers):
  params, data = init_params(), batches(12)
  kw = dict(stage=stage, layers=layers, compute_dtype=jnp.bfloat16, mesh=mesh_of(n_dev),
            max_grad_norm=1.0)
  on_device = make_engine(loss_fn, params, TX(), **kw)
  placed = make_engine(loss_fn, params, TX(), offload=offload, **kw)
  fraction = placed.plan.offloaded_fraction
  # A padded leaf of stages 1-2 on several devices goes whole to one side.
  assert {0.0: fraction == 0, 0.4: 0.1 < fraction < 0.6, True: fraction == 1}[offload]
  for b in data:
    want, got = on_device.step(b), placed.step(b)
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-6, abs=1e-7)
  assert_close(placed.params, on_device.params)
  for a, b in zip(jax.tree.leaves(placed.state.params), jax.tree.leaves(on_device.state.params)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  device_share = placed.memory_per_device()["optimizer"]
  assert (device_share > 0) == (offload is not True)
  assert (placed.host_bytes_in_use() > 0) == (offload != 0.0)


@pytest.mark.parametrize("fraction", [1.0, 0.9999, 0.5, 0.0001, 0.0])
def test_a_fraction_of_a_shard_not_a_multiple_of_the_alignment_stays_inside_it(fraction):
  """The host part of a large shard is rounded to a cache line, never past the shard."""
  shapes = {"w": jax.ShapeDtypeStruct((3 * 43691,), jnp.float32)}  # shards of 43691 on 3
  plan = plan_lib.make_plan(shapes, 8, jzo.EngineOptions(offload=fraction, dpu_warmup=0),
                            n_devices=3)
  (layout,) = plan.leaves
  assert 0 <= layout.on_device <= layout.shard_size == 43691
  assert abs(layout.on_host - fraction * 43691) <= 16


def test_a_fraction_splits_every_large_leaf():
  engine = jzo.ZeroEngine(loss_fn, init_params(), TX(), options=jzo.EngineOptions(offload=0.5),
                          mesh=mesh_of(1))
  for layout in engine.plan.leaves:
    assert 0 < layout.on_device < layout.shard_size or layout.shard_size < 32
  assert engine.plan.has_device_state and engine.plan.has_host_state


def test_host_bytes_planned_equal_what_the_engine_allocates():
  for offload, delayed in ((True, False), (0.4, True)):
    engine = jzo.ZeroEngine(loss_fn, init_params(), TX(),
                            options=jzo.EngineOptions(offload=offload, delayed_update=delayed,
                                                      dpu_warmup=0),
                            mesh=mesh_of(8))
    planned = engine.plan.host_bytes()
    assert engine.host_bytes_in_use() == planned["master"] + planned["moments"]  # before a step
    for b in batches(3):
      engine.step(b)
    # One set of landing buffers, with the delayed update too.
    assert engine.host_bytes_in_use() == sum(planned.values())
    assert engine.host_update.landing_bytes() == (planned["landing"] if delayed else 0)
    device = engine.plan.device_bytes()
    mem = engine.memory_per_device()
    assert mem["optimizer"] == device["master"] + device["moments"] + (
        4 if engine.plan.has_device_state else 0)  # + the device Adam's int32 count
    engine.close()


def test_partial_placement_with_delayed_update_trains():
  """The host part lands one step late, the device part at once: the loss
  still falls like plain training's, and nothing diverges."""
  params, data = init_params(), batches(30)
  engine = jzo.ZeroEngine(loss_fn, params, TX(),
                          options=jzo.EngineOptions(offload=0.5, delayed_update=True, dpu_warmup=2,
                                                    compute_dtype=jnp.float32),
                          mesh=mesh_of(8))
  losses = [float(engine.step(b).loss) for b in data]
  engine.close()
  assert np.isfinite(losses).all() and np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])


def test_auto_fills_the_device_and_offloads_the_rest():
  params = init_params()
  n = sum(x.size for x in jax.tree.leaves(params))
  kw = dict(offload="auto", mesh=mesh_of(1), activation_memory=1000)
  roomy = make_engine(loss_fn, params, TX(), device_memory=10**9, **kw)
  assert roomy.plan.offloaded_fraction == 0.0
  # bf16 params and gradients (4 n bytes) fit, and about half the state:
  # whole leaves, largest first, as many as fit, then part of one more.
  budget = int((4 * n + 6 * n + 1000) / (1 - plan_lib.DEVICE_HEADROOM))
  tight = make_engine(loss_fn, params, TX(), device_memory=budget, **kw)
  assert 0 < tight.plan.offloaded_fraction < 1
  assert len([l for l in tight.plan.leaves if 0 < l.on_device < l.shard_size]) <= 1
  # It fits (the step's peak, the exchange after it, the draw beside the
  # state), and one more aligned block of 16 elements of the largest host
  # leaf on the device would not.
  plan, limit = tight.plan, budget * (1 - plan_lib.DEVICE_HEADROOM)
  need = lambda p: max(sum(p.device_peak(1000).values()),
                       sum(p.device_bytes().values()) + p.build_bytes())
  assert need(plan) <= limit
  leaves, treedef = jax.tree.flatten(plan.layouts, is_leaf=partition.is_layout)
  i = max(range(len(leaves)), key=lambda i: leaves[i].on_host)
  leaves[i] = leaves[i].place(leaves[i].on_device + 16)
  more = dataclasses.replace(plan, layouts=jax.tree.unflatten(treedef, leaves))
  assert need(more) > limit
  for b in batches(3):
    tight.step(b)


def test_what_does_not_fit_is_refused_before_drawing_weights():
  drawn = []

  def params():
    tree = init_params()
    if not isinstance(tree["head"], jax.core.Tracer):  # traced for shapes is fine
      drawn.append(True)
    return tree
  with pytest.raises(MemoryError, match=r"needs .* GiB per device .* available"):
    jzo.ZeroEngine(loss_fn, params, TX(), options=jzo.EngineOptions(offload=0.0),
                   device_memory=1000, mesh=mesh_of(1))
  with pytest.raises(MemoryError, match="all on the host does not fit|needs"):
    jzo.ZeroEngine(loss_fn, params, TX(), options=jzo.EngineOptions(offload="auto"),
                   device_memory=1000, mesh=mesh_of(1))
  with pytest.raises(MemoryError, match="host RAM"):
    jzo.ZeroEngine(loss_fn, params, TX(), options=jzo.EngineOptions(offload=True), host_memory=1000,
                   mesh=mesh_of(1))
  assert not drawn  # shapes were traced, no weight was drawn


def test_bad_offload_values():
  params = init_params()
  for bad in (1.5, -0.1, "half"):
    with pytest.raises(ValueError, match="offload"):
      jzo.ZeroEngine(loss_fn, params, TX(), options=jzo.EngineOptions(offload=bad), mesh=mesh_of(1))
  with pytest.raises(ValueError, match="needs the device memory"):
    jzo.ZeroEngine(loss_fn, params, TX(), options=jzo.EngineOptions(offload="auto"),
                   mesh=mesh_of(1))


def test_draws_are_grouped_largest_first_within_the_largest_leafs_size_or_the_floor():
  """Each group a program: never more float32 at once than the largest
  leaf, or than the floor where that is more."""
  assert plan_lib.draw_groups([2, 8, 3, 5, 1, 8], floor=0) == [[1], [5], [3, 2], [0, 4]]
  assert plan_lib.draw_groups([4, 4, 4], floor=0) == [[0], [1], [2]]
  assert plan_lib.draw_groups([7], floor=0) == [[0]]
  assert plan_lib.draw_groups([2, 8, 3, 5, 1, 8], floor=10) == [[1], [5], [3, 2, 0], [4]]

  # 64 MiB of float32 where the devices report no memory limit; where the
  # plan budgets it, none.
  shapes = {"a": jnp.zeros((8, 4)), "b": jnp.zeros(3), "c": jnp.zeros(5)}
  plan = lambda memory: plan_lib.make_plan(shapes, 8, jzo.EngineOptions(offload=0.0),
                                           n_devices=1, device_memory=memory)
  assert plan(None).draw_floor == plan_lib.DRAW_GROUP_FLOOR and plan(2**30).draw_floor == 0
  # On one device each leaf's copies are written straight into their buffers.
  assert plan(None).build_bytes() == 4 * 40  # every leaf
  assert plan(2**30).build_bytes() == 4 * 32  # the largest leaf alone
  # Over 4 devices the first one also holds one device's piece of a leaf on
  # its way there: stage 3's bf16 weights and the float32 master in quarters
  # (the larger), stage 2's bf16 weights whole (every device's are).
  over4 = lambda stage: plan_lib.make_plan(shapes, 8, jzo.EngineOptions(stage=stage, offload=0.0),
                                           n_devices=4, device_memory=2**30)
  assert over4(3).build_bytes() == 4 * 32 + 4 * 32 // 4
  assert over4(2).build_bytes() == 4 * 32 + 2 * 32


def test_the_build_writes_a_leafs_copies_into_their_buffers_without_a_copy_of_the_leaf():
  """What Plan.build_bytes counts beside the float32 draw: on one device
  nothing (each program computes straight into its buffer), and a device's
  piece of the device part is made without the part whole. (The bf16
  piece's convert fuses into its slice on the GPU, not on the CPU, as
  measured on an H200.)"""
  from jzo.state import fill
  compiled = lambda fn, *args: fn.lower(*args).compile().memory_analysis()
  for per_layer in (False, True):
    layout = partition.LeafLayout((8, 64, 256), 4, per_layer).place(1024)
    flat = jnp.zeros(layout.flat_shape, jnp.float32)
    for fn in (fill.LowpFromMaster(jnp.bfloat16, False, layout),
               fill.LowpFromMaster(jnp.bfloat16, True, layout),
               partition.SplitPart(layout, 0)):
      out = jax.eval_shape(fn, flat)
      write = compiled(fill.write_into, jnp.zeros(out.shape, out.dtype), flat, fn)
      assert write.temp_size_in_bytes == 0
      assert write.alias_size_in_bytes == write.output_size_in_bytes  # into the buffer
    device_part = partition.SplitPart(layout, 0)
    part = jax.eval_shape(device_part, flat).shape
    piece = part[:-1] + (part[-1] // 4,)
    made = compiled(fill.piece_of, flat, device_part, piece, (0,) * len(piece))
    assert made.temp_size_in_bytes == 0 and made.output_size_in_bytes == 4 * math.prod(piece)


def test_a_stacked_leaf_is_drawn_a_slice_of_layers_at_a_time_where_the_source_can():
  """Where the devices' memory is budgeted, a stacked leaf larger than every
  other draw is drawn a slice of its layers at a time from arrays and files
  (an initializer computes its leaves whole); the plan counts the slices."""
  shapes = {"embed": jnp.zeros((60, 100)), "blocks": {"w": jnp.zeros((12, 40, 50)),
                                                     "b": jnp.zeros((12, 50))}}
  plan = lambda sliced, n=1: plan_lib.make_plan(
      shapes, 8, jzo.EngineOptions(stage=3, layers="blocks", offload=True), n_devices=n,
      device_memory=2**30, sliced_draws=sliced)
  w, b, embed = 1, 0, 2  # jax.tree.leaves order: blocks.b, blocks.w, embed
  assert plan(False).build_groups() == [[(w, None)], [(embed, None), (b, None)]]  # largest first
  assert plan(False).build_bytes() == 4 * 24000
  # Slices of the largest other draw's size (embed's 6000 elements): 3 layers of 2000.
  groups = plan(True).build_groups()
  assert sorted(span for group in groups for i, span in group if i == w) == [
      (0, 3), (3, 6), (6, 9), (9, 12)]
  assert all(span is None for group in groups for i, span in group if i != w)
  assert plan(True).build_bytes() == 4 * 6000
  # Over 4 devices a slice's stage-3 bf16 piece comes beside it.
  assert plan(True, 4).build_bytes() == 4 * 6000 + 2 * 6000 // 4
  # Memory for a quarter of the state, its step and a slice, not for the leaf whole.
  sliced = plan(True, 4)
  memory = max(sum(sliced.device_peak().values()),
               sum(sliced.device_bytes().values()) + sliced.build_bytes())
  options = jzo.EngineOptions(stage=3, layers="blocks", offload=True)
  plan_lib.make_plan(shapes, 8, options, n_devices=4, device_memory=memory, sliced_draws=True)
  with pytest.raises(jzo.PlacementError, match="an initializer computes each leaf whole"):
    plan_lib.make_plan(shapes, 8, options, n_devices=4, device_memory=memory)


@pytest.mark.parametrize("n, options", [
    (1, dict(offload=True)), (8, dict(offload=True)), (8, dict(offload=0.5)),
    (8, dict(offload=False)), (8, dict(offload=True, offload_params=True))],
    ids=["1-host", "8-host", "8-split", "8-device", "8-weights-on-host"])
def test_slices_of_layers_build_the_state_of_the_whole_draws(n, options):
  """The same state, bit for bit, from an initializer (whole draws), from
  arrays and from HostLeafs (a slice of layers at a time, read through
  load_rows, never whole), in every placement."""
  from test_grads_in_params import loss_fn as scanned_loss
  params = jax.jit(init_params)()  # the values the initializer's draws compute (not eager's)
  rows_read, whole_read = [], []

  def lazy(x):
    x = np.asarray(x)
    return jzo.HostLeaf(x.shape, x.dtype, lambda: whole_read.append(x.shape) or x.copy(),
                        lambda lo, hi: rows_read.append((lo, hi)) or x[lo:hi].copy())
  kw = dict(stage=3, layers="blocks", mesh=mesh_of(n), device_memory=2**30,
            host_memory=2**35, grads_in_params=options.get("offload") is not False, **options)
  engines = [make_engine(scanned_loss, source, jzo.cpu_adamw(1e-2), **kw)
             for source in (init_params, params, jax.tree.map(lazy, params))]
  whole, *sliced = engines
  assert not whole.plan.sliced_draws and all(e.plan.sliced_draws for e in sliced)
  assert any(span for group in sliced[0].plan.build_groups() for _, span in group)
  assert rows_read and (LAYERS, HIDDEN, HIDDEN) not in whole_read
  for e in sliced:
    jax.tree.map(np.testing.assert_array_equal, e.state_dict(), whole.state_dict())
  for b in batches(2):
    losses = {float(e.step(b).loss) for e in engines}
    assert len(losses) == 1, losses
  for e in engines:
    e.close()


def test_params_as_a_function_are_drawn_to_the_same_weights():
  make = lambda: init_params()
  from_fn = jzo.ZeroEngine(loss_fn, make, TX(), options=jzo.EngineOptions(offload=0.5),
                           mesh=mesh_of(2))
  # Each leaf is the jitted function's leaf (eager code may round differently).
  jax.tree.map(np.testing.assert_array_equal, from_fn.params, jax.jit(make)())
  from_tree = jzo.ZeroEngine(loss_fn, make(), TX(), options=jzo.EngineOptions(offload=0.5),
                             mesh=mesh_of(2))
  for b in batches(3):
    from_tree.step(b)
    from_fn.step(b)
  assert_close(from_fn.params, from_tree.params)


ADAMW = dict(learning_rate=1e-2, weight_decay=0.1)
RESHARD_OPTIONS = dict(compute_dtype=jnp.float32, max_grad_norm=1.0)
# Where an offload run of 8 devices (stage 2) goes on: without offload,
# optax's Adam on 4 devices and jzo's on one; another placement on 2.
RESHARDED = {
    "optax.adamw-4-devices-stage-3": dict(tx=lambda: optax.adamw(**ADAMW), offload=False,
                                          n_dev=4, stage=3, layers="blocks"),
    "cpu_adamw-1-device-stage-0": dict(tx=lambda: jzo.cpu_adamw(**ADAMW), offload=False,
                                       n_dev=1, stage=0),
    "offload-0.4-2-devices-stage-1": dict(tx=lambda: jzo.cpu_adamw(**ADAMW), offload=0.4,
                                          n_dev=2, stage=1),
}


@pytest.fixture(scope="module")
def offload_run():
  """6 steps with offload on 8 devices: (the state dict after 3, the (loss,
  grad norm) of each later step, the final params)."""
  data = batches(6)
  engine = make_engine(loss_fn, init_params(), jzo.cpu_adamw(**ADAMW), offload=True, stage=2,
                       mesh=mesh_of(8), **RESHARD_OPTIONS)
  for b in data[:3]:
    engine.step(b)
  saved = jax.tree.map(np.array, engine.state_dict())  # a snapshot: it holds live host arrays
  metrics = [(m.loss, m.grad_norm) for m in map(engine.step, data[3:])]
  params = engine.params
  engine.close()
  return saved, metrics, params


@pytest.mark.parametrize("target", RESHARDED)
def test_an_offload_state_dict_continues_in_another_layout(offload_run, target):
  saved, metrics, params = offload_run
  options = dict(RESHARDED[target])
  tx, n_dev = options.pop("tx"), options.pop("n_dev")
  resumed = make_engine(loss_fn, init_params(1), tx(), mesh=mesh_of(n_dev), **options,
                        **RESHARD_OPTIONS)
  with pytest.raises(AssertionError):  # so that the comparisons below can fail
    assert_close(resumed.params, params)
  resumed.load_state_dict(saved)
  for b, want in zip(batches(6)[3:], metrics):
    got = resumed.step(b)
    assert_close((got.loss, got.grad_norm), want)
  assert_close(resumed.params, params)
  assert int(resumed.state.step) == 6
  resumed.close()


def run_estimate(*args):
  return subprocess.run([sys.executable, "-m", "jzo.estimate", *args], capture_output=True,
                        text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def estimate_here(capsys, *args):
  """`python -m jzo.estimate ARGS`'s main in this process, as run_estimate
  gives it (a subprocess, which takes seconds more to start JAX)."""
  try:
    code = estimate_cli.main(list(args))
  except SystemExit as e:  # the parser's errors
    code = e.code
  out = capsys.readouterr()
  return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_estimate_cli_on_the_10b_model_and_an_h100(capsys):
  estimate = functools.partial(estimate_here, capsys)
  h100 = ("--model", "gpt2-10b", "--host-gb", "125", "--device-gb", "75.6")
  for moments in ("fp32", "bf16"):
    out = estimate(*h100, "--moments", moments)
    assert out.returncode == 0, out.stderr
    assert "10.279B params" in out.stdout and out.stdout.rstrip().endswith("fits")
    assert "on the device" in out.stdout and "host update about" in out.stdout
  # 100 GiB of host has no room for a step's landing buffers beside fp32
  # moments: the update streams through 2 GiB of them
  out = estimate(*h100[:3], "100", *h100[4:])
  assert out.returncode == 0 and "landing (streamed)        2.00" in out.stdout
  # 85 GiB is too little even so: refused with the numbers
  out = estimate(*h100[:3], "85", *h100[4:])
  assert out.returncode == 1 and "GiB of host RAM" in out.stdout
  assert "85.00 GiB available" in out.stdout
  # All of the state on the host fits 123 GiB, but not beside a checkpoint's save
  on_host = ("--host-gb", "123", "--stage", "3", "--grads-in-params", "--offload", "true",
             "--batch-size", "32")
  out = estimate(*h100[:2], *on_host)
  assert out.returncode == 1 and "checkpoint writes         2.50" in out.stdout
  assert "it fits without the 2.50 GiB a checkpoint's save takes" in out.stdout
  out = estimate(*h100[:2], *on_host, "--no-checkpoints")
  assert out.returncode == 0 and "checkpoint writes" not in out.stdout


def test_llama_70b_on_four_h200s_fits_from_a_checkpoint_not_from_scratch(capsys):
  """From scratch the initializer computes Llama-3.1-70B's MLP kernels whole
  in float32, 140 GiB, more than a GPU; read from a checkpoint a slice of
  layers at a time, the run fits four H200s and the 4 x H200 box's host."""
  run = ("--model", "llama-3.1-70b", "--devices", "4", "--batch-size", "16", "--seq-len", "4096",
         "--stage", "3", "--moments", "int8", "--grads-in-params", "--host-gb", "503",
         "--device-gb", "139")
  out = estimate_here(capsys, *run)
  assert out.returncode == 1 and "an initializer computes each leaf whole" in out.stdout
  out = estimate_here(capsys, *run, "--from-checkpoint")
  assert out.returncode == 0 and out.stdout.rstrip().endswith("fits"), out.stdout
  assert "70.554B params" in out.stdout


def test_the_device_is_checked_against_the_landing_buffers_the_plan_chose(capsys):
  """Where a whole set of landing buffers would not fit the device beside the
  exchange, the update streams through spans: the device is checked against
  that plan, the one the table shows, not against the set it replaced."""
  gpt2_20b = ("--model", "gpt2-20b", "--moments", "int8", "--host-gb", "125", "--batch-size",
              "8", "--micro-batch", "8")
  out = estimate_here(capsys, *gpt2_20b, "--device-gb", "85")
  assert out.returncode == 0 and out.stdout.rstrip().endswith("fits"), out.stdout
  assert "landing (streamed)" in out.stdout
  out = estimate_here(capsys, *gpt2_20b, "--device-gb", "80")
  peak = next(line.split()[2] for line in out.stdout.splitlines() if "total (peak)" in line)
  assert out.returncode == 1 and f"needs {peak} GiB per device" in out.stdout, out.stdout


def test_a_refused_plan_shows_the_plan_its_numbers_are_of(capsys):
  """gpt2-20b overlapping its forward with the host update needs a whole set
  of landing buffers; on a host without room for them the planner tries the
  streamed update, which does not fit either. The table is that plan's, whose
  host total is the refusal's need less the chunk the build copies through."""
  out = estimate_here(capsys, "--model", "gpt2-20b", "--moments", "int8", "--stage", "3",
                      "--grads-in-params", "--batch-size", "32", "--device-gb", "139",
                      "--host-gb", "118")
  assert out.returncode == 1 and "landing (streamed)" in out.stdout, out.stdout
  total = next(float(line.split()[1]) for line in out.stdout.splitlines()
               if line.split()[:1] == ["total"] and "(peak)" not in line)
  need = float(re.search(r"needs ([0-9.]+) GiB of host RAM", out.stdout)[1])
  assert need == pytest.approx(total + plan_lib.BUILD_CHUNK_BYTES / 2**30, abs=0.011)


def test_estimate_cli_help_and_bad_input(capsys):
  out = run_estimate("--help")
  assert out.returncode == 0 and "--device-gb" in out.stdout
  out = run_estimate("--model", "gpt5")
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1, out.stderr
  assert "'gpt5'" in lines[0] and "'gpt2-10b'" in lines[0] and "'qwen2.5-14b'" in lines[0]
  out = estimate_here(capsys, "--model", "gpt2-10b", "--offload", "1.5")
  assert out.returncode == 2 and "fraction must be in [0, 1]" in out.stderr
  for args, message in ((["--model", "gpt2-4b", "--host-gb", "0"], "--host-gb must be > 0"),
                        (["--model", "gpt2-4b", "--stage", "5"], "for argument '--stage'"),
                        (["--devices", "2"], "Missing from python -m jzo.estimate: --model")):
    out = estimate_here(capsys, *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr


def test_the_host_check_counts_a_checkpoints_save():
  """checkpoint_memory is counted beside the offloaded state, up to what a
  save of this state can hold (`save_bytes`: a small model's is far below
  jzo.checkpoint.SAVE_HOST_BYTES); a plan it alone pushes past the host
  says so, and the engine refuses the same before drawing anything."""
  params = init_params()
  need = jzo.estimate(params, devices=8, offload=True, device_memory=10**9,
                      host_memory=1 << 40)
  total = sum(need.plan.host_bytes().values()) + need.plan.runtime_bytes
  elements = sum(l.shards * l.shard_size * (l.shape[0] if l.per_layer else 1)
                 for l in need.plan.leaves)
  figure = plan_lib.save_bytes(12 * elements)  # float32 masters and two moments
  assert figure < checkpoint.SAVE_HOST_BYTES
  said = f"checkpoint writes {figure / 2**30:.2f} GiB"
  # Room for the state and its build, not for the save: the estimate's GPUs
  # have pinned pools, the engine's CPU devices none.
  host = total + need.plan.pool_overhead() + plan_lib.BUILD_CHUNK_BYTES + figure // 2
  assert jzo.estimate(params, devices=8, offload=True, device_memory=10**9,
                      host_memory=host).fits
  saved = jzo.estimate(params, devices=8, offload=True, device_memory=10**9, host_memory=host,
                       checkpoint_memory=checkpoint.SAVE_HOST_BYTES)
  assert not saved.fits and saved.plan.checkpoint_bytes == figure
  assert said in saved.error, saved.error
  assert f"it fits without the {figure / 2**30:.2f} GiB a checkpoint's save takes" in saved.error
  # The refused plan it shows is the GPUs' plan the check refused: their pools, as where it fits.
  assert saved.plan.pool_overhead() == need.plan.pool_overhead() > 0
  assert saved.plan.draw_floor == need.plan.draw_floor == 0
  on_cpus = plan_lib.make_plan(params, 8, jzo.EngineOptions(offload=True), n_devices=8)
  with pytest.raises(jzo.PlacementError, match=said) as refused:
    jzo.ZeroEngine(loss_fn, init_params, TX(), options=jzo.EngineOptions(offload=True),
                   mesh=mesh_of(8), host_memory=total + on_cpus.build_bytes() + figure // 2,
                   checkpoint_memory=checkpoint.SAVE_HOST_BYTES)
  assert refused.value.plan.checkpoint_bytes == figure  # the plan refused, with the error
  # A large state's save counts the whole of SAVE_HOST_BYTES.
  large = {"w": jax.ShapeDtypeStruct((2**28,), jnp.float32)}
  assert jzo.estimate(large, offload=True, device_memory=10**9, host_memory=1 << 40,
                      checkpoint_memory=checkpoint.SAVE_HOST_BYTES
                      ).plan.checkpoint_bytes == checkpoint.SAVE_HOST_BYTES
  # Where the state alone does not fit either, the message does not blame the save.
  tight = jzo.estimate(params, devices=8, offload=True, device_memory=10**9, host_memory=2**30,
                       checkpoint_memory=checkpoint.SAVE_HOST_BYTES)
  assert not tight.fits and "it fits without" not in tight.error


def test_the_runtime_this_process_holds_is_not_counted_twice():
  """Once JAX has run anything on a GPU, the process holds most of its
  runtime: the available memory no longer includes it, and the plan counts
  it as a need. The engine and jzo.estimate add back what the process holds,
  up to the runtime the plan counts, so they answer as a fresh process would."""
  runtime = plan_lib.host_runtime_bytes(1, "cpu")
  gib = plan_lib.GiB
  engine = lambda host_memory: jzo.ZeroEngine(
      loss_fn, init_params, TX(), options=jzo.EngineOptions(offload=True), mesh=mesh_of(1),
      host_memory=host_memory)
  # The tiny model's state is a few MiB beside the runtime.
  host_memory = plan_lib.host_memory_for(runtime, available=runtime - gib, held=gib // 2)
  assert host_memory == runtime - gib // 2
  with pytest.raises(jzo.PlacementError, match=rf"{(runtime - gib // 2) / gib:.2f} GiB available"):
    engine(host_memory)
  host_memory = plan_lib.host_memory_for(runtime, available=runtime - gib, held=2 * gib)
  assert host_memory == runtime + gib and engine(host_memory).plan.offloaded_fraction == 1
  # What the process holds beyond the runtime is not the runtime's: not added back.
  assert plan_lib.host_memory_for(runtime, available=0, held=10 * runtime) == runtime

  def between(read, get) -> bool:
    """get() lies between two read()s around it (within 64 MiB: other
    processes' memory moves meanwhile, so a few tries)."""
    for _ in range(3):
      before, got, after = read(), get(), read()
      if min(before, after) - 2**26 <= got <= max(before, after) + 2**26:
        return True
    return False

  # By default: what is available now, and this process's resident set.
  rss = lambda: psutil.Process().memory_info().rss
  assert rss() > 2**27  # (jax's own: enough to tell added from not)
  assert between(lambda: min(rss(), runtime), lambda: plan_lib.host_memory_for(runtime, 0))
  assert between(plan_lib.available_host_memory,
                 lambda: plan_lib.host_memory_for(runtime, held=0))
  assert between(lambda: plan_lib.host_memory_for(runtime), lambda: jzo.estimate(
      init_params(), devices=1, offload=True, device_memory=10**9).host_memory)


def test_estimate_agrees_with_the_engine():
  params = init_params()
  est = jzo.estimate(params, devices=8, offload=0.4, device_memory=10**9, host_memory=1 << 40)
  engine = jzo.ZeroEngine(loss_fn, params, TX(), options=jzo.EngineOptions(offload=0.4),
                          mesh=mesh_of(8))
  assert est.fits and est.plan.host_bytes() == engine.plan.host_bytes()
  assert est.plan.device_bytes() == engine.plan.device_bytes()


def with_table(pool: int) -> int:
  """Host bytes of a pinned pool of `pool` bytes and its allocator's table
  (an 8-byte handle for each 256 bytes, measured: 0.74 GiB beside 24 GiB)."""
  return pool + pool // 32


def test_the_pinned_pool_is_capped_at_the_landing_buffers(monkeypatch):
  """XLA's pinned pool rounds a region up to a power of two unless its cap
  stops it: the cap set from the landing bytes keeps the pool near them."""
  GiB = 2**30
  monkeypatch.delenv(plan_lib.PINNED_POOL_LIMIT_VAR, raising=False)
  landing = int(21.6 * GiB)
  assert plan_lib.pinned_pool_bytes(landing) == with_table(32 * GiB)  # XLA's default cap: 64
  assert plan_lib.limit_pinned_pool(landing) == 24 * GiB  # 21.6 + 2 of headroom, whole GiB
  assert plan_lib.pinned_pool_bytes(landing) == with_table(24 * GiB)
  # A region that is a power of two already grows by the headroom: a
  # streamed update's 2 GiB of spans took pools of 4.1 GiB on one GPU and two.
  monkeypatch.delenv(plan_lib.PINNED_POOL_LIMIT_VAR)
  assert (plan_lib.pinned_pool_bytes(2 * GiB) == plan_lib.pinned_pool_bytes(2 * GiB, 2)
          == with_table(4 * GiB))
  # a cap the user chose is kept
  monkeypatch.setenv(plan_lib.PINNED_POOL_LIMIT_VAR, "40")
  assert plan_lib.limit_pinned_pool(landing) == 40 * GiB
  monkeypatch.setenv(plan_lib.PINNED_POOL_LIMIT_VAR, "lots")
  with pytest.raises(ValueError, match="whole number of GiB"):
    plan_lib.pinned_pool_limit()


def test_each_devices_pinned_pool_is_capped_at_its_share(monkeypatch):
  """One process over several GPUs has a pinned pool per GPU, each holding
  its share of the landing buffers: each is capped at that share and its
  part of the headroom (at least 1 GiB), and the plan counts every pool's
  rounding and the runtime of every GPU."""
  GiB = 2**30
  monkeypatch.delenv(plan_lib.PINNED_POOL_LIMIT_VAR, raising=False)
  landing = int(23.9 * GiB)  # gpt2-13b's gradients in bf16
  assert plan_lib.pinned_pool_bytes(landing, 4) == 4 * with_table(8 * GiB)  # 5.98 up to 8
  assert plan_lib.limit_pinned_pool(landing, 4) == 7 * GiB  # 5.98 + 1 of headroom, whole GiB
  assert plan_lib.pinned_pool_bytes(landing, 4) == 4 * with_table(7 * GiB)
  monkeypatch.delenv(plan_lib.PINNED_POOL_LIMIT_VAR)
  assert plan_lib.limit_pinned_pool(landing, 2) == 13 * GiB  # 11.95 + 1
  assert plan_lib.host_runtime_bytes(1) == plan_lib.HOST_RUNTIME_BYTES
  assert plan_lib.host_runtime_bytes(4) == (plan_lib.HOST_RUNTIME_BYTES
                                            + 3 * plan_lib.HOST_RUNTIME_BYTES_PER_DEVICE)
  assert plan_lib.host_runtime_bytes(4, "cpu") == plan_lib.HOST_RUNTIME_BYTES
  # Each GPU's allocator keeps a table of 1/32 of the memory it manages.
  assert plan_lib.host_runtime_bytes(2, "gpu", 64 * GiB) == (
      plan_lib.host_runtime_bytes(2) + 2 * 2 * GiB)
  assert plan_lib.host_runtime_bytes(2, "tpu", 64 * GiB) == plan_lib.host_runtime_bytes(2)
  est = jzo.estimate(init_params(), devices=4, offload=True, device_memory=10**9,
                     host_memory=1 << 40)
  pinned = est.plan.pinned_bytes()  # a few KiB: each pool is its share and 1 GiB of headroom
  assert est.plan.pool_overhead() == 4 * with_table(plan_lib.pool_share(pinned, 4) + GiB) - pinned
  four_gpus = dataclasses.replace(est.plan, runtime_bytes=plan_lib.host_runtime_bytes(4))
  assert f"runtime (CUDA, XLA)   {plan_lib.host_runtime_bytes(4) / GiB:8.2f}" in str(four_gpus)


def test_visible_gpus_are_counted_before_jax_starts(monkeypatch):
  """The pools' cap is set before JAX starts its GPU backend, so the GPUs
  are counted as CUDA counts them: CUDA_VISIBLE_DEVICES up to its first
  invalid entry, at least one."""
  for listed, count in (("0,1,2,3", 4), ("2", 1), ("0,1,-1,3", 2), ("", 1),
                        ("GPU-8a1b,GPU-77c2", 2)):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    assert plan_lib.visible_gpus() == count, listed


def test_landing_buffers_beyond_the_pinned_pool_cap_are_refused(monkeypatch):
  monkeypatch.setenv(plan_lib.PINNED_POOL_LIMIT_VAR, "1")
  params = lambda: {"w": jnp.zeros(2**29)}  # 1 GiB of bf16 gradients; never drawn
  est = jzo.estimate(params, offload=True, device_memory=80 * 2**30, host_memory=100 * 2**30)
  assert not est.fits and "pinned pool of a device is capped at 1 GiB" in est.error
  # Over four devices each pool holds a quarter, beside a chunk of the build.
  assert jzo.estimate(params, devices=4, offload=True, device_memory=80 * 2**30,
                      host_memory=100 * 2**30).fits
  with pytest.raises(MemoryError, match=plan_lib.PINNED_POOL_LIMIT_VAR):
    jzo.ZeroEngine(lambda p, b: jnp.sum(p["w"]), params, jzo.cpu_adamw(1e-3),
                   options=jzo.EngineOptions(offload=True), device_memory=80 * 2**30,
                   host_memory=100 * 2**30, mesh=mesh_of(1))
