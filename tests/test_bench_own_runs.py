"""`gcf bench` never replaces a run it did not write.

Each method's run goes to OUT/<method> with overwrite, which removes a run's and a model's files. A folder there that
holds a run of the user's, a model, or a bench run of other settings is refused in one sentence naming it, before any
method runs, unless --replace-runs; the bench's own runs of the same settings are still kept (finished) or run again
(not finished) without a question. The oracle is what the test itself put in the folder: every file's bytes, and the
user's seed (123) against the bench's (0).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from gcfamily.bench import check_run_folder, run_bench
from gcfamily.errors import GcfError

BENCH = (
    "bench",
    "--quick",
    "--methods",
    "sft",
    "--budget",
    "steps:1",
    "--set",
    "eval_samples=2",
    "--set",
    "max_new_tokens=2",
)
USER_SEED = 123  # the bench runs at seed 0


@pytest.fixture(scope="module")
def user_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of the user's: `gcfamily.train`, one step of SFT on the tiny model."""
    import gcfamily

    return gcfamily.train(
        method="sft",
        model="tiny",
        max_steps=1,
        output_dir=str(tmp_path_factory.mktemp("user") / "sft"),
        progress=False,
        report_to="none",
        seed=USER_SEED,
    )


def _digest(folder: Path) -> dict[str, str]:
    """Every file under folder (its relative path) and a hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _seed(folder: Path) -> int:
    return json.loads((folder / "run_config.json").read_text())["seed"]


def test_a_users_finished_run_is_refused_in_one_sentence_naming_it(gcf, user_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    shutil.copytree(user_run, out / "sft")
    before = _digest(out / "sft")
    assert "run_config.json" in before and "model.safetensors" in before and _seed(out / "sft") == USER_SEED
    code, stdout, err = gcf(*BENCH, "--output-dir", str(out))
    assert code == 2, stdout + err
    assert len(err.strip().splitlines()) == 1, err
    assert (
        err.startswith(f"error: {out / 'sft'} holds a run the bench did not start (") and "pass --replace-runs" in err
    ), err
    assert _digest(out / "sft") == before  # not a byte changed, no bench file added
    assert "running" not in stdout and not (out / "bench.md").exists()
    with pytest.raises(
        GcfError, match="holds a run the bench did not start"
    ):  # the entry function refuses by default too
        run_bench(["sft"], None, "arithmetic", "steps:1", True, out, {"eval_samples": "2"})
    assert _digest(out / "sft") == before


def test_replace_runs_replaces_it_and_the_bench_keeps_its_own_runs(gcf, user_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    shutil.copytree(user_run, out / "sft")
    code, stdout, err = gcf(*BENCH, "--output-dir", str(out), "--replace-runs")
    assert code == 0, stdout + err
    assert (
        _seed(out / "sft") == 0 and (out / "sft" / "bench_spec.json").is_file()
    )  # the user's run is gone, the bench's is there
    assert not (
        out / "sft" / "checkpoints"
    ).exists()  # the user's run had checkpoints; a finished bench child keeps none
    own = _digest(out / "sft")

    # the same command without the flag: the bench's own finished run is kept, not refused and not run again
    code, stdout, err = gcf(*BENCH, "--output-dir", str(out))
    assert code == 0 and "sft: kept the finished run" in stdout, stdout + err
    assert _digest(out / "sft") == own

    # a bench run of other settings is not the bench's to replace without the flag
    code, stdout, err = gcf(*BENCH[:4], "--budget", "steps:2", *BENCH[6:], "--output-dir", str(out))
    assert code == 2 and f"error: {out / 'sft'} holds a bench run of other settings (max_steps: 1 -> 2)" in err, (
        stdout + err
    )
    assert _digest(out / "sft") == own

    # the bench's own run that did not finish (stopped while it ran: no launch record) runs again without a question
    (out / "sft" / "bench_proc.json").unlink()
    code, stdout, err = gcf(*BENCH, "--output-dir", str(out))
    assert code == 0 and "sft: running" in stdout and "kept" not in stdout, stdout + err
    assert (out / "sft" / "bench_proc.json").is_file() and _seed(out / "sft") == 0


def test_what_a_folder_may_hold(tmp_path: Path) -> None:
    """Folders made by hand: a model is refused like a run; files the run would not touch are not; a file in the folder's
    place is refused even with the flag; an unreadable bench_spec.json is not taken for the bench's own."""
    plan = {"method_spec": "sft", "settings": {"method": "sft", "max_steps": 1, "output_dir": "x"}}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(
        GcfError,
        match=r"model holds a model or files the bench did not write \(config.json, model.safetensors\); "
        r"pass --replace-runs",
    ):
        check_run_folder(model, plan)
    check_run_folder(model, plan, replace=True)

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")  # the run's overwrite removes only a run's and a model's files
    check_run_folder(notes, plan)
    check_run_folder(tmp_path / "absent", plan)

    (tmp_path / "afile").write_text("x")
    for replace in (False, True):
        with pytest.raises(GcfError, match="afile is a file, where the bench would write"):
            check_run_folder(tmp_path / "afile", plan, replace=replace)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text("")
    (broken / "bench_spec.json").write_text("{not json")
    with pytest.raises(GcfError, match="bench_spec.json cannot be read"):
        check_run_folder(broken, plan)
    (broken / "bench_spec.json").write_text(
        json.dumps({**plan, "settings": {**plan["settings"], "output_dir": "elsewhere"}})
    )
    check_run_folder(broken, plan)  # the same plan written from another path spelling: the bench's own
