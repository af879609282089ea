"""Breaks of the run folder found by an attacker (issue 33): --overwrite removes only what a run wrote and checks
everything before it moves anything; resume follows the run's own history; one owner per folder in every race; and
the damaged or full-disk cases end in one sentence with nothing left half written."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import metrics_rows

from gcfamily.config import Config
from gcfamily.errors import GcfError, Interrupted
from gcfamily.run import checkpoint_format as checkpoint
from gcfamily.run.folder.lock import LOCK, RunLock
from gcfamily.run.folder.ownership import CLAIMS, RECORD
from gcfamily.run.folder.resuming import finish_pending, truncate_logs

SMALL = ["--set", "progress=false", "--set", "report_to=none", "--set", "batch_size=2", "--set", "max_new_tokens=4"]
ROOT = Path(__file__).resolve().parents[1]


def run(gcf, out, *args, steps=1):
    return gcf(
        "run", "--method", "sft", "--model", "tiny", "--max-steps", str(steps), "--output-dir", str(out), *SMALL, *args
    )


def one_error(code, err, needle):
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert needle in err, err


def folder_bytes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
    }


def user_files(folder: Path) -> None:
    """What a user keeps in a folder of their own, under names a gcfamily run also writes."""
    for d in ("checkpoints", "wandb", "adapter"):
        (folder / d).mkdir(parents=True)
        (folder / d / "mine.txt").write_text(d)
    (folder / "vocab.json").write_text('{"mine": 1}')
    (folder / "notes.txt").write_text("mine")


# --------------------------------------------------------------------------- 1. --overwrite removes only a run's


def test_overwrite_never_removes_a_users_files_that_bear_run_names(gcf, tmp_path):
    out = tmp_path / "mine"
    user_files(out)
    before = folder_bytes(out)
    code, _, err = run(gcf, out, "--overwrite")
    one_error(code, err, "no run of this folder wrote them")
    assert folder_bytes(out) == before  # the old code called this "another run" and removed all four


def test_the_current_directory_is_refused_asking_for_a_folder(gcf, tmp_path, monkeypatch):
    user_files(tmp_path / "cwd")
    monkeypatch.chdir(tmp_path / "cwd")
    before = folder_bytes(tmp_path / "cwd")
    for given in ("", ".", str(tmp_path / "cwd")):
        code, _, err = run(gcf, given, "--overwrite")
        one_error(code, err, "is the current directory")
    assert folder_bytes(tmp_path / "cwd") == before


def test_overwrite_removes_exactly_the_runs_entries_also_for_a_run_of_before_records(gcf, tmp_path):
    out = tmp_path / "r"
    assert run(gcf, out, "--set", "save_every=1", steps=2)[0] == 0
    (out / "notes.txt").write_text("mine")  # the user's, beside the run
    (out / "data").mkdir()
    (out / "data" / "rows.jsonl").write_text("{}\n")
    assert run(gcf, out, "--overwrite", steps=1)[0] == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "data" / "rows.jsonl").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]
    (out / RECORD).unlink()  # a run written before records: its owned entries are the run names present
    assert run(gcf, out, "--overwrite", steps=1)[0] == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "data" / "rows.jsonl").is_file()
    record = json.loads((out / RECORD).read_text())
    assert "checkpoints" in record["owns"] and "notes.txt" not in record["owns"]


def test_a_failed_overwrite_start_leaves_the_folder_byte_for_byte(gcf, tmp_path):
    out = tmp_path / "r"
    assert run(gcf, out, "--set", "save_every=1", steps=2)[0] == 0
    before = folder_bytes(out)
    code, _, err = run(gcf, out, "--overwrite", "--dataset", str(tmp_path / "typo.jsonl"))
    one_error(code, err, "typo.jsonl")
    assert folder_bytes(out) == before
    # the --model is a checkpoint of the run --overwrite would remove: refused before anything moves
    code, _, err = run(gcf, out, "--overwrite", "--model", str(out / "checkpoints" / "step-1"))
    one_error(code, err, "lies inside")
    assert folder_bytes(out) == before


# --------------------------------------------------------------------------- 2. resume follows the run's history


def _cfg(out: Path, **kw) -> Config:
    base = {"method": "sft", "model": "tiny", "task": "arithmetic", "max_steps": 4, "lr": 1e-3, "batch_size": 2}
    base.update(
        output_dir=str(out), progress=False, report_to="none", lr_schedule="constant", save_every=1, keep_last=10
    )
    return Config(**{**base, **kw})


def test_resume_latest_continues_the_newest_segment_not_an_older_branch(tmp_path):
    from gcfamily.run.trainer import Trainer

    out = tmp_path / "r"
    Trainer(_cfg(out)).run()  # steps 1..4, a checkpoint at each
    branch = Trainer(_cfg(out, lr=5e-4, allow_changed_settings=True), resume=str(out / "checkpoints" / "step-2"))
    assert branch.step == 2
    after = branch.method.after_step

    def stop_at_3(s: int):  # as SIGTERM during step 3: the run checkpoints step 3 and stops
        if s == 3:
            branch.stop_signal = "SIGTERM"
        return after(s)

    branch.method.after_step = stop_at_3
    with pytest.raises(Interrupted):
        branch.run()
    again = Trainer(_cfg(out, lr=5e-4, allow_changed_settings=True), resume="latest")
    assert again.step == 3  # the old code took the first branch's step 4
    again.run()
    rows = [r for r in metrics_rows(out) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["lr"] for r in rows] == [1e-3, 1e-3, 5e-4, 5e-4]
    assert json.loads((out / "run_config.json").read_text())["lr"] == 5e-4
    root = out / "checkpoints"
    assert sorted(p.name for p in (root / "replaced-at-step-2").iterdir()) == ["step-3", "step-4"]  # kept, set apart
    record = json.loads((out / RECORD).read_text())
    assert [(s["start"], Path(s["from"]).name if s["from"] else None) for s in record["segments"]] == [
        (0, None),
        (2, "step-2"),
        (3, "step-3"),
    ]


def test_a_resume_killed_while_setting_a_branch_apart_is_finished_by_the_next_start(tmp_path):
    out = tmp_path / "r"
    root = out / "checkpoints"
    for step in (1, 2, 3):
        checkpoint.save(root, step, torch.nn.Linear(2, 2), {"step": step}, keep_last=5)
    record = {
        "owns": list(CLAIMS),
        "segments": [],
        "pending": {"dest": "replaced-at-step-1", "names": ["step-2", "step-3"]},
    }
    (out / "run_config.json").write_text(json.dumps({"method": "sft"}))
    (root / "replaced-at-step-1").mkdir()
    os.replace(root / "step-3", root / "replaced-at-step-1" / "step-3")  # the kill came after step-3 moved
    finish_pending(out, record)
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step-1"]
    assert record["pending"] is None and json.loads((out / RECORD).read_text())["pending"] is None


# --------------------------------------------------------------------------- 3. one owner per folder

WORKER = """
import os, sys, time
from pathlib import Path
from gcfamily.errors import GcfError
from gcfamily.run.folder.lock import RunLock
out, sync, me, rounds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
def wait(name):
    while not (sync / name).exists():
        time.sleep(0.001)
