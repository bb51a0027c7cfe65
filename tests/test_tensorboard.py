"""`python -m jzo.train --tensorboard`: the event files hold metrics.jsonl's numbers, as
TensorBoard's own reader reads them, also across a resumed run; without the tensorboard
package, one line says how to install it."""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import numpy as np
from tensorboard.backend.event_processing import event_accumulator, event_file_loader

from jzo import train

RUN = ["--warmup", "1", "--log-every", "2", "--eval-every", "2", "--eval-batches", "1",
       "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "0", "--devices", "1",
       "--checkpoint-every", "2"]


def logged(out: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
  """metrics.jsonl as TensorBoard tags: (step, value as float32, as events hold it)."""
  want = {}
  for line in (out / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    for name, value in record.items():
      if name != "step":
        tag = "eval/" + name[5:] if name.startswith("eval_") else "train/" + name
        want.setdefault(tag, []).append((record["step"], float(np.float32(value))))
  return want


def read_back(out: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
  """The scalars TensorBoard's event accumulator reads from `out`/tensorboard."""
  events = event_accumulator.EventAccumulator(str(out / "tensorboard"),
                                              size_guidance={event_accumulator.SCALARS: 0})
  events.Reload()
  return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
          for tag in events.Tags()["scalars"]}


def raw_steps(out: pathlib.Path, tag: str) -> list[int]:
  """The steps of `tag` in the event files, in the order TensorBoard reads them."""
  return [e.step for f in sorted((out / "tensorboard").iterdir())
          for e in event_file_loader.EventFileLoader(str(f)).Load()
          if any(v.tag == tag for v in e.summary.value)]


def test_event_files_hold_the_metrics_across_a_resume(tmp_path):
  out = tmp_path / "run"
  assert train.main(RUN + ["--steps", "3", "--tensorboard", "--out", str(out)]) == 0
  want = logged(out)
  assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
          "eval/loss"} <= set(want)
  assert read_back(out) == want
  # Killed after step 3's line but before its checkpoint, in the middle of a record: the
  # run resumes from step 2 and writes step 3 again, in place of the first run's.
  shutil.rmtree(out / "checkpoints" / "3")
  (earlier,) = (out / "tensorboard").iterdir()
  with open(earlier, "ab") as f:
    f.write((40).to_bytes(8, "little") + b"\0" * 10)
  assert train.main(RUN + ["--steps", "4", "--resume", "--tensorboard", "--out", str(out)]) == 0
  assert len(list((out / "tensorboard").iterdir())) == 2
  assert raw_steps(out, "train/loss") == [1, 2, 3, 4]
  resumed = logged(out)
  assert [step for step, _ in resumed["train/loss"]] == [1, 2, 3, 4]
  assert read_back(out) == resumed


def test_tensorboard_first_given_on_resume_writes_the_log_so_far(tmp_path):
  out = tmp_path / "run"
  assert train.main(RUN + ["--steps", "2", "--out", str(out)]) == 0
  assert not (out / "tensorboard").exists()
  assert train.main(RUN + ["--steps", "3", "--resume", "--tensorboard", "--out", str(out)]) == 0
  assert [step for step, _ in read_back(out)["train/loss"]] == [1, 2, 3]
  assert read_back(out) == logged(out)


def test_without_tensorboard_one_line_says_how_to_install_it(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "tensorboard", None)  # as uninstalled: no spec, no import
  assert train.main(RUN + ["--steps", "2", "--tensorboard", "--out", str(tmp_path / "o")]) == 2
  assert capsys.readouterr().err.strip() == (
      "error: --tensorboard writes with the tensorboard package, which is not installed: "
      "pip install 'jzo[tensorboard]' (or pip install tensorboard)")
  assert not (tmp_path / "o").exists()
