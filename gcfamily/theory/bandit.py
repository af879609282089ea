"""A bandit language model: for each of P prompts, a softmax over K whole outputs.

It has the two parts of a Hugging Face causal LM that the engine uses, so the engine, the
method classes and the trainer's log-prob helper run on it unchanged:

    sequence   [q, o]           input_ids [B, 2]: prompt id q < P, then output id o < K
    backbone   h_t = onehot(q)  last_hidden_state [B, 2, P]: the prompt at every position
    head       Linear(P, K)     weight[:, q] holds the logits of prompt q
    so the engine's log-prob at position 1 is log softmax(logits_q)[o] (loss_mask [0, 1]).

A BanditProblem adds the reference policy and the rewards: deterministic values r(q, o), or
(bernoulli=True) success probabilities of a 0/1 reward. It makes the batches that rollouts
and reward functions make for a real model: sampled groups of G outputs per prompt, or every
possible group with its probability (the exact expectation over groups).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from gcfamily.core.batch import Batch
from gcfamily.errors import GcfError


class _PromptBackbone(nn.Module):
    """The "decoder": the one-hot of the prompt id (position 0) as the hidden state everywhere."""

    def __init__(self, num_prompts: int) -> None:
        super().__init__()
        self.num_prompts = num_prompts
        self.register_buffer("_dtype_probe", torch.zeros((), dtype=torch.float64), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        use_cache: bool = False,
    ) -> SimpleNamespace:
        q = input_ids[:, :1].expand_as(input_ids)  # [B, L]
        hidden = nn.functional.one_hot(q, self.num_prompts).to(self._dtype_probe.dtype)  # [B, L, P]
        return SimpleNamespace(last_hidden_state=hidden)


class BanditLM(nn.Module):
    """pi(o | q) = softmax(logits[q])[o]; the logits are the only parameters (float64)."""

    def __init__(self, logits: torch.Tensor | np.ndarray) -> None:
        super().__init__()
        logits = torch.as_tensor(np.asarray(logits, dtype=float))  # [P, K]
        if logits.ndim != 2 or not torch.isfinite(logits).all():
            raise GcfError("BanditLM needs a finite [prompts, outputs] matrix of logits.")
        P, K = logits.shape
        self.backbone = _PromptBackbone(P)
        self.head = nn.Linear(P, K, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.head.weight.copy_(logits.t())  # [K, P]: column q is prompt q's logits

    def get_decoder(self) -> nn.Module:
        return self.backbone

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    @property
    def logits(self) -> torch.Tensor:
        """[P, K] view of the head's weight."""
        return self.head.weight.t()

    def probs(self) -> torch.Tensor:
        """pi [P, K], float64, no grad."""
        return torch.softmax(self.logits.detach(), dim=-1)


@dataclass
class BanditProblem:
    """P prompts, K outputs each: the reference policy and the (expected) rewards."""

    pi_ref: np.ndarray  # [P, K], every entry > 0, rows sum to 1
    rewards: np.ndarray  # [P, K] reward values, or success probabilities when bernoulli
    bernoulli: bool = False

    def __post_init__(self) -> None:
        self.pi_ref = np.atleast_2d(np.asarray(self.pi_ref, dtype=float))
        self.rewards = np.atleast_2d(np.asarray(self.rewards, dtype=float))
        if self.pi_ref.shape != self.rewards.shape or self.pi_ref.shape[1] < 2:
            raise GcfError(
                f"pi_ref {self.pi_ref.shape} and rewards {self.rewards.shape} must both be [prompts, K >= 2]."
            )
        if not np.all(self.pi_ref > 0) or not np.allclose(self.pi_ref.sum(1), 1.0, atol=1e-9):
            raise GcfError("every row of pi_ref must be a distribution with all entries > 0 (finite reference logits).")
        if self.bernoulli and not np.all((self.rewards >= 0) & (self.rewards <= 1)):
            raise GcfError("with Bernoulli rewards every reward is a success probability in [0, 1].")

    @classmethod
    def binary(
        cls, p_refs: Sequence[float], rewards: Sequence[float] = (1.0, 0.0), bernoulli: bool = False
    ) -> "BanditProblem":
        """One binary question per p_ref: output 0 is the correct answer a, output 1 the wrong one b."""
        p = np.asarray(p_refs, dtype=float)
        if p.ndim != 1 or not np.all((p > 0) & (p < 1)):
            raise GcfError(f"every p_ref must lie strictly between 0 and 1 (got {list(p_refs)}).")
        return cls(np.stack([p, 1 - p], 1), np.tile(np.asarray(rewards, dtype=float), (len(p), 1)), bernoulli)

    @property
    def P(self) -> int:
        return self.pi_ref.shape[0]

    @property
    def K(self) -> int:
        return self.pi_ref.shape[1]

    def policy(self) -> BanditLM:
        """A bandit model at pi_ref (log pi_ref as logits); GRPO's reference is a frozen copy of it."""
        return BanditLM(np.log(self.pi_ref))

    # the task interface a method's setup reads: rows("train") and reward
    def reward(self, prompts: list[str], completions: list[str], **columns: object) -> list[float]:
        """The (expected) rewards as a reward function of prompt ("q3") and output ("o1") names."""
        return [float(self.rewards[int(p[1:]), int(c[1:])]) for p, c in zip(prompts, completions)]

    def rows(self, split: str = "train") -> list[dict[str, str]]:
        """The prompts as task rows (a method's setup reads them; the bandit makes the batches)."""
        return [{"prompt": f"q{i}"} for i in range(self.P)]


