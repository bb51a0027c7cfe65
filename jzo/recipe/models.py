"""The models the recipe trains: presets of every family in jzo.models, and
checkpoints in Hugging Face format, with the training defaults that suit each.

A `Model` is what the run loop needs of a model whatever its family: its
config, the family's functions (`init_params`, `loss_fn`, `forward`,
`generate`, `activation_bytes`), where its stacked layers are (ZeRO stage 3
gathers them one at a time), which leaves take weight decay, and the
learning rate and warm-up to start from.

Learning rates, where published (peak, before a cosine decay):
  GPT-2 shapes: GPT-3's for the same sizes (Brown et al. 2020, table 2.1),
    warm-up over the first 375M tokens.
  Llama 2 pre-training 3e-4, 2,000 warm-up steps (Touvron et al. 2023,
    section 2.2); its chat fine-tuning 2e-5 (section 3.1).
  Llama 3 pre-training 3e-4 for 8B, 8,000 warm-up steps; fine-tuning 1e-5
    (Llama Team 2024, sections 3.4.1 and 4.1.6).
  Qwen2.5 fine-tuning from 7e-6 down to 7e-7 (Qwen team 2024, section 4.1),
    for every Qwen model.
  Others (Mistral, Mixtral, Phi, Gemma, Qwen pre-training: not published):
  2e-5 to fine-tune, 3e-4 to pre-train.
Fine-tuning warms up over 3% of the steps (Alpaca's and TRL's default).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Callable

from jzo.models import gemma, gpt, llama


@dataclasses.dataclass(frozen=True)
class Defaults:
  """Training defaults of a preset (see the module docstring for sources)."""
  lr: float  # peak learning rate training from scratch
  warmup_tokens: float | None  # tokens of linear warm-up from scratch (None: a tenth of the run)
  finetune_lr: float  # peak learning rate fine-tuning from a checkpoint


FINETUNE_WARMUP_FRACTION = 0.03
# Llama 3's and Llama 2's published schedules, in tokens (steps x their
# 4M- and 16M-token batches).
_LLAMA3 = Defaults(lr=3e-4, warmup_tokens=8000 * 4e6, finetune_lr=1e-5)
_LLAMA2 = Defaults(lr=3e-4, warmup_tokens=2000 * 4e6, finetune_lr=2e-5)
_QWEN25 = Defaults(lr=3e-4, warmup_tokens=2000 * 4e6, finetune_lr=7e-6)
_OTHER = Defaults(lr=3e-4, warmup_tokens=2000 * 4e6, finetune_lr=2e-5)
# 70B-class models from scratch: Llama 2's peak rate for its 34B and 70B
# (Qwen publishes none).
_LLAMA3_70B = dataclasses.replace(_LLAMA3, lr=1.5e-4)
_QWEN25_72B = dataclasses.replace(_QWEN25, lr=1.5e-4)
# The tiny presets train from scratch on bytes in minutes on a CPU: a small
# model takes a large rate.
_TINY = Defaults(lr=3e-3, warmup_tokens=None, finetune_lr=2e-5)
_GPT3_WARMUP = 375e6


@dataclasses.dataclass(frozen=True)
class Family:
  """What the recipe needs of a family module (jzo.models.gpt, .llama, ...)."""
  module: types.ModuleType
  layers: str  # dotted path of the stacked layers (stage 3 gathers one at a time)
  decays: Callable[[str], bool]  # weight decay on a leaf, by its last key


# Matrices and embeddings decay; norm scales and biases do not.
GPT = Family(gpt, "blocks", lambda key: key in ("wte", "wpe", "kernel"))
_NOT_SCALE_OR_BIAS = lambda key: key not in ("scale", "bias")
LLAMA = Family(llama, llama.LAYERS, _NOT_SCALE_OR_BIAS)
GEMMA = Family(gemma, gemma.LAYERS, _NOT_SCALE_OR_BIAS)


@dataclasses.dataclass(frozen=True)
class Model:
  """One model of a run: its family, config and training defaults."""
  name: str  # the preset, or the Hugging Face folder it came from
  family: Family
  config: Any  # the family's frozen config
  defaults: Defaults

  @property
  def max_seq_len(self) -> int:
    """Longest context the model takes."""
    return self.config.seq_len

  def init_params(self, key):
    return self.family.module.init_params(self.config, key)

  def loss_fn(self, params, batch):
    return self.family.module.loss_fn(self.config, params, batch)

  def activation_bytes(self, micro_batch: int, seq_len: int, accumulation: int = 1) -> int:
    """Bytes of activations one device needs for `micro_batch` sequences
    (with `accumulation` micro-batches whose layers run first)."""
    return self.family.module.activation_bytes(self.config, micro_batch, seq_len,
                                               accumulation=accumulation)

  def decay_mask(self, params):
    """Tree of bools: weight decay on each leaf of `params`."""
    import jax
    return jax.tree_util.tree_map_with_path(lambda path, _: self.family.decays(path[-1].key),
                                            params)


def _gpt_defaults(config: gpt.GPTConfig) -> Defaults:
  """GPT-3's learning rate for the nearest size (table 2.1)."""
  sizes = [(125e6, 6e-4), (350e6, 3e-4), (760e6, 2.5e-4), (1.3e9, 2e-4), (2.7e9, 1.6e-4),
           (6.7e9, 1.2e-4), (13e9, 1e-4)]
  lr = min(sizes, key=lambda s: abs(math.log(s[0] / config.n_params)))[1]
  return Defaults(lr=lr, warmup_tokens=_GPT3_WARMUP, finetune_lr=2e-5)


