"""A full fine-tune of a Hugging Face folder through the recipe, as a user runs it, at shapes
no checkpoint can be downloaded for here: speed, memory against the plan, and the export.

Writes a folder of --model's shape (synthetic_checkpoint.py's random bf16 shards and byte
tokenizer) and chat JSONL (conversations cut from Python's standard library sources, enough
for the run), or takes --init-from and --data; then runs

  python -m jzo.train --init-from DIR --data CHAT --steps N --log-every 1
      --checkpoint-every 0 --sample-tokens 0 --export WORK/export [options passed through]

in a process of its own, every option this script does not know passed through as given
(e.g. --seq-len 4096 --batch-size 32 --stage 3 --grads-in-params --moments int8), sampling
every --interval s its host RSS, its GPU memory and the allocator's peak its log lines print
(soak.py's Watch). With --drop-input, once the first step has logged, the input's shards are
removed but the one holding --check-tensor: the disk then needs room for the model once, not
twice (a 70B model's bf16 weights are 141 GB).

Reported: the median step time, tokens/s and model TFLOPS a GPU of the steps after the first
two (which compile); the GPU and host peaks against the plan the recipe printed (its "total
(peak)" a device and its host "total"), and the host's peak before the first step (the
import, leaf by leaf); the export's seconds; and the export checked: transformers reads its
config and index (where transformers is installed), every tensor the index names is in its
shard, and --check-tensor has the input's shape and differs from the input's by at most what
the run's Adam steps and bf16 rounding allow (each step moves an element by about the
learning rate), and somewhere by more than nothing.

  python3 benchmarks/finetune_hf.py --model llama-3.1-70b --steps 6 --drop-input \\
      --work /tmp/llama-70b --seq-len 4096 --batch-size 32 --stage 3 --grads-in-params \\
      --moments int8
  python3 benchmarks/finetune_hf.py --model llama-tiny --vocab-size 320 --steps 3 \\
      --work /tmp/tiny --seq-len 64 --batch-size 4 --stage 3 --grads-in-params   # a CPU
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time

import numpy as np

from jzo.models import hf_files

import harness
import soak
import synthetic_checkpoint

# Options of the recipe this script sets itself.
SET_HERE = ("--init-from", "--data", "--steps", "--log-every", "--checkpoint-every",
            "--sample-tokens", "--export", "--out", "--resume", "--sample", "--eval-every")
# The plan's totals as the recipe prints it (jzo.plan.format_plan): the first is a device's.
PLAN_TOTAL = re.compile(r"^  total(?: \(peak\))?\s+([\d.]+) (GiB|MiB|KiB)")
UNITS = {"GiB": 1, "MiB": 2**-10, "KiB": 2**-20}


def chat_jsonl(path: pathlib.Path, n_bytes: int) -> int:
  """Writes conversations of at least `n_bytes` of text to `path`: a user
  asks about one of the standard library's sources, the assistant answers
  with a part of it (about 3,000 bytes); their count."""
  sources = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
  count = written = 0
  with open(path, "w") as f:
    while written < n_bytes:
      source = sources[count % len(sources)]
      text = source.read_text(errors="replace")
      part = (count // len(sources)) * 3000 % max(len(text), 1)
      answer = text[part:part + 3000] or text[:3000]
      f.write(json.dumps({"messages": [
          {"role": "user", "content": f"Show part {count} of {source.name}."},
          {"role": "assistant", "content": answer}]}) + "\n")
      written, count = written + len(answer), count + 1
  return count


def option(extra: list[str], name: str) -> str | None:
  """The value of recipe option `name` among `extra` (--name V or --name=V)."""
  for i, arg in enumerate(extra):
    if arg == name and i + 1 < len(extra):
      return extra[i + 1]
    if arg.startswith(name + "="):
      return arg.split("=", 1)[1]
  return None


def planned(log: pathlib.Path) -> tuple[float | None, float | None]:
  """(a device's peak, the host's total) in GiB from the plan the recipe printed."""
  totals = [float(m[1]) * UNITS[m[2]] for line in log.read_text(errors="replace").splitlines()
            if (m := PLAN_TOTAL.match(line))]
  return (totals[0] if totals else None), (totals[1] if len(totals) > 1 else None)


def located(folder: pathlib.Path, tensor: str) -> tuple[hf_files.Tensor, dict]:
  """Where `tensor` lies in `folder`'s checkpoint, and every tensor of it
  (hf_files.tensors: each shard's header read, each tensor the index names
  found in its shard)."""
  try:
    found = hf_files.tensors(str(folder))
  except (OSError, ValueError) as e:
    raise soak.Failed("error", [str(e)]) from None
  if tensor not in found:
    raise soak.Failed("error", [f"--check-tensor {tensor!r} is not in {folder}"])
  return found[tensor], found


def as_float32(t: hf_files.Tensor) -> np.ndarray:
  """A tensor's values, read from its file, as float32."""
  return np.memmap(t.file, hf_files.DTYPES[t.code], "r", t.offset, t.shape).astype(np.float32)


