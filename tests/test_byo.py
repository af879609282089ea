"""Bring your own: the Python API, TRL-style rewards unchanged, evaluation on your data, and what a run leaves behind."""

import json

import pytest
import torch
from conftest import metrics_rows
from datasets import Dataset

import gcfamily as gcf

SMALL = {"max_steps": 2, "batch_size": 2, "group_size": 2, "max_new_tokens": 6, "progress": False}
SETS = [x for k, v in SMALL.items() for x in ("--set", f"{k}={v}")]


def reward_len(completions, **kwargs):  # TRL's quickstart reward, verbatim
    return [-abs(20 - len(completion)) for completion in completions]


def _prompts(n=8):
    return [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(n)]


def test_python_api_with_a_lambda_reward_and_an_in_memory_dataset(tmp_path):
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(n=len(completions), ids=completion_ids[0], answer=answer[0])
        return [0.0] * len(completions)

    ds = Dataset.from_list(_prompts())
    out = gcf.train(
        method="grpo",
        model="tiny",
        dataset=ds,
        reward=[lambda completions, **kw: [float(len(c)) for c in completions], spy],
        output_dir=tmp_path / "run",
        **SMALL,
    )
    assert out == (tmp_path / "run").resolve()
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()
    row = metrics_rows(out)[-1]
    assert row["step"] == 2 and "reward/<lambda>/mean" in row and row["reward/spy/mean"] == 0.0
    assert seen["n"] == 4 and isinstance(seen["ids"], list) and seen["answer"] in {str(2 * i) for i in range(8)}
    cfg = json.loads((out / "run_config.json").read_text())
    assert cfg["dataset"] == "<Dataset of 8 rows>" and cfg["reward"] == ["<lambda>", "spy"]


def test_python_api_takes_a_method_class_and_a_model_object(tmp_path):
    from gcfamily.methods.sft import SFT
    from gcfamily.models import tiny_model, tiny_tokenizer

    class HalfSFT(SFT):
        def coefficient(self, batch, logps):
            return 0.5 * torch.ones_like(logps)

    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    before = model.model.embed_tokens.weight.detach().clone()
    rows = [{"prompt": "2+2=", "completion": "4"}, {"prompt": "3+3=", "completion": "6"}]
    out = gcf.train(
        method=HalfSFT,
        model=(model, tok),
        dataset=rows,
        output_dir=tmp_path / "run",
        max_steps=1,
        batch_size=2,
        progress=False,
    )
    assert not torch.equal(before, model.model.embed_tokens.weight)  # the object passed in was trained in place
    assert (
        json.loads((out / "run_config.json").read_text())["method"].startswith("test_byo:")
        and "HalfSFT" in json.loads((out / "run_config.json").read_text())["method"]
    )


def test_python_api_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(gcf.GcfError, match="not a gcfamily Method"):
        gcf.train(method=dict, model="tiny", output_dir=tmp_path / "a")
    with pytest.raises(gcf.GcfError, match="sft cannot train on unpaired-preference"):
        gcf.train(
            method="sft",
            model="tiny",
            dataset=[{"prompt": "a", "completion": "b", "label": True}],
            output_dir=tmp_path / "b",
            max_steps=1,
        )
    with pytest.raises(gcf.GcfError, match="Unknown setting 'nonsense'"):
        gcf.train(method="sft", model="tiny", output_dir=tmp_path / "c", nonsense=1)


def test_trl_quickstart_and_conversational_rewards_run_unchanged_from_the_cli(gcf_cli, tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def reward_len(completions, **kwargs):\n"
        "    return [-abs(20 - len(completion)) for completion in completions]\n\n"
        "def conv_len(completions, **kwargs):\n"
        "    return [-abs(20 - len(completion[0]['content'])) for completion in completions]\n"
    )
    std, conv = tmp_path / "std.jsonl", tmp_path / "conv.jsonl"
    std.write_text("\n".join(json.dumps({"prompt": r["prompt"]}) for r in _prompts()))
    conv.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}]}) for r in _prompts()))
    for data, fn in ((std, "reward_len"), (conv, "conv_len")):
        code, out, err = gcf_cli(
            "run",
            "--method",
            "grpo",
            "--model",
            "tiny",
            "--dataset",
            str(data),
            "--reward",
            f"{rewards}:{fn}",
            "--output-dir",
            str(tmp_path / fn),
            *SETS,
        )
        assert code == 0, err
        row = metrics_rows(tmp_path / fn)[-1]
        assert row["reward/failed"] == 0.0 and row["reward/mean"] <= 0.0


