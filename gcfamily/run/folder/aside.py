"""What a start changes in the folder before it commits, and how a failed start undoes it: --overwrite's previous run
set aside in `.gcf-replaced/` and put back (or dropped at commit), the paths a start adds (`snapshot` before,
`remove_new` after a failure), and at commit the checkpoint folders a killed write left half-done.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gcfamily.errors import GcfError
from gcfamily.run.folder.lock import LOCK
from gcfamily.run.folder.ownership import ASIDE, RECORD, is_run_file, owned_entries


def set_aside(out_dir: Path, names: list[str] | None = None) -> list[str]:
    """--overwrite, before the checks: move the entries the folder's run owns (`names`, by default owned_entries) and
    its record into ASIDE; the names moved. A rename in the same folder: nothing is copied or lost."""
    aside = out_dir / ASIDE
    names = owned_entries(out_dir) if names is None else names
    moved = names + ([RECORD] if (out_dir / RECORD).is_file() else [])
    if moved:
        aside.mkdir()
        for name in moved:
            os.replace(out_dir / name, aside / name)
    return names


def put_back(out_dir: Path) -> list[str]:
    """Undo set_aside: each set-aside entry back in its place (over whatever a failed start wrote there); the names."""
    aside = out_dir / ASIDE
    if not (aside.exists() or aside.is_symlink()):
        return []
    names = sorted(p.name for p in aside.iterdir()) if aside.is_dir() and not aside.is_symlink() else None
    strange = [n for n in names or [] if not (is_run_file(n) or n == RECORD)]
    if names is None or strange:  # a folder copied or downloaded: only what set_aside moves is put back
        what = f"holds {strange[0][:40]!r}, which no run sets aside" if strange else "is not a folder"
        raise GcfError(
            f"{aside} {what}, so it is not a run that --overwrite set aside and nothing was changed; move it out of "
            f"{out_dir}, or choose another --output-dir."
        )
    for name in names:
        _remove(out_dir / name)
        os.replace(aside / name, out_dir / name)
    aside.rmdir()
    return [n for n in names if n != RECORD]


def drop_aside(out_dir: Path) -> None:
    """The start committed: the set-aside run goes for good."""
    shutil.rmtree(out_dir / ASIDE, ignore_errors=True)


def _paths(out_dir: Path) -> list[Path]:
    """The folder's entries, and everything inside those that a run writes (its checkpoints, logs, pools): a start
    writes nowhere else, and a folder of the user's is not walked."""
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
    """A failed start: remove every path it added (not in `before`), except the lock and ASIDE, which put_back empties."""
    for p in _paths(out_dir):  # a folder before what is in it
        rel = p.relative_to(out_dir)
        if rel.parts[0].startswith((ASIDE, LOCK)) or str(rel) in before or not (p.exists() or p.is_symlink()):
            continue  # (a path inside a new folder went with it)
        _remove(p)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def clean_partial_checkpoints(out_dir: Path) -> None:
    """Remove checkpoint folders that a killed or failed write left half-done (.tmp-step-*); a whole one it had swapped
    out (.tmp-old-step-N-*) goes back to step-N when that is missing."""
    root = out_dir / "checkpoints"
    if root.is_dir():
        for p in root.glob(".tmp-old-step-*"):  # a checkpoint swapped out for a rewrite of its step, killed midway
            final = root / ("step-" + p.name.split("-")[3])
            if (p / "COMPLETE").is_file() and not final.exists():
                os.replace(p, final)
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)
