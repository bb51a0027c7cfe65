"""`python -m jzo.train`: a few steps end to end, and what bad input gets."""

import dataclasses
import functools
import json
import re
import time

import numpy as np
import pytest

import jzo
from jzo import train
from jzo import checkpoint
from jzo.recipe import config as config_lib
from jzo.recipe import data as data_lib, models, options, runs

FAST = ["--steps", "4", "--warmup", "1", "--log-every", "2", "--eval-every", "4",
        "--eval-batches", "1", "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "8",
        "--devices", "2"]


def test_recipe_runs_with_offload_on_two_devices(tmp_path, capsys):
  code = train.main(FAST + ["--offload", "--out", str(tmp_path)])
  assert code == 0
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  # A line per step; the log steps (2, 4) carry the rates, the last the evaluation.
  assert [l["step"] for l in lines] == [1, 2, 3, 4]
  for l in lines:
    assert np.isfinite(l["loss"]) and l["step_s"] > 0 and l["skipped"] is False
    assert {"lr", "grad_norm", "loss_scale"} <= set(l)
    assert ("tokens_per_s" in l) == (l["step"] % 2 == 0)
  assert "eval_loss" in lines[-1]
  assert (tmp_path / "loss.png").stat().st_size > 1000
  assert json.loads((tmp_path / "config.json").read_text())["devices"] == 2
  out = capsys.readouterr().out
  assert "2 cpu device(s), stage 2 + offload" in out and "--- sample" in out


def test_throughput_counts_training_steps_only(tmp_path, monkeypatch):
  """A slow checkpoint write (1 s here) and the evaluation stay out of the
  logged tokens/s and of the steps' seconds: each interval's time,
  recovered from its tokens/s, is shorter."""
  save = checkpoint.save

  def slow_save(*args, **kwargs):
    time.sleep(1.0)
    return save(*args, **kwargs)
  monkeypatch.setattr(checkpoint, "save", slow_save)
  args = FAST + ["--checkpoint-every", "2", "--steps", "6", "--eval-every", "2",
                 "--sample-tokens", "0", "--out", str(tmp_path)]
  assert train.main(args) == 0
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  tokens = 4 * 32 * 2  # batch x seq x steps per interval
  seconds = [tokens / l["tokens_per_s"] for l in lines if "tokens_per_s" in l]
  assert len(seconds) == 3 and max(seconds[1:]) < 1.0, seconds
  assert max(l["step_s"] for l in lines[1:]) < 1.0


def test_loss_falls_on_the_embedded_corpus(tmp_path, optimized_xla):  # 60 steps: mostly running
  last = train.train(train.TrainConfig(steps=60, warmup=5, log_every=30, eval_every=30,
                                       eval_batches=2, batch_size=8, seq_len=64,
                                       sample_tokens=0, devices=1, out=str(tmp_path)))
  assert last["eval_loss"] < 3.3  # from ln(256) = 5.55 at initialisation


