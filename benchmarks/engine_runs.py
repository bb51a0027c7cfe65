"""jzo's ZeroEngine training a GPT or Llama-family model, measured: what
train_gpt.py and train_llama.py share (their flags and configurations, the
child process that measures one configuration, the record, the summary).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import statistics
import sys
import time

import harness

CONFIGS = {"device": False, "offload": True, "offload_dpu": True, "auto": "auto",
           "auto_dpu": "auto"}
MOMENTS = ("fp32", "bf16", "int8")


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family of jzo.models and the defaults of its benchmark."""
  module: str       # jzo.models.gpt or jzo.models.llama: PRESETS, init_params, loss_fn, ...
  layers: str       # the key of the stacked layers (stage 3 gathers one at a time)
  model: str        # the default preset
  seq_len: int
  batch: int
  configs: tuple[str, ...]
  others: tuple[str, ...] = ()  # more modules whose presets it takes


GPT = Family("jzo.models.gpt", "blocks", "gpt2-1.5b", 1024, 8, tuple(CONFIGS))
# Every family with a Hugging Face form: the Llama family and Gemma.
LLAMA = Family("jzo.models.llama", "layers", "llama-3.1-8b", 4096, 1, ("auto_dpu",),
               ("jzo.models.gemma",))


def add_flags(parser, family: Family):
  """The flags of a benchmark of `family` (its parser from harness.parser)."""
  add = parser.add_argument
  add("--model", default=family.model, help="a preset of " + family.module
      + (" or a Hugging Face folder (config.json, safetensors)" if family is LLAMA else ""))
  add("--seq-len", type=int, default=family.seq_len)
  add("--batch", type=int, nargs="+", default=[family.batch],
      help="micro-batch (sequences a GPU); several: one engine measured at each")
  add("--n-layer", type=int, help="layers, instead of the preset's")
  add("--grad-accum", type=int, default=1)
  add("--accumulation", choices=["auto", "device", "host", "layers"], default="auto",
      help="with --grad-accum > 1: where the micro-batches are summed (layers: the layers "
      "first, under --grads-in-params)")
  add("--remat", default="full", help="full, dots or none")
  add("--configs", nargs="+", default=list(family.configs), choices=list(CONFIGS))
  add("--steps", type=int, default=5, help="timed steps, after 3 to compile and warm up")
  add("--moments", choices=MOMENTS, default="fp32",
      help="Adam moments' dtype (host bytes a parameter: fp32 14, bf16 10, int8 about 8)")
  add("--stage", type=int, choices=[0, 1, 2, 3], default=2,
      help="ZeRO stage (3: the layers gathered one at a time)")
  add("--grads-in-params", action="store_true",
      help="stage 3 + offload: each layer's gradient written over its weights")
  add("--no-overlap-forward", dest="overlap_forward", action="store_false",
      help="with --grads-in-params: the host update before the next step's forward")
  add("--offload-params", nargs="?", const="all", choices=["all", "auto"],
      help="stage 3 + offload: the layers' weights in pinned host memory (auto: where the "
      "GPU needs it, the first layers that fit kept resident)")
  add("--resident-layers", type=int, help="with --offload-params all: layers kept on the GPU")
  add("--landing-limit-gb", type=float,
      help="the landing buffers' limit (default: the plan's; 0: one whole set)")
  add("--gpus", type=int, default=1, help="GPUs the engine spans (one process, --batch a GPU)")
  add("--host-memory-gb", type=float, help="host RAM the plan may use (default: available)")
  add("--device-memory-gb", type=float, help="GPU memory the plan may use (default: the "
      "allocator's limit)")
  add("--compiled-memory", action="store_true",
      help="record the compiled step's memory analysis (arguments, temporaries)")
  add("--no-breakdown", dest="breakdown", action="store_false",
      help="skip the timings apart: the device step alone, the transfers (GPU)")
  add("--timeout", type=float, default=900, help="seconds a configuration may run")
  add("--child", metavar="CONFIG", help=argparse.SUPPRESS)  # measures one configuration
  return parser


