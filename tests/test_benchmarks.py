"""The GPU benchmarks (benchmarks/train_gpt.py, train_llama.py,
peers_gpt.py, peers_hf.py, figures.py, largest_model.py, zero_stages.py,
generate_speed.py, soak.py, reproducibility.py, synthetic_checkpoint.py, plot.py) at the tiny
size on the CPU, and the
GPU driver benchmarks/gpu.sh: each script's --help, a run of each in a
subprocess whose JSON record is checked (status ok, the fields plot.py and
docs/results.md read there, the figures positive), every figure drawn from
benchmarks/records/, and every part gpu.sh's header names has a case.
Benchmarks report figures; these tests only keep them from rotting.

The runs start together, each a process of its own, and share one tiny
configuration (and the session's compilation cache), so the file's time is
about that of its slowest run."""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
TINY = ["--seq-len", "32", "--steps", "1"]
RUNS = {  # name: (script, arguments)
    "train_gpt": ("train_gpt.py", ["--model", "tiny", "--batch", "2", "--configs", "offload_dpu",
                                   *TINY]),
    "train_llama": ("train_llama.py", ["--model", "llama-tiny", "--batch", "2", "--configs",
                                       "offload", "--no-breakdown", *TINY]),
    "peers_gpt": ("peers_gpt.py", ["--model", "tiny", "--system", "torch", "--batch", "2",
                                   "--device", "cpu", *TINY]),
    "peers_hf": ("peers_hf.py", ["--shape", "llama-tiny", "--system", "torch", "--warmup", "1",
                                 "--device", "cpu", *TINY]),
    "train_gemma": ("train_llama.py", ["--model", "gemma-tiny", "--batch", "2", "--configs",
                                       "offload", "--no-breakdown", "--stage", "3",
                                       "--grads-in-params", *TINY]),
    "peers_hf_moe": ("peers_hf.py", ["--shape", "qwen3-moe-tiny", "--system", "torch",
                                     "--warmup", "1", "--device", "cpu", *TINY]),
    "figures": ("figures.py", ["llama-1b", "--smoke", "--rounds", "2"]),
    "largest_model": ("largest_model.py", ["--base", "tiny", "--seq-len", "32", "--batch", "2",
                                           "--gpus", "1", "--device-gb", "0.02", "--host-gb", "4.4",
                                           "--moments", "fp32", "int8", "--run", "--steps", "1"]),
    "zero_stages": ("zero_stages.py", ["--model", "tiny", "--batch-per-gpu", "2", "--gpus", "1",
                                       "--stages", "2", *TINY]),
    "generate_speed": ("generate_speed.py", ["--shape", "llama-tiny", "--prompt", "16",
                                             "--new-tokens", "8", "--rounds", "2", "--caches",
                                             "dynamic", "--device", "cpu"]),
    "soak": ("soak.py", ["--model", "tiny", "--minutes", "0.3", "--checkpoint-minutes", "0.05",
                         "--window-s", "6", "--calibration-steps", "6", "--batch-size", "2",
                         "--seq-len", "32", "--delayed-update"]),
    "finetune_hf": ("finetune_hf.py", ["--model", "llama-tiny", "--vocab-size", "320", "--n-layer",
                                       "3", "--shard-gb", "0.0005", "--steps", "3",
                                       "--drop-input", "--seq-len", "32", "--batch-size", "4",
                                       "--stage", "3", "--grads-in-params", "--offload"]),
    "reproducibility-cost": ("reproducibility.py", ["cost", "--smoke", "--rounds", "2",
                                                    "--shapes", "gpt2-1.5b"]),
    "reproducibility-bitwise": ("reproducibility.py", ["bitwise", "--smoke", "--steps", "8",
                                                       "--runs", "sigkill"]),
}
SCRIPTS = sorted({script for script, _ in RUNS.values()} | {"plot.py", "synthetic_checkpoint.py"})
# The fields of a train_gpt.py / train_llama.py point that plot.py and docs/results.md read.
ENGINE_FIELDS = ("step_s", "tokens_per_s", "tflops", "n_params", "host_rss_peak_gib",
                 "planned_gpu_gib", "planned_build_gib", "planned_host_gib", "host_update_s",
                 "host_update_gparam_s")
DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def records(tmp_path_factory):
  """Starts every run at once (on the CPU); each name's (record, output) once it is done."""
  folder = tmp_path_factory.mktemp("records")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = {name: subprocess.Popen([sys.executable, str(BENCHMARKS / script), *args, "--json",
                                   str(folder / f"{name}.json")],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=env)
           for name, (script, args) in RUNS.items()}
  results = {}
  for name, proc in procs.items():
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{name}:\n{out[-3000:]}"
    results[name] = (json.loads((folder / f"{name}.json").read_text()), out)
  return results


