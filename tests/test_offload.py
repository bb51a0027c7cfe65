"""ZeRO-Offload on 8 fake CPU devices: same results as on-device, DPU, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzo
from test_engine import assert_close, batches, init_params, loss_fn, make_engine, mesh_of

TX = lambda: jzo.cpu_adamw(1e-2, weight_decay=0.1, mask={"embed": True, "blocks": False,
                                                          "head": True})


@pytest.mark.parametrize("compute_dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("stage, layers", [(1, None), (2, None), (3, None), (3, "blocks")],
                         ids=str)
def test_offload_matches_on_device(stage, layers, compute_dtype):
  params, data = init_params(), batches(20)
  kw = dict(stage=stage, layers=layers, compute_dtype=compute_dtype, mesh=mesh_of(8),
            max_grad_norm=1.0)
  on_device = make_engine(loss_fn, params, TX(), **kw)
  offloaded = make_engine(loss_fn, params, TX(), offload=True, **kw)
  for b in data:
    want, got = on_device.step(b), offloaded.step(b)
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-6, abs=1e-7)
    assert float(got.loss_scale) == float(want.loss_scale)
  assert_close(offloaded.params, on_device.params)
  # The gradients are down and their landing buffers, carrying the weights
  # back, are freed: nothing is kept between steps but the state.
  assert offloaded.state.grads is None
  assert not offloaded.host_update.in_flight and offloaded.host_update.landing_bytes() == 0
  assert offloaded.memory_per_device()["optimizer"] == offloaded.memory_per_device()["grads"] == 0
  assert offloaded.host_bytes_in_use() > 0


@pytest.mark.parametrize("n_dev", [1, 2])
def test_offload_on_few_devices(n_dev):
  """One device uploads whole leaves (no gather), two gather the shards."""
  params, data = init_params(), batches(6)
  kw = dict(stage=2, compute_dtype=jnp.bfloat16, mesh=mesh_of(n_dev))
  on_device = make_engine(loss_fn, params, TX(), **kw)
  offloaded = make_engine(loss_fn, params, TX(), offload=True, **kw)
  for b in data:
    on_device.step(b)
    offloaded.step(b)
  assert_close(offloaded.params, on_device.params)
  for a, b in zip(jax.tree.leaves(offloaded.state.params), jax.tree.leaves(on_device.state.params)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_new_weights_are_written_into_the_params_in_place():
  """The host parts' new weights land in the params' own buffers (donated),
  so no second copy of a leaf waits on the device beside the old one."""
  engine = jzo.ZeroEngine(loss_fn, init_params(), TX(),
                          options=jzo.EngineOptions(offload=0.5, delayed_update=True, dpu_warmup=1),
                          mesh=mesh_of(1))
  where = lambda: [x.unsafe_buffer_pointer() for x in jax.tree.leaves(engine.state.params)]
  before = where()
  for b in batches(4):
    engine.step(b)
  assert where() == before


def test_a_device_step_run_alone_lets_go_of_the_gradients_before_the_next():
  """Steps run alone (to time the device) leave their gradients in the
  state; the next step must not run while the engine still holds them (on
  an H100 gpt2-10b has no room for two sets): the loss, while the next
  step computes it, finds the last step's gradients freed."""
  import weakref
  previous, held = [], []

  def watched_loss(params, batch):
    jax.debug.callback(lambda: held.append(sum(r() is not None for r in previous)))
    return loss_fn(params, batch)
  engine = jzo.ZeroEngine(watched_loss, init_params(), TX(),
                          jzo.EngineOptions(offload=True), mesh=mesh_of(1))
  b = batches(1)[0]
  engine.run_device_step(b)
  previous[:] = [weakref.ref(g) for g in jax.tree.leaves(engine.state.grads)]
  assert previous and all(r() is not None for r in previous)
  held.clear()
  engine.run_device_step(b)
  jax.effects_barrier()
  assert held and set(held) == {0}


def test_delayed_update_applies_each_update_one_step_late():
  params, data, warmup = init_params(), batches(12), 3
  engine = jzo.ZeroEngine(loss_fn, params, jzo.cpu_adamw(1e-2),
                          options=jzo.EngineOptions(stage=2, offload=True, delayed_update=True,
                                                    dpu_warmup=warmup, compute_dtype=jnp.float32),
                          mesh=mesh_of(8))
  for b in data:
    engine.step(b)
  # Reference: step t's gradient uses the weights after update t - 1
  # (history[t]) during warm-up, after update t - 2 (history[t - 1]) later.
  tx = optax.adamw(1e-2, weight_decay=1e-4)
  history, opt_state = [params], tx.init(params)
  grad = jax.jit(jax.grad(loss_fn))
  for t, b in enumerate(data):
    used = history[t] if t <= warmup else history[t - 1]
    updates, opt_state = tx.update(grad(used, b), opt_state, history[t])
    history.append(optax.apply_updates(history[t], updates))
  assert_close(engine.params, history[-1])
  # and it differs from plain training, so the test can tell the two apart
  plain = history[0]
  opt_state = tx.init(plain)
  for b in data:
    updates, opt_state = tx.update(grad(plain, b), opt_state, plain)
    plain = optax.apply_updates(plain, updates)
  assert not np.allclose(engine.params["head"], plain["head"], atol=1e-4)


