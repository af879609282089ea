"""GRPO: group-relative advantages, a clipped ratio against pi_old, and k3 KL to a frozen reference.

Objective (DeepSeekMath, Shao et al. 2024, section 4; the chapter's J^GRPO), maximised:

    J    = aggregate_t[ min(r_t A_i, clip(r_t, 1 - eps, 1 + eps_high) A_i) - beta * k3_t ]
    r_t  = pi(o_t) / pi_old(o_t)
    A_i  = (R_i - mean(R)) / std(R) over the G samples of o_i's prompt (0 if the G rewards are equal)
    k3_t = rho - log rho - 1,   rho = pi_ref(o_t) / pi(o_t)

Coefficient, dJ/dlogp_t at the current log-probs (divided by the aggregation weight w_t):

    GC = r_t * A_i * 1[not clipped] + beta * (rho - 1)
    clipped = (A_i > 0 and r_t > 1 + eps_high) or (A_i < 0 and r_t < 1 - eps)

aggregate is the engine's normalisation: by default "sequence" (1/|o_i| per token, then the mean
over the samples of the step), the chapter's 1/G sum_i 1/|o_i| sum_t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange, repeat

from gcfamily.config import Config
from gcfamily.engine import effective_mask
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch
from gcfamily.methods.onpolicy import ClippedOnPolicy, all_equal_groups, masked_group_stats


class GRPO(ClippedOnPolicy):
    """Group Relative Policy Optimization; subclass and override one function for a variant."""

    name = "grpo"
    data_source = "on-policy groups of G outputs per prompt"
    gc_formula = "r_t * A_i * 1[not clipped] + beta * (pi_ref/pi - 1),  A_i = (R_i - mean R) / std R over the group"
    default_norm = "sequence"

    @dataclass
    class Settings(ClippedOnPolicy.Settings):
        ref_refresh_every: int = 0
        """Copy the policy into the reference every this many steps (0 = never)."""
        zero_std: str = "keep"
        """Groups whose rewards are all equal (advantage 0): keep their tokens in the normaliser, or exclude them."""
        std: str = "sample"
        """Group std of the advantages: sample (torch's default, 1/(G-1)) or population (1/G)."""

    # -- lifecycle -------------------------------------------------------------------
    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        s = cfg.settings
        for ok, msg in [(s.zero_std in ("keep", "exclude"), "zero_std must be keep or exclude"), (s.ref_refresh_every >= 0, "ref_refresh_every must be >= 0"),
                        (s.std in ("sample", "population"), "std must be sample or population")]:
            if not ok:
                raise GcfError(f"Invalid setting: {msg}.")
        if cfg.group_size < 2:
            raise GcfError(f"{cls.name} needs group_size >= 2: a group-relative advantage compares each sample with the others of its group.")

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        # No reference model at all when its KL term is not in the loss.
        self.ref = trainer.reference() if self.cfg.beta > 0 else None
        self.ref_refreshes = 0

    # -- the rule, as small functions a variant overrides one of ----------------------
    def group_advantages(self, rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """A [n, G] from rewards [n, G]: (R_i - mean) / std over the valid samples of each group."""
        mean, std, _ = masked_group_stats(rewards, valid, unbiased=self.cfg.std == "sample")
        equal = all_equal_groups(rewards, valid)[:, None]  # [n, 1] std == 0: advantage 0, no division
        adv = (rewards.double() - mean[:, None]) / torch.where(equal, 1.0, std[:, None].double())
        return adv.masked_fill(equal | ~valid, 0.0).float()

    # -- prepare, coefficient, objective ---------------------------------------------
    def add_advantages(self, batch: Batch) -> Batch:
        """advantages [N], zero-std groups handled per cfg.zero_std, and their fraction logged."""
        G = self.cfg.group_size
        rewards = rearrange(batch["rewards"].float(), "(n g) -> n g", g=G)  # [n, G]
        valid = rearrange(batch["valid"].bool(), "(n g) -> n g", g=G)  # [n, G]
        equal = all_equal_groups(rewards, valid)  # [n]
        adv = self.group_advantages(rewards, valid).masked_fill(equal[:, None] | ~valid, 0.0)  # [n, G]
        batch["advantages"] = rearrange(adv, "n g -> (n g)")  # [N]
        if self.cfg.zero_std == "exclude":  # their tokens leave the normaliser as well as the gradient
            batch["valid"] = batch["valid"].bool() & ~repeat(equal, "n -> (n g)", g=G)
        batch["stat/grpo/zero_std_frac"] = float(equal.float().mean())
        return batch

    @torch.no_grad()
    def prepare(self, batch: Batch) -> Batch:
        batch = self.add_advantages(batch)
        tr, T = self.trainer, self.logprob_temperature()
        # With one pass over one minibatch pi_old == pi at the moment of the step: no forward is
        # spent on it and `coefficient` uses the detached current log-probs (ratio exactly 1).
        if self.inner_epochs() > 1 or self.num_minibatches() > 1:
            batch["old_logps"] = tr.logprobs(tr.unwrapped_policy(), batch, T)  # [N, L]
        if self.ref is not None:
            batch["ref_logps"] = tr.logprobs(self.ref, batch, T)  # [N, L]
        return batch

    def _ratio(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()
        return torch.exp(logps - old)  # [B, L]

    def _kl_log_ratio(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor | None:
        if self.cfg.beta <= 0 or "ref_logps" not in batch:
            return None
        return (batch["ref_logps"] - logps).clamp(-self.kl_clamp, self.kl_clamp)  # [B, L] log rho

    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        adv = batch["advantages"][:, None].float()  # [B, 1]
        ratio = self._ratio(batch, logps)  # [B, L]
        coef = torch.where(self.clipped(ratio, adv) | (adv == 0), 0.0, ratio * adv)  # [B, L]
        log_rho = self._kl_log_ratio(batch, logps)
        if log_rho is not None:
            inside = (batch["ref_logps"] - logps).abs() <= self.kl_clamp  # the clamp's gradient is 0 outside
            coef = coef + self.cfg.beta * torch.expm1(log_rho) * inside  # beta (rho - 1)
        return coef * batch["loss_mask"]

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        adv = batch["advantages"][:, None].float()  # [B, 1]
        ratio = self._ratio(batch, logps)  # [B, L]
        lo, hi = self.clip_range()
        per_token = torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv)
        log_rho = self._kl_log_ratio(batch, logps)
        if log_rho is not None:
            per_token = per_token - self.cfg.beta * (torch.expm1(log_rho) - log_rho)  # k3 = rho - log rho - 1
        return self.aggregate(per_token, batch, Z)

    # -- logging, reference refresh, state -------------------------------------------
    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        mask = effective_mask(batch).bool()
        n = max(int(mask.sum()), 1)
        adv = batch["advantages"][:, None].float().expand_as(logps)
        ratio = self._ratio(batch, logps)
        lo, hi = self.clip_range()
        low = (adv < 0) & (ratio < 1 - lo) & mask
        high = (adv > 0) & (ratio > 1 + hi) & mask
        out = {"grpo/clip_frac": float((low | high).sum()) / n, "grpo/clip_low_frac": float(low.sum()) / n,
               "grpo/clip_high_frac": float(high.sum()) / n, "grpo/adv_abs_mean": float(adv.abs()[mask].sum()) / n}
        if "ref_logps" in batch:
            d = (batch["ref_logps"] - logps).double()  # float64 and expm1: k3 ~ d^2/2 vanishes in float32
            out["grpo/kl"] = float((torch.expm1(d) - d)[mask].sum()) / n  # mean k3 over the step's tokens
        return out

    def after_step(self, step: int) -> dict[str, float]:
        K = self.cfg.ref_refresh_every
        if self.ref is None or not K:
            return {}
        if step % K == 0:
            self.ref.load_state_dict(self.trainer.unwrapped_policy().state_dict())
            self.ref_refreshes += 1
        return {"grpo/ref_refreshes": float(self.ref_refreshes)}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"ref_refreshes": self.ref_refreshes}
        if self.ref is not None and self.ref_refreshes:  # otherwise the reference is the initial model
            state["ref"] = {k: v.detach().cpu().clone() for k, v in self.ref.state_dict().items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ref_refreshes = int(state.get("ref_refreshes", 0))
        if "ref" in state and self.ref is not None:
            self.ref.load_state_dict(state["ref"])