def test_eval_on_your_own_data_during_training_and_from_gcf_eval(gcf_cli, tmp_path):
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in _prompts()))
    held.write_text("\n".join(json.dumps(r) for r in _prompts(4)))
    code, out, err = gcf_cli(
        "run",
        "--method",
        "grpo",
        "--model",
        "tiny",
        "--dataset",
        str(train),
        "--reward",
        "numeric",
        "--eval",
        "--set",
        f"eval_dataset={held}",
        "--set",
        "eval_split=train",
        "--output-dir",
        str(tmp_path / "run"),
        *SETS,
    )
    assert code == 0, err
    evals = [r for r in metrics_rows(tmp_path / "run") if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(
        r["eval/prompts"] == 4 and 0 <= r["eval/accuracy"] <= 1 for r in evals
    )
    code, out, err = gcf_cli(
        "eval",
        "--model",
        str(tmp_path / "run"),
        "--dataset",
        str(held),
        "--split",
        "train",
        "--reward",
        "numeric",
        "--max-new-tokens",
        "4",
        "--device",
        "cpu",
    )
    assert code == 0 and "mean reward" in out and "over 4 prompts" in out, err


def test_a_run_on_your_data_never_reports_the_task_accuracy(gcf_cli, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": "2+2=", "completion": "4"}) for _ in range(4)))
    code, out, err = gcf_cli(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--dataset",
        str(data),
        "--eval",
        "--output-dir",
        str(tmp_path / "r"),
        *SETS,
    )
    assert code == 2 and err.startswith("error:") and "eval_dataset" in err and len(err.strip().splitlines()) == 1


def test_run_folder_has_loadable_checkpoints_a_card_completions_and_a_summary(gcf_cli, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    code, out, err = gcf_cli(
        "run",
        "--method",
        "grpo",
        "--model",
        "tiny",
        "--output-dir",
        str(tmp_path / "r"),
        "--set",
        "save_every=1",
        "--set",
        "log_completions_every=1",
        *SETS,
    )
    assert code == 0, err
    assert out.startswith("done: 2 steps in") and "model: " in out and "reward/mean" in out
    ckpt = tmp_path / "r" / "checkpoints" / "step-1"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert AutoTokenizer.from_pretrained(ckpt).eos_token == "<eos>" and model.config.vocab_size > 0
    card = (tmp_path / "r" / "README.md").read_text()
    assert "grpo" in card and "tiny" in card
    samples = [json.loads(x) for x in (tmp_path / "r" / "completions.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2] and all(
        {"prompt", "completion", "reward"} <= set(s) for s in samples
    )


def test_gcf_data_shows_the_trained_spans(gcf_cli, tmp_path):
    data = tmp_path / "conv.jsonl"
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "ok"},
    ]
    data.write_text(json.dumps({"messages": msgs}) + "\n")
    code, out, err = gcf_cli(
        "data", "--method", "sft", "--model", "tiny", "--dataset", str(data), "--set", "system_prompt=Be kind."
    )
    assert code == 0, err
    assert "conversational; chat_format=auto -> chat" in out and "1 kept, 0 skipped" in out
    assert "<|system|>Be kind.\n<|user|>hi\n<|assistant|>[[yo<eos>]]\n<|user|>ok?\n<|assistant|>[[ok<eos>]]\n" in out
    code, out, err = gcf_cli("data", "--method", "dpo", "--model", "tiny", "--dataset", str(data))
    assert code == 2 and "dpo cannot train on language-modeling" in err


def test_bench_takes_output_dir_and_the_older_out(gcf_cli):
    code, out, err = gcf_cli("bench", "--help")
    assert "--output-dir" in out and "--out" in out


@pytest.fixture
def gcf_cli(gcf):
    return gcf
