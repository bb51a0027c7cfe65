"""The command lines (jzo.recipe.config, the parser of jzo.train, jzo.estimate and
jzo.export): --help lists every option with its help and default, presets
load, and every mistake gets one line on stderr and status 2, no traceback:
in an option, a preset, a data file (missing, empty, binary, unreadable) or
--out (a file, read-only); a command that fails in a run's folder leaves
every byte of it as it was.

The real entry points run in subprocesses (--help, a mistake each, a short
training run); the mistakes of each option run in this process, to keep the
suite quick, and those of file permissions in one child whose permissions
bind (root gives up the capabilities that override them).
"""

import ast
import contextlib
import dataclasses
import importlib.util
import inspect
import io
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from jzo.recipe import config as config_lib
from jzo import train
from jzo.recipe import export
from jzo import plan
from jzo.recipe import estimate as estimate_cli
from jzo.recipe.options import ALL_WEIGHTS_FIT


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
  """`python -m module args` on the CPU, with a terminal wide enough that
  tyro's help wraps no line."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "1000"}
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                        timeout=300, env=env)


def run_main(main, args: list[str]) -> tuple[int, list[str]]:
  """(exit status, stderr's lines) of a CLI's main, as the shell sees them."""
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    try:
      code = main(args)
    except SystemExit as e:
      code = e.code
  return code, err.getvalue().splitlines()


def field_help(cls) -> dict[str, str]:
  """Each field's docstring, from the class's source: the help tyro shows
  (a docstring of several lines as one)."""
  body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
  return {stmt.target.id: " ".join(doc.value.value.split()) for stmt, doc in zip(body, body[1:])
          if isinstance(stmt, ast.AnnAssign) and isinstance(doc, ast.Expr)}


def help_entry(field: dataclasses.Field, help_text: str) -> re.Pattern:
  """An option's entry in --help: the flag (and --no-flag), a metavar, the
  help, then the default (tyro shows '' for an empty string)."""
  flag = field.name.replace("_", "-")
  if field.default is dataclasses.MISSING:
    tail = "(required)"
  else:
    tail = f"(default: {field.default if field.default != '' else repr('')})"
  return re.compile(rf"--{flag}(, --no-{flag})?( \S+)? {re.escape(help_text)} "
                    + re.escape(tail))


def check_help_lists_every_option(cls, help_out: str) -> None:
  """Every field of `cls` in `help_out` with its docstring and default."""
  text = " ".join(" ".join(line.strip(" │|") for line in help_out.splitlines()).split())
  docs = field_help(cls)
  assert set(docs) == {f.name for f in dataclasses.fields(cls)}, "a field without help"
  for field in dataclasses.fields(cls):
    assert help_entry(field, docs[field.name]).search(text), (field.name, text)
  assert config_lib.CONFIG_HELP in text


@pytest.mark.parametrize("module, cls", [("jzo.train", train.TrainConfig),
                                         ("jzo.estimate", estimate_cli.EstimateConfig)])
def test_help_of_the_real_entry_points(module, cls):
  done = run_module(module, "--help")
  assert done.returncode == 0 and done.stderr == "", done.stderr
  assert done.stdout.startswith(f"usage: python -m {module} ")
  check_help_lists_every_option(cls, done.stdout)


@pytest.mark.parametrize("first, loaded", [("", "False"), ("; import IPython", "True")],
                         ids=["alone", "ipython-loaded"])
def test_the_recipe_loads_without_ipython_unless_it_is_loaded(first, loaded):
  """flax.nnx imports IPython only to ask whether it runs under it: the
  recipe's import leaves it out (0.5 s of every command), and where IPython
  is loaded already (Jupyter), it stays as it was."""
  if first and importlib.util.find_spec("IPython") is None:
    pytest.skip("IPython is not installed here (the GPU machine's Python has none)")
  script = "import sys{}; import jzo.train; print('IPython' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", script.format(first)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == loaded, out.stdout


def test_help_of_export(capsys, monkeypatch):
  monkeypatch.setenv("COLUMNS", "1000")
  assert run_main(export.main, ["--help"]) == (0, [])
  check_help_lists_every_option(export.ExportConfig, capsys.readouterr().out)


@pytest.mark.parametrize("module, doc", [
    ("jzo.train", lambda: train.__doc__), ("jzo.estimate", lambda: estimate_cli.__doc__),
    ("jzo.export", lambda: export.ExportConfig.__doc__)], ids=["train", "estimate", "export"])
def test_help_opens_with_whole_sentences(module, doc):
  """Each command's --help opens with the first paragraph of its docstring,
  whole: the lines of a wrapped sentence joined, nothing cut."""
  done = run_module(module, "--help")
  assert done.returncode == 0, done.stderr
  description = done.stdout.split("\n\n")[1]  # after the usage line, before the presets
  assert description == config_lib.first_paragraph(doc()), description
  assert re.fullmatch(r"[`A-Z].*[.!?]", description), description
  assert description.count("(") == description.count(")"), description
  assert description.count("`") % 2 == 0, description


def test_a_mistake_through_each_real_entry_point(tmp_path):
  # One the recipe finds after JAX has started, one the parser finds.
  done = run_module("jzo.train", "--lr", "-1", "--out", str(tmp_path))
  assert (done.returncode, done.stderr) == (2, "error: --lr must be a number > 0, got -1.0\n")
  done = run_module("jzo.estimate", "--model", "tiny", "--stage", "9")
  assert done.returncode == 2 and done.stdout == ""
  assert done.stderr == ("error: Invalid choice: invalid choice '9' for argument '--stage'. "
                         "Expected one of ('0', '1', '2', '3').\n")


# A short run's options; --steps alone (the warm-up follows it).
SHORT = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--log-every", "1",
         "--eval-every", "2", "--eval-batches", "1", "--sample-tokens", "0",
         "--checkpoint-every", "2", "--devices", "1"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
  """A short run through the real entry point, and its folder (a run that
  other tests' failing commands must leave as it is). --resume in a folder
  with no checkpoint yet, allowed by --fresh-start-ok, as a scheduler's
  requeue would."""
  out = tmp_path_factory.mktemp("short") / "run"
  return run_module("jzo.train", *SHORT, "--resume", "--fresh-start-ok", "--out", str(out)), out


def test_a_short_run_through_the_real_entry_point(short_run):
  done, out = short_run
  assert done.returncode == 0, done.stderr
  assert "Traceback" not in done.stderr
  where = out.absolute() / "checkpoints"
  assert f"--resume: no checkpoint in {where} yet: starting at step 0" in done.stdout
  steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2]
  assert sorted(p.name for p in where.iterdir()) == ["2"]


def test_int8_moments_through_the_real_entry_point(tmp_path):
  """--moments int8: the moments train on the host as 8-bit codes."""
  done = run_module("jzo.train", *SHORT, "--moments", "int8", "--out", str(tmp_path))
  assert done.returncode == 0, done.stderr
  records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2] and all(r["loss"] < 10 for r in records)


@pytest.mark.parametrize("flag, model, batch", [("--grads-in-params", "gpt2-20b", "32"),
                                                ("--offload-params", "gpt2-10b", "96")])
def test_grads_in_params_through_the_real_entry_point(tmp_path, flag, model, batch):
  """--stage 3 --grads-in-params: the layers' gradients take their weights'
  memory (here with two micro-batches a step, summed on the device); with
  --offload-params the weights are in host memory too (on a CPU all of
  them; jzo.estimate offloads them at micro-batch 96 on an 80 GB device
  and keeps as many layers resident as fit). The run trains, and
  jzo.estimate plans it."""
  # (--no-overlap-forward: the flag reaches the engine; a CPU overlaps nothing.)
  accumulate = (["--micro-batch", "1", "--no-overlap-forward"] if flag == "--grads-in-params"
                else [])
  done = run_module("jzo.train", *SHORT, "--stage", "3", flag, *accumulate, "--out",
                    str(tmp_path))
  assert done.returncode == 0, done.stderr
  if accumulate:
    assert "micro-batch 1 a device x 2 accumulation" in done.stdout + done.stderr
  records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2] and all(r["loss"] < 10 for r in records)
  planned = run_module("jzo.estimate", "--model", model, "--moments", "int8", "--stage",
                       "3", flag, "--batch-size", batch, "--host-gb", "125", "--device-gb", "80")
  assert planned.returncode == 0, planned.stdout + planned.stderr
  assert "fits" in planned.stdout.splitlines()[-1]
  resident = re.search(r"layers' weights on the host \((\d+) of 50 layers resident",
                       planned.stdout)
  assert bool(resident) == (flag == "--offload-params"), planned.stdout
  assert not resident or 0 < int(resident.group(1)) < 50
  if flag == "--offload-params":  # at micro-batch 8 every array fits on the device
    small = run_module("jzo.estimate", "--model", model, "--moments", "int8", "--stage", "3",
                       flag, "--batch-size", "8", "--host-gb", "125", "--device-gb", "80")
    assert small.returncode == 0 and "none is offloaded" in small.stdout, small.stdout


def test_estimate_caps_the_pinned_pool_as_the_recipe_does(monkeypatch):
  """jzo.estimate plans XLA's pinned pool capped at the landing buffers, as
  the recipe runs it: gpt2-13b at micro-batch 32 with the delayed update
  fits 80 GB and 125 GiB, where a pool rounded up to 32 GiB (9.47 GiB past
  the landing buffers, 10.47 with its allocator's table) did not."""
  monkeypatch.delenv(plan.PINNED_POOL_LIMIT_VAR, raising=False)
  done = run_module("jzo.estimate", "--model", "gpt2-13b", "--moments", "bf16", "--stage", "3",
                    "--batch-size", "32", "--delayed-update", "--host-gb", "125",
                    "--device-gb", "80")
  assert done.returncode == 0 and done.stdout.splitlines()[-1] == "fits", done.stdout
  overhead = float(re.search(r"pinned pool overhead +([\d.]+)", done.stdout).group(1))
  assert overhead < 5, done.stdout  # the cap, 26 GiB, and its table, past 22.41 GiB


def test_the_recipe_caps_each_pool_at_the_share_of_the_gpus_it_will_drive(monkeypatch):
  """Before JAX starts, the recipe spreads the landing buffers' cap over
  --devices, else over the GPUs the process sees; the pools' cap it sets
  is the share of one of them."""
  from jzo.recipe import loop, models
  from jzo.recipe.options import TrainConfig
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
  assert loop.landing_devices(TrainConfig()) == 4
  assert loop.landing_devices(TrainConfig(devices=2)) == 2
  monkeypatch.delenv(plan.PINNED_POOL_LIMIT_VAR, raising=False)
  model = models.PRESETS["gpt2-13b"]
  loop.cap_pinned_pool(model, 4)
  share = 2 * model.config.n_params // 4 + plan.MIN_POOL_HEADROOM  # 5.98 GiB + 1
  assert os.environ[plan.PINNED_POOL_LIMIT_VAR] == str(-(-share // 2**30)) == "7"


def test_estimate_plans_the_share_of_the_gpu_the_recipe_claims(monkeypatch, capsys):
  """jzo.estimate reads the GPU's limit under the share of its memory that
  jzo.train claims (JAX's default, 75%, would plan for 20 GB less of an
  H100 than training has), and leaves the environment as it was."""
  import jax
  from jzo.recipe import loop
  var = "XLA_PYTHON_CLIENT_MEM_FRACTION"
  monkeypatch.delenv(var, raising=False)
  loop.claim_gpu_memory()
  claimed = os.environ.pop(var)
  seen = []

  class Gpu:  # the machine's first device, as JAX shows it: its allocator's limit
    platform = "gpu"

    def memory_stats(self):
      seen.append(os.environ.get(var))
      return {"bytes_limit": 80 * 2**30}
  monkeypatch.setattr(jax, "devices", lambda backend=None: [Gpu()])
  assert estimate_cli.main(["--model", "gpt2-124m"]) == 0, capsys.readouterr()
  assert seen == [claimed] and var not in os.environ


@pytest.mark.parametrize("flags, placed", [
    (["--device-memory-gb", "0.0014"], "layers' weights on the host\n"),
    (["--resident-layers", "1"],
     "layers' weights on the host (1 of 2 layers resident on the device)")],
    ids=["planned", "asked"])
def test_offload_params_offloads_what_the_device_memory_needs(tmp_path, flags, placed):
  """--offload-params with --device-memory-gb plans where the layers'
  weights live, or --resident-layers sets how many stay on the device
  beside them in host memory; the run trains with them. On a CPU, 1.4 MiB
  puts the tiny model's weights on the host with none resident: one
  resident layer needs as much as both, with the other being fetched
  (tests/test_offload_params.py covers a plan of some)."""
  done = run_module("jzo.train", *SHORT, "--stage", "3", "--offload-params", *flags,
                    "--out", str(tmp_path))
  assert done.returncode == 0, done.stderr
  assert placed in done.stdout + done.stderr
  records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2] and all(r["loss"] < 10 for r in records)


def test_estimate_plans_the_overlapping_step_unless_told_not_to():
  """gpt2-10b at one micro-batch of 32 with --grads-in-params on an 80 GB
  device: the plan counts the layers the overlapping step fetches (and so
  keeps less of the state on the device); --no-overlap-forward plans the
  update first, without them."""
  args = ["--model", "gpt2-10b", "--batch-size", "32", "--stage", "3", "--grads-in-params",
          "--device-gb", "79.19", "--host-gb", "122.56"]
  overlap, after = (run_module("jzo.estimate", *args, *flag)
                    for flag in ([], ["--no-overlap-forward"]))
  assert overlap.returncode == after.returncode == 0, overlap.stderr + after.stderr
  share = lambda out: float(re.search(r"optimizer state ([\d.]+)% on the device", out).group(1))
  assert "fetched layers" in overlap.stdout and "fetched layers" not in after.stdout
  assert share(overlap.stdout) < share(after.stdout)


@pytest.mark.parametrize("batch, micro", [("64", "auto"), ("64", "4"), ("12", "auto")])
def test_estimate_makes_the_global_batch_as_train_does(capsys, batch, micro):
  """--batch-size is the global batch and --micro-batch a device's share of
  one forward and backward in jzo.estimate as in jzo.train: on a device of
  the same memory both make the batch the same way (auto: the largest
  micro-batch that fits, with the accumulation that makes up the rest)."""
  import jax
  from jzo.recipe import loop, models
  from jzo.recipe.options import TrainConfig
  args = ["--model", "gpt2-350m", "--batch-size", batch, "--micro-batch", micro,
          "--seq-len", "1024", "--devices", "2", "--device-gb", "3"]
  assert estimate_cli.main(args) == 0
  lines = capsys.readouterr().out.splitlines()
  cfg = TrainConfig(model="gpt2-350m", batch_size=int(batch), micro_batch=micro, seq_len=1024,
                    devices=2, device_memory_gb=3)
  micro_batch, line = loop.micro_batch(cfg, models.PRESETS["gpt2-350m"], jax.devices()[:2])
  if micro == "auto":
    assert lines[1] == line and 1 < micro_batch < int(batch) // 2, (lines[1], line)
  else:  # (jzo.train's line does not say where the micro-batches are summed)
    assert micro_batch == 4 and re.fullmatch(r"micro-batch 4 a device x 8 accumulation summed "
                                             r"on the (host|device) x 2 devices = global batch "
                                             r"64 \(--micro-batch\)", lines[1]), lines[1]
  want = re.match(r"micro-batch (\d+) a device x (\d+) accumulation", lines[1])
  assert int(want[1]) * int(want[2]) * 2 == int(batch)


def test_estimate_runs_the_layers_first_with_accumulation():
  """gpt2-10b at 4 x 8 with --grads-in-params on an 80 GB device, as
  jzo.estimate and jzo.train plan it: the layers first (every micro-batch's
  layer inputs in the activations, float32 sums of the other leaves and of
  one layer only, no layers fetched beyond one micro-batch's step), which
  keeps more of the state on the device than the layers' float32 sums;
  where they do not fit, the sums."""
  import jax
  import jzo
  from jzo.models import gpt
  kw = dict(stage=3, grads_in_params=True, offload="auto", device_memory=int(79.19 * 2**30),
            host_memory=int(122.56 * 2**30))
  picked = estimate_cli.estimate_model("gpt2-10b", batch_size=32, micro_batch=8, **kw)
  first = picked.estimate
  assert (picked.micro_batch, picked.grad_accum, picked.accumulation) == (8, 4, "layers")
  assert picked.line == ("micro-batch 8 a device x 4 accumulation with the layers first x 1 "
                         "device = global batch 32")
  assert first.fits and first.plan.layers_first and first.plan.grad_accum == 4
  peak = first.plan.device_peak(first.activations)
  assert peak["float32 sums"] < 2 * 2**30 and peak["activations"] > 15 * 2**30
  assert first.plan.overlaps_update and "fetched layers" not in peak  # (measured: none)
  sums = jzo.estimate(jax.eval_shape(lambda: gpt.init_params(gpt.PRESETS["gpt2-10b"],
                                                             jax.random.PRNGKey(0))),
                      activations=gpt.activation_bytes(gpt.PRESETS["gpt2-10b"], 8, 1024),
                      layers="blocks", accumulation="device", grad_accum=4, **kw)
  assert sums.fits and not sums.plan.layers_first
  assert first.plan.offloaded_fraction < sums.plan.offloaded_fraction - 0.15
  # 256 sequences' layer inputs (100 GiB) do not fit: the sums (38 GiB) do
  many = estimate_cli.estimate_model("gpt2-10b", batch_size=256, micro_batch=8, **kw)
  assert many.grad_accum == 32 and many.estimate.fits and not many.estimate.plan.layers_first


def test_offload_params_offloads_nothing_where_the_weights_fit():
  """In 1.6 MiB the tiny model's weights all fit on the device (as the
  recipe plans: the same planner), and jzo.estimate says so."""
  done = run_module("jzo.estimate", "--model", "tiny", "--stage", "3", "--offload-params",
                    "--device-gb", "0.0016", "--batch-size", "2", "--seq-len", "16",
                    "--devices", "1")
  assert done.returncode == 0, done.stderr
  assert ALL_WEIGHTS_FIT in done.stdout and "weights on the host" not in done.stdout


def test_grads_in_params_keeps_what_fits_of_the_state_on_the_device(tmp_path):
  """--grads-in-params with --device-memory-gb places the optimizer state
  (--offload-fraction auto): part of it on the device, whose new weights
  the step writes over their gradients, and the run trains."""
  done = run_module("jzo.train", *SHORT, "--stage", "3", "--grads-in-params",
                    "--device-memory-gb", "0.004", "--out", str(tmp_path))
  assert done.returncode == 0, done.stderr
  share = re.search(r"optimizer state ([\d.]+)% on the device", done.stdout + done.stderr)
  assert share and 0 < float(share.group(1)) < 100, done.stdout
  records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2] and all(r["loss"] < 10 for r in records)


def snapshot(folder: pathlib.Path) -> dict[str, bytes | None]:
  """Every path under `folder`, with a file's bytes (None: a folder)."""
  return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
          for p in folder.rglob("*")}


def test_a_failing_run_leaves_an_earlier_run_as_it_was(short_run, tmp_path):
  out = short_run[1]
  before = snapshot(out)
  binary = tmp_path / "binary.txt"
  binary.write_bytes(b"text\0")
  for args, message in (
      ([], f"--out {out.absolute()} holds an earlier run (metrics.jsonl, checkpoints): --resume "
           "continues it; a new run needs another --out"),
      (["--resume", "--seq-len", "8"], "was made with --seq-len 16, not 8"),
      (["--resume", "--data", str(binary)], f"data file {binary} is binary"),
      (["--resume", "--lr", "-1"], "--lr must be a number > 0"),
      (["--sample", "--seq-len", "4096"], "--seq-len 4096 is beyond tiny's context")):
    one_line_error(train.main, SHORT + ["--out", str(out)] + args, message)
  assert snapshot(out) == before


def test_data_that_cannot_serve(tmp_path):
  """Each bad --data is one line naming the file and what is wrong with it,
  before --out is made."""
  made = {"empty.txt": b"", "binary.txt": b"\x7fELF\x02\x01\x01\x00", "short.txt": b"hi\n",
          "odd.bin": b"abc", "empty.bin": b"", "beyond.bin": b"\x07\x00\x60\xea",
          "folder/a.txt": b"text", "folder/sub/image.png": b"\x89PNG\r\n\x1a\n\x00",
          "empty-folder/.keep": b""}
  for name, content in made.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_bytes(content)
  (tmp_path / "folder.bin").mkdir()
  out = tmp_path / "out"
  with socket.socket(socket.AF_UNIX) as server:  # exists, but no one (root included) can read it
    server.bind(str(tmp_path / "socket.txt"))
    for name, message in (
        ("empty.txt", "data path {} holds no bytes"),
        ("empty-folder", "data path {} holds no bytes"),
        ("binary.txt", "data file {} is binary (a NUL byte at offset 7): --data takes text, or "
                       "token ids in a .bin file"),
        ("folder", "data file {}/sub/image.png is binary (a NUL byte at offset 8)"),
        ("socket.txt", "data file {} cannot be read: No such device or address"),
        ("short.txt", "2 tokens are too few for windows of 33"),
        ("odd.bin", "token file {} has 3 bytes: not a non-empty array of uint16 tokens"),
        ("empty.bin", "token file {} has 0 bytes"),
        ("beyond.bin", "token file {} holds token id 60000, beyond the vocabulary of 256"),
        ("folder.bin", "token file {} is not a file")):
      path = tmp_path / name
      one_line_error(train.main, TRAIN_BASE + ["--vocab-size", "256", "--data", str(path),
                                               "--out", str(out)], message.format(path))
  assert not out.exists()


def as_unprivileged() -> list[str]:
  """The prefix of a command line under which file permissions bind: root
  gives up the capabilities that override them (the owner, root, then
  reads a mode 000 file no more than anyone)."""
  if os.geteuid():
    return []
  assert shutil.which("setpriv"), "setpriv (util-linux) is needed to test permissions as root"
  return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]


def test_unreadable_files_and_a_read_only_out(short_run, tmp_path):
  """Permission denied, in a child whose permissions bind, through the
  recipe's main: unreadable --data (a file, a file in a folder) and
  --config; --out read-only (empty, inside a read-only folder, and a run
  --resume cannot write to, left as it was)."""
  locked = tmp_path / "locked.txt"
  folder = tmp_path / "folder"
  (folder / "sub").mkdir(parents=True)
  (folder / "a.txt").write_text("text")
  preset = tmp_path / "preset.json"
  preset.write_text("{}")
  locked.write_text("text")
  shutil.copy(locked, folder / "sub" / "locked.txt")
  read_only, run = tmp_path / "read-only", tmp_path / "run"
  read_only.mkdir()
  shutil.copytree(short_run[1], run)
  before = snapshot(run)
  for path in (locked, folder / "sub" / "locked.txt", preset):
    path.chmod(0)
  for path in [read_only, run, *run.rglob("*")]:
    path.chmod(0o555 if path.is_dir() else 0o444)
  out = str(tmp_path / "out")
  cases = [
      (SHORT + ["--data", str(locked), "--out", out],
       f"error: data file {locked} cannot be read: Permission denied"),
      (SHORT + ["--data", str(folder), "--out", out],
       f"error: data file {folder}/sub/locked.txt cannot be read: Permission denied"),
      (SHORT + ["--config", str(preset), "--out", out],
       f"error: config file {preset} cannot be read: Permission denied"),
      (SHORT + ["--out", str(read_only)],
       f"error: [Errno 13] Permission denied: '{read_only}/checkpoints'"),
      (SHORT + ["--out", f"{read_only}/new"],
       f"error: [Errno 13] Permission denied: '{read_only}/new'"),
      (SHORT + ["--out", str(run), "--resume"],
       f"error: [Errno 13] Permission denied: '{run}/config.json.part'")]
  child = ("import json, sys, test_cli\n"
           "print(json.dumps([test_cli.run_main(test_cli.train.main, args)\n"
           "                  for args in json.loads(sys.argv[1])]))")
  done = subprocess.run(as_unprivileged() + [sys.executable, "-c", child,
                                             json.dumps([args for args, _ in cases])],
                        capture_output=True, text=True, timeout=300, cwd=pathlib.Path(__file__).parent,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-3000:]
  answers = json.loads(done.stdout.splitlines()[-1])
  for (args, message), (code, lines) in zip(cases, answers, strict=True):
    assert (code, lines) == (2, [message]), args
  for path in [run, *run.rglob("*")]:
    path.chmod(0o755 if path.is_dir() else 0o644)
  assert snapshot(run) == before


# Every option of the recipe with a mistake in it, and a part of the one line
# that answers it. The recipe's arguments before them: TRAIN_BASE.
TRAIN_BASE = ["--steps", "4", "--batch-size", "4", "--seq-len", "32", "--devices", "2"]
TRAIN_MISTAKES = [
    ("resident_layers", ["--resident-layers", "1"], "it needs --offload-params"),
    ("resident_layers", ["--resident-layers", "-2"],
     "--resident-layers must be -1 (the planner's choice) or a count >= 0, got -2"),
    ("resident_layers", ["--stage", "3", "--offload-params", "--resident-layers", "3"],
     "resident_layers must be in [0, 2] (the layers), got 3"),
    ("model", ["--model", "gpt5"], "invalid choice 'gpt5' for argument '--model'"),
    ("data", ["--data", "/no/such/file.txt"], "data path /no/such/file.txt does not exist"),
    ("vocab_size", ["--vocab-size", "-1"], "--vocab-size must be >= 0, got -1"),
    ("seq_len", ["--seq-len", "4096"], "--seq-len 4096 is beyond tiny's context of 128"),
    ("seq_len", ["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    ("batch_size", ["--batch-size", "3", "--devices", "2"], "does not split over 2 devices"),
    ("batch_size", ["--batch-size", "four"], "Error parsing --batch-size"),
    ("micro_batch", ["--micro-batch", "0"], "--micro-batch must be auto or a whole number >= 1"),
    ("micro_batch", ["--micro-batch", "3"], "2 a device, not a multiple of --micro-batch 3"),
    ("init_from", ["--init-from", "/no/such/folder"], "/no/such/folder"),
    ("init_from", ["--model", "tiny", "--init-from", "x"], "--model tiny and --init-from x: give one"),
    ("tokenizer", ["--tokenizer", "/no/such/folder"], "/no/such/folder/tokenizer.json"),
    ("steps", ["--steps", "many"], "Error parsing --steps: invalid literal for int()"),
    ("steps", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("lr", ["--lr", "-1"], "--lr must be a number > 0, got -1.0"),
    ("lr", ["--lr", "nan"], "--lr must be a number > 0, got nan"),
    ("warmup", ["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    ("warmup", ["--warmup", "some"], "Error parsing --warmup"),
    ("weight_decay", ["--weight-decay", "-0.1"], "--weight-decay must be a number >= 0"),
    ("max_grad_norm", ["--max-grad-norm", "0"],
     "--max-grad-norm must be a finite number > 0, got 0.0"),
    ("stage", ["--stage", "7"], "invalid choice '7' for argument '--stage'"),
    ("stage", ["--stage", "0"], "--offload needs --stage 1, 2 or 3"),
    ("offload", ["--offload", "yes"], "Unrecognized options: yes"),
    ("offload_fraction", ["--offload-fraction", "2"],
     "--offload-fraction must be in [0, 1], got 2.0"),
    ("offload_fraction", ["--offload-fraction", "most"], "auto or a number in [0, 1]"),
    ("device_memory_gb", ["--device-memory-gb", "-1"], "--device-memory-gb must be a number >= 0"),
    ("moments", ["--moments", "fp8"], "invalid choice 'fp8' for argument '--moments'"),
    ("moments", ["--moments", "int8", "--no-offload"], "--moments int8 keeps the moments in "
     "host memory: it needs --offload with --offload-fraction auto or 1 (got --no-offload)"),
    ("moments", ["--moments", "int8", "--offload-fraction", "0.5"],
     "(got --offload-fraction 0.5)"),
    ("delayed_update", ["--no-offload", "--delayed-update"], "--delayed-update needs --offload"),
    ("grads_in_params", ["--grads-in-params"], "--grads-in-params needs --stage 3"),
    ("grads_in_params", ["--stage", "3", "--grads-in-params", "--no-offload"],
     "--grads-in-params needs --offload (jzo's Adam"),
    ("grads_in_params", ["--stage", "3", "--grads-in-params", "--delayed-update"],
     "--grads-in-params cannot take --delayed-update"),
    ("offload_params", ["--offload-params"], "--offload-params needs --stage 3"),
    ("offload_params", ["--stage", "3", "--offload-params", "--no-offload"],
     "--offload-params needs --offload (the host kernel updates the weights in host memory where "
     "they are), got --no-offload"),
    ("offload_params", ["--stage", "3", "--offload-params", "--offload-fraction", "0.5"],
     "--offload-params needs --offload (the host kernel updates the weights in host memory where "
     "they are), got --offload-fraction 0.5"),
    ("overlap_forward", ["--overlap-forward", "no"], "Unrecognized options: no"),
    ("deterministic", ["--deterministic", "yes"], "Unrecognized options: yes"),
    ("precision", ["--precision", "fp8"], "invalid choice 'fp8' for argument '--precision'"),
    # conftest.py gives this process 8 CPU devices.
    ("devices", ["--devices", "99"], "--devices 99: this machine has 8 cpu device(s)"),
    ("coordinator", ["--coordinator", "localhost"], "--coordinator must be host:port, got "
     "'localhost'"),
    ("num_processes", ["--num-processes", "-1"], "--num-processes must be >= 0, got -1"),
    ("process_id", ["--num-processes", "2", "--process-id", "2"],
     "--process-id 2 is outside [0, 2)"),
    ("process_id", ["--process-id", "two"], "Error parsing --process-id"),
    ("seed", ["--seed", "-1"], "--seed must be >= 0, got -1"),
    ("log_every", ["--log-every", "0"], "--log-every must be >= 1, got 0"),
    ("eval_every", ["--eval-every", "0"], "--eval-every must be >= 1, got 0"),
    ("eval_batches", ["--eval-batches", "-2"], "--eval-batches must be >= 1, got -2"),
    ("sample_tokens", ["--sample-tokens", "-5"], "--sample-tokens must be >= 0, got -5"),
    ("remat", ["--remat", "some"], "invalid choice 'some' for argument '--remat'"),
    ("peak_tflops", ["--peak-tflops", "fast"], "Error parsing --peak-tflops"),
    ("checkpoint_every", ["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
    ("keep_checkpoints", ["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1, got 0"),
    ("resume", ["--resume"], "--resume: no complete checkpoint in"),
    ("fresh_start_ok", ["--fresh-start-ok"], "--fresh-start-ok only applies with --resume"),
    ("sample", ["--sample"], "--sample: no complete checkpoint in"),
    ("tensorboard", ["--tensorboard", "yes"], "Unrecognized options: yes"),
    ("out", ["--out", "/dev/null"], "--out /dev/null is a file, not a folder"),
    ("export", ["--export", "/dev/null"], "--export /dev/null is a file: give a new or empty"),
    ("export", ["--export", "exported", "--sample"], "--export writes the weights a run trains"),
    (None, ["--stepz", "3"], "Unrecognized options: --stepz, 3"),
    (None, ["--lr"], "Missing value for argument '--lr'"),
]

ESTIMATE_MISTAKES = [
    ("resident_layers", ["--model", "tiny", "--resident-layers", "1"],
     "it needs --offload-params"),
    ("model", ["--devices", "2"], "Missing from python -m jzo.estimate: --model"),
    ("model", ["--model", "gpt5"], "invalid choice 'gpt5' for argument '--model'"),
    ("devices", ["--model", "tiny", "--devices", "0"], "--devices must be >= 1, got 0"),
    ("batch_size", ["--model", "tiny", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    ("seq_len", ["--model", "tiny", "--seq-len", "long"], "Error parsing --seq-len"),
    ("remat", ["--model", "tiny", "--remat", "some"], "invalid choice 'some' for argument"),
    ("stage", ["--model", "tiny", "--stage", "5"], "invalid choice '5' for argument '--stage'"),
    ("offload", ["--model", "tiny", "--offload", "1.5"], "fraction must be in [0, 1], got 1.5"),
    ("offload", ["--model", "tiny", "--offload", "most"], "--offload takes auto, true, false"),
    ("moments", ["--model", "tiny", "--moments", "fp8"], "invalid choice 'fp8' for argument"),
    ("moments", ["--model", "tiny", "--moments", "int8", "--offload", "false"],
     "int8 moments are kept in host memory: offload must be True or 'auto', got False"),
    ("precision", ["--model", "tiny", "--precision", "fp8"], "invalid choice 'fp8' for argument"),
    ("batch_size", ["--model", "tiny", "--batch-size", "6", "--devices", "4"],
     "--batch-size 6 does not split over 4 devices (6 = 1 x 4 + 2)"),
    ("micro_batch", ["--model", "tiny", "--micro-batch", "0"],
     "--micro-batch must be auto or a whole number >= 1, got '0'"),
    ("micro_batch", ["--model", "tiny", "--micro-batch", "some"],
     "--micro-batch must be auto or a whole number >= 1, got 'some'"),
    ("micro_batch", ["--model", "tiny", "--batch-size", "8", "--devices", "2", "--micro-batch",
                     "3"], "--batch-size 8 over 2 devices is 4 a device, not a multiple of "
     "--micro-batch 3"),
    ("micro_batch", ["--model", "tiny", "--grad-accum", "4"], "Unrecognized options: --grad-accum"),
    ("delayed_update", ["--model", "tiny", "--delayed-update", "--offload", "false"],
     "--delayed-update needs --offload"),
    ("grads_in_params", ["--model", "tiny", "--grads-in-params"],
     "--grads-in-params needs --stage 3 (the stacked layers"),
    ("grads_in_params", ["--model", "tiny", "--stage", "3", "--grads-in-params", "--offload",
                         "false"], "--grads-in-params needs --offload (jzo's Adam, whose masters "
     "remake the weights the gradients overwrote), got --offload false"),
    ("offload_params", ["--model", "tiny", "--stage", "3", "--offload-params", "--offload",
                        "0.5"], "--offload-params needs --offload (the host kernel updates the "
     "weights in host memory where they are), got --offload 0.5"),
    ("offload_params", ["--model", "tiny", "--offload-params"],
     "--offload-params needs --stage 3 (the stacked layers"),
    ("from_checkpoint", ["--model", "tiny", "--from-checkpoint", "yes"],
     "Unrecognized options: yes"),
    ("checkpoints", ["--model", "tiny", "--checkpoints", "yes"], "Unrecognized options: yes"),
    ("overlap_forward", ["--model", "tiny", "--overlap-forward", "no"],
     "Unrecognized options: no"),
    ("host_gb", ["--model", "tiny", "--host-gb", "0"], "--host-gb must be > 0, got 0.0"),
    ("device_gb", ["--model", "tiny", "--device-gb", "lots"], "Error parsing --device-gb"),
]


@pytest.mark.parametrize("cls, mistakes", [(train.TrainConfig, TRAIN_MISTAKES),
                                           (estimate_cli.EstimateConfig, ESTIMATE_MISTAKES)],
                         ids=["train", "estimate"])
def test_every_option_has_its_mistakes_checked(cls, mistakes):
  assert {name for name, *_ in mistakes} - {None} == {f.name for f in dataclasses.fields(cls)}


def one_line_error(main, args: list[str], message: str) -> str:
  """The one line `main` answers `args` with, after checking it is one line,
  an error, status 2, and names `message`."""
  code, lines = run_main(main, args)
  assert code == 2 and len(lines) == 1, lines
  assert lines[0].startswith("error: ") and message in lines[0], lines[0]
  return lines[0]


@pytest.mark.parametrize("option, args, message", TRAIN_MISTAKES,
                         ids=[" ".join(args) for _, args, _ in TRAIN_MISTAKES])
def test_recipe_mistakes(option, args, message, tmp_path):
  one_line_error(train.main, TRAIN_BASE + ["--out", str(tmp_path)] + args, message)


@pytest.mark.parametrize("option, args, message", ESTIMATE_MISTAKES,
                         ids=[" ".join(args) for _, args, _ in ESTIMATE_MISTAKES])
def test_estimate_mistakes(option, args, message):
  one_line_error(estimate_cli.main, args, message)


def test_out_naming_a_file_is_left_alone(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("mine")
  one_line_error(train.main, TRAIN_BASE + ["--out", str(a_file)], "is a file, not a folder")
  assert a_file.read_text() == "mine"


def test_resume_without_a_checkpoint_names_where_it_looked(tmp_path):
  typo = tmp_path / "typo"
  line = one_line_error(train.main, TRAIN_BASE + ["--out", str(typo), "--resume"], "--resume")
  assert line == (f"error: --resume: no complete checkpoint in {typo / 'checkpoints'} "
                  "(to start at step 0 then, add --fresh-start-ok)")
  assert not typo.exists()  # refused before anything was written


def test_long_words_stay_whole_on_a_narrow_terminal(monkeypatch):
  # tyro wraps its report at the terminal's width; folded, a wrapped word
  # would come back split.
  monkeypatch.setenv("COLUMNS", "30")
  option = "--" + "x" * 300
  assert one_line_error(train.main, [option], option) == f"error: Unrecognized options: {option}"
  assert os.environ["COLUMNS"] == "30"


def test_preset_files(tmp_path):
  preset = tmp_path / "preset.json"
  for content, message in ((json.dumps({"steps": 2, "learning_rate": 1e-3}),
                            "has unknown options: learning_rate"),
                           (json.dumps({"steps": "many"}), "Error parsing --steps"),
                           ("{not json", "is not valid JSON"),
                           ("[1, 2]", "must hold a JSON object")):
    preset.write_text(content)
    one_line_error(train.main, ["--config", str(preset)], message)
  for content in (b"", b"\x89PNG\r\n\x1a\n\x00\xff"):  # empty, binary
    preset.write_bytes(content)
    one_line_error(train.main, ["--config", str(preset)], f"config file {preset} is not valid JSON")
  one_line_error(train.main, ["--config", str(tmp_path / "missing.json")],
                 "cannot be read: No such file or directory")
  one_line_error(train.main, ["--config", str(tmp_path)], "cannot be read: Is a directory")
  one_line_error(train.main, ["--steps", "3", "--config"], "--config needs a path")


def test_preset_file_then_command_line(tmp_path):
  preset = tmp_path / "preset.json"
  preset.write_text(json.dumps({"steps": 7, "lr": 1e-3}))
  cfg = config_lib.parse(train.TrainConfig, ["--config", str(preset), "--steps", "9"])
  assert cfg.steps == 9 and cfg.lr == 1e-3
  preset.write_text(json.dumps({"offload": False, "delayed_update": True}))
  cfg = config_lib.parse(train.TrainConfig, [f"--config={preset}", "--offload"])
  assert cfg.offload and cfg.delayed_update
  preset.write_text(json.dumps({"model": "gpt2-4b", "host_gb": 125}))
  cfg = config_lib.parse(estimate_cli.EstimateConfig, ["--config", str(preset)])
  assert (cfg.model, cfg.host_gb) == ("gpt2-4b", 125.0)