def model_config(args, family: Family):
  """(module, config, params): the preset (or Hugging Face folder) at
  --seq-len, --remat and --n-layer; params None (drawn from the preset) or a
  folder's tree of HostLeaf."""
  if os.path.isdir(args.model):
    from jzo.models import hf
    config, params = hf.param_sources(args.model, remat=args.remat)
    if args.n_layer:
      raise SystemExit("--n-layer cuts a preset, not a Hugging Face folder")
    return hf.family(config), dataclasses.replace(config, seq_len=args.seq_len), params
  modules = [importlib.import_module(m) for m in (family.module, *family.others)]
  models = next((m for m in modules if args.model in m.PRESETS), None)
  if models is None:
    raise SystemExit(f"--model {args.model}: not a preset of {family.module} "
                     f"({', '.join(p for m in modules for p in m.PRESETS)})")
  config = models.PRESETS[args.model]
  cut = {}
  if args.n_layer and hasattr(config, "layer_types"):  # Gemma: the first layers' types
    cut = {"layer_types": config.layer_types[:args.n_layer]}
  config = dataclasses.replace(config, seq_len=args.seq_len, remat=args.remat,
                               n_layer=args.n_layer or config.n_layer, **cut)
  return models, config, None


def gib(nbytes) -> float:
  return nbytes / 2**30


def before_jax(args, family: Family, name: str) -> None:
  """What must precede JAX's GPU backend, as in the recipe: XLA may hand out
  95% of a GPU, and with offload its pinned pool is not rounded up past the
  landing buffers (at most 2 B a parameter)."""
  from jzo.recipe.loop import claim_gpu_memory
  claim_gpu_memory()
  if CONFIGS[name] is not False:
    import jzo
    jzo.plan.limit_pinned_pool(2 * model_config(args, family)[1].n_params, args.gpus)


def build(args, family: Family, name: str):
  """The engine of configuration `name` over the first --gpus devices, and
  the activation bytes the plan makes room for at each micro-batch."""
  offload = CONFIGS[name]
  models, config, params = model_config(args, family)
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import jzo
  devices = jax.devices()
  if args.gpus > len(devices):
    raise SystemExit(f"--gpus {args.gpus}: {len(devices)} {devices[0].platform} devices here")
  moments = {"fp32": None, "bf16": jnp.bfloat16, "int8": jnp.int8}[args.moments]
  tx = (jzo.cpu_adamw(3e-4, weight_decay=0.1, mu_dtype=moments, nu_dtype=moments) if offload
        else optax.adamw(3e-4, weight_decay=0.1, mu_dtype=moments))
  # With the layers first (grads_in_params and accumulation), every
  # micro-batch's layer inputs are kept.
  first = ((args.grads_in_params or args.offload_params) and args.grad_accum > 1
           and args.accumulation in ("auto", "layers"))
  activations = {micro: models.activation_bytes(config, micro, args.seq_len,
                                                accumulation=args.grad_accum if first else 1)
                 for micro in args.batch}
  in_gib = lambda x: None if x is None else int(x * 2**30)
  if params is None:  # drawn leaf by leaf
    params = functools.partial(models.init_params, config, jax.random.PRNGKey(0))
  options = jzo.EngineOptions(
      stage=args.stage, layers=family.layers if args.stage == 3 else None, max_grad_norm=1.0,
      grad_accum=args.grad_accum, offload=offload,
      accumulation=args.accumulation if offload else "auto", delayed_update=name.endswith("_dpu"),
      dpu_warmup=1, grads_in_params=args.grads_in_params, overlap_forward=args.overlap_forward,
      offload_params={None: False, "all": True, "auto": "auto"}[args.offload_params],
      resident_layers=args.resident_layers, landing_limit=in_gib(args.landing_limit_gb))
  engine = jzo.ZeroEngine(functools.partial(models.loss_fn, config), params, tx, options,
                          mesh=jax.sharding.Mesh(np.array(devices[:args.gpus]), ("data",)),
                          activation_memory=max(activations.values()),
                          host_memory=in_gib(args.host_memory_gb),
                          device_memory=in_gib(args.device_memory_gb))
  return engine, config, activations


