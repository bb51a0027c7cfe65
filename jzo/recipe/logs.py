"""What a run reports: throughput and MFU, the log line, the metrics
record of each step, its TensorBoard scalars, the loss plot, the banner."""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import psutil

import jzo
from jzo.parallel import distributed
from jzo.recipe.models import Model
from jzo.recipe.options import TrainConfig


class Throughput:
  """Training speed over the steps since the last log line, from the steps'
  own seconds (so evaluations and checkpoint writes between them do not count).

  Attributes:
    peak: bf16 TFLOPS of all the devices together, for MFU (0: unknown).
  """

  def __init__(self, cfg: TrainConfig, model: Model, peak: float):
    self.tokens_per_step = cfg.batch_size * cfg.seq_len
    self.flops_per_step = self.tokens_per_step * model.config.flops_per_token(cfg.seq_len)
    self.peak = peak
    self._steps, self._seconds = 0, 0.0

  def add(self, seconds: float) -> None:
    """Counts one optimizer step that took `seconds`."""
    self._steps += 1
    self._seconds += seconds

  def rates(self) -> dict:
    """Tokens/s, model TFLOPS (and MFU) of the steps counted since the last call."""
    tokens_per_s = self.tokens_per_step * self._steps / self._seconds
    tflops = self.flops_per_step * self._steps / self._seconds / 1e12
    self._steps, self._seconds = 0, 0.0
    out = {"tokens_per_s": tokens_per_s, "model_tflops": tflops}
    if self.peak:
      out["mfu"] = tflops / self.peak
    return out


def step_record(step: int, metrics: jzo.StepMetrics, lr: float) -> dict:
  """One metrics.jsonl entry after `step` optimizer steps (reading it waits for the step)."""
  return {"step": step, "loss": float(metrics.loss), "lr": lr,
          "grad_norm": float(metrics.grad_norm), "loss_scale": float(metrics.loss_scale),
          "skipped": bool(metrics.skipped)}


