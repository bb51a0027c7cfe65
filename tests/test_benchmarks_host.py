"""The host benchmarks (benchmarks/host_adam.py, moments_quality.py,
checkpoint_io.py) at tiny sizes on the CPU: each one's --help, and a run of
each in a subprocess whose JSON record is checked (status ok, its fields
there, its figures positive). Benchmarks report figures; these tests only
keep them from rotting."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str, tmp_path: pathlib.Path) -> tuple[dict, str]:
  """Runs benchmarks/`script` with `args` on the CPU; its record and output."""
  record = tmp_path / "record.json"
  out = subprocess.run([sys.executable, str(BENCHMARKS / script), *args, "--json", str(record)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
  result = json.loads(record.read_text())
  assert result["benchmark"] == script.removesuffix(".py")
  assert result["machine"]["cores"] > 0 and result["machine"]["date"]
  assert result["command"].startswith(f"benchmarks/{script}")
  assert result["points"] and all(p["status"] == "ok" for p in result["points"])
  return result, out.stdout


@pytest.mark.parametrize("script", ["host_adam.py", "moments_quality.py", "checkpoint_io.py"])
def test_help_is_the_docstring(script):
  out = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  assert "--json" in out.stdout and "python3 benchmarks/" + script in out.stdout


def check_rates_and_ratios(points: list[dict], mode: str, systems: list[str]) -> None:
  rates = {p["system"]: p for p in points if "system" in p}
  assert sorted(rates) == sorted(systems)
  for p in rates.values():
    assert p["mode"] == mode and p["log2_n"] == 16
    assert p["gparam_per_s"] > 0 and p["gb_per_s"] > 0 and p["step_s"]["median"] > 0
  for p in points:
    if "ratio" in p:
      assert p["mode"] == mode and p["median"] > 0 and p["n"] == len(p["values"]) >= 1


def test_host_adam_in_turns(tmp_path):
  systems = ["jzo", "engine-fp32", "engine-int8", "torch", "optax"]
  record, _ = run("host_adam.py", "--sizes", "16", "--rounds", "2", "--steps", "2",
                  "--systems", *systems, tmp_path=tmp_path)
  check_rates_and_ratios(record["points"], "turns", systems)
  ratios = {p["ratio"] for p in record["points"] if "ratio" in p}
  assert ratios == {"jzo / torch", "jzo / optax", "engine-int8 / engine-fp32"}


def test_host_adam_in_processes_of_their_own(tmp_path):
  no_deepspeed = importlib.util.find_spec("deepspeed") is None
  record, out = run("host_adam.py", "--sizes", "16", "--pairs", "1", "--steps", "5",
                    "--systems", "jzo", "torch", *(["deepspeed"] if no_deepspeed else []),
                    tmp_path=tmp_path)
  check_rates_and_ratios(record["points"], "processes", ["jzo", "torch"])
  assert [p["ratio"] for p in record["points"] if "ratio" in p] == ["jzo / torch"]
  if no_deepspeed:
    assert "deepspeed skipped: deepspeed is not installed" in out


def test_moments_quality_tiny(tmp_path):
  record, out = run("moments_quality.py", "--model", "tiny", "--steps", "2", "--seq-len", "32",
                    "--batch-size", "2", "--eval-every", "2", "--eval-batches", "1",
                    "--jobs", "1", tmp_path=tmp_path)
  points = record["points"]
  assert [p["moments"] for p in points] == ["fp32", "bf16", "int8"]
  for p in points:
    assert p["steps"] == [1, 2] and p["eval_steps"] == [2] and p["skipped_steps"] == 0
    assert all(math.isfinite(x) and x > 0 for x in p["train_loss"] + p["eval_loss"])
    assert p["final_eval_loss"] == p["eval_loss"][-1]
    assert abs(p["against_fp32_pct"]) < 5  # two steps in: still the same model
  assert "final held-out loss" in out


def test_checkpoint_io_restores_a_tiny_model_exactly(tmp_path):
  record, out = run("checkpoint_io.py", "--model", "tiny", "--batch", "2", "--seq-len", "32",
                    "--moments", "int8", "--dir", str(tmp_path / "ckpt"), tmp_path=tmp_path)
  [p] = record["points"]
  assert p["exact"] and p["checksums_equal"] and p["losses_equal"]
  for key in ("save_s", "restore_s", "disk_gib", "host_state_gib", "rss_peak_save_gib",
              "rss_before_save_gib", "rss_peak_restore_gib"):
    assert p[key] > 0, key
  assert p["rss_peak_save_gib"] >= p["rss_before_save_gib"]
  assert "exact: True" in out
