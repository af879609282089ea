"""Online rejection sampling: the kept set, its coefficient, exactness, and two CLI steps."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from gcfamily.cli import main
from gcfamily.config import Config
from gcfamily.core import engine
from gcfamily.core.batch import Batch
from gcfamily.methods import get_method
from gcfamily.methods.rft import RFT
from gcfamily.run.trainer import Trainer

FAST = {"batch_size": 2, "group_size": 4, "max_new_tokens": 8, "micro_batch_size": 8, "progress": False}


def _batch():
    # 4 samples, 3 completion tokens each (the first column is the prompt)
    return Batch(
        input_ids=torch.zeros(4, 4, dtype=torch.long),
        attention_mask=torch.ones(4, 4, dtype=torch.long),
        loss_mask=torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0]]),
        rewards=torch.tensor([1.0, 0.4, 0.6, 0.0]),
        valid=torch.tensor([True, True, True, False]),
    )


def test_kept_set_and_coefficient_by_hand():
    m = RFT(Config(method="rft", reward_threshold=0.5))
    b, stats = m.prepare(_batch())
    # rewards (1.0, 0.4, 0.6, failed) against 0.5: kept (yes, no, yes, no); a failed reward is never kept
    assert b.kept.tolist() == [True, False, True, False] and stats["rft/kept_frac"] == 0.5
    coef = m.coefficient(b, torch.zeros(4, 4))
    assert coef.tolist() == [
        [0, 1, 1, 1],
        [0, 0, 0, 0],
        [0, 1, 1, 1],
        [0, 0, 0, 0],
    ]  # GC = 1[kept] on completion tokens
    # token normalisation over kept samples only: Z = 3 + 3 tokens
    assert m.norm == "token" and engine.normaliser([b], m.norm) == 6.0


def test_engine_gradient_equals_autograd_of_objective():
    for norm in (None, "sequence", "sum"):
        m = RFT(Config(method="rft", reward_threshold=0.5, loss_norm=norm))
        b, _ = m.prepare(_batch())
        logps = -torch.rand(4, 4, generator=torch.Generator().manual_seed(0)) * b.loss_mask
        Z = engine.normaliser([b], m.norm)
        lp = logps.clone().requires_grad_(True)
        (-m.objective(b, lp, Z)).backward()
        want = lp.grad
        lp = logps.clone().requires_grad_(True)
        engine.weighted_loss(m.coefficient(b, lp.detach()), lp, b, m.norm, Z).backward()
        assert torch.allclose(lp.grad, want, atol=1e-7)
        if norm is None:  # d(-J)/dlogp = -1/6 on the 6 kept tokens, 0 elsewhere
            assert torch.allclose(want, -b.kept.float()[:, None] * b.loss_mask / 6)


ALWAYS = """
def half(prompts, completions, **columns):
    return [float(i % 2) for i in range(len(completions))]
"""


def test_rollout_keeps_what_clears_the_threshold(tmp_path):
    (tmp_path / "r.py").write_text(ALWAYS)
    tr = Trainer(
        Config(
            method="rft",
            model="tiny",
            task="arithmetic",
            output_dir=str(tmp_path / "run"),
            reward=f"{tmp_path / 'r.py'}:half",
            **FAST,
        )
    )
    b, _ = tr.method.prepare(tr.method.data(0)[0])
    assert b.kept.tolist() == [False, True] * 4 and engine.effective_mask(b)[::2].sum() == 0
    assert get_method("rft") is RFT


def test_cli_two_steps(tmp_path):
    (tmp_path / "r.py").write_text(ALWAYS)
    res = CliRunner().invoke(
        main,
        [
            "run",
            "--method",
            "rft",
            "--model",
            "tiny",
            "--task",
            "arithmetic",
            "--max-steps",
            "2",
            "--output-dir",
            str(tmp_path / "run"),
            "--reward",
            f"{tmp_path / 'r.py'}:half",
            *[f"--set={k}={v}" for k, v in FAST.items()],
        ],
    )
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in (
            "rft/kept_frac",
            "reward/mean",
            "reward/std",
            "reward/failed",
            "completion/length_mean",
            "completion/truncated_frac",
            "entropy",
            "gc/mean",
            "loss",
        ):
            assert r.get(k) is not None, k
        assert r["rft/kept_frac"] == 0.5 and r["gc/mean"] == 1.0 and r["grad_norm"] > 0


SEVENS = """
def sevens(prompts, completions, **columns):
    return [c.count("7") / max(len(c), 1) for c in completions]
"""


@pytest.mark.slow
def test_rft_learns_a_simple_reward(tmp_path):
    """Imitating the samples with at least 20% '7's raises the tiny model's rate of '7's."""
    (tmp_path / "r.py").write_text(SEVENS)
    cfg = Config(
        method="rft",
        model="tiny",
        task="arithmetic",
        output_dir=str(tmp_path / "run"),
        reward=f"{tmp_path / 'r.py'}:sevens",
        max_steps=12,
        lr=5e-3,
        reward_threshold=0.2,
        **{**FAST, "batch_size": 4, "group_size": 8, "micro_batch_size": 32},
    )
    Trainer(cfg).run()
    rewards = [json.loads(x)["reward/mean"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rewards[0] < 0.05 and sum(rewards[-2:]) / 2 > 0.1, rewards
