"""grads_in_params: the layers' gradients written over their weights
(jzo.scan_layers), on 1 and 8 fake CPU devices: the same training as
without it, the memory it saves, skipped steps, bad input; with gradient
accumulation, the same training as the device's float32 sums, without a
gradient buffer of the layers beside the sums."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzo
from jzo.parallel import layer_scan
from test_engine import DIN, DOUT, LAYERS, assert_close, batches, init_params, make_engine, mesh_of
from test_offload import TX


def loss_fn(params, batch):
  """test_engine's residual tanh MLP, its layers run by jzo.scan_layers; the
  layers also read `shift`, a value computed from another leaf (so the
  scan's gradient with respect to what it closes over counts)."""
  h = batch["x"] @ params["embed"]
  shift = jnp.mean(params["head"])

  def layer(h, p):
    p = jzo.gather_layer(p)
    return jnp.tanh(h @ p["w"] + p["b"] + shift) + h
  h = jzo.scan_layers(jax.checkpoint(layer), h, params["blocks"])
  return jnp.mean((h @ params["head"] - batch["y"]) ** 2)


def engine(mesh_size=1, **kw):
  kw = dict(dict(stage=3, layers="blocks", offload=True, mesh=mesh_of(mesh_size)), **kw)
  return make_engine(loss_fn, init_params(), TX(), **kw)


def test_scan_layers_gradients_are_lax_scans():
  """Outside an engine scan_layers is lax.scan; writing gradients over the
  layers gives the same gradients, the closed-over value's included."""
  params, batch = init_params(), batches(1)[0]
  plain = jax.jit(jax.grad(loss_fn))(params, batch)

  def in_place(params, batch):
    with layer_scan.writing_grads_over_layers() as used:
      grads = jax.grad(loss_fn)(params, batch)
    assert used
    return grads
  assert_close(jax.jit(in_place)(params, batch), plain, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows", [1, LAYERS], ids=["first", "all"])
def test_scan_layers_reads_resident_layers_from_their_copy(rows):
  """With a copy of the first layers' weights (resident layers), the same
  gradients as lax.scan, however many layers are resident; the copy is
  what the scan reads for them (a changed copy changes the loss)."""
  params, batch = init_params(), batches(1)[0]
  plain_loss, plain = jax.jit(jax.value_and_grad(loss_fn))(params, batch)

  def with_copy(params, batch, resident):
    with layer_scan.writing_grads_over_layers(resident=resident):
      return jax.value_and_grad(loss_fn)(params, batch)
  copy = jax.tree.map(lambda x: x[:rows], params["blocks"])
  loss, grads = jax.jit(with_copy)(params, batch, copy)
  np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-6)
  assert_close(grads, plain, rtol=1e-6, atol=1e-7)
  changed, _ = jax.jit(with_copy)(params, batch, jax.tree.map(lambda x: x + 0.5, copy))
  assert abs(float(changed) - float(plain_loss)) > 1e-3


@pytest.mark.parametrize("compute_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mesh_size, landing_limit", [(1, None), (1, 2048), (8, None), (8, 2048)],
                         ids=["1dev", "1dev-streamed", "8dev", "8dev-streamed"])
def test_training_matches_the_gradients_apart(mesh_size, landing_limit, compute_dtype):
  """Same losses and weights as the engine that keeps the gradients apart,
  with the update whole or streamed in spans (each span's gradient read
  from the params' memory after earlier spans' weights went back in)."""
  kw = dict(compute_dtype=compute_dtype, landing_limit=landing_limit, max_grad_norm=1.0)
  apart, inside = engine(mesh_size, **kw), engine(mesh_size, grads_in_params=True, **kw)
  for b in batches(6):
    want, got = apart.step(b), inside.step(b)
    assert float(got.loss) == float(want.loss)
  assert_close(inside.params, apart.params, rtol=1e-6, atol=1e-7)
  for a, b in zip(jax.tree.leaves(inside.state.params), jax.tree.leaves(apart.state.params)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("offload", [0.5, 0.0])
@pytest.mark.parametrize("mesh_size, landing_limit", [(1, None), (8, 2048)],
                         ids=["1dev", "8dev-streamed"])
def test_a_device_part_of_the_state_trains_as_the_gradients_apart(mesh_size, landing_limit,
                                                                  offload):
  """With part of every leaf's state on the device (offload=0.5; 0: all of
  it), the step writes the device parts' new weights over their gradients
  and the host's come up into the rest: the same losses and weights as the
  engine that keeps the gradients apart, bit for bit."""
  kw = dict(offload=offload, landing_limit=landing_limit, max_grad_norm=1.0)
  apart, inside = engine(mesh_size, **kw), engine(mesh_size, grads_in_params=True, **kw)
  assert inside.plan.offloaded_fraction == apart.plan.offloaded_fraction < 1
  for b in batches(6):
    assert float(inside.step(b).loss) == float(apart.step(b).loss)
  assert_close(inside.params, apart.params, rtol=0, atol=0)
  for a, b in zip(jax.tree.leaves(inside.state.params), jax.tree.leaves(apart.state.params)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("where", ["grads_in_params", "offload_params"])
def test_evaluate_reads_the_weights_where_they_are(where):
  """engine.evaluate with the layers' weights written back by the host (and
  with offload_params fetched from host memory a layer at a time) gives the
  loss of the weights, as the engine that keeps its gradients apart does."""
  apart, inside = engine(8, grad_accum=2), engine(8, grad_accum=2, **{where: True})
  data = batches(3)
  for b in data[:2]:
    apart.step(b), inside.step(b)
  np.testing.assert_allclose(float(inside.evaluate(data[2])), float(apart.evaluate(data[2])),
                             rtol=1e-6)


@pytest.mark.parametrize("where", ["grads_in_params", "offload_params"])
def test_compute_params_bring_the_weights_from_where_they_are(where):
  """compute_params() with the weights written back by the host, or kept in
  host memory: the masters in bf16, full shapes, on the devices."""
  inside = engine(8, **{where: True})
  inside.step(batches(1)[0])
  want = jax.tree.map(lambda x: x.astype(jnp.bfloat16), inside.params)
  for a, b in zip(jax.tree.leaves(inside.compute_params()), jax.tree.leaves(want)):
    assert a.sharding.memory_kind != "pinned_host" and a.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_layers_gradients_take_no_memory_of_their_own():
  """XLA writes the layers' gradients into the donated weights: the compiled
  step needs (temporaries and outputs beyond the donated arguments) a
  stacked gradient's bytes less than the engine that keeps them apart
  (float32: the CPU computes bfloat16 in float32 copies)."""
  big = {"embed": jnp.zeros((DIN, 256)), "head": jnp.zeros((256, DOUT)),
         "blocks": {"w": jnp.full((4, 256, 256), 0.01), "b": jnp.zeros((4, 256))}}
  batch = {"x": jnp.ones((8, DIN)), "y": jnp.ones((8, DOUT))}
  layer_bytes = 4 * (4 * 256 * 256 + 4 * 256)
  need = {}
  for inside in (False, True):
    e = jzo.ZeroEngine(loss_fn, big, TX(),
                       options=jzo.EngineOptions(stage=3, layers="blocks", offload=True,
                                                 compute_dtype=jnp.float32, grads_in_params=inside),
                       mesh=mesh_of(1))
    m = e.lower(batch).compile().memory_analysis()
    need[inside] = m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
  assert need[True] <= need[False] - layer_bytes, need


@pytest.mark.parametrize("offload", [True, 0.5], ids=["host", "split"])
def test_a_skipped_step_puts_the_weights_back(offload):
  """Non-finite gradients skip the step: the weights they overwrote are
  made again from the masters (a device part's in the step, the host
  part's after it), and training goes on as the engine that keeps its
  gradients apart."""
  kw = dict(landing_limit=2048, offload=offload)
  apart, inside = engine(8, **kw), engine(8, grads_in_params=True, **kw)
  data = batches(4)
  bad = dict(data[1], x=data[1]["x"].at[0, 0].set(jnp.nan))
  for b in [data[0], bad, data[2], data[3]]:
    want, got = apart.step(b), inside.step(b)
    assert bool(got.skipped) == bool(want.skipped)
  assert int(inside.state.skipped) == 1
  for a, b in zip(jax.tree.leaves(inside.state.params), jax.tree.leaves(apart.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("compute_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("where", ["grads_in_params", "offload_params"])
@pytest.mark.parametrize("mesh_size, grad_accum, landing_limit, accumulation", [
    (1, 2, None, "layers"), (1, 4, 2048, "layers"), (8, 2, 2048, "layers"),
    pytest.param(1, 4, 2048, "device", marks=pytest.mark.slow), (8, 2, 2048, "device")],
    ids=["1dev-2", "1dev-4-streamed", "8dev-2-streamed", "1dev-4-streamed-sums",
         "8dev-2-streamed-sums"])
def test_accumulation_matches_the_device_sums(mesh_size, grad_accum, landing_limit,
                                              accumulation, where, compute_dtype):
  """grad_accum > 1 trains as the engine that sums every gradient on the
  device after its backward pass, to float32 rounding:
  - the layers first (accumulation "layers", the default): every micro-
    batch's forward through the layers, then each layer's backward over
    every micro-batch, its float32 sum written over its weights;
  - accumulation "device": the layers' micro-batches summed in float32 in
    their backward pass, the last written over the weights; the same
    arithmetic, bit for bit on CI's CPU (on the GPU machine's 16-core Xeon
    XLA fuses the two programs otherwise, and losses differ in their last
    bit).
  With the weights in device or host memory. In bfloat16 the gradient norm
  is of the rounded sums the host reads, not of the float32 sums, so
  clipping is left out there: each clip factor would differ in its last
  bits (as it does with the weights in host memory, whose norm is summed
  layer by layer)."""
  fp32 = compute_dtype == jnp.float32
  kw = dict(compute_dtype=compute_dtype, landing_limit=landing_limit,
            max_grad_norm=1.0 if fp32 else None, grad_accum=grad_accum)
  apart = engine(mesh_size, accumulation="device", **kw)
  inside = engine(mesh_size, **{where: True}, accumulation=accumulation, **kw)
  assert not inside.plan.host_accumulation
  assert inside.plan.layers_first == (accumulation == "layers")
  exact = accumulation == "device"
  for b in batches(4):
    want, got = apart.step(b), inside.step(b)
    # (XLA's CPU fuses the bfloat16 forward otherwise in the two programs.)
    np.testing.assert_allclose(float(got.loss), float(want.loss), rtol=1e-6 if exact else 1e-5)
    np.testing.assert_allclose(float(got.grad_norm), float(want.grad_norm),
                               rtol=1e-6 if fp32 else 1e-3)
  # A gradient's last float32 bit moves a weight near zero by a far smaller
  # part of the learning rate (1e-2) than of the weight. In bfloat16 the
  # layers first round the leaves' gradients through the loss and through
  # the layers apart (the device sums, their sum): a last bfloat16 bit of a
  # gradient moves its weight by up to 1% of the learning rate (measured:
  # 1.0e-4 at most).
  rtol, atol = (0, 0) if exact and not (fp32 and where == "offload_params") else (1e-5, 1e-7)
  if not fp32 and not exact:
    rtol, atol = 1e-3, 2e-4
  assert_close(inside.params, apart.params, rtol=rtol, atol=atol)
  for a, b in zip(jax.tree.leaves(inside.state.params), jax.tree.leaves(apart.state.params)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol,
                               atol=atol)


@pytest.mark.parametrize("mesh_size", [1, 8])
def test_accumulation_with_a_device_part_matches_the_device_sums(mesh_size):
  """grad_accum = 2 with half of every leaf's state on the device, in
  float32: the device part is updated from the layers' sums written over
  the weights, and trains as the engine that sums every gradient apart, to
  float32 rounding (bit for bit on one device on CI's CPU; on eight, and on
  the GPU machine's Xeon, XLA fuses the two programs otherwise). In bfloat16 it reads the sums
  rounded once, as the host part does, where the engine apart updates its
  device part from the float32 sums."""
  kw = dict(compute_dtype=jnp.float32, max_grad_norm=1.0, grad_accum=2, offload=0.5,
            landing_limit=2048)
  apart = engine(mesh_size, accumulation="device", **kw)
  inside = engine(mesh_size, grads_in_params=True, **kw)
  rtol = 1e-6
  for b in batches(4):
    np.testing.assert_allclose(float(inside.step(b).loss), float(apart.step(b).loss), rtol=rtol)
  assert_close(inside.params, apart.params, rtol=10 * rtol, atol=0)


def test_accumulation_keeps_no_gradient_of_the_layers_beside_the_sums():
  """With grad_accum = 4 and accumulation "device" the compiled step holds
  the float32 sums and a layer's temporaries beyond the donated weights;
  summing after each backward pass holds a stacked gradient beside its
  sums. The layers first hold no float32 sums of the layers: every micro-
  batch's layer inputs (16 x 16 x 256 floats here) and one layer's float32
  sum instead. (Shown with the weights in host memory: with them on the
  device the step counts the stack's non-finite gradients after the
  backward pass, for which XLA:CPU makes an int32 array as large as the
  sums.)"""
  layers = 16
  big = {"embed": jnp.zeros((DIN, 256)), "head": jnp.zeros((256, DOUT)),
         "blocks": {"w": jnp.full((layers, 256, 256), 0.01), "b": jnp.zeros((layers, 256))}}
  batch = {"x": jnp.ones((16, DIN)), "y": jnp.ones((16, DOUT))}
  stack = 4 * layers * (256 * 256 + 256)
  sums = 4 * sum(x.size for x in jax.tree.leaves(big))
  need = {}
  for kw in (dict(accumulation="device"), dict(grads_in_params=True, accumulation="device"),
             dict(offload_params=True, accumulation="device"), dict(offload_params=True)):
    e = make_engine(loss_fn, big, TX(), stage=3, layers="blocks", offload=True, grad_accum=4,
                    compute_dtype=jnp.float32, mesh=mesh_of(1), **kw)
    m = e.lower(batch).compile().memory_analysis()
    need[len(need)] = m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
  assert need[0] >= sums + stack, need
  assert need[1] < sums + stack // 4, need
  inputs = 4 * layers * 16 * 256
  assert need[2] >= stack and need[3] < need[2] - stack + inputs + stack // 4, need


def test_a_non_finite_micro_batch_skips_the_accumulated_step():
  """A NaN in the first micro-batch (whose gradients only go into the sums)
  or the last (written over the weights) skips the step: the weights are
  made again from the masters, as with the device's sums."""
  kw = dict(grad_accum=2, landing_limit=2048)
  apart, inside = engine(8, accumulation="device", **kw), engine(8, grads_in_params=True, **kw)
  data = batches(4)
  # Micro-batch j of a device takes its rows [j m, (j + 1) m) (m = 1 here).
  first = dict(data[1], x=data[1]["x"].at[0, 0].set(jnp.nan))
  last = dict(data[2], x=data[2]["x"].at[1, 0].set(jnp.inf))
  for b in [data[0], first, last, data[3]]:
    want, got = apart.step(b), inside.step(b)
    assert bool(got.skipped) == bool(want.skipped)
  assert int(inside.state.skipped) == 2
  for a, b in zip(jax.tree.leaves(inside.state.params), jax.tree.leaves(apart.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp16_loss_scaling_over_accumulated_micro_batches():
  """fp16 with grad_accum = 2: where the float32 sums of scaled gradients
  overflow as they are rounded to fp16 over the weights (the first two
  steps' scales, and a batch 10^4 times larger at any scale), the step is
  skipped and the loss scale halved, as with the device's sums; the other
  steps train the same (the weights equal)."""
  kw = dict(compute_dtype=jnp.float16, grad_accum=2, landing_limit=2048)
  apart, inside = engine(8, accumulation="device", **kw), engine(8, grads_in_params=True, **kw)
  data = batches(5)
  data[2] = dict(data[2], x=data[2]["x"] * 1e4)  # overflows at every scale tried
  for b in data:
    want, got = apart.step(b), inside.step(b)
    assert (bool(got.skipped), float(got.loss_scale)) == (bool(want.skipped),
                                                          float(want.loss_scale))
  assert int(inside.state.skipped) == 3 and int(inside.state.step) == 2
  for a, b in zip(jax.tree.leaves(inside.state.params), jax.tree.leaves(apart.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("offload", [True, 0.5], ids=["host", "split"])
def test_an_accumulating_run_resumes_from_its_checkpoint_exactly(offload):
  """state_dict after accumulated steps (the weights written back over the
  last micro-batch's sums) loads into a new engine, which goes on as the
  uninterrupted one, bit for bit."""
  kw = dict(grad_accum=2, landing_limit=2048, grads_in_params=True, offload=offload)
  data = batches(5)
  first = engine(8, **kw)
  for b in data[:2]:
    first.step(b)
  resumed = engine(8, **kw)
  resumed.load_state_dict(first.state_dict())
  for b in data[2:]:
    assert float(resumed.step(b).loss) == float(first.step(b).loss)
  for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(first.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert_close(resumed.params, first.params, rtol=0, atol=0)


@pytest.mark.parametrize("offload", [True, 0.5], ids=["host", "split"])
def test_a_device_step_run_alone_leaves_the_weights_whole(offload):
  """(With a device part, the step updates it: only the host part's
  weights, which no update wrote, are as before.)"""
  inside = engine(1, grads_in_params=True, offload=offload)
  layouts = inside.plan.leaves
  before = [np.asarray(x) for x in jax.tree.leaves(inside.state.params)]
  inside.run_device_step(batches(1)[0])
  for l, a, b in zip(layouts, jax.tree.leaves(inside.state.params), before):
    c = l.on_device  # of a flat shard (one device), or of each layer's row
    np.testing.assert_array_equal(np.asarray(a)[..., c:], b[..., c:])


def test_cpu_devices_do_not_overlap_the_update():
  """The plan would overlap the next step's forward with the host update,
  but not on CPU devices: XLA's CPU runtime was seen to read the landing
  buffers before the step's callback let it (the step trained on gradients
  for weights, one run in six), and its devices share the cores the host
  update runs on. The overlap's tests run on a GPU (test_offload_gpu.py)."""
  e = engine(1, grads_in_params=True)
  assert e.plan.overlaps_update and not e.overlaps_update


def test_the_plan_counts_the_fetched_layers_on_one_device_or_several():
  """The overlapped forward fetches each layer's new weights over one device
  or several; the plan counts them in the GPU peak either way, and not where
  the update comes first."""
  for n in (1, 2):
    overlapped = engine(n, grads_in_params=True)
    update_first = engine(n, grads_in_params=True, overlap_forward=False)
    assert overlapped.plan.overlaps_update and not update_first.plan.overlaps_update
    assert "fetched layers" in overlapped.plan.device_peak(0)
    assert "fetched layers" not in update_first.plan.device_peak(0)


@pytest.mark.parametrize("kw, message", [
    (dict(stage=2, layers=None), "needs stage=3 and layers="),
    (dict(layers=None), "needs stage=3 and layers="),
    (dict(offload=False), "needs offload=True, a fraction or 'auto'"),
    (dict(grad_accum=2, accumulation="host"), "cannot take accumulation='host'"),
    (dict(delayed_update=True), "cannot delay"),
    (dict(grads_in_params=1), "must be True or False"),
    (dict(overlap_forward=1), "overlap_forward must be True or False"),
    (dict(grads_in_params=False, accumulation="layers"), "set grads_in_params=True"),
])
def test_bad_options(kw, message):
  kw = dict(dict(stage=3, layers="blocks", offload=True, grads_in_params=True), **kw)
  with pytest.raises(ValueError, match=message):
    make_engine(loss_fn, init_params(), TX(), mesh=mesh_of(1), **kw)


def test_a_model_without_scan_layers_is_named():
  from test_engine import loss_fn as lax_scan_loss
  e = jzo.ZeroEngine(lax_scan_loss, init_params(), TX(),
                     options=jzo.EngineOptions(stage=3, layers="blocks", offload=True,
                                               grads_in_params=True),
                     mesh=mesh_of(1))
  with pytest.raises(ValueError, match="jzo.scan_layers"):
    e.step(batches(1)[0])


def masked_loss_fn(params, batch):
  """loss_fn whose layers also close over an integer array of the batch
  (a mask): the layers first take it, per micro-batch, without a gradient."""
  h = batch["x"] @ params["embed"]
  shift = jnp.mean(params["head"])
  mask = (batch["x"][:, :1] > 0).astype(jnp.int32)

  def layer(h, p):
    p = jzo.gather_layer(p)
    return jnp.tanh(h @ p["w"] + p["b"] + shift) * mask + h
  h = jzo.scan_layers(jax.checkpoint(layer), h, params["blocks"])
  return jnp.mean((h @ params["head"] - batch["y"]) ** 2)


@pytest.mark.parametrize("mesh_size", [1, 8])
def test_the_layers_first_take_what_the_layers_close_over_per_micro_batch(mesh_size):
  """A layer function closing over a float computed from the params and an
  integer mask computed from each micro-batch: the layers first train as
  the device's sums, to float32 rounding."""
  kw = dict(stage=3, layers="blocks", offload=True, mesh=mesh_of(mesh_size), grad_accum=2,
            compute_dtype=jnp.float32, max_grad_norm=1.0)
  apart = make_engine(masked_loss_fn, init_params(), TX(), accumulation="device", **kw)
  first = make_engine(masked_loss_fn, init_params(), TX(), grads_in_params=True, **kw)
  assert first.plan.layers_first
  for b in batches(3):
    np.testing.assert_allclose(float(first.step(b).loss), float(apart.step(b).loss), rtol=1e-6)
  assert_close(first.params, apart.params, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("accumulation", ["layers", "device"])
def test_a_model_scanning_part_of_the_layers_is_refused(accumulation):
  """With grad_accum > 1 scan_layers must get the engine's layers whole."""
  def part_loss(params, batch):
    h = batch["x"] @ params["embed"]
    h = jzo.scan_layers(lambda h, w: jnp.tanh(h @ jzo.gather_layer(w)) + h, h,
                        params["blocks"]["w"])
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2)
  e = jzo.ZeroEngine(part_loss, init_params(), TX(),
                     options=jzo.EngineOptions(stage=3, layers="blocks", offload=True,
                                               grads_in_params=True, grad_accum=2,
                                               accumulation=accumulation),
                     mesh=mesh_of(1))
  with pytest.raises(ValueError, match="subtree whole"):
    e.step(batches(1)[0])