def points(records, name: str) -> list[dict]:
  record, _ = records[name]
  assert record["benchmark"] in (name, RUNS[name][0].removesuffix(".py"))
  assert record["machine"]["cores"] > 0 and record["machine"]["date"]
  assert record["command"].startswith(f"benchmarks/{RUNS[name][0]}")
  assert record["points"]
  return record["points"]


def check_positive(point: dict, fields) -> None:
  missing = [f for f in fields if f not in point]
  assert not missing, f"{missing} missing from {point}"
  assert all(point[f] > 0 for f in fields), {f: point[f] for f in fields}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_the_docstring(script):
  out = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  assert "--json" in out.stdout and "python3 benchmarks/" + script in out.stdout


def test_train_gpt_offload_with_the_delayed_update(records):
  (point,) = points(records, "train_gpt")
  assert point["status"] == "ok" and point["config"] == "offload_dpu", point
  check_positive(point, ENGINE_FIELDS + ("device_step_s",))
  assert point["offloaded_fraction"] == 1.0 and point["peak_gpu_gib"] == 0  # a CPU: no GPU peak
  assert "d2h_gb_s" not in point  # the pinned bandwidth: GPUs only
  assert "offload_dpu" in records["train_gpt"][1]  # the summary table


def test_train_llama_offload(records):
  (point,) = points(records, "train_llama")
  assert point["status"] == "ok" and point["model"] == "llama-tiny", point
  check_positive(point, ENGINE_FIELDS + ("flops_per_token",))
  assert "device_step_s" not in point  # --no-breakdown


def test_train_gemma_at_stage_3(records):
  (point,) = points(records, "train_gemma")
  assert point["status"] == "ok" and point["model"] == "gemma-tiny", point
  assert point["stage"] == 3 and point["grads_in_params"]
  check_positive(point, ENGINE_FIELDS + ("flops_per_token",))


@pytest.mark.parametrize("name", ["peers_gpt", "peers_hf", "peers_hf_moe"])
def test_pytorch_alone(records, name):
  (point,) = points(records, name)
  assert point["status"] == "ok" and point["system"] == "torch", point
  check_positive(point, ("step_s", "tokens_per_s", "tflops", "n_params", "host_rss_peak_gib"))
  assert point["device"] == "cpu" and len(point["losses"]) >= 2
  if name == "peers_hf_moe":  # the FLOPs count the routed experts alone
    assert point["flops_per_token"] < 6 * point["n_params"]
    assert point["experts"] == "grouped_mm"  # transformers' default, its fastest on a GPU


@pytest.mark.skipif(DEEPSPEED, reason="DeepSpeed is installed here")
@pytest.mark.parametrize("command", [["peers_gpt.py", "--model", "tiny"],
                                     ["peers_hf.py", "--shape", "llama-tiny"]])
def test_deepspeed_missing_is_one_line(command):
  out = subprocess.run([sys.executable, str(BENCHMARKS / command[0]), *command[1:], "--system",
                        "deepspeed"], capture_output=True, text=True, timeout=60)
  assert out.returncode != 0
  assert out.stderr.strip() == "DeepSpeed is not installed (pip install deepspeed)"


def test_figures_smoke_part(records):
  """A part's points in rounds: jzo and transformers' model under PyTorch
  alone on one Llama shape, each point its median round's with every round's
  step beside it."""
  jzo, torch = points(records, "figures")
  assert (jzo["system"], torch["system"]) == ("jzo offload auto", "PyTorch alone")
  for point in (jzo, torch):
    assert point["status"] == "ok" and point["part"] == "llama-1b", point
    check_positive(point, ("step_s", "tflops", "tokens_per_s"))
    assert len(point["step_s_rounds"]) == 2 and point["step_s"] in point["step_s_rounds"]
  assert jzo["model"] == "llama-tiny" and jzo["seq_len"] == 32

def test_largest_model_planned_then_trained(records):
  """Each dtype of the moments its own search and run: on a host that
  bounds both, int8 moments (2 bytes a parameter, against fp32's 8) fit
  more layers."""
  fp32, int8 = points(records, "largest_model")
  assert (fp32["moments"], int8["moments"]) == ("fp32", "int8")
  for point in (fp32, int8):
    assert point["n_layer"] == max(point["layers_by_placement"].values()) > 2, point
    trained = point["trained"]
    assert trained["status"] == "ok" and trained["n_layer"] == point["n_layer"], trained
    assert trained["stage"] == 3 and trained["n_params"] == point["n_params"]
    assert trained["moments"] == point["moments"]
    check_positive(trained, ("step_s", "tflops", "planned_gpu_gib", "planned_host_gib"))
  assert int8["n_layer"] > fp32["n_layer"]


