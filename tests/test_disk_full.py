"""A full disk at every write a run makes ends in one sentence and a resumable run (issue 33, item 5).

A first pass counts the writes a whole short run makes into its folder; then, for every N, the run is made again with
the Nth write failing as a full disk fails it (half the bytes land, then ENOSPC, in the error type each writer really
raises: OSError from Python's files, SafetensorError from safetensors, a bare Exception from tokenizers, torch's stream
writer's RuntimeError; measured on a 64 KiB tmpfs). Each time the run must end in a GcfError of one line that names the
newest intact checkpoint (or says there is none), leave no temporary file or folder and no damaged file, and a
following --resume (or a fresh run where no checkpoint exists) must finish, from that checkpoint.

The hooks sit at the lowest level Python reaches: `open`/`io.open` (every Python file, os.fdopen included), `os.write`
(raw descriptors), safetensors' `serialize_file`, `torch.save` and the tokenizers backend's `save`; renames are
followed, and the counting pass asserts that every file the run left was written through one of them.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
from pathlib import Path
from typing import Any, Self

import pytest
import torch

from gcfamily.config import Config
from gcfamily.errors import GcfError
from gcfamily.run import checkpoint_format as checkpoint
from gcfamily.run.trainer import Trainer

FULL = "No space left on device"


class Disk:
    """Counts the writes under `root` and fails the `fail_at`-th (1-based) as a full disk does."""

    def __init__(self, root: Path, fail_at: int | None = None) -> None:
        self.root = str(root.resolve())
        self.fail_at = fail_at
        self.writes: list[str] = []  # the path of each write, in order
        self.written: set[str] = set()  # files whose bytes came through a hook (followed through renames)
        self.failed: str | None = None  # the path of the failed write

    def under(self, path: Any) -> str | None:
        if isinstance(path, int):
            try:
                path = os.readlink(f"/proc/self/fd/{path}")
            except OSError:
                return None
        try:
            p = os.path.abspath(os.fsdecode(path))
        except TypeError:
            return None
        return p if p == self.root or p.startswith(self.root + os.sep) else None

    def hit(self, path: str) -> bool:
        """Count a write to `path`; True when this one is to fail."""
        self.writes.append(path)
        self.written.add(path)
        if self.fail_at is not None and len(self.writes) == self.fail_at:
            self.failed = path
            return True
        return False

    def moved(self, src: Any, dst: Any) -> None:
        s, d = self.under(src), self.under(dst)
        if s is None or d is None:
            return
        for p in [p for p in self.written if p == s or p.startswith(s + os.sep)]:
            self.written.discard(p)
            self.written.add(d + p[len(s) :])


class _File:
    """A file object whose writes go through Disk."""

    def __init__(self, f: Any, disk: Disk, path: str) -> None:
        self._f, self._disk, self._path = f, disk, path

    def write(self, data: Any) -> int:
        if self._disk.hit(self._path):
            self._f.write(data[: len(data) // 2])
            self._f.flush()
            raise OSError(errno.ENOSPC, FULL)
        return self._f.write(data)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def __iter__(self) -> Any:
        return iter(self._f)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class _Backend:
    """The tokenizers backend, whose `save` (Rust) goes through Disk."""

    def __init__(self, tok: Any, disk: Disk) -> None:
        self._tok, self._disk = tok, disk

    def save(self, path: str, *a: Any, **k: Any) -> None:
        p = self._disk.under(path)
        if p is not None and self._disk.hit(p):
            self._tok.save(path, *a, **k)
            _halve(path)
            raise Exception(f"{FULL} (os error 28)")  # noqa: TRY002 - what tokenizers raises on a full disk
        self._tok.save(path, *a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def _halve(path: Any) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def install(monkeypatch: pytest.MonkeyPatch, disk: Disk) -> None:
    """Route every write of the process under disk.root through `disk`."""
    import safetensors
    import safetensors.torch as st
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    real_open, real_write, real_replace, real_rename = io.open, os.write, os.replace, os.rename

    def hooked_open(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        f = real_open(file, mode, *a, **k)
        p = disk.under(file) if any(c in mode for c in "wax+") else None
        return f if p is None else _File(f, disk, p)

    def hooked_write(fd: int, data: Any) -> int:
        p = disk.under(fd)
        if p is not None and disk.hit(p):
            real_write(fd, bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, FULL)
        return real_write(fd, data)

    def moving(real: Any) -> Any:
        def f(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            real(src, dst, *a, **k)
            disk.moved(src, dst)

        return f

    real_serialize = st.serialize_file

    def hooked_serialize(tensors: Any, filename: Any, *a: Any, **k: Any) -> None:
        p = disk.under(filename)
        real_serialize(tensors, filename, *a, **k)
        if p is not None and disk.hit(p):
            _halve(filename)
            raise safetensors.SafetensorError(f"Error while serializing: I/O error: {FULL} (os error 28)")

    real_save = torch.save

    def hooked_save(obj: Any, f: Any, *a: Any, **k: Any) -> None:
        p = disk.under(f) if isinstance(f, (str, os.PathLike)) else None
        real_save(obj, f, *a, **k)
        if p is not None and disk.hit(p):
            _halve(f)
            # torch's stream writer on a full disk (measured): the cause is not named
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not what is tested here, and fsync is slow
    monkeypatch.setattr(builtins, "open", hooked_open)
    monkeypatch.setattr(io, "open", hooked_open)
    monkeypatch.setattr(os, "write", hooked_write)
    monkeypatch.setattr(os, "replace", moving(real_replace))
    monkeypatch.setattr(os, "rename", moving(real_rename))
    monkeypatch.setattr(st, "serialize_file", hooked_serialize)
    monkeypatch.setattr(torch, "save", hooked_save)
    monkeypatch.setattr(torch.serialization, "save", hooked_save)
    monkeypatch.setattr(TokenizersBackend, "backend_tokenizer", property(lambda self: _Backend(self._tokenizer, disk)))


# ------------------------------------------------------------------ the run


def _cfg(out: Path, **kw: Any) -> Config:
    base: dict[str, Any] = {
        "method": "sft",
        "model": "tiny",
        "task": "arithmetic",
        "max_steps": 4,
        "save_every": 2,
        "lr": 1e-3,
        "batch_size": 2,
        "micro_batch_size": 2,
        "output_dir": str(out),
        "progress": False,
        "eval_at_ends": False,
        "report_to": "tensorboard",
    }
    base.update(kw)
    return Config(**base)


ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(3) for b in range(3)]
"""A small dataset: the arithmetic task's 240 chat-templated rows would take most of each run's time."""


def _trainer(out: Path, resume: str | None = None, **kw: Any) -> Trainer:
    return Trainer(_cfg(out, **kw), resume, dataset=ROWS)


def _run(out: Path, **kw: Any) -> None:
    _trainer(out, **kw).run()


def _intact(out: Path) -> list[int]:
    """Steps of the complete checkpoints whose files match their manifest (checkpoint.damage, sha256 and all)."""
    return [
        int(p.name[5:])
        for p in checkpoint.complete_checkpoints(out / "checkpoints")
        if checkpoint.damage(p) is None  # the oracle: every file hashed against the manifest written with it
    ]


def _check_folder(out: Path) -> None:
    """No temporary leftovers; every log line parses; every complete checkpoint is intact."""
    if not out.exists():
        return
    left = [str(p.relative_to(out)) for p in out.rglob("*") if ".tmp" in p.name]
    assert not left, f"temporary leftovers: {left}"
    for name in ("metrics.jsonl", "completions.jsonl"):
        if (out / name).is_file():
            text = (out / name).read_text()
            assert text == "" or text.endswith("\n"), f"{name} ends in half a line"
            for line in text.splitlines():
                json.loads(line)
    for p in checkpoint.complete_checkpoints(out / "checkpoints"):
        assert checkpoint.damage(p) is None, f"{p} is damaged: {checkpoint.damage(p)}"
    for f in out.glob("*.json"):  # the run record and the final folder's files: whole, or not there
        json.loads(f.read_text())
    if (out / "model.safetensors").is_file():
        from safetensors.torch import load_file

        load_file(str(out / "model.safetensors"))


def _shape(path: str, out: Path) -> str:
    """A written path relative to its run folder, less what differs from run to run (pids, times, random names)."""
    rel = os.path.relpath(path, out.resolve())
    return re.sub(r"[0-9a-f]{16}|\d+", "#", re.sub(r"\.[a-z0-9_]{8}\.tmp$", ".*.tmp", rel))


def _steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if "loss" in x]


def _count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Disk:
    out = tmp_path / "count"
    disk = Disk(out)
    with monkeypatch.context() as m:
        install(m, disk)
        _run(out)
    # the hooks saw every file the run left (after its renames): nothing is written past them
    files = {str(p.resolve()) for p in out.rglob("*") if p.is_file()}
    assert files and files <= disk.written, f"written past the hooks: {sorted(files - disk.written)}"
    return disk


@pytest.fixture(scope="module")
def writes(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The writes of the whole run, in order, as `_shape`s."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("disk")
    try:
        return [_shape(p, root / "count") for p in _count(root, mp).writes]
    finally:
        mp.undo()


def test_the_hooks_see_every_write_of_a_run(writes):
    """Every kind of file the run writes is counted (the fixture also checked that no file was written past the hooks)."""
    names = " ".join(writes)
    for name in ("metrics.jsonl", "events.out.tfevents", "model.safetensors", "state.pt", "tokenizer.json", "COMPLETE"):
        assert name in names, (name, names)
    assert "README.md" in names and "run_config.json" in names


# ------------------------------------------------------------------ every write, failed in turn


def _fail_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int, want: str) -> tuple[str, str]:
    """Run with the nth write failing; check the sentence and the folder, then continue. (what failed, the sentence)"""
    out = tmp_path / f"n{n}"
    disk = Disk(out, fail_at=n)
    with monkeypatch.context() as m:
        install(m, disk)
        try:
            _run(out)
            raised: BaseException | None = None
        except BaseException as e:  # noqa: BLE001 - which type it is, is the point
            raised = e
    where = _shape(disk.failed, out) if disk.failed else "?"
    assert where == want, f"write {n} is {where}, not the {want} counted"
    assert isinstance(raised, GcfError), f"write {n} ({where}): {type(raised).__name__}: {raised}"
    said = str(raised)
    assert "\n" not in said.strip(), f"write {n} ({where}): more than one line: {said}"
    _check_folder(out)
    intact = _intact(out)
    if intact:
        assert f"step {intact[-1]}" in said and "--resume" in said, f"write {n} ({where}): {said}"
        trainer = _trainer(out, "latest")
        assert trainer.step == intact[-1]  # the newest intact checkpoint is the one taken
        trainer.run()
    else:
        assert "intact" not in said or "no checkpoint" in said, f"write {n} ({where}): {said}"
        _run(out, overwrite=True)
    _check_folder(out)
    assert _steps(out) == [1, 2, 3, 4] and (out / "model.safetensors").is_file() and (out / "README.md").is_file()
    return where, said


def test_a_full_disk_at_every_write_ends_in_one_sentence_and_the_run_resumes(writes, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # the resumes too: 80 runs, and durability is not tested here
    problems = []
    for n, want in enumerate(writes, 1):
        try:
            where, said = _fail_and_resume(tmp_path, monkeypatch, n, want)
            print(f"write {n:2d} {where}: {said}")  # the table of the closing note (pytest -s)
        except AssertionError as e:
            problems.append(f"write {n} ({want}): {str(e).splitlines()[0]}")
    assert not problems, "\n".join(problems)


def test_a_failed_folder_write_leaves_the_folder_as_it_was(tmp_path):
    from gcfamily.run.folder.writes import STAGE, WriteFailed, write_folder

    out = tmp_path / "run"
    (out / "adapter").mkdir(parents=True)
    (out / "config.json").write_text("old")
    (out / "adapter" / "a.bin").write_text("old adapter")

    def half(folder: Path) -> None:
        (folder / "config.json").write_text("new")
        (folder / "model.safetensors").write_bytes(b"12")
        raise Exception(f"Error while serializing: I/O error: {FULL} (os error 28)")  # noqa: TRY002 - as a writer says it

    with pytest.raises(WriteFailed, match=r"Could not write the model \(the disk is full\); no checkpoint of this run"):
        write_folder(out, half, run_dir=out, what="the model")
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "config.json"]  # no stage left, nothing new
    assert (out / "config.json").read_text() == "old" and (out / "adapter" / "a.bin").read_text() == "old adapter"

    def whole(folder: Path) -> None:
        (folder / "config.json").write_text("new")
        (folder / "adapter").mkdir()
        (folder / "adapter" / "b.bin").write_text("new adapter")

    assert write_folder(out, whole, run_dir=out, what="the model") == ["adapter", "config.json"]
    assert (out / "config.json").read_text() == "new" and not (out / STAGE).exists()
    assert [p.name for p in (out / "adapter").iterdir()] == ["b.bin"]  # a folder is replaced whole, not merged

    def wrong(folder: Path) -> None:
        raise TypeError("a bug, not a full disk")

    with pytest.raises(TypeError):  # a mistake shows as itself, and the stage still goes
        write_folder(out, wrong, run_dir=out, what="the model")
    assert not (out / STAGE).exists()


def test_an_append_that_fails_halfway_leaves_the_log_as_it_was(tmp_path, monkeypatch):
    from gcfamily.run.logger import RunLogger

    out = tmp_path / "run"
    log = RunLogger(out, report_to="tensorboard")
    log.log(1, {"loss": 1.0})
    log.completions(1, [{"prompt": "p", "completion": "c", "reward": 1.0}] * 3)
    events = next((out / "tensorboard").iterdir())
    before = {p: p.read_bytes() for p in (out / "metrics.jsonl", out / "completions.jsonl", events)}
    for call in (
        lambda: log.log(2, {"loss": 0.5}),
        lambda: log.completions(2, [{"prompt": "p", "completion": "c", "reward": 1.0}] * 3),
    ):
        disk = Disk(out, fail_at=1)
        with monkeypatch.context() as m:
            install(m, disk)
            with pytest.raises(GcfError, match=r"\(the disk is full\); no checkpoint of this run was saved"):
                call()
        assert disk.failed is not None  # the write did fail, half of it on disk, and was undone
        assert {p: p.read_bytes() for p in before} == before
    for call in (  # the second write of each: TensorBoard's record, after the row
        lambda: log.log(3, {"loss": 0.25}),
        lambda: log.completions(3, [{"prompt": "p", "completion": "c"}]),
    ):
        kept = events.read_bytes()
        disk = Disk(out, fail_at=2)
        with monkeypatch.context() as m:
            install(m, disk)
            with pytest.raises(GcfError, match="the disk is full"):
                call()
        assert disk.failed == str(events.resolve()) and events.read_bytes() == kept
    log.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()  # the file reads whole: every record that is there is complete
    assert [e.step for e in acc.Scalars("loss")] == [1]


def test_a_full_disk_while_a_resume_starts_and_drops_the_rows_past_its_checkpoint(tmp_path, monkeypatch):
    """The writes of a resume up to its first checkpoint (the lock, the run record, the logs cut back to the checkpoint's
    step, TensorBoard's file, the rows of steps 3 and 4), each failed in turn."""
    import shutil

    monkeypatch.setattr(os, "fsync", lambda fd: None)
    base = tmp_path / "base"
    _run(base)
    shutil.rmtree(base / "checkpoints" / "step-4")  # checkpoint 2 stays; rows 3 and 4 are past it
    (base / "model.safetensors").unlink()
    probe = tmp_path / "probe"
    shutil.copytree(base, probe)
    disk = Disk(probe)
    with monkeypatch.context() as m:
        install(m, disk)
        _trainer(probe, "latest").run()
    shapes = [_shape(p, probe) for p in disk.writes]
    start = shapes[: next(i for i, s in enumerate(shapes) if s.startswith("checkpoints/"))]
    assert "metrics.jsonl.tmp" in start or any("metrics" in s for s in start), start
    problems = []
    for n, want in enumerate(start, 1):
        out = tmp_path / f"r{n}"
        shutil.copytree(base, out)
        disk = Disk(out, fail_at=n)
        try:
            with monkeypatch.context() as m:
                install(m, disk)
                with pytest.raises(BaseException) as info:  # which type it is, is checked below
                    _trainer(out, "latest").run()
            said = str(info.value)
            assert isinstance(info.value, GcfError), f"{type(info.value).__name__}: {said}"
            assert "\n" not in said.strip() and "step 2" in said and "--resume" in said, said
            _check_folder(out)
            assert _intact(out) == [2]
            trainer = _trainer(out, "latest")
            assert trainer.step == 2
            trainer.run()
            _check_folder(out)
            assert _steps(out) == [
                1,
                2,
                3,
                4,
            ]  # each step's row once: the rows past step 2 were dropped, then logged again
        except AssertionError as e:
            problems.append(f"write {n} ({want}): {str(e).splitlines()[0]}")
    assert not problems, "\n".join(problems)
