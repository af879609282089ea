"""The model card and console summary of gcfamily/run/card.py and summary.py, on hand-made settings and metrics rows."""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path

import pytest
import yaml

from gcfamily.config import parse_sets, to_dict
from gcfamily.methods import METHODS, get_method, resolve
from gcfamily.methods.onpolicy import OnPolicy
from gcfamily.run import card
from gcfamily.run.card import write_model_card
from gcfamily.run.folder.writes import WriteFailed
from gcfamily.run.summary import summary

GRPO_INFO = {"name": "grpo", "data_source": "on-policy groups of G outputs per prompt", "gc_formula": "r_t * A_i"}
SFT_INFO = {"name": "sft", "data_source": "fixed demonstrations (prompt, completion)", "gc_formula": "+1 per token"}


def grpo_config(out: Path) -> dict:
    """A flat run config as config.to_dict writes it (only the keys the card reads)."""
    return {
        "method": "grpo",
        "model": "org/tiny-model",
        "output_dir": str(out),
        "task": "arithmetic",
        "task_options": {},
        "dataset": None,
        "dataset_split": "train",
        "seed": 3,
        "dtype": "auto",
        "lr": 5e-05,
        "batch_size": 4,
        "max_steps": 2,
        "lora_r": 8,
        "group_size": 4,
        "reward": ["numeric", "my rewards.py:length"],
        "reward_weights": [1.0, 0.5],
        "stop_strings": ["\n\n", "Q: it's"],
        "beta": 0.04,
        "overwrite": True,
        "explicit": [
            "beta",
            "group_size",
            "lr",
            "method",
            "model",
            "output_dir",
            "overwrite",
            "reward",
            "reward_weights",
            "stop_strings",
        ],
    }


def grpo_metrics() -> list[dict]:
    return [
        {"step": 0, "time": 1.0, "eval/accuracy": 0.5},
        {"step": 1, "time": 2.0, "loss": 1.0, "reward/mean": 0.25, "grpo/kl": 0.0},
        {"step": 2, "time": 3.0, "loss": 0.123456, "reward/mean": None, "grpo/kl": float("nan"), "lr": 5e-05},
        {"step": 2, "time": 4.0, "eval/accuracy": 0.75},
    ]


def parts(text: str) -> tuple[dict, str]:
    """The card's YAML front matter, parsed, and its body."""
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


