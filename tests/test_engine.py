"""ZeRO stages 0-3 on 8 fake CPU devices: results, memory, collectives, bad input."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jzo

DIN, HIDDEN, DOUT, LAYERS = 5, 12, 3, 3  # sizes that do not divide 8


def init_params(seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  return {"embed": jax.random.normal(k[0], (DIN, HIDDEN)) * 0.3,
          "blocks": {"w": jax.random.normal(k[1], (LAYERS, HIDDEN, HIDDEN)) * 0.2,
                     "b": jnp.zeros((LAYERS, HIDDEN))},
          "head": jax.random.normal(k[2], (HIDDEN, DOUT)) * 0.3}


def make_loss(unroll=1):
  """Residual tanh MLP as a scan over stacked layers, each rematerialized."""
  def loss_fn(params, batch):
    h = batch["x"] @ params["embed"]  # (B, HIDDEN)

    def layer(h, p):
      p = jzo.gather_layer(p)
      return jnp.tanh(h @ p["w"] + p["b"]) + h, None
    h, _ = jax.lax.scan(jax.checkpoint(layer), h, params["blocks"], unroll=unroll)
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2)
  return loss_fn


loss_fn = make_loss()


def batches(n, size=16, seed=1):
  keys = jax.random.split(jax.random.PRNGKey(seed), n)
  return [{"x": jax.random.normal(k, (size, DIN)),
           "y": jax.random.normal(jax.random.fold_in(k, 1), (size, DOUT))} for k in keys]


def reference(params, tx, data, max_grad_norm=None):
  """Plain single-device float32 training."""
  if max_grad_norm is not None:
    tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)
  state = tx.init(params)
  step = jax.jit(lambda p, s, b: tx.update(jax.grad(loss_fn)(p, b), s, p))
  for b in data:
    updates, state = step(params, state, b)
    params = optax.apply_updates(params, updates)
  return params


def mesh_of(n):
  return Mesh(np.array(jax.devices()[:n]), ("data",))


OPTION_NAMES = {f.name for f in dataclasses.fields(jzo.EngineOptions)}


def make_engine(loss_fn, params, tx, **kw):
  """A ZeroEngine from keywords of both kinds: EngineOptions' fields go into
  its options, the rest (mesh, memory) to the engine."""
  options = jzo.EngineOptions(**{k: kw.pop(k) for k in list(kw) if k in OPTION_NAMES})
  return jzo.ZeroEngine(loss_fn, params, tx, options, **kw)


def assert_close(got, want, rtol=2e-5, atol=2e-6):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                       rtol=rtol, atol=atol), got, want)


STAGES = [(0, None), (1, None), (2, None), (3, None), (3, "blocks")]
OPTIMIZERS = {"optax.adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
              "jzo.cpu_adamw": lambda: jzo.cpu_adamw(1e-2, weight_decay=0.1)}


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("stage, layers", STAGES, ids=lambda x: str(x))
def test_stages_match_single_device(stage, layers, opt):
  params, data = init_params(), batches(20)
  engine = jzo.ZeroEngine(loss_fn, params, OPTIMIZERS[opt](),
                          options=jzo.EngineOptions(stage=stage, layers=layers,
                                                    compute_dtype=jnp.float32),
                          mesh=mesh_of(8))
  for b in data:
    engine.step(b)
  assert_close(engine.params, reference(params, OPTIMIZERS[opt](), data))
  assert int(engine.state.step) == 20 and int(engine.state.skipped) == 0


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("stage, layers", STAGES, ids=lambda x: str(x))
def test_evaluate_is_the_loss_of_the_weights(stage, layers, offload):
  """engine.evaluate(batch) is loss_fn's mean over the batch with the
  trained weights (in float32 here: the compute dtype), run by devices and
  micro-batches, and changes nothing."""
  kw = dict(stage=stage, layers=layers, compute_dtype=jnp.float32, mesh=mesh_of(8),
            grad_accum=2)
  tx = jzo.cpu_adamw(1e-2) if offload else optax.adam(1e-2)
  engine = make_engine(loss_fn, init_params(), tx, offload=offload and stage > 0, **kw)
  data = batches(3)
  for b in data[:2]:
    engine.step(b)
  weights = engine.params
  got = float(engine.evaluate(data[2]))
  np.testing.assert_allclose(got, float(jax.jit(loss_fn)(weights, data[2])), rtol=1e-6)
  assert_close(engine.params, weights, rtol=0, atol=0)
  assert int(engine.state.step) == 2
  with pytest.raises(ValueError, match="does not split into 8 devices x 2 micro-batches"):
    engine.evaluate(batches(1, size=12)[0])


@pytest.mark.parametrize("stage, layers", STAGES, ids=lambda x: str(x))
def test_compute_params_are_the_weights_in_the_compute_dtype(stage, layers):
  """compute_params(): the masters rounded to bf16, in full shapes, on the
  devices (replicated)."""
  engine = jzo.ZeroEngine(loss_fn, init_params(), optax.adam(1e-2),
                          options=jzo.EngineOptions(stage=stage, layers=layers), mesh=mesh_of(8))
  engine.step(batches(1)[0])
  got = engine.compute_params()
  want = jax.tree.map(lambda x: x.astype(jnp.bfloat16), engine.params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == jnp.bfloat16 and a.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_grad_accumulation_and_clipping(stage):
  params, data = init_params(), batches(6, size=32)
  engine = jzo.ZeroEngine(loss_fn, params, optax.adam(1e-2),
                          options=jzo.EngineOptions(stage=stage, grad_accum=4, max_grad_norm=0.5,
                                                    compute_dtype=jnp.float32),
                          mesh=mesh_of(4))
  for b in data:
    metrics = engine.step(b)
  assert_close(engine.params, reference(params, optax.adam(1e-2), data, max_grad_norm=0.5))
  assert float(metrics.grad_norm) > 0.5  # the clip was active
  assert engine.state.grads["head"].dtype == jnp.float32  # accumulated in float32


def test_bf16_compute_tracks_float32():
  params, data = init_params(), batches(10)
  engine = jzo.ZeroEngine(loss_fn, params, optax.adam(1e-2), options=jzo.EngineOptions(stage=2),
                          mesh=mesh_of(8))
  for b in data:
    engine.step(b)
  assert engine.state.params["head"].dtype == jnp.bfloat16
  # bf16 forward/backward: gradients carry 8 mantissa bits. Adam normalizes
  # each element, so a near-zero gradient can flip sign; compare the total
  # movement of the weights instead of single elements.
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
  start, want, got = flat(params), flat(reference(params, optax.adam(1e-2), data)), flat(engine.params)
  assert np.linalg.norm(got - want) < 0.05 * np.linalg.norm(want - start)


def big_params():
  """About 60K parameters in leaves whose sizes leave little padding at 8 shards."""
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  return {"embed": jax.random.normal(k[0], (DIN, 256)) * 0.1,
          "blocks": {"w": jax.random.normal(k[1], (LAYERS, 256, 256)) * 0.05,
                     "b": jnp.zeros((LAYERS, 256))},
          "head": jax.random.normal(k[2], (256, DOUT)) * 0.1}


@pytest.mark.parametrize("n_dev", [1, 2, 4, 8])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_matches_zero_paper(stage, n_dev):
  """Bytes per device for bf16 params and grads, fp32 master + Adam moments."""
  params = big_params()
  psi = sum(x.size for x in jax.tree.leaves(params))
  engine = jzo.ZeroEngine(loss_fn, params, optax.adam(1e-3), options=jzo.EngineOptions(stage=stage),
                          mesh=mesh_of(n_dev))
  mem = engine.memory_per_device()
  expected = {0: 16 * psi, 1: 4 * psi + 12 * psi / n_dev, 2: 2 * psi + 14 * psi / n_dev,
              3: 16 * psi / n_dev}[stage]
  padding = sum(math.ceil(x.size / n_dev) * n_dev - x.size for x in jax.tree.leaves(params))
  # Up to 16 bytes per padded element, plus Adam's int32 step count.
  assert abs(sum(mem.values()) - expected) <= 16 * padding + 4
  assert mem["optimizer"] >= 12 * psi / (1 if stage == 0 else n_dev)


_COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\]\S* (all-reduce|reduce-scatter|all-gather)\(")
_CALLEE = re.compile(r"(?:to_apply|calls|called_computations|body|condition|branch_computations|"
                     r"true_computation|false_computation)=\{?([\w.\-]+(?:, [\w.\-]+)*)\}?")


def collectives(hlo: str, n_dev: int = 8) -> dict[str, list[int]]:
  """Element counts of the full (unsharded) operand of every collective the
  step executes: computations are counted once per call site (a scan body
  lowered to a called computation runs once per layer)."""
  own, callees, name, entry = {}, {}, None, None
  for line in hlo.splitlines():
    header = re.match(r"^(ENTRY )?([\w.\-]+) .*\{$|^(ENTRY )?([\w.\-]+) \{$", line)
    if header:
      name = header.group(2) or header.group(4)
      entry = name if (header.group(1) or header.group(3)) else entry
      own[name], callees[name] = [], []
      continue
    if name is None:
      continue
    if m := _COLLECTIVE.search(line):
      size = math.prod(int(d) for d in m.group(2).split(",") if d)
      if m.group(3) == "reduce-scatter":  # the result is one shard of the full operand
        size *= n_dev
      own[name].append((m.group(3), size))
    for m in _CALLEE.finditer(line):
      callees[name] += m.group(1).split(", ")

  def total(comp):
    return own.get(comp, []) + [op for c in callees.get(comp, []) for op in total(c)]
  found = {"all-reduce": [], "reduce-scatter": [], "all-gather": []}
  for kind, size in total(entry):
    found[kind].append(size)
  return found


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_collectives_and_volume_match_zero_paper(stage):
  params = big_params()
  psi = sum(x.size for x in jax.tree.leaves(params))
  engine = jzo.ZeroEngine(make_loss(unroll=LAYERS), params, optax.adam(1e-3),
                          options=jzo.EngineOptions(stage=stage,
                                                    layers="blocks" if stage == 3 else None),
                          mesh=mesh_of(8))
  hlo = engine.lower(batches(1)[0]).as_text(dialect="hlo")
  ops = collectives(hlo)
  big = {name: [s for s in sizes if s > 64] for name, sizes in ops.items()}  # not scalars
  volume = 2 * sum(ops["all-reduce"]) + sum(ops["reduce-scatter"]) + sum(ops["all-gather"])
  if stage == 0:
    assert big["all-reduce"] and not big["reduce-scatter"] and not big["all-gather"]
  elif stage in (1, 2):
    assert not big["all-reduce"] and big["reduce-scatter"] and big["all-gather"]
  else:
    # One gather of each layer in the forward pass and again in the
    # rematerialized backward pass, plus the non-layer leaves once.
    assert not big["all-reduce"]
    layer_gathers = [s for s in big["all-gather"] if s in (256 * 256, 256)]
    assert len(layer_gathers) == 2 * 2 * LAYERS
  want = 3 * psi if stage == 3 else 2 * psi
  assert abs(volume - want) <= 0.05 * want, (volume, want)


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
  params, data = init_params(), batches(5)
  data[2] = dict(data[2], y=data[2]["y"].at[0, 0].set(jnp.inf))  # inf loss -> inf grads
  engine = jzo.ZeroEngine(loss_fn, params, optax.adam(1e-2),
                          options=jzo.EngineOptions(stage=2, compute_dtype=jnp.float16,
                                                    loss_scale=jzo.LossScale(init_scale=2.0**10)),
                          mesh=mesh_of(8))
  history = []
  for b in data:
    before = engine.params
    m = engine.step(b)
    history.append((bool(m.skipped), float(m.loss_scale)))
    if bool(m.skipped):
      assert_close(engine.params, before, rtol=0, atol=0)  # master weights untouched
  assert [s for s, _ in history] == [False, False, True, False, False]
  assert [scale for _, scale in history] == [1024.0, 1024.0, 1024.0, 512.0, 512.0]
  assert int(engine.state.skipped) == 1 and int(engine.state.step) == 4


def test_loss_scale_grows_after_clean_steps():
  engine = jzo.ZeroEngine(loss_fn, init_params(), optax.adam(1e-3),
                          jzo.EngineOptions(stage=1, compute_dtype=jnp.float16,
                                            loss_scale=jzo.LossScale(init_scale=8.0,
                                                                     growth_interval=2)),
                          mesh=mesh_of(2))
  scales = [float(engine.step(b).loss_scale) for b in batches(5)]
  assert scales == [8.0, 8.0, 16.0, 16.0, 32.0]


def test_options_are_an_engine_options_object():
  """The options go in one object; a dict of them is refused naming the type."""
  with pytest.raises(TypeError, match="options must be a jzo.EngineOptions, got dict"):
    jzo.ZeroEngine(loss_fn, init_params(), optax.adam(1e-3), {"stage": 3})


def test_bad_input():
  params, tx, mesh = init_params(), optax.adam(1e-3), mesh_of(8)
  with pytest.raises(ValueError, match="stage must be"):
    jzo.ZeroEngine(loss_fn, params, tx, options=jzo.EngineOptions(stage=4))
  with pytest.raises(ValueError, match="no axis named 'data'"):
    jzo.ZeroEngine(loss_fn, params, tx, mesh=Mesh(np.array(jax.devices()), ("model",)))
  with pytest.raises(ValueError, match="grad_accum"):
    jzo.ZeroEngine(loss_fn, params, tx, options=jzo.EngineOptions(grad_accum=0))
  with pytest.raises(ValueError, match="max_grad_norm"):
    jzo.ZeroEngine(loss_fn, params, tx, options=jzo.EngineOptions(max_grad_norm=-1.0))
  with pytest.raises(ValueError, match="compute_dtype"):
    jzo.ZeroEngine(loss_fn, params, tx, options=jzo.EngineOptions(compute_dtype=jnp.int8))
  with pytest.raises(ValueError, match="only applies to stage 3"):
    jzo.ZeroEngine(loss_fn, params, tx, options=jzo.EngineOptions(stage=2, layers="blocks"))
  with pytest.raises(ValueError, match="no 'layer' in the params"):
    jzo.ZeroEngine(loss_fn, params, tx, options=jzo.EngineOptions(stage=3, layers="layer"))
  with pytest.raises(ValueError, match="does not mirror"):
    jzo.ZeroEngine(loss_fn, params, optax.adafactor(1e-3), options=jzo.EngineOptions(stage=2),
                   mesh=mesh)
  with pytest.raises(TypeError, match="not floating point"):
    jzo.ZeroEngine(loss_fn, {"w": jnp.ones(3, jnp.int32)}, tx)

  engine = jzo.ZeroEngine(loss_fn, params, tx, options=jzo.EngineOptions(stage=2, grad_accum=2),
                          mesh=mesh)
  with pytest.raises(ValueError, match="does not split into 8 devices x 2 micro-batches"):
    engine.step(batches(1, size=24)[0])
  with pytest.raises(ValueError, match="same leading"):
    engine.step({"x": jnp.ones((16, DIN)), "y": jnp.ones((8, DOUT))})

  def wrong_keys(params, batch):
    return jnp.mean(batch["x"] @ params["embedding"])
  with pytest.raises(ValueError, match="loss_fn failed.*embedding"):
    jzo.ZeroEngine(wrong_keys, params, tx, mesh=mesh).step(batches(1)[0])

  with pytest.raises(ValueError, match="scalar"):
    jzo.ZeroEngine(lambda p, b: b["x"] @ p["embed"], params, tx, mesh=mesh).step(batches(1)[0])
  for constant in (lambda p, b: jnp.int32(1), lambda p, b: "loss"):  # nothing to differentiate
    with pytest.raises(TypeError, match="floating-point scalar"):
      jzo.ZeroEngine(constant, params, tx, mesh=mesh).step(batches(1)[0])
  with pytest.raises(ValueError, match="loss_fn failed.*KeyError: 'y'"):
    jzo.ZeroEngine(loss_fn, params, tx, mesh=mesh).step({"x": batches(1)[0]["x"]})

  def no_gather(params, batch):  # make_loss without jzo.gather_layer
    h = batch["x"] @ params["embed"]
    h, _ = jax.lax.scan(lambda h, p: (jnp.tanh(h @ p["w"] + p["b"]) + h, None), h,
                        params["blocks"])
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2)
  with pytest.raises(ValueError, match="must call jzo.gather_layer"):
    jzo.ZeroEngine(no_gather, params, tx, options=jzo.EngineOptions(stage=3, layers="blocks"),
                   mesh=mesh).step(
        batches(1)[0])


@pytest.mark.parametrize("offload", [False, True])
def test_training_leaves_the_callers_arrays_alone(offload):
  """The engine's state is donated and updated in place each step: the
  caller's arrays, a leaf that is already flat among them, keep their values."""
  params = jax.tree.map(np.array, init_params())
  params["flat"] = np.linspace(-1, 1, 8, dtype=np.float32)  # flattens to itself
  before = jax.tree.map(np.copy, params)
  tx = jzo.cpu_adamw(1e-2) if offload else optax.adam(1e-2)
  engine = jzo.ZeroEngine(lambda p, b: loss_fn(p, b) + jnp.sum(p["flat"] ** 2), params, tx,
                          options=jzo.EngineOptions(stage=1, offload=offload), mesh=mesh_of(1))
  for b in batches(3):
    engine.step(b)
  jax.tree.map(np.testing.assert_array_equal, params, before)
  assert not np.array_equal(engine.params["flat"], before["flat"])


def test_shard_map_without_empty_maps_the_rest_and_returns_empty_arrays_of_their_shapes():
  """Empty arrays stay out of the map (jax 0.11.2's partitioner crashed on
  them): f sees them with their local shapes, they come out with their
  global shapes, and the rest is mapped as jax.shard_map maps it."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jzo.step import shard_map_without_empty
  mesh = mesh_of(8)
  seen = {}

  def f(x, empties):
    seen.update(shapes=[e.shape for e in empties])
    return x * 2 + jax.lax.axis_index("data"), [e + 1 for e in empties]
  x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))
  empties = [jnp.zeros((0,)), jnp.zeros((16, 0))]
  fn = jax.jit(shard_map_without_empty(f, mesh=mesh, in_specs=(P("data"), [P(), P("data")]),
                                       out_specs=(P("data"), [P(), P("data")])))
  y, out = fn(x, empties)
  np.testing.assert_array_equal(np.asarray(y), np.arange(16.0) * 2 + np.repeat(np.arange(8), 2))
  assert seen["shapes"] == [(0,), (2, 0)]  # local: 16 rows over 8 devices
  assert [o.shape for o in out] == [(0,), (16, 0)]
