"""`python -m jzo.generate`: text from a trained model, streamed as it comes.

The model is a training run (`--run DIR`: its latest checkpoint, model and
tokenizer, no training flags repeated) or a Hugging Face folder (`--hf DIR`,
jzo's exports included). The prompt is raw text (`--prompt`, or standard
input), or with `--chat` a user turn through the tokenizer's chat template;
`--chat` with no prompt is a conversation at the terminal. `--input FILE`
(JSONL) generates for many prompts, batched, into `--output` (or stdout).
Only the completion goes to stdout, so the command can be piped; errors are
one line on stderr.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import pathlib
import sys
from typing import Iterator, Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jzo.models import decoding, gpt2_hf, hf, hf_files
from jzo.recipe import config as config_lib, export, runs, tokens as tokens_lib

# Tokens that end a chat turn in the templates of the common families
# (Llama 3, Qwen/ChatML, Phi, Gemma), besides the tokenizer's eos.
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
               "<|endoftext|>")


class GenerateError(ValueError):
  """Bad input to jzo.generate (a missing folder, checkpoint or tokenizer, a
  prompt that does not fit), said in one line."""


@dataclasses.dataclass(frozen=True)
class Model:
  """What generation needs of a model: its config and params (in the
  dtype to compute in), its tokenizer, and the ids that end a completion."""
  config: object
  params: dict
  tokenizer: tokens_lib.Tokenizer
  stop_ids: frozenset[int]


def load_run(run: str | pathlib.Path, step: int | None = None,
             tokenizer: str | None = None) -> tuple[object, dict, tokens_lib.Tokenizer, list]:
  """(model config, float32 params, tokenizer, eos ids) of a training run's
  checkpoint (the latest complete one, or `step`); `tokenizer`: a folder
  whose tokenizer replaces the run's."""
  run = pathlib.Path(run)
  try:
    step, config, params = export.load_run(run, step)
    found = (tokens_lib.load_tokenizer(tokenizer) if tokenizer
             else export.run_tokenizer(run))
  except (ValueError, OSError) as e:
    raise GenerateError(str(e)) from e
  if found is None:
    raise GenerateError(f"{run} trained on token ids (a .bin file) and knows no tokenizer: "
                        "--tokenizer DIR names one")
  return config, params, found, _eos_ids(runs.model_folder(run))


def load_hf(folder: str | pathlib.Path, tokenizer: str | None = None):
  """(model config, float32 params, tokenizer, eos ids) of a Hugging Face
  folder: a model of a Hugging Face family jzo reads, GPT-2 among them
  (jzo's exports too)."""
  folder = pathlib.Path(folder)
  try:
    model_type = hf_files.read_config(str(folder)).get("model_type")
    if model_type == "gpt2":
      config, params = gpt2_hf.read_config(str(folder)), gpt2_hf.load_params(str(folder))
    else:
      config, sources = hf.param_sources(str(folder))
      params = jax.tree.map(lambda leaf: leaf.load().astype(np.float32), sources)
    source = pathlib.Path(tokenizer or folder)
    if not (source / "tokenizer.json").is_file():
      raise GenerateError(f"{source} has no tokenizer.json: --tokenizer DIR names a folder "
                          "that has one")
    found = tokens_lib.load_tokenizer(source)
  except (ValueError, OSError) as e:
    raise GenerateError(str(e)) from e
  return config, params, found, _eos_ids(folder)


def _eos_ids(folder: pathlib.Path) -> list[int]:
  """The eos ids a Hugging Face folder names in config.json and
  generation_config.json (what transformers' generate stops at)."""
  ids = []
  for name in ("config.json", "generation_config.json"):
    try:
      eos = json.loads((folder / name).read_text()).get("eos_token_id")
    except (OSError, ValueError):
      continue
    ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
  return ids


def stop_ids(tokenizer: tokens_lib.Tokenizer, eos: list[int], chat: bool) -> frozenset[int]:
  """Where a completion ends: the model's and the tokenizer's eos, and in a
  chat the special tokens that end a turn."""
  ids = set(eos) | ({tokenizer.eos_id} if tokenizer.eos_id is not None else set())
  if chat:
    ids |= {i for i in tokenizer.special_ids
            if tokenizer.backend.id_to_token(i) in END_OF_TURN}
  return frozenset(ids)


def compute_dtype(name: str):
  """The params' dtype for `--dtype` (auto: bfloat16 on an accelerator, float32 on CPU)."""
  if name == "auto":
    name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
  return {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[name]


def prompt_ids(model: Model, prompt: str | list[dict], chat: bool) -> list[int]:
  """Token ids of a raw prompt (after bos where the tokenizer adds one), or
  of messages (`prompt` a list of {role, content}, or text as a user turn
  when `chat`) rendered by the chat template with the assistant's turn opened."""
  tokenizer = model.tokenizer
  if isinstance(prompt, list) or chat:
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if tokenizer.chat_template is None:
      raise GenerateError("the tokenizer has no chat template: leave out --chat, or give a "
                          "tokenizer that has one (--tokenizer DIR)")
    return tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=True))
  ids = tokenizer.encode(prompt)
  if tokenizer.add_bos and tokenizer.bos_id is not None:
    ids = [tokenizer.bos_id] + ids
  return ids