def test_accumulation_in_float32_equals_one_large_batch():
  params, data = init_params(), batches(5, size=64)
  kw = dict(stage=2, offload=True, compute_dtype=jnp.float32, mesh=mesh_of(4))
  accumulated = make_engine(loss_fn, params, jzo.cpu_adamw(1e-2), grad_accum=4, **kw)
  large = make_engine(loss_fn, params, jzo.cpu_adamw(1e-2), **kw)
  for b in data:
    accumulated.step(b)
    large.step(b)
  assert_close(accumulated.params, large.params)


def test_accumulated_bf16_gradients_travel_in_bf16():
  """The fp32 sum of the micro-batches is rounded once for the trip to the
  host: what arrives is the on-device optimizer's fp32 gradient in bf16."""
  params, batch = init_params(), batches(1, size=64)[0]
  kw = dict(stage=2, compute_dtype=jnp.bfloat16, mesh=mesh_of(4), grad_accum=4)
  offloaded = make_engine(loss_fn, params, TX(), offload=True, **kw)
  on_device = make_engine(loss_fn, params, TX(), **kw)
  offloaded.run_device_step(batch)  # the host parts' gradients, before they go down
  on_device.step(batch)
  for got, want in zip(jax.tree.leaves(offloaded.state.grads),
                       jax.tree.leaves(on_device.state.grads)):
    assert got.dtype == jnp.bfloat16 and want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2**-8,
                               atol=1e-7)


def test_non_finite_bf16_gradients_skip_the_step():
  params, data = init_params(), batches(4)
  data[1] = dict(data[1], x=data[1]["x"].at[3, 0].set(jnp.nan))
  engine = jzo.ZeroEngine(loss_fn, params, jzo.cpu_adamw(1e-2),
                          options=jzo.EngineOptions(stage=2, offload=True), mesh=mesh_of(8))
  skipped = []
  for b in data:
    before = engine.params
    skipped.append(bool(engine.step(b).skipped))
    if skipped[-1]:
      assert_close(engine.params, before, rtol=0, atol=0)
  assert skipped == [False, True, False, False]
  assert int(engine.state.skipped) == 1 and int(engine.state.step) == 3


def test_host_memory_is_checked_before_allocating():
  runtime = jzo.plan.HOST_RUNTIME_BYTES / 2**30  # a CPU device's runtime; the state is tiny
  with pytest.raises(MemoryError, match=rf"needs {runtime:.1f}\d GiB of host RAM .*runtime "
                     rf"{runtime:.2f}.* 0\.00 GiB available"):
    jzo.ZeroEngine(loss_fn, init_params(), jzo.cpu_adamw(1e-3),
                   options=jzo.EngineOptions(offload=True), host_memory=1000, mesh=mesh_of(8))


