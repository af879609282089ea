"""Writes into the run folder that either complete or leave the file as it was (a full disk included).

`append_lines` (and `append_bytes`) appends whole records and, when a write fails (ENOSPC, EIO, a quota), cuts
the file back to the length it had, so a log never ends in half a line; `write_atomic` writes a sibling temporary
file and renames it over the target, so a reader sees the old content or the new, never a part; `write_folder`
does the same for a set of files (the final model): they are written into a temporary folder inside the target and
moved into place one rename at a time (a rename needs no room), or the temporary folder goes and the target is as
it was. All raise `WriteFailed`, a GcfError whose sentence names the file and the cause and, given the run folder,
the last intact checkpoint and how to continue (`resume_hint`): the run's one closing sentence.

This module is below checkpoint_format.py (which writes through it), so it reads a checkpoint folder itself: the marker and
the manifest's sizes, nothing hashed (an error path must not read gigabytes).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from gcfamily.errors import GcfError

STAGE = ".tmp-final"
"""The temporary folder `write_folder` writes into, inside the target; a killed run's leftover goes at the next write_folder
(and --overwrite takes it for the run's: gcfamily/run/folder/ownership.py, .tmp-*)."""


def os_error(e: BaseException) -> OSError | None:
    """The OSError behind a writer's exception, or None when it is not a failed write.

    Python's own writes raise OSError; safetensors and tokenizers (Rust) raise their own types whose text ends in
    "(os error 28)"; torch.save's stream writer raises a RuntimeError that names no cause.
    """
    if isinstance(e, OSError):
        return e
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    found = re.search(r"\(os error (\d+)\)", text)
    if found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    if isinstance(e, RuntimeError) and re.search(r"inline_container|PytorchStreamWriter|file write failed", text):
        return OSError(None, f"the file could not be written ({text[:160]})")
    return None


def _why(cause: OSError) -> str:
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    return cause.strerror or str(cause) or type(cause).__name__


def last_intact(run_dir: Path | str) -> Path | None:
    """The newest checkpoint of the run that finished writing (its COMPLETE marker) and whose files have the sizes its
    manifest records; None when there is none."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    found = [p for p in root.glob("step-*") if p.name[5:].isdigit() and (p / "COMPLETE").is_file()]
    for path in sorted(found, key=lambda p: int(p.name[5:]), reverse=True):
        try:
            files = json.loads((path / "manifest.json").read_text()) if (path / "manifest.json").is_file() else {}
            if all((path / name).stat().st_size == want.get("size") for name, want in files.items()):
                return path
        except (OSError, ValueError, AttributeError):
            continue  # unreadable or a file missing: not intact
    return None


def resume_hint(run_dir: Path | str) -> str:
    """What is kept and how to go on, for the end of a sentence: the last intact checkpoint and --resume, or that there
    is none."""
    last = last_intact(run_dir)
    if last is None:
        return "no checkpoint of this run was saved, so its steps are lost: free some disk space and run it again"
    return (
        f"the checkpoint of step {last.name[5:]} is intact ({last}): free some disk space and run the same command "
        "with --resume"
    )


class WriteFailed(GcfError):
    """A write into the run folder failed and was undone; `path` is the file, `cause` the OSError.

    Given `run_dir`, the sentence ends with what is kept and how to continue (`resume_hint`)."""

    def __init__(self, path: Path, cause: OSError, *, run_dir: Path | str | None = None, what: str = "") -> None:
        self.path = Path(path)
        self.cause = cause
        then = "the file was left as it was before the write" if run_dir is None else resume_hint(run_dir)
        super().__init__(f"Could not write {what or self.path} ({_why(cause)}); {then}.")


def append_bytes(path: Path | str, data: bytes, *, run_dir: Path | str | None = None) -> None:
    """Append `data` to `path`, all or nothing: on a failed write the file is cut back to its length before."""
    path = Path(path)
    if not data:
        return
    try:
        # unbuffered: a failed write leaves nothing in a buffer that closing the file would try to write again
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise WriteFailed(path, e, run_dir=run_dir) from None
    try:
        start = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError as e:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise WriteFailed(path, e, run_dir=run_dir) from None
    finally:
        os.close(fd)


def append_lines(path: Path | str, lines: Iterable[str], *, run_dir: Path | str | None = None) -> None:
    """Append each string of `lines` plus a newline to `path`, all or nothing."""
    append_bytes(path, "".join(line + "\n" for line in lines).encode(), run_dir=run_dir)


def write_atomic(path: Path | str, content: str | bytes, *, run_dir: Path | str | None = None) -> None:
    """Replace `path` with `content` in one rename; on failure the old file (or its absence) stays."""
    path = Path(path)
    data = content.encode() if isinstance(content, str) else content
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb", buffering=0) as f:
            view = memoryview(data)
            while view:
                view = view[f.write(view) :]
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise WriteFailed(path, e, run_dir=run_dir) from None


def write_folder(
    target: Path | str, write: Callable[[Path], None], *, run_dir: Path | str, what: str
) -> list[str] | None:
    """Files written by `write(folder)` into `target`, all or none: `write` gets a temporary folder inside `target`,
    whose entries are then moved over `target`'s; if `write` fails (a full disk), the temporary folder is removed, the
    target is as it was, and WriteFailed says `what` could not be written and what is kept. The names moved, or None
    when `write` wrote nothing (the temporary folder is removed)."""
    target = Path(target)
    stage = target / STAGE
    try:
        if stage.exists():
            shutil.rmtree(stage)
        stage.mkdir(parents=True)
        write(stage)
    except Exception as e:  # the writers' own types (safetensors, tokenizers, torch), read by os_error
        cause = os_error(e)
        shutil.rmtree(stage, ignore_errors=True)
        if cause is None:  # not a failed write: a mistake that must show as what it is
            raise
        raise WriteFailed(stage, cause, run_dir=run_dir, what=what) from e
    names = sorted(p.name for p in stage.iterdir())
    for name in names:  # renames in one folder need no room: this cannot fail for a full disk
        dest = target / name
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        os.replace(stage / name, dest)
    stage.rmdir()
    return names or None
