"""What a model source must pass before anything loads it: a damaged folder, pickle weights, a folder's own Python
code, a config holding NaN or describing a model larger than this machine, each refused in one sentence."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from gcfamily.errors import GcfError
from gcfamily.models.sources import HUB_ALIASES, OFFLINE_ALIASES

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_source(name: str) -> None:
    """Refuse a damaged local model folder in one sentence, reading only its config.json and the weights' headers.

    Aliases and hub ids pass (nothing local to read). Pickle weights are refused, never unpickled: loading
    one runs whatever code the file names.
    """
    if name in OFFLINE_ALIASES or name in HUB_ALIASES:
        return
    p = Path(name).expanduser()
    if not p.exists():
        return
    if not p.is_dir():
        raise GcfError(
            f"Model {name} is a file; point --model at a Hugging Face checkpoint folder (config.json and model.safetensors)."
        )
    config = p / "config.json"
    if not config.is_file():
        raise GcfError(f"Model folder {name} has no config.json; point --model at a Hugging Face checkpoint folder.")
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GcfError(
            f"Model folder {name} has a config.json that is not JSON ({str(e).splitlines()[0][:120]}); restore it from the model's source."
        ) from e
    if not isinstance(parsed, dict):
        raise GcfError(
            f"Model folder {name} has a config.json holding a JSON {type(parsed).__name__}, not an object of settings; restore it from the model's source."
        )
    check_config(parsed, f"Model folder {name} has a config.json whose", "restore it from the model's source")
    weights = sorted(f for f in p.iterdir() if f.suffix == ".safetensors" and not f.name.startswith("adapter_"))
    pickles = sorted(
        f.name
        for f in p.iterdir()
        if f.suffix in PICKLE_SUFFIXES and f.name not in ("training_args.bin", "optimizer.pt", "scheduler.pt")
    )
    if not weights and pickles:
        raise GcfError(
            f"Model folder {name} holds its weights only as pickle ({pickles[0]}), which gcfamily does not load because unpickling can run code; "
            f"convert it to safetensors (from_pretrained it where you trust the file, then save_pretrained(folder, safe_serialization=True))."
        )
    if not weights:
        raise GcfError(
            f"Model folder {name} has no model.safetensors; point --model at a folder holding the weights as well as config.json."
        )
    from safetensors import safe_open

    for f in weights:
        try:
            with safe_open(str(f), framework="pt"):  # reads the header and checks it covers the whole file
                pass
        except Exception as e:  # SafetensorError, OSError: a truncated, overwritten or unreadable file
            raise GcfError(
                f"Model weights {f} are damaged or not safetensors ({str(e).splitlines()[0][:120]}); copy the file again from its source."
            ) from e


CODE_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")
"""The files whose `auto_map` makes transformers import a folder's own Python code."""


def refuse_remote_code(source: str, trust_remote_code: bool, what: str = "Model folder") -> None:
    """Refuse, in one sentence, a local folder that ships its own code (`auto_map`) unless --trust-remote-code was given.

    Checked before any load, so that transformers never reaches its interactive "run the custom code? [y/N]" prompt
    (which reads stdin, where a `y` would run the folder's Python file); every load passes the flag explicitly too.
    """
    if trust_remote_code:
        return
    p = Path(source).expanduser()
    if not p.is_dir():
        return
    for name in CODE_FILES:
        f = p / name
        try:
            parsed = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None
        except (OSError, UnicodeDecodeError, ValueError):
            continue  # check_source (or the loader, in one sentence) says what is wrong with it
        if isinstance(parsed, dict) and parsed.get("auto_map"):
            raise GcfError(
                f"{what} {source} ships its own Python code (auto_map in {name}), which gcfamily runs only with "
                f"--trust-remote-code; pass it if you trust that code, or use a folder without auto_map."
            )


def _non_finite(config: Any, path: str = "") -> str | None:
    """The dotted name of the first NaN or infinite number in a parsed config (json reads NaN and Infinity), or None."""
    stack: list[tuple[Any, str, int]] = [(config, path, 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where or "value"
        if depth < 32 and isinstance(value, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in value.items())
        elif depth < 32 and isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    return None


def parameter_estimate(config: dict) -> int:
    """A lower bound on a decoder's parameter count from its config alone (0 when the sizes are not plain ints):
    embeddings plus per layer at least two H x H attention projections and two H x I MLP projections."""
    config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config

    def size(*keys: str) -> int:
        v = next((config[k] for k in keys if k in config), 0)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0

    H = size("hidden_size", "n_embd", "d_model")
    I = size("intermediate_size", "n_inner", "ffn_dim") or 4 * H
    L = size("num_hidden_layers", "n_layer", "num_layers")
    V = size("vocab_size")
    return V * H + L * (2 * H * H + 2 * H * I)


def machine_memory() -> int:
    """Bytes this machine can hold a model in: its RAM plus every GPU's memory (a generous ceiling)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no ceiling known
        return 2**62
    if torch.cuda.is_available():
        total += sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return total


def check_config(config: dict, prefix: str, fix: str) -> None:
    """Refuse a model config holding NaN or infinity (a NaN norm epsilon makes every step non-finite) or describing a
    model whose weights alone, at 2 bytes each, would not fit this machine's memory (10**7 layers); before any build.

    `prefix` starts the sentence ("Model folder X has a config.json whose"), `fix` ends it."""
    bad = _non_finite(config)
    if bad is not None:
        raise GcfError(f"{prefix} {bad} is not a finite number; every model setting must be one: {fix}.")
    n, memory = parameter_estimate(config), machine_memory()
    if 2 * n > memory:
        raise GcfError(
            f"{prefix} sizes describe a model of at least {n:.3g} parameters ({2 * n / 2**30:,.0f} GiB at 2 bytes each), "
            f"more than this machine's {memory / 2**30:,.0f} GiB of memory can hold: {fix}."
        )
