"""reward_aggregation=normalize_then_sum (TRL's multi_objective_aggregation): each reward function's value reaches the
batch on its own (reward_parts, in --reward's order), and the advantage standardises each within its group before
the weighted sum, then over the step (scale_rewards=batch). `gcf check` restates it (the case "two rewards
standardised apart, then summed"); TRL parity is benchmarks/trl_parity.py's row."""

from __future__ import annotations

import pytest
import torch

from gcfamily.config import Config
from gcfamily.errors import GcfError
from gcfamily.methods import get_method
from gcfamily.run.trainer import Trainer


def length_mod(completions, **kw):
    return [float(len(c) % 3) for c in completions]


def has_digit(completions, **kw):
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def test_each_reward_reaches_the_batch_and_the_advantage_standardises_them_apart(tmp_path):
    cfg = Config(
        method="grpo",
        model="tiny",
        task="arithmetic",
        output_dir=str(tmp_path),
        reward=[f"{__file__}:length_mod", f"{__file__}:has_digit"],  # path/file.py:function, in this order
        reward_weights=[1.0, 0.5],
        reward_aggregation="normalize_then_sum",
        scale_rewards="batch",
        std_eps=1e-4,
        beta=0.0,
        batch_size=4,
        group_size=4,
        max_new_tokens=8,
        progress=False,
    )
    tr = Trainer(cfg)
    batch, _ = tr.method.data(0)
    texts = batch.completions
    want_parts = torch.tensor([length_mod(texts), has_digit(texts)]).T
    assert torch.equal(batch.reward_parts, want_parts)
    assert torch.allclose(batch.rewards, want_parts[:, 0] + 0.5 * want_parts[:, 1])
    batch, _ = tr.method.prepare(batch)
    # the textbook, by hand: z-score each reward in its group (sample std + 1e-4), weigh, sum; then over the step
    z = torch.zeros(len(texts), dtype=torch.float64)
    for g in range(4):
        rows = slice(4 * g, 4 * g + 4)
        for k, w in enumerate([1.0, 0.5]):
            r = want_parts[rows, k].double()
            z[rows] += w * (r - r.mean()) / (r.std() + 1e-4)
    z = z.float().double()
    adv = (z - z.view(4, 4).mean(-1).repeat_interleave(4)) / (z.std() + 1e-4)
    equal = (z.view(4, 4) == z.view(4, 4)[:, :1]).all(-1).repeat_interleave(4)  # all-equal groups get 0
    adv = torch.where(equal, 0.0, adv)
    assert torch.allclose(batch.advantages.double(), adv, atol=1e-6), (batch.advantages, adv)
    assert (adv != 0).sum() >= 4  # the case tells: a group at least whose rewards differ


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"reward_aggregation": "normalize_then_sum"}, "set scale_rewards=batch"),
        ({"reward_aggregation": "sum_then_sum"}, "reward_aggregation must be sum_then_normalize or normalize_then_sum"),
        (
            {"reward_aggregation": "normalize_then_sum", "scale_rewards": "batch", "kl_placement": "reward"},
            "use kl_placement=loss",
        ),
    ],
)
def test_refusals_are_one_sentence(settings: dict, says: str):
    with pytest.raises(GcfError) as e:
        get_method("grpo").validate(Config(method="grpo", **settings))
    assert says in str(e.value) and str(e.value).count(". ") == 0
