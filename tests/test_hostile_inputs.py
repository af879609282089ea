"""Damaged and hostile inputs at every load path: one `error:` line on stderr, exit 2, no traceback, nothing lost.

Recipes (binary bytes, a recipe that switches on trust_remote_code by itself), reward files (not .py,
a syntax error), model folders built from the tiny model then damaged (truncated or random weights, a
config.json that is a list or not JSON, pickle weights only), prompts past the model's context, absurd
sizes, a chat template that trips jinja's sandbox, and a null prompt in a later row. A few run as a real
subprocess, where a library's own log line or warning before the error line would show.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gcfamily.methods import resolve

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--max-steps", "1", "--set", "progress=false", "--set", "batch_size=2", "--set", "max_new_tokens=4"]


def _one_clear_line(code: int, out: str, err: str) -> str:
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in out + err
    return err


def _subprocess(*args: str, cwd: Path) -> tuple[int, str, str]:
    """`python -m gcfamily ARGS` as a user runs it: every line the libraries print lands in the captured streams."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONWARNINGS": "default"}
    res = subprocess.run(
        [sys.executable, "-m", "gcfamily", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    return res.returncode, res.stdout, res.stderr


class _RunsCode:
    """Unpickling this makes a folder: the sign that something unpickled the file instead of refusing it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The tiny model saved as a Hugging Face folder, and copies of it each damaged one way."""
    from safetensors.torch import load_file

    from gcfamily.models import tiny_model, tiny_tokenizer

    base = tmp_path_factory.mktemp("models")
    good = base / "good"
    tok = tiny_tokenizer()
    tiny_model(len(tok)).save_pretrained(good)
    tok.save_pretrained(good)
    out = {"good": good}
    for name in ("truncated", "random", "config-list", "config-not-json", "pickle-only"):
        out[name] = base / name
        shutil.copytree(good, out[name])
    weights = (good / "model.safetensors").read_bytes()
    (out["truncated"] / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (out["random"] / "model.safetensors").write_bytes(os.urandom(4096))
    (out["config-list"] / "config.json").write_text(json.dumps([1, 2, 3]))
    (out["config-not-json"] / "config.json").write_text("{model_type: llama,,")
    (out["pickle-only"] / "model.safetensors").unlink()
    state = load_file(good / "model.safetensors")
    (out["pickle-only"] / "pytorch_model.bin").write_bytes(
        pickle.dumps({"weights": state, "payload": _RunsCode(base / "UNPICKLED")})
    )
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("files")
    out = {
        "binary.yaml": os.urandom(512),
        "keys.yaml": b"1: 2\n",
        "trusting.yaml": b"method: sft\nmodel: tiny\ntrust_remote_code: true\n",
        "my_reward": b"def fn(completions, **kw):\n    return [0.0] * len(completions)\n",  # a Python file without .py
        "rewards.txt": b"def fn(completions, **kw):\n    return [0.0] * len(completions)\n",
        "broken.py": b"def fn(completions:\n    return [0.0]\n",
        "exits.py": b"import sys\nsys.exit(3)\n",
        "rows.jsonl": "".join(
            json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1), "answer": str(i + 1)}) + "\n" for i in range(4)
        ).encode(),
        "null-prompt.jsonl": (
            json.dumps({"prompt": "1+1=", "completion": "2"})
            + "\n"
            + json.dumps({"prompt": None, "completion": "2"})
            + "\n"
        ).encode(),
        # 990 characters: 993 tokens in tiny's chat format, under max_length=1000 but not with 64 new tokens in 1024 positions
        "long-prompt.jsonl": (
            json.dumps({"prompt": "x" * 990, "answer": "2"})
            + "\n"
            + json.dumps({"prompt": "1+1=", "answer": "2"})
            + "\n"
        ).encode(),
        "longer-than-context.jsonl": (json.dumps({"prompt": "x" * 3000, "answer": "2"}) + "\n").encode(),
    }
    for name, data in out.items():
        (d / name).write_bytes(data)
    return {name: d / name for name in out}


# --------------------------------------------------------------------------- recipes


