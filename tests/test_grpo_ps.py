"""GRPO with process supervision: step rewards normalised per group, a token's advantage the sum of the steps at or
after it, outcome supervision as the one-step case, steps laid on tokens exactly, and planted bugs caught."""

from __future__ import annotations

import math

import pytest
import torch

from gcfamily import check
from gcfamily.config import Config
from gcfamily.core.batch import Batch
from gcfamily.methods import get_method, grpo_ps
from gcfamily.methods.grpo_ps import GRPOProcess, process_advantages
from gcfamily.methods.onpolicy import place_steps
from gcfamily.models import tiny_tokenizer
from gcfamily.rewards import Rewards, Term
from gcfamily.rewards.scoring import Scores

SQRT3 = math.sqrt(3.0)


def test_advantages_by_hand() -> None:
    # one group of G = 2 outputs of 6 tokens. Output 0: steps ending on tokens 2 (reward 1) and 4 (reward 0);
    # output 1: one step ending on token 3 (reward 1). The group's step rewards {1, 0, 1}: mean 2/3, sample std
    # sqrt(((1/3)^2 + (2/3)^2 + (1/3)^2) / 2) = 1/sqrt(3), so r~ = +1/sqrt(3), -2/sqrt(3), +1/sqrt(3).
    R, at = torch.zeros(2, 6), torch.zeros(2, 6, dtype=torch.bool)
    R[0, 2], R[0, 4], R[1, 3] = 1.0, 0.0, 1.0
    at[0, 2] = at[0, 4] = at[1, 3] = True
    adv, equal = process_advantages(R, at, torch.ones(2, dtype=torch.bool), G=2, unbiased=True, std_eps=0.0)
    up, down = 1 / SQRT3, -2 / SQRT3
    # output 0: tokens 0-2 see both steps (up + down), tokens 3-4 the second only, token 5 none
    want0 = [up + down] * 3 + [down] * 2 + [0.0]
    want1 = [up] * 4 + [0.0] * 2  # output 1: tokens 0-3 see its step
    assert torch.allclose(adv, torch.tensor([want0, want1], dtype=torch.float64), atol=1e-12)
    assert not equal.any()


def test_equal_groups_invalid_outputs_and_outputs_without_steps() -> None:
    R, at = torch.zeros(4, 5), torch.zeros(4, 5, dtype=torch.bool)
    R[0, 1], R[0, 3], R[1, 2] = 0.5, 0.5, 0.5  # group 0: every step reward equal -> no gradient
    at[0, 1] = at[0, 3] = at[1, 2] = True
    R[2, 4], R[3, 4] = 9.0, 1.0  # group 1: output 2 failed (invalid), so one valid step: fewer than two -> none
    at[2, 4] = at[3, 4] = True
    valid = torch.tensor([True, True, False, True])
    adv, equal = process_advantages(R, at, valid, G=2, unbiased=True, std_eps=0.0)
    assert equal.tolist() == [True, True] and (adv == 0).all()
    # population std on group 1 without the failure: {9, 1}, mean 5, std 4 -> r~ = +1, -1 on every earlier token
    adv, equal = process_advantages(R, at, torch.ones(4, dtype=torch.bool), G=2, unbiased=False, std_eps=0.0)
    assert equal.tolist() == [True, False] and adv[2].tolist() == [1.0] * 5 and adv[3].tolist() == [-1.0] * 5


def _outcome_batch() -> dict:
    """8 samples (2 prompts x G = 4) with outcome rewards: each sample's last completion token holds its step."""
    g = torch.Generator().manual_seed(0)
    N, L = 8, 7
    lengths = torch.tensor([3, 5, 2, 4, 5, 1, 3, 4])
    pos = torch.arange(L)[None]
    loss_mask = ((pos >= 2) & (pos < 2 + lengths[:, None])).long()
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.2, 0.2, 0.9, 0.0])
    R, at = torch.zeros(N, L), torch.zeros(N, L, dtype=torch.bool)
    last = 1 + lengths
    R[torch.arange(N), last], at[torch.arange(N), last] = rewards, True
    return Batch(
        input_ids=torch.randint(0, 5, (N, L), generator=g),
        attention_mask=(pos < 2 + lengths[:, None]).long(),
        loss_mask=loss_mask,
        rewards=rewards,
        valid=torch.ones(N, dtype=torch.bool),
        step_rewards=R,
        step_mask=at,
    )


