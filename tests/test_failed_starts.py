"""Runs that must not end "done": a start that fails leaves its folder as it was, a run that trained nothing is
refused; and the run of no step at all (max_steps=0) writes the model as loaded, with its card."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gcfamily.config import Config
from gcfamily.core.batch import STEP
from gcfamily.errors import GcfError
from gcfamily.run.trainer import Trainer

SMALL = ["--set", "progress=false", "--set", "report_to=none", "--set", "batch_size=2", "--set", "max_new_tokens=4"]
GRPO = ["--method", "grpo", "--model", "tiny", "--task", "arithmetic", "--set", "group_size=2", *SMALL]


def folder_bytes(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder`: a file by the sha256 of its bytes, a folder as "dir"."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_error(code: int, err: str, needle: str) -> None:
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert needle in err, err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A GRPO run of two steps with a checkpoint at each, made once and copied by each test."""
    from click.testing import CliRunner

    from gcfamily.cli import main

    out = tmp_path_factory.mktemp("base") / "r"
    args = ["run", *GRPO, "--max-steps", "2", "--output-dir", str(out), "--set", "save_every=1"]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A model folder of another size than tiny: tiny's checkpoints do not fit it."""
    from gcfamily.models import tiny_model, tiny_tokenizer

    folder = tmp_path_factory.mktemp("other") / "m"
    tok = tiny_tokenizer()
    tiny_model(len(tok), hidden=32).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# --------------------------------------------------------------------------- a failed start changes nothing

RESUME_FAILS = {
    "changed settings refused": (["--set", "lr=0.5"], "with other settings (lr: 1e-05 -> 0.5)"),
    "another model, changes allowed": (["--model", "OTHER", "--set", "allow_changed_settings=true"], "does not fit"),
    "a bad dataset path, changes allowed": (
        ["--dataset", "MISSING", "--set", "allow_changed_settings=true"],
        "does not exist",
    ),
    "LoRA on a full-weight checkpoint, changes allowed": (
        ["--set", "lora_r=4", "--set", "allow_changed_settings=true"],
        "does not match the model",
    ),
    "a bad reward spec, changes allowed": (
        ["--reward", "nosuch_module_gcf:fn", "--set", "allow_changed_settings=true"],
        "could not import reward module",
    ),
}


def _fill(args: list[str], tmp_path: Path, other_model: Path) -> list[str]:
    return [
        str(other_model) if a == "OTHER" else str(tmp_path / "missing.jsonl") if a == "MISSING" else a for a in args
    ]


@pytest.mark.parametrize("case", list(RESUME_FAILS))
def test_a_failed_resume_leaves_the_run_folder_byte_for_byte(gcf, tmp_path, finished_run, other_model, case):
    out = tmp_path / "r"
    shutil.copytree(finished_run, out)
    before = folder_bytes(out)
    args, needle = RESUME_FAILS[case]
    # the later flags win: --model OTHER after GRPO's --model tiny
    code, _, err = gcf(
        "run", *GRPO, "--max-steps", "3", "--output-dir", str(out), "--resume", *_fill(args, tmp_path, other_model)
    )
    one_error(code, err, needle)
    assert not (out / ".gcf.lock").exists()
    assert folder_bytes(out) == before  # run_config.json above all: no new settings, no "changes" entry


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--dataset", "MISSING"], "does not exist"),
        (["--reward", "nosuch_module_gcf:fn"], "could not import reward module"),
    ],
)
def test_a_failed_overwrite_keeps_the_previous_run(gcf, tmp_path, finished_run, other_model, args, needle):
    out = tmp_path / "r"
    shutil.copytree(finished_run, out)
    before = folder_bytes(out)
    assert "checkpoints/step-2/model.safetensors" in before and "model.safetensors" in before
    code, _, err = gcf(
        "run", *GRPO, "--max-steps", "2", "--output-dir", str(out), "--overwrite", *_fill(args, tmp_path, other_model)
    )
    one_error(code, err, needle)
    assert not (out / ".gcf.lock").exists()
    assert folder_bytes(out) == before
    assert gcf("run", *GRPO, "--max-steps", "3", "--output-dir", str(out), "--resume")[0] == 0  # still resumable


