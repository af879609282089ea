"""Naming a model: the aliases, hub ids and local folders --model takes, and what from_pretrained is given for each."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from gcfamily.errors import GcfError
from gcfamily.models.gguf import _smollm2_folder
from gcfamily.models.tiny import TINY_CONTEXT

HUB_ALIASES = {
    "qwen-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "llama-1b": "meta-llama/Llama-3.2-1B-Instruct",
}
OFFLINE_ALIASES = ("tiny", "smollm2-135m")


def context_of(name: str) -> int | None:
    """The positions a model by this name was built for, read without loading it: tiny's, or a local folder's config.json
    (max_position_embeddings or n_positions); None for a hub id, or where the config names none (known once loaded)."""
    if name == "tiny":
        return TINY_CONTEXT
    p = Path(name).expanduser() / "config.json"
    if name in HUB_ALIASES or not p.is_file():
        return None
    try:
        config = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # check_source says what is wrong with it
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    values = [config.get(k) for k in ("max_position_embeddings", "n_positions")] if isinstance(config, dict) else []
    return next((v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)


def resolve_source(name: str, say: Callable[[str], None] | None = None) -> str:
    """An alias, hub id or local folder -> what from_pretrained takes (`say`: where a first use's conversion speaks)."""
    if name == "smollm2-135m":
        return str(_smollm2_folder(say))
    if name in HUB_ALIASES:
        return HUB_ALIASES[name]
    p = Path(name).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise GcfError(
                f"Model folder {name} has no config.json; point --model at a Hugging Face checkpoint folder."
            )
        return str(p)
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return name  # a hub id
    known = ", ".join(list(OFFLINE_ALIASES) + list(HUB_ALIASES))
    raise GcfError(
        f"Unknown model '{name}'; use an alias ({known}), a hub id like org/name, or a local checkpoint folder."
    )