_LLAMA_DEFAULTS = {"llama-3.2-1b": _LLAMA3, "llama-3.2-3b": _LLAMA3, "llama-3.1-8b": _LLAMA3,
                   "llama-3.1-70b": _LLAMA3_70B, "llama-2-13b": _LLAMA2, "mistral-7b": _OTHER,
                   "qwen2.5-7b": _QWEN25, "qwen2.5-14b": _QWEN25, "qwen2.5-72b": _QWEN25_72B,
                   "phi-4": _OTHER, "qwen3-30b-a3b": _QWEN25, "mixtral-8x7b": _OTHER}


def _presets() -> dict[str, Model]:
  out = {}
  for name, config in gpt.PRESETS.items():
    out[name] = Model(name, GPT, config, _TINY if name == "tiny" else _gpt_defaults(config))
  for name, config in llama.PRESETS.items():
    out[name] = Model(name, LLAMA, config, _LLAMA_DEFAULTS.get(name, _TINY))
  for name, config in gemma.PRESETS.items():
    out[name] = Model(name, GEMMA, config, _TINY if name == "gemma-tiny" else _OTHER)
  return out


PRESETS = _presets()
# A Hugging Face family's model module -> its Family.
_HF_FAMILIES = {f.module: f for f in (LLAMA, GEMMA)}


def from_hf(folder: str) -> tuple[Model, Any]:
  """(the Model of a Hugging Face folder, its params as lazy leaves that
  read one tensor stack at a time; see jzo.models.hf).

  Raises:
    FileNotFoundError, ValueError: the folder, its config or weights, named.
  """
  from jzo.models import hf  # its readers matter only to fine-tuning
  config, params = hf.param_sources(folder)
  if config.model_type == "gemma3":
    # An image-text Gemma 3's text model trains; it is kept, and exported, as one.
    config = dataclasses.replace(config, model_type="gemma3_text")
  if config.model_type.startswith("qwen"):
    defaults = _QWEN25
  elif config.model_type == "llama":
    defaults = _LLAMA3 if config.rope_type == "llama3" else _LLAMA2
  else:
    defaults = _OTHER
  return Model(folder, _HF_FAMILIES[hf.family(config)], config, defaults), params