def measure_config(args, family: Family, name: str) -> list[dict]:
  """In a child: builds configuration `name` and measures it at each
  micro-batch; its points."""
  before_jax(args, family, name)
  import jax
  jax.devices()  # the runtime's own host memory counts as the baseline
  rss_before = harness.host_rss_gib()
  start = time.perf_counter()
  engine, config, activations = build(args, family, name)
  build_s = time.perf_counter() - start
  print(engine.plan, file=sys.stderr, flush=True)
  points = [dict(measure(args, engine, config, micro, activations[micro]), config=name,
                 build_s=build_s, host_rss_before_gib=rss_before)
            for micro in args.batch]
  on_gpu = jax.devices()[0].platform != "cpu"
  host_grads = engine.host_update is not None and engine.state.grads is not None
  if args.breakdown and on_gpu and host_grads:
    points[-1].update(transfer_bandwidth(engine))
  engine.close()
  return points


def measure(args, engine, config, micro: int, activations: int) -> dict:
  """Warm-up and timed steps of `engine` at micro-batch `micro`: one point,
  the measured figures beside the plan's."""
  import jax
  import jax.numpy as jnp
  plan, offload = engine.plan, engine.host_update is not None
  batch_size = micro * args.grad_accum * args.gpus
  batch = {"tokens": jax.random.randint(jax.random.PRNGKey(1), (batch_size, args.seq_len + 1),
                                        0, config.vocab_size, jnp.int32)}
  point = {}
  if args.compiled_memory:
    m = engine.lower(batch).compile().memory_analysis()
    point["compiled_gib"] = {k: round(gib(getattr(m, f"{k}_size_in_bytes")), 3) for k in
                             ("argument", "output", "alias", "temp", "host_temp")}
  for _ in range(3):  # compile, warm up, start the delayed updates
    jax.block_until_ready(engine.step(batch).loss)
  times, timings = [], []
  for _ in range(args.steps):
    start = time.perf_counter()
    jax.block_until_ready(engine.step(batch).loss)
    times.append(time.perf_counter() - start)
    timings.append(dict(engine.host_timings))
  step_s = statistics.median(times)
  tokens_per_s = batch_size * args.seq_len / step_s
  device = jax.devices()[0]
  point.update(
      status="ok", model=args.model, n_layer=config.n_layer, n_params=config.n_params,
      moments=args.moments, batch=micro, grad_accum=args.grad_accum, seq_len=args.seq_len,
      gpus=args.gpus, stage=plan.stage, grads_in_params=plan.grads_in_params,
      layers_first=plan.layers_first, offload_params=plan.offload_params,
      resident_layers=plan.resident_layers, overlaps_update=engine.overlaps_update,
      step_s=step_s, times_s=times, tokens_per_s=tokens_per_s,
      flops_per_token=config.flops_per_token(args.seq_len),
      tflops=tokens_per_s * config.flops_per_token(args.seq_len) / args.gpus / 1e12,  # a GPU
      # The process's peaks so far: with several micro-batches, the largest yet.
      peak_gpu_gib=harness.device_peak_gib(), host_rss_gib=harness.host_rss_gib(),
      host_rss_peak_gib=harness.host_peak_rss_gib(), device=device.device_kind,
      offloaded_fraction=plan.offloaded_fraction if offload else 0.0,
      # The planner's figures for this run: the step's GPU peak, the
      # build's (the state beside the largest leaf drawn in float32), the
      # host's state and its total (state, pinned pools, runtime).
      planned_gpu_gib=gib(sum(plan.device_peak(activations).values())),
      planned_build_gib=gib(sum(plan.device_bytes().values()) + plan.build_bytes()),
      planned_host_state_gib=gib(sum(plan.host_bytes().values())) if offload else 0.0,
      planned_host_gib=gib((sum(plan.host_bytes().values()) + plan.pool_overhead()
                            if offload else 0) + plan.runtime_bytes),
      host_state_gib=gib(engine.host_bytes_in_use()))
  if offload:
    engine.wait()  # no delayed update may share the timings below
    median = lambda key: statistics.median(t[key] for t in timings)
    point.update(host_update_s=median("update"), exchange_tail_s=median("upload"),
                 host_update_gparam_s=plan.host_elements / median("update") / 1e9,
                 streamed=plan.streamed)
    if plan.host_accumulation:
      point.update(host_accumulate_s=median("accumulate"), wait_micro_s=median("wait_micro"))
    if args.breakdown and not plan.grads_in_params:
      # The device step alone: forward, backward, the device part's update
      # (under grads_in_params it would remake the layers' weights too).
      point["device_step_s"] = harness.timed(
          lambda: jax.block_until_ready(engine.run_device_step(batch)))
  print("point:", point, file=sys.stderr, flush=True)  # in the log if a later one fails
  return point