def drop_shards(folder: pathlib.Path, keep: pathlib.Path) -> int:
  """Removes `folder`'s safetensors shards but `keep`; bytes freed."""
  freed = 0
  for shard in folder.glob("*.safetensors"):
    if shard != keep:
      freed += shard.stat().st_size
      shard.unlink()
  return freed


def check_export(export: pathlib.Path, source: hf_files.Tensor, tensor: str, steps: int,
                 lr: float) -> dict:
  """The export read back: its index's tensors in their shards, and
  `tensor` against the input's `source` (its shape, how far each element moved)."""
  result = {}
  if importlib.util.find_spec("transformers"):
    import transformers
    result["transformers_config"] = type(transformers.AutoConfig.from_pretrained(export)).__name__
  exported, found = located(export, tensor)
  result["tensors"] = len(found)
  result["shards"] = len({t.file for t in found.values()})
  before, after = as_float32(source), as_float32(exported)
  if before.shape != after.shape:
    raise soak.Failed("error", [f"{tensor}: exported shape {after.shape}, the input's "
                                f"{before.shape}"])
  moved = np.abs(after - before)
  # Adam moves an element about the learning rate a step (int8 moments: at
  # most 2.1 times); bf16 rounds the float32 master to 2^-8 of its size.
  bound = 3 * lr * steps + np.abs(before) * 2.0**-8 + 1e-30
  result.update(check_tensor=tensor, elements_moved=float(np.mean(moved > 0)),
                largest_move=float(moved.max()), within_adam=bool(np.all(moved <= bound)))
  return result


def run(args, extra: list[str], work: pathlib.Path) -> dict:
  """Writes the inputs where needed, runs the recipe under a soak.Watch,
  checks the export; the point."""
  point = {"model": args.model or args.init_from}
  source = pathlib.Path(args.init_from) if args.init_from else work / "input"
  if not args.init_from:
    config = synthetic_checkpoint.preset(args.model, args.n_layer, args.vocab_size)
    source.mkdir(parents=True)
    written = synthetic_checkpoint.write_folder(config, source, args.shard_gb)
    point.update(n_params=config.n_params, n_layer=config.n_layer,
                 input_write_s=written["seconds"], input_bytes=written["bytes"])
  data = pathlib.Path(args.data) if args.data else work / "chat.jsonl"
  seq_len, batch = int(option(extra, "--seq-len")), int(option(extra, "--batch-size"))
  if not args.data:
    point["conversations"] = chat_jsonl(data, 2 * (args.steps + 2) * batch * seq_len)
  checked, _ = located(source, args.check_tensor)
  keep = pathlib.Path(checked.file)  # what --drop-input leaves
  out, export, log = work / "run", work / "export", work / "run.log"
  cmd = [sys.executable, "-m", "jzo.train", "--init-from", str(source), "--data", str(data),
         *extra, "--steps", str(args.steps), "--log-every", "1", "--checkpoint-every", "0",
         "--eval-every", str(soak.NEVER), "--sample-tokens", "0", "--export", str(export),
         "--out", str(out)]
  proc = soak.start(cmd, log)
  watch = soak.Watch(proc, out, log)
  dropped = False
  try:
    while proc.poll() is None:
      watch.poll()
      if args.drop_input and watch.steps and not dropped:
        point["input_bytes_dropped"] = drop_shards(source, keep)
        dropped = True
      if watch.now() > args.timeout:
        raise soak.Failed("timeout", [f"still running after {args.timeout:g} s"]
                          + soak.tail(log))
      time.sleep(args.interval)
  finally:
    soak.kill(proc)
  watch.exited = watch.now()
  watch.read(watch.exited)
  if proc.returncode != 0:
    raise soak.failure(proc, log)
  metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  timed = [r for r in metrics if r["step"] > soak.WARMUP_STEPS] or metrics
  devices = re.search(r"(\d+) \w+ device\(s\)", watch.lines.get("banner", ""))
  devices = int(devices[1]) if devices else 1
  first_step = watch.steps[0][1] - watch.steps[0][2] if watch.steps else watch.now()
  gpu_plan, host_plan = planned(log)
  peaks = [s[3] for s in watch.samples if s[3] is not None]
  point.update(
      steps=len(metrics), seq_len=seq_len, batch_size=batch,
      step_s=statistics.median(r["step_s"] for r in timed),
      tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
      devices=devices,
      model_tflops_per_gpu=statistics.median(r["model_tflops"] for r in timed) / devices,
      losses=[r["loss"] for r in metrics],
      allocator_peak_gib=max(peaks) if peaks else None, planned_gpu_gib=gpu_plan,
      host_rss_peak_gib=max(s[1] for s in watch.samples), planned_host_gib=host_plan,
      import_host_peak_gib=max((s[1] for s in watch.samples if s[0] < first_step), default=0),
      export_s=watch.exited - watch.steps[-1][1] if watch.steps else None)
  lr = max(r["lr"] for r in metrics)
  point.update(check_export(export, checked, args.check_tensor, len(metrics), lr))
  point["status"] = "ok"
  return point


