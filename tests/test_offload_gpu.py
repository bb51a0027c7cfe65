"""The offload data path on a GPU: gradients land in pinned host memory, the
new weights go back from the same buffers, results match on-device training;
the portable path (no pinned memory) matches the pinned one; each step's
forward overlapping the last host update (grads_in_params), a layer at a time."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzo
from jzo.host import transfer
from test_engine import assert_close, batches, init_params, loss_fn, make_engine

try:
  GPUS = jax.devices("gpu")
except RuntimeError:
  GPUS = []
pytestmark = pytest.mark.skipif(not GPUS, reason="needs a GPU: pinned host memory and its "
                                "DMA transfers exist only there (CPU tests cover the rest)")


@pytest.mark.parametrize("compute_dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-3)],
                         ids=["fp32", "bf16"])
def test_offload_on_gpu_matches_device_training(compute_dtype, tol):
  mesh = jax.sharding.Mesh(np.array(GPUS[:1]), ("data",))
  params, data = init_params(), batches(10)
  kw = dict(stage=2, mesh=mesh, compute_dtype=compute_dtype, max_grad_norm=1.0)
  with jax.default_device(GPUS[0]):
    on_device = make_engine(loss_fn, params, jzo.cpu_adamw(1e-2), **kw)
    offloaded = make_engine(loss_fn, params, jzo.cpu_adamw(1e-2), offload=True, **kw)
    for b in data:
      on_device.step(b)
      offloaded.step(b)
  # On the GPU, on-device cpu_adamw runs as XLA ops, offload in the C++ kernel.
  assert_close(offloaded.params, on_device.params, rtol=tol, atol=tol / 10)
  offloaded.close()


def test_landing_buffers_are_pinned_and_reused_across_steps():
  """With the delayed update, each step's gradients land in pinned host
  memory from XLA's pool: one set of buffers, at the same few addresses each
  step, where a fresh pinned allocation per step would map new pages."""
  mesh = jax.sharding.Mesh(np.array(GPUS[:1]), ("data",))
  engine = jzo.ZeroEngine(loss_fn, init_params(), jzo.cpu_adamw(1e-2),
                          options=jzo.EngineOptions(stage=2, offload=True, delayed_update=True,
                                                    dpu_warmup=1),
                          mesh=mesh)
  addresses = []
  for b in batches(10):
    engine.step(b)
    landing = engine.host_update.landing_buffers()
    if landing:
      assert {x.sharding.memory_kind for x in landing.values()} == {"pinned_host"}
      addresses.append(landing[min(landing)].addressable_shards[0].data.unsafe_buffer_pointer())
  engine.close()
  assert len(addresses) >= 8
  assert max(addresses) - min(addresses) < 64 * 1024 * 1024, addresses
  assert engine.host_bytes_in_use() == sum(engine.plan.host_bytes().values())


def test_the_portable_path_trains_as_the_pinned_one_on_a_gpu():
  """host_transfer="portable" (what a device without pinned host memory
  gets: numpy copies and device_put) gives the pinned path's weights bit for
  bit, with the delayed update and a split leaf."""
  mesh = jax.sharding.Mesh(np.array(GPUS[:1]), ("data",))
  params, data = init_params(), batches(10)
  engines = [jzo.ZeroEngine(loss_fn, params, jzo.cpu_adamw(1e-2),
                            options=jzo.EngineOptions(stage=2, offload=0.5, delayed_update=True,
                                                      dpu_warmup=2, host_transfer=path),
                            mesh=mesh) for path in ("pinned", "portable")]
  for b in data:
    for engine in engines:
      engine.step(b)
  for engine in engines:
    engine.close()
  jax.tree.map(np.testing.assert_array_equal, engines[1].params, engines[0].params)


def test_a_view_of_gpu_memory_is_refused():
  x = jax.device_put(jnp.arange(8, dtype=jnp.float32), GPUS[0])
  with pytest.raises(ValueError, match="host memory"):
    transfer.writable_view(x)


def test_a_streamed_update_on_a_gpu_equals_the_whole_one():
  """Spans of the host parts go down to pinned memory, through the kernel and
  up into the params at their offsets, overlapped: the weights equal the
  whole update's, bit for bit."""
  mesh = jax.sharding.Mesh(np.array(GPUS[:1]), ("data",))
  make = lambda limit: jzo.ZeroEngine(loss_fn, init_params(), jzo.cpu_adamw(1e-2),
                                      options=jzo.EngineOptions(stage=2, offload=True,
                                                                landing_limit=limit),
                                      mesh=mesh)
  whole, streamed = make(None), make(64)
  assert streamed.plan.streamed
  for b in batches(4):
    whole.step(b)
    streamed.step(b)
  for a, b in zip(jax.tree.leaves(whole.state.params), jax.tree.leaves(streamed.state.params)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert 0 < streamed.host_update.landing_peak <= 64
  whole.close()
  streamed.close()


def test_offloaded_weights_on_a_gpu_train_as_the_weights_on_it():
  """offload_params on a GPU: the layers' weights stay in pinned host memory
  (fetched a layer at a time by XLA's host offload; gradients written back
  over them there), the compiled step takes none of them as device
  arguments, and training matches grads_in_params with the weights on the GPU."""
  from test_grads_in_params import loss_fn as scanned_loss
  mesh = jax.sharding.Mesh(np.array(GPUS[:1]), ("data",))
  kw = dict(stage=3, layers="blocks", offload=True, mesh=mesh, max_grad_norm=1.0)
  with jax.default_device(GPUS[0]):
    on_gpu = make_engine(scanned_loss, init_params(), jzo.cpu_adamw(1e-2), grads_in_params=True,
                         **kw)
    on_host = make_engine(scanned_loss, init_params(), jzo.cpu_adamw(1e-2), offload_params=True,
                          **kw)
    layers = sum(x.nbytes for x in jax.tree.leaves(on_host.state.params["blocks"]))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(on_host.state.params["blocks"])} \
        == {"pinned_host"}
    data = batches(8)
    argument = lambda e: e.lower(data[0]).compile().memory_analysis().argument_size_in_bytes
    assert argument(on_gpu) - argument(on_host) == layers
    for b in data:
      want, got = on_gpu.step(b), on_host.step(b)
      np.testing.assert_allclose(float(got.loss), float(want.loss), rtol=1e-5)
  assert_close(on_host.params, on_gpu.params, rtol=1e-4, atol=1e-5)
  on_gpu.close()
  on_host.close()