def test_bad_offload_options():
  params, mesh = init_params(), mesh_of(8)
  with pytest.raises(ValueError, match="stage 1, 2 or 3"):
    jzo.ZeroEngine(loss_fn, params, jzo.cpu_adamw(1e-3),
                   options=jzo.EngineOptions(stage=0, offload=True), mesh=mesh)
  with pytest.raises(TypeError, match="jzo.cpu_adam or jzo.cpu_adamw"):
    jzo.ZeroEngine(loss_fn, params, optax.adamw(1e-3), options=jzo.EngineOptions(offload=True),
                   mesh=mesh)
  for moments in (dict(mu_dtype=jnp.float16), dict(nu_dtype=jnp.float16)):
    with pytest.raises(ValueError, match="float32, bfloat16 or int8 moments, got mu_dtype"):
      jzo.ZeroEngine(loss_fn, params, jzo.cpu_adamw(1e-3, **moments),
                     options=jzo.EngineOptions(offload=True), mesh=mesh)
  with pytest.raises(ValueError, match="needs offload=True"):
    jzo.ZeroEngine(loss_fn, params, jzo.cpu_adamw(1e-3),
                   options=jzo.EngineOptions(delayed_update=True), mesh=mesh)
  with pytest.raises(ValueError, match="only axis of size > 1"):
    jzo.ZeroEngine(loss_fn, params, jzo.cpu_adamw(1e-3), options=jzo.EngineOptions(offload=True),
                   mesh=jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model")))
  with pytest.raises(ValueError, match="dpu_warmup"):
    jzo.ZeroEngine(loss_fn, params, jzo.cpu_adamw(1e-3),
                   options=jzo.EngineOptions(offload=True, delayed_update=True, dpu_warmup=-1),
                   mesh=mesh)


def test_host_update_yields_leaves_largest_first_with_their_new_weights():
  """The pipelined upload sends each leaf as soon as it is yielded: its
  landing buffer must already hold the new weights (written over the
  gradients), and the big leaves come first."""
  from jzo.host import update as offload
  from jzo import plan
  params = init_params()
  hyper = jzo.cpu_adamw(1e-2).hyperparams
  layout_plan = plan.make_plan(params, 8, jzo.EngineOptions(offload=True, dpu_warmup=0),
                               n_devices=2)
  layouts = layout_plan.leaves
  flat = [np.asarray(l.flatten(jnp.asarray(x, jnp.float32)))
          for l, x in zip(layouts, jax.tree.leaves(params))]
  host = offload.HostAdam(layout_plan, hyper, jax.tree.map(lambda _: True, params))
  for l, dst, x in zip(layouts, jax.tree.leaves(host.master), flat):
    np.copyto(dst, l.split(x)[1])
  landing = [[np.full(s.shape, 0.5, jnp.bfloat16) for s in l.split(x)[1]]
             for l, x in zip(layouts, flat)]
  sizes = []
  for i in host.update_leaves(lambda i: landing[i], 1.0, count=1):
    sizes.append(landing[i][0].size)
    master = jax.tree.leaves(host.master)[i]
    for d, weights in enumerate(landing[i]):
      np.testing.assert_array_equal(weights, master[d].astype(jnp.bfloat16))
      before = layouts[i].split(flat[i])[1][d]
      # Adam's first update (count 1): the moments' bias corrections make
      # the step lr * g / |g|, plus the weight decay
      first = before - hyper.learning_rate * (0.5 / (0.5 + hyper.eps)
                                              + hyper.weight_decay * before)
      np.testing.assert_allclose(master[d], first, rtol=1e-6, atol=1e-7)
  assert len(sizes) == len(layouts)
  assert sizes == sorted(sizes, reverse=True)


def _failing_after_one_leaf(update_leaves):
  """update_leaves that finishes one leaf, then raises inside the update thread."""
  def failing(*args, **kw):
    leaves = update_leaves(*args, **kw)
    yield next(leaves)
    raise OSError("injected fault in the host update")
  return failing


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_a_fault_in_the_host_update_surfaces_and_stops_the_engine(delayed):
  """The update thread's exception reaches the caller with its traceback (at
  the same step, or the next one with the delayed update); the engine then
  refuses to go on, since the host state may be half updated; nothing hangs."""
  import faulthandler
  import traceback
  faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the run, with the stacks
  engine = jzo.ZeroEngine(loss_fn, init_params(), TX(),
                          options=jzo.EngineOptions(offload=True, delayed_update=delayed,
                                                    dpu_warmup=0),
                          mesh=mesh_of(2))
  data = batches(4)
  engine.step(data[0])
  engine.host.update_leaves = _failing_after_one_leaf(engine.host.update_leaves)
  with pytest.raises(OSError, match="injected fault") as caught:
    for b in data[1:3]:
      engine.step(b)
  frames = traceback.extract_tb(caught.value.__traceback__)
  assert frames[-1].name == "failing"  # raised in the thread, re-raised here with its frames
  with pytest.raises(RuntimeError, match="earlier host update failed.*OSError.*checkpoint"):
    engine.step(data[3])
  with pytest.raises(RuntimeError, match="earlier host update failed"):
    engine.state_dict()
  engine.close()  # stops the thread without raising again
  engine.close()
  with pytest.raises(RuntimeError, match="closed"):
    engine.step(data[3])
  faulthandler.cancel_dump_traceback_later()


def test_close_twice_and_step_after_close():
  engine = jzo.ZeroEngine(loss_fn, init_params(), TX(),
                          jzo.EngineOptions(offload=True, delayed_update=True, dpu_warmup=0),
                          mesh=mesh_of(1))
  for b in batches(3):
    engine.step(b)
  assert engine.host_update.in_flight
  engine.close()
  assert not engine.host_update.in_flight  # the update in flight was applied
  params = engine.params
  engine.close()
  with pytest.raises(RuntimeError, match="closed"):
    engine.step(batches(1)[0])
  jax.tree.map(np.testing.assert_array_equal, engine.params, params)


def test_a_long_run_with_offload_and_the_delayed_update_does_not_grow():
  """2,000 steps: after warm-up neither host RSS (within a few MiB) nor the
  number of live arrays grows, so no buffer is kept per step."""
  import psutil
  engine = jzo.ZeroEngine(loss_fn, init_params(), TX(),
                          jzo.EngineOptions(offload=True, delayed_update=True, dpu_warmup=0),
                          mesh=mesh_of(2))
  data, process = batches(8), psutil.Process()
  rss, arrays = [], []
  for step in range(2000):
    engine.step(data[step % len(data)])
    if step in (400, 1999):
      rss.append(process.memory_info().rss)
      arrays.append(len(jax.live_arrays()))
  engine.close()
  assert rss[1] - rss[0] < 4 * 2**20, f"host RSS grew by {(rss[1] - rss[0]) / 2**20:.1f} MiB"
  # A few arrays come and go with the update in flight; a per-step leak adds 1,600.
  assert arrays[1] <= arrays[0] + 16, arrays
