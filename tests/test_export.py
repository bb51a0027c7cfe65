"""jzo.export: a run's checkpoint, loaded without jzo's engine, gives the
engine's weights and logits: by default a Hugging Face folder (a GPT as
GPT-2, a Llama as itself) that transformers loads with its tokenizer;
--format jzo as safetensors with numpy, orbax and flax NNX."""

import dataclasses
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tokenizers
import torch
import transformers
from flax import nnx, traverse_util
from safetensors import safe_open
from safetensors.numpy import load_file

from jzo import train
from jzo import checkpoint
from jzo.recipe import export
from jzo.recipe import loop
from jzo.recipe import tokens as tokens_lib
from jzo.parallel.partition import LeafLayout
from jzo.models import gpt, gpt2_hf, hf, llama

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
  engine: object  # the run's ZeroEngine, closed (its state stays readable)


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
  return Run(folder, model, jax.tree.map(np.array, engine.params), engine)


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
  done = export.export(run.folder, tmp_path / "out", format="jzo")
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
  done = export.export(run.folder, tmp_path / "out", dtype="bfloat16", format="jzo")
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
  assert sorted(p.name for p in out.iterdir()) == HF_FILES
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


def test_masters_read_when_indexed_equal_the_masters_read_whole(run):
  """read_masters(lazy=True): each leaf indexed as the export cuts tensors
  (a layer, rows, columns of every row, an ellipsis, a stride) and read
  whole gives what the whole read gives, and masters_in_shapes takes it."""
  step, whole = checkpoint.read_masters(run.folder / "checkpoints")
  lazy_step, lazy = checkpoint.read_masters(run.folder / "checkpoints", lazy=True)
  assert lazy_step == step and jax.tree.structure(lazy) == jax.tree.structure(whole)
  for view, values in zip(jax.tree.leaves(lazy), jax.tree.leaves(whole)):
    assert view.shape == values.shape and view.dtype == values.dtype
    last = values.shape[0] - 1
    columns = [(slice(None), slice(0, 2))] if values.ndim > 1 else []
    for index in [last, (last,), slice(1, None), (Ellipsis, 0), slice(None, None, 2), (),
                  *columns]:
      np.testing.assert_array_equal(view[index], values[index], err_msg=str(index))
    np.testing.assert_array_equal(np.asarray(view), values)
  shapes = jax.tree.map(lambda x: np.zeros(x.shape), whole)
  assert_same(checkpoint.masters_in_shapes(lazy, shapes), whole)


def test_the_live_masters_read_when_indexed_equal_the_params(run):
  """jzo.checkpoint.live_masters: the engine's masters in full shapes, read
  from its live state (the host's parts, or the devices' flat and padded
  ones with a row per layer) a row at a time where indexed."""
  views = checkpoint.live_masters(run.engine)
  for view, want in zip(jax.tree.leaves(views), jax.tree.leaves(run.params)):
    assert view.shape == want.shape and view.dtype == np.float32
    assert_same(np.asarray(view), want)
    assert_same(view[want.shape[0] - 1], want[-1])
    cut = (slice(1, None),) + ((Ellipsis, slice(0, 2)) if want.ndim > 1 else ())
    assert_same(view[cut], want[cut])


def test_an_engines_export_equals_its_last_checkpoints(run, tmp_path):
  """export_engine writes, from the engine, what `export` writes in
  bfloat16 from the checkpoint of the same step; an output in the way is refused."""
  done = export.export_engine(run.engine, run.folder, tmp_path / "live", 2, run.model)
  assert done.step == 2
  assert_same_files(tmp_path / "live",
                    export.export(run.folder, tmp_path / "saved", dtype="bfloat16").config.parent)
  with pytest.raises(export.ExportError, match=r"output folder .*/live is not empty$"):
    export.export_engine(run.engine, run.folder, tmp_path / "live", 2, run.model)


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
  export.export(run.folder, out, step=1, format="jzo")
  before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
  write = export.write

  def dies_halfway(folder, *args):
    write(folder, *args)
    raise OSError("disk full")
  monkeypatch.setattr(export, "write", dies_halfway)
  with pytest.raises(OSError, match="disk full"):
    export.export(run.folder, out, overwrite=True, format="jzo")
  assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
  assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the staging folder is gone