@contextlib.contextmanager
def tensorboard_log(out: pathlib.Path, first: int, history: list[dict],
                    enabled: bool) -> Iterator[Callable[[dict], None]]:
  """A function that writes a metrics.jsonl record as TensorBoard scalars to a new event
  file in `out`/tensorboard, on disk when it returns (a no-op where not `enabled`).

  Each number of a record but its step is a scalar at that step, tagged eval/NAME for
  eval_NAME, else train/NAME (skipped as 0 or 1). As metrics.jsonl (runs.start_log), the
  earlier files keep the steps up to `first`, the checkpoint the run starts from, and lose
  the later ones, which the run writes again: no reader sees a step twice. The new file
  opens with a restart marker at step `first` + 1 (SessionLog START, as torch's
  SummaryWriter(purge_step=) writes it), so that a TensorBoard that read those steps
  already drops them too. Where no earlier scalars are left (--tensorboard first given on
  --resume), `history`, the log so far, is written first.
  """
  if not enabled:
    yield lambda record: None
    return
  # tensorboard's record format and protos, written to a file of our own: its
  # EventFileWriter would import TensorFlow where it is installed, for its file API.
  from tensorboard.compat.proto import event_pb2, summary_pb2
  from tensorboard.summary.writer.record_writer import RecordWriter
  folder = out / "tensorboard"
  folder.mkdir(parents=True, exist_ok=True)
  earlier = _cut_event_files(folder, first, event_pb2.Event)
  # TensorBoard reads a run's files in the order of their names: the start time first.
  name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
  records = RecordWriter(open(folder / name, "wb"))

  def add(**event) -> None:
    records.write(event_pb2.Event(wall_time=time.time(), **event).SerializeToString())

  def write(record: dict) -> None:
    add(step=record["step"], summary=summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag=_tensorboard_tag(name), simple_value=float(value))
        for name, value in record.items() if name != "step" and isinstance(value, (int, float))]))
    records.flush()
  try:
    add(file_version="brain.Event:2")
    add(step=first + 1, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
    if not earlier:
      for record in history:
        write(record)
    records.flush()
    yield write
  finally:
    records.close()


def _cut_event_files(folder: pathlib.Path, step: int, event_type) -> bool:
  """Cuts each event file in `folder` where its scalars pass `step` (or where a record
  was cut short by a kill), removing the files left without any; returns whether any are
  left. A file is a sequence of records (TFRecord): length (uint64), its CRC (uint32), the
  serialized `event_type` proto, its CRC (uint32)."""
  from google.protobuf.message import DecodeError
  left = False
  for path in sorted(folder.glob("*tfevents*")):
    end, scalars = 0, False
    with open(path, "rb") as f:
      while len(header := f.read(12)) == 12:
        length = int.from_bytes(header[:8], "little")
        body = f.read(length + 4)
        if len(body) < length + 4:
          break
        try:
          event = event_type.FromString(body[:length])
        except DecodeError:  # a corrupt record
          break
        if event.HasField("summary"):
          if event.step > step:
            break
          scalars = True
        end = f.tell()
    if not scalars:
      path.unlink()
    elif end < path.stat().st_size:
      os.truncate(path, end)
    left |= scalars
  return left


def _tensorboard_tag(name: str) -> str:
  return "eval/" + name[len("eval_"):] if name.startswith("eval_") else "train/" + name


def log_line(record: dict) -> str:
  """The printed form of a log step's record (with its rates and evaluation, if any)."""
  return (f"step {record['step']}: loss {record['loss']:.4f}"
          + (f", eval {record['eval_loss']:.4f}" if "eval_loss" in record else "")
          + f", lr {record['lr']:.2e}, {record['tokens_per_s']:,.0f} tokens/s, "
          f"{record['model_tflops']:.3f} TFLOPS"
          + (f", MFU {record['mfu']:.1%}" if "mfu" in record else "") + f", {memory_line()}")


def memory_line() -> str:
  host = psutil.Process().memory_info().rss / 2**30
  stats = jax.local_devices()[0].memory_stats() or {}
  device = stats.get("peak_bytes_in_use")
  return f"host {host:.1f} GiB" + (f", device {device / 2**30:.1f} GiB" if device else "")


def plot(history: list[dict], path: pathlib.Path) -> None:
  # A Figure of its own, not pyplot's: no backend chosen or changed (a
  # notebook that runs the recipe keeps its inline plots).
  from matplotlib.figure import Figure
  fig = Figure(figsize=(6, 4))
  ax = fig.subplots()
  train = [(h["step"], h["loss"]) for h in history if "loss" in h]
  evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
  ax.plot(*zip(*train), label="train")
  if evals:
    ax.plot(*zip(*evals), "o-", label="held out")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def matmul_tflops(device, n: int = 8192, repeats: int = 20) -> float:
  """Measured bf16 TFLOPS of an n x n x n matmul on `device` (warm, median of 3)."""
  a = jax.device_put(jnp.ones((n, n), jnp.bfloat16), device)

  @jax.jit
  def chain(a):  # `repeats` dependent matmuls in one dispatch
    return jax.lax.fori_loop(0, repeats, lambda _, x: (x @ a) * 1e-4, a)
  chain(a).block_until_ready()
  times = []
  for _ in range(3):
    start = time.perf_counter()
    chain(a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 * repeats / sorted(times)[1] / 1e12


def peak_tflops(cfg: TrainConfig, devices) -> float:
  """Peak bf16 TFLOPS of one device for MFU: --peak-tflops, else measured on a GPU, else 0."""
  if cfg.peak_tflops or devices[0].platform != "gpu":
    return cfg.peak_tflops
  return matmul_tflops(distributed.own_device(devices))


def banner(cfg: TrainConfig, model: Model, n_tokens: int, devices, peak: float) -> str:
  """The line that opens a run: model, data, devices, ZeRO setup, kernel, peak."""
  processes = (f" in {jax.process_count()} processes" if jax.process_count() > 1 else "")
  params = f"{model.config.n_params / 1e6:.2f}M params"
  active = getattr(model.config, "n_active_params", model.config.n_params)
  if active != model.config.n_params:  # a mixture of experts: TFLOPS count the active ones
    params += f", {active / 1e6:.2f}M active a token (TFLOPS count these)"
  return (f"jzo: {model.name} ({params}), {n_tokens:,} tokens, "
          f"{len(devices)} {devices[0].platform} device(s){processes}, stage {cfg.stage}"
          f"{' + offload' if cfg.offload else ''}, kernel {jzo.kernels.simd_level()}"
          + (f", peak {peak:.0f} TFLOPS/device{'' if cfg.peak_tflops else ' (measured)'}"
             if peak else ""))

