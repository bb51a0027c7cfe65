"""offload_params: the layers' weights in pinned host memory, fetched a layer
at a time, their gradients written back over them there, on 1 and 8 fake
CPU devices: the same training as grads_in_params on the devices, the
plan's bytes, skipped steps, checkpoints, bad input; offload_params="auto"
choosing how many layers keep their weights in device memory as well, and
training with them there."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzo
from jzo import step as step_lib
from jzo.parallel.partition import is_layout
from jzo.plan import DEVICE_HEADROOM
from test_engine import LAYERS, assert_close, batches, init_params, make_engine, mesh_of
from test_grads_in_params import engine, loss_fn
from test_offload import TX


def layer_leaves(e):
  """The params leaves of the stacked layers (blocks' b and w)."""
  return [x for path, x in jax.tree_util.tree_leaves_with_path(e.state.params)
          if "blocks" in jax.tree_util.keystr(path)]


@pytest.mark.parametrize("compute_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mesh_size, landing_limit", [(1, None), (8, None), (8, 2048)],
                         ids=["1dev", "8dev", "8dev-streamed"])
def test_training_matches_the_weights_on_the_devices(mesh_size, landing_limit, compute_dtype):
  """Same losses, gradient norms (counted on the devices, layer by layer:
  in another order, so the clip factor may differ in its last bits, and
  XLA may fuse the forward otherwise) and weights as grads_in_params with
  the weights on the devices; the
  layers' weights stay in pinned host memory, the other leaves on the
  devices; the update whole or streamed in spans."""
  kw = dict(compute_dtype=compute_dtype, landing_limit=landing_limit, max_grad_norm=1.0)
  on_devices, on_host = engine(mesh_size, grads_in_params=True, **kw), engine(
      mesh_size, offload_params=True, **kw)
  for b in batches(6):
    want, got = on_devices.step(b), on_host.step(b)
    np.testing.assert_allclose(float(got.loss), float(want.loss), rtol=1e-6)
    np.testing.assert_allclose(float(got.grad_norm), float(want.grad_norm), rtol=1e-6)
  assert_close(on_host.params, on_devices.params, rtol=1e-6, atol=1e-7)
  kinds = {jax.tree_util.keystr(p): x.sharding.memory_kind
           for p, x in jax.tree_util.tree_leaves_with_path(on_host.state.params)}
  assert {k: v for k, v in kinds.items() if "blocks" in k} == {
      "['blocks']['b']": "pinned_host", "['blocks']['w']": "pinned_host"}
  assert all(v != "pinned_host" for k, v in kinds.items() if "blocks" not in k)
  for a, b in zip(jax.tree.leaves(on_host.state.params), jax.tree.leaves(on_devices.state.params)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-5 if compute_dtype == jnp.float32 else 1e-2, atol=1e-7)


def test_the_plan_moves_the_layers_weights_to_the_host():
  """The device holds the other leaves and one layer's weights and gradient
  at the step's peak; the host the layers' weights in the compute dtype,
  which take the place of their landing buffers."""
  kw = dict(compute_dtype=jnp.bfloat16)
  on_devices, on_host = engine(1, grads_in_params=True, **kw), engine(1, offload_params=True, **kw)
  layers = sum(x.size for x in layer_leaves(on_host))
  row = layers // init_params()["blocks"]["w"].shape[0]
  a, b = on_devices.plan, on_host.plan
  assert a.device_bytes()["params"] - b.device_bytes()["params"] == 2 * layers
  assert on_host.memory_per_device()["params"] == b.device_bytes()["params"]
  step = lambda plan: plan.device_peak(activations=2**20)["backward grads"]  # the step's peak
  assert step(a) + 2 * row == step(b)
  assert b.host_bytes()["params"] == 2 * layers == b.host_params_bytes()
  assert a.host_bytes()["landing"] - b.host_bytes()["landing"] == 2 * layers
  assert "layers' weights on the host" in str(b)
  on_host.step(batches(1)[0])
  state = sum(x.nbytes for x in on_host.host.arrays())
  assert on_host.host_bytes_in_use() == state + 2 * layers + on_host.host_update.landing_peak


@pytest.mark.parametrize("mesh_size", [1, 8])
def test_the_compiled_step_copies_no_layer_buffer(mesh_size):
  """The backward pass writes the gradients over the weights in place:
  XLA's compiled step holds no copy of a stacked buffer (a fetch a layer
  ahead, read from the carried buffer before its in-place write, made XLA
  copy it whole: on an H100 an 18.75 GiB host allocation at gpt2-10b)."""
  e = engine(mesh_size, offload_params=True, compute_dtype=jnp.bfloat16)
  hlo = e.lower(batches(1)[0]).compile().as_text()
  stacked = {"bf16[%s]" % ",".join(map(str, x.addressable_shards[0].data.shape))
             for x in layer_leaves(e)}
  copies = re.findall(r"= (bf16\[[0-9,]*\])\{[^}]*\} copy\(", hlo)
  assert stacked and not stacked & set(copies), (stacked, copies)


def test_only_a_step_with_weights_on_the_host_runs_without_command_buffers(monkeypatch):
  """XLA:GPU's command buffers would chain the layers' fetches from host
  memory behind the matmuls (docs/performance.md); steps without weights
  in host memory, and other platforms, keep XLA's default. The step is
  compiled with the options chosen: a bad one reaches XLA. (XLA:GPU forms
  command buffers from its thunks, after the HLO that a compiled step
  shows, so a GPU cannot check more.) The step's programs take their
  options from jzo.step.programs.compiler_options, its one hook for them."""
  from jzo.step import programs
  off = {"xla_gpu_enable_command_buffer": ""}
  on_host, on_devices = engine(1, offload_params=True).plan, engine(1, grads_in_params=True).plan
  assert step_lib.compiler_options(on_host, "gpu") == off
  assert step_lib.compiler_options(on_devices, "gpu") is None
  assert step_lib.compiler_options(with_weights_on_host(on_devices, [W]), "gpu") == off
  assert step_lib.compiler_options(on_host, "tpu") is None  # an XLA:GPU option
  monkeypatch.setattr(programs, "compiler_options",
                      lambda plan, platform: {"xla_no_such_option": ""})
  with pytest.raises(Exception, match="xla_no_such_option"):
    engine(1, offload_params=True).lower(batches(1)[0]).compile()


def test_a_skipped_step_and_a_device_step_alone_put_the_weights_back():
  """Non-finite gradients skip the step, and a device step run alone
  updates nothing: either way the host weights the gradients overwrote are
  made again from the masters, and training goes on as with the weights on
  the devices."""
  on_devices, on_host = (engine(8, landing_limit=2048, grads_in_params=True),
                         engine(8, landing_limit=2048, offload_params=True))
  data = batches(4)
  bad = dict(data[1], x=data[1]["x"].at[0, 0].set(jnp.nan))
  for b in [data[0], bad, data[2]]:
    want, got = on_devices.step(b), on_host.step(b)
    assert bool(got.skipped) == bool(want.skipped)
  assert int(on_host.state.skipped) == 1
  before = [np.asarray(x) for x in jax.tree.leaves(on_host.state.params)]
  on_host.run_device_step(data[3])
  for a, b, c in zip(jax.tree.leaves(on_host.state.params), before,
                     jax.tree.leaves(on_devices.state.params)):
    np.testing.assert_array_equal(np.asarray(a), b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_a_checkpoint_moves_between_weights_on_the_host_and_on_the_devices():
  """state_dict of an offload_params engine loads into one whose weights
  are on the devices and back, and both go on training alike."""
  data = batches(5)
  first = engine(8, offload_params=True)
  for b in data[:2]:
    first.step(b)
  saved = first.state_dict()
  on_devices, on_host = engine(1, grads_in_params=True), engine(8, offload_params=True)
  on_devices.load_state_dict(saved)
  on_host.load_state_dict(on_devices.state_dict())
  assert {x.sharding.memory_kind for x in layer_leaves(on_host)} == {"pinned_host"}
  for b in data[2:]:
    want, got = first.step(b), on_host.step(b)
    assert float(got.loss) == float(want.loss)
    # One device sums the bf16 gradients in another order than eight.
    np.testing.assert_allclose(float(on_devices.step(b).loss), float(want.loss), rtol=1e-3)
  assert_close(on_host.params, first.params, rtol=0, atol=0)


@pytest.mark.parametrize("kw, message", [
    (dict(stage=2, layers=None), "offload_params needs stage=3 and layers="),
    (dict(offload=0.5), "offload_params needs offload=True"),
    (dict(grad_accum=2, accumulation="host"), "offload_params sums the layers' micro-batches"),
    (dict(delayed_update=True), "offload_params cannot delay"),
    (dict(offload_params=1), "offload_params must be True, False or 'auto'"),
    (dict(offload_params="auto"), "offload_params='auto' needs the device memory"),
    (dict(host_transfer="portable"), "offload_params keeps the layers' weights in pinned host"),
    (dict(resident_layers=-1), "resident_layers must be an integer >= 0"),
    (dict(resident_layers=1, offload_params="auto"), "resident_layers .* needs offload_params=True"),
    (dict(resident_layers=1, offload_params=False, grads_in_params=True),
     "resident_layers .* needs offload_params=True"),
    (dict(resident_layers=LAYERS + 1), r"resident_layers must be in \[0, 3\]"),
])
def test_bad_options(kw, message):
  kw = dict(dict(stage=3, layers="blocks", offload=True, offload_params=True), **kw)
  with pytest.raises(ValueError, match=message):
    make_engine(loss_fn, init_params(), TX(), mesh=mesh_of(1), **kw)


def test_the_planner_estimates_it():
  """jzo.estimate with offload_params: offload 'auto' means True, the
  layers' weights on the host."""
  est = jzo.estimate(init_params(), stage=3, layers="blocks", offload_params=True,
                     device_memory=2**30, host_memory=8 * 2**30)
  assert est.fits and est.plan.offload_params and est.plan.offloaded_fraction == 1
  assert est.plan.host_bytes()["params"] > 0


W, B = "['blocks']['w']", "['blocks']['b']"


def with_weights_on_host(plan, names):
  """`plan` with the weights of the leaves named (keystr) in pinned host memory."""
  layouts = jax.tree_util.tree_map_with_path(
      lambda path, l: dataclasses.replace(l, weights_on_host=jax.tree_util.keystr(path) in names),
      plan.layouts, is_leaf=is_layout)
  return dataclasses.replace(plan, layouts=layouts)


def device_need(plan, activations):
  """Bytes of device memory a plan needs, as the planner counts them."""
  return max(sum(plan.device_peak(activations).values()),
             sum(plan.device_bytes().values()) + plan.build_bytes())


def memory_for(need):
  """device_memory whose budget (less the planner's headroom) just holds `need` bytes."""
  return math.ceil(need / (1 - DEVICE_HEADROOM)) + 1


def on_host_names(plan):
  return {jax.tree_util.keystr(path) for path, l in
          jax.tree_util.tree_leaves_with_path(plan.layouts, is_leaf=is_layout)
          if plan.params_on_host(l)}


def test_auto_keeps_as_many_layers_resident_as_fit():
  """offload_params='auto' keeps the layers' weights on the device where
  they fit; else it offloads them and keeps a copy of the first layers'
  that still fit in device memory (each one 2 B a parameter more there),
  none where only that fits, and is refused, with the numbers, below."""
  act = 2**20
  estimate = lambda memory, offload_params="auto", **kw: jzo.estimate(
      init_params(), stage=3, layers="blocks", offload_params=offload_params, activations=act,
      device_memory=memory, host_memory=8 * 2**30, **kw)
  on_devices = estimate(2**34).plan
  assert on_devices.grads_in_params and not on_devices.offload_params
  on_host = estimate(2**34, offload_params=True).plan
  resident = lambda r: dataclasses.replace(on_host, resident_layers=r)
  row = sum(x[0].size for x in jax.tree.leaves(init_params()["blocks"]))
  row *= np.dtype(on_host.compute_dtype).itemsize
  need = [device_need(resident(r), act) for r in range(LAYERS + 1)]
  assert all(b - a == row for a, b in zip(need, need[1:]))
  assert resident(1).device_bytes()["params"] - on_host.device_bytes()["params"] == row
  assert need[1] < device_need(on_devices, act)  # so one resident layer is a plan of its own
  for r in (0, 1):
    plan = estimate(memory_for(need[r])).plan
    assert plan.resident_layers == r and on_host_names(plan) == {W, B}
  assert f"layers' weights on the host (1 of {LAYERS} layers resident on the device)" in str(
      estimate(memory_for(need[1])).plan)
  refused = estimate(need[0] - 1)
  assert not refused.fits and "GiB" in refused.error
  with pytest.raises(ValueError, match="resident_layers must be in"):
    resident(LAYERS + 1)
  assert estimate(2**34, offload_params=True, resident_layers=2).plan == resident(2)
  with pytest.raises(ValueError, match="resident_layers needs every leaf"):
    dataclasses.replace(on_devices, resident_layers=1)


@pytest.mark.parametrize("mesh_size, kw", [
    (1, {}), (8, {}), (8, dict(grad_accum=2, offload_params=True, resident_layers=1)),
    (8, dict(landing_limit=2048))], ids=["1dev", "8dev", "8dev-accum-explicit", "8dev-streamed"])
def test_resident_layers_train_as_the_weights_on_the_devices(mesh_size, kw):
  """With the first layer resident (chosen by "auto", or asked for), the
  same training as grads_in_params
  with every weight on the devices (whole or streamed updates, summed
  micro-batches, a skipped step); the resident copy is the weights' first
  row after each update, and the step reads it (a zeroed copy changes the
  loss). A checkpoint loads into such an engine, resident copy and all."""
  asked = {k: kw.pop(k) for k in ("offload_params", "resident_layers") if k in kw}
  kw = dict(compute_dtype=jnp.float32, max_grad_norm=1.0, activation_memory=2**20, **kw)
  on_devices = engine(mesh_size, grads_in_params=True, **kw)
  on_host = engine(mesh_size, offload_params=True, **kw).plan
  memory = memory_for(device_need(dataclasses.replace(on_host, resident_layers=1), 2**20))
  kw.update(asked or dict(offload_params="auto", device_memory=memory))
  mixed = engine(mesh_size, **kw)
  assert mixed.plan.resident_layers == 1

  def assert_resident_is_the_first_row(e):
    for name in ("w", "b"):
      np.testing.assert_array_equal(np.asarray(e.state.resident[name]),
                                    np.asarray(e.state.params["blocks"][name])[:1])
  data = batches(5)
  bad = dict(data[2], x=data[2]["x"].at[0, 0].set(jnp.nan))
  for b in [data[0], data[1], bad, data[3]]:
    want, got = on_devices.step(b), mixed.step(b)
    assert bool(got.skipped) == bool(want.skipped)
    np.testing.assert_allclose(float(got.loss), float(want.loss), rtol=1e-6)
    np.testing.assert_allclose(float(got.grad_norm), float(want.grad_norm), rtol=1e-5)
    assert_resident_is_the_first_row(mixed)
  assert int(mixed.state.skipped) == 1
  assert_close(mixed.params, on_devices.params, rtol=1e-5, atol=1e-7)
  assert mixed.memory_per_device()["params"] == mixed.plan.device_bytes()["params"]

  again = engine(mesh_size, **kw)
  again.load_state_dict(mixed.state_dict())
  assert_resident_is_the_first_row(again)
  assert float(again.evaluate(data[4])) == float(mixed.evaluate(data[4]))
  zeroed = jax.tree.map(jnp.zeros_like, again.state.resident)
  again.trained.device = again.state._replace(resident=zeroed)
  want, got = mixed.step(data[4]), again.step(data[4])
  assert abs(float(got.loss) - float(want.loss)) > 1e-3


@pytest.mark.parametrize("kw, mode", [
    (dict(), "WholeUpdate"),
    (dict(landing_limit=2048), "StreamedUpdate"),
    (dict(offload_params=True), "ParamsOnHostUpdate"),
    (dict(offload_params=True, landing_limit=2048), "StreamedParamsOnHostUpdate"),
    (dict(grads_in_params=False, grad_accum=2, accumulation="host"), "AccumulatedUpdate"),
], ids=["whole", "streamed", "params-on-host", "streamed-params-on-host", "accumulated"])
def test_the_engine_picks_the_host_update_mode_from_its_plan(kw, mode):
  """One mode of the host update, chosen when the engine is built (on CPU
  devices the forward never overlaps the update: jzo.host.overlapped runs
  on accelerators); each trains as the plain update does."""
  kw = dict(dict(grads_in_params=True), **kw)
  e, plain = engine(1, **kw), engine(1, **dict(kw, landing_limit=None))
  assert type(e.host_update).__name__ == mode
  for b in batches(2):
    np.testing.assert_array_equal(np.float32(e.step(b).loss), np.float32(plain.step(b).loss))
  assert_close(e.params, plain.params, rtol=0, atol=0)
