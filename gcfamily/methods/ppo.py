"""PPO with a learned critic: GAE on a value model, the clipped surrogate, a clipped value loss.

Objective (Schulman et al. 2017, arXiv:1707.06347, eq. 7, in the RLHF form of Ouyang et al. 2022,
InstructGPT, arXiv:2203.02155), maximised:

    J     = aggregate_t[ min(r_t A_t, clip(r_t, 1 - eps, 1 + eps_high) A_t) - beta * k3_t ]
    r_t   = pi(o_t) / pi_old(o_t)
    k3_t  = rho - log rho - 1,  rho = pi_ref(o_t) / pi(o_t)        (KL in the loss: beta > 0, kl_placement=loss)

A_t is GAE (Schulman et al. 2016, arXiv:1506.02438) over the completion tokens, on per-token rewards

    rwd_t   = R * 1[t is the last completion token]  - beta * KL_t(pi_old) * 1[kl_placement=reward]  (k1 by default:
              InstructGPT's log(pi_old/pi_ref)(o_t))
    delta_t = rwd_t + gamma * V_{t+1} - V_t           (V after the last token is 0: the episode ends)
    A_t     = delta_t + gamma * lam * A_{t+1},   returns_t = A_t + V_t

then whitened over the step's valid tokens. V_t = V(q, o_<t) comes from the critic, a second network
(the policy's backbone + a scalar head, its own optimizer) trained through `auxiliary_step` on

    critic_loss = vf_coef * mean_t max((V_t - returns_t)^2, (clip(V_t, V_old - c, V_old + c) - returns_t)^2)

Coefficient, dJ/dlogp_t at the current log-probs (per aggregation weight):

    GC = r_t * A_t * 1[not clipped] + beta * (rho - 1)
    clipped = (A_t > 0 and r_t > 1 + eps_high) or (A_t < 0 and r_t < 1 - eps)

The clipped surrogate and the KL term (estimator and placement) are methods/clipped.py's, shared with GRPO.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from gcfamily.config import Config
from gcfamily.config.rules import require
from gcfamily.core.engine import build_optimizer, effective_mask, second_model_step
from gcfamily.core.memory import module_mb
from gcfamily.core.packing import backbone_hidden
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch, Stats
from gcfamily.methods.clipped import ClippedOnPolicy
from gcfamily.methods.services import Services
from gcfamily.models import load_model, lora

# ----------------------------------------------------------------------------------
# the critic and the advantage estimator, as plain functions and one module


class ValueModel(nn.Module):
    """V(q, o_<t): a transformer backbone and a scalar head, values aligned with tokens like logps."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)  # float32 whatever the backbone's dtype
        nn.init.zeros_(self.head.weight)  # V = 0 at the start: the first baseline is no baseline
        nn.init.zeros_(self.head.bias)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """values[b, t] = V of the state that emits token t, read at position t-1 (0 at t = 0).

        With `loss_mask` the backbone runs packed like the policy's (a shared prompt once, no
        padding), and values before the first loss column of the batch are 0 (nothing reads them).
        """
        lm = loss_mask if loss_mask is not None else torch.ones_like(attention_mask)
        # [B, L - S, H]
        hidden, S = backbone_hidden(self.backbone, input_ids, attention_mask, lm, share_prefix=loss_mask is not None)
        v = self.head(hidden[:, :-1].to(self.head.weight.dtype)).squeeze(-1)  # [B, L - S - 1]
        return torch.cat([v.new_zeros(v.shape[0], S + 1), v], dim=1)  # [B, L]


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, L] by GAE over each row's masked positions, right to left; 0 elsewhere.

    The masked positions of a row are its completion tokens, wherever the padding puts them; the
    state after the last one is terminal (V = 0), and the positions between them are skipped.
    """
    B, L = values.shape
    m = mask.bool()
    adv = torch.zeros_like(values)  # [B, L]
    next_adv = values.new_zeros(B)  # [B] A_{t+1}
    next_value = values.new_zeros(B)  # [B] V_{t+1}
    for t in reversed(range(L)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m[:, t], a, 0.0)
        next_adv = torch.where(m[:, t], a, next_adv)
        next_value = torch.where(m[:, t], values[:, t], next_value)
    return adv, (adv + values) * m


def whiten(
    x: torch.Tensor, mask: torch.Tensor, all_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """(x - mean) / std over the masked entries (sample std), 0 elsewhere; unchanged but centred if fewer than 2.

    With `all_sum` (a sum over the processes, DistEnv.all_sum) the mean and std are those of every
    process's entries together, so N processes whiten exactly as one process with the whole batch.
    """
    m = mask.bool()
    v = x[m].double()
    total = torch.stack([v.new_tensor(float(v.numel())), v.sum()])
    if all_sum is not None:
        total = all_sum(total)
    n = int(total[0])
    if n == 0:
        return torch.zeros_like(x)
    mean = total[1] / n
    sq = ((v - mean) ** 2).sum().reshape(1)
    if all_sum is not None:
        sq = all_sum(sq)
    std = (sq[0] / (n - 1)).sqrt() if n > 1 else mean.new_ones(())
    return torch.where(m, ((x.double() - mean) / (std + 1e-8)).to(x.dtype), 0.0)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked tokens: 1 is a perfect critic, <= 0 a useless one."""
    m = mask.bool()
    var = returns[m].double().var() if int(m.sum()) > 1 else torch.zeros((), dtype=torch.float64)
    if float(var) == 0.0:
        return math.nan
    return float(1 - (returns[m] - values[m]).double().var() / var)


