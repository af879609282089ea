"""The run folder's lock: one owner at a time.

The lock (`.gcf.lock`) is taken before anything is written. It names its owner by what survives pid namespaces and
reused pids: a random token, pid, host, boot id, pid namespace and the process's start time (/proc/PID/stat field
22); and its owner holds an flock on it for as long as it runs, which the kernel drops when the process dies, however
it dies. The lock appears in one hard link of a fully written file, so its content is never seen half written. The
rule for a lock found in place: held by this process (a Trainer built and never run) -> replaced; its flock held ->
in use, refused in one sentence; its flock free and its owner on this host and boot -> stale (a live owner would hold
it), taken over and said so; a lock of before the flock, or on a filesystem without flock -> stale only when its pid
provably names no process of that start time in our pid namespace (a pid whose process started after the lock was
written, pid 1 say, is not its owner); another host or boot -> cannot be checked from here: treated as held, and the
sentence says which file to delete if that run is gone. Content that is not a lock (not JSON, null, a list, a
folder) is refused naming the file.
A takeover renames the judged file aside while holding its flock, then links its own: one winner in every race (on a
filesystem without flock, a rename checked by inode: a narrower race remains).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import stat
import time
from pathlib import Path
from typing import Any

from gcfamily.errors import GcfError
from gcfamily.run.folder.writes import WriteFailed

LOCK = ".gcf.lock"


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat field 22); None when no such process runs
    (or there is no /proc)."""
    text = _read(f"/proc/{pid}/stat")
    try:
        return int(text[text.rindex(")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _identity() -> dict[str, Any]:
    """This process, as a lock names its owner (module docstring)."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    pid = os.getpid()
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "pidns": pidns,
        "start_ticks": _start_ticks(pid),
        "token": secrets.token_hex(8),
        "started": time.time(),
        "flock": True,
    }


def _gone(owner: dict[str, Any], me: dict[str, Any]) -> bool:
    """The lock's process provably runs no more: same host, boot and pid namespace as ours (those a lock records), and
    its pid runs no process, or one started at another time (a lock of before start times were recorded: one started
    after the lock was written)."""
    if owner.get("host") != me["host"] or any(owner.get(k) not in (None, me[k]) for k in ("boot_id", "pidns")):
        return False
    pid = owner["pid"]
    if not os.path.isdir("/proc/self"):  # no /proc: whether the pid runs at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    ticks = _start_ticks(pid)
    if ticks is None:
        return True
    if isinstance(owner.get("start_ticks"), int):
        return ticks != owner["start_ticks"]
    started, boot = owner.get("started"), _read("/proc/stat").partition("btime ")[2].split()
    if isinstance(started, (int, float)) and boot:
        return int(boot[0]) + ticks / os.sysconf("SC_CLK_TCK") > started + 1.0
    return False


def _parse(data: bytes) -> tuple[dict[str, Any] | None, str]:
    """The owner a lock file names, or None and what it holds instead."""
    try:
        owner = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, "it is not JSON" if data.strip() else "it is empty"
    if not isinstance(owner, dict):
        return None, f"it holds {json.dumps(owner)[:40]}, not an owner"
    if not isinstance(owner.get("pid"), int) or owner["pid"] <= 0 or not isinstance(owner.get("host"), str):
        return None, "it names no pid and host"
    return owner, ""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _flock(fd: int) -> bool | None:
    """Take an exclusive flock on fd without waiting: True taken, False another holds it, None not supported here."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class RunLock:
    """`out_dir/.gcf.lock`, held (with an flock on it) until release; a stale one is taken over (module docstring)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK
        self.held = False
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns a note when a stale lock was taken over; one sentence when a live run holds it."""
        me = _identity()
        tmp = self.path.with_name(f"{LOCK}.{me['token']}")
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except OSError as e:
            raise self._unwritable(e) from None
        note = None
        try:
            me["flock"] = _flock(fd) is True
            try:
                _write_all(fd, json.dumps(me).encode())
            except OSError as e:
                raise self._unwritable(e) from None
            for _ in range(60):
                try:
                    os.link(tmp, self.path)  # all or nothing, content and flock included
                except FileExistsError:
                    note = self._take_over(me) or note
                    continue
                except OSError:  # no hard links on this filesystem: made in place, its content a moment later
                    try:
                        made = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
                    except FileExistsError:
                        note = self._take_over(me) or note
                        continue
                    _flock(made)
                    try:
                        _write_all(made, json.dumps(me).encode())
                    except OSError as e:
                        os.close(made)
                        self.path.unlink(missing_ok=True)
                        raise self._unwritable(e) from None
                    os.close(fd)
                    fd = made
                self._fd, fd, self.held = fd, -1, True
                return note
        finally:
            tmp.unlink(missing_ok=True)
            if fd >= 0:
                os.close(fd)
        raise GcfError(f"Could not take the lock {self.path}; other starts keep taking it: try again.")

    def _unwritable(self, e: OSError) -> GcfError:
        """The sentence for a lock that could not be written: a full disk says what of the run is kept (WriteFailed);
        anything else, that the folder is not writable."""
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return WriteFailed(self.path, e, run_dir=self.path.parent, what=f"the lock {self.path}")
        return GcfError(
            f"Output folder {self.path.parent} is not writable ({e.strerror or e}); choose another --output-dir or fix "
            "its permissions."
        )

    def _take_over(self, me: dict[str, Any]) -> str | None:
        """The lock in place: replaced when it is stale or this process's (a note when stale), else one sentence; None
        to look again (it changed meanwhile)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise GcfError(
                f"The lock file {self.path} cannot be read ({e.strerror or e}); if no gcfamily run is using "
                f"{self.path.parent}, delete it and start again."
            ) from e
        try:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise GcfError(
                    f"{self.path} is a folder, where gcfamily keeps its lock file; if no gcfamily run is using "
                    f"{self.path.parent}, remove it and start again."
                )
            free = _flock(fd)
            if not _same_file(fd, self.path):
                return None
            owner, why = _parse(os.read(fd, 1 << 16))
            if owner is None:
                if free is False:
                    raise GcfError(_in_use(self.path, "another process"))
                raise GcfError(
                    f"The lock file {self.path} is not a gcfamily lock ({why}); if no gcfamily run is using "
                    f"{self.path.parent}, delete it and start again."
                )
            pid, host = owner["pid"], owner["host"]
            if (
                pid == me["pid"]
                and host == me["host"]
                and all(owner.get(k) in (None, me[k]) for k in ("boot_id", "pidns", "start_ticks"))
            ):
                self._move_aside(fd)  # this process's own: a Trainer built here earlier and never run
                return None
            gone = _gone(owner, me)
            if free is False:
                if gone:  # another start is taking this stale lock over right now
                    time.sleep(0.05)
                    return None
                raise GcfError(_in_use(self.path, f"pid {pid} on {host}"))
            same_boot = host == me["host"] and owner.get("boot_id") == me["boot_id"]
            if not (gone or (free and owner.get("flock") is True and same_boot)):
                if host == me["host"] and owner.get("boot_id") in (None, me["boot_id"]):
                    raise GcfError(_in_use(self.path, f"pid {pid} on {host}"))
                raise GcfError(
                    f"Output folder {self.path.parent} is locked by a gcfamily run on another machine or boot (pid {pid} "
                    f"on {host}), which cannot be checked from here; wait for it to end, or if that run is gone, delete "
                    f"{self.path}."
                )
            if not self._move_aside(fd):
                return None
            return f"note: took over the lock of a run that is gone (pid {pid} on {host}) in {self.path.parent}."
        finally:
            os.close(fd)

    def _move_aside(self, fd: int) -> bool:
        """Rename the lock file judged (open as fd) out of the way; False when the file in place is another (put back)."""
        aside = self.path.with_name(f"{LOCK}.stale-{secrets.token_hex(6)}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        if not _same_file(fd, aside):  # another start's fresh lock (only where there is no flock): put it back
            try:
                os.link(aside, self.path)
            except OSError:
                pass
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    def release(self) -> None:
        """Remove the lock while still holding its flock, then let go of it."""
        if self.held and self._fd is not None:
            if _same_file(self._fd, self.path):
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
        self._fd, self.held = None, False


def _in_use(path: Path, who: str) -> str:
    return (
        f"Output folder {path.parent} is in use by a running gcfamily run ({who}); wait for it to end, or choose "
        f"another --output-dir (if that run is gone, delete {path})."
    )
