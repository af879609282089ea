"""GRPO: group-relative advantages, a clipped ratio against pi_old, and k3 KL to a frozen reference.

Objective (DeepSeekMath, Shao et al. 2024, section 4; the chapter's J^GRPO), maximised:

    J    = aggregate_t[ min(r_t A_i, clip(r_t, 1 - eps, 1 + eps_high) A_i) - beta * k3_t ]
    r_t  = pi(o_t) / pi_old(o_t)
    A_i  = (R_i - mean(R)) / (std(R) + std_eps) over the G samples of o_i's prompt (0 if the G rewards are equal)
    k3_t = rho - log rho - 1,   rho = pi_ref(o_t) / pi(o_t)

Coefficient, dJ/dlogp_t at the current log-probs (divided by the aggregation weight w_t):

    GC = r_t * A_i * 1[not clipped] + beta * (rho - 1)
    clipped = (A_i > 0 and r_t > 1 + eps_high) or (A_i < 0 and r_t < 1 - eps)

aggregate is the engine's normalisation: by default "sequence" (1/|o_i| per token, then the mean
over the samples of the step), the chapter's 1/G sum_i 1/|o_i| sum_t. The clipped surrogate and the
KL term are methods/clipped.py's; GRPO adds the group-relative advantage, as hooks a variant overrides:
`group_advantages` (the estimator), `equal_reward_groups` (which groups get no gradient), and the
settings scale_rewards (group | batch | none), std, std_eps, zero_std.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from einops import rearrange, repeat

from gcfamily.config import Config
from gcfamily.config.rules import require
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch, Stats
from gcfamily.methods.clipped import ClippedOnPolicy
from gcfamily.methods.onpolicy import all_equal_groups, masked_group_stats
from gcfamily.methods.services import Services


class GRPO(ClippedOnPolicy):
    """Group Relative Policy Optimization; subclass and override one function for a variant."""

    name = "grpo"
    data_source = "on-policy groups of G outputs per prompt"
    gc_formula = "r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1),  A_i = (R_i - mean R) / std R over the group"
    default_norm = "sequence"
    metric_prefix = "grpo"
    min_group_size: ClassVar[int] = 2
    """The smallest G the advantage is defined for (a variant with a baseline of its own may take 1)."""

    @dataclass
    class Settings(ClippedOnPolicy.Settings):
        ref_refresh_every: int = 0
        """Copy the policy into the reference every this many steps (0 = never)."""
        ref_mixup_alpha: float = 1.0
        """ref_refresh_every's update, TRL's ref_model_mixup_alpha: pi_ref's parameters become alpha * the policy's +
        (1 - alpha) * their own (1: a copy)."""
        zero_std: str = "keep"
        """Groups whose rewards are all equal (advantage 0): keep their tokens in the normaliser, or exclude them."""
        std: str = "sample"
        """Std of the advantages' scale: sample (torch's default, 1/(G-1)) or population (1/G)."""
        scale_rewards: str = "group"
        """Divide R_i - mean(group) by the group's std (group), by the std of every reward of the step (batch, over all
        processes), or by nothing (none: Dr. GRPO's and grpo-shift's advantage)."""
        std_eps: float = 0.0
        """Added to the std before dividing (TRL adds 1e-4); 0 divides by the std itself."""
        reward_aggregation: str = "sum_then_normalize"
        """Several rewards: sum_then_normalize (the weighted sum is the reward) or normalize_then_sum (TRL's
        multi_objective_aggregation, GDPO's idea: each reward z-scored in its group, (r_k - mean) / (std + std_eps),
        then weighted and summed; needs scale_rewards=batch, which re-scales the sums over the step)."""
        mask_truncated: bool = False
        """TRL's mask_truncated_completions (DAPO's overlong filtering): a completion that hit max_new_tokens without
        EOS or a stop string trains no token, but its reward stays in its group's mean and std, and in Z it counts as
        the aggregation says (a sequence in sequence / sum / constant, no tokens in token)."""

    # -- lifecycle -------------------------------------------------------------------
    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        s = cfg.settings
        require(
            [
                (s.zero_std in ("keep", "exclude"), "zero_std must be keep or exclude"),
                (s.ref_refresh_every >= 0, "ref_refresh_every must be >= 0"),
                (0 < s.ref_mixup_alpha <= 1, "ref_mixup_alpha must be in (0, 1]"),
                (
                    s.ref_mixup_alpha == 1 or cfg.strategy != "fsdp2",
                    "ref_mixup_alpha < 1 mixes whole parameters, which FSDP2 shards (not built); use strategy=ddp",
                ),
                (s.std in ("sample", "population"), "std must be sample or population"),
                (s.scale_rewards in ("group", "batch", "none"), "scale_rewards must be group, batch or none"),
                (s.std_eps >= 0, "std_eps must be >= 0"),
                (
                    s.reward_aggregation in ("sum_then_normalize", "normalize_then_sum"),
                    "reward_aggregation must be sum_then_normalize or normalize_then_sum",
                ),
                (
                    s.reward_aggregation == "sum_then_normalize" or s.scale_rewards == "batch",
                    "reward_aggregation=normalize_then_sum re-scales the summed z-scores over the step: set scale_rewards=batch",
                ),
                (
                    s.reward_aggregation == "sum_then_normalize" or s.kl_placement == "loss" or s.beta == 0,
                    "reward_aggregation=normalize_then_sum has no reward for the KL to join: use kl_placement=loss",
                ),
            ]
        )
        if cfg.group_size < cls.min_group_size:
            raise GcfError(
                f"{cls.name} needs group_size >= {cls.min_group_size}: a group-relative advantage compares each sample with the others of its group."
            )

    def setup(self, services: Services) -> None:
        super().setup(services)
        # No reference model at all when its KL term is not in the loss.
        self.ref = services.reference() if self.settings.beta > 0 else None
        self.ref_refreshes = 0

    # -- the advantage, as small functions a variant overrides one of ------------------
    def group_advantages(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """A [n, G] from rewards [n, G]: (R_i - mean) / (std + std_eps) over the valid samples of each group."""
        s = self.settings
        mean, std, _ = masked_group_stats(rewards, valid, unbiased=s.std == "sample")
        centred = rewards.double() - mean[:, None]  # [n, G]
        if s.scale_rewards == "none":
            return torch.where(valid, centred, 0.0).float()
        scale = std[:, None] if s.scale_rewards == "group" else self._batch_std(rewards, valid).expand_as(centred)
        scale = scale + s.std_eps
        adv = centred / torch.where(scale > 0, scale, 1.0)  # std 0 (all equal): the advantage is 0, no division
        return torch.where(valid & (scale > 0), adv, 0.0).float()

    def _batch_std(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The std of every valid reward of the step, over all processes (scale_rewards=batch), as a [1, 1] tensor."""
        r, v = rewards.double()[valid], valid.sum().double()
        total = self.services.all_sum(torch.stack([v, r.sum(), (r * r).sum()]))
        n, mean = total[0], total[1] / total[0].clamp(min=1)
        dof = n - 1 if self.settings.std == "sample" else n
        var = (total[2] - n * mean * mean) / dof.clamp(min=1)
        return var.clamp(min=0).sqrt().reshape(1, 1) if dof > 0 else torch.zeros(1, 1, dtype=torch.float64)

    def equal_reward_groups(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[n] bool: groups that get no gradient (advantage 0; with zero_std=exclude, out of the normaliser too):
        those whose valid rewards are all equal. A variant whose advantage does not vanish there returns none."""
        return all_equal_groups(rewards, valid)

    def token_advantages(self, batch: Batch) -> torch.Tensor:
        return batch.advantages[:, None].float()  # [B, 1]

    # -- prepare ---------------------------------------------------------------------
    def add_advantages(self, batch: Batch) -> tuple[Batch, Stats]:
        """advantages [N], equal-reward groups handled per zero_std, and their fraction logged."""
        G = self.cfg.group_size
        rewards = rearrange(batch.rewards.float(), "(n g) -> n g", g=G)  # [n, G]
        if self.settings.reward_aggregation == "normalize_then_sum":
            rewards = self.normalized_sum(batch)
        if batch.kl_rewards is not None:  # kl_placement=reward: -beta * sum_t KL_t at pi_old joins each sample's reward
            rewards = rewards - self.settings.beta * rearrange(batch.kl_rewards.float(), "(n g) -> n g", g=G)
        valid = rearrange(batch.valid.bool(), "(n g) -> n g", g=G)  # [n, G]
        equal = self.equal_reward_groups(rewards, valid)  # [n]
        adv = self.group_advantages(rewards, valid).masked_fill(equal[:, None] | ~valid, 0.0)  # [n, G]
        batch.advantages = rearrange(adv, "n g -> (n g)")  # [N]
        if self.settings.zero_std == "exclude":  # their tokens leave the normaliser as well as the gradient
            batch.valid = batch.valid.bool() & ~repeat(equal, "n -> (n g)", g=G)
        return batch, {f"{self.metric_prefix}/zero_std_frac": float(equal.float().mean())}

    def normalized_sum(self, batch: Batch) -> torch.Tensor:
        """[n, G]: sum_k w_k (r_k - mean_k) / (std_k + std_eps), each reward's statistics over its group's valid samples
        (a group whose r_k are all equal adds 0 for it), w the reward_weights (1 each when unset)."""
        G, s = self.cfg.group_size, self.settings
        if batch.reward_parts is None:
            raise GcfError("reward_aggregation=normalize_then_sum needs each reward's own value; this batch has none.")
        parts = rearrange(batch.reward_parts.double(), "(n g) k -> n g k", g=G)  # [n, G, K]
        valid = rearrange(batch.valid.bool(), "(n g) -> n g", g=G)
        weights = self.cfg.reward_weights or [1.0] * parts.shape[-1]
        out = torch.zeros(parts.shape[:2], dtype=torch.float64)
        for k, w in enumerate(weights):
            mean, std, _ = masked_group_stats(parts[..., k], valid, unbiased=s.std == "sample")
            scale = (std + s.std_eps)[:, None]
            out += float(w) * torch.where(scale > 0, (parts[..., k] - mean[:, None]) / scale.clamp(min=1e-300), 0.0)
        return out.float()

    @torch.no_grad()
    def prepare(self, batch: Batch) -> tuple[Batch, Stats]:
        stats: Stats = {}
        if self.settings.mask_truncated and batch.truncated is not None:  # before every term that reads the mask
            batch.loss_mask = batch.loss_mask * ~batch.truncated[:, None]
            stats[f"{self.metric_prefix}/masked_truncated"] = float(batch.truncated.sum())
        old = self.old_and_ref_logps(batch)  # [N, L] or None
        if self.settings.kl_placement == "reward" and self.ref is not None:
            kl = self.kl_reward(batch.ref_logps, old) * batch.loss_mask  # [N, L]
            batch.kl_rewards = kl.sum(-1)  # [N] the sequence's KL estimate at pi_old
            stats[f"{self.metric_prefix}/kl_reward_mean"] = float(batch.kl_rewards.mean())
        batch, more = self.add_advantages(batch)
        return batch, {**stats, **more, **self.prepared_mismatch(batch)}  # the mismatch: here when pi_old was computed

    # -- reference refresh, state ----------------------------------------------------
    def after_step(self, step: int) -> dict[str, float]:
        K = self.settings.ref_refresh_every
        if self.ref is None or not K:
            return {}
        if step % K == 0:
            mix_reference(self.ref, self.services.policy(), self.settings.ref_mixup_alpha)
            self.ref_refreshes += 1
        return {f"{self.metric_prefix}/ref_refreshes": float(self.ref_refreshes)}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"ref_refreshes": self.ref_refreshes}
        if self.ref is not None and self.ref_refreshes:  # otherwise the reference is the initial model
            state["ref"] = {k: v.detach().cpu().clone() for k, v in self.ref.state_dict().items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ref_refreshes = int(state.get("ref_refreshes", 0))
        if "ref" in state and self.ref is not None:
            self.ref.load_state_dict(state["ref"])


@torch.no_grad()
def mix_reference(ref: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """pi_ref <- alpha * policy + (1 - alpha) * pi_ref, parameter by parameter (TRL's SyncRefModelCallback); alpha = 1
    copies the whole state (buffers too)."""
    if alpha == 1:
        ref.load_state_dict(policy.state_dict())
        return
    for (name, r), (other, p) in zip(ref.named_parameters(), policy.named_parameters(), strict=True):
        assert name == other, (name, other)  # pi_ref is a copy of the policy: one layout
        r.mul_(1.0 - alpha).add_(p, alpha=alpha)
