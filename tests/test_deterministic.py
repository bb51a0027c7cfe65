"""Reproducible runs on request: `EngineOptions(deterministic=True)` and the
recipe's --deterministic compile the step programs with XLA's deterministic
GPU operations; on a GPU two engines built apart (each compiled, and on
XLA's own autotuning, its own) train a GPT bit for bit alike. CPU steps are
deterministic as they are: the option leaves their programs unchanged."""

import dataclasses
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzo
from jzo import step as step_lib
from jzo.models import gpt
from jzo.recipe import config as config_lib, options as recipe_options
from jzo.train import TrainConfig

DETERMINISTIC = {"xla_gpu_deterministic_ops": True}
# A GPT small enough for a CPU, with a head size cuDNN's flash attention takes
# (its backward is one of the operations that needs the deterministic kernel).
CONFIG = gpt.GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=128)
# On the CPU devices of a machine with a GPU too, XLA's attention ("auto" asks the
# default backend, the GPU, and would pick cuDNN's).
CPU_CONFIG = dataclasses.replace(CONFIG, attention="xla")


def engine(devices, config=CONFIG, **options) -> jzo.ZeroEngine:
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  return jzo.ZeroEngine(functools.partial(gpt.loss_fn, config),
                        gpt.init_params(config, jax.random.PRNGKey(0)),
                        jzo.cpu_adamw(1e-3, weight_decay=0.1),
                        jzo.EngineOptions(max_grad_norm=1.0, **options), mesh=mesh)


def batches(n: int, rows: int) -> list[dict]:
  rng = np.random.default_rng(0)
  return [{"tokens": rng.integers(0, CONFIG.vocab_size, (rows, CONFIG.seq_len + 1),
                                  dtype=np.int32)} for _ in range(n)]


def train(devices, steps: int = 4, **options) -> tuple[list[float], list[np.ndarray]]:
  """Losses of `steps` steps and the float32 masters after them (options:
  `engine`'s)."""
  e = engine(devices, **options)
  losses = [float(e.step(b).loss) for b in batches(steps, 2 * len(devices))]
  masters = [np.asarray(x) for x in jax.tree.leaves(e.params)]
  e.close()
  return losses, masters


def test_the_option_is_checked_and_reaches_the_gpu_programs_only():
  with pytest.raises(ValueError, match="deterministic must be True or False, got 1"):
    jzo.EngineOptions(deterministic=1)
  plan = engine(jax.devices("cpu")[:2], CPU_CONFIG, offload=True, deterministic=True).plan
  assert plan.deterministic
  assert step_lib.compiler_options(plan, "gpu") == DETERMINISTIC
  assert step_lib.compiler_options(plan, "cpu") is None
  usual = engine(jax.devices("cpu")[:2], CPU_CONFIG, offload=True).plan
  assert not usual.deterministic and step_lib.compiler_options(usual, "gpu") is None


def test_the_recipe_flag_sets_the_engine_option():
  for argv, wanted in ([], False), (["--deterministic"], True):
    cfg = config_lib.parse(TrainConfig, ["--model", "tiny", *argv])
    assert recipe_options.engine_options(cfg, "blocks").deterministic is wanted


def test_a_resumed_run_keeps_the_flag(tmp_path):
  """--resume refuses to continue a --deterministic run without it (and the
  other way round): the steps after the checkpoint would not be the run's."""
  def train_cli(*argv):
    return subprocess.run([sys.executable, "-m", "jzo.train", "--model", "tiny", "--steps", "2",
                           "--seq-len", "16", "--batch-size", "2", "--sample-tokens", "0",
                           "--out", str(tmp_path / "run"), *argv],
                          capture_output=True, text=True, timeout=300)
  assert train_cli("--deterministic").returncode == 0
  refused = train_cli("--resume", "--steps", "3")
  assert refused.returncode == 2
  assert refused.stderr.strip().splitlines()[-1] == (
      f"error: checkpoint in {tmp_path / 'run'} was made with --deterministic True, not False")


def test_cpu_steps_are_the_same_with_the_option():
  cpus = jax.devices("cpu")[:2]
  plain, deterministic = (train(cpus, offload=True, config=CPU_CONFIG),
                          train(cpus, offload=True, deterministic=True, config=CPU_CONFIG))
  assert plain[0] == deterministic[0]
  for a, b in zip(plain[1], deterministic[1]):
    np.testing.assert_array_equal(a, b)


try:
  GPUS = jax.devices("gpu")
except RuntimeError:
  GPUS = []


@pytest.mark.skipif(not GPUS, reason="needs a GPU: XLA:GPU's atomics, autotuning and cuDNN's "
                    "attention backward are what the option makes deterministic")
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_two_gpu_engines_train_bit_for_bit_alike(offload):
  kw = dict(compute_dtype=jnp.bfloat16, offload=offload, deterministic=True)
  first, second = train(GPUS[:1], steps=6, **kw), train(GPUS[:1], steps=6, **kw)
  assert first[0] == second[0]
  for a, b in zip(first[1], second[1]):
    np.testing.assert_array_equal(a, b)