def reproduce(text: str) -> list[str]:
    """The Reproduce block's command, as bash would split it (continuation lines joined)."""
    block = text.split("## Reproduce", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


def test_on_policy_card(tmp_path):
    cfg = grpo_config(tmp_path)
    path = write_model_card(tmp_path, cfg, grpo_metrics(), "org/tiny-model", GRPO_INFO)
    text = path.read_text()
    assert path == tmp_path / "README.md"
    front, body = parts(text)
    assert front == {"library_name": "transformers", "base_model": "org/tiny-model", "tags": ["gcfamily", "grpo"]}
    assert "gcfamily's `grpo` from `org/tiny-model`" in body
    assert "- **Data:** the built-in task `arithmetic`" in body
    assert "- **Reward:** 1.0 * `numeric` + 0.5 * `my rewards.py:length`" in body
    # settings: the explicit ones (not method/model/output_dir), then the core ones, then lora_r as it is > 0
    settings = body.split("## Settings", 1)[1].split("##", 1)[0]
    for row in [
        "| `beta` | `0.04` |",
        "| `group_size` | `4` |",
        "| `lr` | `5e-05` |",
        "| `overwrite` | `true` |",
        '| `reward` | `["numeric","my rewards.py:length"]` |',
        "| `reward_weights` | `[1.0,0.5]` |",
        '| `stop_strings` | `["\\n\\n","Q: it\'s"]` |',
        "| `batch_size` | `4` |",
        "| `max_steps` | `2` |",
        "| `seed` | `3` |",
        "| `dtype` | `auto` |",
        "| `lora_r` | `8` |",
    ]:
        assert row in settings, row
    assert "`output_dir`" not in settings and "`method`" not in settings and "`task_options`" not in settings
    # final metrics: eval first -> last; the last loss 0.123456 to 4 digits; None and NaN as n/a
    final = body.split("## Final metrics", 1)[1].split("##", 1)[0]
    for row in [
        "| eval/accuracy (held-out) | 0.5 → 0.75 | 0 → 2 |",
        "| loss | 0.1235 | 2 |",
        "| reward/mean | n/a | 2 |",
        "| grpo/kl | n/a | 2 |",
        "| steps done | 2 |  |",
    ]:
        assert row in final, row
    assert "from_pretrained" in body and "PeftModel" not in body  # no adapter_config.json in the folder
    argv = reproduce(text)
    assert argv[:6] == ["gcf", "run", "--method", "grpo", "--model", "org/tiny-model"]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert parse_sets(tuple(sets)) == {
        "beta": "0.04",
        "group_size": "4",
        "lr": "5e-05",
        "overwrite": "true",
        "reward": '["numeric","my rewards.py:length"]',
        "reward_weights": "[1.0,0.5]",
        "stop_strings": '["\\n\\n","Q: it\'s"]',
    }


def test_reproduce_command_resolves_to_the_same_settings(tmp_path):
    # the oracle is gcf's own parser: the flags, read back, give the values the run had
    cfg = grpo_config(tmp_path)
    argv = shlex.split(card.reproduce_command(cfg, "org/tiny-model"))
    sets = parse_sets(tuple(argv[i + 1] for i, a in enumerate(argv) if a == "--set"))
    resolved = to_dict(resolve(None, {**sets, "method": argv[3], "model": argv[5]}))
    for key in ["beta", "group_size", "lr", "overwrite", "reward", "reward_weights", "stop_strings"]:
        assert resolved[key] == cfg[key], key


def test_sft_card(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    cfg = {
        "method": "sft",
        "model": "smollm2-135m",
        "task": None,
        "dataset": "data/train.jsonl",
        "dataset_config": "main",
        "dataset_split": "train[:90%]",
        "lr": 1e-05,
        "batch_size": 8,
        "max_steps": 6,
        "seed": 0,
        "dtype": "float32",
        "lora_r": 0,
        "max_length": 256,
        "explicit": ["dataset", "max_length", "method"],
    }
    metrics = [{"step": 1, "loss": 2.5}, "not a row", {"loss": "odd"}, {"step": 6, "loss": None}]
    text = write_model_card(tmp_path, cfg, metrics, "smollm2-135m", SFT_INFO).read_text()
    front, body = parts(text)
    # the alias stands for a hub model: the front matter names it by hub id, never as the alias
    assert front == {
        "library_name": "transformers",
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "tags": ["gcfamily", "sft"],
    }
    assert "- **Data:** `data/train.jsonl` (config `main`, split `train[:90%]`)" in body
    assert "**Reward:**" not in body
    assert "| `max_length` | `256` |" in body and "| `lr` | `1e-05` |" in body and "| `dtype` | `float32` |" in body
    assert "`lora_r`" not in body  # 0 and not given
    assert "| loss | n/a | 6 |" in body and "| steps done | 6 |  |" in body
    assert "PeftModel.from_pretrained(base, " in body
    assert "eval/" not in body and "reward/mean" not in body
    assert reproduce(text) == [
        "gcf",
        "run",
        "--method",
        "sft",
        "--model",
        "smollm2-135m",
        "--set",
        "dataset=data/train.jsonl",
        "--set",
        "max_length=256",
    ]


def test_no_metrics_and_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    cfg = {"method": "sft", "explicit": None}
    text = write_model_card(tmp_path / "run", cfg, [], "models/mine", SFT_INFO).read_text()
    front, body = parts(text)
    assert "base_model" not in front  # looks like org/name but is a folder here
    assert "## Final metrics" not in body


def test_on_policy_inferred_for_every_builtin_method():
    # the oracle is the class hierarchy: the methods that sample from the policy subclass OnPolicy
    seen = set()
    for name in METHODS:
        cls = get_method(name)
        seen.add(issubclass(cls, OnPolicy))
        assert card._on_policy({"data_source": cls.data_source}) == issubclass(cls, OnPolicy), name
    assert seen == {True, False}
    assert card._on_policy({"data_source": "the policy's own samples", "on_policy": False}) is False


def test_atomic_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    (tmp_path / "README.md").write_text("peft's template")
    write_model_card(tmp_path, grpo_config(tmp_path), grpo_metrics(), "org/tiny-model", GRPO_INFO)
    assert sorted(os.listdir(tmp_path)) == ["README.md"]
    assert "peft's template" not in (tmp_path / "README.md").read_text()

    # a failed rename keeps the old card and removes the temporary file
    before = (tmp_path / "README.md").read_text()
    calls = []

    def failing_replace(src, dst):
        calls.append((src, dst))
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(WriteFailed, match="README.md"):  # the run's one sentence, naming the file
        write_model_card(tmp_path, grpo_config(tmp_path), [], "org/tiny-model", GRPO_INFO)
    assert len(calls) == 1 and Path(calls[0][0]).parent == tmp_path  # the rename was tried, from the same folder
    assert sorted(os.listdir(tmp_path)) == ["README.md"]
    assert (tmp_path / "README.md").read_text() == before


def test_summary_all_lines(tmp_path):
    metrics = [
        {"step": 0, "eval/accuracy": 0.625},
        {"step": 1, "loss": 2.0, "reward/mean": 0.41},
        {"step": 6, "loss": 1.23456, "reward/mean": 0.77},
        {"step": 6, "eval/accuracy": 0.75},
    ]
    assert summary(metrics, 6, 41.23, tmp_path, True).splitlines() == [
        "done: 6 steps in 41.2 s",
        "  eval/accuracy 0.625 -> 0.75 (held-out, before -> after)",
        "  reward/mean 0.41 -> 0.77 (first -> last step)",
        "  loss 1.235 (last step)",
        f"  model: {tmp_path} (AutoModelForCausalLM.from_pretrained)",
    ]


def test_summary_leaves_out_what_is_missing(tmp_path):
    # one eval only (no before -> after), no reward (SFT), a NaN loss, no final model
    metrics = [{"step": 3, "loss": 1.0}, {"step": 4, "loss": math.nan}, {"step": 4, "eval/accuracy": 0.5}, None]
    lines = summary(metrics, 4, 200.0, tmp_path, False).splitlines()
    assert lines == ["done: 4 steps in 200 s (3.3 min)", "  loss n/a (last step)", "  no final model was written"]
    lines = summary([], 0, float("nan"), tmp_path, False).splitlines()
    assert lines == ["done: 0 steps in n/a", "  no final model was written"]


def test_summary_names_an_adapter(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    lines = summary([], 1, 1.0, tmp_path, True).splitlines()
    assert lines[0] == "done: 1 step in 1.0 s"
    line = lines[-1]
    assert line == f"  model: {tmp_path} (AutoModelForCausalLM.from_pretrained; a LoRA adapter, needs peft)"