class TextStream:
  """Text of token ids that arrive one at a time: `add(id)` returns what is
  new and whole (a character split over tokens waits for its last byte).
  Each call decodes only the last few tokens: the ones already shown from
  `shown_from` (whose text it subtracts, so a decoder that treats the first
  token of a piece apart still joins them right) and the new ones."""

  def __init__(self, tokenizer: tokens_lib.Tokenizer):
    self.tokenizer, self.ids = tokenizer, []
    self.shown_from = self.shown_to = 0  # ids[shown_from:shown_to]: shown, decoded again

  def _decode(self, ids: list[int]) -> str:
    return self.tokenizer.backend.decode(ids, skip_special_tokens=True)

  def add(self, token: int) -> str:
    self.ids.append(token)
    new = self.rest()
    if not new or new.endswith("\ufffd"):
      return ""
    self.shown_from, self.shown_to = self.shown_to, len(self.ids)
    return new

  def rest(self) -> str:
    """The text of the ids not shown yet (a character cut short included)."""
    shown = self._decode(self.ids[self.shown_from:self.shown_to])
    return self._decode(self.ids[self.shown_from:])[len(shown):]

  def text(self) -> str:
    return self._decode(self.ids)


def complete(generator: decoding.Generator, model: Model, prompts: list[list[int]],
             max_new_tokens: int, sampling: decoding.Sampling,
             on_token=None) -> Iterator[tuple[str, str]]:
  """(text, finish reason: "stop" or "length") of each prompt's completion,
  in order; on_token(text) gets the first row's new text as it comes."""
  streams = [TextStream(model.tokenizer) for _ in prompts]
  done = [None] * len(prompts)
  try:
    for step in generator.stream(prompts, max_new_tokens, sampling):
      for row, token in enumerate(step.tolist()):
        if done[row] is None:
          if token in model.stop_ids:
            done[row] = "stop"
            continue
          new = streams[row].add(token)
          if row == 0 and on_token is not None and new:
            on_token(new)
      if all(done):
        break
  except ValueError as e:
    raise GenerateError(str(e)) from e
  if on_token is not None and streams[0].rest():
    on_token(streams[0].rest())
  for row, stream in enumerate(streams):
    yield stream.text(), done[row] or "length"


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
  """Generate text with a model trained by jzo.train (--run) or a Hugging Face folder (--hf),
  streamed to stdout as it comes: from --prompt or standard input, as a chat turn with --chat
  (a conversation at the terminal when no prompt is given), or for each line of --input. Greedy
  unless --temperature is above 0."""

  run: str | None = None
  """a jzo.train run folder: its latest checkpoint, model and tokenizer"""
  hf: str | None = None
  """a Hugging Face folder (config.json, safetensors weights, tokenizer.json)"""
  step: int | None = None
  """with --run: the checkpoint to use (default: the latest complete one)"""
  tokenizer: str | None = None
  """a folder whose tokenizer.json replaces the model's"""
  prompt: str | None = None
  """the prompt (default: standard input, read to its end)"""
  chat: bool = False
  """the prompt is a user turn, through the tokenizer's chat template"""
  system: str | None = None
  """with --chat: a system message before the conversation"""
  input: str | None = None
  """a JSONL file of prompts: {"prompt": text} or {"messages": [{"role", "content"}, ...]}"""
  output: str | None = None
  """with --input: the JSONL file to write (default: stdout), each line its input and completion"""
  batch_size: int = 16
  """with --input: prompts generated together"""
  max_new_tokens: int = 256
  """the most tokens a completion may have"""
  temperature: float = 0.0
  """0: greedy (the most likely token); above 0: sample from softmax(logits / temperature)"""
  top_k: int = 0
  """sample among the k most likely tokens (0: all)"""
  top_p: float = 1.0
  """sample among the most likely tokens whose probabilities add up to top_p"""
  seed: int = 0
  """the random draws are a function of the seed"""
  dtype: Literal["auto", "float32", "bfloat16"] = "auto"
  """of the weights: auto is bfloat16 on a GPU, float32 on a CPU"""
  compile_cache: str | None = None
  """folder that keeps compiled programs for later runs (a first run on a GPU compiles for tens
  of seconds); default: $JAX_COMPILATION_CACHE_DIR, else ~/.cache/jzo/xla; "" for none"""


def check(cfg: GenerateConfig) -> decoding.Sampling:
  """The sampling of a config whose options agree, else GenerateError naming them."""
  if (cfg.run is None) == (cfg.hf is None):
    raise GenerateError("give one model: --run DIR (a jzo.train run) or --hf DIR "
                        "(a Hugging Face folder)")
  if cfg.input is None and cfg.output is not None:
    raise GenerateError("--output needs --input")
  if cfg.input is not None and cfg.prompt is not None:
    raise GenerateError("give --prompt or --input, not both")
  if cfg.system is not None and not cfg.chat:
    raise GenerateError("--system needs --chat")
  if cfg.max_new_tokens < 1 or cfg.batch_size < 1:
    raise GenerateError("--max-new-tokens and --batch-size must be >= 1")
  try:
    return decoding.Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)
  except ValueError as e:
    raise GenerateError(str(e).replace("top_", "--top-").replace("temperature", "--temperature"))