def test_a_failed_fresh_start_leaves_an_empty_folder_empty_and_makes_none(gcf, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = tmp_path / "new" / "r"
    for out in (empty, missing):
        code, _, err = gcf(
            "run", *GRPO, "--max-steps", "1", "--output-dir", str(out), "--reward", "nosuch_module_gcf:fn"
        )
        one_error(code, err, "could not import reward module")
    assert list(empty.iterdir()) == []
    assert not missing.exists()


def test_an_overwrite_killed_mid_start_is_put_back_by_the_next_start(gcf, tmp_path, finished_run):
    """A start with --overwrite sets the previous run aside until every check has passed; killed before then, the next
    start finds the run put back."""
    from conftest import metrics_rows

    from gcfamily.run.folder.aside import set_aside

    out = tmp_path / "r"
    shutil.copytree(finished_run, out)
    set_aside(out)  # what a killed --overwrite start leaves
    assert not (out / "run_config.json").exists()
    code, _, err = gcf("run", *GRPO, "--max-steps", "2", "--output-dir", str(out))
    one_error(code, err, "holds another run")  # the set-aside run counts as the run it is
    code, _, err = gcf("run", *GRPO, "--max-steps", "3", "--output-dir", str(out), "--resume")
    assert code == 0 and "put back" in err, err
    assert [r["step"] for r in metrics_rows(out) if "loss" in r] == [1, 2, 3]


# --------------------------------------------------------------------------- a run that trained nothing


def _cfg(tmp: Path, **kw) -> Config:
    base = dict(
        method="sft",
        model="tiny",
        task="arithmetic",
        max_steps=3,
        lr=1e-3,
        batch_size=4,
        micro_batch_size=2,
        output_dir=str(tmp),
        progress=False,
        report_to="none",
        save_every=0,
        log_every=1,
    )
    base.update(kw)
    return Config(**base)


def _poison(trainer: Trainer, at) -> None:
    """As tests/test_reliability.py: the steps where at(step) holds get a NaN coefficient (`step` is data()'s, from 0,
    so logged step step+1)."""
    data, coefficient = trainer.method.data, trainer.method.coefficient

    def poisoned(step: int):
        batch, stats = data(step)
        return batch.put("poison", bool(at(step)), STEP), stats

    trainer.method.data = poisoned
    trainer.method.coefficient = lambda batch, logps: (
        coefficient(batch, logps) * (float("nan") if batch.own.get("poison") else 1.0)
    )


def _skipped_steps(out: Path) -> list[int]:
    from conftest import metrics_rows

    return [r["step"] for r in metrics_rows(out) if r.get("skipped") == 1.0]


def test_a_run_whose_every_step_was_skipped_is_refused_naming_the_first(tmp_path):
    t = Trainer(_cfg(tmp_path, max_steps=3, max_bad_steps=5))  # 3 bad steps in a row never reach the 5 that stop it
    _poison(t, lambda step: True)
    with pytest.raises(GcfError) as e:
        t.run()
    assert _skipped_steps(tmp_path) == [1, 2, 3]  # every step was run, and every one skipped
    msg = str(e.value)
    assert "step 1" in msg and "skipped" in msg and len(msg.splitlines()) == 1, msg
    assert not (tmp_path / "model.safetensors").exists() and not (tmp_path / "README.md").exists()
    assert not (tmp_path / ".gcf.lock").exists()


def test_more_bad_steps_in_all_than_max_bad_steps_stop_the_run(tmp_path):
    t = Trainer(_cfg(tmp_path, max_steps=6, max_bad_steps=2))
    _poison(t, lambda step: step in (1, 3, 5))  # logged steps 2, 4, 6: never two in a row
    with pytest.raises(GcfError) as e:
        t.run()
    msg = str(e.value)
    assert "3 steps in all" in msg and "max_bad_steps=2" in msg and "step 2" in msg, msg
    assert _skipped_steps(tmp_path) == [2, 4]  # the third bad step (6) stopped the run before its row
    assert not (tmp_path / "model.safetensors").exists()


def test_as_many_bad_steps_in_all_as_max_bad_steps_finish(tmp_path):
    t = Trainer(_cfg(tmp_path, max_steps=4, max_bad_steps=2))
    _poison(t, lambda step: step in (0, 2))  # logged steps 1 and 3: 2 in all, not more than max_bad_steps
    t.run()
    assert _skipped_steps(tmp_path) == [1, 3]
    assert (tmp_path / "model.safetensors").exists()


def test_consecutive_bad_steps_name_the_runs_first_bad_step_across_a_resume(tmp_path):
    t = Trainer(_cfg(tmp_path, max_steps=2, max_bad_steps=3, save_every=1))
    _poison(t, lambda step: step == 0)  # logged step 1 skipped, step 2 trained
    t.run()
    assert _skipped_steps(tmp_path) == [1]
    t = Trainer(_cfg(tmp_path, max_steps=5, max_bad_steps=3, save_every=1), resume="latest")
    _poison(t, lambda step: step >= 2)  # logged steps 3, 4, 5: the run's 2nd-4th bad steps, 3 in a row at step 5
    with pytest.raises(GcfError) as e:
        t.run()
    msg = str(e.value)
    assert "3 consecutive steps had a non-finite" in msg and "first at step 1" in msg, msg


def test_a_method_whose_coefficient_is_nan_ends_non_zero_without_done(gcf, tmp_path):
    method = tmp_path / "nan_method.py"
    method.write_text(
        "from gcfamily.methods.sft import SFT\n\n\n"
        "class NaNSFT(SFT):\n"
        '    """SFT with a NaN coefficient everywhere."""\n\n'
        "    def coefficient(self, batch, logps):\n"
        '        return super().coefficient(batch, logps) * float("nan")\n'
    )
    out = tmp_path / "r"
    code, stdout, err = gcf(
        "run", "--method", f"{method}:NaNSFT", "--model", "tiny", "--task", "arithmetic", "--max-steps", "2",
        "--output-dir", str(out), *SMALL,
    )  # fmt: skip
    assert code != 0 and "done" not in stdout, stdout
    one_error(code, err, "step 1")
    assert not (out / "model.safetensors").exists()


# --------------------------------------------------------------------------- max_steps=0


@pytest.mark.parametrize("evaluate", [False, True])
def test_max_steps_zero_writes_the_model_as_loaded_with_its_card(gcf, tmp_path, evaluate):
    from gcfamily.models import tiny_model, tiny_tokenizer

    out = tmp_path / "r"
    code, stdout, err = gcf(
        "run", "--method", "sft", "--model", "tiny", "--task", "arithmetic", "--max-steps", "0",
        "--output-dir", str(out), "--set", "progress=false", "--set", "report_to=none",
        *(["--eval", "--set", "eval_samples=4", "--set", "max_new_tokens=4"] if evaluate else []),
    )  # fmt: skip
    assert code == 0, err
    assert "Traceback" not in err and "done: 0 steps" in stdout, stdout + err
    card = (out / "README.md").read_text()
    assert "no training step" in card, card
    base = tiny_model(len(tiny_tokenizer()), seed=0).state_dict()  # what --model tiny loads with the default seed
    written = load_file(str(out / "model.safetensors"))
    assert written and all(torch.equal(v, base[k]) for k, v in written.items())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if evaluate else []
    assert not evaluate or [r["step"] for r in rows] == [0] and "eval/accuracy" in rows[0]
    assert evaluate or not (out / "metrics.jsonl").exists()
