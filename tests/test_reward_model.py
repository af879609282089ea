"""The Bradley-Terry reward model: the loss by hand, scoring, saving and loading, training through the
trainer without touching the policy, the three-stage chain through the CLI, and learning."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from click.testing import CliRunner

from gcfamily.cli import main
from gcfamily.config import Config
from gcfamily.data.batches import split_batch
from gcfamily.data.preferences import MALFORMED, preference_rows
from gcfamily.errors import GcfError
from gcfamily.methods import get_method
from gcfamily.methods.reward_model import RewardModelTraining
from gcfamily.models import load_model
from gcfamily.rewards.model import RewardModel, bradley_terry_loss, load_reward_model
from gcfamily.run.trainer import Trainer

FAST = {"batch_size": 2, "group_size": 4, "max_new_tokens": 8, "micro_batch_size": 8, "progress": False}


def rm_config(out, **settings) -> Config:
    return Config(
        **{
            "method": "reward-model",
            "model": "tiny",
            "task": "arithmetic",
            "output_dir": str(out),
            "progress": False,
            "device": "cpu",
            "batch_size": 4,
            "micro_batch_size": 8,
            "eval_samples": 16,
            **settings,
        }
    )


# ----------------------------------------------------------------------------- by hand


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([0.0, 2.0, -1.0], requires_grad=True), torch.tensor([0.0, 0.0, 1.0])
    loss = bradley_terry_loss(chosen, rejected)
    # margins (0, 2, -2): -log sigmoid(0) = log 2 = 0.6931; -log sigmoid(2) = log(1 + e^-2) = 0.1269;
    # -log sigmoid(-2) = log(1 + e^2) = 2.1269
    assert torch.allclose(
        loss, torch.tensor([math.log(2), math.log1p(math.exp(-2)), math.log1p(math.exp(2))]), atol=1e-6
    )
    loss.sum().backward()
    # d loss / d r_w = -sigmoid(r_l - r_w): -0.5, -sigmoid(-2) = -0.1192, -sigmoid(2) = -0.8808
    assert torch.allclose(chosen.grad, torch.tensor([-0.5, -0.11920292, -0.88079708]), atol=1e-6)


# ----------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def tiny_rm():
    policy, tok = load_model("tiny", seed=0)
    rm = RewardModel.from_causal_lm(policy, tok)
    torch.nn.init.normal_(rm.head.weight, std=0.5)  # a non-trivial head, so scores differ
    return rm


def test_scores_read_the_last_real_token_whatever_the_padding(tiny_rm):
    prompts, completions = ["What is 2 + 2?", "What is 13 * 7? Reply with just the number."], ["4", "I'm not sure."]
    alone = [tiny_rm.score([p], [c])[0] for p, c in zip(prompts, completions)]
    together = tiny_rm.score(prompts, completions)  # right padding of the short row
    assert together == pytest.approx(alone, abs=1e-5) and alone[0] != alone[1]
    ids = [tiny_rm.encode(p, c) for p, c in zip(prompts, completions)]
    L = max(map(len, ids))
    left = torch.tensor([[0] * (L - len(x)) + x for x in ids])  # left padding: positions still start at 0
    mask = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in ids])
    with torch.no_grad():
        assert tiny_rm(left, mask).tolist() == pytest.approx(alone, abs=1e-5)
    assert ids[0][-1] == tiny_rm.tokenizer.eos_token_id  # the scalar sits on the completion's EOS


def test_a_fresh_reward_model_scores_zero():
    policy, tok = load_model("tiny", seed=0)
    assert RewardModel.from_causal_lm(policy, tok).score(["a", "b"], ["1", "2"]) == [
        0.0,
        0.0,
    ]  # zero head: loss log 2, chance


def test_save_and_load(tiny_rm, tmp_path):
    tiny_rm.save(tmp_path / "rm")
    fn = load_reward_model(str(tmp_path / "rm"), batch_size=1)
    prompts, completions = ["What is 1 + 1?", "What is 3 + 4?", "x"], ["2", "8", "?"]
    assert fn(prompts, completions, answer=["2", "7", "0"]) == pytest.approx(
        tiny_rm.score(prompts, completions), abs=1e-5
    )
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")  # a plain Hugging Face reward model
    assert hf.config.num_labels == 1
    assert not any(
        p.requires_grad for p in RewardModel.load(tmp_path / "rm").parameters()
    )  # loaded frozen, for scoring
    policy, tok = load_model("tiny")
    policy.save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    with pytest.raises(GcfError, match="is not a reward model"):
        RewardModel.load(tmp_path / "policy")
    with pytest.raises(GcfError, match="has no config.json"):
        RewardModel.load(tmp_path / "nowhere")


# ----------------------------------------------------------------------------- training through the trainer


def test_the_trainer_trains_only_the_reward_model_and_pairs_are_the_normaliser(tmp_path):
    tr = Trainer(rm_config(tmp_path / "a", max_steps=2, lr=1e-3))
    m = tr.method
    before = copy.deepcopy(tr.policy.state_dict())
    batch, _ = m.data(0)
    seen = []
    handle = m.optimizer.register_step_pre_hook(
        lambda opt, a, k: seen.append([p.grad.clone() for p in m.rm.parameters()])
    )
    state = copy.deepcopy(m.state_dict())
    for size in (2, 8):  # one pair per micro-batch, or all four in one
        m.load_state_dict(state)
        tr.auxiliary_only_step(split_batch(batch, size, m.rows_per_example))
    handle.remove()
    assert len(seen) == 2 and all(torch.allclose(a, b, atol=1e-7, rtol=1e-4) for a, b in zip(*seen))
    m.load_state_dict(state)
    tr.run()
    for k, v in tr.policy.state_dict().items():  # the policy was never trained (and never had a gradient)
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in tr.policy.parameters())
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]  # the output is the reward model, not the policy


def test_exact_resume(tmp_path):
    straight = Trainer(rm_config(tmp_path / "a", max_steps=3, lr=1e-3))
    straight.run()
    Trainer(rm_config(tmp_path / "b", max_steps=2, lr=1e-3)).run()
    resumed = Trainer(rm_config(tmp_path / "b", max_steps=3, lr=1e-3), resume="latest")
    resumed.run()
    for p, q in zip(straight.method.rm.parameters(), resumed.method.rm.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_preference_dataset_with_a_held_out_tenth(tmp_path):
    rows = [{"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": "?"} for i in range(30)]
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tr = Trainer(rm_config(tmp_path / "run", dataset=str(path), max_steps=1))
    assert len(tr.method.pairs) == 27 and len(tr.method.heldout) == 3
    tr.run()
    assert "rm/heldout_accuracy" in json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])


# ----------------------------------------------------------------------------- the CLI: SFT model -> reward model -> PPO


def _gcf(*args):
    return CliRunner().invoke(main, ["run", "--model", "tiny", *args])


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    res = _gcf(
        "--method",
        "reward-model",
        "--max-steps",
        "5",
        "--output-dir",
        str(out),
        "--set=progress=false",
        "--set=eval_samples=16",
    )
    return out, res


def test_cli_trains_a_reward_model(trained_rm):
    out, res = trained_rm
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # zero head: every margin is 0 at the first step
    assert 0 <= rows[-1]["rm/heldout_accuracy"] <= 1 and all("rm/accuracy" in r for r in rows)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("method", ["ppo", "grpo"])
def test_on_policy_methods_take_the_reward_model(trained_rm, tmp_path, method):
    out, _ = trained_rm
    res = _gcf(
        "--method",
        method,
        "--task",
        "arithmetic",
        "--max-steps",
        "2",
        "--reward-model",
        str(out),
        "--output-dir",
        str(tmp_path / "run"),
        *[f"--set={k}={v}" for k, v in FAST.items()],
    )
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["reward/failed"] == 0 and rows[-1]["reward/std"] > 0  # real-valued scores, not the task's 0/1


def test_reward_model_errors_are_one_sentence(trained_rm, tmp_path):
    out, _ = trained_rm
    base = ["--method", "ppo", "--task", "arithmetic", "--max-steps", "1", *[f"--set={k}={v}" for k, v in FAST.items()]]
    res = _gcf(*base, "--reward-model", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "a"))
    assert res.exit_code == 2 and "has no config.json" in res.output and "Traceback" not in res.output
    res = _gcf(*base, "--reward-model", str(out), "--reward", "numeric", "--output-dir", str(tmp_path / "b"))
    assert res.exit_code == 2 and "pass one of --reward and --reward-model" in res.output


# ----------------------------------------------------------------------------- learning


@pytest.mark.slow
def test_heldout_pair_accuracy_rises_well_above_chance(tmp_path):
    """300 steps of 16 pairs on the tiny (random) model. Measured on 256 held-out pairs of the offline
    arithmetic set: 0.5 at the start (zero head), 0.70 / 0.71 / 0.72 after 300 steps with seeds 0 / 1 / 2:
    every malformed reply is ranked below the answer, and wrong numbers better than chance. 0.62 is 3.8
    standard deviations above a coin's 0.5 at n = 256."""
    tr = Trainer(
        rm_config(
            tmp_path,
            max_steps=300,
            batch_size=16,
            micro_batch_size=32,
            lr=2e-3,
            lr_schedule="cosine",
            warmup_steps=20,
            eval_samples=256,
        )
    )
    m = tr.method
    assert m.heldout_accuracy() == 0.5
    tr.run()
    acc = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["rm/heldout_accuracy"]
    held = preference_rows(tr.task, 256, 0, split="test")
    malformed = [r for r in held if r["rejected"] in MALFORMED]
    s = m.rm.score(
        [r["prompt"] for r in malformed for _ in (0, 1)], [r[k] for r in malformed for k in ("chosen", "rejected")]
    )
    assert acc > 0.62, acc
    assert sum(a > b for a, b in zip(s[0::2], s[1::2])) / len(malformed) > 0.9


def test_registered():
    assert get_method("reward-model") is RewardModelTraining and not RewardModelTraining.trains_policy