@pytest.mark.parametrize("given, message", [
    ("file", "--export {} is a file: give a new or empty folder"),
    ("folder", "--export {} is not empty: give a new or empty folder")])
def test_an_export_folder_in_the_way_is_refused_before_training(tmp_path, capsys, given, message):
  out = tmp_path / "out"
  out.mkdir()
  (out / "weights.bin").write_bytes(b"kept")
  target = out / "weights.bin" if given == "file" else out
  assert train.main(RECIPE + ["--out", str(tmp_path / "run"), "--export", str(target)]) == 2
  assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message.format(target))
  assert not (tmp_path / "run").exists() and (out / "weights.bin").read_bytes() == b"kept"


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
@pytest.mark.parametrize("args, wte", [([], "transformer.wte.weight"),
                                       (["--format", "hf"], "transformer.wte.weight"),
                                       (["--format", "jzo"], "wte")])
def test_cli_exports(run, tmp_path, capsys, args, wte):
  assert export.main(["--run", str(run.folder), "--out", str(tmp_path / "out"),
                      "--dtype", "bfloat16", *args]) == 0
  out, err = capsys.readouterr()
  assert f"exported step 2 of {run.folder}" in out and err == ""
  assert (str(tmp_path / "out" / "tokenizer.json") in out) == (wte != "wte")
  assert load_file(tmp_path / "out" / "model.safetensors")[wte].dtype == ml_dtypes.bfloat16


def test_the_real_entry_point(tmp_path):
  def cli(*args):
    return subprocess.run([sys.executable, "-m", "jzo.export", *args], capture_output=True,
                          text=True, timeout=120)
  done = cli("--help")
  assert done.returncode == 0, done.stderr
  for option in ("--out", "--run", "--step", "--dtype", "--overwrite", "--format {hf,jzo}"):
    assert option in done.stdout
  assert "(default: hf)" in done.stdout
  done = cli("--run", str(tmp_path / "missing"), "--out", str(tmp_path / "out"))
  assert done.returncode == 2
  assert done.stderr == f"error: no run folder {tmp_path / 'missing'}\n", done.stderr


HF_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def _from_pretrained(folder: pathlib.Path, model_class=transformers.AutoModelForCausalLM):
  """transformers' float32 model of an export; asserts no key was missing,
  unexpected or of another shape."""
  model, info = model_class.from_pretrained(str(folder), output_loading_info=True,
                                            attn_implementation="eager",
                                            torch_dtype=torch.float32)
  assert {k: v for k, v in info.items() if v} == {}, info
  return model.eval()


def _torch_logits(model, x: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(x, dtype=torch.long)).logits.numpy()


def test_default_export_is_a_gpt2_that_transformers_loads(run, tmp_path):
  done = export.export(run.folder, tmp_path / "out")
  out = tmp_path / "out"
  assert sorted(p.name for p in out.iterdir()) == HF_FILES
  assert done == export.Exported(2, out / "model.safetensors", None, out / "config.json",
                                 out / "tokenizer.json")
  model = _from_pretrained(out)
  assert type(model) is transformers.GPT2LMHeadModel
  x = tokens(run.model)
  with jax.default_matmul_precision("highest"):
    want = np.asarray(gpt.forward(run.model, run.params, x))
  np.testing.assert_allclose(_torch_logits(model, x), want, rtol=0, atol=1e-5)
  # Back into jzo: the float32 masters bit for bit.
  config = gpt2_hf.read_config(str(out), remat=run.model.remat)
  assert config == run.model
  assert_same(gpt2_hf.load_params(str(out)), run.params)
  # The run trained on bytes: its tokenizer's ids are the bytes, in jzo and in transformers.
  text = "caf\u00e9 \u2615, ok ."
  assert tokens_lib.load_tokenizer(out).encode(text) == list(text.encode())
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
  assert tokenizer(text)["input_ids"] == list(text.encode())
  assert json.loads(done.config.read_text())["eos_token_id"] is None


@only_offload
def test_bfloat16_hf_export(run, tmp_path):
  done = export.export(run.folder, tmp_path / "out", dtype="bfloat16")
  assert json.loads(done.config.read_text())["torch_dtype"] == "bfloat16"
  want = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), run.params)
  assert_same(gpt2_hf.load_params(str(tmp_path / "out"), ml_dtypes.bfloat16), want)


