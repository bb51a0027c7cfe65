"""`python -m jzo.train`: a few steps end to end, and what bad input gets."""

import json

import numpy as np
import pytest

from jzo import train

FAST = ["--steps", "4", "--warmup", "1", "--log-every", "2", "--eval-every", "4",
        "--eval-batches", "1", "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "8",
        "--devices", "2"]


def test_recipe_runs_with_offload_on_two_devices(tmp_path, capsys):
  code = train.main(FAST + ["--offload", "--out", str(tmp_path)])
  assert code == 0
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [l["step"] for l in lines] == [2, 4]
  assert np.isfinite(lines[-1]["loss"]) and "eval_loss" in lines[-1]
  assert (tmp_path / "loss.png").stat().st_size > 1000
  assert json.loads((tmp_path / "config.json").read_text())["devices"] == 2
  out = capsys.readouterr().out
  assert "2 cpu device(s), stage 2 + offload" in out and "--- sample" in out


def test_loss_falls_on_the_embedded_corpus(tmp_path):
  last = train.train(train.TrainConfig(steps=60, warmup=5, log_every=30, eval_every=30,
                                       eval_batches=2, batch_size=8, seq_len=64,
                                       sample_tokens=0, devices=1, out=str(tmp_path)))
  assert last["eval_loss"] < 3.3  # from ln(256) = 5.55 at initialisation


@pytest.mark.parametrize("args, message", [
    (["--data", "/no/such/file.txt"], "does not exist"),
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--seq-len", "4096"], "beyond tiny's context of 128"),
    (["--precision", "fp8"], "bf16 or fp16"),
    (["--batch-size", "3", "--devices", "2"], "does not split over 2 devices"),
    (["--stage", "7"], "stage must be 0, 1, 2 or 3"),
])
def test_bad_options_fail_with_a_message(args, message, tmp_path, capsys):
  assert train.main(FAST + ["--out", str(tmp_path)] + args) == 2
  assert message in capsys.readouterr().err


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


def test_unknown_or_mistyped_options_are_named(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    train.main(["--stepz", "3"])
  assert e.value.code == 2 and "--stepz" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    train.main(["--steps", "many"])
  assert "invalid int value: 'many'" in capsys.readouterr().err
  preset = tmp_path / "preset.json"
  preset.write_text(json.dumps({"steps": 2, "learning_rate": 1e-3}))
  with pytest.raises(SystemExit, match="unknown options: learning_rate"):
    train.main(["--config", str(preset)])


def test_preset_file_then_command_line(tmp_path):
  preset = tmp_path / "preset.json"
  preset.write_text(json.dumps({"steps": 7, "lr": 1e-3}))
  cfg = train.config_lib.parse(train.TrainConfig, ["--config", str(preset), "--steps", "9"])
  assert cfg.steps == 9 and cfg.lr == 1e-3
