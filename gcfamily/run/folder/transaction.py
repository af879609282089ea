"""The run folder as a transaction: refuse a folder that would lose or mix work, take its lock, check a resume's
settings against its checkpoint's and choose that checkpoint (rank 0 decides for every rank; the modules beside this
one do the file work), and change nothing in the folder until the start commits. An object the Trainer holds, given the
settings, the processes and the folder.

A start opens the folder (`open`: checks that read, every refusal of the folder's contents made before anything moves,
an --overwrite's old run only set aside, and the run's record of the names it owns written before the run writes
anything), builds everything that can fail (models, data, rewards, the method, a resumed checkpoint, the logger), then
`commit`s: the set-aside run goes, logs past the resumed step are dropped, the checkpoints of the branch a resume leaves
are set apart, run_config.json is written and the record gains this segment. A start that fails before then is
`abandon`ed: what it wrote is removed, what it set aside put back and the record's old bytes written back, so the folder
is byte for byte as it was; the lock goes either way.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gcfamily.config import to_dict
from gcfamily.errors import GcfError
from gcfamily.models import lora
from gcfamily.run import checkpoint_format
from gcfamily.run.folder import aside, checks, ownership, resuming
from gcfamily.run.folder.lock import RunLock
from gcfamily.run.folder.writes import write_atomic


class RunFolder:
    """Setting up the run folder, its lock, and a resume's changed settings."""

    def __init__(self, cfg: Any, dist: Any) -> None:
        self.cfg, self.dist = cfg, dist
        self.is_main = dist is None or dist.rank == 0
        self.out_dir = Path(cfg.output_dir)
        self.lock = RunLock(self.out_dir)
        self.change: dict[str, Any] | None = None
        """A resume's changed settings (allow_changed_settings), or None."""
        self.record: dict[str, Any] | None = None
        """The settings the run records (run_config.json, and a copy in each checkpoint); rank 0 only."""
        self.committed = False
        self._before: set[str] | None = None  # the folder's paths when this start began (rank 0)
        self._made: list[Path] = []  # the folders this start made, deepest first
        self._aside: list[str] = []  # what --overwrite set aside
        self._resume_step: int | None = None
        self._resume_path: str | None = None
        self._run: dict[str, Any] | None = None  # the run's record (ownership.RECORD) this start writes
        self._record_bytes: bytes | None = None  # the record's bytes before this start (written back if it fails)

    def decide(self, fn: Callable[[], Any]) -> Any:
        """fn() run once, on rank 0 under torch.distributed, its result (or its one-sentence error) on every rank."""
        if self.dist is None:
            return fn()
        out, err = None, None
        if self.is_main:
            try:
                out = fn()
            except GcfError as e:
                err = str(e)
        out, err = self.dist.broadcast((out, err))
        if err is not None:
            raise GcfError(err)
        return out

    def open(self, resume: str | None) -> Path | None:
        """Refuse a folder that would lose or mix work, take its lock, check a resume's settings and choose its
        checkpoint (rank 0 chooses for all); returns it. Nothing already in the folder is changed: an --overwrite's old
        run is set aside until `commit`, and the run's record (the names it owns) is written with its old bytes kept
        for `abandon`."""
        cfg, out = self.cfg, self.out_dir

        def prepare() -> tuple[str | None, dict[str, Any] | None]:
            checks.check_target(out, cfg.model, resume, cfg.overwrite)
            self._made = [d for d in (out, *out.parents) if not d.exists()]
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise GcfError(
                    f"Output folder {out} cannot be made ({e.strerror or e}); choose another --output-dir."
                ) from e
            try:
                checks.check_writable(out, 0)
                _say(self.lock.acquire())
                return self._prepare(resume)
            except BaseException:
                self._undo()
                raise

        path, self.change = self.decide(prepare)
        return None if path is None else Path(path)

    def _prepare(self, resume: str | None) -> tuple[str | None, dict[str, Any] | None]:
        """Rank 0, holding the lock: (the checkpoint to resume, the change of settings); the record to write."""
        cfg, out = self.cfg, self.out_dir
        back = aside.put_back(out)  # a killed --overwrite start's: we hold the lock, so that start is gone
        if back:
            print(
                f"note: put back the run in {out} that an --overwrite start set aside and never finished ({_names(back)}).",
                file=sys.stderr,
            )
        old = ownership.read_record(out)  # validated: nothing in it is acted on before
        checks.check_contents(out, cfg.model, resume, cfg.overwrite, old)
        if resume is not None and old is not None and old.get("pending"):
            resuming.finish_pending(out, old)  # a resume's commit killed while it set an older branch apart
        self._before = aside.snapshot(out)
        if (out / ownership.RECORD).is_file():
            self._record_bytes = (out / ownership.RECORD).read_bytes()
        record = to_dict(cfg)
        path, change = None, None
        if resume is not None:
            path = checkpoint_format.find(resume, out)
            step = int(path.name[5:]) if path.name[5:].isdigit() else None
            saved = resuming.settings_of(path)  # the checkpoint's own, wherever this run continues
            change = resuming.check_resume(
                path, _but_threads(saved), _but_threads(record), cfg.allow_changed_settings, step
            )
            record["changes"] = ((saved or {}).get("changes") or []) + (
                [{"step": step, "changed": change["changed"]}] if change else []
            )
            self._resume_step, self._resume_path = step, str(path)
        if resume is None and cfg.overwrite:
            self._aside = aside.set_aside(out)
        self._run = ownership.claim(out, old, keep=resume is not None)
        ownership.write_record(out, self._run)  # before the run writes anything that it will own
        self.record = record
        return (None if path is None else str(path)), change

    def commit(self) -> None:
        """Every check of the start has passed: the set-aside run goes, half-written checkpoints and the logs past the
        resumed step are dropped, the checkpoints of the branch a resume leaves are set apart, run_config.json is
        written and the record gains this segment. From here on the folder is this run's."""

        def write() -> None:
            out = self.out_dir
            if self._aside:
                aside.drop_aside(out)
                print(
                    f"note: --overwrite removed the previous contents of {out} ({_names(self._aside)}).",
                    file=sys.stderr,
                )
            aside.clean_partial_checkpoints(out)
            run = self._run if self._run is not None else ownership.claim(out, ownership.read_record(out), keep=True)
            if self._resume_step is not None:
                resuming.truncate_logs(out, self._resume_step)
                resuming.supersede(out, run, self._resume_step)
            write_atomic(out / "run_config.json", json.dumps(self.record, indent=2), run_dir=out)
            start = self._resume_step if self._resume_path is not None else 0
            run["segments"].append({"start": start, "from": self._resume_path, "at": time.time()})
            ownership.write_record(out, run)

        self.decide(write)
        self.committed = True

    def abandon(self) -> None:
        """A start that failed: before `commit`, the folder goes back to what it was; the lock goes."""
        if self.committed:
            self.lock.release()
        else:
            self._undo()

    def _undo(self) -> None:
        """What this start wrote is removed, what it set aside put back, a folder it made removed; the lock released."""
        try:
            if self.is_main and self._before is not None:
                aside.remove_new(self.out_dir, self._before)
                aside.put_back(self.out_dir)
                record = self.out_dir / ownership.RECORD
                if self._record_bytes is not None and (
                    not record.is_file() or record.read_bytes() != self._record_bytes
                ):
                    write_atomic(record, self._record_bytes)
        finally:
            self.lock.release()
            for d in self._made if self.is_main else []:
                try:
                    d.rmdir()
                except OSError:  # not empty: someone else's now
                    break

    def check_room(self, policy: Any) -> None:
        """Rank 0: the disk holds a checkpoint (the trained weights and AdamW's two moments, in the master dtype, plus 10%),
        counting the room that a set-aside run frees at commit."""
        if not self.is_main:
            return
        trained = sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad)
        weights = trained if lora.is_peft(policy) else sum(p.numel() * p.element_size() for p in policy.parameters())
        reclaim = checks.size_of(self.out_dir / ownership.ASIDE)
        checks.check_writable(self.out_dir, int((weights + 2 * trained) * 1.1), reclaim)


def _but_threads(settings: dict[str, Any] | None) -> dict[str, Any] | None:
    """Settings less `threads`: a resume may give it freely, as it may give the device; the Trainer keeps the count the
    checkpoint recorded unless it is given, and says when a change ends bitwise equality (gcfamily/core/threads.py)."""
    return None if settings is None else {k: v for k, v in settings.items() if k != "threads"}


def _say(note: str | None) -> None:
    if note:
        print(note, file=sys.stderr)


def _names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
