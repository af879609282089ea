"""The second model's loss, checked like the policy's: PPO's critic (the clipped value loss) and the reward model
(Bradley-Terry), each through the method's own `auxiliary_step` per micro-batch and `auxiliary_step_end`, against
autograd of the loss written here from the paper.

The model is a float64 table (a value or a score per token and position) and its optimizer plain SGD at lr 1 with no
clip, so the step's parameter change is the step's gradient, divided by the method's own normaliser.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gcfamily.check.textbook import _gae
from gcfamily.check.world import L, N, StubServices, V, World, make, micro_batches
from gcfamily.methods.base import Batch, Method


@dataclass
class SecondCheck:
    name: str
    got: torch.Tensor
    """The method's step on the second model's table (lr 1: its gradient)."""
    want: torch.Tensor
    """Autograd of the textbook loss, over the whole step."""
    branches: Counter
    required: set[str]


class _Table(nn.Module):
    """A second model from a float64 table [V, L]: per token, table[token, position] (a critic's value), or summed over
    the attended tokens (a reward model's score)."""

    def __init__(self, table: torch.Tensor, score: bool) -> None:
        super().__init__()
        self.table, self.score = nn.Parameter(table.clone()), score

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: Any = None) -> torch.Tensor:
        per = self.table[input_ids, torch.arange(input_ids.shape[1])]  # [B, L]
        return (per * attention_mask).sum(-1) if self.score else per


def _plain_sgd(m: Method, model: nn.Module) -> torch.optim.Optimizer:
    object.__setattr__(m.cfg, "grad_clip", 0.0)  # no clip: the step is the gradient itself
    return torch.optim.SGD(model.parameters(), lr=1.0)


def critic_check(m: Any, mbs: list[Batch], raw: Batch, stub: StubServices, gen: torch.Generator) -> SecondCheck:
    """PPO's critic after prepare moved by +-1.5 c (past the value clip c) or +-0.3 c (inside it): its step against
    vf_coef * mean over the step's valid tokens of max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), R = GAE's
    returns (Schulman et al. 2017, the clipped value loss of their baselines; Ouyang et al. 2022)."""
    s = m.settings
    old = stub.world.value_table.double()  # [V, L] the critic prepare read V_old from
    moves = torch.tensor([1.5, -1.5, 0.3, -0.3], dtype=torch.float64) * (s.value_clip or 0.2)
    start = old + moves[torch.randint(0, 4, old.shape, generator=gen)]  # [V, L]
    m.critic = _Table(start, score=False)
    m.critic_optimizer = _plain_sgd(m, m.critic)
    m.critic_tokens = 0.0
    for mb in mbs:
        m.auxiliary_step(mb)
    m.auxiliary_step_end()
    got = start - m.critic.table.detach()

    A, v_old, _ = _gae(raw, stub, m, Counter())
    R = A + v_old  # [N, L] the returns
    on = raw.loss_mask.bool() & raw.valid.bool()[:, None]
    table = start.clone().requires_grad_(True)
    v = table[raw.input_ids, torch.arange(L)]  # [N, L]
    plain = (v - R) ** 2
    c = s.value_clip
    clipped = (v_old + torch.clamp(v - v_old, -c, c) - R) ** 2 if c > 0 else plain
    loss = s.vf_coef * torch.where(on, torch.maximum(plain, clipped), 0.0).sum() / on.sum()
    want = torch.autograd.grad(loss, table)[0]
    br = Counter(
        {
            "value loss: clipped term larger": int(((clipped > plain) & on).sum()),
            "value loss: unclipped term larger": int(((plain > clipped) & on).sum()),
        }
    )
    return SecondCheck("(c) the critic's step vs the clipped value loss", got, want, br, set(br) if c > 0 else set())


def bradley_terry_check(cls: type[Method], seed: int) -> SecondCheck:
    """The reward model: its data() lays out 8 pairs of World rows (chosen 2k, rejected 2k+1, one prompt), a score
    table stands in for its model; its step against -mean over pairs of log sigmoid(r(x, y_w) - r(x, y_l)) (Bradley and
    Terry 1952; Ouyang et al. 2022, eq. 1), the pairs known by their rows, not by where the method put them."""
    gen = torch.Generator().manual_seed(seed)
    m: Any = make(cls, {})
    world = World(N, gen)
    pairs = [(2 * k, 2 * k + 1) for k in range(N // 2)]
    for w, lo in pairs:
        world.share_prompt(w, lo)
    start = [world.positions(i)[0] for i in range(N)]
    ids = [[int(t) for t in world.tokens[i, world.attention_mask[i].bool()]] for i in range(N)]
    m.services = StubServices(m.cfg, world, 1.0)
    m.pairs = [(ids[w][: start[w]], ids[w][start[w] :], ids[lo][start[lo] :]) for w, lo in pairs]  # as setup encodes
    m.pad_id, m.skipped, m.pairs_in_step = 0, 0, 0
    object.__setattr__(m.cfg, "batch_size", len(pairs))  # the step holds every pair once
    table0 = 0.5 * torch.randn(V, L, generator=gen, dtype=torch.float64)
    m.rm = _Table(table0, score=True)
    m.optimizer = _plain_sgd(m, m.rm)
    m.scheduler = torch.optim.lr_scheduler.LambdaLR(m.optimizer, lambda step: 1.0)
    batch, _ = m.data(0)
    for mb in micro_batches(batch, m.rows_per_example):
        m.auxiliary_step(mb)
    m.auxiliary_step_end()
    got = table0 - m.rm.table.detach()

    table = table0.clone().requires_grad_(True)
    # [N]
    score = torch.stack(
        [table[world.tokens[i], torch.arange(L)][world.attention_mask[i].bool()].sum() for i in range(N)]
    )
    margin = score[0::2] - score[1::2]  # [P] chosen minus rejected
    want = torch.autograd.grad(F.softplus(-margin).mean(), table)[0]
    br = Counter({"pairs ranked right": int((margin > 0).sum()), "pairs ranked wrong": int((margin < 0).sum())})
    return SecondCheck("the reward model's step vs Bradley-Terry", got, want, br, set(br))


POLICYLESS: dict[str, Callable[[type[Method], int], SecondCheck]] = {
    "gcfamily.methods.reward_model.RewardModelTraining": bradley_terry_check,
}
"""Methods that train only a model of their own, by the class whose loss the check restates."""


def policyless_check(cls: type[Method]) -> Callable[[type[Method], int], SecondCheck] | None:
    """The check of the nearest class in cls's MRO that POLICYLESS knows, or None."""
    return next((POLICYLESS[q] for c in cls.__mro__ if (q := f"{c.__module__}.{c.__qualname__}") in POLICYLESS), None)
