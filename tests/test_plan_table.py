"""The planner's table (jzo.plan.format_plan, printed by jzo.estimate and by
jzo.train at the start of a run) reads well at every size: the parameter
count and each row in the unit that fits it, no row of nothing, a CPU's
runtime not called CUDA's, a small state's save not counted as a large
one's; and each figure it shows is the plan's own, read back."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import jzo
from jzo import checkpoint
from jzo import plan as plan_lib
from jzo.models import gpt

UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
ROW = re.compile(r"  (\S.*?) +(\d+\.\d\d) (KiB|MiB|GiB)(?:  of (\d+\.\d\d) (KiB|MiB|GiB) "
                 r"available)?")


def sections(table: str) -> dict[str, dict[str, int]]:
  """{"per device": {row: bytes}, "host": {...}} read back from a table,
  each row checked to be in the unit that fits it (at least 1 of it, or KiB)."""
  found, section = {}, None
  for line in table.splitlines()[1:]:
    if line in ("  per device", "  host"):
      section = found.setdefault(line.strip(), {})
      continue
    match = ROW.fullmatch(line)
    if match is None:
      assert line.startswith("  host update about"), line
      continue
    value, unit = float(match[2]), match[3]
    assert value >= 1 or unit == "KiB", line
    assert value < 1024 or unit == "GiB", line
    section[match[1]] = value * UNITS[unit]
  return found


def check_figures(plan: jzo.Plan, table: str, activations: int = 0) -> dict:
  """Every row of the table is the plan's figure within its rounding, and
  every part of the plan that takes memory has its row."""
  read = sections(table)
  peak = plan.device_peak(activations)
  want = {"per device": {**{k: v for k, v in peak.items() if v},
                         "total (peak)": sum(peak.values())}}
  if plan.cpu_adam:
    host = dict(plan.host_bytes())
    if plan.streamed:
      host["landing (streamed)"] = host.pop("landing")
    runtime = "runtime (CUDA, XLA)" if plan.pinned_pools else "runtime (Python, XLA)"
    host.update({"pinned pool overhead": plan.pool_overhead(), runtime: plan.runtime_bytes,
                 "checkpoint writes": plan.checkpoint_bytes})
    want["host"] = {**{k: v for k, v in host.items() if v}, "total": sum(host.values())}
  assert set(read) == set(want), (read, table)
  for section, rows in want.items():
    assert list(read[section]) == list(rows), table  # the same rows, in order
    for name, b in rows.items():
      unit = max(u for u in UNITS.values() if u <= max(b, 2**10))
      assert abs(read[section][name] - b) <= 0.005 * unit, (name, b, table)
  return read


def test_a_tiny_model_on_cpus():
  """The tiny run of the recipe's first command: 0.14M parameters on CPU
  devices (no memory limit), the state on the host, a checkpoint saved."""
  shapes = {"embed": jax.ShapeDtypeStruct((256, 128), jnp.float32),
            "blocks": jax.ShapeDtypeStruct((2, 128, 384), jnp.float32),
            "head": jax.ShapeDtypeStruct((128, 2), jnp.float32)}
  options = jzo.EngineOptions(stage=2, offload=True, dpu_warmup=0)
  plan = plan_lib.make_plan(shapes, 8, options, n_devices=1,
                            checkpoint_memory=checkpoint.SAVE_HOST_BYTES,
                            runtime_bytes=plan_lib.host_runtime_bytes(1, "cpu"))
  table = str(plan)
  assert "on 1 device(s), 0.13M params," in table, table  # 131,328 parameters
  read = check_figures(plan, table)
  # A CPU process's runtime, not CUDA's; no pinned pools, so no row for them.
  assert "runtime (Python, XLA)" in read["host"] and "CUDA" not in table
  assert "pinned pool overhead" not in read["host"]
  # The save of a 1.5 MiB state counts what such a save holds, not SAVE_HOST_BYTES.
  state = 12 * plan.n_params
  assert plan.checkpoint_bytes == plan_lib.save_bytes(state) < 0.1 * checkpoint.SAVE_HOST_BYTES
  assert re.search(r"\n  checkpoint writes +\d+\.\d\d MiB\n", table), table
  assert re.search(r"\n  master +\d+\.\d\d KiB\n", table), table
  assert " 0.00 " not in table and "0.000B" not in table, table
  assert re.search(r"host update about \d+\.\d\d ms a step", table), table
  # Where nothing is counted for the save, there is no row for it.
  assert "checkpoint writes" not in str(plan_lib.make_plan(shapes, 8, options, n_devices=1))


def test_the_largest_preset_on_a_gpu():
  """gpt2-20b at stage 3 with its gradients over its weights and int8
  moments on an 80 GiB GPU: billions of parameters, every row in GiB, the
  GPU's runtime and the whole of a save's host memory."""
  config = gpt.PRESETS["gpt2-20b"]
  shapes = jax.eval_shape(lambda: gpt.init_params(config, jax.random.PRNGKey(0)))
  activations = gpt.activation_bytes(config, 8, 1024)
  est = jzo.estimate(shapes, activations=activations, stage=3, layers="blocks",
                     grads_in_params=True, moments="int8", device_memory=80 * 2**30,
                     host_memory=125 * 2**30, checkpoint_memory=checkpoint.SAVE_HOST_BYTES)
  assert est.fits, est.error
  # The runtime of the GPU the plan is for (jzo.estimate counts a CPU
  # process's where JAX runs on CPUs alone, as the suite does).
  plan = dataclasses.replace(est.plan,
                             runtime_bytes=plan_lib.host_runtime_bytes(1, "gpu", 80 * 2**30))
  table = plan_lib.format_plan(plan, activations, 80 * 2**30, 125 * 2**30)
  assert f"{plan.n_params / 1e9:.3f}B params" in table and "20.2" in table, table
  read = check_figures(plan, table, activations)
  assert all(" GiB" in line for line in table.splitlines()[1:] if ROW.fullmatch(line)), table
  assert read["host"]["runtime (CUDA, XLA)"] == pytest.approx(4.5 * 2**30, abs=0.005 * 2**30)
  assert "checkpoint writes         2.50 GiB" in table, table
  assert re.search(r"total \(peak\) +\d+\.\d\d GiB  of 80\.00 GiB available", table), table
  assert re.search(r"\n  total +\d+\.\d\d GiB  of 125\.00 GiB available", table), table
  assert re.search(r"host update about \d\.\d\d s a step", table), table


@pytest.mark.parametrize("n, text", [(20_250_000_000, "20.250B"), (10_279_239_680, "10.279B"),
                                     (124_439_808, "124.44M"), (140_000, "0.14M"),
                                     (99_000, "99.0K"), (4_096, "4.1K"), (512, "512")])
def test_parameter_counts(n, text):
  assert plan_lib.count_text(n) == text