def load(cfg: GenerateConfig) -> Model:
  """The model, params in the compute dtype on the default device."""
  if cfg.run is not None:
    config, params, tokenizer, eos = load_run(cfg.run, cfg.step, cfg.tokenizer)
  else:
    config, params, tokenizer, eos = load_hf(cfg.hf, cfg.tokenizer)
  dtype = compute_dtype(cfg.dtype)
  params = jax.tree.map(lambda x: jnp.asarray(x.astype(dtype)), params)
  return Model(config, params, tokenizer, stop_ids(tokenizer, eos, cfg.chat))


def _records(path: str) -> Iterator[tuple[int, dict]]:
  """(line number, record) of a JSONL file of prompts."""
  try:
    lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise GenerateError(f"--input {path}: {e}") from e
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except ValueError as e:
      raise GenerateError(f"{path} line {number}: not JSON ({e})") from e
    if not isinstance(record, dict) or not (isinstance(record.get("prompt"), str)
                                            or isinstance(record.get("messages"), list)):
      raise GenerateError(f"{path} line {number}: each line needs a \"prompt\" (text) or "
                          "\"messages\" (a list of {role, content})")
    yield number, record


def run_batch(cfg: GenerateConfig, model: Model, generator: decoding.Generator,
              sampling: decoding.Sampling) -> None:
  """Completions of every line of --input, --batch-size at a time, written as JSONL."""
  records = list(_records(cfg.input))
  out = open(cfg.output, "w", encoding="utf-8") if cfg.output else sys.stdout
  try:
    for start in range(0, len(records), cfg.batch_size):
      batch = records[start:start + cfg.batch_size]
      ids = []
      for number, record in batch:
        try:
          ids.append(prompt_ids(model, record.get("messages") or record["prompt"], cfg.chat))
        except ValueError as e:
          raise GenerateError(f"{cfg.input} line {number}: {e}") from e
      try:
        results = list(complete(generator, model, ids, cfg.max_new_tokens, sampling))
      except GenerateError as e:
        raise GenerateError(f"{cfg.input} lines {batch[0][0]}-{batch[-1][0]}: {e}") from e
      for (_, record), (text, reason) in zip(batch, results):
        out.write(json.dumps(record | {"completion": text, "finish_reason": reason},
                             ensure_ascii=False) + "\n")
      out.flush()
  finally:
    if out is not sys.stdout:
      out.close()


def converse(cfg: GenerateConfig, model: Model, generator: decoding.Generator,
             sampling: decoding.Sampling) -> None:
  """A conversation: each line of standard input a user turn, each reply
  streamed; the messages so far go with every turn. Ends at end of input."""
  messages = [{"role": "system", "content": cfg.system}] if cfg.system else []
  interactive = sys.stdin.isatty()
  while True:
    if interactive:
      print("> ", end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    if not line:
      return
    if not line.strip():
      continue
    messages.append({"role": "user", "content": line.rstrip("\n")})
    ids = prompt_ids(model, messages, chat=True)
    text, _ = next(complete(generator, model, [ids], cfg.max_new_tokens, sampling, _show))
    print(flush=True)
    messages.append({"role": "assistant", "content": text})


def _show(text: str) -> None:
  print(text, end="", flush=True)


def compile_cache(flag: str | None) -> str | None:
  """The folder of JAX's persistent compilation cache for --compile-cache (None: none)."""
  if flag is None:
    flag = os.environ.get("JAX_COMPILATION_CACHE_DIR") or "~/.cache/jzo/xla"
  return str(pathlib.Path(flag).expanduser()) if flag else None


def main(argv: list[str] | None = None) -> int:
  cfg = config_lib.parse(GenerateConfig, argv, prog="python -m jzo.generate",
                         description=inspect.cleandoc(GenerateConfig.__doc__))
  try:
    sampling = check(cfg)
    if cfg.input is None and cfg.prompt is None and not cfg.chat and sys.stdin.isatty():
      raise GenerateError("give a prompt: --prompt TEXT, standard input, --chat or --input FILE")
    jax.config.update("jax_compilation_cache_dir", compile_cache(cfg.compile_cache))
    model = load(cfg)
    generator = decoding.Generator(model.config, model.params)
    if cfg.input is not None:
      run_batch(cfg, model, generator, sampling)
    elif cfg.prompt is None and cfg.chat:
      converse(cfg, model, generator, sampling)
    else:
      prompt = cfg.prompt if cfg.prompt is not None else sys.stdin.read()
      messages = ([{"role": "system", "content": cfg.system}] if cfg.system else [])
      source = messages + [{"role": "user", "content": prompt}] if cfg.chat else prompt
      ids = prompt_ids(model, source, cfg.chat)
      next(complete(generator, model, [ids], cfg.max_new_tokens, sampling, _show))
      print(flush=True)
  except GenerateError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0
