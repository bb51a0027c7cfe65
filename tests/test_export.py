"""jzo.export: a run's checkpoint, loaded without jzo's engine (safetensors
with numpy; orbax and flax NNX), gives the engine's weights and logits."""

import dataclasses
import functools
import json
import pathlib
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx, traverse_util
from safetensors import safe_open
from safetensors.numpy import load_file

from jzo import train
from jzo import checkpoint
from jzo.recipe import export
from jzo.recipe import loop
from jzo.parallel.partition import LeafLayout
from jzo.models import gpt

# Two steps of the tiny GPT, a checkpoint after each.
RECIPE = ["--steps", "2", "--warmup", "0", "--checkpoint-every", "1", "--log-every", "1",
          "--eval-every", "2", "--eval-batches", "1", "--batch-size", "6", "--seq-len", "32",
          "--sample-tokens", "0"]
RUNS = {
    # The recipe's default on CPUs: masters on the host, saved in full shapes.
    "offload": ["--offload", "--devices", "2"],
    # Masters flat on the devices, the blocks' per layer, padded (3 divides
    # few leaves' sizes).
    "stage3": ["--no-offload", "--stage", "3", "--devices", "3"],
}


@dataclasses.dataclass(frozen=True)
class Run:
  folder: pathlib.Path  # the recipe's --out
  model: gpt.GPTConfig  # the model the recipe trained
  params: dict  # the engine's float32 params after the last step (numpy)


@pytest.fixture(scope="module", params=RUNS)
def run(request, tmp_path_factory) -> Run:
  folder = tmp_path_factory.mktemp(request.param)
  built = []
  build = loop.build_engine

  def keep(cfg, model, params, devices, micro):
    built.append((model.config, build(cfg, model, params, devices, micro)))
    return built[-1][1]
  with pytest.MonkeyPatch.context() as m:
    m.setattr(loop, "build_engine", keep)
    assert train.main(RECIPE + RUNS[request.param] + ["--out", str(folder)]) == 0
  (model, engine), = built
  return Run(folder, model, jax.tree.map(np.array, engine.params))


only_offload = pytest.mark.parametrize("run", ["offload"], indirect=True)


def tokens(model: gpt.GPTConfig) -> np.ndarray:
  return np.random.default_rng(0).integers(0, model.vocab_size, (2, model.seq_len), np.int32)