def test_learning_rate_and_warmup_suit_the_model():
  """Each preset starts from its published rate and warm-up (gpt2-10b: GPT-3's
  1e-4 for 13B, not the tiny demo's 3e-3, whose loss jumped from 11.5 to
  26.5 at step 3); fine-tuning from a checkpoint warms up over 3% of the
  steps at the fine-tuning rate; the options win over both. From scratch
  no warm-up is shorter than 3000 steps, past the run's end if it is
  shorter (gpt2-10b's loss went from 11.6 to 16.4 after one update at a
  hundredth of its peak rate); fine-tuning's is at least 20 or half the run.
  The warm-up's first update takes 1/W of the peak, not 0."""
  tiny = models.PRESETS["tiny"]
  cfg = config_lib.parse(train.TrainConfig, ["--steps", "3"])  # test_cli.py trains so
  options.check(cfg)
  assert cfg.warmup is None and options.warmup_steps(cfg, tiny) == 0  # the demo's: a tenth
  assert float(options.lr_schedule(cfg, tiny)(0)) == pytest.approx(3e-3)  # no warm-up
  assert options.warmup_steps(train.TrainConfig(steps=300), tiny) == 30
  schedule = options.lr_schedule(train.TrainConfig(steps=100, warmup=10), tiny)
  assert [float(schedule(c)) for c in (0, 8, 9, 54, 99)] == pytest.approx(
      [3e-4, 2.7e-3, 3e-3, 1.65e-3, 3e-4])  # the peak at update 10, a tenth at the last
  small = train.TrainConfig(model="gpt2-124m", steps=300)
  assert options.warmup_steps(small, models.PRESETS["gpt2-124m"]) == 3000
  assert options.warmup_steps(dataclasses.replace(small, steps=50_000),
                              models.PRESETS["gpt2-124m"]) == 5000
  short = train.TrainConfig(model="gpt2-20b", steps=20, batch_size=32, seq_len=1024)
  assert options.warmup_steps(short, models.PRESETS["gpt2-20b"]) == 3000
  peak, schedule = (options.peak_lr(short, models.PRESETS["gpt2-20b"]),
                    options.lr_schedule(short, models.PRESETS["gpt2-20b"]))
  assert [float(schedule(c)) for c in (0, 1, 19)] == pytest.approx(
      [peak / 3000, 2 * peak / 3000, 20 * peak / 3000])  # never decays
  assert options.warmup_line(short, models.PRESETS["gpt2-20b"]) == (
      "learning rate: the run ends inside its 3000-step warm-up, at 6.7e-07 (peak 0.0001; "
      "--warmup sets the warm-up)")  # the rate of its last update
  big = models.PRESETS["gpt2-10b"]
  cfg = train.TrainConfig(model="gpt2-10b", steps=1000, batch_size=32, seq_len=1024)
  assert options.peak_lr(cfg, big) == 1e-4
  assert options.warmup_steps(cfg, big) == 3000  # 375M tokens would be 11,445 steps
  cfg = train.TrainConfig(model="gpt2-10b", steps=200_000, batch_size=32, seq_len=1024)
  assert options.warmup_steps(cfg, big) == 11_445
  tuned = train.TrainConfig(init_from="somewhere", steps=1000)
  llama = models.PRESETS["llama-3.1-8b"]
  assert options.peak_lr(tuned, llama) == 1e-5 and options.warmup_steps(tuned, llama) == 30
  assert options.warmup_steps(dataclasses.replace(tuned, steps=100), llama) == 20
  assert options.peak_lr(tuned, models.PRESETS["qwen2.5-7b"]) == 7e-6
  mine = train.TrainConfig(init_from="somewhere", steps=1000, lr=1e-3, warmup=7)
  assert options.peak_lr(mine, llama) == 1e-3 and options.warmup_steps(mine, llama) == 7


def test_bad_data_files(tmp_path, capsys):
  empty = tmp_path / "empty.txt"
  empty.write_bytes(b"")
  assert train.main(FAST + ["--data", str(empty), "--out", str(tmp_path)]) == 2
  assert "holds no bytes" in capsys.readouterr().err
  tokens = tmp_path / "tokens.bin"
  np.array([1, 2, 999], np.uint16).tofile(tokens)
  assert train.main(FAST + ["--data", str(tokens), "--vocab-size", "256",
                            "--out", str(tmp_path)]) == 2
  assert "token id 999, beyond the vocabulary of 256" in capsys.readouterr().err


def run_log(out):
  """The metrics of a run without its wall-clock fields."""
  lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in l.items() if k not in ("tokens_per_s", "model_tflops", "step_s")}
          for l in lines]


RESUMABLE = FAST[:] + ["--steps", "6", "--log-every", "1", "--eval-every", "3",
                       "--checkpoint-every", "2", "--sample-tokens", "0"]


class Killed(Exception):
  """Stands for the process dying at an arbitrary point."""


def kill_at_step(monkeypatch, step):
  original = data_lib.Batches.__getitem__

  def getitem(self, i):
    if i == step and self.batch_size == 4:
      raise Killed
    return original(self, i)
  monkeypatch.setattr(data_lib.Batches, "__getitem__", getitem)


@pytest.mark.parametrize("extra", [["--offload"], ["--offload", "--delayed-update"],
                                   ["--no-offload", "--stage", "3"]], ids=str)
