"""A run's settings made to travel, for its model card: a setting that names a file or folder of this machine (a
method's file, the dataset, the held-out set, a reward's file, a reward model, a base model folder, a chat template
file) is recorded by its name, and the card lists those local inputs by name and sha256 digest, so that its reproduce
command runs on another machine once they sit, by those names, in the folder it runs from; no card carries a path of
this machine."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from gcfamily.models import HUB_ALIASES, OFFLINE_ALIASES

PATH_KEYS = ("method", "model", "dataset", "eval_dataset", "reward", "reward_model", "chat_template")
"""The settings whose value may name a local file or folder."""


def digest(path: Path) -> str:
    """sha256 of a file's bytes; of a folder, of its files' relative names and bytes in sorted order (a run folder's
    checkpoints/ left out: from_pretrained never reads them)."""
    h = hashlib.sha256()
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and "checkpoints" not in p.relative_to(path).parts)
    for f in files:
        if f is not path:
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _local(value: str) -> tuple[str, Path] | None:
    """(the value as it travels, the local path it names), or None for a name that is not a path of this machine
    (an alias, a hub id, a built-in reward, module:function, a template's text)."""
    if value in OFFLINE_ALIASES or value in HUB_ALIASES or "\n" in value or len(value) > 1024:
        return None
    head, fn = value.rsplit(":", 1) if value.count(":") == 1 and value.split(":")[0].endswith(".py") else (value, "")
    try:
        path = Path(head).expanduser()
        if not path.exists():
            return None
    except OSError:  # a name too long for the file system, say: not a path
        return None
    return path.resolve().name + (f":{fn}" if fn else ""), path


def portable(config: dict, base_model: str) -> tuple[dict, str, list[str]]:
    """The settings and the base model with every local path replaced by its name, and the local inputs the
    reproduce command needs: "`name` (file, sha256 ...)" each, once."""
    config, needs, seen = dict(config), [], set()

    def travel(value: Any) -> Any:
        if isinstance(value, list):
            return [travel(v) for v in value]
        found = _local(value) if isinstance(value, str) else None
        if found is None:
            return value
        name, path = found
        if path.resolve() not in seen:
            seen.add(path.resolve())
            kind = "file" if path.is_file() else "folder"
            needs.append(f"`{name.split(':')[0]}` ({kind}, sha256 {digest(path)})")
        return name

    for key in PATH_KEYS:
        if config.get(key):
            config[key] = travel(config[key])
    return config, travel(base_model) if base_model else base_model, needs