def _copy_run(run: Run, folder: pathlib.Path, **options) -> pathlib.Path:
  """The run's folder with its checkpoints linked and config.json's options changed."""
  folder.mkdir()
  (folder / "checkpoints").symlink_to(run.folder / "checkpoints")
  saved = json.loads((run.folder / "config.json").read_text())
  (folder / "config.json").write_text(json.dumps(saved | options))
  (folder / "model").mkdir()
  return folder


@only_offload
def test_a_run_on_token_ids_exports_without_a_tokenizer(run, tmp_path, capsys):
  copy = _copy_run(run, tmp_path / "run", data="tokens.bin")
  out = tmp_path / "out"
  assert export.main(["--run", str(copy), "--out", str(out)]) == 0
  assert capsys.readouterr().err == (
      f"warning: the run knows no tokenizer of its token ids (--data *.bin), so {out} has none: "
      "copy that tokenizer's files into it to read and write text\n")
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
  assert export.export(copy, out, overwrite=True).tokenizer is None
  assert _from_pretrained(out).config.eos_token_id is None


@only_offload
def test_a_run_with_a_tokenizer_exports_its_files(run, tmp_path):
  """A --tokenizer run: its tokenizer's files as the run kept them, and its
  bos and eos in config.json."""
  words = ["<s>", "</s>", *"abcdefgh"]
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(words)}, unk_token="a"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  copy = _copy_run(run, tmp_path / "run", tokenizer="/where/it/was")
  kept = copy / "model"
  backend.save(str(kept / "tokenizer.json"))
  (kept / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
  done = export.export(copy, tmp_path / "out")
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert (tmp_path / "out" / name).read_bytes() == (kept / name).read_bytes()
  config = json.loads(done.config.read_text())
  assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  assert tokenizer("b c")["input_ids"] == [3, 4] and tokenizer.eos_token_id == 1
  assert _from_pretrained(tmp_path / "out").config.eos_token_id == 1


def assert_same_files(got: pathlib.Path, want: pathlib.Path) -> None:
  """Two Hugging Face folders hold the same files, the same tensors bit for bit."""
  assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
  for path in want.iterdir():
    if path.suffix == ".safetensors":
      a, b = load_file(got / path.name), load_file(path)
      assert a.keys() == b.keys()
      for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    else:
      assert (got / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_llama_run_exports_to_hugging_face_by_default(tmp_path):
  """A Llama preset trained on bytes: its own format with no --format, the
  byte-level tokenizer, and --format jzo refused. The run's --export (its
  live weights at the end) equals the export of its last checkpoint."""
  folder = tmp_path / "run"
  one_step = [a if a != "2" else "1" for a in RECIPE[:2]] + RECIPE[2:]
  assert train.main(one_step + ["--model", "llama-tiny", "--offload", "--devices", "2",
                                "--out", str(folder), "--export", str(tmp_path / "live")]) == 0
  assert_same_files(tmp_path / "live",
                    export.export(folder, tmp_path / "bf16", dtype="bfloat16").config.parent)
  done = export.export(folder, tmp_path / "out")
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == HF_FILES
  model = _from_pretrained(tmp_path / "out")
  assert type(model) is transformers.LlamaForCausalLM
  step, config, params = export.read_run(folder, None, folder / "model" / "config.json")
  assert step == done.step == 1
  x = np.random.default_rng(0).integers(0, 256, (2, 32))
  with jax.default_matmul_precision("highest"):
    want = np.asarray(llama.forward(config, params, x))
  np.testing.assert_allclose(_torch_logits(model, x), want, rtol=0, atol=1e-4)
  assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))("\u00e9")[
      "input_ids"] == [0xC3, 0xA9]
  with pytest.raises(export.ExportError, match="trained a llama model: jzo's own form is a GPT's; "
                                               "--format hf"):
    export.export(folder, tmp_path / "jzo", format="jzo")


