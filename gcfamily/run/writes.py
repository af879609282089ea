"""Writes into the run folder that either complete or leave the file as it was (a full disk included).

`append_lines` appends whole lines and, when a write fails (ENOSPC, EIO, a quota), cuts the file back to the
length it had, so a log never ends in half a line; `write_atomic` writes a sibling temporary file and renames
it over the target, so a reader sees the old content or the new, never a part. Both raise `WriteFailed`, a
GcfError whose sentence names the file and the cause; the run turns it into its one closing sentence.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterable

from gcfamily.errors import GcfError


class WriteFailed(GcfError):
    """A write into the run folder failed and was undone; `path` is the file, `cause` the OSError."""

    def __init__(self, path: Path, cause: OSError) -> None:
        self.path = Path(path)
        self.cause = cause
        why = "the disk is full" if cause.errno in (errno.ENOSPC, errno.EDQUOT) else (cause.strerror or str(cause))
        super().__init__(f"Could not write {self.path} ({why}); the file was left as it was before the write.")


def append_lines(path: Path | str, lines: Iterable[str]) -> None:
    """Append each string of `lines` plus a newline to `path`, all or nothing."""
    path = Path(path)
    data = "".join(line + "\n" for line in lines).encode()
    if not data:
        return
    try:
        with path.open("ab") as f:
            start = f.tell()
            try:
                f.write(data)
                f.flush()
            except OSError as e:
                try:
                    f.truncate(start)
                except OSError:
                    pass
                raise WriteFailed(path, e) from None
    except WriteFailed:
        raise
    except OSError as e:
        raise WriteFailed(path, e) from None


def write_atomic(path: Path | str, content: str | bytes) -> None:
    """Replace `path` with `content` in one rename; on failure the old file (or its absence) stays."""
    path = Path(path)
    data = content.encode() if isinstance(content, str) else content
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise WriteFailed(path, e) from None