def test_zero_stages(records):
  (point,) = points(records, "zero_stages")
  assert point["status"] == "ok" and point["stage"] == 2 and point["gpus"] == 1, point
  check_positive(point, ("step_s", "tokens_per_s", "tflops", "x_one_gpu"))


def test_generate_speed_against_transformers(records):
  ours, theirs = points(records, "generate_speed")
  assert (ours["system"], theirs["system"]) == ("jzo", "transformers dynamic cache")
  for point in (ours, theirs):
    assert point["status"] == "ok" and point["prompt"] == 16 and point["new_tokens"] == 8, point
    check_positive(point, ("prefill_tokens_per_s", "decode_tokens_per_s"))
    assert len(point["decode_tokens_per_s_rounds"]) == 2
  check_positive(ours, ("param_bytes", "copy_bandwidth_gb_s", "decode_limit_tokens_per_s"))
  ratio = ours["decode_vs_transformers_dynamic_cache"]
  assert ratio["n"] == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]


def test_finetune_hf_trains_a_written_folder_and_checks_its_export(records):
  """A folder of the preset's shape written in shards, chat data, the
  recipe's run with the input's other shards removed after its first step,
  and the export read back: its tensor moved by Adam's steps."""
  (point,) = points(records, "finetune_hf")
  assert point["status"] == "ok" and point["steps"] == 3 and point["n_layer"] == 3, point
  assert point["input_bytes_dropped"] > 0 and point["conversations"] > 0
  check_positive(point, ("step_s", "tokens_per_s", "host_rss_peak_gib", "planned_host_gib",
                         "import_host_peak_gib", "export_s", "tensors"))
  assert point["transformers_config"] == "LlamaConfig" and point["shards"] >= 1
  assert point["within_adam"] and 0 < point["elements_moved"] <= 1, point
  assert point["allocator_peak_gib"] is None  # a CPU


def test_soak_samples_memory_and_steps_across_checkpoints_to_the_stop(records):
  """The recipe trained --minutes with a checkpoint every few steps, then
  stopped by SIGTERM: its RSS sampled, each checkpoint seen, steps/s per window."""
  (point,) = points(records, "soak")
  assert point["status"] == "ok" and point["model"] == "tiny", point
  every = point["checkpoint_every"]
  assert point["calibration"]["step_s"] > 0 and every >= 1
  saved = point["checkpoints"]
  assert len(saved) >= 2 and all(c["step"] % every == 0 and c["rss_gib"] > 0 for c in saved)
  assert [c["step"] for c in saved] == list(range(every, every * len(saved) + 1, every))
  rss = point["host_rss"]
  assert 0 < rss["first_checkpoint_gib"] == saved[0]["rss_gib"] <= rss["max_gib"], rss
  if len(saved) >= 3:  # the RSS just before each save after the first
    settled = rss["before_saves"]
    assert len(settled["gib"]) == len(saved) - 1 and min(settled["gib"]) > 0, settled
  assert point["gpu_memory"] is None and point["allocator_peak"] is None  # a CPU
  assert point["trained_s"] >= 0.3 * 60 - 0.1 and point["steps_done"] >= saved[-1]["step"]
  steps = point["step_series"]["rows"]
  assert [row[0] for row in steps] == list(range(1, point["steps_done"] + 1))
  assert all(step_s > 0 for _, _, step_s in steps)
  windows = point["windows"]
  assert len(windows) >= 3 and all(w["steps"] > 0 and w["steps_per_s"] > 0 for w in windows)
  assert point["steps_per_s_last_vs_first"] > 0
  rows = point["series"]["rows"]
  assert len(rows) >= 4 and all(row[1] > 0 for row in rows), rows
  assert point["stop"]["exit"] == 143 and point["stop"]["checkpoint"] == point["steps_done"]


def test_the_soaks_gpu_memory_counts_only_the_gpus_it_may_use(tmp_path, monkeypatch):
  """Where nvidia-smi lists no process of the run's (a container), the soak
  reads the used memory of the GPUs CUDA_VISIBLE_DEVICES names: another
  job's GPU on the same machine is left out."""
  smi = tmp_path / "nvidia-smi"  # lists no process, and 1 GiB and 3 GiB used on GPUs 0 and 1
  smi.write_text('#!/bin/sh\ncase "$1" in *gpu=index*) printf "0, 1024\\n1, 3072\\n";; esac\n')
  smi.chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  spec = importlib.util.spec_from_file_location("harness", BENCHMARKS / "harness.py")
  harness = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(harness)
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
  assert harness.gpu_memory_gib([os.getpid()]) == (3.0, "device")
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0, 1")
  assert harness.gpu_memory_gib([os.getpid()]) == (4.0, "device")
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
  assert harness.gpu_memory_gib([os.getpid()]) == (4.0, "device")


