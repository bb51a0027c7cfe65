"""The run loop of `python -m jzo.train`: the model, the data and the
engine of a run, then steps, logs, evaluations and checkpoints until done
or stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import time

import jax
import numpy as np
import tqdm
from jax.sharding import Mesh

import jzo
from jzo import checkpoint
from jzo.parallel import distributed
from jzo.kernels.cpu_adam import MOMENT_DTYPES
from jzo.models import decoding
from jzo.recipe import data as data_lib, export as export_lib, models
from jzo.recipe.logs import (Throughput, banner, log_line, peak_tflops, plot, step_record,
                             tensorboard_log)
from jzo.recipe.options import (ALL_WEIGHTS_FIT, TrainConfig, UserError, check,
                                check_for_model, engine_options, lr_schedule,
                                offload_placement, resident_count, warmup_line,
                                weights_placement)
from jzo.recipe.runs import (EngineChanged, barrier, check_checkpoint_to_continue,
                             check_disk_for_checkpoints, check_no_earlier_run, keep_model_files,
                             remove_partial_checkpoints, restore_run, save_checkpoint, start_log,
                             with_run_options)
from jzo.recipe.signals import Interrupted, Interrupts


def pick_devices(cfg: TrainConfig) -> list:
  """The first --devices devices (all for 0; with several processes,
  process by process); refuses more than there are."""
  devices = list(distributed.default_mesh("data").devices.flat)
  if cfg.devices > len(devices):
    raise UserError(f"--devices {cfg.devices}: this machine has {len(devices)} "
                    f"{devices[0].platform} device(s)")
  return devices[:cfg.devices or None]



def memory_known(cfg: TrainConfig, devices) -> bool:
  """Whether the placement knows the devices' memory: --device-memory-gb,
  or what they report (CPUs report none)."""
  return bool(cfg.device_memory_gb
              or jzo.plan.device_memory_limit(distributed.own_device(devices)))


def source_model(cfg: TrainConfig) -> tuple[models.Model, object | None]:
  """(the model --model or --init-from names, its weights as lazy leaves
  read from --init-from's files, or None to draw new ones). Reads only
  config.json and the weights' headers: JAX's backend is not started."""
  if not cfg.init_from:
    return models.PRESETS[cfg.model or "tiny"], None
  try:
    return models.from_hf(cfg.init_from)
  except (OSError, ValueError) as e:
    raise UserError(str(e)) from e


def run_model(cfg: TrainConfig, model: models.Model, data: data_lib.Data) -> models.Model:
  """The model with the run's remat policy; a GPT also with --seq-len as its
  context and, for tiny and token files, the data's vocabulary."""
  vocab = data.vocab
  config = dataclasses.replace(model.config, remat=cfg.remat)
  if model.family is models.GPT:
    # tiny and token files take the data's vocabulary, padded to a multiple of 128.
    own_vocab = model.name == "tiny" or cfg.data.endswith(".bin")
    config = dataclasses.replace(config, seq_len=cfg.seq_len, vocab_size=-(-vocab // 128) * 128
                                 if own_vocab else config.vocab_size)
  if vocab > config.vocab_size:
    what = (f"the tokenizer in {data_lib.tokenizer_folder(cfg)} has {vocab} ids"
            if data.tokenizer else f"the data needs a vocabulary of {vocab}")
    raise UserError(f"{what}, {model.name} has a vocabulary of {config.vocab_size}")
  return dataclasses.replace(model, config=config)


def claim_gpu_memory() -> None:
  """Lets XLA's allocator hand out 95% of each GPU's memory, where JAX's
  default of 75% would leave 20 GB of an H100 unused (the planner keeps its
  own headroom). Takes effect only before JAX starts its GPU backend, and
  leaves a fraction the user set alone."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")


def cap_pinned_pool(model: models.Model, devices: int) -> None:
  """Caps each device's XLA pinned host pool at its share of what the
  landing buffers can hold at most, every parameter's gradient in the
  2-byte compute dtype spread over `devices` (or more), so that it does not
  round them up to a power of two (jzo.plan.limit_pinned_pool)."""
  jzo.plan.limit_pinned_pool(2 * model.config.n_params, devices)


def landing_devices(cfg: TrainConfig) -> int:
  """The fewest devices the run spreads its landing buffers over, as known
  before JAX starts its GPU backend: --devices; with several processes,
  --num-processes (each drives one at least), else 1 (a process may see
  GPUs it does not drive); with one, the GPUs it sees."""
  if cfg.devices:
    return cfg.devices
  if jax.distributed.is_initialized():
    return cfg.num_processes or 1
  return jzo.plan.visible_gpus()


def per_device_batch(cfg: TrainConfig, devices) -> int:
  """Sequences per device per step; refuses a --batch-size that does not
  split over the devices or into --micro-batch."""
  per_device, rest = divmod(cfg.batch_size, len(devices))
  if rest:
    raise UserError(f"--batch-size {cfg.batch_size} does not split over {len(devices)} devices "
                    f"({cfg.batch_size} = {per_device} x {len(devices)} + {rest})")
  if cfg.micro_batch != "auto" and per_device % int(cfg.micro_batch):
    raise UserError(f"--batch-size {cfg.batch_size} over {len(devices)} devices is "
                    f"{per_device} a device, not a multiple of --micro-batch {cfg.micro_batch}")
  return per_device


def micro_batch(cfg: TrainConfig, model: models.Model, devices) -> tuple[int, str]:
  """(sequences per device in one forward and backward, a line saying how
  many and why). --micro-batch auto asks the planner for the largest that
  fits with the accumulation that makes --batch-size (jzo.pick_micro_batch);
  devices that report no memory limit (CPUs) take their whole share."""
  per_device = per_device_batch(cfg, devices)
  device_memory = (int(cfg.device_memory_gb * 2**30)
                   or jzo.plan.device_memory_limit(distributed.own_device(devices)))
  if cfg.micro_batch != "auto" or not device_memory:
    micro = per_device if cfg.micro_batch == "auto" else int(cfg.micro_batch)
    why = "--micro-batch" if cfg.micro_batch != "auto" else "the devices report no memory limit"
    return micro, (f"micro-batch {micro} a device x {per_device // micro} accumulation x "
                   f"{len(devices)} device(s) = global batch {cfg.batch_size} ({why})")
  shapes = jax.eval_shape(functools.partial(model.init_params, jax.random.PRNGKey(0)))
  try:  # the devices' memory is known here: the placements' default
    picked = jzo.pick_micro_batch(
        shapes, functools.partial(model.activation_bytes, seq_len=cfg.seq_len),
        devices=len(devices), global_batch=cfg.batch_size, stage=cfg.stage,
        offload=offload_placement(cfg), moments=cfg.moments, precision=cfg.precision,
        delayed_update=cfg.delayed_update, grads_in_params=cfg.grads_in_params,
        offload_params=weights_placement(cfg), resident_layers=resident_count(cfg),
        overlap_forward=cfg.overlap_forward, layers=model.family.layers if cfg.stage == 3 else None,
        device_memory=device_memory, checkpoint_memory=checkpoint_memory(cfg),
        sliced_draws=bool(cfg.init_from))  # a checkpoint's leaves are read a slice at a time
  except (jzo.PlacementError, ValueError) as e:  # ValueError: an option the plan refuses
    raise UserError(str(e)) from e
  return picked.micro_batch, picked.line


def make_engine(cfg: TrainConfig, model: models.Model, params, devices,
                micro: int) -> jzo.ZeroEngine:
  """The run's engine over `devices` at `micro` sequences per device per
  forward and backward: `params` lazy leaves of a checkpoint, or None to
  draw new weights from --seed."""
  if params is None:
    # A function, not arrays: the engine checks its plan fits from the shapes,
    # then draws the float32 weights one leaf at a time.
    params = functools.partial(model.init_params, jax.random.PRNGKey(cfg.seed))
  moments = MOMENT_DTYPES[cfg.moments]
  tx = jzo.cpu_adamw(lr_schedule(cfg, model), b2=0.95, weight_decay=cfg.weight_decay,
                     mask=model.decay_mask, mu_dtype=moments, nu_dtype=moments)
  accum = cfg.batch_size // len(devices) // micro
  known = memory_known(cfg, devices)

  def engine(accumulation: str, activations: int) -> jzo.ZeroEngine:
    options = engine_options(cfg, model.family.layers, memory_known=known, grad_accum=accum,
                             accumulation=accumulation)
    return jzo.ZeroEngine(model.loss_fn, params, tx, options,
                          mesh=Mesh(np.array(devices), ("data",)), activation_memory=activations,
                          device_memory=int(cfg.device_memory_gb * 2**30) or None,
                          checkpoint_memory=checkpoint_memory(cfg))
  single = model.activation_bytes(micro, cfg.seq_len)
  if accum == 1 or not (cfg.grads_in_params or cfg.offload_params):
    return engine("auto", single)
  try:  # the layers first (no float32 sums of the layers) where they fit, else their sums
    return engine("layers", model.activation_bytes(micro, cfg.seq_len, accumulation=accum))
  except jzo.PlacementError:
    return engine("device", single)


def checkpoint_memory(cfg: TrainConfig) -> int:
  """Host RAM the plan counts for a checkpoint's save: a run that saves
  every --checkpoint-every steps must have it. Neither one that saves only
  on SIGINT or SIGTERM (--checkpoint-every 0) nor --sample, which saves
  nothing, is refused for it."""
  return checkpoint.SAVE_HOST_BYTES if cfg.checkpoint_every and not cfg.sample else 0


def build_engine(cfg: TrainConfig, model: models.Model, params, devices,
                 micro: int) -> jzo.ZeroEngine:
  """`make_engine`, its refusals (a plan that does not fit: before any
  weight is drawn) as UserErrors."""
  try:
    return make_engine(cfg, model, params, devices, micro)
  except (ValueError, TypeError, MemoryError) as e:
    raise UserError(str(e)) from e


def evaluate(engine: jzo.ZeroEngine, val, n: int) -> float:
  """Mean loss of n held-out batches under the engine's weights as its step
  uses them (`ZeroEngine.evaluate`: no float32 copy of a large model)."""
  return float(np.mean([float(engine.evaluate(engine.local_batch(val(i)))) for i in range(n)]))


def sample_params(engine: jzo.ZeroEngine):
  """The weights the sample is drawn with: the compute-dtype params in full
  shapes on this process's first device (not the float32 masters on the
  host, which would not fit beside a large model's state)."""
  return jax.tree.map(lambda x: x.addressable_data(0), engine.compute_params())


def print_sample(model: models.Model, params, data: data_lib.Data, cfg: TrainConfig):
  """Generates --sample-tokens from a prompt taken from the held-out split,
  sampled at temperature 0.8 (jzo.models.decoding); where the model's
  context fills, it goes on from the last half of the context."""
  context = model.max_seq_len
  prompt = data.val_tokens[:min(32, context // 2)].tolist()
  stop = [] if data.tokenizer is None or data.tokenizer.eos_id is None else [data.tokenizer.eos_id]
  generator = decoding.Generator(model.config, params)
  new: list[int] = []
  while len(new) < cfg.sample_tokens:
    window = (prompt + new)[-(context // 2):] if new else prompt
    sampling = decoding.Sampling(temperature=0.8, seed=cfg.seed + len(new))
    drawn = generator.generate([window], cfg.sample_tokens - len(new), sampling, stop)[0]
    new += drawn
    if len(window) + len(drawn) < context:  # all of them, or a stop token
      break
  if data.tokenizer is not None:
    decode = lambda ids: data.tokenizer.backend.decode([int(i) for i in ids])
  elif data.vocab == data_lib.BYTE_VOCAB:
    decode = lambda ids: bytes(np.asarray(ids, np.uint8)).decode("utf-8", "replace")
  else:  # token ids of a .bin file, whose tokenizer the run does not know
    decode = lambda ids: " ".join(map(str, ids))
  print("\n--- sample (prompt from the held-out split) ---\n" + decode(prompt) + decode(new))


def train(cfg: TrainConfig, stop: Interrupts | None = None) -> dict:
  """Runs the recipe; returns the last step's record ({} if no step was run).

  `stop`: the signal handlers, entered by the caller (`python -m jzo.train`
  enters them first thing); None installs them for this call. Once the
  engine is built, a signal waits for a step boundary.

  Raises:
    UserError: a mistake in the options or the data.
    Interrupted: SIGINT or SIGTERM stopped the run (see `Interrupts`),
      after the checkpoint of the step reached.
  """
  if stop is None:
    with Interrupts() as stop:
      return train(cfg, stop)
  if cfg.sample:
    cfg = with_run_options(cfg, pathlib.Path(cfg.out))
  check(cfg)
  if cfg.export and jax.process_count() > 1:
    raise UserError("--export reads the live weights in one process; with several, export a "
                    "checkpoint: python -m jzo.export --run DIR --out DIR --dtype bfloat16")
  model, params = source_model(cfg)
  check_for_model(cfg, model)
  if cfg.offload:
    cap_pinned_pool(model, landing_devices(cfg))  # before JAX starts its GPU backend
  devices = pick_devices(cfg)
  per_device_batch(cfg, devices)  # refuses a batch that does not split before reading data
  out = pathlib.Path(cfg.out)
  primary = distributed.is_primary()  # prints, logs and plots
  check_checkpoint_to_continue(cfg, out)
  check_no_earlier_run(cfg, out)
  # Tokenized data is cached in --out, once it has been read whole: bad
  # data leaves --out as it was.
  data = data_lib.load_data(cfg, model.config.vocab_size, out / "data-cache", progress=primary)
  model = run_model(cfg, model, data)
  micro, micro_line = micro_batch(cfg, model, devices)
  out.mkdir(parents=True, exist_ok=True)
  if cfg.sample:
    with checkpoint.open_manager(out / "checkpoints", cfg.keep_checkpoints) as manager:
      engine = build_engine(cfg, model, params, devices, micro)
      restore_run(manager, engine, cfg, out)
      params = sample_params(engine)  # every process takes part in the gather
      if primary:
        print_sample(model, params, data, cfg)
      engine.close()
      return {}
  if primary:
    remove_partial_checkpoints(out)
  barrier("jzo: partial checkpoints removed")
  with checkpoint.open_manager(out / "checkpoints", cfg.keep_checkpoints) as manager:
    engine = build_engine(cfg, model, params, devices, micro)
    try:
      first = restore_run(manager, engine, cfg, out) if cfg.resume else 0
    except EngineChanged:  # a checkpoint failed part-way through the engine's state
      engine.close()
      del engine  # its device memory is the new engine's
      engine, first = build_engine(cfg, model, params, devices, micro), 0
    try:
      check_disk_for_checkpoints(cfg, manager, engine, first)
    except UserError:
      engine.close()
      raise
    stop.defer()  # from here a signal waits for a step boundary, and a checkpoint
    history = start_log(cfg, out, first) if primary else []
    if primary and not first:
      hf_config = None if model.family is models.GPT else model.config.to_hf()
      keep_model_files(out, hf_config, [f for f in (data_lib.tokenizer_folder(cfg),
                                                    cfg.init_from) if f])
    peak = peak_tflops(cfg, devices)
    if primary:
      print(banner(cfg, model, data.n_tokens, devices, peak))
      print(engine.plan)
      if cfg.offload_params and not engine.plan.offload_params:
        print(ALL_WEIGHTS_FIT)
      print(micro_line)
      print(warmup_line(cfg, model))
    schedule = lr_schedule(cfg, model)
    meter = Throughput(cfg, model, peak * len(devices))
    last = {}
    done = saved = first  # steps done; the step of the last checkpoint (or the start)
    with open(out / "metrics.jsonl" if primary else os.devnull, "a") as log, \
         tensorboard_log(out, first, history, cfg.tensorboard and primary) as to_tensorboard, \
         tqdm.tqdm(total=cfg.steps, initial=first, unit="step", disable=not primary) as bar:
      started = time.perf_counter()
      for step in range(first, cfg.steps):
        if stop.in_any_process():
          break
        metrics = engine.step(engine.local_batch(data.batch(step)))
        done = step + 1
        last = step_record(done, metrics, float(schedule(step)))  # waits for the step
        last["step_s"] = time.perf_counter() - started
        meter.add(last["step_s"])
        bar.update()
        is_eval = done % cfg.eval_every == 0 or done == cfg.steps
        if is_eval or done % cfg.log_every == 0:
          last.update(meter.rates())
          if is_eval:
            last["eval_loss"] = evaluate(engine, data.val, cfg.eval_batches)
          if primary:
            bar.write(log_line(last))
        history.append(last)
        # The line before the checkpoint: a run resumed from it finds the log whole.
        log.write(json.dumps(last) + "\n")
        log.flush()
        to_tensorboard(last)
        if cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
          # The batch order is a function of the step, so the step is the data position.
          save_checkpoint(manager, engine, done)
          saved = done
        started = time.perf_counter()  # the next step's clock: not this bookkeeping
    # Once more in every process, whether the loop ran out or stopped: a
    # signal during the last step stops every process, or none.
    if stop.in_any_process():
      if done > saved:  # deferred still: a second signal exits at once
        save_checkpoint(manager, engine, done)
      engine.close()
      raise Interrupted(stop.signum, done,
                        out.absolute() / "checkpoints" / str(done) if done else None)
    stop.at_once("after the last step")
  engine.close()
  if cfg.export:
    try:
      exported = export_lib.export_engine(engine, out, cfg.export, done, model.config)
    except export_lib.ExportError as e:
      raise UserError(f"--export: {e}") from e
    print(f"\nweights: {exported.config.parent} (Hugging Face, bfloat16, step {done})")
  if primary:
    plot(history, out / "loss.png")
  if cfg.sample_tokens:
    params = sample_params(engine)  # every process takes part in the gather
    if primary:
      print_sample(model, params, data, cfg)
  if primary:
    print(f"\nmetrics: {out / 'metrics.jsonl'}, loss curve: {out / 'loss.png'}")
  return last


def start_processes(cfg: TrainConfig) -> None:
  """Joins the other processes of a run, where the options or the
  environment name them (jzo.distributed); a single process otherwise."""
  host_port = r"(\[[0-9a-fA-F:.]+\]|[^:\s\[\]]+):\d+"  # an IPv6 host in brackets
  if cfg.coordinator and not re.fullmatch(host_port, cfg.coordinator):
    raise UserError(f"--coordinator must be host:port, got {cfg.coordinator!r}")
  if cfg.num_processes < 0:
    raise UserError(f"--num-processes must be >= 0, got {cfg.num_processes}")
  if cfg.process_id < -1 or (cfg.num_processes and cfg.process_id >= cfg.num_processes):
    count = cfg.num_processes or "the process count"
    raise UserError(f"--process-id {cfg.process_id} is outside [0, {count}) (-1: from the "
                    "environment)")
  try:
    distributed.initialize_from_environment(cfg.coordinator or None, cfg.num_processes or None,
                                            None if cfg.process_id < 0 else cfg.process_id)
  except ValueError as e:
    raise UserError(str(e)) from e

