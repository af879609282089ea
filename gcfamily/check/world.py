"""The stub world of gcf check (gcfamily/check/): sizes, rewards, the stand-in Services and critic, and how a method is made for a check."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gcfamily.config import Config
from gcfamily.core.batch import select
from gcfamily.methods.base import Batch, Method
from gcfamily.methods.services import LocalServices

L, V, G, N = 8, 5, 4, 16  # sequence length, vocabulary, samples per prompt, rows (4 prompts x G, or 8 pairs)
MICRO = 4  # rows per micro-batch: every batch is split into several
TOL_A, TOL_B = 2e-6, 1e-5  # relative to the gradient's largest entry: float64 log-probs; the engine's float32 path
# a group's rewards: mixed with ties, all equal, one failed (valid=False, with a high reward so that using it
# unmasked changes every result), distinct
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.9, 1.0, 0.2, 0.6, 0.8, 0.1, 0.3, 0.65]
FAILED, FAR = 9, 4  # the failed sample; the row with a token 25 nats from pi_ref (past any KL clamp)
SECOND_REWARD = [0.3, 0.9, 0.1, 0.5, 0.2, 0.2, 0.2, 0.2, 0.7, 0.4, 0.1, 0.8, 0.6, 0.0, 0.9, 0.3]
"""A second reward function's values (reward_aggregation=normalize_then_sum); group 1 equal in both rewards."""
TRUNCATED = (2, 13)  # the samples that hit max_new_tokens without EOS (rows of groups whose advantages are not 0)
WARMUP = [[0.2, 0.7] * 8, [0.9, 1.0, 0.8, 1.0] * 4, [0.0, 0.1] * 8]
"""Three warm-up steps' rewards (means 0.45, 0.925, 0.05) before the checked one: a running baseline's b is their
moving average, which a baseline that forgot all but the last step would miss."""

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
    pi_ref = pi * exp(ref_offset), the sampler's pi_old / exp(sample_offset) (check/sampler.py), and a critic
    V(token, position)."""

    def __init__(self, n: int, gen: torch.Generator, episodes: bool = False) -> None:
        pos = torch.arange(L)[None]
        start = torch.randint(1, 3, (n, 1), generator=gen)  # a prompt of 1-2 tokens
        end = start + torch.randint(4, L - 1, (n, 1), generator=gen)  # a completion of 4-6, right padding
        self.tokens = torch.randint(0, V, (n, L), generator=gen)  # [n, L]
        self.attention_mask = (pos < end).long()  # [n, L]
        self.loss_mask = ((pos >= start) & (pos < end)).long()  # [n, L]
        self.env_mask = torch.zeros(n, L, dtype=torch.long)  # [n, L] an environment's tokens inside a completion
        if episodes:  # two rows in three: a policy turn, an answer of 1-2 tokens, then the policy's next turn
            width = torch.randint(1, 3, (n,), generator=gen)
            for i in range(n):
                if i % 3 != 2:
                    a = int(start[i]) + 1 + i % 2  # after one or two policy tokens, leaving at least one after it
                    self.env_mask[i, a : min(a + int(width[i]), int(end[i]) - 1)] = 1
            self.loss_mask = self.loss_mask * (1 - self.env_mask)
        self.logits = 1.5 * torch.randn(n, L, V, generator=gen, dtype=torch.float64)  # [n, L, V]
        self.log_ratio = torch.zeros(n, L, dtype=torch.float64)  # log pi - log pi_old, set by a builder
        self.ref_offset = 0.5 * torch.randn(n, L, generator=gen, dtype=torch.float64)  # log pi_ref - log pi
        self.sample_offset = torch.zeros(n, L, dtype=torch.float64)  # log pi_old - log pi_sampler, set by a builder
        self.value_table = torch.randn(V, L, generator=gen)  # [V, L]

    def logps(self, logits: torch.Tensor | None = None, tau: float = 1.0) -> torch.Tensor:
        """log pi(token) per row [n, L], 0 off the loss mask."""
        x = self.logits if logits is None else logits
        return torch.log_softmax(x / tau, -1).gather(-1, self.tokens[..., None]).squeeze(-1) * self.loss_mask

    def rows(self, ids: Any) -> Batch:
        ids = torch.as_tensor(list(ids))
        return Batch(
            input_ids=self.tokens[ids],
            attention_mask=self.attention_mask[ids],
            loss_mask=self.loss_mask[ids],
            row_id=ids,
        )

    def positions(self, i: int) -> list[int]:
        return self.loss_mask[i].nonzero().flatten().tolist()

    def text(self, i: int, part: str) -> str:
        """Row i's prompt or completion tokens as text ("3 0 4"), for a method that reads rows through a formatter."""
        pos = self.positions(i)
        span = range(pos[0]) if part == "prompt" else pos
        return " ".join(str(int(self.tokens[i, t])) for t in span)

    def share_prompt(self, i: int, j: int) -> None:
        """Row j takes row i's prompt (a preference pair's two rows), keeping its own completion length."""
        start, n = self.positions(i)[0], len(self.positions(j))
        pos = torch.arange(L)
        self.tokens[j, :start] = self.tokens[i, :start]
        self.attention_mask[j] = (pos < start + n).long()
        self.loss_mask[j] = ((pos >= start) & (pos < start + n)).long()

    def find(self, batch: Batch) -> torch.Tensor:
        """The row ids [B] of a batch laid out by a method from the World's rows (by their tokens and loss masks)."""
        key = {
            (tuple(self.tokens[i][self.attention_mask[i].bool()].tolist()), tuple(self.positions(i))): i
            for i in range(len(self.tokens))
        }
        ids = []
        for b in range(batch.input_ids.shape[0]):
            on = batch.attention_mask[b].bool()
            row = (tuple(batch.input_ids[b][on].tolist()), tuple(batch.loss_mask[b].nonzero().flatten().tolist()))
            if row not in key:
                raise AssertionError(f"row {b} of the method's batch is none of the check's rows")
            ids.append(key[row])
        return torch.tensor(ids)


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