def transfer_bandwidth(engine) -> dict:
  """GB/s of the engine's own pinned transfers: every host part's gradient
  down, then the same bytes up, one set of landing buffers at a time."""
  import jax
  transfer, grads = engine.host_update.transfer, jax.tree.leaves(engine.state.grads)
  leaves = [i for i, layout in enumerate(transfer.layouts) if layout.on_host]
  down = lambda: jax.block_until_ready({i: transfer.download(i, grads[i]) for i in leaves})
  nbytes = sum(x.nbytes for x in down().values())
  d2h_s = harness.timed(lambda: [x.delete() for x in down().values()])
  landing = down()
  h2d_s = harness.timed(lambda: [transfer.upload(i, landing[i]).delete() for i in leaves])
  return {"d2h_gb_s": nbytes / d2h_s / 1e9, "h2d_gb_s": nbytes / h2d_s / 1e9}


def failure_fields(args, family: Family, name: str) -> dict:
  """What a point that did not train says of its model."""
  try:
    _, config, _ = model_config(args, family)
    sizes = {"n_layer": config.n_layer, "n_params": config.n_params}
  except (SystemExit, OSError, ValueError):
    sizes = {}
  return dict(config=name, model=args.model, moments=args.moments, batch=args.batch[0],
              seq_len=args.seq_len, gpus=args.gpus, stage=args.stage, **sizes)


def summary(points: list[dict]) -> str:
  """A table of the points, one line each."""
  lines = [f"{'config':<12} {'batch':>5} {'s/step':>7} {'tokens/s':>9} {'TFLOPS':>7} "
           f"{'GPU GiB (plan)':>15} {'host GiB (plan)':>16} {'host %':>6}  breakdown"]
  for p in points:
    if p["status"] != "ok":
      lines.append(f"{p.get('config', ''):<12} {p['status']}: {(p.get('detail') or [''])[-1]}")
      continue
    parts = []
    if "device_step_s" in p:
      parts.append(f"device step {p['device_step_s']:.3f} s")
    if "host_update_s" in p:
      parts.append(f"host update {p['host_update_s']:.3f} s "
                   f"({p['host_update_gparam_s']:.2f} Gparam/s), after it "
                   f"{p['exchange_tail_s']:.3f} s")
    if "d2h_gb_s" in p:
      parts.append(f"pinned down {p['d2h_gb_s']:.1f} GB/s, up {p['h2d_gb_s']:.1f} GB/s")
    lines.append(
        f"{p['config']:<12} {p['batch']:>5} {p['step_s']:7.3f} {p['tokens_per_s']:9.0f} "
        f"{p['tflops']:7.1f} {p['peak_gpu_gib']:6.2f} ({p['planned_gpu_gib']:6.2f}) "
        f"{p['host_rss_peak_gib']:7.2f} ({p['planned_host_gib']:6.2f}) "
        f"{100 * p['offloaded_fraction']:6.1f}  {'; '.join(parts)}")
  return "\n".join(lines)


def main(doc: str, family: Family, benchmark: str) -> None:
  """A benchmark's main: a child measures one configuration (--child); the
  parent runs one child a configuration and writes the record."""
  args = add_flags(harness.parser(doc), family).parse_args()
  if args.child:
    harness.child_result(measure_config(args, family, args.child))
    return
  points = []
  for name in args.configs:
    cmd = [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:], "--child", name]
    for point in harness.run_child(cmd, timeout_s=args.timeout):
      points.append(point if point["status"] == "ok"
                    else dict(failure_fields(args, family, name), **point))
  harness.write_record(args.json, benchmark, args, points, with_devices=False)
  print(summary(points))
  harness.child_result(points)