def assert_same(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def restore_nnx(config: gpt.GPTConfig, folder: pathlib.Path) -> gpt.GPT:
  """The module docstring's recipe: orbax and flax alone."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: gpt.GPT(config, rngs=nnx.Rngs(0))))
  with ocp.StandardCheckpointer() as checkpointer:
    nnx.replace_by_pure_dict(state, checkpointer.restore(folder))
  return nnx.merge(graphdef, state)


def test_export_gives_the_engines_weights_and_logits(run, tmp_path):
  done = export.export(run.folder, tmp_path / "out")
  assert done.step == 2
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == \
      ["config.json", "model.safetensors", "nnx_state"]
  config = gpt.GPTConfig(**json.loads(done.config.read_text()))
  assert config == run.model
  params = traverse_util.unflatten_dict(load_file(done.safetensors), sep=".")
  assert_same(params, run.params)  # float32 masters, bit for bit
  with safe_open(done.safetensors, "np") as f:
    assert json.loads(f.metadata()["config"]) == dataclasses.asdict(config)
    assert f.metadata()["step"] == "2"
  assert "blocks.qkv.kernel" in load_file(done.safetensors)

  x = tokens(config)
  forward = jax.jit(functools.partial(gpt.forward, run.model))
  want = np.asarray(forward(run.params, x))
  initial = forward(gpt.init_params(run.model, jax.random.PRNGKey(0)), x)
  assert np.abs(want - np.asarray(initial)).max() > 1e-3  # trained: the comparisons can fail
  np.testing.assert_allclose(jax.jit(functools.partial(gpt.forward, config))(params, x), want,
                             rtol=1e-6, atol=1e-6)
  model = restore_nnx(config, done.nnx_state)
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(model, x), want, rtol=1e-6, atol=1e-6)
  loaded_config, loaded_params = export.load_safetensors(done.safetensors)
  assert loaded_config == config
  assert_same(loaded_params, params)


@only_offload
def test_bfloat16_export(run, tmp_path):
  done = export.export(run.folder, tmp_path / "out", dtype="bfloat16")
  want = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), run.params)
  assert_same(traverse_util.unflatten_dict(load_file(done.safetensors), sep="."), want)
  model = restore_nnx(run.model, done.nnx_state)
  assert_same(nnx.to_pure_dict(nnx.state(model)), want)


@only_offload
def test_a_chosen_step(run, tmp_path):
  first = export.export(run.folder, tmp_path / "1", step=1)
  assert first.step == 1
  step_1 = load_file(first.safetensors)
  step_2 = load_file(export.export(run.folder, tmp_path / "2", step=2).safetensors)
  assert all(not np.array_equal(step_1[k], step_2[k]) for k in step_2)
  with pytest.raises(export.ExportError,
                     match=r"no checkpoint 5 in .*checkpoints \(complete ones: \[1, 2\]\)"):
    export.export(run.folder, tmp_path / "5", step=5)
  assert not (tmp_path / "5").exists()


@only_offload
def test_bad_run_or_output(run, tmp_path):
  def refused(message, run_dir, out, **options):
    with pytest.raises(export.ExportError, match=message):
      export.export(run_dir, out, **options)
  out = tmp_path / "out"
  refused(r"^no run folder .*/missing$", tmp_path / "missing", out)
  (tmp_path / "file").write_text("x")
  refused(r"^no run folder .*/file \(a file\)$", tmp_path / "file", out)
  (tmp_path / "empty").mkdir()
  refused(r"^no checkpoints folder .*/empty/checkpoints$", tmp_path / "empty", out)
  (tmp_path / "empty" / "checkpoints").mkdir()
  refused(r"^no checkpoint in .*/empty/checkpoints$", tmp_path / "empty", out)
  refused(r"^output .*/file is a file, not a folder$", run.folder, tmp_path / "file")
  refused(r"dtype must be one of float32, bfloat16, got 'fp8'", run.folder, out, dtype="fp8")
  out.mkdir()
  (out / "notes.txt").write_text("mine")
  refused(r"^output folder .*/out is not empty \(overwrite: --overwrite\)$", run.folder, out)
  assert [p.name for p in out.iterdir()] == ["notes.txt"]
  export.export(run.folder, out, overwrite=True)
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors",
                                                   "nnx_state"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "out"]  # no leftovers


@only_offload
def test_a_run_without_its_config(run, tmp_path):
  copy = tmp_path / "run"
  copy.mkdir()
  (copy / "checkpoints").symlink_to(run.folder / "checkpoints")
  with pytest.raises(export.ExportError, match=r"config.json is not the config of a jzo.train "
                                               r"run: FileNotFoundError"):
    export.export(copy, tmp_path / "out")
  (copy / "config.json").write_text(json.dumps({"model": "gpt5", "remat": "full"}))
  with pytest.raises(export.ExportError, match="KeyError: 'gpt5'"):
    export.export(copy, tmp_path / "out")
  # Another preset's shapes: the checkpoint does not fit.
  (copy / "config.json").write_text(json.dumps({"model": "gpt2-124m", "remat": "full"}))
  with pytest.raises(export.ExportError, match=r"checkpoint 2 in .* does not fit its run's "
                                               r"model: the checkpoint's \['blocks'\]"):
    export.export(copy, tmp_path / "out")


@only_offload
def test_a_damaged_checkpoint(run, tmp_path):
  copy = tmp_path / "run"
  shutil.copytree(run.folder, copy)
  for f in (copy / "checkpoints" / "2").rglob("*"):
    if f.is_file():
      f.write_bytes(b"corrupt")
  with pytest.raises(export.ExportError, match=r"^checkpoint 2 in .*/run/checkpoints is "
                                               r"unreadable: "):
    export.export(copy, tmp_path / "out")
  assert not (tmp_path / "out").exists()


def test_masters_in_shapes_undoes_the_engines_flattening():
  """Against partition's own flatten over 3 shards: whole leaves, per-layer
  leaves, leaves already in shape; and what does not fit."""
  rng = np.random.default_rng(0)
  full = {"w": rng.normal(size=(5, 7)), "layers": rng.normal(size=(2, 5)), "b": rng.normal(size=4)}
  saved = {"w": LeafLayout((5, 7), 3).flatten(full["w"]),  # (36,)
           "layers": LeafLayout((2, 5), 3, per_layer=True).flatten(full["layers"]),  # (2, 6)
           "b": full["b"]}
  assert saved["w"].shape == (36,) and saved["layers"].shape == (2, 6)
  assert_same(checkpoint.masters_in_shapes(saved, full), full)
  with pytest.raises(ValueError, match=r"\['w'\] is float64\[36\], which does not hold the "
                                       r"model's \[6, 7\]"):
    checkpoint.masters_in_shapes(saved, {**full, "w": np.zeros((6, 7))})
  with pytest.raises(ValueError, match=r"\['c'\] only in the checkpoint, \['b'\] only in the "
                                       r"model$"):
    checkpoint.masters_in_shapes({"w": saved["w"], "layers": saved["layers"], "c": full["b"]},
                                 full)


@only_offload
def test_a_failed_export_leaves_the_old_one(run, tmp_path, monkeypatch):
  out = tmp_path / "out"
  export.export(run.folder, out, step=1)
  before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
  write = export.write

  def dies_halfway(folder, *args):
    write(folder, *args)
    raise OSError("disk full")
  monkeypatch.setattr(export, "write", dies_halfway)
  with pytest.raises(OSError, match="disk full"):
    export.export(run.folder, out, overwrite=True)
  assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
  assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the staging folder is gone


@only_offload
@pytest.mark.parametrize("args, message", [
    (["--run", "/no/such/run"], "error: no run folder /no/such/run"),
    (["--step", "9"], "error: no checkpoint 9 in "),
    (["--out", "/dev/null"], "error: output /dev/null is a file, not a folder"),
])
def test_cli_errors_are_one_line(run, tmp_path, capsys, args, message):
  assert export.main(["--run", str(run.folder), "--out", str(tmp_path / "out")] + args) == 2
  err = capsys.readouterr().err
  assert err.startswith(message) and err.count("\n") == 1, err


@only_offload
def test_cli_exports(run, tmp_path, capsys):
  assert export.main(["--run", str(run.folder), "--out", str(tmp_path / "out"),
                      "--dtype", "bfloat16"]) == 0
  assert f"exported step 2 of {run.folder}" in capsys.readouterr().out
  assert load_file(tmp_path / "out" / "model.safetensors")["wte"].dtype == ml_dtypes.bfloat16


def test_the_real_entry_point(tmp_path):
  def cli(*args):
    return subprocess.run([sys.executable, "-m", "jzo.export", *args], capture_output=True,
                          text=True, timeout=120)
  done = cli("--help")
  assert done.returncode == 0, done.stderr
  for option in ("--out", "--run", "--step", "--dtype", "--overwrite"):
    assert option in done.stdout
  done = cli("--run", str(tmp_path / "missing"), "--out", str(tmp_path / "out"))
  assert done.returncode == 2
  assert done.stderr == f"error: no run folder {tmp_path / 'missing'}\n", done.stderr