@pytest.mark.parametrize("std", ["sample", "population"])
def test_outcome_rewards_give_grpos_gradient(std: str) -> None:
    batch = _outcome_batch()
    logps = -torch.rand(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1)) * batch.loss_mask
    coefs = []
    for name in ("grpo", "grpo-ps"):
        m = get_method(name)(Config(method=name, group_size=4, beta=0.0, std=std, std_eps=1e-4))
        prepared, _ = m.add_advantages(batch.clone())
        coefs.append(m.coefficient(prepared, logps) * batch.loss_mask)
    assert coefs[0].abs().max() > 0.1  # a real gradient, equal on every completion token
    assert torch.allclose(coefs[0], coefs[1], atol=1e-7, rtol=0)


def test_steps_are_laid_on_the_token_holding_their_last_character() -> None:
    tok = tiny_tokenizer()  # one token per character
    texts = ["1+2=3\nAnswer: 3", "ab"]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    assert [len(x) for x in ids] == [len(t) for t in texts]
    L = 2 + max(len(x) for x in ids)
    loss_mask = torch.zeros(2, L, dtype=torch.long)
    loss_mask[0, 2 : 2 + len(ids[0])] = 1
    loss_mask[1, 2 : 2 + len(ids[1])] = 1
    scored = Scores(torch.zeros(2), torch.ones(2, dtype=torch.bool), [], steps=[[(5, 1.0), (15, 0.5)], [(2, 0.5)]])
    R, at, unplaced = place_steps(tok, scored, ids, texts, loss_mask)
    # "1+2=3" ends at char 5, held by completion token 4 (position 2 + 4); "Answer: 3" ends at char 15, token 14
    assert at[0].nonzero().flatten().tolist() == [6, 16] and R[0, 6] == 1.0 and R[0, 16] == 0.5
    assert at[1].nonzero().flatten().tolist() == [3] and R[1, 3] == 0.5 and not unplaced.any()


def test_several_rewards_merge_their_weighted_steps() -> None:
    def steps(prompts, completions, **kw):  # noqa: ANN001, ANN202
        return [[(1, 1.0), (len(c), 0.0)] for c in completions]

    def outcome(prompts, completions, **kw):  # noqa: ANN001, ANN202
        return [2.0 for _ in completions]

    s = Rewards([Term("steps", fn=steps, weight=0.5), Term("outcome", fn=outcome, weight=0.25)]).score(
        ["p", "p"], ["abc", "x"]
    )
    # "abc": a step at 1 (0.5 * 1) and at 3 (0.5 * 0 + 0.25 * 2); "x": both of steps' at 1 plus the outcome's
    assert s.steps == [[(1, 0.5), (3, 0.5)], [(1, 0.5 + 0.5)]] and s.step_rewards == ("steps",)
    with pytest.raises(Exception, match="scores steps"):
        s.require_outcome("grpo")


def test_a_bad_step_list_masks_the_sample() -> None:
    def bad(prompts, completions, **kw):  # noqa: ANN001, ANN202
        return [[(0, 1.0)], [(2, float("nan"))], [(99, 1.0)], [(1, 1.0)]]  # end 0, NaN, past the text, fine

    s = Rewards([Term("bad", fn=bad)]).score(["p"] * 4, ["ab", "ab", "ab", "ab"])
    assert s.valid.tolist() == [False, False, False, True]


# ----------------------------------------------------------------------------- planted bugs: gcf check catches each


def _per_output(step_rewards, step_mask, valid, G, unbiased, std_eps):  # noqa: ANN001, ANN202
    """Bug: the step rewards normalised within each output instead of across the group."""
    return process_advantages(step_rewards, step_mask, valid, 1, unbiased, std_eps)


