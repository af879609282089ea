"""--resume from a checkpoint into another folder than its own run's: the settings are compared with the checkpoint's
(which it records), refused or recorded and applied exactly as a resume in place; the source run is left as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import metrics_rows

SMALL = ["--set", "progress=false", "--set", "report_to=none", "--set", "batch_size=2"]
LR = 0.001


def run(gcf, out: Path, *args: str, steps: int):
    return gcf(
        "run", "--method", "sft", "--model", "tiny", "--task", "arithmetic", "--max-steps", str(steps),
        "--output-dir", str(out), *SMALL, *args,
    )  # fmt: skip


def folder_bytes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
    }


def one_error(code: int, err: str, needle: str) -> None:
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert needle in err, err


def trained_lrs(out: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in metrics_rows(out) if "loss" in r}


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """Run A: two steps at lr 0.001 (constant), a checkpoint at each."""
    from click.testing import CliRunner

    from gcfamily.cli import main

    out = tmp_path_factory.mktemp("a") / "A"
    args = ["run", "--method", "sft", "--model", "tiny", "--task", "arithmetic", "--max-steps", "2"]
    args += ["--output-dir", str(out), *SMALL, "--set", f"lr={LR}", "--set", "save_every=1"]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    return out


def test_a_changed_lr_into_another_folder_is_refused_and_touches_neither_folder(gcf, tmp_path, run_a):
    a_before = folder_bytes(run_a)
    b = tmp_path / "B"
    code, _, err = run(gcf, b, "--resume", str(run_a / "checkpoints" / "step-2"), "--set", "lr=0.5", steps=4)
    one_error(code, err, "with other settings (lr: 0.001 -> 0.5)")
    assert not b.exists()
    assert folder_bytes(run_a) == a_before


def test_a_changed_lr_into_another_folder_when_allowed_is_recorded_and_every_step_takes_it(gcf, tmp_path, run_a):
    a_before = folder_bytes(run_a)
    b = tmp_path / "B"
    code, _, err = run(
        gcf,
        b,
        "--resume",
        str(run_a / "checkpoints" / "step-2"),
        "--set",
        "lr=0.5",
        "--set",
        "allow_changed_settings=true",
        steps=4,
    )
    assert code == 0, err
    saved = json.loads((b / "run_config.json").read_text())
    assert saved["lr"] == 0.5 and saved["changes"] == [{"step": 2, "changed": {"lr": [LR, 0.5]}}]
    assert trained_lrs(b) == {3: 0.5, 4: 0.5}  # the optimizer took the new lr, not the checkpoint's 0.001
    assert [r.get("settings_changed") for r in metrics_rows(b)] == [1.0, None, None]
    assert trained_lrs(run_a) == {1: LR, 2: LR}
    assert folder_bytes(run_a) == a_before


def test_the_same_settings_into_another_folder_continue_the_run(gcf, tmp_path, run_a):
    b = tmp_path / "B"
    code, _, err = run(gcf, b, "--resume", str(run_a / "checkpoints" / "step-2"), "--set", f"lr={LR}", steps=4)
    assert code == 0, err
    assert trained_lrs(b) == {3: LR, 4: LR}
    assert json.loads((b / "run_config.json").read_text()).get("changes") in (None, [])


def test_a_checkpoint_copied_out_of_its_run_still_carries_its_settings(gcf, tmp_path, run_a):
    copy = tmp_path / "kept" / "step-2"
    shutil.copytree(run_a / "checkpoints" / "step-2", copy)  # no run folder around it any more
    code, _, err = run(gcf, tmp_path / "B", "--resume", str(copy), "--set", "lr=0.5", steps=4)
    one_error(code, err, "with other settings (lr: 0.001 -> 0.5)")


def test_a_checkpoint_that_records_no_settings_is_compared_with_its_run_folder(gcf, tmp_path, run_a):
    """A checkpoint written before checkpoints recorded their settings: its run's run_config.json stands in."""
    a = tmp_path / "A"
    shutil.copytree(run_a, a)
    ckpt = a / "checkpoints" / "step-2"
    (ckpt / "run_config.json").unlink()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest.pop("run_config.json")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run(gcf, tmp_path / "B", "--resume", str(ckpt), "--set", "lr=0.5", steps=4)
    one_error(code, err, "with other settings (lr: 0.001 -> 0.5)")


def test_an_earlier_checkpoint_is_compared_with_the_settings_it_was_written_under(gcf, tmp_path):
    """Run A changes its lr at step 2 (allowed, recorded); a resume from step 2 at the new lr is still a change for
    the checkpoint of step 2, whose optimizer holds the old one: refused unless allowed, then applied."""
    a = tmp_path / "A"
    assert run(gcf, a, "--set", f"lr={LR}", "--set", "save_every=1", "--set", "keep_last=9", steps=2)[0] == 0
    more = ["--set", "lr=0.01", "--set", "save_every=1", "--set", "keep_last=9"]
    code, _, err = run(gcf, a, "--resume", *more, "--set", "allow_changed_settings=true", steps=4)
    assert code == 0, err
    step2 = str(a / "checkpoints" / "step-2")
    code, _, err = run(gcf, tmp_path / "B", "--resume", step2, *more, steps=4)
    one_error(code, err, "with other settings (lr: 0.001 -> 0.01)")
    code, _, err = run(gcf, a, "--resume", step2, *more, steps=4)  # in place, the same
    one_error(code, err, "with other settings (lr: 0.001 -> 0.01)")
    code, _, err = run(gcf, tmp_path / "B", "--resume", step2, *more, "--set", "allow_changed_settings=true", steps=4)
    assert code == 0, err
    assert trained_lrs(tmp_path / "B") == {3: 0.01, 4: 0.01}
