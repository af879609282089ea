"""Data paths that once had no test able to fail (issue 49, item 4): each test reads what the method trains on and
checks it against an oracle recorded apart from the method (the rollouts the policy produced, the reward given), and
asserts that the branch it guards occurred.

- rft-offline with 0 < pool_prompts < the prompts: every pooled sample, and every row trained on, pairs a completion
  with the prompt it was sampled for.
- DPO on its own samples: every pair trained on puts a completion the reward kept first and one it rejected second.
- PPO: `whiten` defaults to true, as documented, and a run with the default whitens its advantages.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_pools import FAST as POOL_FAST
from test_pools import odd_length

import gcfamily
import gcfamily.methods.ppo as ppo_module
from gcfamily.core.engine import effective_mask
from gcfamily.methods.dpo import DPO
from gcfamily.methods.ppo import PPO
from gcfamily.methods.rft import OfflineRFT
from gcfamily.run.services import RunServices

# the pool tests' run settings without their pool size (each test sets its own) and their reward
FAST = {k: v for k, v in POOL_FAST.items() if k != "pool_prompts"}


def record_rollouts(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[tuple[int, ...], tuple[int, ...]], str]:
    """{(prompt ids as the policy read them, completion ids it sampled): completion text}, from every generate call,
    read off the rollout's own rows (left-padded prompt, then completion)."""
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], str] = {}
    real = RunServices.generate

    def generate(self, prompt_ids, group_size, sampling):  # noqa: ANN001, ANN202
        ro = real(self, prompt_ids, group_size, sampling)
        for row, att, comp, text in zip(ro.input_ids, ro.attention_mask, ro.completion_mask, ro.completions):
            prompt = row[att.bool() & ~comp.bool()].tolist()
            seen[(tuple(prompt), tuple(row[comp.bool()].tolist()))] = text
        return ro

    monkeypatch.setattr(RunServices, "generate", generate)
    return seen


def trained_rows(batch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:  # noqa: ANN001
    """(prompt, completion) of each row of a collated batch, split by its loss mask."""
    out = []
    for ids, att, loss in zip(batch.input_ids, batch.attention_mask, batch.loss_mask):
        out.append((tuple(ids[att.bool() & ~loss.bool()].tolist()), tuple(ids[loss.bool()].tolist())))
    return out


def capture(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list:
    """Wrap cls.name (a method's data or prepare) to keep (self, its batch) of each call."""
    calls: list = []
    real = getattr(cls, name)

    def wrapped(self, *args):  # noqa: ANN001, ANN202
        batch, stats = real(self, *args)
        calls.append((self, batch, stats))
        return batch, stats

    monkeypatch.setattr(cls, name, wrapped)
    return calls


def test_offline_rft_stores_each_pooled_sample_under_the_prompt_it_answers(tmp_path, monkeypatch):
    seen = record_rollouts(monkeypatch)
    calls = capture(monkeypatch, OfflineRFT, "data")
    gcfamily.train(
        method="rft-offline", reward=odd_length, output_dir=str(tmp_path / "r"), max_steps=3, pool_prompts=5, **FAST
    )
    method = calls[0][0]
    n, chosen = len(method.prompt_tokens), method.pool_prompts
    # the branch: a strict subset of the prompts, and not the first ones (where an unmapped index would look right)
    assert 0 < len(chosen) == 5 < n and chosen != list(range(5))
    pool = method.pool
    assert len(pool) == 5 * 4 == len(seen)
    for k in range(len(pool)):
        assert (tuple(method.prompt_tokens[pool.prompt_index[k]]), tuple(pool.completion_ids[k])) in seen, k
    rows = [r for _, batch, _ in calls for r in trained_rows(batch)]
    assert len(rows) == 3 * 2 * 4 and all(r in seen for r in rows)  # 3 steps of 2 prompts' 4 samples


def test_dpo_trains_on_pairs_whose_first_the_reward_kept_and_second_it_rejected(tmp_path, monkeypatch):
    seen = record_rollouts(monkeypatch)
    calls = capture(monkeypatch, DPO, "data")
    gcfamily.train(
        method="dpo",
        reward=odd_length,
        output_dir=str(tmp_path / "d"),
        max_steps=3,
        pairs="own-samples",
        pool_prompts=6,
        **FAST,
    )
    pairs = 0
    for _, batch, _ in calls:
        rows = trained_rows(batch)
        assert len(rows) % 2 == 0 and rows
        for chosen, rejected in zip(rows[0::2], rows[1::2]):  # chosen at 2i, rejected at 2i+1
            assert chosen[0] == rejected[0] and chosen in seen and rejected in seen  # one prompt, its own samples
            # the reward's verdict, from the text the policy produced (the oracle is odd_length itself)
            assert odd_length([], [seen[chosen]])[0] >= 0.5 > odd_length([], [seen[rejected]])[0]
            pairs += 1
    assert pairs == 3 * 2


def test_ppo_whitens_by_default_as_documented(tmp_path, monkeypatch):
    field = next(f for f in dataclasses.fields(PPO.Settings) if f.name == "whiten")
    assert field.default is True and PPO.Settings().whiten is True
    assert "whitened over the step's valid tokens" in ppo_module.__doc__  # the objective as the module documents it
    calls = capture(monkeypatch, PPO, "prepare")
    out = gcfamily.train(method="ppo", reward=odd_length, output_dir=str(tmp_path / "p"), max_steps=2, beta=0.0, **FAST)
    assert json.loads((Path(out) / "run_config.json").read_text())["whiten"] is True
    for _, batch, stats in calls:
        valid = effective_mask(batch).bool()
        a = batch.token_advantages[valid]  # [n]
        # the branch: the raw advantages are not already whitened, so only whitening makes them mean 0 and std 1
        assert stats["ppo/adv_raw_std"] > 0 and abs(stats["ppo/adv_raw_std"] - 1) > 1e-2
        assert a.mean().abs() < 1e-5 and (a.std() - 1).abs() < 1e-3, (float(a.mean()), float(a.std()))
    assert len(calls) == 2 and torch.is_tensor(calls[0][1].token_advantages)
