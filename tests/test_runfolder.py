"""The run folder as a transaction: overwrite, refusals, the lock, resume means the same run, damaged checkpoints,
a full disk at every write of a checkpoint, and processes that never outlive their launcher."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import metrics_rows

SMALL = ["--set", "progress=false", "--set", "batch_size=2", "--set", "max_new_tokens=4"]


def run(gcf, out, *args, steps=3):
    return gcf(
        "run", "--method", "sft", "--model", "tiny", "--max-steps", str(steps), "--output-dir", str(out), *SMALL, *args
    )


def one_error(code, err, needle):
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert needle in err, err


def steps_of(out):
    return [r["step"] for r in metrics_rows(out) if "loss" in r]


def checkpoints(out):
    return sorted(p.name for p in (Path(out) / "checkpoints").iterdir())


def test_overwrite_removes_the_previous_run_so_nothing_mixes(gcf, tmp_path):
    out = tmp_path / "r"
    assert run(gcf, out, "--set", "save_every=1", "--set", "keep_last=5", steps=4)[0] == 0
    assert checkpoints(out) == ["step-1", "step-2", "step-3", "step-4"]
    code, _, err = run(gcf, out, "--overwrite", steps=1)
    assert code == 0 and "--overwrite removed the previous contents" in err
    assert checkpoints(out) == ["step-1"] and steps_of(out) == [1]
    code, _, err = run(gcf, out, "--resume", steps=2)  # continues the new run, not the old one's step 4
    assert code == 0 and steps_of(out) == [1, 2]


def test_the_model_folder_and_a_folder_of_other_files_are_refused(gcf, tmp_path):
    model = tmp_path / "m"
    assert run(gcf, model, steps=1)[0] == 0
    code, _, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        str(model),
        "--max-steps",
        "1",
        "--output-dir",
        str(model),
        "--overwrite",
        *SMALL,
    )
    one_error(code, err, "is the model being trained")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, _, err = run(gcf, other, steps=1)
    one_error(code, err, "holds files (notes.txt) but no gcfamily run")
    assert (other / "notes.txt").read_text() == "mine"


def test_a_live_lock_is_refused_and_a_stale_one_taken_over(gcf, tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    lock = out / ".gcf.lock"
    holder = (  # a process that holds the folder's lock as a run does, until it is killed
        "import sys, time; from pathlib import Path; from gcfamily.run.folder.lock import RunLock; "
        "RunLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(60)"
    )
    live = subprocess.Popen([sys.executable, "-c", holder, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "held"
        code, _, err = run(gcf, out, steps=1)
        one_error(code, err, f"is in use by a running gcfamily run (pid {live.pid}")
    finally:
        live.kill()
        live.wait()
    code, _, err = run(gcf, out, steps=1)  # killed: its lock stays, and is stale
    assert code == 0 and f"took over the lock of a run that is gone (pid {live.pid}" in err
    assert not lock.exists()  # released at the end
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": 0}))  # a lock of before flock
    code, _, err = run(gcf, out, "--overwrite", steps=1)
    assert code == 0 and f"took over the lock of a run that is gone (pid {dead.pid}" in err


def test_resume_refuses_changed_settings_unless_allowed_and_then_applies_them(gcf, tmp_path):
    out = tmp_path / "r"
    assert run(gcf, out, "--set", "save_every=1", steps=2)[0] == 0
    code, _, err = run(gcf, out, "--resume", "--set", "lr=1e-4", "--set", "batch_size=4", steps=3)
    one_error(code, err, "with other settings (batch_size: 2 -> 4; lr: 1e-05 -> 0.0001)")
    code, _, err = run(gcf, out, "--resume", "--set", "lr=1e-4", "--set", "allow_changed_settings=true", steps=3)
    assert code == 0, err
    saved = json.loads((out / "run_config.json").read_text())
    assert saved["lr"] == 1e-4 and saved["changes"] == [{"step": 2, "changed": {"lr": [1e-5, 1e-4]}}]
    rows = metrics_rows(out)
    assert [r.get("settings_changed") for r in rows if r["step"] == 2][-1] == 1.0
    assert [r["lr"] for r in rows if "loss" in r] == [
        1e-5,
        1e-5,
        1e-4,
    ]  # the optimizer took the new lr, not the checkpoint's


def test_resume_logs_each_step_once_and_clears_half_written_checkpoints(gcf, tmp_path):
    out = tmp_path / "r"
    assert run(gcf, out, "--set", "save_every=2", steps=4)[0] == 0
    import shutil

    shutil.rmtree(out / "checkpoints" / "step-4")  # as if the run died after logging steps 3 and 4
    (out / "checkpoints" / ".tmp-step-4-123").mkdir()
    assert run(gcf, out, "--resume", "--set", "save_every=2", steps=4)[0] == 0
    assert steps_of(out) == [1, 2, 3, 4]
    assert not list((out / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["truncated weights", "missing state", "truncated state", "flipped byte"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_intact_one(gcf, tmp_path, damage):
    out = tmp_path / "r"
    assert run(gcf, out, "--set", "save_every=1", steps=3)[0] == 0
    newest = out / "checkpoints" / "step-3"
    if damage == "truncated weights":
        os.truncate(newest / "model.safetensors", 100)
    elif damage == "missing state":
        (newest / "state.pt").unlink()
    elif damage == "truncated state":
        os.truncate(newest / "state.pt", 64)
    else:
        data = bytearray((newest / "model.safetensors").read_bytes())
        data[-1] ^= 1
        (newest / "model.safetensors").write_bytes(bytes(data))
    code, _, err = run(gcf, out, "--resume", str(newest), steps=4)  # named explicitly: refused, not silently replaced
    one_error(code, err, "step-3 is damaged")
    code, _, err = run(gcf, out, "--resume", steps=4)
    assert code == 0 and "step-3 is damaged" in err and "trying the one before it" in err
    assert steps_of(out) == [1, 2, 3, 4]


WRITES = ["weights", "state", "tokenizer", "manifest", "marker"]


@pytest.mark.parametrize("which", WRITES)
def test_a_full_disk_at_each_write_of_a_checkpoint_leaves_the_previous_one_resumable(gcf, tmp_path, monkeypatch, which):
    import torch

    from gcfamily.run import checkpoint_format as checkpoint

    out = tmp_path / "r"
    calls = {"n": 0}

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    real = {"weights": checkpoint.save_file, "state": torch.save, "manifest": checkpoint._manifest}

    def on_second(name):
        def f(*a, **k):
            if name == "weights":
                calls["n"] += 1
            if calls["n"] >= 2:
                full()
            return real[name](*a, **k)

        return f

    monkeypatch.setattr(checkpoint, "save_file", on_second("weights"))
    if which == "state":
        monkeypatch.setattr(checkpoint.torch, "save", on_second("state"))
    elif which == "manifest":
        monkeypatch.setattr(checkpoint, "_manifest", on_second("manifest"))
    elif which == "tokenizer":
        from transformers import PreTrainedTokenizerBase

        real_tok = PreTrainedTokenizerBase.save_pretrained
        monkeypatch.setattr(
            PreTrainedTokenizerBase,
            "save_pretrained",
            lambda self, *a, **k: full() if calls["n"] >= 2 else real_tok(self, *a, **k),
        )
    elif which == "marker":
        real_write = Path.write_text
        monkeypatch.setattr(
            Path,
            "write_text",
            lambda self, *a, **k: full() if self.name == "COMPLETE" and calls["n"] >= 2 else real_write(self, *a, **k),
        )
    code, _, err = run(gcf, out, "--set", "save_every=1", steps=3)
    one_error(code, err, "Could not write the checkpoint of step 2")
    assert "No space left on device" in err and "the checkpoint of step 1 is intact" in err
    assert checkpoints(out) == ["step-1"]
    monkeypatch.undo()
    code, _, err = run(gcf, out, "--resume", "--set", "save_every=1", steps=3)
    assert code == 0, err
    assert steps_of(out) == [1, 2, 3] and checkpoints(out) == ["step-2", "step-3"]


def test_a_full_disk_without_any_checkpoint_says_so(gcf, tmp_path, monkeypatch):
    from gcfamily.run import checkpoint_format as checkpoint

    monkeypatch.setattr(
        checkpoint, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    )
    code, _, err = run(gcf, tmp_path / "r", steps=2)
    one_error(code, err, "no checkpoint of this run was saved, so its steps are lost")
    assert "intact" not in err


def test_a_full_disk_at_the_final_model_keeps_the_checkpoint_and_resume_writes_it(gcf, tmp_path, monkeypatch):
    from gcfamily.core import precision

    monkeypatch.setattr(
        precision, "save_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    )
    out = tmp_path / "r"
    code, _, err = run(gcf, out, steps=2)
    one_error(code, err, "Could not write the final model")
    assert "the checkpoint of step 2 is intact" in err
    monkeypatch.undo()
    assert run(gcf, out, "--resume", steps=2)[0] == 0
    assert (out / "model.safetensors").is_file() and steps_of(out) == [1, 2]


def test_an_unwritable_output_folder_is_one_sentence(gcf, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes through permissions")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code, _, err = run(gcf, ro / "run", steps=1)
        one_error(code, err, "cannot be made")
    finally:
        ro.chmod(0o700)


def _gcf_cmd(*args):
    return [sys.executable, "-m", "gcfamily", "run", "--method", "sft", "--model", "tiny", *SMALL, *args]


def _has_a_step(out):
    try:
        return bool(steps_of(out))
    except (OSError, ValueError):  # not written yet, or a line half written
        return False


def test_two_runs_started_into_one_folder_never_interleave(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "r"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # a stale lock to take over: both judge it stale, exactly one takes it (tests/test_runfolder_attacks.py races twelve)
    (out / ".gcf.lock").write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": 0}))
    # Both race for the lock; whichever wins runs until it is stopped, so the other always meets it running (60 steps of
    # the tiny model take under a second: a finished first run left the second free to --overwrite it, and both exited 0).
    procs = [
        subprocess.Popen(
            _gcf_cmd("--max-steps", "100000", "--output-dir", str(out), "--overwrite"),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + 300
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        _, err = loser.communicate(timeout=60)
        assert loser.returncode == 2, err
        assert "is in use by a running gcfamily run" in err and len(err.strip().splitlines()) == 1, err
        while not _has_a_step(out) and time.monotonic() < deadline:  # the winner is training
            time.sleep(0.2)
        assert winner.poll() is None
        winner.send_signal(signal.SIGTERM)
        _, err = winner.communicate(timeout=120)
        assert winner.returncode == 128 + signal.SIGTERM, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    steps = steps_of(out)
    assert steps and steps == list(range(1, len(steps) + 1))  # one run's steps, each once


def test_sigkill_to_the_launcher_leaves_no_worker_behind(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "r"
    launcher = subprocess.Popen(
        _gcf_cmd("--max-steps", "100000", "--output-dir", str(out), "--nproc", "2"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 1800  # a hang guard: two workers start slowly on a loaded machine
        while not (out / "metrics.jsonl").is_file() and time.time() < deadline:
            time.sleep(0.5)
        assert (out / "metrics.jsonl").is_file(), "the workers never started"
        workers = [
            int(p)
            for p in subprocess.run(
                ["pgrep", "-P", str(launcher.pid)], check=False, capture_output=True, text=True
            ).stdout.split()
        ]
        assert len(workers) == 2
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 300  # a hang guard, not a speed claim: they must die, however busy the machine
        alive = workers
        while alive and time.time() < deadline:
            time.sleep(0.2)
            alive = [
                w
                for w in workers
                if Path(f"/proc/{w}").exists() and "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2]
            ]
        assert not alive, f"workers {alive} outlived their launcher"
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_checkpoint_resumed_into_another_architecture_is_one_sentence(gcf, tmp_path):
    out = tmp_path / "r"
    assert run(gcf, out, steps=1)[0] == 0
    code, _, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "smollm2-135m",
        "--max-steps",
        "2",
        "--output-dir",
        str(tmp_path / "o"),
        "--resume",
        str(out / "checkpoints" / "step-1"),
        "--set",
        "allow_changed_settings=true",  # another model is a change of settings: refused without it (issue 35)
        *SMALL,
    )
    one_error(code, err, "does not fit this model (size mismatch")


def test_a_run_that_fails_in_setup_leaves_no_run_behind(gcf, tmp_path):
    out = tmp_path / "r"
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": None, "completion": "b"}) + "\n"
    )
    code, _, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--dataset",
        str(data),
        "--max-steps",
        "1",
        "--output-dir",
        str(out),
        *SMALL,
    )
    one_error(code, err, "Row 1")
    assert not (out / "run_config.json").exists() and not (out / ".gcf.lock").exists()
    assert run(gcf, out, steps=1)[0] == 0  # the same folder, no --overwrite needed


def test_prompts_too_long_for_the_context_are_skipped_at_setup(gcf, tmp_path):
    from gcfamily.models import tiny_model, tiny_tokenizer
    from gcfamily.rollout import context_length

    ctx = context_length(tiny_model(len(tiny_tokenizer())))
    data = tmp_path / "p.jsonl"
    data.write_text(
        json.dumps({"prompt": "x" * (ctx - 5), "answer": "1"})
        + "\n"
        + json.dumps({"prompt": "1+0=", "answer": "1"})
        + "\n"
    )
    code, _, err = gcf(
        "run",
        "--method",
        "grpo",
        "--model",
        "tiny",
        "--dataset",
        str(data),
        "--reward",
        "numeric",
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "r"),
        "--set",
        f"max_length={ctx}",
        "--set",
        "group_size=2",
        *SMALL,
    )
    assert code == 0, err
    assert metrics_rows(tmp_path / "r")[-1]["skipped_long_prompts"] == 1.0
