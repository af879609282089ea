"""The foundation end to end through `gcf`: a tiny SFT run, and clear errors for bad input."""

import json

import pytest
import torch
from conftest import metrics_rows


def test_sft_tiny_run_leaves_model_metrics_and_events(gcf, tmp_path):
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
        "3",
        "--output-dir",
        str(out),
        "--set",
        "lr=1e-3",
        "--set",
        "progress=false",
    )
    assert code == 0, stderr
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in (
        "loss",
        "gc/mean",
        "gc/abs_mean",
        "gc/zero_frac",
        "grad_norm",
        "lr",
        "train_tokens_per_s",
        "peak_memory_mb",
    ):
        assert key in rows[0], key
    assert rows[0]["gc/mean"] == 1.0 and rows[0]["gc/zero_frac"] == 0.0  # SFT: GC = 1 on every loss token
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((out / "run_config.json").read_text())["max_steps"] == 3
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model(torch.tensor([tok("1+1")["input_ids"]])).logits.shape[-1] == len(tok)


def test_sft_loss_falls_on_tiny(gcf, tmp_path):
    out = tmp_path / "run"
    code, _, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--max-steps",
        "30",
        "--output-dir",
        str(out),
        "--set",
        "lr=3e-3",
        "--set",
        "progress=false",
        "--set",
        "batch_size=16",
    )
    assert code == 0, err
    losses = [r["loss"] for r in metrics_rows(out)]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def test_yaml_recipe_then_command_line_wins(gcf, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: sft\nmodel: tiny\nmax_steps: 5\nlr: 0.002\nprogress: false\n")
    out = tmp_path / "run"
    code, _, err = gcf("run", "--config", str(recipe), "--max-steps", "2", "--output-dir", str(out))
    assert code == 0, err
    saved = json.loads((out / "run_config.json").read_text())
    assert saved["max_steps"] == 2 and saved["lr"] == 0.002  # command line over recipe over defaults


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--method", "nope", "--model", "tiny"], "Unknown method 'nope'"),
        (["--method", "sft", "--model", "no-such-model"], "Unknown model 'no-such-model'"),
        (["--method", "sft", "--model", "tiny", "--dataset", "missing/file.jsonl"], "does not exist"),
        (["--method", "sft", "--model", "tiny", "--set", "bogus=1"], "Unknown setting 'bogus'"),
        (["--method", "sft", "--model", "tiny", "--set", "lr=0"], "lr (learning rate) must be > 0"),
        (["--method", "sft", "--model", "tiny", "--set", "max_steps=abc"], "wrong type"),
        (["--method", "sft", "--model", "tiny", "--config", "no/such.yaml"], "does not exist"),
        (["--method", "sft", "--model", "tiny", "--task", "nope"], "nope"),
    ],
)
def test_bad_input_is_one_clear_line(gcf, tmp_path, args, needle):
    code, stdout, stderr = gcf("run", *args, "--max-steps", "1", "--output-dir", str(tmp_path / "o"))
    assert code != 0
    assert stderr.startswith("error: ") and needle in stderr, stderr
    assert "Traceback" not in stderr + stdout
    assert len(stderr.strip().splitlines()) == 1


def test_dataset_with_missing_column_names_the_row(gcf, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c", "answer": "d"}\n')
    code, _, stderr = gcf(
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
        str(tmp_path / "o"),
    )
    assert code != 0 and stderr.startswith("error: Row 1 has a missing or empty 'completion'"), stderr


def test_local_dataset_and_messages_rows_train(gcf, tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": str(i + 1)}]}
        for i in range(6)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    code, _, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--dataset",
        str(data),
        "--max-steps",
        "2",
        "--output-dir",
        str(tmp_path / "o"),
        "--set",
        "progress=false",
    )
    assert code == 0, err


def test_output_dir_with_another_run_is_refused(gcf, tmp_path):
    out = tmp_path / "run"
    args = [
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--max-steps",
        "1",
        "--output-dir",
        str(out),
        "--set",
        "progress=false",
    ]
    assert gcf(*args)[0] == 0
    code, _, stderr = gcf(*args)
    assert code != 0 and "holds another run" in stderr
    assert gcf(*args, "--overwrite")[0] == 0


def test_methods_lists_data_and_gc(gcf):
    code, stdout, _ = gcf("methods")
    assert code == 0 and "sft" in stdout and "GC:" in stdout