def report(point: dict) -> None:
  gib = lambda v: "-" if v is None else f"{v:.2f}"
  print(f"{point['model']}: {point['steps']} steps of {point['batch_size']} x {point['seq_len']}"
        f"; {point['step_s']:.2f} s a step, {point['tokens_per_s']:,.0f} tokens/s, "
        f"{point['model_tflops_per_gpu']:.1f} model TFLOPS a GPU")
  print(f"GPU allocator peak {gib(point['allocator_peak_gib'])} GiB (plan "
        f"{gib(point['planned_gpu_gib'])}); host RSS peak {gib(point['host_rss_peak_gib'])} GiB "
        f"(plan {gib(point['planned_host_gib'])}), before the first step "
        f"{gib(point['import_host_peak_gib'])} GiB")
  print(f"export: {point['tensors']} tensors in {point['shards']} shards, "
        f"{point.get('transformers_config', 'transformers not installed')}; "
        f"{point['check_tensor']}: {100 * point['elements_moved']:.1f}% of its elements moved, "
        f"at most {point['largest_move']:.3g}, within Adam's steps: {point['within_adam']}")


def main() -> None:
  parser = harness.parser(__doc__)
  parser.add_argument("--model", help="a preset of the Hugging Face families to write a folder "
                      "of (synthetic_checkpoint.py)")
  parser.add_argument("--n-layer", type=int, help="layers, instead of the preset's")
  parser.add_argument("--vocab-size", type=int, help="vocabulary, instead of the preset's")
  parser.add_argument("--init-from", help="a Hugging Face folder, instead of --model")
  parser.add_argument("--data", help="chat JSONL (default: written from the standard library)")
  parser.add_argument("--steps", type=int, default=6, help="the recipe's --steps")
  parser.add_argument("--shard-gb", type=float, default=5.0,
                      help="most GB of one shard of the folder written")
  parser.add_argument("--work", help="a folder for the input, the data, the run and the export "
                      "(new, or empty; default: a temporary one, removed)")
  parser.add_argument("--drop-input", action="store_true", help="remove the input's shards, "
                      "but --check-tensor's, once the first step has logged")
  parser.add_argument("--check-tensor", default="model.layers.0.self_attn.q_proj.weight",
                      help="the tensor the export is checked on against the input")
  parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
  parser.add_argument("--timeout", type=float, default=3600, help="seconds the run may take")
  args, extra = parser.parse_known_args()
  if (args.model is None) == (args.init_from is None):
    parser.error("give --model or --init-from, one of them")
  if args.init_from and args.drop_input:
    parser.error("--drop-input removes the input's shards: only with --model, never a folder "
                 "of your own")
  if set_here := [a for a in extra if a.split("=", 1)[0] in SET_HERE]:
    parser.error(f"{' '.join(set_here)}: this script sets it")
  for needed in ("--seq-len", "--batch-size"):
    if not (option(extra, needed) or "").isdigit():
      parser.error(f"give the recipe's {needed} (the chat data is written to last the run)")
  if args.model:
    try:
      synthetic_checkpoint.preset(args.model, args.n_layer, args.vocab_size)
    except ValueError as e:
      parser.error(str(e))
  work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="finetune-hf-"))
  if args.work and work.exists() and any(work.iterdir()):
    parser.error(f"--work {work} holds files")
  work.mkdir(parents=True, exist_ok=True)
  try:
    point = run(args, extra, work)
    report(point)
  except soak.Failed as e:
    point = {"model": args.model or args.init_from, "status": e.status, "detail": e.detail}
    print(f"{e.status}: " + "\n".join(e.detail), file=sys.stderr)
  finally:
    if not args.work:
      shutil.rmtree(work, ignore_errors=True)
  harness.write_record(args.json, "finetune_hf", args, [point])
  sys.exit(0 if point["status"] == "ok" else 1)


if __name__ == "__main__":
  main()
