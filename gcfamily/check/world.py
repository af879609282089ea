"""The stub world of gcfamily/check/__init__.py: sizes, rewards, the stand-in Services and critic, and how a method is made for a check."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gcfamily.config import Config
from gcfamily.methods.base import Batch, Method
from gcfamily.methods.services import LocalServices


L, V, G, N = 8, 5, 4, 16  # sequence length, vocabulary, samples per prompt, rows (4 prompts x G, or 8 pairs)
MICRO = 4  # rows per micro-batch: every batch is split into several
TOL_A, TOL_B = 2e-6, 1e-5  # relative to the gradient's largest entry: float64 log-probs; the engine's float32 path
# a group's rewards: mixed with ties, all equal, one failed (valid=False, with a high reward so that using it
# unmasked changes every result), distinct; the warm-up step's mean 0.45 is the running baseline's b
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.9, 1.0, 0.2, 0.6, 0.8, 0.1, 0.3, 0.65]
FAILED, FAR = 9, 4  # the failed sample; the row with a token 25 nats from pi_ref (past any KL clamp)
WARMUP = [0.2, 0.7] * 8

M = "gcfamily.methods."
GRPO_, CLIP_, PPO_, DPO_ = M + "grpo.GRPO", M + "clipped.ClippedOnPolicy", M + "ppo.PPO", M + "dpo.DPO"
RB_ = M + "reinforce.ReinforceBaseline"


def _qual(c: type) -> str:
    return f"{c.__module__}.{c.__qualname__}"


def _definer(cls: type, attr: str) -> str:
    """The class of cls's MRO whose body defines attr."""
    return next((_qual(c) for c in cls.__mro__ if attr in vars(c)), "")


# ----------------------------------------------------------------------------- rows, stub trainer


class World:
    """Rows by id and what the stub's models say of them: the policy's logits, pi_old = pi / exp(log_ratio),
    pi_ref = pi * exp(ref_offset), and a critic V(token, position)."""

    def __init__(self, n: int, gen: torch.Generator) -> None:
        pos = torch.arange(L)[None]
        start = torch.randint(1, 3, (n, 1), generator=gen)  # a prompt of 1-2 tokens
        end = start + torch.randint(4, L - 1, (n, 1), generator=gen)  # a completion of 4-6, right padding
        self.tokens = torch.randint(0, V, (n, L), generator=gen)  # [n, L]
        self.attention_mask = (pos < end).long()  # [n, L]
        self.loss_mask = ((pos >= start) & (pos < end)).long()  # [n, L]
        self.logits = 1.5 * torch.randn(n, L, V, generator=gen, dtype=torch.float64)  # [n, L, V]
        self.log_ratio = torch.zeros(n, L, dtype=torch.float64)  # log pi - log pi_old, set by a builder
        self.ref_offset = 0.5 * torch.randn(n, L, generator=gen, dtype=torch.float64)  # log pi_ref - log pi
        self.value_table = torch.randn(V, L, generator=gen)  # [V, L]

    def logps(self, logits: torch.Tensor | None = None, tau: float = 1.0) -> torch.Tensor:
        """log pi(token) per row [n, L], 0 off the loss mask."""
        x = self.logits if logits is None else logits
        return torch.log_softmax(x / tau, -1).gather(-1, self.tokens[..., None]).squeeze(-1) * self.loss_mask

    def rows(self, ids: Any) -> Batch:
        ids = torch.as_tensor(list(ids))
        return {
            "input_ids": self.tokens[ids],
            "attention_mask": self.attention_mask[ids],
            "loss_mask": self.loss_mask[ids],
            "row_id": ids,
        }

    def positions(self, i: int) -> list[int]:
        return self.loss_mask[i].nonzero().flatten().tolist()


class _StubTask:
    name = "stub"

    def rows(self, split: str) -> list[dict]:
        return [{"prompt": "p"}]

    def reward(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        return [0.0] * len(prompts)


class StubFormatter:
    """Token ids for the stub task's rows (a method's setup encodes them; its batches come from the World)."""

    def mode(self, conversational: bool) -> str:
        return "raw"

    def prompt_ids(self, prompt: Any) -> list[int]:
        return [1]

    def completion_ids(self, prompt: Any, completion: Any, i: int = 0) -> list[int]:
        return [1]

    def demonstration(self, row: dict, i: int = 0) -> tuple[list[int], list[int]]:
        return [1, 1], [0, 1]


class StubServices(LocalServices):
    """The checker's Services (gcfamily/methods/services.py): one process; log-probs are the World's, by row id."""

    def __init__(self, cfg: Config, world: World, tau: float) -> None:
        self.cfg, self.world, self.tau = cfg, world, tau  # tau: the temperature the textbook reads pi_old, pi_ref at
        self.task, self.tokenizer, self.device = _StubTask(), None, torch.device("cpu")
        self.policy_model, self.ref = nn.Linear(1, 1), nn.Linear(1, 1)
        self.formatter = StubFormatter()

    def policy(self) -> nn.Module:
        return self.policy_model

    def generate(self, prompt_ids: list[list[int]], group_size: int, sampling: Any) -> Any:
        raise NotImplementedError("the checker's rollouts are rows of its World (check/builders.py), never sampled")

    def reference(self) -> nn.Module:
        return self.ref

    def logprobs(self, model: nn.Module, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """pi_old's (the policy's before the step) or pi_ref's log-probs at `temperature`, as the trainer's: a method
        that asks for another temperature than the sampling one gets other log-probs."""
        w, ids = self.world, batch["row_id"]
        shift = -w.log_ratio[ids] if model is self.policy_model else w.ref_offset[ids]
        return (
            (w.logps(tau=temperature)[ids] + shift) * batch["loss_mask"]
        ).float()  # [B, L], float32 as the trainer's


class StubCritic(nn.Module):
    """PPO's value model: V(token, position) from a table."""

    def __init__(self, world: World) -> None:
        super().__init__()
        self.table = world.value_table

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: Any = None) -> torch.Tensor:
        return self.table[input_ids, torch.arange(input_ids.shape[1])]  # [B, L]


def make(cls: type[Method], settings: dict[str, Any]) -> Method:
    """The method at its own defaults plus `settings` (marked explicit, so its setting_defaults fill the rest)."""
    cfg = Config(method=cls.name or cls.__name__, **settings)
    object.__setattr__(cfg, "explicit", sorted(settings))
    cls.apply_setting_defaults(cfg)
    cls.validate(cfg)
    return cls(cfg)