def test_reproducibility_cost_times_both_engines_in_turn(records):
  (point,) = points(records, "reproducibility-cost")
  assert point["status"] == "ok" and point["shape"] == "tiny"
  assert len(point["usual_rounds"]) == len(point["deterministic_rounds"]) == 2
  check_positive(point, ("n_params",))
  for name in ("usual_tflops", "deterministic_tflops", "ratio"):
    assert point[name]["n"] == 2 and 0 < point[name]["min"] <= point[name]["max"], point


def test_reproducibility_bitwise_resumes_a_killed_run_bit_for_bit(records):
  """On the CPU the runs are deterministic: the killed and resumed run
  equals the reference bit for bit."""
  reference, killed = points(records, "reproducibility-bitwise")
  assert reference["run"] == "reference" and reference["status"] == "ok", reference
  assert killed["run"] == "sigkill" and killed["status"] == "ok", killed
  assert killed["stop_exits"] == [-9] and 5 <= killed["stopped_after_step"] < 8
  assert killed["steps_logged"] == 8 and killed["bitwise_losses"] and killed["bitwise_masters"]
  assert reference["alarming_lines"] == killed["alarming_lines"] == [], (reference, killed)


def test_plot_draws_every_figure_from_the_records(tmp_path):
  out = subprocess.run([sys.executable, str(BENCHMARKS / "plot.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  sys.path.insert(0, str(BENCHMARKS))
  try:
    import plot
  finally:
    sys.path.remove(str(BENCHMARKS))
  present = {p.stem for p in (BENCHMARKS / "records").glob("*.json")}
  expected = {name for name, needs in plot.RECORDS.items() if set(needs) <= present}
  assert expected >= set(plot.DRAW) - {"moments-quality"}  # the records behind the figures
  drawn = {p.stem for p in tmp_path.glob("*.png") if p.stat().st_size > 10_000}
  assert drawn == expected


def test_gpu_sh_parses_and_every_part_in_its_header_has_a_case():
  script = BENCHMARKS / "gpu.sh"
  assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
  text = script.read_text()
  header = text.split("# Parts:", 1)[1].split("\nset ", 1)[0]
  named = re.findall(r"^#   ([a-z0-9-]+)  ", header, re.MULTILINE)
  cases = set(re.findall(r"^    ([a-z0-9-]+)\)", text, re.MULTILINE))
  assert "tests" in named and len(named) >= 10
  assert set(named) == cases, (set(named) ^ cases)


def test_a_synthetic_checkpoint_loads_in_transformers_and_fine_tunes(tmp_path):
  """benchmarks/synthetic_checkpoint.py's folder: transformers loads it with
  the preset's shapes and its ChatML template, and `jzo.train --init-from`
  fine-tunes it on chat JSONL."""
  import transformers
  from jzo import train
  from test_finetune import chats
  folder = tmp_path / "llama"
  done = subprocess.run([sys.executable, str(BENCHMARKS / "synthetic_checkpoint.py"), "--model",
                         "llama-tiny", "--n-layer", "3", "--vocab-size", "300", "--shard-gb",
                         "0.0005", "--out", str(folder), "--json", str(tmp_path / "record.json")],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  point, = json.loads((tmp_path / "record.json").read_text())["points"]
  assert point["n_layer"] == 3 and point["bytes"] > 2 * point["n_params"]  # bf16, and headers
  assert (folder / "model.safetensors.index.json").is_file()
  model = transformers.AutoModelForCausalLM.from_pretrained(folder)
  assert model.config.num_hidden_layers == 3 and model.num_parameters() == point["n_params"]
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
      "<|im_start|>user\nhi<|im_end|>\n")
  data = tmp_path / "chat.jsonl"
  data.write_text("".join(json.dumps(c) + "\n" for c in chats(16)))
  run = tmp_path / "run"
  assert train.main(["--init-from", str(folder), "--data", str(data), "--steps", "2",
                     "--seq-len", "32", "--batch-size", "4", "--devices", "2", "--log-every", "1",
                     "--sample-tokens", "0", "--out", str(run)]) == 0
  losses = [json.loads(l)["loss"] for l in (run / "metrics.jsonl").read_text().splitlines()]
  assert len(losses) == 2 and all(np.isfinite(losses))