for r in range(rounds):
    wait(f"go-{r}")
    lock = RunLock(out)
    try:
        lock.acquire()
        won = "won"
    except GcfError as e:
        won = "lost" if "in use" in str(e) else "error: " + str(e)
    (sync / f"res-{r}-{me}.tmp").write_text(won)
    os.replace(sync / f"res-{r}-{me}.tmp", sync / f"res-{r}-{me}")
    wait(f"release-{r}")
    lock.release()
    (sync / f"done-{r}-{me}").write_text("")
"""


def _stale_lock(path: Path, fmt: int) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    owner = {"pid": dead.pid, "host": host, "started": 0}  # a lock of before flock: judged by its pid
    if fmt:  # this version's, its owner gone: no one holds its flock
        owner.update(token="0" * 16, flock=True, boot_id=Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    path.write_text(json.dumps(owner))


def _wait_files(sync: Path, pattern: str, n: int) -> None:
    deadline = time.monotonic() + 120
    while len(list(sync.glob(pattern))) < n:
        assert time.monotonic() < deadline, f"workers never wrote {pattern}"
        time.sleep(0.005)


@pytest.mark.skipif(not Path("/proc/sys/kernel/random/boot_id").is_file(), reason="needs Linux /proc")
def test_many_processes_racing_to_take_over_a_stale_lock_have_one_winner(tmp_path):
    out, sync = tmp_path / "r", tmp_path / "sync"
    out.mkdir()
    sync.mkdir()
    n, rounds = 12, 6
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(out), str(sync), str(i), str(rounds)], cwd=ROOT)
        for i in range(n)
    ]
    try:
        for r in range(rounds):
            _stale_lock(out / LOCK, r % 2)
            (sync / f"go-{r}").write_text("")
            _wait_files(sync, f"res-{r}-*[0-9]", n)
            results = [(sync / f"res-{r}-{i}").read_text() for i in range(n)]
            assert sorted(results) == ["lost"] * (n - 1) + ["won"], (r, results)
            (sync / f"release-{r}").write_text("")
            _wait_files(sync, f"done-{r}-*", n)
            assert not (out / LOCK).exists()
        assert sorted(p.name for p in out.iterdir()) == []  # no temporary link left behind
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.parametrize(
    "content, needle",
    [
        ("null", "not a gcfamily lock (it holds null"),
        ('"abc"', 'not a gcfamily lock (it holds "abc"'),
        ("[1, 2]", "not a gcfamily lock (it holds [1, 2]"),
        ("{not json", "not a gcfamily lock (it is not JSON"),
        ('{"pid": "abc", "host": "h"}', "not a gcfamily lock (it names no pid"),
        ('{"pid": null}', "not a gcfamily lock (it names no pid"),
        ("folder", "is a folder, where gcfamily keeps its lock file"),
    ],
)
def test_a_lock_file_that_is_not_a_lock_is_one_sentence_naming_it(tmp_path, content, needle):
    lock = tmp_path / LOCK
    lock.mkdir() if content == "folder" else lock.write_text(content)
    with pytest.raises(GcfError) as e:
        RunLock(tmp_path).acquire()
    assert needle in str(e.value) and str(lock) in str(e.value) and "\n" not in str(e.value)
    assert lock.exists() and sorted(p.name for p in tmp_path.iterdir()) == [LOCK]


def test_a_lock_of_pid_1_is_not_a_running_run_unless_it_holds_the_lock(tmp_path):
    lock = tmp_path / LOCK
    host = socket.gethostname()
    lock.write_text(json.dumps({"pid": 1, "host": host, "started": 0}))  # pid 1 started after this lock: not its owner
    note = RunLock(tmp_path).acquire()
    assert note and "took over the lock of a run that is gone (pid 1" in note
    os.unlink(lock)
    boot = (
        Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        if Path("/proc/sys/kernel/random/boot_id").exists()
        else ""
    )
    lock.write_text(
        json.dumps({"pid": 1, "host": host, "boot_id": boot, "token": "x", "flock": True, "started": time.time()})
    )
    assert "took over" in (RunLock(tmp_path).acquire() or "")  # no flock held: no run holds it
    os.unlink(lock)
    for other in ({"host": "another-host"}, {"host": host, "boot_id": "another-boot"}):
        lock.write_text(json.dumps({"pid": 1, "token": "x", "flock": True, "started": 0, **other}))
        with pytest.raises(GcfError, match="on another machine or boot .* cannot be checked from here; .* delete"):
            RunLock(tmp_path).acquire()


def test_a_lock_in_this_process_is_replaced_and_releases_only_its_own(tmp_path):
    first, second = RunLock(tmp_path), RunLock(tmp_path)
    first.acquire()
    assert second.acquire() is None  # a Trainer built here earlier and never run
    first.release()  # not first's lock any more: left in place
    assert (tmp_path / LOCK).exists()
    second.release()
    assert not (tmp_path / LOCK).exists()


# --------------------------------------------------------------------------- 4. damaged files and a full disk


def _two_checkpoints(root: Path) -> None:
    model = torch.nn.Linear(2, 2)
    for step in (1, 2):
        checkpoint.save(root, step, model, {"step": step, "optimizer": {}, "scheduler": {}, "rng": {}, "method": {}})


@pytest.mark.parametrize("manifest", ["[]", "null", '{"state.pt": null}', '{"state.pt": {"size": "x"}}'])
def test_a_manifest_that_is_not_one_is_damage_not_a_traceback(tmp_path, manifest, capsys):
    root = tmp_path / "checkpoints"
    _two_checkpoints(root)
    (root / "step-2" / checkpoint.MANIFEST).write_text(manifest)
    assert checkpoint.find("latest", tmp_path).name == "step-1"
    assert "step-2 is damaged (manifest.json" in capsys.readouterr().err
    with pytest.raises(GcfError, match="step-2 is damaged"):
        checkpoint.find(str(root / "step-2"), tmp_path)


def test_unreadable_checkpoint_files_are_one_sentence(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    _two_checkpoints(root)
    real = checkpoint._sha256
    monkeypatch.setattr(
        checkpoint,
        "_sha256",
        lambda f: (_ for _ in ()).throw(PermissionError(13, "Permission denied")) if "step-2" in str(f) else real(f),
    )
    with pytest.raises(GcfError, match=r"step-2 is damaged \(.* cannot be read \(Permission denied\)\)"):
        checkpoint.find(str(root / "step-2"), tmp_path)
    monkeypatch.undo()
    model = torch.nn.Linear(2, 2)
    checkpoint.save(root, 3, model, [1, 2])  # type: ignore[arg-type]  # a state.pt that is no run's state
    with pytest.raises(GcfError, match="step-3 has a state.pt that holds a list, not a run's training state"):
        checkpoint.load(root / "step-3", model)


def _enospc_at(monkeypatch, n: int, targets: list[tuple[object, str]]) -> dict:
    """Make the n-th call (counting over every target) raise ENOSPC; returns the counter."""
    calls = {"n": 0}
    for owner, name in targets:
        real = getattr(owner, name)

        def wrapped(*a, _real=real, **k):
            calls["n"] += 1
            if calls["n"] == n:
                raise OSError(errno.ENOSPC, "No space left on device")
            return _real(*a, **k)

        monkeypatch.setattr(owner, name, wrapped)
    return calls


WRITES = [(checkpoint, "save_file"), (torch, "save"), (Path, "write_text"), (os, "fsync"), (os, "replace")]


def test_a_full_disk_at_any_write_of_a_checkpoint_leaves_the_earlier_ones_whole(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    _two_checkpoints(root)
    before = folder_bytes(root)
    counted = _enospc_at(monkeypatch, 0, WRITES)
    checkpoint.save(root, 2, torch.nn.Linear(2, 2), {"step": 2})  # the same step again: every write it makes, counted
    total = counted["n"]
    monkeypatch.undo()
    before, failed = folder_bytes(root), 0
    assert total >= 8
    for n in range(1, total + 1):
        _enospc_at(monkeypatch, n, WRITES)
        try:
            checkpoint.save(root, 2, torch.nn.Linear(2, 2), {"step": 2})
        except GcfError as e:
            assert "Could not write the checkpoint of step 2" in str(e) and "step 2 is intact" in str(e), str(e)
            failed += 1
        monkeypatch.undo()
        if folder_bytes(root) != before:  # saved: only the sync of the folder after the rename may fail unseen
            assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"], n
            assert checkpoint.damage(root / "step-2") is None
            before = folder_bytes(root)
    assert failed >= total - 1  # the old code lost step-2 itself when the rename over it failed


def test_a_writer_failing_with_its_own_error_type_leaves_no_temporary_folder(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    root = tmp_path / "checkpoints"
    _two_checkpoints(root)
    monkeypatch.setattr(
        checkpoint,
        "save_file",
        lambda *a, **k: (_ for _ in ()).throw(
            SafetensorError("Error while serializing: No space left on device (os error 28)")
        ),
    )
    with pytest.raises(GcfError, match="Could not write the checkpoint of step 3 .*step 2 is intact"):
        checkpoint.save(root, 3, torch.nn.Linear(2, 2), {"step": 3})
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"]
    monkeypatch.setattr(checkpoint, "save_file", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):  # not a failed write: shown as it is, and still nothing left half written
        checkpoint.save(root, 3, torch.nn.Linear(2, 2), {"step": 3})
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"]


def _full_disk_for(monkeypatch, suffix: str) -> None:
    """Writes to files whose name ends in `suffix` fail as on a full disk (after the file was created)."""
    real = Path.open

    class Full(io.RawIOBase):
        def __init__(self, f):
            self.f = f

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def writable(self):
            return True

        def fileno(self):
            return self.f.fileno()

        def close(self):
            self.f.close()
            super().close()

    def opened(self, mode="r", *a, **k):
        f = real(self, mode, *a, **k)
        if self.name.endswith(suffix) and "w" in mode:
            return Full(f) if "b" in mode else io.TextIOWrapper(Full(f))
        return f

    monkeypatch.setattr(Path, "open", opened)


def test_truncating_the_logs_on_a_full_disk_leaves_no_temporary_file(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    _full_disk_for(monkeypatch, ".jsonl.tmp")
    with pytest.raises(GcfError, match="metrics.jsonl"):
        truncate_logs(tmp_path, 1)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_full_disk_at_run_config_json_is_one_sentence_and_leaves_nothing(tmp_path, monkeypatch):
    from gcfamily.run.trainer import Trainer

    out = tmp_path / "r"
    _full_disk_for(monkeypatch, "run_config.json.tmp")
    with pytest.raises(GcfError, match="run_config.json"):
        Trainer(_cfg(out, max_steps=1))
    monkeypatch.undo()
    assert not out.exists()  # the start made the folder, and took it away again


def test_a_filesystem_without_hard_links_still_gets_a_whole_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(
        os, "link", lambda *a, **k: (_ for _ in ()).throw(PermissionError(1, "Operation not permitted"))
    )
    lock = RunLock(tmp_path)
    assert lock.acquire() is None
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    other = (  # another process meets the lock held
        "import sys; from pathlib import Path; from gcfamily.errors import GcfError; "
        "from gcfamily.run.folder.lock import RunLock\n"
        "try:\n    RunLock(Path(sys.argv[1])).acquire()\nexcept GcfError as e:\n    print(e)"
    )
    said = subprocess.run(
        [sys.executable, "-c", other, str(tmp_path)], check=False, capture_output=True, text=True, cwd=ROOT
    )
    assert f"is in use by a running gcfamily run (pid {os.getpid()}" in said.stdout, said.stdout + said.stderr
    lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