def test_resume_continues_bit_exactly(tmp_path, monkeypatch, extra):
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  assert train.main(RESUMABLE + extra + ["--out", str(whole)]) == 0
  with monkeypatch.context() as m:
    kill_at_step(m, 5)  # dies during step 6, after the checkpoint of step 4
    with pytest.raises(Killed):
      train.main(RESUMABLE + extra + ["--out", str(parts)])
  assert train.main(RESUMABLE + extra + ["--out", str(parts), "--resume"]) == 0
  assert run_log(parts) == run_log(whole)


def test_unfinished_checkpoint_is_ignored(tmp_path, monkeypatch):
  with monkeypatch.context() as m:
    kill_at_step(m, 3)
    with pytest.raises(Killed):
      train.main(RESUMABLE + ["--out", str(tmp_path)])
  # What a run killed while writing checkpoint 4 leaves behind.
  partial = tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-1234567"
  partial.mkdir()
  (partial / "garbage").write_bytes(b"\0" * 100)
  assert train.main(RESUMABLE + ["--out", str(tmp_path), "--resume"]) == 0
  assert [l["step"] for l in run_log(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_incompatible_or_corrupt_checkpoint(tmp_path, capsys):
  assert train.main(RESUMABLE + ["--steps", "2", "--warmup", "0", "--out", str(tmp_path)]) == 0
  assert train.main(RESUMABLE + ["--out", str(tmp_path), "--resume", "--seq-len", "16"]) == 2
  assert "made with --seq-len 32, not 16" in capsys.readouterr().err
  for f in (tmp_path / "checkpoints" / "2").rglob("*"):
    if f.is_file():
      f.write_bytes(b"corrupt")
  assert train.main(RESUMABLE + ["--out", str(tmp_path), "--resume"]) == 2
  assert "checkpoint 2 in" in capsys.readouterr().err


def test_sample_from_a_checkpoint(tmp_path, capsys):
  assert train.main(RESUMABLE + ["--steps", "2", "--warmup", "0", "--out", str(tmp_path)]) == 0
  capsys.readouterr()
  assert train.main(RESUMABLE + ["--steps", "2", "--warmup", "0", "--out", str(tmp_path),
                                 "--sample", "--sample-tokens", "12"]) == 0
  assert "--- sample" in capsys.readouterr().out
  # The run's options come from its config.json: no training flag again.
  assert train.main(["--out", str(tmp_path), "--sample", "--sample-tokens", "12"]) == 0
  assert "--- sample" in capsys.readouterr().out
  assert train.main(["--out", str(tmp_path), "--sample", "--seq-len", "16"]) == 2
  assert "made with --seq-len 32, not 16" in capsys.readouterr().err
  assert train.main(RESUMABLE + ["--out", str(tmp_path / "none"), "--sample"]) == 2
  assert "--sample: no complete checkpoint in" in capsys.readouterr().err


def test_partial_placement_and_bf16_moments(tmp_path, capsys):
  code = train.main(FAST + ["--offload-fraction", "0.5", "--moments", "bf16",
                            "--checkpoint-every", "0", "--out", str(tmp_path)])
  assert code == 0
  out = capsys.readouterr().out
  assert "% on the device" in out and "% on the host" in out
  assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_a_run_that_saves_checkpoints_counts_their_host_memory(tmp_path, monkeypatch, capsys):
  """The plan counts a save's host memory beside the offloaded state when
  the run saves every --checkpoint-every steps: a host with room for the
  state but not for that is refused before any weight is drawn, naming it;
  --checkpoint-every 0 (a checkpoint only on a signal) and --sample are not."""
  # The recipe's engine, told the host memory (ZeroEngine's host_memory=).
  engine = jzo.ZeroEngine
  host_memory = lambda b: monkeypatch.setattr(jzo, "ZeroEngine",
                                              functools.partial(engine, host_memory=b))
  host_memory(1)  # (0 would be the machine's)
  args = FAST + ["--steps", "2", "--sample-tokens", "0", "--checkpoint-every", "2"]
  out = tmp_path / "saving"
  assert train.main(args + ["--out", str(out)]) == 2
  # What the tiny model's plan needs, and the part of it a save takes (a
  # small state's save: far less than SAVE_HOST_BYTES).
  need, save = map(float, re.search(r"needs ([\d.]+) GiB of host RAM .*checkpoint writes "
                                    r"([\d.]+) GiB", capsys.readouterr().err).groups())
  assert 0 < save < checkpoint.SAVE_HOST_BYTES / 2**30
  host_memory(int((need - save / 2) * 2**30))
  assert train.main(args + ["--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert f"checkpoint writes {save:.2f} GiB" in err and f"it fits without the {save:.2f} GiB a " \
      "checkpoint's save takes while it writes: save none (jzo.train: --checkpoint-every 0)" in err
  assert not (out / "metrics.jsonl").exists() and runs.latest_checkpoint(out) is None
  out = tmp_path / "signal-only"
  assert train.main(args[:-1] + ["0", "--out", str(out)]) == 0
  assert "checkpoint writes" not in capsys.readouterr().out
  host_memory(1 << 40)
  out = tmp_path / "sampled"
  assert train.main(args + ["--out", str(out)]) == 0
  assert re.search(r"checkpoint writes +[\d.]+ MiB\n", capsys.readouterr().out)  # its table
  host_memory(int((need - save / 2) * 2**30))
  assert train.main(args + ["--out", str(out), "--sample"]) == 0
  assert "--- sample" in capsys.readouterr().out


def test_checkpoints_that_will_not_fit_on_the_disk_are_refused_before_the_first_step(
    tmp_path, monkeypatch, capsys):
  """The refusal names each checkpoint's bytes, how many the run holds at
  once (--keep-checkpoints + 1, or fewer when it saves fewer) and the free
  space; --checkpoint-every 0 only warns."""
  real = runs.shutil.disk_usage
  free = {"bytes": 0}
  monkeypatch.setattr(runs.shutil, "disk_usage",
                      lambda path: real(path)._replace(free=free["bytes"]))
  args = FAST + ["--sample-tokens", "0", "--checkpoint-every", "1"]
  for keep, steps, at_once in [(2, 4, 3), (1, 4, 2), (3, 2, 2)]:
    out = tmp_path / f"keep{keep}-steps{steps}"
    assert train.main(args + ["--keep-checkpoints", str(keep), "--steps", str(steps),
                              "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"this run holds up to {at_once} at once (--keep-checkpoints {keep}," in err, err
    assert "against 0.0 MiB free" in err and not (out / "metrics.jsonl").exists()
    each = float(err.split("each takes up to ")[1].split(" MiB")[0]) * 2**20
  free["bytes"] = 1 << 40
  out = tmp_path / "fits"
  assert train.main(args + ["--keep-checkpoints", "1", "--out", str(out)]) == 0
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["4"]  # one kept
  written = sum(f.stat().st_size for f in (out / "checkpoints").rglob("*") if f.is_file())
  assert 0.5 * each < written < each + 2**20  # zstd, and orbax's metadata files
  free["bytes"] = 0
  out = tmp_path / "signal-only"
  assert train.main(args[:-1] + ["0", "--out", str(out)]) == 0
  assert "one written on SIGINT or SIGTERM would not fit" in capsys.readouterr().err
  assert train.main(args + ["--keep-checkpoints", "0", "--out", str(out)]) == 2
  assert "--keep-checkpoints must be >= 1, got 0" in capsys.readouterr().err
  # Resumed with fewer kept than are there: the first save still adds one
  # to the two (steps 3 and 4) before any goes.
  free["bytes"] = 1 << 40
  out = tmp_path / "resumed"
  assert train.main(args + ["--out", str(out)]) == 0
  free["bytes"] = int(0.5 * each)
  assert train.main(args + ["--keep-checkpoints", "1", "--steps", "6", "--resume",
                            "--out", str(out)]) == 2
  assert "holds up to 3 at once (--keep-checkpoints 1," in capsys.readouterr().err
  # A run resumed at its last step writes nothing more: a full disk is no matter.
  free["bytes"] = 0
  assert train.main(args + ["--resume", "--out", str(out)]) == 0
