"""A streamed host update (a landing limit below one step's gradients) on
fake CPU devices: the same weights as the whole update, bit for bit, within
its limit; the plan's choice and bytes; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jzo
from jzo import plan as plan_lib
from jzo.parallel.partition import LeafLayout
from jzo.step import write_part
from test_engine import batches, init_params, loss_fn, make_engine, mesh_of
from test_offload import TX

LIMIT = 1024  # bytes: spans of 256, 16 bf16 elements of each of 8 shards


def pair(n_dev=8, **kw):
  """The same engine twice: with one set of landing buffers and streamed."""
  make = lambda limit: make_engine(loss_fn, init_params(), TX(), max_grad_norm=1.0,
                                   landing_limit=limit, mesh=mesh_of(n_dev), **kw)
  return make(None), make(LIMIT)


def assert_same_weights(a, b):
  for x, y in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params)):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  for x, y in zip(a.host.arrays(), b.host.arrays()):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("offload", [True, 0.5], ids=["all-host", "half-host"])
@pytest.mark.parametrize("stage, layers", [(1, None), (2, None), (3, None), (3, "blocks")],
                         ids=str)
def test_a_streamed_update_equals_the_whole_one(stage, layers, offload):
  """Spans of padded leaves, of split leaves' host parts and of per-layer
  shards (layers at a time) go down, through the kernel and up into the
  params: the weights, masters and moments equal the whole update's."""
  whole, streamed = pair(stage=stage, layers=layers, offload=offload,
                         compute_dtype=jnp.bfloat16)
  assert streamed.plan.streamed and not whole.plan.streamed
  assert streamed.plan.host_bytes()["landing"] == min(LIMIT, whole.plan.host_bytes()["landing"])
  for b in batches(3):
    want, got = whole.step(b), streamed.step(b)
    assert float(got.loss) == float(want.loss)
  assert_same_weights(whole, streamed)
  update = streamed.host_update
  assert 0 < update.landing_peak <= LIMIT and not update.in_flight
  assert streamed.host_bytes_in_use() == whole.host_bytes_in_use() - whole.host_update.landing_peak + \
      update.landing_peak
  assert streamed.host_timings["update"] > 0
  assert int(streamed.state.step) == 3


@pytest.mark.parametrize("n_dev", [1, 2])
@pytest.mark.parametrize("compute_dtype", [jnp.float32, jnp.float16], ids=["fp32", "fp16"])
def test_streaming_on_few_devices_and_other_dtypes(n_dev, compute_dtype):
  """One device uploads spans without a gather; float32 sends the masters
  themselves up; float16 skips a step whose loss scale overflows."""
  whole, streamed = pair(n_dev, stage=2, offload=True, compute_dtype=compute_dtype)
  for b in batches(4):
    whole.step(b)
    streamed.step(b)
  assert_same_weights(whole, streamed)


def test_streaming_through_pageable_memory():
  whole, streamed = pair(stage=2, offload=True, compute_dtype=jnp.bfloat16,
                         host_transfer="portable")
  for b in batches(2):
    whole.step(b)
    streamed.step(b)
  assert_same_weights(whole, streamed)


def test_a_span_larger_than_the_limit_still_moves_alone():
  """A limit below one span (one layer of a per-layer shard) moves one span
  at a time."""
  engine = jzo.ZeroEngine(loss_fn, init_params(), TX(),
                          options=jzo.EngineOptions(stage=3, layers="blocks", offload=True,
                                                    landing_limit=1),
                          mesh=mesh_of(8))
  whole, = [jzo.ZeroEngine(loss_fn, init_params(), TX(),
                           options=jzo.EngineOptions(stage=3, layers="blocks", offload=True),
                           mesh=mesh_of(8))]
  for b in batches(2):
    engine.step(b)
    whole.step(b)
  assert_same_weights(whole, engine)
  largest_span = max(engine.host_update.transfer.span_bytes(i, (0, 1))
                     for i, l in enumerate(engine.plan.leaves) if l.on_host)
  assert engine.host_update.landing_peak == largest_span


def test_a_failing_span_stops_the_engine():
  """A kernel error mid-stream leaves the host state half updated: the step
  raises it and every later step refuses, naming it."""
  _, engine = pair(stage=2, offload=True)
  update_part = engine.host.update_part
  calls = []

  def failing(*args, **kw):
    calls.append(1)
    if len(calls) == 3:
      raise MemoryError("injected")
    return update_part(*args, **kw)
  engine.host.update_part = failing
  b = batches(1)[0]
  with pytest.raises(MemoryError, match="injected"):
    engine.step(b)
  with pytest.raises(RuntimeError, match="earlier host update failed.*injected"):
    engine.step(b)