def test_binary_recipe_is_one_line_in_a_real_process(files, tmp_path):
    code, out, err = _subprocess(
        "run", "--config", str(files["binary.yaml"]), "--output-dir", str(tmp_path / "o"), cwd=tmp_path
    )
    _one_clear_line(code, out, err)
    assert "binary.yaml" in err and "not text" in err, err


def test_recipe_keys_must_be_names(gcf, files, tmp_path):
    err = _one_clear_line(*gcf("run", "--config", str(files["keys.yaml"]), "--output-dir", str(tmp_path / "o")))
    assert "key 1" in err, err


def test_a_recipe_alone_cannot_trust_remote_code(gcf, files, tmp_path):
    err = _one_clear_line(
        *gcf("run", "--config", str(files["trusting.yaml"]), "--output-dir", str(tmp_path / "o"), *QUICK)
    )
    assert "trust_remote_code" in err and "--trust-remote-code" in err, err
    assert not (tmp_path / "o").exists()
    # the flag (or --set on the command line) is the user's own word: the recipe's value is then accepted
    assert resolve(str(files["trusting.yaml"]), {"trust_remote_code": True}).trust_remote_code is True
    assert resolve(str(files["trusting.yaml"]), {"trust-remote-code": "true"}).trust_remote_code is True
    code, out, err = gcf(
        "run",
        "--config",
        str(files["trusting.yaml"]),
        "--trust-remote-code",
        "--set",
        "lr=-1",
        "--output-dir",
        str(tmp_path / "o"),
    )
    assert "lr (learning rate)" in _one_clear_line(code, out, err)  # got past the trust check to the next setting


# --------------------------------------------------------------------------- reward files


@pytest.mark.parametrize(
    "name, needles",
    [
        ("my_reward", ["my_reward", "not a .py file"]),
        ("rewards.txt", ["rewards.txt", "not a .py file"]),
        ("broken.py", ["broken.py", "failed to import", "SyntaxError"]),
        ("exits.py", ["exits.py", "failed to import", "SystemExit"]),
    ],
)
def test_bad_reward_files(gcf, files, tmp_path, name, needles):
    err = _one_clear_line(
        *gcf(
            "run",
            "--method",
            "grpo",
            "--model",
            "tiny",
            "--reward",
            f"{files[name]}:fn",
            "--set",
            "group_size=2",
            "--output-dir",
            str(tmp_path / "o"),
            *QUICK,
        )
    )
    assert all(n in err for n in needles), err


# --------------------------------------------------------------------------- model folders

DAMAGE = [
    ("truncated", ["model.safetensors", "damaged or not safetensors"]),
    ("random", ["model.safetensors", "damaged or not safetensors"]),
    ("config-list", ["config.json", "JSON list"]),
    ("config-not-json", ["config.json", "not JSON"]),
    ("pickle-only", ["pytorch_model.bin", "convert it to safetensors"]),
]


@pytest.mark.parametrize("name, needles", DAMAGE)
def test_damaged_model_folder_in_run_keeps_the_output_folder(gcf, folders, tmp_path, monkeypatch, name, needles):
    loads: list = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or pytest.fail("torch.load was called"))
    out = tmp_path / "earlier-run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "run_config.json").write_text("{}")
    err = _one_clear_line(
        *gcf("run", "--method", "sft", "--model", str(folders[name]), "--output-dir", str(out), "--overwrite", *QUICK)
    )
    assert all(n in err for n in needles), err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # --overwrite never got to clear the earlier run
    assert not loads and not (folders["good"].parent / "UNPICKLED").exists()


@pytest.mark.parametrize("name, needles", DAMAGE)
def test_damaged_model_folder_in_eval(gcf, folders, name, needles):
    err = _one_clear_line(*gcf("eval", "--model", str(folders[name]), "--samples", "2", "--max-new-tokens", "2"))
    assert all(n in err for n in needles), err
    assert not (folders["good"].parent / "UNPICKLED").exists()


