"""Rejection sampling fine-tuning: sample, keep what clears the reward threshold, imitate it. RFT samples the current
policy at every step (DeepSeekMath's Online RFT); OfflineRFT (`rft-offline`) samples the initial policy once.

Objective (DeepSeekMath 5.2.1, "RFT"/"Online RFT"), maximised:

    J  = sum_{o kept} sum_t log pi(o_t | q, o_<t) / (tokens of the kept samples in the step)
    GC = 1[o kept],   kept = reward(o) >= reward_threshold (and the reward did not fail)

Samples that are not kept get valid=False: no gradient and no place in the normaliser, so J is
SFT's token mean over the kept samples alone (rather than diluted by the rejected ones). A step
that keeps nothing has a zero gradient.

With the sampler correction on (setting tis, OnPolicy.sampler_correction) each kept token's log-likelihood is
multiplied by c_t = pi_old/pi_sampler truncated or masked (no gradient; pi_old is the current policy, one pass):
J = sum_{o kept} sum_t c_t log pi(o_t) / Z and GC = c_t 1[o kept]. rft-offline refuses it: its pool was drawn once
from the initial policy and keeps no sampler log-probs, so there is no sampler to correct against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from gcfamily.config import Config
from gcfamily.data.batches import collate, collate_masked, default_pad_id, epoch_indices
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch, Stats
from gcfamily.methods.onpolicy import OnPolicy
from gcfamily.methods.pools import Pool, check_drawn_for, draw, pool_for
from gcfamily.methods.services import Services


class RFT(OnPolicy):
    """Online rejection sampling: the policy's own samples, kept if correct, trained with GC = 1."""

    name = "rft"
    data_source = "the current policy's samples, drawn every step, kept if reward >= reward_threshold"
    gc_formula = "1[o kept] = 1[reward(o) >= reward_threshold]"
    default_norm = "token"

    @dataclass
    class Settings(OnPolicy.Settings):
        reward_threshold: float = 0.5
        """A sample is kept (GC = 1) when its reward is at least this."""

    @torch.no_grad()
    def prepare(self, batch: Batch) -> tuple[Batch, Stats]:
        kept = batch.valid.bool() & (batch.rewards >= self.settings.reward_threshold)  # [N]
        batch.kept = kept
        batch.valid = kept
        return batch, {"rft/kept_frac": float(kept.float().mean())}

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        c = self.sampler_correction(batch, logps.detach())  # [B, L], 1 with tis=off; pi_old is pi (one pass)
        return batch.kept.float()[:, None] * batch.loss_mask.float() * c  # [B, L]

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        c = self.sampler_correction(batch, logps.detach())
        return self.aggregate(batch.kept.float()[:, None] * c * logps, batch, Z)


class OfflineRFT(RFT):
    """Rejection sampling, offline (DeepSeekMath 5.2.1's RFT): G samples per training prompt drawn once from the initial
    policy (gcfamily/methods/pools.py), then every step trains on its prompts' samples with RFT's rule, GC = 1[kept].

    The rule, the normaliser and the checks are online RFT's; only the data source differs: the step's samples are
    read from the pool instead of drawn from the current policy. The pool is drawn at the first step (before any
    update) and saved in the run folder (pools/rft-offline.jsonl); `--resume` reads it, and `pool=PATH` trains on
    an earlier run's pool exactly.
    """

    name = "rft-offline"
    data_source = "the initial policy's samples, drawn once: G per training prompt, kept if reward >= reward_threshold"

    @dataclass
    class Settings(RFT.Settings):
        pool: Optional[str] = None
        """The pools/rft-offline.jsonl of an earlier run to train on exactly (same prompts and tokenizer); none: draw the
        pool from this run's initial policy at its first step."""
        pool_prompts: int = 0
        """Training prompts the pool samples G completions of (a seeded choice); 0 = every training prompt."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        if cfg.settings.tis != "off":
            raise GcfError(
                f"{cls.name} trains on a pool drawn once from the initial policy, which keeps no sampler log-probs to "
                f"correct against, so tis={cfg.settings.tis} cannot apply; use tis=off, or --method rft to sample every step."
            )

    def setup(self, services: Services) -> None:
        super().setup(services)  # the prompts, the reward and the sampling settings, as online RFT's
        if self.settings.pool_prompts < 0:
            raise GcfError(f"pool_prompts={self.settings.pool_prompts} must be >= 0 (0 = every training prompt).")
        self.pool: Optional[Pool] = None
        self.resumed = False
        n, k = len(self.prompt_tokens), self.settings.pool_prompts
        self.pool_prompts = sorted(epoch_indices(n, self.cfg.seed, 0, k)) if 0 < k < n else list(range(n))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "pool": self.pool.drawn_for if self.pool is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.resumed = True  # the pool must be this run's own: never redrawn from a trained policy
        check_drawn_for(self._pool(), state.get("pool"), self.name)  # read now: refused before the start commits

    def _pool(self) -> Pool:
        if self.pool is None:
            services, cfg = self.services, self.cfg

            def make() -> Pool:
                prompts = [self.prompt_tokens[i] for i in self.pool_prompts]
                rows = [self.rows[i] for i in self.pool_prompts]
                drawn = draw(
                    services, prompts, rows, cfg.group_size, self.sampling, self.reward_fn, cfg.batch_size, services.say
                )
                drawn.prompt_index = [self.pool_prompts[i] for i in drawn.prompt_index]
                return drawn

            # a pool file read is checked against these prompts: its indices in range, its prompts these
            self.pool = pool_for(services, self.name, self.settings.pool, make, self.resumed, self.prompt_tokens)
            self.pad_id = default_pad_id(services.tokenizer)
            self.samples: dict[int, list[int]] = {}
            for k, p in enumerate(self.pool.prompt_index):
                self.samples.setdefault(p, []).append(k)
            self.order = sorted(self.samples)
        return self.pool

    def data(self, step: int) -> tuple[Batch, Stats]:
        """The step's batch_size prompts of the pool (deterministic in seed and step), all their pooled samples."""
        pool = self._pool()
        prompts = [self.order[i] for i in self.step_indices(len(self.order), step)]
        ks = [k for p in prompts for k in self.samples[p]]
        prompt = [self.prompt_tokens[pool.prompt_index[k]] for k in ks]
        batch: Batch = (
            collate_masked(
                [(p + pool.completion_ids[k], [0] * len(p) + pool.policy_mask[k]) for p, k in zip(prompt, ks)],
                self.pad_id,
            )  # fmt: skip
            if pool.policy_mask  # pooled episodes: the environment's tokens stay off the loss mask
            else collate([(p, pool.completion_ids[k]) for p, k in zip(prompt, ks)], self.pad_id)
        )
        batch.rewards = torch.tensor([pool.rewards[k] for k in ks], dtype=torch.float32)  # [N]
        batch.valid = torch.tensor([pool.valid[k] for k in ks], dtype=torch.bool)  # [N]
        batch.prompt_index = torch.tensor([prompts.index(pool.prompt_index[k]) for k in ks])  # [N]
        batch.completions = [pool.completions[k] for k in ks]
        thr = self.settings.reward_threshold
        kept = sum(1 for k in range(len(pool)) if pool.valid[k] and pool.rewards[k] >= thr)
        return batch, {"rft/pool_samples": float(len(pool)), "rft/pool_kept_frac": kept / max(len(pool), 1)}