def value_loss_terms(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss max((V-R)^2, (clip(V, V_old-c, V_old+c)-R)^2) and where the clipped term wins."""
    unclipped = (values - returns) ** 2
    if clip <= 0:
        return unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    return torch.maximum(unclipped, clipped), clipped > unclipped


# ----------------------------------------------------------------------------------
# the method


class PPO(ClippedOnPolicy):
    """PPO with a critic (Schulman et al. 2017; Ouyang et al. 2022): GC = r_t * A_t * 1[not clipped], A_t by GAE."""

    name = "ppo"
    data_source = (
        "the policy's own samples (G per prompt), scored by the reward; a learned critic supplies the baseline"
    )
    gc_formula = "r_t * A_t * 1[not clipped] (+ beta * (pi_ref/pi - 1) unless kl_placement=reward),  A_t = GAE(gamma, lam) on a learned value model"
    default_norm = "token"
    metric_prefix = "ppo"

    @dataclass
    class Settings(ClippedOnPolicy.Settings):
        gamma: float = 1.0
        """Discount of GAE."""
        lam: float = 0.95
        """lambda of GAE."""
        vf_coef: float = 0.5
        """Weight of the critic's loss."""
        value_clip: float = 0.2
        """Clip range of the value loss (0 turns the value clip off)."""
        whiten: bool = True
        """Whiten the GAE advantages over the step's valid tokens (mean 0, std 1, across every rank)."""
        critic_lr: float = 1e-5
        """Learning rate of the critic."""
        critic_model: Optional[str] = None
        """Model of the critic (alias or folder, same tokenizer as the policy); none: the policy's backbone (with LoRA, adapters
        of its own over the policy's frozen base)."""

    @classmethod
    def validate(cls, cfg: Config) -> None:
        super().validate(cfg)
        s = cfg.settings
        require(
            [
                (0 <= s.gamma <= 1, "gamma must be in [0, 1]"),
                (0 <= s.lam <= 1, "lam must be in [0, 1]"),
                (s.vf_coef > 0, "vf_coef must be > 0"),
                (s.critic_lr > 0, "critic_lr must be > 0"),
                (s.value_clip >= 0, "value_clip must be >= 0 (0 turns the value clip off)"),
            ]
        )

    def setup(self, services: Services) -> None:
        super().setup(services)
        cfg = self.cfg
        self.ref = services.reference() if self.settings.beta > 0 else None
        self.critic = self.build_critic(services)
        self.critic_optimizer = build_optimizer(
            self.critic.parameters(), self.settings.critic_lr, cfg.weight_decay, tuple(cfg.adam_betas)
        )
        self.critic_tokens = 0.0  # valid tokens the critic's loss summed over since its last step

    def build_critic(self, services: Services) -> ValueModel:
        """A copy of the policy's backbone (or of `critic_model`'s, which must share the tokenizer) + a scalar head."""
        name = self.settings.critic_model
        if name:
            model, tok = load_model(name, services.dtype, services.device, self.cfg.trust_remote_code, self.cfg.seed)
            if tok.get_vocab() != services.tokenizer.get_vocab():
                raise GcfError(
                    f"critic_model={name} has another tokenizer than the policy; the critic reads the policy's tokens, so pick a model of the same family."
                )
            backbone = model.get_decoder()
            backbone.requires_grad_(True)
        elif lora.is_peft(services.policy()):  # adapters of its own over the policy's frozen base: no copy of the base
            backbone = lora.shared_base_copy(services.policy().get_decoder())
        else:
            backbone = copy.deepcopy(services.policy().get_decoder())
            backbone.requires_grad_(True)
        if self.cfg.activation_checkpointing and hasattr(backbone, "gradient_checkpointing_enable"):
            backbone.gradient_checkpointing_enable()
        return ValueModel(backbone, backbone.config.hidden_size).to(services.device).train()

    # -- prepare: values, per-token rewards, GAE -------------------------------------
    @torch.no_grad()
    def prepare(self, batch: Batch) -> tuple[Batch, Stats]:
        kl_reward = self.settings.kl_placement == "reward" and self.ref is not None
        old = self.old_and_ref_logps(batch)  # [N, L] or None
        mask = batch.loss_mask.float()  # [N, L]
        valid = effective_mask(batch)  # [N, L]
        batch.values = self.critic_values(batch) * mask  # [N, L]
        batch.token_rewards = self.token_rewards(batch, old)  # [N, L]
        adv, batch.returns = gae(batch.token_rewards, batch.values, mask, self.settings.gamma, self.settings.lam)
        # [N, L]
        batch.token_advantages = whiten(adv, valid, self.services.all_sum) if self.settings.whiten else adv * valid
        n = max(float(valid.sum()), 1.0)
        stats = {
            "ppo/explained_variance": explained_variance(batch.values, batch.returns, valid),
            "ppo/value_mean": float((batch.values * valid).sum()) / n,
            "ppo/return_mean": float((batch.returns * valid).sum()) / n,
            "ppo/adv_raw_std": float(adv[valid.bool()].std()) if n > 1 else 0.0,
        }
        if kl_reward:
            stats["ppo/kl_penalty_mean"] = (
                float((self.settings.beta * self.kl_reward(batch.ref_logps, old) * valid).sum()) / n
            )
        return batch, {**stats, **self.prepared_mismatch(batch)}  # the sampler mismatch, when pi_old was computed

    @torch.no_grad()
    def critic_values(self, batch: Batch) -> torch.Tensor:
        """V [N, L] of a whole batch without grad, micro-batched like the trainer's log-probs."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        size = self.cfg.micro_batch_size
        for s in range(0, out.shape[0], size):
            ids, am, lm = (
                t[s : s + size].to(self.services.device)
                for t in (batch.input_ids, batch.attention_mask, batch.loss_mask)
            )
            out[s : s + size] = self.critic(ids, am, lm).float().cpu()
        return out

    def token_rewards(self, batch: Batch, old_logps: torch.Tensor | None) -> torch.Tensor:
        """[N, L]: the sequence reward on each row's last completion token, minus beta * the per-token KL when kl_placement=reward."""
        mask = batch.loss_mask.float()  # [N, L]
        N, L = mask.shape
        last = (mask * torch.arange(L)).argmax(-1)  # [N] position of the last completion token
        R = torch.where(batch.valid.bool(), batch.rewards.float(), 0.0) * mask.any(-1)  # [N]
        rewards = torch.zeros(N, L)
        rewards[torch.arange(N), last] = R
        if old_logps is not None and self.settings.kl_placement == "reward" and batch.ref_logps is not None:
            # k1: InstructGPT's -beta log(pi/pi_ref)
            rewards = rewards - self.settings.beta * self.kl_reward(batch.ref_logps, old_logps) * mask
        return rewards

    # -- the policy's rule: the shared clipped surrogate on GAE advantages ---------
    def token_advantages(self, batch: Batch) -> torch.Tensor:
        return batch.token_advantages  # [B, L]

    # -- the critic: its loss, its step ----------------------------------------------
    def critic_loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """vf_coef * sum over valid tokens of the clipped value loss (the step's token count divides it later)."""
        mask = effective_mask(batch)  # [b, L]
        values = self.critic(batch.input_ids, batch.attention_mask, batch.loss_mask)  # [b, L] with grad
        per_token, clipped = value_loss_terms(
            values, batch.values.float(), batch.returns.float(), self.settings.value_clip
        )
        k = max(float(mask.sum()), 1.0)
        stats = {
            "ppo/value_loss": float((per_token.detach() * mask).sum()) / k,
            "ppo/vf_clip_frac": float((clipped * mask).sum()) / k,
        }
        return self.settings.vf_coef * (per_token * mask).sum(), stats

    def auxiliary_step(self, batch: Batch) -> dict[str, float]:
        """The critic's backward on this micro-batch; it steps once per policy step, in auxiliary_step_end."""
        loss, stats = self.critic_loss(batch)
        loss.backward()
        self.critic_tokens += float(effective_mask(batch).sum())
        return stats

    def auxiliary_step_end(self) -> dict[str, float]:
        """Divide the accumulated gradient by the step's token count (the normaliser), clip, step."""
        services = self.services
        # the critic's gradients are averaged over the ranks (DistEnv.average_method_grads, or FSDP2's reduce-scatter
        # when it is sharded), so dividing by the mean token count per rank gives sum / (tokens of the whole step)
        tokens = float(services.all_sum(torch.tensor([self.critic_tokens], dtype=torch.float64))) / services.world_size
        # sharded: norms span the ranks
        status, norm = second_model_step(
            self.critic_optimizer,
            list(self.critic.parameters()),
            tokens,
            self.cfg.grad_clip,
            services.all_finite,
            services.clip_grad_norm,
        )
        out: dict[str, float] = (
            {"ppo/critic_grad_norm": norm}
            if status == "stepped"
            else {"ppo/critic_skipped": 1.0}
            if status == "skipped"
            else {}
        )
        self.critic_tokens = 0.0
        param_mb, optim_mb = module_mb(self.critic, self.critic_optimizer)
        out.update(
            {
                "ppo/critic_param_mb": param_mb,
                "ppo/critic_optimizer_mb": optim_mb,
                "ppo/critic_memory_mb": param_mb + optim_mb,
            }
        )
        return out

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # what the critic trains: all of it, or (LoRA) its adapters and head, not the base it shares with the policy
        frozen = {n for n, p in self.critic.named_parameters() if not p.requires_grad}
        return {
            "critic": {k: v.detach().cpu().clone() for k, v in self.critic.state_dict().items() if k not in frozen},
            "critic_optimizer": self.critic_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "critic" in state:
            frozen = {n for n, p in self.critic.named_parameters() if not p.requires_grad}
            missing, unexpected = self.critic.load_state_dict(state["critic"], strict=False)
            if unexpected or set(missing) - frozen:
                raise GcfError(
                    f"The checkpoint's critic does not match this run's (missing {sorted(set(missing) - frozen)[:3]}, unexpected {unexpected[:3]})."
                )
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])
