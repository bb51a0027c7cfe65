"""`python -m jzo.train`: train or fine-tune a model with jzo's ZeRO engine.

With no arguments it trains the `tiny` preset on the embedded corpus (the
standard library's Python sources, byte-level) with the optimizer offloaded
to the host, on every local device, for a few hundred steps (minutes on a
laptop CPU), then prints a sample of generated text. `--help` lists every
option with its default.

`--init-from DIR` fine-tunes a Hugging Face checkpoint (Llama, Mistral,
Qwen2/3, Phi-3/4, Gemma 2/3, Qwen3-MoE, Mixtral: config.json and
safetensors) on --data read with its tokenizer;
`python -m jzo.export --format hf` gives the result back in that format.

The recipe's pieces live in jzo.recipe: options, models (the presets and
their defaults), data, the run loop, logs, the run folder and signals.

Each log line reports model TFLOPS = tokens/s x (6 N + 12 L D T) (PaLM,
Chowdhery et al. 2022, appendix B) and MFU = that over the devices' peak
bf16 rate: `--peak-tflops` per device, or on GPUs the bf16 matmul rate
measured at start-up (the ceiling a JAX program can reach there).

SIGINT (Ctrl-C) or SIGTERM finishes the step in flight, writes a checkpoint
and exits with status 130 or 143, naming it; the same signal again exits at
once, as does one before the first step. `--resume` continues from the last
checkpoint that reads, bit for bit.

Several processes (one per host, or per accelerator) run the same command
with --coordinator, --num-processes and --process-id (or JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID, or JZO_DISTRIBUTED=auto under Slurm, Open
MPI or a TPU pod; jzo.distributed): each feeds its devices' rows of every
batch and writes its shards of each checkpoint; process 0 alone prints, logs
and plots. They stop together: a signal to any stops all at one step, and
one that fails or dies stops the others (jzo.parallel.peer_watch).
"""

from __future__ import annotations

import os
import sys
import traceback

from jzo.recipe import config as config_lib
from jzo.recipe.loop import claim_gpu_memory, start_processes, train
from jzo.recipe.options import TrainConfig, UserError
from jzo.parallel.peer_watch import PeerWatch
from jzo.recipe.quick_exit import quick_exit
from jzo.recipe.signals import Interrupted, Interrupts, quiet_failed_reads


# How long an error waits for news of another process's end, which may
# have caused it: a killed peer's connections all close at once, and the
# watch reads its own within milliseconds of the collective's failure.
PEER_NEWS_S = 2.0


def main(argv: list[str] | None = None) -> int:
  claim_gpu_memory()
  cfg = config_lib.parse(TrainConfig, argv, description=__doc__.splitlines()[0],
                         prog="python -m jzo.train")
  watch = None
  with Interrupts() as stop:
    try:
      # While the processes join, a signal waits: exiting before the others
      # know of this one would leave them waiting for it.
      stop.defer("exiting once every process has joined, so that all stop")
      # After the options: a process with a mistake in them stops at once
      # rather than leaving the others waiting for it at the coordinator.
      start_processes(cfg)
      watch = PeerWatch.start()  # None with one process
      stop.on_exit = watch and watch.leaving
      stop.at_once("before the first step")  # nothing trained yet: nothing to save
      train(cfg, stop)
    except (UserError, OSError) as e:  # the options, the data or the output folder
      return stop_alone(watch, 2, f"error: {e}")
    except Interrupted as e:  # every process stopped at the same step
      if watch:
        watch.finished()
      sys.stderr.write(f"jzo: {e}\n")
      return 128 + e.signum  # as a shell reports a process the signal ended: 130, 143
    except BaseException as e:  # a failure of this process alone: the others stop too
      if watch is None:
        raise
      return stop_alone(watch, 1, f"{type(e).__name__}: {e}", traceback.format_exc())
  if watch:
    watch.finished()
  return 0


def stop_alone(watch: PeerWatch | None, status: int, reason: str, report: str = "") -> int:
  """Writes `report` (default: `reason`) and returns `status`; with other
  processes, tells them (they stop too) and exits at once: JAX's shutdown
  at exit would wait for them, and they do not come. An error that another
  process's end caused here is not reported: the watch names that process."""
  if watch is not None:
    watch.await_news(PEER_NEWS_S)
  # One write: no other thread's output inside the line.
  sys.stderr.write((report or reason).rstrip("\n") + "\n")
  if watch is None:
    return status
  watch.leaving(status, reason)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


if __name__ == "__main__":
  quiet_failed_reads()
  quick_exit(main())

