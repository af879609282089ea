"""The run folder as a transaction: one owner at a time, never two runs mixed, resume means the same run, and a start
that fails leaves the folder as it was.

- A lock file (`.gcf.lock`: pid, host, start time) is taken before anything is written. A folder that a
  live run holds is refused in one sentence; a lock whose process is gone (same host) is taken over,
  and said so.
- A folder that holds another run is refused unless --overwrite or --resume. --overwrite sets that run's
  files (settings, metrics, checkpoints, logs, the final model) aside in `.gcf-replaced/` while the start
  runs its checks, and removes them only once every check has passed, so nothing of the old run is
  mixed in and a start that fails loses nothing; a set-aside run that a killed start left is put back by
  the next start. A folder that holds a model or other files but no run is refused unless --overwrite;
  the folder that is the --model itself is always refused.
- A resume compares the requested settings with those the checkpoint was written under (recorded in the
  checkpoint; for an older checkpoint, its run folder's run_config.json), wherever the run continues: a
  setting that changes the trajectory may differ only with allow_changed_settings=true, which records
  the change; metrics and completions logged after the resumed step are dropped (they are about to be
  logged again), and half-written checkpoint folders are removed.
- Before training the folder must be writable and hold room for a checkpoint.
- Until the start commits (RunFolder.commit) nothing already in the folder is changed or removed, only
  set aside; a start that fails removes what it wrote (`snapshot`, `remove_new`) and puts back what it
  set aside, so the folder is byte for byte as it was, and a folder it made is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

from gcfamily.errors import GcfError

LOCK = ".gcf.lock"
ASIDE = ".gcf-replaced"
"""Where --overwrite keeps the previous run's files until the start commits."""
RUN_MARKERS = ("run_config.json", "metrics.jsonl", "checkpoints")
RUN_FILES = (
    "run_config.json",
    "metrics.jsonl",
    "completions.jsonl",
    "eval_details.jsonl",
    "tensorboard",
    "wandb",
    "checkpoints",
    "README.md",
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
"""What a gcfamily run writes; --overwrite removes these (and model-*.safetensors shards), nothing else."""

RESUMABLE = {
    "output_dir",
    "overwrite",
    "progress",
    "log_every",
    "report_to",
    "save_every",
    "keep_last",
    "eval_every",
    "eval_every_s",
    "eval_samples",
    "eval_at_ends",
    "log_completions_every",
    "reward_timeout",
    "device",
    "max_time",
    "max_tokens",
    "explicit",
    "allow_changed_settings",
    "dist_timeout",
    "trust_remote_code",
    "save_dtype",
    "merge_lora",
    "eval_dataset",
    "eval_split",
}
"""Settings a resume may change freely: where and how often to log, evaluate, save, and when to stop."""


# --------------------------------------------------------------------------- the lock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class RunLock:
    """`out_dir/.gcf.lock`, created exclusively; released on close (and left stale by a killed process, then taken over)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK
        self.held = False

    def acquire(self) -> Optional[str]:
        """Take the lock; returns a note when a stale lock was taken over; one sentence when a live run holds it."""
        note = None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is None:  # being written by its owner, or unreadable: look again
                    time.sleep(0.2)
                    owner = self._owner() or {}
                pid, host = int(owner.get("pid", -1)), str(owner.get("host", "?"))
                if host == socket.gethostname() and pid == os.getpid():
                    self.path.unlink(
                        missing_ok=True
                    )  # this process's own: a Trainer built here earlier and never run (a notebook, a test)
                    continue
                if (host == socket.gethostname() and pid > 0 and not _alive(pid)) or (
                    owner.get("pid") is None and self._older_than(10)
                ):
                    self.path.unlink(missing_ok=True)  # a stale lock: its process is gone
                    note = (
                        f"note: took over the lock of a run that is gone (pid {pid} on {host}) in {self.path.parent}."
                    )
                    continue
                where = f"pid {pid} on {host}" if host != "?" else "another process"
                raise GcfError(
                    f"Output folder {self.path.parent} is in use by a running gcfamily run ({where}); wait for it to end, "
                    f"or choose another --output-dir (if that run is gone, delete {self.path})."
                )
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}, f)
            self.held = True
            return note
        raise GcfError(f"Could not take the lock {self.path}; another run keeps taking it.")

    def _owner(self) -> Optional[dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None

    def _older_than(self, seconds: float) -> bool:
        try:
            return time.time() - self.path.stat().st_mtime > seconds
        except OSError:
            return True

    def release(self) -> None:
        if self.held:
            owner = self._owner() or {}
            if owner.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False


# --------------------------------------------------------------------------- what a folder holds


def holds_run(out_dir: Path) -> bool:
    """A run's files are in the folder, or set aside by an --overwrite start that never committed."""
    return any((out_dir / m).exists() for m in RUN_MARKERS) or (out_dir / ASIDE).is_dir()


def same_folder(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return False


def check_target(out_dir: Path, model: str, resume: Optional[str], overwrite: bool) -> None:
    """Refuse a folder that would lose or mix work (module docstring); nothing is written here."""
    if Path(model).expanduser().is_dir() and same_folder(out_dir, model):
        raise GcfError(
            f"Output folder {out_dir} is the model being trained (--model {model}); writing there would replace the weights it starts from: "
            "choose another --output-dir."
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise GcfError(f"Output folder {out_dir} is a file; choose a folder for --output-dir.")
    if resume is not None or overwrite or not out_dir.is_dir():
        return
    if holds_run(out_dir):
        raise GcfError(
            f"Output folder {out_dir} holds another run; pass --overwrite to replace it, --resume to continue it, or another --output-dir."
        )
    others = sorted(p.name for p in out_dir.iterdir() if p.name != LOCK)
    if others:
        what = "a model" if (out_dir / "config.json").is_file() else "files"
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        raise GcfError(
            f"Output folder {out_dir} holds {what} ({shown}) but no gcfamily run; pass --overwrite to write over them, or another --output-dir."
        )


def is_run_file(name: str) -> bool:
    """What a gcfamily run writes (RUN_FILES, model-*.safetensors shards, .tmp-* leftovers): --overwrite replaces these."""
    return (
        name in RUN_FILES or (name.startswith("model-") and name.endswith(".safetensors")) or name.startswith(".tmp-")
    )


def set_aside(out_dir: Path) -> list[str]:
    """--overwrite, before the checks: move what an earlier run (or a model) left in the folder into ASIDE; the names
    moved. A rename in the same folder: nothing is copied or lost."""
    aside = out_dir / ASIDE
    names = [p.name for p in sorted(out_dir.iterdir()) if is_run_file(p.name)]
    if names:
        aside.mkdir()
        for name in names:
            os.replace(out_dir / name, aside / name)
    return names


def put_back(out_dir: Path) -> list[str]:
    """Undo set_aside: each set-aside entry back in its place (over whatever a failed start wrote there); the names."""
    aside = out_dir / ASIDE
    if not aside.is_dir():
        return []
    names = sorted(p.name for p in aside.iterdir())
    for name in names:
        _remove(out_dir / name)
        os.replace(aside / name, out_dir / name)
    aside.rmdir()
    return names


def drop_aside(out_dir: Path) -> None:
    """The start committed: the set-aside run goes for good."""
    shutil.rmtree(out_dir / ASIDE, ignore_errors=True)


def size_of(path: Path) -> int:
    """Bytes of the files under `path` (what removing it frees)."""
    if not path.exists():
        return 0
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    return sum(p.stat().st_size for p in files)


def _paths(out_dir: Path) -> list[Path]:
    """The folder's entries, and everything inside those that a run writes (its checkpoints, logs, pools): a start
    writes nowhere else, and a folder of the user's that --overwrite writes over is not walked."""
    out = []
    for p in sorted(out_dir.iterdir()):
        out.append(p)
        if is_run_file(p.name) and p.is_dir() and not p.is_symlink():
            out += sorted(p.rglob("*"))
    return out


def snapshot(out_dir: Path) -> set[str]:
    """The paths a start could add to (`_paths`, relative), taken before it writes anything."""
    return {str(p.relative_to(out_dir)) for p in _paths(out_dir)}


def remove_new(out_dir: Path, before: set[str]) -> None:
    """A failed start: remove every path it added (not in `before`), except ASIDE, which put_back empties."""
    for p in _paths(out_dir):  # a folder before what is in it
        rel = p.relative_to(out_dir)
        if rel.parts[0] in (ASIDE, LOCK) or str(rel) in before or not (p.exists() or p.is_symlink()):
            continue  # (a path inside a new folder went with it)
        _remove(p)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def check_writable(out_dir: Path, need_bytes: int, reclaim: int = 0) -> None:
    """The folder takes a file, and its disk has room for one checkpoint (need_bytes, estimated by the caller; `reclaim`
    bytes are freed before the first checkpoint: a run that --overwrite set aside)."""
    probe = out_dir / f".gcf-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise GcfError(
            f"Output folder {out_dir} is not writable ({e.strerror or e}); choose another --output-dir or fix its permissions."
        ) from e
    free = shutil.disk_usage(out_dir).free + reclaim
    if free < need_bytes:
        raise GcfError(
            f"The disk of {out_dir} has {free / 2**20:,.0f} MB free, less than one checkpoint needs (about {need_bytes / 2**20:,.0f} MB); "
            "free some space or choose another --output-dir."
        )


def clean_partial_checkpoints(out_dir: Path) -> None:
    """Remove checkpoint folders that a killed or failed write left half-done (.tmp-step-*)."""
    root = out_dir / "checkpoints"
    if root.is_dir():
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------- resume


def compare_settings(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{setting: (the run's, requested)} for settings that change the trajectory (max_steps only where the schedule depends on it)."""
    free = set(RESUMABLE)
    if now.get("lr_schedule") == "constant" and saved.get("lr_schedule") == "constant":
        free.add("max_steps")
    keys = (set(saved) | set(now)) - free - {"changes"}
    return {k: (saved.get(k), now.get(k)) for k in sorted(keys) if saved.get(k) != now.get(k)}


def settings_of(path: Path) -> Optional[dict[str, Any]]:
    """The settings checkpoint `path` was written under: its own run_config.json, or for a checkpoint written before
    checkpoints recorded them, the run_config.json of its run folder (path is RUN/checkpoints/step-N); None if neither."""
    places = [path / "run_config.json"]
    if path.parent.name == "checkpoints":
        places.append(path.parent.parent / "run_config.json")
    for f in places:
        if f.is_file():
            try:
                saved = json.loads(f.read_text())
            except (OSError, ValueError) as e:
                raise GcfError(
                    f"{f} cannot be read ({e}); the settings of checkpoint {path} are unknown: restore the file, or "
                    "resume another checkpoint."
                ) from e
            return saved if isinstance(saved, dict) else None
    return None


def check_resume(
    path: Path, saved: Optional[dict[str, Any]], now: dict[str, Any], allow: bool, step: Optional[int]
) -> Optional[dict[str, Any]]:
    """Refuse a resume of checkpoint `path` whose settings differ from `saved` (those it was written under), unless
    allowed; the change record when allowed. A checkpoint with no record of its settings cannot be compared: refused
    unless allowed, and then every setting is taken as given."""
    run = path.parent.parent if path.parent.name == "checkpoints" else path
    if saved is None:
        if not allow:
            raise GcfError(
                f"--resume {path}: the checkpoint records no settings and {run} has no run_config.json, so a change of "
                "settings cannot be seen; pass --set allow_changed_settings=true to continue with the settings given now."
            )
        return {"step": step, "changed": {"settings": ["not recorded", "as given"]}}
    diffs = compare_settings(saved, now)
    if not diffs:
        return None
    shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(diffs.items())[:6]) + (
        "; ..." if len(diffs) > 6 else ""
    )
    if not allow:
        raise GcfError(
            f"--resume would continue run {run} with other settings ({shown}); run the same settings, "
            "or pass --set allow_changed_settings=true to change them on purpose (recorded in run_config.json)."
        )
    return {"step": step, "changed": {k: [a, b] for k, (a, b) in diffs.items()}}


def truncate_logs(out_dir: Path, step: int) -> None:
    """Drop metric and completion rows logged after `step` (a resume from step logs them again)."""
    for name in ("metrics.jsonl", "completions.jsonl", "eval_details.jsonl"):
        path = out_dir / name
        if not path.is_file():
            continue
        keep = []
        for line in path.read_text().splitlines():
            try:
                if int(json.loads(line).get("step", 0)) <= step:
                    keep.append(line)
            except (ValueError, AttributeError, TypeError):
                continue  # a line cut by a kill mid-write
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        os.replace(tmp, path)


def say(note: Optional[str]) -> None:
    if note:
        print(note, file=sys.stderr)