def test_resident_layers_on_a_gpu_train_as_the_weights_on_it():
  """offload_params="auto" with the first layer resident on a GPU: its copy
  of the weights is in device memory, an argument of the compiled step
  beside the layers' weights in host memory, equal to their first row
  after every update, and training matches grads_in_params with the
  weights on the GPU (float32 at full matmul precision: in bf16 the two
  programs' forwards, fused differently, drift apart over Adam's steps)."""
  import dataclasses
  from test_grads_in_params import loss_fn as scanned_loss
  from test_offload_params import device_need, memory_for
  mesh = jax.sharding.Mesh(np.array(GPUS[:1]), ("data",))
  kw = dict(stage=3, layers="blocks", offload=True, mesh=mesh, max_grad_norm=1.0,
            activation_memory=2**20, compute_dtype=jnp.float32)
  with jax.default_device(GPUS[0]), jax.default_matmul_precision("highest"):
    make = lambda **more: make_engine(scanned_loss, init_params(), jzo.cpu_adamw(1e-2), **kw,
                                      **more)
    on_gpu, on_host = make(grads_in_params=True), make(offload_params=True)
    plan = dataclasses.replace(on_host.plan, resident_layers=1)
    resident = make(offload_params="auto", device_memory=memory_for(device_need(plan, 2**20)))
    assert resident.plan.resident_layers == 1
    copies = jax.tree.leaves(resident.state.resident)
    assert {x.sharding.memory_kind for x in copies} == {"device"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(resident.state.params["blocks"])} \
        == {"pinned_host"}
    data = batches(8)
    argument = lambda e: e.lower(data[0]).compile().memory_analysis().argument_size_in_bytes
    assert argument(resident) - argument(on_host) == sum(x.nbytes for x in copies)
    for b in data:
      want, got = on_gpu.step(b), resident.step(b)
      np.testing.assert_allclose(float(got.loss), float(want.loss), rtol=1e-5)
      for name in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(resident.state.resident[name]),
                                      np.asarray(resident.state.params["blocks"][name])[:1])
  assert_close(resident.params, on_gpu.params, rtol=1e-4, atol=1e-5)
  for e in (on_gpu, on_host, resident):
    e.close()


