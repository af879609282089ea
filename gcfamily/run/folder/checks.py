"""The refusals a start makes before it changes anything: a folder no run may write (the current directory, the
--model itself, a file), a folder whose contents would lose or mix work, and a folder that takes no file or has no
room for a checkpoint.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.run.folder.ownership import ASIDE, is_internal, is_run_file, matches_any, owned_names, shown_names
from gcfamily.run.folder.writes import WriteFailed


def same_folder(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return False


def check_target(out_dir: Path, model: str, resume: str | None = None, overwrite: bool = False) -> None:
    """Refuse, before the lock, a folder no run may write: the current directory, the --model itself, a file; and a run
    set aside by an --overwrite start (killed, or still running its checks) unless --overwrite or --resume: it counts
    as the run it is."""
    if not str(out_dir).strip() or same_folder(out_dir, os.getcwd()):
        raise GcfError(
            f"--output-dir {str(out_dir)!r} is the current directory, where a run would write among your own files; "
            "give the run a folder of its own (e.g. --output-dir runs/my-run)."
        )
    if Path(model).expanduser().is_dir() and same_folder(out_dir, model):
        raise GcfError(
            f"Output folder {out_dir} is the model being trained (--model {model}); writing there would replace the weights it starts from: "
            "choose another --output-dir."
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise GcfError(f"Output folder {out_dir} is a file; choose a folder for --output-dir.")
    if (out_dir / ASIDE).is_dir() and resume is None and not overwrite:
        raise GcfError(
            f"Output folder {out_dir} holds another run; pass --overwrite to replace it, --resume to continue it, or another --output-dir."
        )


def _inside(path: Path, folder: Path) -> str | None:
    """The top-level entry of `folder` that holds `path`, or None when path is not inside folder."""
    try:
        rel = path.expanduser().resolve().relative_to(folder.resolve())
    except (OSError, ValueError):
        return None
    return rel.parts[0] if rel.parts else None


def check_contents(
    out_dir: Path, model: str, resume: str | None, overwrite: bool, record: dict[str, Any] | None
) -> None:
    """Refuse, holding the lock and before anything moves, a folder that would lose or mix work (module docstring)."""
    owns = owned_names(out_dir, record)
    entries = [p.name for p in sorted(out_dir.iterdir()) if not is_internal(p.name)]
    live = [n for n in entries if matches_any(n, owns)]
    foreign = [n for n in entries if not matches_any(n, owns)]
    clash = [n for n in foreign if is_run_file(n)]
    if clash:
        raise GcfError(
            f"Output folder {out_dir} holds {shown_names(clash)}, which bear the names of a gcfamily run's files but no run of "
            "this folder wrote them; a run would write over them: move them, or choose another --output-dir."
        )
    top = _inside(Path(model), out_dir) if Path(model).expanduser().exists() else None
    if top is not None and (matches_any(top, owns) or is_run_file(top)):
        raise GcfError(
            f"--model {model} lies inside {out_dir / top}, which the run in {out_dir} owns and may replace or remove; "
            "copy the model elsewhere first, or choose another --output-dir."
        )
    latest = resume in ("", "latest", "auto", "true", "True")
    if resume is not None and not latest and live:
        path = Path(resume)
        mine = (out_dir / "checkpoints").resolve()
        if not (same_folder(path, out_dir) or (path.parent.resolve() == mine and path.name.startswith("step-"))):
            raise GcfError(
                f"--resume {resume} is not a checkpoint of the run in {out_dir} (its checkpoints/step-N), and resuming it "
                "there would mix two runs; resume it into another --output-dir."
            )
    if resume is not None:
        return
    if live and not overwrite:
        raise GcfError(
            f"Output folder {out_dir} holds another run; pass --overwrite to replace it, --resume to continue it, or another --output-dir."
        )
    if foreign and record is None and not live and not overwrite:
        what = "a model" if "config.json" in foreign else "files"
        raise GcfError(
            f"Output folder {out_dir} holds {what} ({shown_names(foreign)}) but no gcfamily run; pass --overwrite to write "
            "the run beside them (it removes only what a run wrote, none of these), or another --output-dir."
        )


def size_of(path: Path) -> int:
    """Bytes of the files under `path` (what removing it frees)."""
    if not path.exists():
        return 0
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    return sum(p.stat().st_size for p in files)


def check_writable(out_dir: Path, need_bytes: int, reclaim: int = 0) -> None:
    """The folder takes a file, and its disk has room for one checkpoint (need_bytes, estimated by the caller; `reclaim`
    bytes are freed before the first checkpoint: a run that --overwrite set aside)."""
    probe = out_dir / f".gcf-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        try:
            probe.unlink()
        except OSError:
            pass
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise WriteFailed(probe, e, run_dir=out_dir, what=f"into {out_dir}") from None
        raise GcfError(
            f"Output folder {out_dir} is not writable ({e.strerror or e}); choose another --output-dir or fix its permissions."
        ) from e
    free = shutil.disk_usage(out_dir).free + reclaim
    if free < need_bytes:
        raise GcfError(
            f"The disk of {out_dir} has {free / 2**20:,.0f} MB free, less than one checkpoint needs (about {need_bytes / 2**20:,.0f} MB); "
            "free some space or choose another --output-dir."
        )
