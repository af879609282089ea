"""TRL's names lead to gcfamily's (the one table, gcfamily/config/trl_names.py, and its copy in docs/trl-mapping.md);
`epochs` is a budget the trainer keeps; `gcf --version`; the console says what an evaluation is doing and where the
curves are."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import tomllib
import torch
from conftest import metrics_rows

from gcfamily.config import FIELD_NAMES, Config, apply, planned_steps, validate
from gcfamily.config.trl_names import TRL_NAMES, markdown_table
from gcfamily.errors import GcfError, Interrupted
from gcfamily.methods import METHODS, get_method
from gcfamily.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(10)]


def _run_flags() -> set[str]:
    from gcfamily.cli import run

    return {o for p in run.params for o in getattr(p, "opts", [])}


def test_every_target_is_a_setting_or_a_flag_of_gcf_run():
    flags = _run_flags()
    own = {f.name for m in METHODS for f in dataclasses.fields(get_method(m).Settings)}
    for name, s in TRL_NAMES.items():
        if s.target is None:
            assert s.note, f"{name}: no equivalent, and no word on what to do instead"
        elif s.target.startswith("--"):
            assert s.target in flags, f"{name} -> {s.target}, not a flag of gcf run"
        else:
            assert s.target in FIELD_NAMES or s.target in own, f"{name} -> {s.target}, not a setting"
            if s.value is not None and s.target in FIELD_NAMES and not re.search("[A-Z]", s.value):
                validate(apply(Config(), {s.target: s.value}, "--set"))  # the value it names is one gcfamily takes


def test_the_doc_table_is_the_dict():
    doc = (ROOT / "docs" / "trl-mapping.md").read_text()
    start = doc.index("| TRL / transformers | gcfamily | |")
    assert doc[start : doc.index("\n\n", start)] == markdown_table()
    rows = [line for line in markdown_table().splitlines()[2:]]
    assert len(rows) == len(TRL_NAMES) and "| `learning_rate` | `--set lr=...` |" in markdown_table()


@pytest.mark.parametrize(
    "flag,said",
    [
        ("--learning_rate", "gcfamily spells it --set lr=..."),
        ("--use_peft", "--set lora_r=16"),
        ("--num_train_epochs", "--set epochs=..."),
        ("--model_name_or_path", "gcfamily spells it --model"),
        ("--output_dir", "--output-dir"),
        ("--bf16", "--set dtype=bfloat16"),
        ("--per_device_eval_batch_size", "gcfamily has no equivalent"),
        ("--max_new_tokens", "--set max_new_tokens=..."),  # gcfamily's own setting, typed as a flag
    ],
)
def test_a_trl_flag_is_one_sentence_with_gcfamilys_spelling(gcf, flag, said):
    code, _out, err = gcf("run", "--method", "sft", "--model", "tiny", flag, "1")
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err


def test_a_trl_setting_name_is_one_sentence_and_a_flag_of_another_command_is_not_offered(gcf, tmp_path):
    code, _, err = gcf("run", "--model", "tiny", "--set", "learning_rate=1e-5")
    assert code == 2 and "'learning_rate' is TRL's name; gcfamily spells it --set lr=..." in err, err
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: sft\nnum_train_epochs: 2\n")
    code, _, err = gcf("run", "--model", "tiny", "--config", str(recipe))
    assert code == 2 and "'num_train_epochs' is TRL's name; gcfamily spells it --set epochs=..." in err, err
    code, _, err = gcf("run", "--model", "tiny", "--set", "beta=0.1")  # gcfamily's name too, not sft's: the usual error
    assert code == 2 and "Unknown setting 'beta' for method sft" in err, err
    code, _, err = gcf("eval", "--learning_rate", "1")  # eval's --set takes task options: no lr there
    assert code == 2 and "No such option '--learning_rate'" in err, err
    code, _, err = gcf("run", "--set", "lr=1e-5", "epochs=2")
    assert code == 2 and "--set takes one key=value" in err and "(--set epochs=2)" in err, err


def test_version(gcf):
    code, out, _ = gcf("--version")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert code == 0 and out.strip() == f"gcf (gcfamily) {version}"


# ----------------------------------------------------------------------------- epochs


def _cfg(tmp: Path, given: tuple[str, ...] = (), **kw) -> Config:
    base = {
        "method": "sft",
        "model": "tiny",
        "task": None,
        "lr": 1e-3,
        "batch_size": 4,
        "micro_batch_size": 4,
        "output_dir": str(tmp),
        "progress": False,
        "lr_schedule": "linear",
        "report_to": "none",
    }
    base.update(kw)
    return Config(**base, explicit=sorted({"epochs", *given}))


def _steps_and_lrs(out: Path) -> tuple[list[int], list[float]]:
    rows = [r for r in metrics_rows(out) if "loss" in r]
    return [r["step"] for r in rows], [r["lr"] for r in rows]


def test_epochs_alone_set_the_steps_and_the_schedule_spans_them(tmp_path):
    # 2 passes over 10 rows at 4 a step: ceil(20 / 4) = 5 steps; linear decay over 5: lr_k = 1e-3 (1 - k/5)
    Trainer(_cfg(tmp_path, epochs=2.0), dataset=ROWS).run()
    steps, lrs = _steps_and_lrs(tmp_path)
    assert steps == [1, 2, 3, 4, 5]
    assert lrs == pytest.approx([8e-4, 6e-4, 4e-4, 2e-4, 0.0], abs=1e-12)


@pytest.mark.parametrize(
    "epochs,max_steps,expected", [(2.0, 3, 3), (0.5, 10, 2)], ids=["max_steps-first", "epochs-first"]
)
def test_epochs_and_max_steps_stop_at_whichever_comes_first(tmp_path, epochs, max_steps, expected):
    # 0.5 passes over 10 rows at 4 a step: ceil(5 / 4) = 2 steps, before max_steps=10
    Trainer(_cfg(tmp_path, ("max_steps",), epochs=epochs, max_steps=max_steps), dataset=ROWS).run()
    steps, lrs = _steps_and_lrs(tmp_path)
    assert steps == list(range(1, expected + 1))
    assert lrs[-1] == 0.0  # the linear schedule reaches its end on the last step taken


def test_epochs_count_prompts_on_policy(tmp_path):
    import gcfamily as gcf

    prompts = [{"prompt": f"{i}+2="} for i in range(6)]
    out = gcf.train(
        method="grpo",
        model="tiny",
        dataset=prompts,
        reward=lambda completions, **_: [float(len(c) % 2) for c in completions],
        epochs=1,
        batch_size=3,
        group_size=2,
        micro_batch_size=6,
        max_new_tokens=3,
        progress=False,
        report_to="none",
        output_dir=str(tmp_path),
    )
    assert _steps_and_lrs(out)[0] == [1, 2]  # 6 prompts, 3 a step: one pass is 2 steps


def test_epochs_take_the_decimal_as_written_and_a_method_that_gives_no_count_is_refused():
    cfg = Config(epochs=0.1, batch_size=3, explicit=["epochs"])
    assert planned_steps(cfg, 30) == 1  # 0.1 * 30 / 3 = 1 exactly; in floats 1.0000000000000002, ceil 2
    assert planned_steps(Config(max_steps=7), None) == 7  # no epochs: max_steps, the count never needed
    with pytest.raises(GcfError, match="epochs=0.1 needs the number of examples"):
        planned_steps(cfg, None)


def test_an_epochs_run_resumed_equals_the_uninterrupted_one(tmp_path):
    from test_reliability import _interrupt_at, _params

    whole = Trainer(_cfg(tmp_path / "a", epochs=2.0), dataset=ROWS)
    whole.run()
    cut = Trainer(_cfg(tmp_path / "b", epochs=2.0), dataset=ROWS)
    _interrupt_at(cut, 2)
    with pytest.raises(Interrupted, match="--resume"):
        cut.run()
    resumed = Trainer(_cfg(tmp_path / "b", epochs=2.0), dataset=ROWS, resume="latest")
    assert resumed.step == 2 and resumed.max_steps == 5
    resumed.run()
    assert resumed.step == 5
    a, b = _params(whole), _params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run differs from the uninterrupted one"


# ----------------------------------------------------------------------------- what the console says


def test_the_console_says_an_evaluation_runs_and_where_the_curves_are(gcf, tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--task",
        "arithmetic",
        "--max-steps",
        "1",
        "--eval",
        "--output-dir",
        str(out),
        "--set",
        "eval_samples=2",
        "--set",
        "max_new_tokens=2",
        "--set",
        "batch_size=2",
    )
    assert code == 0, stderr
    assert "evaluating at step 0 on up to 2 held-out examples..." in stderr
    assert "evaluated at step 1 in" in stderr and "eval/accuracy" in stderr
    assert f"metrics: {out / 'metrics.jsonl'}" in stdout
    assert f"tensorboard: tensorboard --logdir {out / 'tensorboard'}" in stdout
    assert f"curves: {out / 'curves.png'}" in stdout
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # an image, whole


def test_the_packing_answer_says_what_the_engine_does_and_the_engine_does_it(gcf, tmp_path, monkeypatch):
    """--packing and --padding_free are answered with what gcfamily always does (not 'no equivalent'), and a training
    step's log-prob pass does pack its rows: fewer columns through the model than the padded micro-batch."""
    from gcfamily.core import packing

    for flag in ("--packing", "--padding_free"):
        code, _out, err = gcf("run", "--method", "sft", "--model", "tiny", flag, "true")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "always does this" in err and "block-causal mask" in err and "no equivalent" not in err, err
    code, _out, err = gcf("run", "--method", "sft", "--model", "tiny", "--packing", "true")
    assert "TRL's packing=True instead concatenates" in err and "padding_free=True flattens" not in err, err
    seen = []
    real_pack = packing.pack_rows

    def spy(input_ids, attention_mask, *a, **k):
        got = real_pack(input_ids, attention_mask, *a, **k)
        seen.append((got, int(attention_mask.sum()), input_ids.numel()))
        return got

    monkeypatch.setattr(packing, "pack_rows", spy)
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "12+1=", "completion": " thirteen and some more"}] * 2
    cfg = apply(Config(), {"method": "sft", "model": "tiny", "max_steps": 1, "batch_size": 4}, "--set")
    cfg.output_dir, cfg.progress = str(tmp_path / "run"), False
    Trainer(cfg, dataset=rows).run()
    assert seen, "no log-prob pass went through the packed path"
    for got, real, padded in seen:
        assert got is not None and real < padded  # rows of unequal length: the padded micro-batch holds padding
        assert got.input_ids.numel() < padded  # packed: fewer columns through the model than the padded micro-batch
