"""Whose the names in a run folder are: the names a gcfamily run writes, the run's record of those it owns
(`.gcf-run.json`, written before the run writes anything) and the entries a folder's run owns (what --overwrite
removes). The rules are in the package's docstring (gcfamily/run/folder/__init__.py).
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.run.folder.writes import write_atomic

ASIDE = ".gcf-replaced"
"""Where --overwrite keeps the previous run's files until the start commits."""
RECORD = ".gcf-run.json"
"""The run's record: the names it owns, its segments."""
RUN_FILES = (
    "run_config.json",
    "metrics.jsonl",
    "completions.jsonl",
    "eval_details.jsonl",
    "tensorboard",
    "wandb",
    "checkpoints",
    "README.md",
    "curves.png",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter",
    "reward_model.json",
    "value_head.safetensors",
    "pools",
)
"""What a gcfamily run writes (with model-*.safetensors shards and .tmp-* leftovers): the names a start claims."""
CLAIMS = (*RUN_FILES, "model-*.safetensors", ".tmp-*")


def is_internal(name: str) -> bool:
    """gcfamily's own bookkeeping beside a run (the lock and its temporary links, the record, the set-aside run, a
    write probe): never a user's file, never a run's output."""
    return name.startswith(".gcf")


_STEP = re.compile(r"step-[0-9]{1,18}")
_DEST = re.compile(r"replaced-at-step-[0-9]{1,18}(-[0-9]{1,9})?")
"""The names a record's `pending` may hold: checkpoints/step-N moved into checkpoints/replaced-at-step-B[-n]."""


def _record_fault(out_dir: Path, record: Any) -> str | None:
    """Why `record` is not one that a run wrote (the module docstring's shape, every name one a run writes, every path
    inside the folder), or None. A record is read from a folder that may have been copied or downloaded: nothing in it
    is acted on before this has passed."""
    if not isinstance(record, dict):
        return "not a JSON object"
    owns = record.get("owns")
    if not isinstance(owns, list) or not all(isinstance(n, str) for n in owns):
        return "its owns is not a list of names"
    strange = [n for n in owns if n not in CLAIMS]  # every record a run ever wrote owns a subset of CLAIMS
    if strange:
        return f"it owns {strange[0][:40]!r}, which is not a name a gcfamily run writes"
    segments = record.get("segments", [])
    if not isinstance(segments, list) or not all(isinstance(s, dict) for s in segments):
        return "its segments are not a list of records"
    pending = record.get("pending")
    if pending is None:
        return None
    names = pending.get("names") if isinstance(pending, dict) else None
    dest = pending.get("dest") if isinstance(pending, dict) else None
    if not isinstance(dest, str) or not _DEST.fullmatch(dest):
        return "its pending move does not name a checkpoints/replaced-at-step-N folder"
    if not isinstance(names, list) or not all(isinstance(n, str) and _STEP.fullmatch(n) for n in names):
        return "its pending move names something other than checkpoints/step-N"
    root = out_dir / "checkpoints"
    for path in (root, root / dest):  # a link would carry the move out of the folder
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            return f"its pending move goes through {path.relative_to(out_dir)}, which is not a folder of the run"
    if not (root / dest).resolve().is_relative_to(out_dir.resolve()):
        return "its pending move leaves the folder"
    return None


def read_record(out_dir: Path) -> dict[str, Any] | None:
    """The run's record (module docstring), validated (`_record_fault`), or None when the folder has none; one sentence
    when it cannot be read or does not validate."""
    path = out_dir / RECORD
    if not (path.exists() or path.is_symlink()):
        return None
    record, why = None, None
    if path.is_symlink() or not path.is_file():
        why = "it is a link or a folder, not a file"
    else:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:
            why = str(e)[:80] or type(e).__name__
        else:
            why = _record_fault(out_dir, record)
    if why is not None:
        raise GcfError(
            f"The run record {path} is not one a run wrote ({why}), so what the run in {out_dir} owns is unknown and "
            f"nothing was changed; restore the record, or choose another --output-dir."
        )
    return record


def _legacy_run(out_dir: Path) -> bool:
    """A run written before records existed: its run_config.json is one gcfamily wrote (a dict naming a method)."""
    try:
        saved = json.loads((out_dir / "run_config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(saved, dict) and "method" in saved


def owned_names(out_dir: Path, record: dict[str, Any] | None) -> list[str]:
    """The names (and patterns) the folder's run owns: its record's, or a run of before records, the gcfamily run names
    present; none for a folder that holds no run."""
    if record is not None:
        return list(record["owns"])
    if _legacy_run(out_dir):
        return list(CLAIMS)
    return []


def matches_any(name: str, owns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in owns)


def owned_entries(out_dir: Path, record: dict[str, Any] | None = None) -> list[str]:
    """The folder's top-level entries that its run owns (what --overwrite removes), sorted."""
    if not out_dir.is_dir():
        return []
    if record is None:
        record = read_record(out_dir)
    owns = owned_names(out_dir, record)
    return sorted(p.name for p in out_dir.iterdir() if not is_internal(p.name) and matches_any(p.name, owns))


def holds_run(out_dir: Path) -> bool:
    """A run's files are in the folder, or set aside by an --overwrite start that never committed."""
    return bool(owned_entries(out_dir)) or (out_dir / ASIDE).is_dir()


def is_run_file(name: str) -> bool:
    """A gcfamily run name (RUN_FILES, model-*.safetensors shards, .tmp-* leftovers)."""
    return matches_any(name, list(CLAIMS))


def shown_names(names: list[str]) -> str:
    """The first four names, for a sentence."""
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def claim(out_dir: Path, record: dict[str, Any] | None, keep: bool) -> dict[str, Any]:
    """The record this start writes before anything else: the names the run owns now (`keep`: those it owned; after
    check_contents, every gcfamily run name is free or owned) and, `keep`, its segments so far."""
    owns = set(owned_names(out_dir, record)) if keep else set()
    return {
        "owns": sorted(owns | set(CLAIMS)),
        "segments": list((record or {}).get("segments") or []) if keep else [],
        "pending": (record or {}).get("pending") if keep else None,
    }


def write_record(out_dir: Path, record: dict[str, Any]) -> None:
    write_atomic(out_dir / RECORD, json.dumps(record, indent=1), run_dir=out_dir)