def test_damaged_model_folders_in_a_real_process(folders, tmp_path):
    for name in ("truncated", "pickle-only"):
        code, out, err = _subprocess("eval", "--model", str(folders[name]), "--samples", "2", cwd=tmp_path)
        _one_clear_line(code, out, err)  # and no library line or warning before it
    assert not (folders["good"].parent / "UNPICKLED").exists()


def test_the_undamaged_folder_loads(gcf, folders):
    code, out, err = gcf("eval", "--model", str(folders["good"]), "--samples", "2", "--max-new-tokens", "2")
    assert code == 0, err
    assert "held-out accuracy" in out


# --------------------------------------------------------------------------- lengths and sizes


def test_prompt_past_the_context_in_a_run(gcf, files, tmp_path):
    args = [
        "run",
        "--method",
        "grpo",
        "--model",
        "tiny",
        "--dataset",
        str(files["long-prompt.jsonl"]),
        "--reward",
        "numeric",
        "--max-steps",
        "1",
        "--set",
        "progress=false",
        "--set",
        "batch_size=2",
        "--set",
        "group_size=2",
        "--set",
        "max_length=1000",
        "--set",
        "max_new_tokens=64",
    ]
    err = _one_clear_line(*gcf(*args, "--output-dir", str(tmp_path / "o"), "--set", "long_prompts=error"))
    assert "993 tokens" in err and "max_new_tokens=64" in err and "1057" in err and "1024" in err, err
    code, out, err = gcf(
        *args, "--output-dir", str(tmp_path / "skip")
    )  # the default, long_prompts=skip: skipped at setup and counted
    assert code == 0, err
    assert json.loads((tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()[-1])["skipped_long_prompts"] >= 1


def test_prompt_past_the_context_in_eval(gcf, files):
    err = _one_clear_line(
        *gcf(
            "eval",
            "--model",
            "tiny",
            "--dataset",
            str(files["longer-than-context.jsonl"]),
            "--reward",
            "numeric",
            "--max-new-tokens",
            "4",
        )
    )
    assert "max_new_tokens=4" in err and "1024" in err, err


def test_max_length_past_the_context(gcf, tmp_path):
    err = _one_clear_line(
        *gcf(
            "run", "--method", "sft", "--model", "tiny", "--set", "max_length=5000", "--output-dir", str(tmp_path / "o")
        )
    )
    assert "max_length=5000" in err and "1024" in err, err


@pytest.mark.parametrize("setting", ["max_new_tokens=1000000000", "group_size=1000000000", "batch_size=1000000000"])
def test_absurd_sizes(gcf, tmp_path, setting):
    err = _one_clear_line(
        *gcf("run", "--method", "grpo", "--model", "tiny", "--set", setting, "--output-dir", str(tmp_path / "o"))
    )
    assert setting.split("=")[0] in err and "1000000000" in err, err


# --------------------------------------------------------------------------- data and templates


def test_chat_template_tripping_the_sandbox(gcf, files, tmp_path):
    err = _one_clear_line(
        *gcf(
            "run",
            "--method",
            "sft",
            "--model",
            "tiny",
            "--dataset",
            str(files["rows.jsonl"]),
            "--set",
            "chat_template={{ ().__class__.__mro__ }}",
            "--set",
            "chat_format=chat",
            "--output-dir",
            str(tmp_path / "o"),
            *QUICK,
        )
    )
    assert "chat template" in err and "unsafe" in err, err


def test_null_prompt_in_a_later_row_names_the_row(gcf, files, tmp_path):
    err = _one_clear_line(
        *gcf(
            "run",
            "--method",
            "sft",
            "--model",
            "tiny",
            "--dataset",
            str(files["null-prompt.jsonl"]),
            "--output-dir",
            str(tmp_path / "o"),
            *QUICK,
        )
    )
    assert "Row 1" in err and "'prompt'" in err, err


def test_a_bad_option_value_is_one_line(gcf):
    err = _one_clear_line(*gcf("run", "--max-steps", "abc"))
    assert "--max-steps" in err and " run --help" in err, err  # in-process, click names the program "main"
    err = _one_clear_line(*gcf("eval", "--samples", "0"))
    assert "--samples" in err, err
