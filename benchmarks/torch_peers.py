"""What peers_gpt.py and peers_hf.py share: PyTorch alone and DeepSpeed
ZeRO-2 with offload_optimizer to the CPU as step functions over a module
that returns its loss, a process per GPU, and the timed steps.

Both systems: lr 3e-4, weight decay 0.1, global-norm clip 1.0, one
micro-batch a step. PyTorch alone: float32 weights, bf16 autocast, fused
AdamW where the weights are. DeepSpeed: bf16 weights on the GPU (or with
offload_param on the CPU), ZeRO stage 2 (or 3 where asked), offload_optimizer cpu with
pinned memory, contiguous gradients, overlapped reduction, its AdamW
(DeepSpeedCPUAdam, built on first use).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import time

SYSTEMS = ("deepspeed", "torch")


def require(system: str) -> None:
  """Stops with one line where `system` cannot run here."""
  if system == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
    raise SystemExit("DeepSpeed is not installed (pip install deepspeed)")


def default_device() -> str:
  import torch
  return "cuda" if torch.cuda.is_available() else "cpu"


def start_ranks(gpus: int) -> list[subprocess.Popen]:
  """With `gpus` > 1, in the process that is to be rank 0 (before torch is
  imported): starts ranks 1..gpus-1 as copies of this command, in this
  process group (a time limit on the group stops them all), each with its
  share of the host's cores for DeepSpeed's CPU Adam (one OpenMP thread a
  process, torchrun's default, ran it 2-4x slower)."""
  if gpus <= 1 or "RANK" in os.environ:
    return []
  threads = str(max(1, len(os.sched_getaffinity(0)) // gpus))
  common = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000),
                WORLD_SIZE=str(gpus), LOCAL_WORLD_SIZE=str(gpus), OMP_NUM_THREADS=threads)
  os.environ.update(common, RANK="0", LOCAL_RANK="0")
  return [subprocess.Popen([sys.executable, *sys.argv],
                           env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r)),
                           stdout=subprocess.DEVNULL)
          for r in range(1, gpus)]


def rank() -> int:
  return int(os.environ.get("RANK", "0"))


def world() -> int:
  return int(os.environ.get("WORLD_SIZE", "1"))


def deepspeed_config(micro_batch: int, zero_stage: int = 2, offload_param: bool = False) -> dict:
  """DeepSpeed's config: ZeRO-2 (or 3) + offload_optimizer cpu, and with
  `offload_param` (stage 3) the bf16 weights on the CPU as well."""
  zero = {"stage": zero_stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
          "contiguous_gradients": True, "overlap_comm": True,
          "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}
  if offload_param:
    zero["offload_param"] = {"device": "cpu", "pin_memory": True}
  return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
          "zero_optimization": zero, "steps_per_print": 10**9}


def init_deepspeed(device: str) -> None:
  """DeepSpeed's process group (one process where no launcher set it up)."""
  import deepspeed
  for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "RANK": "0",
                     "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
    os.environ.setdefault(key, value)
  # On the CPU, DeepSpeed's accelerator would ask for oneCCL.
  deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else None)


def deepspeed_step(module, micro_batch: int, device: str, zero_stage: int = 2,
                   config: dict | None = None):
  """DeepSpeed over `module` with `config` (default: deepspeed_config's for
  `micro_batch` and `zero_stage`): (step, info)."""
  import deepspeed
  init_deepspeed(device)
  config = config or deepspeed_config(micro_batch, zero_stage)
  engine, optimizer, *_ = deepspeed.initialize(model=module, config=config,
                                               model_parameters=module.parameters())
  inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO's wraps the one that updates

  def step(tokens):
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    return loss
  return step, {"deepspeed": deepspeed.__version__, "optimizer": type(inner).__name__}


def torch_step(module, device: str):
  """PyTorch alone over `module` (float32 weights): (step, info)."""
  import torch
  opt = torch.optim.AdamW(module.parameters(), lr=3e-4, weight_decay=0.1, fused=True)

  def step(tokens):
    with torch.autocast(device, dtype=torch.bfloat16):
      loss = module(tokens)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
  return step, {"optimizer": "torch.optim.AdamW(fused=True)"}


def make_step(system: str, module, micro_batch: int, device: str, zero_stage: int = 2,
              config: dict | None = None):
  return (deepspeed_step(module, micro_batch, device, zero_stage, config)
          if system == "deepspeed" else torch_step(module, device))


def timed_steps(step, tokens, *, warmup: int, steps: int, device: str) -> dict:
  """Runs `warmup` then `steps` timed steps: the median step, each step's
  time and loss, and the GPU's peaks (0 on a CPU)."""
  import torch
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  times, losses = [], []
  for i in range(warmup + steps):
    start = time.perf_counter()
    loss = step(tokens)
    sync()
    losses.append(float(loss.detach()))
    if i >= warmup:
      times.append(time.perf_counter() - start)
  on_gpu = device == "cuda"
  return {"step_s": statistics.median(times), "times_s": times, "losses": losses,
          "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0,
          "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if on_gpu else 0.0,
          "device": torch.cuda.get_device_name() if on_gpu else "cpu",
          "torch": torch.__version__}


def out_of_memory(error: BaseException) -> dict:
  """The point of a run the GPU's memory ended."""
  import torch
  return {"status": "oom", "detail": str(error).splitlines()[:1],
          "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30
          if torch.cuda.is_available() else 0.0}


def run_and_record(args, benchmark: str, about: dict, name: str) -> None:
  """The parent's part of a peer benchmark: this script again as a child
  (--child) with a time limit, its point beside `about` in the record, and a
  line of what it measured for `name`."""
  import harness
  script = os.path.abspath(sys.argv[0])
  points = [dict(about, **p) for p in harness.run_child(
      [sys.executable, script, *sys.argv[1:], "--child"], timeout_s=args.timeout)]
  harness.write_record(args.json, benchmark, args, points, with_devices=False)
  p = points[0]
  print(f"{args.system} {name} ({about['n_params'] / 1e9:.2f}B): " + (
      f"{p['step_s']:.3f} s/step, {p['tflops']:.1f} TFLOPS a GPU, GPU peak "
      f"{p['peak_gpu_gib']:.1f} GiB, host RSS peak {p['host_rss_peak_gib']:.1f} GiB"
      if p["status"] == "ok" else f"{p['status']}: {(p.get('detail') or [''])[-1]}"))
  harness.child_result(points)
