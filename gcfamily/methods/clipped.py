"""The clipped surrogate, written once for GRPO, PPO and their variants, with the parts a variant changes as hooks.

Per token t of output o (to maximise; aggregate is the engine's normalisation):

    J   = aggregate_t[ min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) - beta * KL_t ]
    GC  = g_t A_t 1[not clipped]  -  beta * dKL_t / dlogp_t
    clipped = (A_t > 0 and r_t > 1 + eps_high) or (A_t < 0 and r_t < 1 - eps_low)

Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", arXiv:1912.09729; verl's
clip_ratio_c, OpenRLHF's dual_clip), setting dual_clip = c > 1: for A_t < 0 the per-token term is
max(min(r_t A_t, clip(r_t) A_t), c A_t), so a very unlikely-made token's loss is bounded by -c A_t. Since c > 1,
min(r A, clip(r) A) = r A < c A exactly where r > c, so there the bound binds and GC is 0:

    clipped = ... or (A_t < 0 and r_t > c)

Each part is one hook a variant overrides alone:

    token_advantages(batch)        A_t: GRPO's group-relative A_i, PPO's GAE
    importance_ratio(batch, logps) r_t and its GC factor g_t: pi/pi_old per token; GSPO's sequence ratio
    clip_range()                   (eps_low, eps_high): DAPO's clip-higher
    kl_estimator, kl_placement     settings: k1 | k2 | k3 | k3-importance-weighted, in the loss or the reward

g_t is dr/dlogp_t scaled by (sum of the row's aggregation weights) / w_t, so that the engine's weighted
loss has the objective's gradient: r_t itself for a token ratio, s_i for GSPO's s_i = exp(mean_t log r_t).

With the sampler correction on (setting tis, OnPolicy.sampler_correction), the clipped term of each token is
multiplied by c_t = rho_t truncated or masked (no gradient), and the KL term is not, as TRL 1.16 multiplies its
per-token loss by the ratio before it adds beta * KL (grpo_trainer.py, `_compute_loss`):

    J   = aggregate_t[ c_t min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) - beta * KL_t ]
    GC  = cbar_t g_t A_t 1[not clipped]  -  beta * dKL_t / dlogp_t

cbar_t = c_t for a token ratio; for a sequence ratio, whose one term sits on every token of its row, it is the
row's mean of c (w_t is constant along a row, so d/dlogp_t of sum_u w_u c_u min(s_i A_i, ...) is that mean times
the row's weight). With kl_placement=reward the KL is part of A_t and so is weighed with it.

`objective` states J in textbook form without these helpers' GC code (the exactness suite checks
autograd of it against the engine); a variant that overrides a hook restates `objective` too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from gcfamily.config import Config, resolve_settings
from gcfamily.config.rules import require
from gcfamily.core.engine import effective_mask
from gcfamily.methods.base import Batch
from gcfamily.methods.onpolicy import OnPolicy

KL_ESTIMATORS = ("auto", "k1", "k2", "k3", "k3-importance-weighted")


def kl_value(name: str, log_rho: torch.Tensor, log_r: torch.Tensor) -> torch.Tensor:
    """Schulman's estimators of KL at one token, from log rho = log(pi_ref/pi) and log r = log(pi/pi_old):
    k1 = -log rho, k2 = (log rho)^2 / 2, k3 = rho - log rho - 1, and r * k3 (k3 importance-weighted)."""
    if name == "k1":
        return -log_rho
    if name == "k2":
        return 0.5 * log_rho**2
    k3 = torch.expm1(log_rho) - log_rho  # expm1: k3 ~ (log rho)^2 / 2 does not vanish in float32
    return k3 if name == "k3" else torch.exp(log_r) * k3


def kl_grad(name: str, log_rho: torch.Tensor, inside: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """d KL_t / d logp_t of `kl_value` (d log rho / d logp = -1 inside the clamp, 0 outside; d r / d logp = r)."""
    if name == "k1":
        return inside
    if name == "k2":
        return -log_rho * inside
    dk3 = -torch.expm1(log_rho) * inside  # d(rho - log rho - 1) = (rho - 1) d log rho
    if name == "k3":
        return dk3
    return ratio * (torch.expm1(log_rho) - log_rho) + ratio * dk3


class ClippedOnPolicy(OnPolicy):
    """What GRPO and PPO share: mu passes over minibatches, the clipped surrogate and the KL term."""

    ratio_level: ClassVar[str] = "token"
    """Whether the importance ratio is per token or per sequence (its clip fractions are counted at that level)."""
    metric_prefix: ClassVar[str] = "clipped"
    """Metrics are logged as PREFIX/clip_frac, PREFIX/kl, ..."""
    epsilon_below_one: ClassVar[bool] = True
    """Whether epsilon must be < 1; a rule whose lower clip 1 - epsilon <= 0 means no lower bound (CISPO) allows more."""

    @dataclass
    class Settings(OnPolicy.Settings):
        beta: float = 0.04
        """KL weight: how much of the KL to the frozen reference policy the objective subtracts (0 loads no reference)."""
        epsilon: float = 0.2
        """Clip range of the importance ratio: r is clipped to [1 - epsilon, 1 + epsilon_high]."""
        epsilon_high: Optional[float] = None
        """Upper clip range (DAPO's clip-higher); none means epsilon (symmetric)."""
        mu: int = 1
        """Inner epochs over each batch of rollouts (pi_old is only computed when mu > 1 or num_minibatches > 1)."""
        num_minibatches: int = 1
        """Optimizer steps per inner epoch (the batch is split into this many minibatches)."""
        kl_estimator: str = "auto"
        """KL_t: k1 (log pi/pi_ref), k2 ((log pi/pi_ref)^2 / 2), k3 (rho - log rho - 1, rho = pi_ref/pi), k3-importance-weighted
        (r_t * k3, which estimates KL(pi || pi_ref) from pi_old's samples); auto: k3 in the loss, k1 in the reward."""
        kl_placement: str = "loss"
        """loss: -beta * KL_t is a term of the objective; reward: -beta * KL at pi_old joins the reward before advantages."""
        kl_clamp: Optional[float] = 20.0
        """|log(pi_ref/pi)| beyond this is clamped before exp, in the objective and GC alike (its gradient is 0 there),
        so rho never overflows; none clamps nothing (TRL's default)."""
        off_policy_mask: Optional[float] = None
        """DeepSeek-V3.2's off-policy sequence mask (TRL's off_policy_mask_threshold): a sample with A < 0 whose mean
        log(pi_sampler/pi) over its tokens exceeds this gets no policy-term gradient (its KL term stays); none is off."""
        dual_clip: Optional[float] = None
        """Dual-clip's c > 1 (verl's clip_ratio_c, OpenRLHF's dual_clip): for A < 0 the term is max(clipped surrogate,
        c A), no gradient where r > c; none is off (verl's default is 3.0, on; OpenRLHF's and TRL's is off)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        s = resolve_settings(cfg, cls).settings
        checks = [
            (s.beta >= 0, "beta must be >= 0"),
            (
                0 < s.epsilon and (s.epsilon < 1 or not cls.epsilon_below_one),
                "epsilon must be in (0, 1)" if cls.epsilon_below_one else "epsilon must be > 0",
            ),
            (s.epsilon_high is None or s.epsilon_high > 0, "epsilon_high must be > 0"),
            (s.mu >= 1, "mu (inner epochs) must be >= 1"),
            (s.num_minibatches >= 1, "num_minibatches must be >= 1"),
            (s.kl_clamp is None or s.kl_clamp > 0, "kl_clamp must be > 0 or none"),
            (s.dual_clip is None or s.dual_clip > 1, "dual_clip must be > 1 or none"),
            (s.kl_estimator in KL_ESTIMATORS, f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}"),
            (s.kl_placement in ("loss", "reward"), "kl_placement must be loss or reward"),
            (
                not (s.kl_placement == "reward" and s.kl_estimator == "k3-importance-weighted"),
                "k3-importance-weighted weighs by the ratio to pi_old, which is 1 in the reward; use it with kl_placement=loss",
            ),
        ]
        require(checks)

    # -- settings read by the rule ---------------------------------------------------
    @property
    def kl_clamp(self) -> float:
        """The clamp of |log(pi_ref/pi)|; infinite when the setting is none."""
        return math.inf if self.settings.kl_clamp is None else self.settings.kl_clamp

    @property
    def kl_name(self) -> str:
        """The estimator in use (auto resolved by placement)."""
        s = self.settings
        return s.kl_estimator if s.kl_estimator != "auto" else ("k1" if s.kl_placement == "reward" else "k3")

    def inner_epochs(self) -> int:
        return self.settings.mu

    def num_minibatches(self) -> int:
        return self.settings.num_minibatches

    # -- the hooks -------------------------------------------------------------------
    def token_advantages(self, batch: Batch) -> torch.Tensor:
        """A_t, broadcastable to [B, L]."""
        raise NotImplementedError

    def importance_ratio(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(r [B, L], its GC factor g [B, L]): pi/pi_old per token, g = r. With one pass over one minibatch
        pi_old is the current policy (no old_logps were computed) and r is exactly 1."""
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        ratio = torch.exp(logps - old)  # [B, L]
        return ratio, ratio

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) of the ratio's clip; symmetric unless epsilon_high is set."""
        s = self.settings
        return s.epsilon, (s.epsilon_high if s.epsilon_high is not None else s.epsilon)

    def clipped(self, ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        """Where min() picks the clipped branch, or dual-clip's bound c A binds (A < 0, r > c): the gradient is 0."""
        lo, hi = self.clip_range()
        out = ((adv > 0) & (ratio > 1 + hi)) | ((adv < 0) & (ratio < 1 - lo))
        c = self.settings.dual_clip
        return out if c is None else out | ((adv < 0) & (ratio > c))

    def kl_in_loss(self, batch: Batch) -> bool:
        return self.settings.beta > 0 and self.settings.kl_placement == "loss" and batch.ref_logps is not None

    def old_and_ref_logps(self, batch: Batch) -> Optional[torch.Tensor]:
        """pi_old's and pi_ref's log-probs of a rollout, at the sampling temperature, without grad.

        With one pass over one minibatch pi_old == pi at the moment of the step, so no forward is spent on it and
        `coefficient` uses the detached current log-probs (ratio exactly 1); the KL-in-reward still needs pi_old's
        log-probs, which are then that same forward's. Sets batch.old_logps (several passes) and batch.ref_logps
        (a reference), both [N, L]; returns pi_old's [N, L] where it was computed, else None."""
        services, T = self.services, self.logprob_temperature()
        several = self.inner_epochs() > 1 or self.num_minibatches() > 1
        in_reward = self.settings.kl_placement == "reward" and self.ref is not None
        old = services.logprobs(services.policy(), batch, T) if several or in_reward else None
        if several:
            batch.old_logps = old
        if self.ref is not None:
            batch.ref_logps = services.logprobs(self.ref, batch, T)
        return old

    def kl_reward(self, ref_logps: torch.Tensor, old_logps: torch.Tensor) -> torch.Tensor:
        """KL_t at pi_old (no grad) for kl_placement=reward, [B, L]: what -beta * ... adds to the reward."""
        log_rho = (ref_logps - old_logps).clamp(-self.kl_clamp, self.kl_clamp)
        return kl_value(self.kl_name, log_rho, torch.zeros_like(log_rho))

    # -- coefficient and objective ---------------------------------------------------
    def coefficient(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        adv = self.token_advantages(batch)  # [B, 1] or [B, L]
        ratio, factor = self.importance_ratio(batch, logps)  # [B, L]
        c = self.policy_weight(batch, logps)  # [B, L], 1 with tis off and no off-policy mask
        if self.ratio_level == "sequence":  # the row's one clipped term carries every token's c: its mean (above)
            m = batch.loss_mask.to(c.dtype)
            c = ((c * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(c)
        coef = torch.where(self.clipped(ratio, adv), 0.0, factor * adv * c)  # [B, L]
        if self.kl_in_loss(batch):
            d = batch.ref_logps - logps
            inside = (d.abs() <= self.kl_clamp).to(logps.dtype)  # the clamp's gradient is 0 outside
            log_rho = d.clamp(-self.kl_clamp, self.kl_clamp)
            coef = coef - self.settings.beta * kl_grad(
                self.kl_name, log_rho, inside, torch.exp(logps - self._old(batch, logps))
            )
        return coef * batch.loss_mask

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        adv = self.token_advantages(batch)
        log_r = logps - self._old(batch, logps)
        ratio = torch.exp(log_r)
        lo, hi = self.clip_range()
        per_token = torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv)
        if self.settings.dual_clip is not None:  # max(., c A) for A < 0 only
            per_token = torch.where(adv < 0, torch.maximum(per_token, self.settings.dual_clip * adv), per_token)
        per_token = per_token * self.policy_weight(batch, logps)
        if self.kl_in_loss(batch):
            log_rho = (batch.ref_logps - logps).clamp(-self.kl_clamp, self.kl_clamp)
            per_token = per_token - self.settings.beta * kl_value(self.kl_name, log_rho, log_r)
        return self.aggregate(per_token * batch.loss_mask, batch, Z)

    def policy_weight(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        """[B, L], no gradient: what multiplies each token's policy term (never the KL term): the sampler correction
        (tis) times the off-policy mask."""
        return self.sampler_correction(batch, self._old(batch, logps)) * self.off_policy_keep(batch, logps)

    def off_policy_keep(self, batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        """1 or 0 per row (or per token for per-token advantages) [B, 1]: 0 where A < 0 and the row's mean
        log(pi_sampler/pi_now) is above off_policy_mask (the sampler's log-probs, or pi_old's where the batch has
        none, as TRL without vLLM); 1 everywhere when the setting is off."""
        delta = self.settings.off_policy_mask
        if delta is None:
            return torch.ones_like(logps[:, :1])
        mask = batch.loss_mask.to(logps.dtype)
        sampler = batch.sample_logps if batch.sample_logps is not None else self._old(batch, logps)
        kl = ((sampler - logps.detach()) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        return ((self.token_advantages(batch) >= 0) | (kl <= delta)).to(logps.dtype)

    @staticmethod
    def _old(batch: Batch, logps: torch.Tensor) -> torch.Tensor:
        return batch.old_logps if batch.old_logps is not None else logps.detach()

    # -- logging ---------------------------------------------------------------------
    def metrics(self, batch: Batch, logps: torch.Tensor, coef: torch.Tensor) -> dict[str, float]:
        """Clip fractions at the ratio's level (tokens, or sequences), |A|, the mean k3 KL to the reference, and the
        sampler/trainer mismatch (OnPolicy.metrics)."""
        p = self.metric_prefix
        mask = effective_mask(batch).bool()  # [B, L]
        n = max(int(mask.sum()), 1)
        adv = self.token_advantages(batch).expand_as(logps)
        ratio, _ = self.importance_ratio(batch, logps)
        lo, hi = self.clip_range()
        low, high = (adv < 0) & (ratio < 1 - lo) & mask, (adv > 0) & (ratio > 1 + hi) & mask
        if self.ratio_level == "sequence":  # one ratio per row: count rows
            rows = mask.any(-1)
            n_rows = max(int(rows.sum()), 1)
            low, high = low.any(-1), high.any(-1)
            clip = {
                f"{p}/seq_clip_frac": float((low | high).sum()) / n_rows,
                f"{p}/seq_clip_low_frac": float(low.sum()) / n_rows,
                f"{p}/seq_clip_high_frac": float(high.sum()) / n_rows,
            }
        else:
            clip = {
                f"{p}/clip_frac": float((low | high).sum()) / n,
                f"{p}/clip_low_frac": float(low.sum()) / n,
                f"{p}/clip_high_frac": float(high.sum()) / n,
            }
        out = {**super().metrics(batch, logps, coef), **clip, f"{p}/adv_abs_mean": float(adv.abs()[mask].sum()) / n}
        if self.settings.dual_clip is not None:  # tokens (or a sequence ratio's tokens) where the bound c A binds
            out[f"{p}/dual_clip_frac"] = float(((adv < 0) & (ratio > self.settings.dual_clip) & mask).sum()) / n
        if batch.ref_logps is not None:
            d = (batch.ref_logps - logps).double()  # float64 and expm1: k3 ~ d^2/2 vanishes in float32
            out[f"{p}/kl"] = float((torch.expm1(d) - d)[mask].sum()) / n  # mean k3 over the step's tokens
        return out