def make_batch(prompts: torch.Tensor, outputs: torch.Tensor, rewards: torch.Tensor) -> Batch:
    """The batch a rollout plus reward scoring would make: one row [q, o] per sample."""
    N = prompts.shape[0]
    return Batch(
        input_ids=torch.stack([prompts, outputs], 1).long(),  # [N, 2]
        attention_mask=torch.ones(N, 2, dtype=torch.long),  # [N, 2]
        loss_mask=torch.tensor([[0, 1]]).expand(N, 2).clone(),  # [N, 2]: the output is the completion
        rewards=rewards.float(),  # [N]
        valid=torch.ones(N, dtype=torch.bool),  # [N]
        prompt_index=prompts.long(),  # [N]
    )


def sample_groups(
    problem: BanditProblem, policy: BanditLM, groups_per_prompt: int, G: int, generator: torch.Generator
) -> Batch:
    """groups_per_prompt groups of G outputs drawn from the current policy for every prompt, scored.

    Rows are grouped as the rollout groups them: G consecutive rows per group, prompt-major.
    """
    P, n = problem.P, groups_per_prompt
    probs = policy.probs().float()  # [P, K]
    outputs = torch.multinomial(probs.repeat_interleave(n, 0), G, replacement=True, generator=generator)  # [P*n, G]
    outputs = outputs.flatten()  # [N]
    prompts = torch.arange(P).repeat_interleave(n * G)  # [N]
    r = torch.as_tensor(problem.rewards)[prompts, outputs]  # [N]
    if problem.bernoulli:
        r = torch.bernoulli(r, generator=generator)
    return make_batch(prompts, outputs, r)


class GroupEnumeration:
    """Every group of G samples of every prompt, as one batch, with each group's probability.

    A sample is an outcome c = (output, reward); deterministic rewards give K outcomes per
    prompt, Bernoulli rewards 2K (output o with reward 1 has probability pi(o) q(o)). A group
    is a multiset of G outcomes; its probability is the multinomial coefficient times the
    product of its outcomes' probabilities. The gradient of a method's loss is the same for
    every ordering of a group, so the multisets and their weights give the exact expectation.
    """

    def __init__(self, problem: BanditProblem, G: int) -> None:
        prompts, outputs, rewards, log_factor = [], [], [], []
        group, log_coef = [], []
        g = 0
        for q in range(problem.P):
            outcomes = self._outcomes(problem, q)  # [(o, reward, log factor)]
            for combo in itertools.combinations_with_replacement(range(len(outcomes)), G):
                counts = np.bincount(combo, minlength=len(outcomes))
                log_coef.append(math.lgamma(G + 1) - sum(math.lgamma(c + 1) for c in counts))
                for c in combo:
                    o, r, lf = outcomes[c]
                    prompts.append(q), outputs.append(o), rewards.append(r), log_factor.append(lf)
                    group.append(g)
                g += 1
        self.G, self.num_groups = G, g
        self.prompts = torch.tensor(prompts)  # [N]
        self.outputs = torch.tensor(outputs)  # [N]
        self.log_factor = torch.tensor(log_factor, dtype=torch.float64)  # [N]
        self.group = torch.tensor(group)  # [N]
        self.log_coef = torch.tensor(log_coef, dtype=torch.float64)  # [groups]
        self.rewards = torch.tensor(rewards, dtype=torch.float64)  # [N]

    @staticmethod
    def _outcomes(problem: BanditProblem, q: int) -> list[tuple[int, float, float]]:
        out = []
        for o in range(problem.K):
            r = float(problem.rewards[q, o])
            if not problem.bernoulli:
                out.append((o, r, 0.0))
                continue
            for bit, prob in ((1.0, r), (0.0, 1.0 - r)):
                if prob > 0:  # an impossible reward is not an outcome
                    out.append((o, bit, math.log(prob)))
        return out

    def batch(self) -> Batch:
        """Every group's rows, G consecutive rows per group (the layout of sampled batches)."""
        return make_batch(self.prompts, self.outputs, self.rewards)

    def weights(self, policy: BanditLM) -> torch.Tensor:
        """[N] probability, under the current policy, of the group each row belongs to."""
        log_pi = torch.log_softmax(policy.logits.detach(), dim=-1)  # [P, K]
        row = log_pi[self.prompts, self.outputs] + self.log_factor  # [N]
        log_p = self.log_coef.clone().index_add_(0, self.group, row)  # [groups]
        return log_p.exp()[self.group]  # [N]
