"""Gradient accumulation on the host, on 8 fake CPU devices: the
same training as accumulation on the device, the step's norm, skip and loss
scale, what each side holds, the kernel, the planner's bytes and its pick."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jzo
from jzo import kernels
from jzo import plan as planner
from jzo.plan import GiB, PlacementError
from test_engine import assert_close, batches, init_params, loss_fn, make_engine, mesh_of
from test_nonfinite import poisoned_loss, with_poison
from test_offload import TX

K = 4  # micro-batches a step


def engines(accumulations=("device", "host"), loss=loss_fn, **kw):
  """One engine per accumulation, the rest of their options the same."""
  return [make_engine(loss, init_params(), TX(), grad_accum=K, max_grad_norm=1.0, accumulation=a,
                      mesh=mesh_of(8), **kw) for a in accumulations]


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
@pytest.mark.parametrize("offload", [True, 0.5], ids=["all-host", "half-host"])
@pytest.mark.parametrize("stage, layers", [(1, None), (2, None), (3, None), (3, "blocks")],
                         ids=str)
def test_host_accumulation_equals_device_accumulation(stage, layers, offload, delayed):
  """float32 compute: every step's loss and norm, and the weights, agree to
  float32 rounding with the same engine summing on the device (with the
  delayed update: step t + 1's micro-batches all see weights without step
  t's host update, as the device accumulation's one call does)."""
  on_device, on_host = engines(stage=stage, layers=layers, offload=offload,
                               compute_dtype=jnp.float32, delayed_update=delayed, dpu_warmup=1)
  assert on_host.plan.host_accumulation and not on_device.plan.host_accumulation
  for b in batches(5, size=64):
    want, got = on_device.step(b), on_host.step(b)
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-6)
    assert float(got.grad_norm) == pytest.approx(float(want.grad_norm), rel=1e-5)
  assert_close(on_host.params, on_device.params)


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_sums_of_the_same_micro_batch_gradients_match_without_offload(stage):
  """bf16: each micro-batch's reduced gradient is the same bf16 on both
  paths and the host sums it in float32 as the device does."""
  kw = dict(stage=stage, compute_dtype=jnp.bfloat16, mesh=mesh_of(8), grad_accum=K,
            max_grad_norm=1.0)
  plain = make_engine(loss_fn, init_params(), TX(), **kw)
  on_host = make_engine(loss_fn, init_params(), TX(), offload=True, accumulation="host", **kw)
  for b in batches(4, size=64):
    want, got = plain.step(b), on_host.step(b)
    assert float(got.grad_norm) == pytest.approx(float(want.grad_norm), rel=1e-5)
  assert_close(on_host.params, plain.params)


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_a_non_finite_micro_batch_skips_the_whole_step_and_fp16_scaling_follows(delayed):
  """fp16: an inf in one example of the third micro-batch of step 2 skips
  that step on both paths (counted, loss scale halved, no weight moves);
  the loss scale grows the same; training goes on identically."""
  data = [with_poison(b) for b in batches(5, size=64)]
  # 8 rows a device, 2 a micro-batch: row 20 is device 2's third micro-batch
  data[2] = with_poison(data[2], np.inf, example=2 * 8 + 2 * 2)
  # A scale that does not overflow by itself (the device's fp16 rounding of
  # its float32 sums would at 2**16, where the host's sums do not), grown
  # every 2 clean steps so that its update is seen.
  scale = jzo.LossScale(init_scale=2.0**8, growth_interval=2)
  kw = dict(loss=poisoned_loss, stage=2, loss_scale=scale, compute_dtype=jnp.float16,
            delayed_update=delayed, dpu_warmup=0)
  # Without the delay, the state all on the device sums in float32 as the
  # host does; with it, the device path's host parts travel as fp16
  # roundings of their float32 sums (so: to fp16 rounding).
  (on_device,) = engines(("device",), offload=0.0 if not delayed else True, **kw)
  (on_host,) = engines(("host",), offload=True, **kw)
  used = []
  for t, b in enumerate(data):
    want, got = on_device.step(b), on_host.step(b)
    assert bool(got.skipped) == bool(want.skipped) == (t == 2)
    assert float(got.loss_scale) == float(want.loss_scale)
    used.append(float(got.loss_scale))
  assert used == [256, 256, 512, 256, 256]  # doubled after 2 clean steps, halved by the skip
  on_host.close()
  assert int(on_host.state.skipped) == 1 and int(on_host.state.step) == len(data) - 1
  assert float(on_host.state.loss_scale.scale) == float(on_device.state.loss_scale.scale)
  assert_close(on_host.params, on_device.params, **(dict(rtol=1e-3, atol=1e-5) if delayed else {}))


def test_the_device_holds_one_micro_batch_and_no_float32_sum_of_the_host_part():
  """Between micro-batches the state carries float32 sums of the device
  parts only and compute-dtype gradients of the host parts (what a
  micro-batch's call returns: `engine.lower`); between steps no
  accumulator at all, so checkpoints are unchanged."""
  on_device, on_host = engines(stage=2, offload=0.5, compute_dtype=jnp.bfloat16)
  b = batches(1, size=64)[0]
  state_out = on_host.lower(b).out_info[0]
  between = [([(x.shape, x.dtype) for x in jax.tree.leaves(state_out.acc)],
              [x.dtype for x in jax.tree.leaves(state_out.grads)])]
  on_host.step(b)
  on_device.step(b)
  layouts = on_host.plan.leaves
  for sums, grads in between:
    assert len(sums) == len(grads) == len(layouts)
    for l, (shape, dtype), grad_dtype in zip(layouts, sums, grads):
      assert dtype == jnp.float32 and shape == l.part_shape(l.on_device)
      assert grad_dtype == jnp.bfloat16
  assert on_host.state.acc is None and on_host.state.grads is None
  saved, reference = on_host.state_dict(), on_device.state_dict()
  assert saved.keys() == reference.keys()
  host_elements = on_host.plan.host_elements
  assert sum(a.size for a in jax.tree.leaves(on_host.host.acc)) == host_elements
  # masters, moments and accumulators, all float32 here, and the landing
  # buffers of one micro-batch's bfloat16 gradients, no more (fewer at once
  # when the host's sums free some before the last ones land)
  landing_peak = on_host.host_update.landing_peak
  assert 0 < landing_peak <= 2 * host_elements
  assert on_host.host_bytes_in_use() == 16 * host_elements + landing_peak


def test_the_landing_ring_bounds_the_buffers_held_and_changes_nothing():
  """With a landing limit of one leaf the micro-batches go down a leaf at a
  time behind the host's sums: the same result."""
  kw = dict(stage=2, offload=True, compute_dtype=jnp.float32, mesh=mesh_of(8), grad_accum=K,
            accumulation="host")
  free = make_engine(loss_fn, init_params(), TX(), **kw)
  # one leaf at a time (one always may land)
  ring = make_engine(loss_fn, init_params(), TX(), landing_limit=1, **kw)
  assert ring.plan.host_accumulation and not ring.plan.streamed
  for b in batches(3, size=64):
    free.step(b)
    ring.step(b)
  assert_close(ring.params, free.params, rtol=0, atol=0)
  largest = max(map(ring.plan.landing_bytes, range(len(ring.plan.leaves))))
  assert ring.host_update.landing_peak == largest



def test_a_slow_host_holds_one_micro_batch_of_landing_buffers_as_planned():
  """The device runs ahead of a host that sums slowly: the micro-batches
  wait for room, and the landing buffers held, theirs and the delayed
  update's new weights going up, never pass one micro-batch's set, the
  bytes the plan counts."""
  import time
  import weakref
  engine, = engines(("host",), stage=2, offload=True, compute_dtype=jnp.bfloat16,
                    delayed_update=True)
  update = engine.host_update
  accumulate = update.adam.accumulate
  update.adam.accumulate = lambda *a: time.sleep(0.02) or accumulate(*a)
  live, peak = [0], [0]  # bytes of landing buffers alive, counted apart from the engine's count

  def tracked(make):
    def wrapper(*args):
      buffer = make(*args)
      live[0] += buffer.nbytes
      peak[0] = max(peak[0], live[0])
      weakref.finalize(buffer, lambda n=buffer.nbytes: live.__setitem__(0, live[0] - n))
      return buffer
    return wrapper
  update.transfer.download = tracked(update.transfer.download)
  update.transfer.new_landing = tracked(update.transfer.new_landing)
  for b in batches(3, size=64):  # the new weights go up while the last sums run
    engine.step(b)
  one_set = sum(map(engine.plan.landing_bytes, range(len(engine.plan.leaves))))
  assert one_set == engine.plan.host_bytes()["landing"]
  assert 0 < peak[0] <= one_set
  assert update.landing_peak == peak[0]

# ------------------------------------------------------------------ kernel
BF16 = ml_dtypes.bfloat16


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("n", [1, 15, 17, 2**17 + 5])
def test_accumulate_writes_then_adds_in_float32_with_squares_and_finite(n, dtype):
  rng = np.random.default_rng(n)
  grads = [rng.standard_normal(n, dtype=np.float32).astype(dtype) for _ in range(3)]
  acc = np.full(n, np.nan, np.float32)  # never zeroed: the first pass writes
  want = np.zeros(n, np.float32)
  for j, g in enumerate(grads):
    sq, finite = kernels.accumulate_(acc, g, add=j > 0)
    want = want + g.astype(np.float32)
    np.testing.assert_array_equal(acc, want)
    assert sq == pytest.approx(float(np.sum(want.astype(np.float64) ** 2)), rel=1e-6)
    assert finite
  acc[n // 2] = np.inf
  assert kernels.accumulate_(acc, grads[0], add=True)[1] is False
  acc[n // 2] = np.nan
  assert kernels.accumulate_(acc, grads[0], add=True)[1] is False


def test_accumulate_and_cast_do_not_depend_on_the_thread_count():
  rng = np.random.default_rng(0)
  g = rng.standard_normal(3 * 2**16 + 7, dtype=np.float32).astype(BF16)
  results = []
  for threads in (1, 2, 3):
    acc = np.full(g.size, 1.5, np.float32)
    sq = kernels.accumulate_(acc, g, add=True, num_threads=threads)
    out = np.empty(g.size, BF16)
    kernels.cast_(out, acc, num_threads=threads)
    results.append((sq, acc.tobytes(), out.tobytes()))
  assert results[0] == results[1] == results[2]
  np.testing.assert_array_equal(out, acc.astype(BF16))


def test_accumulate_and_cast_refuse_bad_input_before_writing():
  acc, g = np.zeros(8, np.float32), np.ones(8, BF16)
  with pytest.raises(TypeError, match="acc must be float32"):
    kernels.accumulate_(acc.astype(np.float16), g, add=True)
  with pytest.raises(ValueError, match="grad has 7 elements, acc has 8"):
    kernels.accumulate_(acc, g[:7], add=True)
  with pytest.raises(ValueError, match="overlap"):
    kernels.accumulate_(acc, acc.view(np.float32), add=True)
  acc.setflags(write=False)
  with pytest.raises(ValueError, match="read-only"):
    kernels.accumulate_(acc, g, add=True)
  with pytest.raises(TypeError, match="dst must be bfloat16 or float16"):
    kernels.cast_(np.zeros(8, np.float32), np.zeros(8, np.float32))
  with pytest.raises(ValueError, match="num_threads"):
    kernels.cast_(np.zeros(8, BF16), np.zeros(8, np.float32), num_threads=0)


# ----------------------------------------------------------------- planner
def _plan(accumulation, offload=True, grad_accum=K, **kw):
  options = jzo.EngineOptions(grad_accum=grad_accum, offload=offload, dpu_warmup=0,
                              accumulation=accumulation)
  return jzo.plan.make_plan(init_params(), 8, options, n_devices=8, **kw)


def test_the_plan_counts_host_and_device_bytes_of_host_accumulation():
  host, device = _plan("host", offload=0.5), _plan("device", offload=0.5)
  n = host.host_elements
  assert host.host_bytes() == {"master": 4 * n, "moments": 8 * n, "accumulator": 4 * n,
                               "landing": 2 * n}
  assert "accumulator" not in device.host_bytes()
  lowp_grads = 2 * host.n_params  # stage 2 differentiates the full bf16 params
  assert host.device_peak()["backward grads"] == lowp_grads == device.device_peak()[
      "backward grads"]
  assert host.device_peak()["float32 sums"] == 4 * host.device_elements
  assert device.device_peak()["float32 sums"] == 4 * sum(l.shard_size for l in device.leaves)
  ring = dataclasses.replace(host, landing_limit=host.landing_ring())
  assert ring.host_bytes()["landing"] == host.landing_ring() < 2 * n


def test_auto_accumulates_on_the_device_where_it_fits_and_else_on_the_host():
  act = 2**20  # bytes: activations well above the drawing of a leaf
  peak = sum(_plan("device").device_peak(act).values())
  assert not _plan("auto", device_memory=2 * peak, activations=act).host_accumulation
  tight = _plan("auto", device_memory=peak - 1, activations=act)
  assert tight.host_accumulation and sum(tight.device_peak(act).values()) < peak


def test_pick_micro_batch_takes_the_largest_that_fits():
  from jzo.models import gpt
  config = gpt.PRESETS["gpt2-1.5b"]
  shapes = jax.eval_shape(functools.partial(gpt.init_params, config, jax.random.PRNGKey(0)))
  act = functools.partial(gpt.activation_bytes, config, seq_len=1024)
  kw = dict(devices=1, global_batch=32, offload="auto", host_memory=125 * GiB)
  roomy = planner.pick_micro_batch(shapes, act, device_memory=80 * GiB, **kw)
  assert (roomy.micro_batch, roomy.grad_accum) == (32, 1)
  tight = planner.pick_micro_batch(shapes, act, device_memory=12 * GiB, **kw)
  assert tight.micro_batch * tight.grad_accum == 32 and tight.grad_accum > 1
  assert tight.line.startswith(f"micro-batch {tight.micro_batch} a device x {tight.grad_accum} "
                               "accumulation")
  assert f"({2 * tight.micro_batch} does not fit: " in tight.line
  assert tight.estimate.fits
  with pytest.raises(ValueError, match="global batch 30 does not split over 4 devices"):
    planner.pick_micro_batch(shapes, act, **{**kw, "devices": 4, "global_batch": 30})
  with pytest.raises(PlacementError, match="global batch 32 on 1 device.*not even 1 a device x "
                                           "32 accumulation"):
    planner.pick_micro_batch(shapes, act, device_memory=2 * GiB, **kw)


def test_the_recipe_runs_the_layers_first_where_they_fit():
  """jzo.train's engine with --grads-in-params and --micro-batch 8 at a
  global batch of 64 (8 accumulated): the layers first on a device with
  room for every micro-batch's layer inputs (20.8 MiB planned); on 16 MiB,
  where only the layers' float32 sums fit (10.5 MiB), those."""
  from jzo.recipe import loop, models
  from jzo.recipe.options import TrainConfig
  for gb, first in ((1.0, True), (0.016, False)):
    cfg = TrainConfig(model="tiny", batch_size=64, micro_batch="8", stage=3,
                      grads_in_params=True, offload_fraction="1.0", device_memory_gb=gb,
                      checkpoint_every=0)
    engine = loop.make_engine(cfg, models.PRESETS["tiny"], None, jax.devices()[:1], 8)
    assert engine.plan.grad_accum == 8 and engine.plan.layers_first == first
    engine.close()


def test_pick_micro_batch_runs_the_layers_first_where_they_fit():
  """With grads_in_params, gpt2-1.5b at a global batch of 32 on 10 GiB:
  the layers first (every micro-batch's layer inputs kept, no float32 sums
  of the layers) fit micro-batches of 4, which the plan says; the layers'
  float32 sums (accumulation "device") only micro-batches of 2."""
  from jzo.models import gpt
  config = gpt.PRESETS["gpt2-1.5b"]
  shapes = jax.eval_shape(functools.partial(gpt.init_params, config, jax.random.PRNGKey(0)))
  act = functools.partial(gpt.activation_bytes, config, seq_len=1024)
  kw = dict(devices=1, global_batch=32, offload="auto", host_memory=125 * GiB, stage=3,
            layers="blocks", grads_in_params=True, device_memory=10 * GiB)
  first = planner.pick_micro_batch(shapes, act, **kw)
  assert (first.micro_batch, first.grad_accum, first.accumulation) == (4, 8, "layers")
  assert first.estimate.plan.layers_first
  assert first.line.startswith("micro-batch 4 a device x 8 accumulation with the layers first")
  assert first.estimate.activations == act(4, accumulation=8) > act(4)
  sums = planner.pick_micro_batch(shapes, act, accumulation="device", **kw)
  assert (sums.micro_batch, sums.grad_accum) == (2, 16) and not sums.estimate.plan.layers_first


def test_the_recipe_picks_the_micro_batch_and_says_so(tmp_path, capsys, monkeypatch):
  """`python -m jzo.train --micro-batch auto` (the default) on devices of
  a few MiB: the planner's largest micro-batch that fits, the accumulation
  that makes --batch-size, summed on the host, in the line the run prints;
  the engine built with them; and a device too small for one sequence is
  one line with the numbers."""
  from jzo import train
  from jzo.recipe import loop
  built = []
  build = loop.build_engine
  monkeypatch.setattr(loop, "build_engine", lambda *a: built.append(build(*a)) or built[-1])
  # tiny at seq 128: 0.8 MiB of activations a sequence, 8 sequences a device
  args = ["--steps", "2", "--batch-size", "16", "--devices", "2", "--offload",
          "--eval-every", "2", "--eval-batches", "1", "--sample-tokens", "0"]
  assert train.main(args + ["--device-memory-gb", "0.004", "--out", str(tmp_path / "a")]) == 0
  out = capsys.readouterr().out
  assert ("micro-batch 2 a device x 4 accumulation summed on the host x 2 devices = global "
          "batch 16 (4 does not fit: does not fit a device: needs") in out
  engine, = built
  assert engine.plan.grad_accum == 4 and engine.plan.host_accumulation
  assert train.main(args + ["--device-memory-gb", "0.0001", "--out", str(tmp_path / "b")]) == 2
  assert ("error: global batch 16 on 2 device(s): no micro-batch fits, not even 1 a device x 8 "
          "accumulation") in capsys.readouterr().err
  assert not (tmp_path / "b").exists()