@pytest.mark.parametrize("limit", [-1, 1.5, True, "2GiB"])
def test_a_bad_landing_limit_is_refused(limit):
  with pytest.raises(ValueError, match="landing_limit must be a whole number of bytes"):
    jzo.ZeroEngine(loss_fn, init_params(), TX(),
                   options=jzo.EngineOptions(offload=True, landing_limit=limit), mesh=mesh_of(8))


def test_a_streamed_update_cannot_be_delayed():
  with pytest.raises(ValueError, match="cannot be delayed"):
    jzo.ZeroEngine(loss_fn, init_params(), TX(),
                   jzo.EngineOptions(offload=True, delayed_update=True, landing_limit=LIMIT),
                   mesh=mesh_of(8))


def plan_of(host_gib, **kw):
  """The plan of a model of 2**32 parameters (two leaves), bf16 compute and
  fp32 moments, on one device of 80 GiB."""
  shapes = {"a": jax.ShapeDtypeStruct((3 * 2**30,), jnp.float32),
            "b": jax.ShapeDtypeStruct((2**15, 2**15), jnp.float32)}
  options = jzo.EngineOptions(offload=True, dpu_warmup=1, **kw)
  return plan_lib.make_plan(shapes, 8, options, n_devices=1, device_memory=80 * plan_lib.GiB,
                            host_memory=int(host_gib * plan_lib.GiB))


def test_the_plan_streams_an_update_of_more_than_its_landing_limit_unless_delayed():
  # 12 B a parameter = 48 GiB of state, 4.5 of runtime, 0.25 to build, and
  # 2 GiB of landing buffers streamed (54.75 GiB), or 8 delayed (60.75)
  streamed = plan_of(56, delayed_update=False)
  assert streamed.streamed and streamed.host_bytes()["landing"] == plan_lib.STREAM_LANDING_BYTES
  assert "landing (streamed)" in str(streamed)
  delayed = plan_of(61, delayed_update=True)
  assert not delayed.streamed and delayed.host_bytes()["landing"] == 8 * plan_lib.GiB
  with pytest.raises(plan_lib.PlacementError, match="GiB of host RAM"):
    plan_of(58, delayed_update=True)  # the delayed update needs one set
  with pytest.raises(plan_lib.PlacementError, match="GiB of host RAM"):
    plan_of(54, delayed_update=False)
  # given, the limit is the user's; 0 asks for one set
  assert plan_of(61, delayed_update=False, landing_limit=2**20).host_bytes()["landing"] == 2**20
  whole = plan_of(61, delayed_update=False, landing_limit=0)
  assert not whole.streamed and whole.host_bytes()["landing"] == 8 * plan_lib.GiB
  # one step's host parts within the limit: one set (the small models of these tests)
  assert not jzo.ZeroEngine(loss_fn, init_params(), TX(), options=jzo.EngineOptions(offload=True),
                            mesh=mesh_of(8)).plan.streamed


def test_write_part_takes_offsets_past_two_to_the_31_elements_in_64_bits():
  """The installer writes a span of one device's shard of 2**32 + 2**16
  elements at an offset past 2**31 under 64-bit indices: the offset is
  written as it is; in 32 bits it would wrap to a negative one."""
  plan = plan_of(80, delayed_update=False)
  layout = LeafLayout(shape=(2**32 + 2**16,), shards=1, device_size=0)
  mesh = mesh_of(1)
  spec = NamedSharding(mesh, P())
  offset = 3 * 2**30
  write = jax.jit(jax.shard_map(
      lambda p, u: write_part(plan.stage, plan.axis, layout, p, u, offset), mesh=mesh,
      in_specs=(P(), P()), out_specs=P(), check_vma=False))
  args = (jax.ShapeDtypeStruct(layout.shape, jnp.bfloat16, sharding=spec),
          jax.ShapeDtypeStruct((2**16,), jnp.bfloat16, sharding=spec))
  with jax.enable_x64(True):
    assert f"dense<{offset}> : tensor<i64>" in write.lower(*args).as_text()
  assert f"dense<{offset - 2**32}> : tensor<i32>" in write.lower(*args).as_text()