def slow_layers(e, seconds: float) -> dict:
  """Makes engine e's host update take `seconds` more a layer of the
  stacked leaves (after each row's kernel), and records when each layer's
  update ended and when the step's wait for it returned: (update, layer)
  -> seconds, under "done" and "waited". Call before the first step."""
  times = {"done": {}, "waited": {}}
  update_part, wait = e.host.update_part, e.host_update.wait_for_layer

  def slow_part(i, grads, grad_scale, scalars, count, span=None, lowp=True):
    update_part(i, grads, grad_scale, scalars, count, span, lowp)
    if span is not None and i == e.plan.overlapped_leaves()[-1]:  # the layer's last leaf
      time.sleep(seconds)
      times["done"][count, span[0]] = time.perf_counter()

  def timed_wait(layer):
    out = wait(layer)
    times["waited"].setdefault((e.host_update.running_update_count, int(layer)),
                               time.perf_counter())
    return out
  e.host.update_part, e.host_update.wait_for_layer = slow_part, timed_wait
  return times


def scanned_engine(devices: int = 1, tx=None, **kw):
  """test_grads_in_params' model (its layers through jzo.scan_layers) at
  stage 3 with grads_in_params on the first `devices` GPUs (default
  optimizer: jzo.cpu_adamw(1e-2))."""
  from test_grads_in_params import loss_fn as scanned_loss
  mesh = jax.sharding.Mesh(np.array(GPUS[:devices]), ("data",))
  kw = dict(dict(stage=3, layers="blocks", offload=True, grads_in_params=True, mesh=mesh,
                 max_grad_norm=1.0), **kw)
  with jax.default_device(GPUS[0]):
    return make_engine(scanned_loss, init_params(), tx or jzo.cpu_adamw(1e-2), **kw)


@pytest.mark.parametrize("offload, seconds, grad_accum", [
    (True, 0.05, 1), (0.5, 0.05, 1), (True, 0.002, 1), (True, 0.05, 2), (0.5, 0.002, 2)],
    ids=["host", "split", "host-tight", "host-layers-first", "split-tight-layers-first"])