class TextFormatter(StubFormatter):
    """Rows whose prompt and completions are token ids written as text ("3 0 4", World.text), read back as ids."""

    def prompt_ids(self, prompt: Any) -> list[int]:
        return [int(x) for x in prompt.split()]

    def completion_ids(self, prompt: Any, completion: Any, i: int = 0) -> list[int]:
        return [int(x) for x in completion.split()]


class PadOnly:
    """The tokenizer of a stub trainer whose method only pads (token 0)."""

    pad_token_id = eos_token_id = 0


class Collective:
    """`world_size` simulated ranks, one thread each: all_sum waits for every rank's tensor and gives each the same sum,
    added in rank order (as the run's all_reduce gives every rank one result)."""

    def __init__(self, world_size: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=60)

    def all_sum(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        total = self.slots[0].clone()  # type: ignore[union-attr]
        for t in self.slots[1:]:
            total = total + t
        self.barrier.wait()  # every rank has read the slots before any writes its next tensor
        return total

    def run(self, work: list[Callable[[], Any]]) -> list[Any]:
        """work[r]() on rank r's thread; the first exception re-raised here (the others' barrier is broken)."""
        out: list[Any] = [None] * len(work)
        errors: list[BaseException] = []

        def one(r: int) -> None:
            try:
                out[r] = work[r]()
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(len(work))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return out


class StubServices(LocalServices):
    """The checker's Services (gcfamily/methods/services.py): log-probs are the World's, by row id; one process, or
    rank `rank` of a Collective's simulated ranks, whose all_sum sums over them."""

    def __init__(
        self, cfg: Config, world: World, tau: float, rank: int = 0, collective: Collective | None = None
    ) -> None:
        self.cfg, self.world, self.tau = cfg, world, tau  # tau: the temperature the textbook reads pi_old, pi_ref at
        self.task, self.tokenizer, self.device = _StubTask(), None, torch.device("cpu")
        self.policy_model, self.ref = nn.Linear(1, 1), nn.Linear(1, 1)
        self.formatter = StubFormatter()
        self.collective, self.rank, self.rows = collective, rank, None
        self.world_size = 1 if collective is None else len(collective.slots)
        self.is_main = rank == 0

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.collective is None else self.collective.all_sum(self.rank, tensor)

    def policy(self) -> nn.Module:
        return self.policy_model

    def training_rows(self) -> list[dict[str, Any]]:
        return self.rows if self.rows is not None else super().training_rows()

    def generate(self, prompt_ids: list[list[int]], group_size: int, sampling: Any) -> Any:
        raise NotImplementedError("the checker's rollouts are rows of its World (check/builders.py), never sampled")

    def reference(self) -> nn.Module:
        return self.ref

    def logprobs(self, model: nn.Module, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """pi_old's (the policy's before the step) or pi_ref's log-probs at `temperature`, as the trainer's: a method
        that asks for another temperature than the sampling one gets other log-probs."""
        w = self.world
        ids = batch.row_id if batch.row_id is not None else w.find(batch)  # a batch the method collated itself
        shift = -w.log_ratio[ids] if model is self.policy_model else w.ref_offset[ids]
        width = batch.input_ids.shape[1]  # a batch the method collated may be narrower than the World's L
        out = (w.logps(tau=temperature)[ids] + shift)[:, :width] * batch.loss_mask
        return out.float()  # [B, L], float32 as the trainer's


class StubCritic(nn.Module):
    """PPO's value model: V(token, position) from a table."""

    def __init__(self, world: World) -> None:
        super().__init__()
        self.table = world.value_table

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: Any = None) -> torch.Tensor:
        return self.table[input_ids, torch.arange(input_ids.shape[1])]  # [B, L]


def micro_batches(batch: Batch, rows_per_example: int) -> list[Batch]:
    """The step's micro-batches, of unequal sizes: one example, then three, then MICRO rows at a time (whole examples),
    so that a normaliser counted on one micro-batch (and scaled by their number) is not the step's."""
    B, k = batch.input_ids.shape[0], rows_per_example
    size = max(k, MICRO - MICRO % k)
    cuts = sorted({0, min(k, B), min(4 * k, B), *range(4 * k + size, B, size), B})
    return [select(batch, slice(a, b)) for a, b in itertools.pairwise(cuts)]


def make(cls: type[Method], settings: dict[str, Any]) -> Method:
    """The method at its own defaults plus `settings` (marked explicit, so its setting_defaults fill the rest)."""
    cfg = Config(method=cls.name or cls.__name__, **settings)
    object.__setattr__(cfg, "explicit", sorted(settings))
    cls.apply_setting_defaults(cfg)
    cls.validate(cfg)
    return cls(cfg)