def _prefix(step_rewards, step_mask, valid, G, unbiased, std_eps):  # noqa: ANN001, ANN202
    """Bug: a token's advantage sums the steps before it instead of those at or after it."""
    adv, equal = process_advantages(step_rewards, step_mask, valid, G, unbiased, std_eps)
    suffix_only = adv - torch.cat([adv[:, 1:], torch.zeros_like(adv[:, :1])], 1)  # each step's own r~ at its token
    return suffix_only.cumsum(-1), equal


def _outcome_broadcast(step_rewards, step_mask, valid, G, unbiased, std_eps):  # noqa: ANN001, ANN202
    """Bug: the outcome (sum of an output's steps) broadcast to every token, as outcome supervision does."""
    total = (step_rewards * step_mask).sum(-1)  # [N]
    last = torch.zeros_like(step_mask)
    last[:, -1] = step_mask.any(-1)
    R = torch.zeros_like(step_rewards)
    R[:, -1] = total
    return process_advantages(R, last, valid, G, unbiased, std_eps)


@pytest.mark.parametrize("bug", [_per_output, _prefix, _outcome_broadcast], ids=lambda f: f.__name__)
def test_check_catches_each_planted_bug(monkeypatch: pytest.MonkeyPatch, bug) -> None:  # noqa: ANN001
    assert check.run_case(GRPOProcess, "defaults", {}).ok  # the method as it is passes
    monkeypatch.setattr(grpo_ps, "process_advantages", bug)
    out = check.run_case(GRPOProcess, "defaults", {})
    assert not out.ok and any("textbook" in f for f in out.failures), out.failures


def test_grpo_ps_refuses_settings_it_cannot_honour() -> None:
    from gcfamily.errors import GcfError

    for sets in ({"scale_rewards": "batch"}, {"kl_placement": "reward"}):
        with pytest.raises(GcfError, match="grpo-ps"):
            check.make(GRPOProcess, {"group_size": 4, **sets})


def test_step_scores_come_back_from_the_reward_worker(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "steps.py"
    path.write_text(
        "def steps(prompts, completions, **kw):\n    return [[(1, 1.0), (len(c), 0.5)] for c in completions]\n"
    )
    r = Rewards.from_specs([f"{path}:steps"])  # a file's reward runs in the worker process
    try:
        s = r.score(["p", "q"], ["abcd", "xy"])
    finally:
        r.close()
    assert s.valid.all() and s.steps == [[(1, 1.0), (4, 0.5)], [(1, 1.0), (2, 0.5)]]


class _Bytes:
    """A byte-level tokenizer: token k is the byte k, 256 is EOS (skipped in decoding), as GPT-2-style tokenizers are."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_a_character_split_over_tokens_and_the_eos() -> None:
    text = "2×3=6\nok"  # "×" is two bytes: two tokens, the first decoding to U+FFFD alone
    ids = list(text.encode()) + [256]  # the sampled EOS ends the completion
    L = len(ids)
    loss_mask = torch.ones(1, L, dtype=torch.long)
    # a step ending after "2×" (character 2) lands on the token completing "×" (token 2: bytes 0, 1-2); the
    # completion's end (character 8) on its last token, the EOS (token 9), as outcome supervision gives it
    scored = Scores(torch.zeros(1), torch.ones(1, dtype=torch.bool), [], steps=[[(2, 1.0), (8, 0.5)]])
    R, at, unplaced = place_steps(_Bytes(), scored, [ids], [text], loss_mask)
    assert not unplaced.any() and at[0].nonzero().flatten().tolist() == [2, L - 1]
    assert R[0, 2] == 1.0 and R[0, L - 1] == 0.5
    # outcome rewards only (no step list): one step on the EOS, every token before it sees it
    R, at, _ = place_steps(
        _Bytes(), Scores(torch.tensor([1.0]), torch.ones(1, dtype=torch.bool), []), [ids], [text], loss_mask
    )
    assert at[0].nonzero().flatten().tolist() == [L - 1] and R[0, L - 1] == 1.0
    # an empty completion (EOS at once) scored by a number: its one token holds the step
    R, at, unplaced = place_steps(
        _Bytes(), Scores(torch.tensor([0.5]), torch.ones(1, dtype=torch.bool), []), [[256]], [""], torch.ones(1, 1)
    )
    assert not unplaced.any() and at.tolist() == [[True]] and R[0, 0] == 0.5