def test_the_forward_overlaps_the_host_update(offload, seconds, grad_accum):
  """Each step's forward takes a layer's new weights as soon as the host
  update has them: with the host slowed, it reads layer 0 while the host
  still updates the last layer, and waits for each (a slowdown of 2 ms a
  layer: reads right after the writes). It trains as the engine that
  finishes the update first, bit for bit, through a skipped step, an
  evaluation (which applies the update first) and a device step run alone.
  With grad_accum = 2 the layers run first: one forward over both
  micro-batches overlaps the update."""
  from test_grads_in_params import LAYERS
  kw = dict(offload=offload, grad_accum=grad_accum)
  inside, after = scanned_engine(**kw), scanned_engine(**kw, overlap_forward=False)
  assert inside.plan.layers_first == (grad_accum > 1)
  assert inside.overlaps_update and not after.overlaps_update
  times = slow_layers(inside, seconds)
  # The step hands the stacked leaves' gradients back in their landing
  # buffers: the exchange downloads only the other leaves.
  downloaded, download = [], inside.host_update.transfer.download
  inside.host_update.transfer.download = lambda i, *a, **k: (downloaded.append(i),
                                                             download(i, *a, **k))[1]
  data = batches(6)
  bad = dict(data[2], x=data[2]["x"].at[0, 0].set(jnp.nan))
  with jax.default_device(GPUS[0]):
    for b in (data[0], data[1], bad, data[3]):
      want, got = after.step(b), inside.step(b)
      assert float(got.loss) == float(want.loss) or np.isnan(float(want.loss))
    assert float(inside.evaluate(data[4])) == float(after.evaluate(data[4]))
    assert float(inside.step(data[4]).loss) == float(after.step(data[4]).loss)
    inside.run_device_step(data[5]), after.run_device_step(data[5])
    for b in (data[5], data[0]):
      assert float(inside.step(b).loss) == float(after.step(b).loss)
  assert_close(inside.params, after.params, rtol=0, atol=0)
  assert not set(downloaded) & set(inside.plan.overlapped_leaves()), downloaded
  done, waited = times["done"], times["waited"]
  overlapped = {count for count, _ in waited if count in {c for c, _ in done}}
  assert len(overlapped) >= 2
  assert all(waited[c, l] >= done[c, l] for c in overlapped for l in range(LAYERS))
  if seconds >= 0.05:  # the step read layer 0 while the host still updated the last
    assert any(waited[c, 0] < done[c, LAYERS - 1] for c in overlapped), (waited, done)
  inside.close(), after.close()


@pytest.mark.parametrize("moments", [None, jnp.int8], ids=["fp32", "int8"])
@pytest.mark.parametrize("devices", [1, 2])
def test_the_overlapped_update_trains_as_the_update_first_on_each_gpu_count(devices, moments):
  """With a shard on each of one or two GPUs and float32 or int8 moments,
  the engine that would overlap its forward with the host update trains as
  the one that finishes the update first, bit for bit (with the host
  slowed, so that a layer read before the host wrote it would show), and as
  one GPU does to rounding."""
  if len(GPUS) < devices:
    pytest.skip(f"needs {devices} GPUs")
  tx = lambda: jzo.cpu_adamw(1e-2, mu_dtype=moments, nu_dtype=moments)
  engines = {(n, overlap): scanned_engine(n, tx(), overlap_forward=overlap)
             for n in {1, devices} for overlap in (True, False)}
  assert engines[devices, True].overlaps_update
  slow_layers(engines[devices, True], 0.02)  # a read of a layer before its write would show
  losses = {key: [] for key in engines}
  with jax.default_device(GPUS[0]):
    for b in batches(6):
      for key, e in engines.items():
        losses[key].append(float(e.step(b).loss))
  assert losses[devices, True] == losses[devices, False], losses
  # Two devices sum the gradients in another order: float32 rounding, which
  # an int8 moment's code can turn into a step of another size (2e-3 here).
  np.testing.assert_allclose(losses[devices, False], losses[1, False], rtol=1e-2)
  assert_close(engines[devices, True].params, engines[devices, False].params, rtol=0, atol=0)
  for e in engines.values():
    e.close()


def test_a_failed_update_fails_the_step_that_overlaps_it():
  """The host update fails in its layers while the next step waits for
  them: that step raises, naming it (no hang), and the engine refuses to
  go on."""
  inside = scanned_engine()
  update_part = inside.host.update_part

  def failing(i, grads, grad_scale, scalars, count, span=None, lowp=True):
    if count == 2 and span == (1, 2):
      raise OSError("disk on fire")
    update_part(i, grads, grad_scale, scalars, count, span, lowp)
  inside.host.update_part = failing
  data = batches(4)
  finished = threading.Event()

  def steps():
    with jax.default_device(GPUS[0]):
      inside.step(data[0]), inside.step(data[1])
      with pytest.raises(Exception, match="host update the step overlaps failed"):
        inside.step(data[2])
    finished.set()
  worker = threading.Thread(target=steps, daemon=True)
  worker.start()
  worker.join(120)
  assert finished.is_set()
  with pytest.raises(RuntimeError, match="an earlier host update failed"):
    inside.step(data[3])
