"""Exact resume, signals, SIGKILL mid-checkpoint, and non-finite steps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gcfamily.config import Config
from gcfamily.core.batch import STEP
from gcfamily.errors import GcfError, Interrupted
from gcfamily.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp: Path, method: str = "sft", **kw) -> Config:
    base = dict(
        method=method,
        model="tiny",
        task="arithmetic",
        max_steps=4,
        lr=1e-3,
        batch_size=4,
        micro_batch_size=2,
        output_dir=str(tmp),
        progress=False,
        lr_schedule="cosine",
        warmup_steps=1,
        save_every=0,
    )
    base.update(kw)
    return Config(**base)


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.unwrapped_policy().state_dict().items()}


def _interrupt_at(trainer: Trainer, step: int) -> None:
    orig = trainer.method.after_step

    def after(s: int):
        if s == step:
            trainer.stop_signal = "SIGTERM"
        return orig(s)

    trainer.method.after_step = after


# GRPO and DPO join this list as they land; each must resume bitwise
RESUME_METHODS = [("sft", {})]
try:
    from gcfamily.methods import METHODS

    if "grpo" in METHODS:
        RESUME_METHODS.append(("grpo", {"group_size": 4, "batch_size": 2, "max_new_tokens": 6, "mu": 2}))
    if "dpo" in METHODS:
        RESUME_METHODS.append(("dpo", {"batch_size": 2}))
except ImportError:  # pragma: no cover
    pass


@pytest.mark.parametrize("method,extra", RESUME_METHODS, ids=[m for m, _ in RESUME_METHODS])
def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, method, extra):
    whole = Trainer(_cfg(tmp_path / "a", method, **extra))
    whole.run()
    cut = Trainer(_cfg(tmp_path / "b", method, **extra))
    _interrupt_at(cut, 2)
    with pytest.raises(Interrupted, match="--resume"):
        cut.run()
    resumed = Trainer(_cfg(tmp_path / "b", method, **extra), resume="latest")
    assert resumed.step == 2
    resumed.run()
    a, b = _params(whole), _params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run differs from the uninterrupted one"


def _poison(trainer: Trainer, at) -> None:  # noqa: ANN001
    """The steps where at(step) holds get a NaN coefficient, hence a non-finite loss and gradient."""
    data, coefficient = trainer.method.data, trainer.method.coefficient

    def poisoned(step: int):  # noqa: ANN202
        batch, stats = data(step)
        return batch.put("poison", bool(at(step)), STEP), stats

    trainer.method.data = poisoned
    trainer.method.coefficient = lambda batch, logps: (
        coefficient(batch, logps) * (float("nan") if batch.own.get("poison") else 1.0)
    )


def test_forced_non_finite_step_is_skipped_and_counted(tmp_path):
    t = Trainer(_cfg(tmp_path, max_steps=3, max_bad_steps=3))
    _poison(t, lambda step: step == 1)
    before = {}
    orig_step = t.optimizer_step

    def spy(batch):
        before["p"] = _params(t)
        out = orig_step(batch)
        if out["skipped"]:
            after = _params(t)
            assert all(torch.equal(before["p"][k], after[k]) for k in after)  # weights untouched
        return out

    t.optimizer_step = spy
    t.run()
    from conftest import metrics_rows

    rows = metrics_rows(tmp_path)
    assert rows[1]["skipped"] == 1.0 and rows[-1]["skipped_steps"] == 1.0
    assert rows[0]["skipped"] == 0.0 and rows[2]["skipped"] == 0.0


def test_consecutive_non_finite_steps_stop_with_checkpoint_intact(tmp_path):
    t = Trainer(_cfg(tmp_path, max_steps=6, max_bad_steps=2, save_every=1))
    _poison(t, lambda step: step >= 2)
    with pytest.raises(GcfError, match="consecutive steps had a non-finite"):
        t.run()
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert ckpts == ["step-2", "step-3"]  # steps 1-2 good, step 3 skipped (weights untouched), step 4 stops
    w2 = load_file(str(tmp_path / "checkpoints" / "step-2" / "model.safetensors"))
    w3 = load_file(str(tmp_path / "checkpoints" / "step-3" / "model.safetensors"))
    assert all(torch.isfinite(v).all() and torch.equal(v, w3[k]) for k, v in w2.items())


def _gcf_proc(
    out: Path, steps: int, extra_env: dict | None = None, resume: bool = False, *more: str
) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "gcfamily",
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--max-steps",
        str(steps),
        "--output-dir",
        str(out),
        "--set",
        "lr=1e-3",
        "--set",
        "batch_size=4",
        "--set",
        "save_every=1",
        "--set",
        "progress=false",
        "--set",
        "lr_schedule=cosine",
    ]
    if resume:
        args.append("--resume")
    args += list(more)
    env = {**os.environ, **(extra_env or {})}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(pred, timeout: float = 1200.0) -> None:
    """Poll until pred() holds; the timeout only guards against a hang (a loaded machine may take minutes)."""
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout:
            raise TimeoutError
        time.sleep(0.05)


def test_sigkill_during_checkpoint_write_then_resume_matches(tmp_path):
    ref = _gcf_proc(tmp_path / "ref", 4)
    assert ref.wait(timeout=300) == 0, ref.stderr.read()
    out = tmp_path / "run"
    # step 1's write pauses until the kill (however long the machine takes to get there)
    p = _gcf_proc(out, 4, {"GCF_TEST_CHECKPOINT_PAUSE": "3600@1"})
    # the first checkpoint write pauses between its files and its marker: kill it right there
    _wait_for(
        lambda: any((out / "checkpoints").glob(".tmp-step-1-*/state.pt")) if (out / "checkpoints").exists() else False
    )
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert not list((out / "checkpoints").glob("step-*"))  # nothing complete to pick up
    r = _gcf_proc(out, 4, resume=True)
    r.wait(timeout=300)
    assert r.returncode != 0 and "No complete checkpoint" in r.stderr.read()
    # a second kill, now mid-write of step 2's checkpoint, after step 1's landed
    q = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gcfamily",
            "run",
            "--method",
            "sft",
            "--model",
            "tiny",
            "--max-steps",
            "4",
            "--output-dir",
            str(out),
            "--overwrite",
            "--set",
            "lr=1e-3",
            "--set",
            "batch_size=4",
            "--set",
            "save_every=1",
            "--set",
            "progress=false",
            "--set",
            "lr_schedule=cosine",
        ],
        cwd=ROOT,
        # step 1's checkpoint lands at once and step 2's write pauses until the kill: no race with a busy machine
        env={**os.environ, "GCF_TEST_CHECKPOINT_PAUSE": "3600@2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(lambda: any((out / "checkpoints").glob(".tmp-step-2-*/state.pt")))
    q.send_signal(signal.SIGKILL)
    q.wait(timeout=60)
    assert [x.name for x in (out / "checkpoints").glob("step-*")] == ["step-1"]
    r = _gcf_proc(out, 4, resume=True)
    assert r.wait(timeout=300) == 0, r.stderr.read()
    a = load_file(str(tmp_path / "ref" / "model.safetensors"))
    b = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_saves_a_resumable_checkpoint(tmp_path):
    out = tmp_path / "run"
    p = _gcf_proc(out, 10_000)
    _wait_for(lambda: (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2)
    p.send_signal(signal.SIGTERM)
    code = p.wait(timeout=1200)  # a hang guard: the step in flight ends first, however loaded the machine
    err = p.stderr.read()
    assert code == 128 + signal.SIGTERM and "--resume" in err and "Traceback" not in err
    assert list((out / "checkpoints").glob("step-*/COMPLETE"))
    # already past step 1: resumes and finishes at once (a shorter cosine schedule is a change of settings, said so)
    r = _gcf_proc(out, 1, None, True, "--set", "allow_changed_settings=true")
    assert r.wait(timeout=300) == 0, r.stderr.read()


def test_full_disk_is_one_clear_error_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """A write that fails (no space left) ends in one sentence; the last complete checkpoint stays and no partial one is left."""
    from gcfamily.run import checkpoint_format as checkpoint

    model = torch.nn.Linear(2, 2)
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 1, model, {"step": 1})

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(GcfError, match="Could not write the checkpoint of step 2.*No space left on device.*--resume"):
        checkpoint.save(root, 2, model, {"step": 2})
    assert [p.name for p in checkpoint.complete_checkpoints(root)] == ["step-1"]
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]
