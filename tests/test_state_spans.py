"""jzo.checkpoint.spans, saved_leaf and handler: checkpoints written and
read a span at a time. Spans cut small here cross the shards' edges, the
device and host parts' and int8 blocks'; what is restored is the state as
it was, bit for bit, and saving or restoring holds no second copy of the
state on the host."""

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

import jzo
from jzo import checkpoint
from jzo.kernels import quant8
from jzo.checkpoint import engine_parts, handler, saved_leaf, spans, state_dict
from jzo.checkpoint.outline import outline
from jzo.parallel.partition import LeafLayout
from test_engine import batches, make_engine, mesh_of
from test_grads_in_params import loss_fn

LAYERS, HIDDEN = 3, 40  # a layer's row of w: 1,600 values, several int8 blocks of 256


def init_params(seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  return {"embed": jax.random.normal(k[0], (5, HIDDEN)) * 0.3,
          "blocks": {"w": jax.random.normal(k[1], (LAYERS, HIDDEN, HIDDEN)) * 0.1,
                     "b": jnp.zeros((LAYERS, HIDDEN))},
          "head": jax.random.normal(k[2], (HIDDEN, 3)) * 0.3}


SETUPS = {
    # stage 3 per layer: int8 moments on the host; half of each shard's state on the devices
    "int8-8": dict(devices=8, stage=3, layers="blocks", offload=True,
                   tx=lambda: jzo.cpu_adamw(1e-2, mu_dtype="int8", nu_dtype="int8")),
    "half-bf16-8": dict(devices=8, stage=3, layers="blocks", offload=0.5,
                        tx=lambda: jzo.cpu_adamw(1e-2, mu_dtype=jnp.bfloat16)),
    "host-fp32-1": dict(devices=1, stage=3, layers="blocks", offload=True,
                        tx=lambda: jzo.cpu_adamw(1e-2)),
    "flat-fp32-8": dict(devices=8, stage=2, offload=0.3, tx=lambda: jzo.cpu_adamw(1e-2)),
    "optax-8": dict(devices=8, stage=3, layers="blocks", offload=False,
                    tx=lambda: optax.adamw(1e-2)),
    "weights-on-host-1": dict(devices=1, stage=3, layers="blocks", offload=True,
                              offload_params=True,
                              tx=lambda: jzo.cpu_adamw(1e-2, mu_dtype=jnp.bfloat16)),
}


def make(setup, seed=0):
  options = dict(SETUPS[setup])
  devices, tx = options.pop("devices"), options.pop("tx")()
  return make_engine(loss_fn, init_params(seed), tx, max_grad_norm=1.0, mesh=mesh_of(devices),
                     **options)


def assert_same(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.fixture
def small_spans(monkeypatch):
  """Spans of 1 KiB: 256 float32 values, so that every leaf has several."""
  monkeypatch.setattr(spans, "SPAN_BYTES", 1024)


def test_rectangles_cover_each_row_in_order():
  layout = LeafLayout((3, 40, 40), shards=8, per_layer=True)
  rects = spans.rectangles(layout, 4)
  for row in range(3):
    mine = [(x0, x1) for _, r, x0, x1 in rects if r == row]
    assert mine[0][0] == 0 and mine[-1][1] == 1600
    assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
  index, row, x0, x1 = rects[1]
  assert spans.span_shape(layout, index) == (1, (x1 - x0) // 40, 40)


@pytest.fixture
def whole_reads(monkeypatch):
  """The saved leaves read whole (SavedLeaf.held), counted."""
  count = {"n": 0}
  real = saved_leaf.SavedLeaf.held

  def held(self):
    count["n"] += 1
    return real(self)
  monkeypatch.setattr(saved_leaf.SavedLeaf, "held", held)
  return count


@pytest.mark.parametrize("signed", [True, False], ids=["mu", "nu"])
def test_quantizing_in_parts_over_threads_gives_the_same_moment(monkeypatch, signed):
  monkeypatch.setattr(saved_leaf, "QUANTIZE_PART", 2 * quant8.QUANT_BLOCK)
  values = np.random.default_rng(0).standard_normal(9 * quant8.QUANT_BLOCK + 100,
                                                    np.float32) * 1e-3
  values = np.abs(values) if not signed else values
  values[5 * quant8.QUANT_BLOCK + 7] = np.nan  # a block of its own: scale NaN
  got, want = saved_leaf.quantize_in_parts(values, signed), quant8.quantize(values, signed=signed)
  np.testing.assert_array_equal(got.codes, want.codes)
  np.testing.assert_array_equal(got.scales, want.scales)


@pytest.mark.parametrize("setup", SETUPS)
def test_a_checkpoint_in_spans_restores_the_state_exactly(tmp_path, small_spans, whole_reads,
                                                          setup):
  """Each span written is a chunk, and is read back as one: no leaf is read whole."""
  trained = make(setup)
  steps = batches(4)
  for b in steps[:3]:
    trained.step(b)
  want = jax.tree.map(np.array, trained.state_dict())
  with checkpoint.open_manager(tmp_path) as manager:
    checkpoint.save(manager, trained, 3)
  fresh = make(setup, seed=1)
  with pytest.raises(AssertionError):  # so that the comparison below can fail
    assert_same(fresh.state_dict(), want)
  with checkpoint.open_manager(tmp_path) as manager:
    assert checkpoint.restore(manager, fresh) == 3
  assert whole_reads["n"] == 0
  assert_same(fresh.state_dict(), want)
  got, expected = fresh.step(steps[3]), trained.step(steps[3])
  assert float(got.loss) == float(expected.loss)
  assert_same(fresh.state_dict(), trained.state_dict())
  trained.close()
  fresh.close()


@pytest.mark.parametrize("saver, loader", [("int8-8", "host-fp32-1"),
                                           ("flat-fp32-8", "optax-8"),
                                           ("half-bf16-8", "weights-on-host-1")])
def test_spans_load_into_another_placement(tmp_path, small_spans, saver, loader):
  """The masters move to another device count, stage and placement exactly."""
  trained = make(saver)
  for b in batches(2):
    trained.step(b)
  with checkpoint.open_manager(tmp_path) as manager:
    checkpoint.save(manager, trained, 2)
  other = make(loader, seed=1)
  with checkpoint.open_manager(tmp_path) as manager:
    checkpoint.restore(manager, other)
  assert_same(other.params, trained.params)
  trained.close()
  other.close()


def test_a_span_that_does_not_read_leaves_a_whole_engine(tmp_path, small_spans, monkeypatch):
  """A read that fails part-way through the state: the error says the engine
  changed, and the engine is whole (it loads the earlier checkpoint)."""
  engine = make("half-bf16-8")
  steps = batches(2)
  with checkpoint.open_manager(tmp_path) as manager:
    engine.step(steps[0])
    checkpoint.save(manager, engine, 1)
    want = jax.tree.map(np.array, engine.state_dict())
    engine.step(steps[1])
    checkpoint.save(manager, engine, 2)
  reads = {"n": 0}
  real = saved_leaf.SavedLeaf.fetch

  def failing(self, *args):  # checkpoint 2's fifth span, and every one after it
    if f"{tmp_path}/2/" in json.dumps(self.store.spec().to_json()):
      reads["n"] += 1
      if reads["n"] >= 5:
        raise OSError("disk went away")
    return real(self, *args)
  monkeypatch.setattr(saved_leaf.SavedLeaf, "fetch", failing)
  with checkpoint.open_manager(tmp_path) as manager:
    with pytest.raises(checkpoint.UnreadableCheckpointError, match="disk went away") as e:
      checkpoint.restore(manager, engine, 2)
    assert e.value.engine_changed
    step, passed = checkpoint.restore_readable(manager, engine)  # 2 fails again
  assert step == 1 and [p.step for p in passed] == [2]
  assert_same(engine.state_dict(), want)
  engine.close()


SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    import jax, jax.numpy as jnp, psutil
    import jzo
    from jzo import checkpoint
    from jzo.kernels import quant8
    from jzo.checkpoint import spans

    spans.SPAN_BYTES = 2**20  # at most 8 MiB in flight

    def loss(p, b):
      return jnp.mean((b @ p["w"]).astype(jnp.float32) ** 2)

    def peak_rss(fn):
      \"\"\"(RSS before fn, the largest RSS seen while it ran), sampled every ms.\"\"\"
      process, seen, done = psutil.Process(), [], threading.Event()
      def sample():
        while not done.is_set():
          seen.append(process.memory_info().rss)
          time.sleep(0.001)
      before = process.memory_info().rss
      watcher = threading.Thread(target=sample)
      watcher.start()
      try:
        fn()
      finally:
        done.set()
        watcher.join()
      return before, max(seen + [process.memory_info().rss])

    params = {"w": jnp.zeros((4096, 8192), jnp.float32)}  # 32M parameters
    engine = jzo.ZeroEngine(loss, params, jzo.cpu_adamw(1e-3),
                            jzo.EngineOptions(offload=True, stage=2))
    engine.step(jnp.ones((8, 4096)))
    with checkpoint.open_manager(sys.argv[1]) as manager:
      checkpoint.save(manager, engine, 1)  # compiles what a save and a restore run
      checkpoint.restore(manager, engine)
      save = peak_rss(lambda: checkpoint.save(manager, engine, 2))
      restore = peak_rss(lambda: checkpoint.restore(manager, engine))
    print(json.dumps({"state": 12 * 4096 * 8192, "save": save, "restore": restore}))
""")


def spans_of(shards: spans.StreamedShards) -> list:
  """What StreamedShards gives a checkpoint's write: (index, values) pairs."""
  async def collect():
    async def nothing(nbytes):
      pass
    return [span async for span in shards.spans(nothing)]
  return asyncio.run(collect())


@pytest.mark.parametrize("setup", ["half-bf16-8", "int8-8"])
def test_each_process_writes_the_chunks_of_its_own_shards(small_spans, setup):
  """Several processes' format (flat, padded): StreamedShards gives one
  process's chunks of the live state, its shards' columns of every row
  (device and host parts alike; int8 codes), and nothing of the others'."""
  engine = make(setup)
  engine.step(batches(1)[0])
  for name, (pieces, dtype) in state_dict.saved_pieces(engine.trained).items():
    if isinstance(pieces[0], spans.HeldPieces):  # int8 scales: global arrays
      continue
    for p in pieces:
      layout = p.layout
      k, rows = layout.shard_size, layout.shape[0] if layout.per_layer else 1
      whole = np.stack([p.read(row, 0, layout.shards * k, dtype) for row in range(rows)])
      whole = whole.reshape(layout.flat_shape)
      for positions in (range(0, 3), range(3, 8)):
        # What that process holds: its devices' shards and its host parts.
        held = lambda x: x[positions.start:positions.stop]
        host = (None if p.host is None else quant8.Int8Moment(held(p.host.codes),
                held(p.host.scales)) if isinstance(p.host, quant8.Int8Moment) else held(p.host))
        shards = spans.StreamedShards(dataclasses.replace(p, host=host), np.dtype(dtype),
                                      positions)
        got, written = np.zeros(layout.flat_shape, dtype), np.zeros(layout.flat_shape, int)
        for index, values in spans_of(shards):
          assert values.shape == shards.chunk_shape and values.nbytes <= spans.SPAN_BYTES
          got[index] = values
          written[index] += 1
        mine = np.zeros(layout.flat_shape, int)
        mine[..., positions.start * k:positions.stop * k] = 1
        np.testing.assert_array_equal(written, mine, err_msg=f"{name} {layout}")
        np.testing.assert_array_equal(got[mine == 1], whole[mine == 1])
  engine.close()


def test_a_shards_chunks_divide_its_rows_and_are_written_a_few_at_a_time(monkeypatch):
  """A chunk is the largest part of a shard's row that divides it and fits
  SPAN_BYTES, or the whole row where only small parts would divide it;
  chunks larger than SPAN_BYTES hold more of the writes in flight, and two
  leaves written at once both finish."""
  monkeypatch.setattr(spans, "SPAN_BYTES", 1024)  # 256 float32 values
  def chunk(k, shards=2):
    layout = LeafLayout((3, shards * k), shards=shards, per_layer=True, device_size=0)
    host = np.arange(np.prod(layout.host_shape), dtype=np.float32).reshape(layout.host_shape)
    return spans.StreamedShards(spans.Pieces(layout, None, host), np.dtype(np.float32),
                                range(shards))
  assert chunk(1000).chunk_shape == (1, 250)  # 1000 = 4 x 250
  assert chunk(257).chunk_shape == (1, 257)  # a prime: the whole row
  assert chunk(3 * 521).chunk_shape == (1, 3 * 521)  # 3 x 521: too small a part
  span_handler = handler.SpanHandler()

  async def write(value):
    spec = {"driver": "zarr", "kvstore": {"driver": "memory"}, "dtype": "float32",
            "metadata": {"shape": list(value.shape), "chunks": list(value.chunk_shape)}}
    store = await ts.open(spec, create=True)
    await span_handler.write_spans(store, value)
    return await store.read()

  async def both(values):
    return await asyncio.wait_for(asyncio.gather(*(write(v) for v in values)), timeout=60)
  values = [chunk(4 * 257), chunk(4 * 257)]  # each chunk 5 of the 8 permits
  for value, got in zip(values, asyncio.run(both(values))):
    host = value.pieces.host
    np.testing.assert_array_equal(got, host.transpose(1, 0, 2).reshape(value.shape))


def test_a_process_reads_only_the_spans_of_its_own_shards(small_spans):
  """load_leaf over some of the shards (one process of several) fetches the
  spans that overlap their columns, and fills their host parts."""
  layout = LeafLayout((LAYERS, HIDDEN, HIDDEN), shards=8, per_layer=True, device_size=0)
  values = np.arange(LAYERS * HIDDEN * HIDDEN, dtype=np.float32).reshape(layout.shape)
  fetched = []

  class Counting(saved_leaf.HeldLeaf):
    def fetch(self, layout, index, x0, x1):
      fetched.append((x0, x1))
      return super().fetch(layout, index, x0, x1)
  positions, k = range(2, 5), layout.shard_size
  host = np.zeros((len(positions), LAYERS, k), np.float32)
  saved_leaf.load_leaf(Counting(values), [saved_leaf.Target(layout, [], [], 0, host=host)],
                       positions)
  flat = values.reshape(LAYERS, -1)
  for j, d in enumerate(positions):
    np.testing.assert_array_equal(host[j], flat[:, d * k:(d + 1) * k])
  assert all(x0 < positions.stop * k and positions.start * k < x1 for x0, x1 in fetched)
  assert len(fetched) < len(spans.rectangles(layout, 4))


def test_saving_and_restoring_hold_no_copy_of_the_state(tmp_path):
  """RSS of a fresh process, sampled while it saves and restores a
  checkpoint of 384 MiB of host state in spans of 1 MiB: it rises by under
  a quarter of the state (orbax's B-tree cache takes up to 100 MB; a copy
  of the state, as orbax's numpy path makes, would add all of it)."""
  # XLA at its default level: the copies of 384 MiB run 3x slower at -O0.
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="0")
  env.pop("XLA_FLAGS", None)
  done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  rss = json.loads(done.stdout.strip().splitlines()[-1])
  for before, peak in (rss["save"], rss["restore"]):
    assert peak - before < rss["state"] / 4, rss


def test_a_checkpoint_chunked_by_orbax_loads_a_leaf_at_a_time(tmp_path, small_spans,
                                                             whole_reads):
  """A checkpoint of numpy arrays (as jzo wrote them before spans,
  in orbax's chunks, which a span would decode again and again) is read a
  leaf at a time, into the same state."""
  trained = make("half-bf16-8")
  for b in batches(2):
    trained.step(b)
  want = jax.tree.map(np.array, trained.state_dict())
  with checkpoint.open_manager(tmp_path) as manager:
    assert manager.save(2, args=ocp.args.PyTreeSave(want))
    manager.wait_until_finished()
  fresh = make("half-bf16-8", seed=1)
  with checkpoint.open_manager(tmp_path) as manager:
    assert checkpoint.restore(manager, fresh) == 2
  # Orbax chunked each small leaf whole: the stacked layers' two leaves (a
  # chunk across layers) are read whole, each of master, mu and nu.
  assert whole_reads["n"] == 2 * 3
  assert_same(fresh.state_dict(), want)
  trained.close()
  fresh.close()


def moment_values(engine, name):
  """Moment `name` of an offloading engine in the params' full shapes,
  float32 (int8 moments dequantized), read from where it lives."""
  pieces, _ = engine_parts.adam_pieces(engine.trained)[name]
  return [spans.read_whole(p, np.float32) for p in pieces]


def requantized(values, layout, signed):
  """Full-shape values as an int8 engine of `layout` keeps them: each
  shard's part of each row quantized in its own blocks, then dequantized."""
  flat = np.asarray(layout.flatten(jnp.asarray(values)))
  _, host = layout.split(flat)
  back = quant8.dequantize(quant8.quantize(host, signed=signed), signed=signed)
  return np.asarray(layout.unflatten(layout.join(np.zeros(layout.part_shape(0)), back)))


def test_int8_moments_are_saved_as_codes_and_scales(tmp_path, small_spans, monkeypatch):
  """An int8 engine's checkpoint keeps its moments as codes (uint8, full
  shapes) and scales, not float32 (half the bytes of the whole state); they
  load exactly into the same placement (above), as their values into float
  moments, requantized into another int8 placement's blocks, and a
  checkpoint of the float32 format of before loads into int8 engines."""
  # Values made from codes and quantized in parts of 512 over the threads:
  # across the shards' parts (200 values of a layer's row of w, 5 of b)
  monkeypatch.setattr(saved_leaf, "QUANTIZE_PART", 2 * quant8.QUANT_BLOCK)
  saver = make("int8-8")
  for b in batches(2):
    saver.step(b)
  n = sum(x.size for x in jax.tree.leaves(saver.params))
  blocks = sum(8 * (3 if l.per_layer else 1) * quant8.blocks(l.shard_size)
               for l in saver.plan.leaves)
  scalars = 4 * 4 + 2 * 8  # loss scale, good steps, step, skipped; steps run, count
  assert checkpoint.saved_bytes(saver) == 4 * n + 2 * (n + 4 * blocks) + scalars
  values = {name: moment_values(saver, name) for name in ("mu", "nu")}
  with checkpoint.open_manager(tmp_path) as manager:
    checkpoint.save(manager, saver, 2)
    saved = outline(manager.item_metadata(2).tree)
  assert "mu" not in saved and saved["mu_codes"]["blocks"]["w"] == "uint8[3, 40, 40]"
  assert saved["nu_scales"]["blocks"]["w"] == "float32[8, 3, 1]"  # 8 shards' 200 of 1,600
  # The same placement takes the codes and scales as they are: nothing is quantized.
  same = make("int8-8", seed=1)
  with monkeypatch.context() as m, checkpoint.open_manager(tmp_path) as manager:
    m.setattr(quant8, "quantize", lambda *a, **k: pytest.fail("quantized again"))
    checkpoint.restore(manager, same)
  assert_same(same.state_dict(), saver.state_dict())
  float_moments = make("host-fp32-1", seed=1)
  other_int8 = jzo.ZeroEngine(loss_fn, init_params(1),
                              jzo.cpu_adamw(1e-2, mu_dtype="int8",
                                                                      nu_dtype="int8"),
                              options=jzo.EngineOptions(stage=2, offload=True, max_grad_norm=1.0),
                              mesh=mesh_of(2))
  on_devices = make("optax-8", seed=1)  # optax.adamw's float32 moments on 8 devices
  for engine in (float_moments, other_int8, on_devices):
    with checkpoint.open_manager(tmp_path) as manager:
      checkpoint.restore(manager, engine)
  for name in ("mu", "nu"):
    for got, want in zip(moment_values(float_moments, name), values[name]):
      np.testing.assert_array_equal(got, want)
    for got, want in zip(jax.tree.leaves(on_devices.state_dict()[name]), values[name]):
      np.testing.assert_array_equal(got, want)
    layouts = other_int8.plan.leaves
    for got, want, layout in zip(moment_values(other_int8, name), values[name], layouts):
      np.testing.assert_array_equal(got, requantized(want, layout, signed=name == "mu"))
  # The same weights (1 device at stage 3 against 2 at stage 2: float rounding)
  np.testing.assert_allclose(float(other_int8.step(batches(3)[2]).loss),
                             float(float_moments.step(batches(3)[2]).loss), rtol=1e-6)

  # The format of before: float32 moments in full shapes.
  before = {k: v for k, v in saver.state_dict().items() if "_codes" not in k and "_scales" not in k}
  structure = jax.tree.structure(saver.params)
  before.update({name: jax.tree.unflatten(structure, values[name]) for name in ("mu", "nu")})
  fresh = make("int8-8", seed=1)
  fresh.load_state_dict(before)
  assert_same(fresh.state_dict(), saver.state_dict())

  # Several processes read it too, each its own shards' part of every entry
  # (what a real pair runs: tests/test_multiprocess.py): from the checkpoint
  # a span at a time, or from their format's global arrays (a state dict).
  # The same blocks take codes and scales as they are, others the values.
  with monkeypatch.context() as m:
    m.setattr(engine_parts, "several_processes", lambda: True)
    flat = saver.state_dict()  # several processes' format: flat codes, global arrays
    assert flat["mu_codes"]["blocks"]["w"].shape == (LAYERS, HIDDEN * HIDDEN)
    for way in ("checkpoint", "state dict"):
      # (Their format keeps a row per layer: it loads where the rows are the same.)
      several = {"same": make("int8-8", seed=1), "float": make("host-fp32-1", seed=1),
                 "other": jzo.ZeroEngine(loss_fn, init_params(1),
                                         jzo.cpu_adamw(
                     1e-2, mu_dtype="int8", nu_dtype="int8"),
                                         options=jzo.EngineOptions(stage=3, layers="blocks",
                                                                   offload=True, max_grad_norm=1.0),
                                         mesh=mesh_of(2))}
      for key, engine in several.items():
        with monkeypatch.context() as q, checkpoint.open_manager(tmp_path) as manager:
          if key == "same":
            q.setattr(quant8, "quantize", lambda *a, **k: pytest.fail("quantized again"))
          if way == "checkpoint":
            checkpoint.restore(manager, engine)
          else:
            engine.load_state_dict(flat)
      m.setattr(engine_parts, "several_processes", lambda: False)  # to read them back
      assert_same(several["same"].state_dict(), saver.state_dict())
      for name in ("mu", "nu"):
        for got, want in zip(moment_values(several["float"], name), values[name]):
          np.testing.assert_array_equal(got, want, err_msg=way)
        for got, want, layout in zip(moment_values(several["other"], name), values[name],
                                     several["other"].plan.leaves):
          np.testing.assert_array_equal(got, requantized(want, layout, signed=name == "mu"),
                                        err_msg=way)
      m.setattr(engine_parts, "several_processes", lambda: True)
      for engine in several.values():
        engine.close()

  # Scales that do not fit their codes are refused before anything is written.
  wrong = saver.state_dict()
  wrong["mu_scales"]["head"] = np.zeros((4, 2), np.float32)  # 4 shards of 30: 1 block
  with pytest.raises(ValueError, match=r"int8 moment scales \[4, 2\] do not fit codes \[40, 3\]"):
    fresh.load_state_dict(wrong)
  assert_same(fresh.state_dict(), saver.state_dict())
  for engine in (saver, same, float_moments, other_int8, on_devices, fresh):
    engine.close()