def test_the_command_line_as_users_call_it(tmp_path):
  """`python -m jzo.train` then `python -m jzo.export` with no --format in
  subprocesses; transformers' pipeline writes text with the export."""
  two_cpus = {**os.environ, "JAX_PLATFORMS": "cpu",
              "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  trained = subprocess.run([sys.executable, "-m", "jzo.train", *RECIPE, *RUNS["offload"],
                            "--out", str(tmp_path / "run"), "--export", str(tmp_path / "live")],
                           capture_output=True, text=True, timeout=600, env=two_cpus)
  assert trained.returncode == 0, trained.stderr[-2000:]
  assert f"weights: {tmp_path / 'live'} (Hugging Face, bfloat16, step 2)" in trained.stdout
  # --export wrote, from the live state, what the export of the last checkpoint writes.
  assert_same_files(tmp_path / "live",
                    export.export(tmp_path / "run", tmp_path / "bf16", dtype="bfloat16").config.parent)
  exported = subprocess.run([sys.executable, "-m", "jzo.export", "--run", str(tmp_path / "run"),
                             "--out", str(tmp_path / "hf")],
                            capture_output=True, text=True, timeout=600)
  assert exported.returncode == 0 and exported.stderr == "", exported.stderr[-2000:]
  assert exported.stdout.startswith(f"exported step 2 of {tmp_path / 'run'}: ")
  assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == HF_FILES
  generate = transformers.pipeline("text-generation", model=str(tmp_path / "hf"))
  text = generate("The cat ", max_new_tokens=12, do_sample=False)[0]["generated_text"]
  ids = generate("The cat ", max_new_tokens=12, do_sample=False,
                 return_tensors=True)[0]["generated_token_ids"]
  assert list(ids[:8]) == list(b"The cat ") and len(ids) == 8 + 12
  assert text == bytes(ids).decode("utf-8", "replace")


@pytest.mark.slow
def test_a_hugging_face_export_reads_the_masters_a_chunk_at_a_time(tmp_path):
  """A Llama folder of 16 layers (960 MiB of float32 masters) fine-tuned a
  step, then exported by the command in a process of its own: the export
  adds less than half the masters to the process's peak RSS (they are read
  a saved chunk at a time, as the tensors are cut; whole, they add 1.1
  times themselves), and every tensor equals the one the whole masters
  give. (The default run's Llama export covers the same path at a tiny
  shape.)"""
  from test_finetune import chats, fine_tune, save_tokenizer
  folder = tmp_path / "checkpoint"
  folder.mkdir()
  vocab = save_tokenizer(folder)
  config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=4096,
                                    num_hidden_layers=16, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=64)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(config).save_pretrained(folder)
  data = tmp_path / "chat.jsonl"
  data.write_text("".join(json.dumps(c) + "\n" for c in chats(16)))
  run = tmp_path / "run"
  assert train.main(fine_tune(folder, data, run, "--offload", "--steps", "1",
                              "--eval-every", "100", "--sample-tokens", "0")) == 0
  # VmHWM, not ru_maxrss: that one keeps the forking process's peak across exec.
  measure = ("import re, sys, jax\n"
             "kib = lambda key: int(re.search(key + r':\\s+(\\d+)', "
             "open('/proc/self/status').read())[1])\n"
             "jax.devices()\n"  # the runtime's own memory, before the count starts
             "from jzo.recipe import export\n"
             "before = kib('VmRSS')\n"
             "export.main(sys.argv[1:])\n"
             "print((kib('VmHWM') - before) * 1024)\n")
  done = subprocess.run([sys.executable, "-c", measure, "--run", str(run), "--out",
                         str(tmp_path / "out")], capture_output=True, text=True,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)
  assert done.returncode == 0, done.stderr
  added = int(done.stdout.split()[-1])
  _, _, masters = export.load_run(run)
  whole = sum(x.nbytes for x in jax.tree.leaves(masters))
  assert added < whole / 2, f"the export added {added / 2**20:.0f} MiB, masters {whole / 2**20:.0f}"
  hf.save_pretrained(str(tmp_path / "eager"), hf.config_from_hf(config.to_dict()), masters,
                     dtype="float32")
  exported, eager = load_file(tmp_path / "out" / "model.safetensors"), load_file(
      tmp_path / "eager" / "model.safetensors")
  assert exported.keys() == eager.keys()
  for name in eager:
    np.testing.assert_array_equal(exported[name], eager[name], err_msg=name)
