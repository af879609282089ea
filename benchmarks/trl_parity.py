"""Loss parity with TRL 1.16: every row of docs/trl-mapping.md that gcfamily can express, checked against TRL's own code.

    .venv/bin/python benchmarks/trl_parity.py               # every row, 3 random cases each
    .venv/bin/python benchmarks/trl_parity.py --seeds 10 --rows grpo,dapo

Needs TRL (`pip install trl==1.16.0 "torch==2.13.0"`); without it the script says so and exits 0.

For each row, on random float64 inputs (a current policy's log-probs as the leaf, pi_old != pi as
with mu = 2, pi_ref with a few tokens past gcfamily's KL clamp, completions of different lengths
with right padding, rewards in groups with one all-equal group):

- TRL: its real code, with no model. GRPO runs `GRPOTrainer._generate_and_score_completions` (which
  computes the advantages and num_items_in_batch) and then `GRPOTrainer._compute_loss`, on an object
  made with object.__new__(GRPOTrainer) that holds what those two read, with `_generate`,
  `_calculate_rewards` and `_get_per_token_logps_and_entropies` replaced by functions that return
  the case's tokens, rewards and log-probs. The settings come from a real GRPOConfig (so TRL's own
  defaults apply), copied onto the object as GRPOTrainer.__init__ copies them. DPO runs
  `DPOTrainer._compute_loss` with a stand-in model whose output's `log_probs` are the case's; SimPO
  runs `CPOTrainer.get_batch_loss_metrics` (trl.experimental.cpo), whose stand-in model returns
  two-token logits [x, log(1 - e^x)], so that TRL's own log-softmax gives back exactly x.
- gcfamily: the real method class, built from the row's `--set` strings the way `gcf run` builds it
  (typed, method defaults applied, validated), then `prepare` (advantages, pi_old/pi_ref as the
  trainer supplies them), `engine.normaliser`, `coefficient` and `engine.weighted_loss`, as
  gcfamily/run/step.py runs a step.

Compared: the gradient with respect to the current log-probs (TRL's autograd vs the engine's one
loss); the loss value, TRL's against minus the method's textbook `objective` (the engine's
weighted loss has the right gradient, not the objective's value); and for GRPO the advantages.
A row fails when any differs by more than 1e-6. A control row (expect "differ") is a setting a user
might wrongly take for TRL's (gcfamily's defaults, or a near-miss); it fails if it does NOT differ,
so the check is shown able to tell the settings apart.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import sys
import tempfile
import types
import warnings
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Optional

import torch

from gcfamily.config import Config, apply, parse_sets, resolve_settings, validate
from gcfamily.core import engine
from gcfamily.methods import get_method
from gcfamily.methods.base import Batch, Method
from gcfamily.methods.clipped import kl_value
from gcfamily.methods.grpo import GRPO
from gcfamily.methods.services import LocalServices

TOL = 1e-6
CONTROL_MIN = 1e-4  # a control row must differ by at least this much
N_PROMPTS, G, P, T, MAX_LEN = (
    4,
    4,
    3,
    8,
    12,
)  # GRPO: 4 prompts x 4 samples, prompt 3, completions <= 8, max_completion_length 12
PAIRS, DPO_P, DPO_T = 5, 2, 7  # preference pairs, prompt and completion widths
EOS, PAD = 2, 0


# ----------------------------------------------------------------------------------
# two user extensions of gcfamily's GRPO (not built in): each overrides one hook and restates `objective`


class GSPO(GRPO):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one ratio per sequence,
    s_i = exp(mean_t log(pi/pi_old)), clipped as GRPO clips r_t; TRL's importance_sampling_level="sequence".

    GC factor g_t = s_i: ds_i/dlogp_t = s_i / |o_i|, and the row's |o_i| tokens carry the same term with
    equal weights under every normalisation, so the engine's sum over them restores the factor |o_i|.
    """

    name = "gspo"
    ratio_level = "sequence"

    def importance_ratio(self, batch: Batch, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = batch.loss_mask.to(logps.dtype)  # [B, L]
        log_s = ((logps - self._old(batch, logps)) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(
            min=1
        )
        s = torch.exp(log_s).expand_as(logps)  # [B, L], one value per row
        return s, s

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        adv, (s, _), (lo, hi) = self.token_advantages(batch), self.importance_ratio(batch, logps), self.clip_range()
        per_token = torch.minimum(s * adv, s.clamp(1 - lo, 1 + hi) * adv)
        if self.kl_in_loss(batch):  # plain k3 only: TRL weighs its bias-corrected KL by s_i, not by r_t
            log_rho = (batch.ref_logps - logps).clamp(-self.kl_clamp, self.kl_clamp)
            per_token = per_token - self.settings.beta * kl_value("k3", log_rho, torch.zeros_like(log_rho))
        return self.aggregate(per_token * batch.loss_mask, batch, Z)


class TwoSidedClip(GRPO):
    """INTELLECT-2's two-sided clip (TRL's `delta`): r_t A_t is also capped at delta * A_t, so a token with
    A_t < 0 and r_t > delta gets no gradient either."""

    name = "grpo-delta"

    @dataclass
    class Settings(GRPO.Settings):
        delta: float = 4.0
        """Cap of the ratio in the unclipped branch (TRL's delta; above 1 + epsilon_high)."""

    def clipped(self, ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        return super().clipped(ratio, adv) | ((adv < 0) & (ratio > self.settings.delta))

    def objective(self, batch: Batch, logps: torch.Tensor, Z: float) -> torch.Tensor:
        adv, (lo, hi) = self.token_advantages(batch), self.clip_range()
        log_r = logps - self._old(batch, logps)
        ratio = torch.exp(log_r)
        per_token = torch.minimum(ratio.clamp(max=self.settings.delta) * adv, ratio.clamp(1 - lo, 1 + hi) * adv)
        if self.kl_in_loss(batch):
            log_rho = (batch.ref_logps - logps).clamp(-self.kl_clamp, self.kl_clamp)
            per_token = per_token - self.settings.beta * kl_value(self.kl_name, log_rho, log_r)
        return self.aggregate(per_token * batch.loss_mask, batch, Z)


EXTENSIONS: dict[str, type[Method]] = {"gspo": GSPO, "grpo-delta": TwoSidedClip}


# ----------------------------------------------------------------------------------
# the rows: TRL's config -> gcfamily's --method and --set


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # grpo | dpo | simpo: which TRL code runs
    trl: dict  # fields of GRPOConfig / DPOConfig / CPOConfig
    method: str  # gcfamily --method (or an EXTENSIONS name)
    sets: str = ""  # gcfamily --set k=v ..., exactly as on the command line
    expect: str = "match"  # match: a supported row; differ: a control that must not match
    validated: bool = True  # False: gcfamily's validation refuses these settings (the row checks the algebra only)
    float32: bool = False  # the case in float32 (TRL's alpha_divergence has no float64 path: its clamp table lacks it)


MU2 = {"num_iterations": 2}  # TRL's mu: pi_old is computed and differs from pi
ROWS: list[Row] = [
    # -- GRPO loss types (each with mu = 2, so both clip sides are live)
    Row("grpo", "grpo", {"loss_type": "grpo", **MU2}, "grpo", "mu=2 std_eps=1e-4 beta=0"),
    Row(
        "grpo beta=0.04 (bias-corrected KL)",
        "grpo",
        {"loss_type": "grpo", "beta": 0.04, **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0.04 kl_estimator=k3-importance-weighted kl_clamp=none",
    ),
    Row(
        "grpo beta=0.04 as --method grpo-direct-kl",
        "grpo",
        {"loss_type": "grpo", "beta": 0.04, **MU2},
        "grpo-direct-kl",
        "mu=2 std_eps=1e-4 beta=0.04 kl_clamp=none",
    ),
    Row(
        "grpo beta=0.04 use_bias_correction_kl=False",
        "grpo",
        {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False, **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0.04 kl_estimator=k3 kl_clamp=none",
    ),
    Row(
        "grpo scale_rewards=batch",
        "grpo",
        {"loss_type": "grpo", "scale_rewards": "batch", **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0 scale_rewards=batch",
    ),
    Row(
        "grpo scale_rewards=none",
        "grpo",
        {"loss_type": "grpo", "scale_rewards": "none", **MU2},
        "grpo-shift",
        "mu=2 beta=0",
    ),
    Row(
        "grpo epsilon=0.1 epsilon_high=0.3",
        "grpo",
        {"loss_type": "grpo", "epsilon": 0.1, "epsilon_high": 0.3, **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0 epsilon=0.1 epsilon_high=0.3",
    ),
    Row(
        "grpo num_iterations=1",
        "grpo",
        {"loss_type": "grpo", "beta": 0.04},
        "grpo",
        "std_eps=1e-4 beta=0.04 kl_estimator=k3-importance-weighted kl_clamp=none",
    ),
    Row(
        "bnpo",
        "grpo",
        {"loss_type": "bnpo", "beta": 0.04, **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0.04 kl_estimator=k3-importance-weighted kl_clamp=none loss_norm=token",
    ),
    Row(
        "dr_grpo (scale_rewards=group, TRL's default)",
        "grpo",
        {"loss_type": "dr_grpo", **MU2},
        "dr-grpo",
        f"mu=2 beta=0 scale_rewards=group std_eps=1e-4 max_new_tokens={MAX_LEN}",
    ),
    Row(
        "dr_grpo scale_rewards=none",
        "grpo",
        {"loss_type": "dr_grpo", "scale_rewards": "none", "beta": 0.04, **MU2},
        "dr-grpo",
        f"mu=2 beta=0.04 kl_estimator=k3-importance-weighted kl_clamp=none max_new_tokens={MAX_LEN}",
    ),
    Row(
        "dapo (TRL default: epsilon_high=epsilon)",
        "grpo",
        {"loss_type": "dapo", **MU2},
        "dapo",
        "mu=2 beta=0 std_eps=1e-4 epsilon_high=0.2",
    ),
    Row(
        "dapo epsilon_high=0.28",
        "grpo",
        {"loss_type": "dapo", "epsilon_high": 0.28, **MU2},
        "dapo",
        "mu=2 beta=0 std_eps=1e-4",
    ),
    Row("GRPOConfig() defaults, num_iterations=1", "grpo", {}, "dapo", "beta=0 std_eps=1e-4 epsilon_high=0.2"),
    Row(
        "luspo, importance_sampling_level=token",
        "grpo",
        {"loss_type": "luspo", **MU2},
        "grpo",
        "mu=2 beta=0 std_eps=1e-4 loss_norm=sum",
    ),
    Row(
        "cispo epsilon_high=1.1 (TRL caps r at epsilon_high)",
        "grpo",
        {"loss_type": "cispo", "epsilon_high": 1.1, **MU2},
        "cispo",
        "mu=2 beta=0 std_eps=1e-4 epsilon=1 epsilon_high=0.1",
    ),
    Row(
        "cispo epsilon_high=1.1 beta=0.04 (bias-corrected KL)",
        "grpo",
        {"loss_type": "cispo", "epsilon_high": 1.1, "beta": 0.04, **MU2},
        "cispo",
        "mu=2 beta=0.04 std_eps=1e-4 epsilon=1 epsilon_high=0.1 kl_estimator=k3-importance-weighted kl_clamp=none",
    ),
    Row("sapo", "grpo", {"loss_type": "sapo", **MU2}, "sapo", "mu=2 beta=0 std_eps=1e-4"),
    Row(
        "sapo temperatures 0.5/2.0",
        "grpo",
        {"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0, **MU2},
        "sapo",
        "mu=2 beta=0 std_eps=1e-4 tau_pos=0.5 tau_neg=2.0",
    ),
    Row(
        "sapo with tau_pos and tau_neg swapped (control)",
        "grpo",
        {"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0, **MU2},
        "sapo",
        "mu=2 beta=0 std_eps=1e-4 tau_pos=2.0 tau_neg=0.5",
        expect="differ",
    ),
    # -- user extensions (not built in; the classes above)
    Row(
        "grpo importance_sampling_level=sequence (GSPO) [subclass]",
        "grpo",
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4, **MU2},
        "gspo",
        "mu=2 beta=0 std_eps=1e-4 epsilon=3e-4 epsilon_high=4e-4",
    ),
    Row(
        "GSPO beta=0.04 use_bias_correction_kl=False [subclass]",
        "grpo",
        {
            "loss_type": "grpo",
            "importance_sampling_level": "sequence",
            "epsilon": 3e-4,
            "epsilon_high": 4e-4,
            "beta": 0.04,
            "use_bias_correction_kl": False,
            **MU2,
        },
        "gspo",
        "mu=2 beta=0.04 std_eps=1e-4 epsilon=3e-4 epsilon_high=4e-4 kl_estimator=k3 kl_clamp=none",
    ),
    Row(
        "luspo importance_sampling_level=sequence [subclass]",
        "grpo",
        {"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4, **MU2},
        "gspo",
        "mu=2 beta=0 std_eps=1e-4 epsilon=3e-4 epsilon_high=4e-4 loss_norm=sum",
    ),
    Row(
        "grpo mask_truncated_completions=True",
        "grpo",
        {"loss_type": "grpo", "mask_truncated_completions": True, "beta": 0.04, **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0.04 kl_estimator=k3-importance-weighted kl_clamp=none mask_truncated=true",
    ),
    Row(
        "dapo mask_truncated_completions=True",
        "grpo",
        {"loss_type": "dapo", "mask_truncated_completions": True, **MU2},
        "dapo",
        "mu=2 beta=0 std_eps=1e-4 epsilon_high=0.2 mask_truncated=true",
    ),
    Row(
        "dr_grpo mask_truncated_completions=True",
        "grpo",
        {"loss_type": "dr_grpo", "mask_truncated_completions": True, **MU2},
        "dr-grpo",
        f"mu=2 beta=0 scale_rewards=group std_eps=1e-4 max_new_tokens={MAX_LEN} mask_truncated=true",
    ),
    Row(
        "grpo off_policy_mask_threshold=0.0",
        "grpo",
        {"loss_type": "grpo", "off_policy_mask_threshold": 0.0, "beta": 0.04, **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0.04 kl_estimator=k3-importance-weighted kl_clamp=none off_policy_mask=0.0",
    ),
    Row(
        "grpo off_policy_mask_threshold=0.0 on vLLM's sampler log-probs",
        "grpo",
        {
            "loss_type": "grpo",
            "off_policy_mask_threshold": 0.0,
            "use_vllm": True,
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_max": 2.0,
            **MU2,
        },
        "grpo",
        "mu=2 std_eps=1e-4 beta=0 off_policy_mask=0.0 tis=token_truncate tis_max=2.0",
    ),
    Row(
        "dapo off_policy_mask_threshold=0.02",
        "grpo",
        {"loss_type": "dapo", "off_policy_mask_threshold": 0.02, **MU2},
        "dapo",
        "mu=2 beta=0 std_eps=1e-4 epsilon_high=0.2 off_policy_mask=0.02",
    ),
    Row(
        "vespo off_policy_mask_threshold=0.0",
        "grpo",
        {"loss_type": "vespo", "off_policy_mask_threshold": 0.0, **MU2},
        "vespo",
        "mu=2 std_eps=1e-4 off_policy_mask=0.0",
    ),
    Row(
        "grpo multi_objective_aggregation=normalize_then_sum (two rewards, weights 1 and 0.5)",
        "grpo",
        {"loss_type": "grpo", "multi_objective_aggregation": "normalize_then_sum", **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0 reward_aggregation=normalize_then_sum scale_rewards=batch reward=[a,b] "
        "reward_weights=[1.0,0.5]",
    ),
    *[
        Row(
            f"grpo vllm IS correction {mode} [0.5, 2]",
            "grpo",
            {
                "loss_type": "grpo",
                "use_vllm": True,
                "vllm_importance_sampling_correction": True,
                "vllm_importance_sampling_mode": mode,
                "vllm_importance_sampling_clip_min": 0.5,
                "vllm_importance_sampling_clip_max": 2.0,
                "beta": 0.04,
                **MU2,
            },
            "grpo",
            f"mu=2 std_eps=1e-4 beta=0.04 kl_estimator=k3-importance-weighted kl_clamp=none tis={mode} tis_min=0.5 tis_max=2.0",
        )
        for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    ],
    Row("vespo", "grpo", {"loss_type": "vespo", **MU2}, "vespo", "mu=2 std_eps=1e-4"),
    Row(
        "vespo k/lambda 1.5/2.5, 2.5/1.5, beta=0.04",
        "grpo",
        {
            "loss_type": "vespo",
            "vespo_k_pos": 1.5,
            "vespo_lambda_pos": 2.5,
            "vespo_k_neg": 2.5,
            "vespo_lambda_neg": 1.5,
            "beta": 0.04,
            **MU2,
        },
        "vespo",
        "mu=2 std_eps=1e-4 k_pos=1.5 lambda_pos=2.5 k_neg=2.5 lambda_neg=1.5 beta=0.04 "
        "kl_estimator=k3-importance-weighted kl_clamp=none",
    ),
    Row(
        "grpo delta=1.5 [subclass]",
        "grpo",
        {"loss_type": "grpo", "delta": 1.5, "beta": 0.04, **MU2},
        "grpo-delta",
        "mu=2 delta=1.5 std_eps=1e-4 beta=0.04 kl_estimator=k3-importance-weighted kl_clamp=none",
    ),
    # -- preference losses
    Row("dpo sigmoid", "dpo", {"loss_type": ["sigmoid"], "beta": 0.1}, "dpo", "beta=0.1"),
    Row(
        "simpo (CPOConfig loss_type=simpo, cpo_alpha=0)",
        "simpo",
        {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0, "simpo_gamma": 0.8},
        "simpo",
        "beta=2.0 simpo_gamma=0.8",
    ),
    # TRL's other DPO loss types, each a gcfamily method (gcfamily/methods/pair_losses.py); beta = 1 puts the case's
    # margins (|beta * (Delta_w - Delta_l)| up to about 3) on both sides of the hinge and of EXO's pivot
    Row("dpo hinge", "dpo", {"loss_type": ["hinge"], "beta": 1.0}, "hinge", "beta=1.0"),
    Row(
        "dpo robust eps=0.1",
        "dpo",
        {"loss_type": ["robust"], "beta": 0.5, "label_smoothing": 0.1},
        "robust-dpo",
        "beta=0.5 label_smoothing=0.1",
    ),
    Row(
        "dpo exo_pair eps=1e-3",
        "dpo",
        {"loss_type": ["exo_pair"], "beta": 1.0, "label_smoothing": 1e-3},
        "exo-pair",
        "beta=1.0 label_smoothing=1e-3",
    ),
    Row(
        "dpo exo_pair eps=0.2",
        "dpo",
        {"loss_type": ["exo_pair"], "beta": 1.0, "label_smoothing": 0.2},
        "exo-pair",
        "beta=1.0 label_smoothing=0.2",
    ),
    Row("dpo discopop tau=0.05", "dpo", {"loss_type": ["discopop"], "beta": 0.1}, "discopop", "beta=0.1"),
    Row(
        "dpo discopop tau=0.5",
        "dpo",
        {"loss_type": ["discopop"], "beta": 1.0, "discopop_tau": 0.5},
        "discopop",
        "beta=1.0 discopop_tau=0.5",
    ),
    Row("dpo nca_pair", "dpo", {"loss_type": ["nca_pair"], "beta": 1.0}, "nca-pair", "beta=1.0"),
    Row("dpo bco_pair", "dpo", {"loss_type": ["bco_pair"], "beta": 1.0}, "bco-pair", "beta=1.0"),
    Row("dpo sppo_hard", "dpo", {"loss_type": ["sppo_hard"], "beta": 0.5}, "sppo-hard", "beta=0.5"),
    Row("dpo apo_zero", "dpo", {"loss_type": ["apo_zero"], "beta": 1.0}, "apo-zero", "beta=1.0"),
    Row("dpo apo_down", "dpo", {"loss_type": ["apo_down"], "beta": 1.0}, "apo-down", "beta=1.0"),
    Row("dpo sigmoid_norm", "dpo", {"loss_type": ["sigmoid_norm"], "beta": 2.0}, "sigmoid-norm", "beta=2.0"),
    Row("dpo ipo (per-token means) as ipo-norm", "dpo", {"loss_type": ["ipo"], "beta": 0.1}, "ipo-norm", "beta=0.1"),
    # f-DPO's divergences and LD-DPO's weights (gcfamily/methods/pair_shaping.py), on DPO and on the losses TRL shapes
    Row(
        "dpo f_divergence=forward_kl",
        "dpo",
        {"loss_type": ["sigmoid"], "beta": 0.5, "f_divergence_type": "forward_kl"},
        "dpo",
        "beta=0.5 f_divergence=forward_kl",
    ),
    Row(
        "dpo f_divergence=js_divergence",
        "dpo",
        {"loss_type": ["sigmoid"], "beta": 0.5, "f_divergence_type": "js_divergence"},
        "dpo",
        "beta=0.5 f_divergence=js_divergence",
    ),
    Row(
        "dpo f_divergence=alpha_divergence, alpha=0.3 (float32)",
        "dpo",
        {
            "loss_type": ["sigmoid"],
            "beta": 0.5,
            "f_divergence_type": "alpha_divergence",
            "f_alpha_divergence_coef": 0.3,
        },
        "dpo",
        "beta=0.5 f_divergence=alpha_divergence f_alpha=0.3",
        float32=True,
    ),
    Row(
        "dpo ld_alpha=0.5",
        "dpo",
        {"loss_type": ["sigmoid"], "beta": 0.5, "ld_alpha": 0.5},
        "dpo",
        "beta=0.5 ld_alpha=0.5",
    ),
    Row(
        "dpo ld_alpha=0 with forward_kl",
        "dpo",
        {"loss_type": ["sigmoid"], "beta": 0.5, "ld_alpha": 0.0, "f_divergence_type": "forward_kl"},
        "dpo",
        "beta=0.5 ld_alpha=0 f_divergence=forward_kl",
    ),
    Row(
        "hinge f_divergence=js_divergence ld_alpha=0.3",
        "dpo",
        {"loss_type": ["hinge"], "beta": 1.0, "f_divergence_type": "js_divergence", "ld_alpha": 0.3},
        "hinge",
        "beta=1.0 f_divergence=js_divergence ld_alpha=0.3",
    ),
    Row(
        "ipo (per-token means) f_divergence=forward_kl",
        "dpo",
        {"loss_type": ["ipo"], "beta": 0.1, "f_divergence_type": "forward_kl"},
        "ipo-norm",
        "beta=0.1 f_divergence=forward_kl",
    ),
    Row(
        "sigmoid_norm ld_alpha=0.5 f_divergence=js_divergence",
        "dpo",
        {"loss_type": ["sigmoid_norm"], "beta": 2.0, "ld_alpha": 0.5, "f_divergence_type": "js_divergence"},
        "sigmoid-norm",
        "beta=2.0 ld_alpha=0.5 f_divergence=js_divergence",
    ),
    Row(
        "nca_pair ld_alpha=0.5",
        "dpo",
        {"loss_type": ["nca_pair"], "beta": 1.0, "ld_alpha": 0.5},
        "nca-pair",
        "beta=1.0 ld_alpha=0.5",
    ),
    Row(
        "discopop f_divergence=forward_kl",
        "dpo",
        {"loss_type": ["discopop"], "beta": 0.5, "f_divergence_type": "forward_kl"},
        "discopop",
        "beta=0.5 f_divergence=forward_kl",
    ),
    Row(
        "dpo robust eps=0.1 = cdpo label_smoothing=-0.125 [refused]",
        "dpo",
        {"loss_type": ["robust"], "beta": 0.1, "label_smoothing": 0.1},
        "cdpo",
        "beta=0.1 label_smoothing=-0.125",
        validated=False,
    ),
    # -- controls: near-misses that must differ
    Row(
        "control: grpo with gcfamily's std_eps=0",
        "grpo",
        {"loss_type": "grpo", **MU2},
        "grpo",
        "mu=2 beta=0",
        expect="differ",
    ),
    Row(
        "control: bias-corrected KL with gcfamily's kl_clamp=20",
        "grpo",
        {"loss_type": "grpo", "beta": 0.04, **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0.04 kl_estimator=k3-importance-weighted",
        expect="differ",
    ),
    Row(
        "control: bias-corrected KL with plain k3",
        "grpo",
        {"loss_type": "grpo", "beta": 0.04, **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0.04 kl_estimator=k3 kl_clamp=none",
        expect="differ",
    ),
    Row(
        "control: TRL dapo with gcfamily dapo's epsilon_high=0.28",
        "grpo",
        {"loss_type": "dapo", **MU2},
        "dapo",
        "mu=2 beta=0 std_eps=1e-4",
        expect="differ",
    ),
    Row(
        "control: dr_grpo with gcfamily's max_new_tokens=64",
        "grpo",
        {"loss_type": "dr_grpo", **MU2},
        "dr-grpo",
        "mu=2 beta=0 scale_rewards=group std_eps=1e-4",
        expect="differ",
    ),
    Row(
        "control: grpo off_policy_mask_threshold=0.0 without the setting",
        "grpo",
        {"loss_type": "grpo", "off_policy_mask_threshold": 0.0, **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0",
        expect="differ",
    ),
    Row(
        "control: two rewards normalize_then_sum as the weighted sum (sum_then_normalize)",
        "grpo",
        {"loss_type": "grpo", "multi_objective_aggregation": "normalize_then_sum", **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0 scale_rewards=batch reward=[a,b] reward_weights=[1.0,0.5]",
        expect="differ",
    ),
    Row(
        "control: vllm IS correction token_mask with gcfamily's tis=off",
        "grpo",
        {
            "loss_type": "grpo",
            "use_vllm": True,
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "token_mask",
            "vllm_importance_sampling_clip_min": 0.5,
            "vllm_importance_sampling_clip_max": 2.0,
            **MU2,
        },
        "grpo",
        "mu=2 std_eps=1e-4 beta=0",
        expect="differ",
    ),
    Row(
        "control: vespo with k and lambda of the other sign",
        "grpo",
        {"loss_type": "vespo", **MU2},
        "vespo",
        "mu=2 std_eps=1e-4 k_pos=3.0 lambda_pos=2.0 k_neg=2.0 lambda_neg=3.0",
        expect="differ",
    ),
    Row(
        "control: grpo mask_truncated_completions=True without the setting",
        "grpo",
        {"loss_type": "grpo", "mask_truncated_completions": True, **MU2},
        "grpo",
        "mu=2 std_eps=1e-4 beta=0",
        expect="differ",
    ),
    Row(
        "control: dpo ipo (TRL: per-token means)",
        "dpo",
        {"loss_type": ["ipo"], "beta": 0.1},
        "ipo",
        "beta=0.1",
        expect="differ",
    ),
    Row(
        "control: dpo robust vs cdpo at the same eps",
        "dpo",
        {"loss_type": ["robust"], "beta": 0.1, "label_smoothing": 0.1},
        "cdpo",
        "beta=0.1 label_smoothing=0.1",
        expect="differ",
    ),
    Row(
        "control: dpo ld_alpha=0.5 as plain dpo",
        "dpo",
        {"loss_type": ["sigmoid"], "beta": 0.5, "ld_alpha": 0.5},
        "dpo",
        "beta=0.5",
        expect="differ",
    ),
    Row(
        "control: dpo forward_kl as js_divergence",
        "dpo",
        {"loss_type": ["sigmoid"], "beta": 0.5, "f_divergence_type": "forward_kl"},
        "dpo",
        "beta=0.5 f_divergence=js_divergence",
        expect="differ",
    ),
    Row(
        "control: dpo sigmoid_norm as dpo (sums)",
        "dpo",
        {"loss_type": ["sigmoid_norm"], "beta": 2.0},
        "dpo",
        "beta=2.0",
        expect="differ",
    ),
    Row(
        "control: dpo apo_down as apo-zero",
        "dpo",
        {"loss_type": ["apo_down"], "beta": 1.0},
        "apo-zero",
        "beta=1.0",
        expect="differ",
    ),
    Row(
        "control: dpo nca_pair as bco-pair",
        "dpo",
        {"loss_type": ["nca_pair"], "beta": 1.0},
        "bco-pair",
        "beta=1.0",
        expect="differ",
    ),
    Row(
        "control: dpo discopop tau=0.5 at gcfamily's tau=0.05",
        "dpo",
        {"loss_type": ["discopop"], "beta": 1.0, "discopop_tau": 0.5},
        "discopop",
        "beta=1.0",
        expect="differ",
    ),
    Row(
        "control: dpo exo_pair as robust-dpo at the same eps",
        "dpo",
        {"loss_type": ["exo_pair"], "beta": 1.0, "label_smoothing": 0.2},
        "robust-dpo",
        "beta=1.0 label_smoothing=0.2",
        expect="differ",
    ),
    Row(
        "control: simpo with simpo_gamma = gamma/beta",
        "simpo",
        {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0, "simpo_gamma": 0.8},
        "simpo",
        "beta=2.0 simpo_gamma=0.4",
        expect="differ",
    ),
]


# ----------------------------------------------------------------------------------
# random cases


def grpo_case(seed: int) -> dict[str, torch.Tensor]:
    """Rewards [B], completion lengths [B], token ids [B, T], and log-probs [B, P + T] of pi, pi_old, pi_ref (float64)."""
    gen = torch.Generator().manual_seed(seed)
    B = N_PROMPTS * G
    rewards = torch.randn(N_PROMPTS, G, generator=gen, dtype=torch.float64)  # [n, G]
    rewards[0] = 0.75  # an all-equal group: advantage 0, tokens kept
    rewards[1] = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=torch.float64)  # a binary reward
    rewards = rewards.flatten().float().double()  # float32-exact values: gcfamily reads rewards as float32
    lengths = torch.randint(1, T + 1, (B,), generator=gen)  # [B]
    lengths[torch.randint(0, B, (1,), generator=gen)] = T  # at least one full row: the others are padded
    ids = torch.randint(3, 50, (B, T), generator=gen)  # [B, T]
    ends = torch.rand(B, generator=gen) < 0.75  # the rest are truncated (no EOS)
    for b in range(B):
        if ends[b]:
            ids[b, lengths[b] - 1] = EOS
    logps = -(
        0.1 + 2.9 * torch.rand(B, P + T, generator=gen, dtype=torch.float64)
    )  # [B, P+T], nonzero past the masks too
    old = logps + 0.35 * torch.randn(
        B, P + T, generator=gen, dtype=torch.float64
    )  # [B, P+T]: r = e^(+-0.35), both clip sides
    ref = logps + 0.5 * torch.randn(B, P + T, generator=gen, dtype=torch.float64)  # [B, P+T]
    rows = torch.randperm(B, generator=gen)[:2]
    ref[rows, P] = logps[rows, P] - 25.0  # |log(pi_ref/pi)| = 25: past gcfamily's default kl_clamp of 20
    # a second reward function (multi_objective_aggregation rows), from its own stream: the other draws stay as they were
    own = torch.Generator().manual_seed(seed + 1000)
    second = torch.randn(N_PROMPTS, G, generator=own, dtype=torch.float64)
    # the sampler's log-probs (vLLM's, for the IS rows): pi_old's with log(pi_old/pi_sampler) ~ N(0, 0.6^2): past both bounds
    sample = old - 0.6 * torch.randn(old.shape, generator=own, dtype=torch.float64)
    second[0] = -0.5  # the all-equal group stays equal in both rewards
    rewards2 = second.flatten().float().double()
    return {
        "rewards": rewards,
        "rewards2": rewards2,
        "sample": sample,
        "lengths": lengths,
        "ids": ids,
        "ends": ends,
        "logps": logps,
        "old": old,
        "ref": ref,
    }


def pair_case(seed: int) -> dict[str, torch.Tensor]:
    """Interleaved pairs (chosen 2i, rejected 2i+1): loss mask [2P, L], log-probs of pi and pi_ref [2P, L]."""
    gen = torch.Generator().manual_seed(seed)
    B, L = 2 * PAIRS, DPO_P + DPO_T
    lengths = torch.randint(2, DPO_T + 1, (B,), generator=gen)
    pos = torch.arange(L)[None]
    loss_mask = ((pos >= DPO_P) & (pos < DPO_P + lengths[:, None])).long()  # [B, L]
    logps = -(0.1 + 2.9 * torch.rand(B, L, generator=gen, dtype=torch.float64))  # [B, L]
    ref = logps + 0.6 * torch.randn(B, L, generator=gen, dtype=torch.float64)
    return {"loss_mask": loss_mask, "logps": logps, "ref": ref, "ids": torch.randint(3, 50, (B, L), generator=gen)}


# ----------------------------------------------------------------------------------
# TRL's side: its own code on a minimal trainer object


class _Accelerator:
    """One process on the CPU: what TRL's loss and advantage code ask of accelerate."""

    device, num_processes, process_index, sync_gradients = torch.device("cpu"), 1, 0, True

    def gather(self, x: Any) -> Any:
        return x

    gather_for_metrics = gather

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x

    def autocast(self) -> Any:
        return contextlib.nullcontext()


def _bare(cls: type, args: Any) -> Any:
    """An instance of a TRL trainer class without its __init__, with the state every loss path reads."""
    tr = object.__new__(cls)
    tr.args, tr.accelerator = args, _Accelerator()
    tr.model = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
    tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    tr.aux_loss_enabled = False
    return tr


def trl_grpo(row: Row, case: dict, workdir: str) -> dict[str, Any]:
    from trl import GRPOConfig, GRPOTrainer

    B = N_PROMPTS * G
    args = GRPOConfig(
        output_dir=workdir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=B,
        num_generations=G,
        max_completion_length=MAX_LEN,
        **row.trl,
    )
    tr = _bare(GRPOTrainer, args)
    # as GRPOTrainer.__init__ copies them from args
    tr.beta, tr.loss_type, tr.scale_rewards = args.beta, args.loss_type, args.scale_rewards
    tr.num_iterations, tr.epsilon_low = args.num_iterations, args.epsilon
    tr.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    tr.importance_sampling_level, tr.off_policy_mask_threshold = (
        args.importance_sampling_level,
        args.off_policy_mask_threshold,
    )
    tr.mask_truncated_completions, tr.top_entropy_quantile = args.mask_truncated_completions, args.top_entropy_quantile
    tr.max_completion_length, tr.num_generations = args.max_completion_length, args.num_generations
    tr.num_generations_eval = args.num_generations_eval or args.num_generations
    tr.multi_objective_aggregation, tr.pad_to_multiple_of = args.multi_objective_aggregation, args.pad_to_multiple_of
    tr.use_vllm, tr.vllm_importance_sampling_correction = args.use_vllm, args.vllm_importance_sampling_correction
    tr.vllm_importance_sampling_mode = args.vllm_importance_sampling_mode
    tr.vllm_importance_sampling_clip_max = args.vllm_importance_sampling_clip_max
    tr.vllm_importance_sampling_clip_min = args.vllm_importance_sampling_clip_min
    tr.entropy_coef, tr.use_adaptive_entropy = args.entropy_coef, args.use_adaptive_entropy
    tr._entropy_bonus_enabled = args.entropy_coef != 0.0 or args.use_adaptive_entropy
    tr.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    two = row.trl.get("multi_objective_aggregation") is not None  # two reward functions, weighted 1 and 0.5
    tr.reward_weights = torch.tensor([1.0, 0.5]) if two else torch.ones(1)
    tr.reward_func_names, tr.reward_funcs = (["a", "b"], [None, None]) if two else (["reward"], [None])
    tr.environment_factories, tr.environments, tr.tools, tr.log_multimodal = None, [], None, False
    tr._tokenizer, tr.eos_token_ids = types.SimpleNamespace(pad_token_id=PAD), [EOS]
    tr.ref_model = types.SimpleNamespace(name="pi_ref")
    tr._pending_extra_logs, tr._pending_metrics = {}, {}
    tr._logs = {
        "prompt": deque(),
        "completion": deque(),
        "rewards": defaultdict(deque),
        "advantages": deque(),
        "extra": defaultdict(deque),
    }

    lengths, ids = case["lengths"], case["ids"]
    logps = case["logps"][:, P:].clone().requires_grad_(True)  # [B, T]: the leaf, completion positions
    ref, old = case["ref"][:, P:], case["old"][:, P:]
    calls: list[str] = []

    def generate(prompts: list) -> tuple:
        completion_ids = [ids[b, : lengths[b]].tolist() for b in range(B)]
        # with use_vllm, the sampler's log-probs of its tokens (vLLM's), which TRL's IS correction reads
        sampled = [case["sample"][b, P : P + lengths[b]].tolist() for b in range(B)] if args.use_vllm else None
        return [[5, 6, 7]] * B, completion_ids, None, ["c"] * B, sampled, {}, None, None

    def logps_and_entropies(
        model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, **kw: Any
    ) -> tuple:
        assert logits_to_keep == T, (logits_to_keep, T)
        if model is tr.ref_model:
            calls.append("ref")
            return ref.clone(), None, None
        if not torch.is_grad_enabled():
            calls.append("old")
            return old.clone(), None, None
        calls.append("policy")
        return logps, torch.zeros_like(logps), None

    tr._generate = generate
    per_func = torch.stack([case["rewards"], case["rewards2"]], 1) if two else case["rewards"][:, None]  # [B, K]
    tr._calculate_rewards = lambda inputs, prompts, completions, ids_list: per_func.clone()
    tr._get_per_token_logps_and_entropies = logps_and_entropies
    inputs = [
        {"prompt": f"prompt {b // G}"} for b in range(B)
    ]  # TRL's sampler repeats each prompt G times, consecutively
    out = GRPOTrainer._generate_and_score_completions(tr, inputs)
    loss = GRPOTrainer._compute_loss(tr, tr.model, out)
    loss.backward()
    grad = torch.zeros_like(case["logps"])
    grad[:, P:] = logps.grad
    return {"loss": float(loss.detach()), "grad": grad, "advantages": out["advantages"].double(), "calls": calls}


def _pair_order(B: int) -> torch.Tensor:
    """TRL's layout, chosen rows then rejected rows, as indices into gcfamily's interleaved pairs."""
    return torch.cat([torch.arange(0, B, 2), torch.arange(1, B, 2)])


def trl_dpo(row: Row, case: dict, workdir: str) -> dict[str, Any]:
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=workdir, use_cpu=True, bf16=False, report_to="none", precompute_ref_log_probs=True, **row.trl
    )
    tr = _bare(DPOTrainer, args)
    tr.beta, tr.precompute_ref_logps, tr.loss_types = args.beta, True, args.loss_type
    tr.loss_weights = args.loss_weights or [1.0] * len(tr.loss_types)
    tr.ld_alpha, tr.f_divergence_type, tr.f_alpha_divergence_coef = (
        args.ld_alpha,
        args.f_divergence_type,
        args.f_alpha_divergence_coef,
    )
    tr.label_smoothing, tr.use_weighting, tr._total_train_tokens, tr._tp_size = (
        args.label_smoothing,
        args.use_weighting,
        0,
        1,
    )

    B = case["logps"].shape[0]
    order = _pair_order(B)
    mask = case["loss_mask"][order]  # [B, L] TRL's completion_mask
    leaf = case["logps"].clone().requires_grad_(True)  # [B, L] gcfamily's layout

    def stand_in(per_token: torch.Tensor) -> Any:
        def model(**kw: Any) -> types.SimpleNamespace:
            labels = kw["labels"]
            log_probs = (per_token[order] * mask)[:, 1:]  # [B, L-1]: TRL's fused head gives 0 where labels are -100
            assert torch.equal(labels[:, 1:] != -100, mask[:, 1:].bool())
            zeros = torch.zeros_like(log_probs).detach()
            return types.SimpleNamespace(
                log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(), aux_loss=None
            )

        return model

    inputs = {  # TRL's own batch: a dict of its keys
        "input_ids": case["ids"][order],
        "attention_mask": torch.ones_like(mask),
        "completion_mask": mask,
    }
    tr.ref_model = stand_in(case["ref"])
    # pi_ref's sums as TRL precomputes them (its own compute_ref_log_probs: with ld_alpha, LD-weighted)
    inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = DPOTrainer.compute_ref_log_probs(
        tr, tr.ref_model, inputs
    )
    model = stand_in(leaf)
    loss = DPOTrainer._compute_loss(tr, model, inputs, return_outputs=False)
    loss.backward()
    return {"loss": float(loss.detach()), "grad": leaf.grad}


def trl_simpo(row: Row, case: dict, workdir: str) -> dict[str, Any]:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    args = CPOConfig(output_dir=workdir, use_cpu=True, bf16=False, report_to="none", **row.trl)
    tr = _bare(CPOTrainer, args)
    tr.beta, tr.label_smoothing, tr.loss_type, tr.cpo_alpha, tr.alpha = (
        args.beta,
        args.label_smoothing,
        args.loss_type,
        args.cpo_alpha,
        args.alpha,
    )
    tr.simpo_gamma, tr.is_encoder_decoder, tr.pad_token_id = args.simpo_gamma, False, PAD

    B, L = case["logps"].shape
    order = _pair_order(B)
    leaf = case["logps"].clone().requires_grad_(True)  # [B, L]

    def model(input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool = False) -> types.SimpleNamespace:
        # position t-1 predicts token t; two classes [x, log(1 - e^x)] have log-softmax exactly x at class 0 (the label)
        x = torch.cat([leaf[order][:, 1:], torch.full((B, 1), -1.0, dtype=leaf.dtype)], 1)  # [B, L]
        return types.SimpleNamespace(logits=torch.stack([x, torch.log(-torch.expm1(x))], -1))  # [B, L, 2]

    labels = torch.where(case["loss_mask"].bool(), 0, -100)  # [B, L]: class 0 is the taken token
    batch = {
        f"{side}_{k}": v[i::2]
        for side, i in (("chosen", 0), ("rejected", 1))
        for k, v in (("input_ids", case["ids"]), ("attention_mask", torch.ones_like(labels)), ("labels", labels))
    }
    loss, _ = CPOTrainer.get_batch_loss_metrics(tr, model, batch)
    loss.backward()
    return {"loss": float(loss.detach()), "grad": leaf.grad}


# ----------------------------------------------------------------------------------
# gcfamily's side: the method class, as gcf run builds it and the trainer runs it


def build_method(spec: str, sets: str, shared: dict[str, Any], check: bool = True) -> Method:
    """The method of `--method spec --set sets`, typed, with its own defaults and (unless check=False) validated."""
    cls = EXTENSIONS.get(spec) or get_method(spec)
    given = {**shared, **parse_sets(tuple(sets.split()))}
    cfg = apply(Config(), {"method": cls.name, **given}, "trl_parity")
    object.__setattr__(cfg, "explicit", sorted(given))
    resolve_settings(cfg, cls)
    validate(cfg)
    cls.apply_setting_defaults(cfg)
    if check:
        cls.validate(cfg)
    return cls(cfg)


class _Services(LocalServices):
    """What GRPO.prepare asks of the run (gcfamily/methods/services.py): the no-grad log-probs of pi_old and pi_ref."""

    def __init__(self, old: torch.Tensor, ref: torch.Tensor) -> None:
        self.old, self.ref = old, ref

    def policy(self) -> str:  # type: ignore[override]
        return "policy"

    def logprobs(self, model: str, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        return (self.ref if model == "reference" else self.old).clone()


def _step(method: Method, batch: Batch, logps0: torch.Tensor) -> dict[str, Any]:
    """One step as gcfamily/run/step.py runs it (one micro-batch): Z, GC, the weighted loss, its backward."""
    Z = engine.normaliser([batch], method.norm, method.cfg.norm_constant)
    logps = logps0.clone().requires_grad_(True)
    coef = method.coefficient(batch, logps.detach())  # [B, L]
    engine.weighted_loss(coef, logps, batch, method.norm, Z).backward()
    objective = float(method.objective(batch, logps0, Z))
    return {"loss": -objective, "grad": logps.grad}


def gcf_grpo(row: Row, case: dict) -> dict[str, Any]:
    B = N_PROMPTS * G
    method = build_method(row.method, row.sets, {"group_size": G}, row.validated)
    lengths = case["lengths"]
    pos = torch.arange(P + T)[None]
    loss_mask = ((pos >= P) & (pos < P + lengths[:, None])).long()  # [B, P+T]
    method.services = _Services(case["old"], case["ref"])  # what setup() would have given prepare
    method.ref = "reference" if method.settings.beta > 0 else None
    batch: Batch = Batch(
        input_ids=torch.cat([torch.full((B, P), 5), case["ids"]], 1),
        attention_mask=torch.ones(B, P + T, dtype=torch.long),
        loss_mask=loss_mask,
        # the run's reward is the weighted sum of its functions (Scores.total), 1 and 0.5 in the two-reward rows
        rewards=(case["rewards"] + 0.5 * case["rewards2"]).float()
        if "multi_objective_aggregation" in row.trl
        else case["rewards"].clone(),
        valid=torch.ones(B, dtype=torch.bool),
        truncated=~case["ends"],  # [B] no EOS within the budget (the rollout's flag)
        reward_parts=torch.stack([case["rewards"], case["rewards2"]], 1).float(),  # [B, 2] each function's own
        # the sampler's log-probs [B, P+T] where TRL has them (vLLM's); without, TRL's off-policy mask reads pi_old, and
        # so does gcfamily's on a batch without them
        sample_logps=case["sample"] * loss_mask if row.trl.get("use_vllm") else None,
    )
    batch, _ = method.prepare(batch)
    out = _step(method, batch, case["logps"])
    out["advantages"] = batch.advantages.double()
    return out


def gcf_pairs(row: Row, case: dict) -> dict[str, Any]:
    method = build_method(row.method, row.sets, {}, row.validated)
    B = case["logps"].shape[0]
    batch: Batch = Batch(
        input_ids=case["ids"],
        attention_mask=torch.ones_like(case["loss_mask"]),
        loss_mask=case["loss_mask"],
        example_weight=torch.full((B,), 0.5),
    )
    if method.uses_reference:
        batch.ref_logps = case["ref"] * case["loss_mask"]
    return _step(method, batch, case["logps"])


# ----------------------------------------------------------------------------------
# the comparison


def coverage(
    case: dict, advantages: torch.Tensor, eps_low: float, eps_high: float, level: str = "token"
) -> dict[str, int]:
    """Branches the GRPO case reaches with these advantages: clipped tokens (or, at the sequence level, rows) on
    each side, equal-reward groups, tokens past gcfamily's KL clamp, padded and truncated rows (computed here,
    independently of both implementations)."""
    lengths = case["lengths"]
    mask = tokens = torch.arange(T)[None] < lengths[:, None]  # [B, T]
    log_r = (case["logps"] - case["old"])[:, P:]  # [B, T]
    if level == "sequence":
        log_r = ((log_r * mask).sum(-1) / lengths)[:, None]  # [B, 1]: GSPO's log s_i
        mask = torch.ones_like(log_r, dtype=torch.bool)
    r, A = torch.exp(log_r), advantages[:, None]
    kl_d = (case["ref"] - case["logps"])[:, P:].abs()
    groups = case["rewards"].view(N_PROMPTS, G)
    return {
        "clip_low": int(((A < 0) & (r < 1 - eps_low) & mask).sum()),
        "clip_high": int(((A > 0) & (r > 1 + eps_high) & mask).sum()),
        "equal_groups": int((groups.amax(-1) == groups.amin(-1)).sum()),
        "past_clamp": int(((kl_d > 20) & tokens).sum()),
        "padded_rows": int((lengths < T).sum()),
        "truncated_rows": int((~case["ends"]).sum()),
    }


def compare(row: Row, seed: int, workdir: Optional[str] = None) -> dict[str, Any]:
    """Max |loss diff|, max |grad diff| (and |advantage diff| for GRPO) between TRL and gcfamily on one random case."""
    with tempfile.TemporaryDirectory() if workdir is None else contextlib.nullcontext(workdir) as wd:
        if row.kind == "grpo":
            case = grpo_case(seed)
            trl, gcf = trl_grpo(row, case, wd), gcf_grpo(row, case)
        else:
            case = pair_case(seed)
            if row.float32:
                case = {k: v.float() if v.is_floating_point() else v for k, v in case.items()}
            trl = (trl_dpo if row.kind == "dpo" else trl_simpo)(row, case, wd)
            gcf = gcf_pairs(row, case)
    res = {
        "row": row.name,
        "loss_diff": abs(trl["loss"] - gcf["loss"]),
        "grad_diff": float((trl["grad"] - gcf["grad"]).abs().max()),
        "grad_scale": float(trl["grad"].abs().max()),
        "adv_diff": None,
    }
    if row.kind == "grpo":
        res["adv_diff"] = float((trl["advantages"] - gcf["advantages"]).abs().max())
        res["trl_calls"] = trl["calls"]  # which log-probs TRL's own code asked for: pi_old, pi_ref, pi
        if "old" in trl["calls"]:  # pi_old != pi
            eps = row.trl.get("epsilon", 0.2)
            level = row.trl.get("importance_sampling_level", "token")
            hi = row.trl.get("epsilon_high") or eps
            hi = hi - 1 if row.trl.get("loss_type") == "cispo" else hi  # cispo caps r at epsilon_high itself
            res["coverage"] = coverage(case, trl["advantages"], eps, hi, level)
    worst = max(res["loss_diff"], res["grad_diff"], res["adv_diff"] or 0.0)
    res["ok"] = worst <= TOL if row.expect == "match" else worst >= CONTROL_MIN
    return res


# ----------------------------------------------------------------------------------
# every loss option of TRL 1.16, enumerated from its code, and what each is here

LOSS_CODE = {
    "GRPOConfig": ("GRPOTrainer", ("_compute_loss", "_generate_and_score_completions")),
    "DPOConfig": ("DPOTrainer", ("_compute_loss",)),
}
"""The loss and advantage code whose option reads are enumerated: a config field it reads (self.X or self.args.X), and
each value it compares a choice field with (== "x", in [...])."""
ALIASES = {"epsilon_low": "epsilon", "loss_types": "loss_type", "precompute_ref_logps": "precompute_ref_log_probs"}
CHOICES = (
    "loss_type",
    "importance_sampling_level",
    "scale_rewards",
    "multi_objective_aggregation",
    "f_divergence_type",
    "vllm_importance_sampling_mode",
)
LOSS_CODE_ONLY = "reads no loss term: "  # the prefix of an option that shapes batches or logs, not the loss

R = "refused: "
OPTION_STATUS: dict[str, str] = {
    # -- GRPOConfig: fields the loss and advantage code read
    "GRPOConfig.beta": "grpo beta=0.04 (bias-corrected KL)",
    "GRPOConfig.delta": "grpo delta=1.5 [subclass]",
    "GRPOConfig.epsilon": "grpo epsilon=0.1 epsilon_high=0.3",
    "GRPOConfig.epsilon_high": "grpo epsilon=0.1 epsilon_high=0.3",
    "GRPOConfig.importance_sampling_level": "grpo importance_sampling_level=sequence (GSPO) [subclass]",
    "GRPOConfig.loss_type": "grpo",
    "GRPOConfig.mask_truncated_completions": "grpo mask_truncated_completions=True",
    "GRPOConfig.max_completion_length": "dr_grpo (scale_rewards=group, TRL's default)",
    "GRPOConfig.multi_objective_aggregation": "grpo multi_objective_aggregation=normalize_then_sum (two rewards, weights 1 and 0.5)",
    "GRPOConfig.num_iterations": "grpo",
    "GRPOConfig.off_policy_mask_threshold": "grpo off_policy_mask_threshold=0.0",
    "GRPOConfig.reward_weights": "grpo multi_objective_aggregation=normalize_then_sum (two rewards, weights 1 and 0.5)",
    "GRPOConfig.sapo_temperature_neg": "sapo temperatures 0.5/2.0",
    "GRPOConfig.sapo_temperature_pos": "sapo temperatures 0.5/2.0",
    "GRPOConfig.scale_rewards": "grpo scale_rewards=batch",
    "GRPOConfig.use_bias_correction_kl": "grpo beta=0.04 use_bias_correction_kl=False",
    "GRPOConfig.vespo_k_neg": "vespo k/lambda 1.5/2.5, 2.5/1.5, beta=0.04",
    "GRPOConfig.vespo_k_pos": "vespo k/lambda 1.5/2.5, 2.5/1.5, beta=0.04",
    "GRPOConfig.vespo_lambda_neg": "vespo k/lambda 1.5/2.5, 2.5/1.5, beta=0.04",
    "GRPOConfig.vespo_lambda_pos": "vespo k/lambda 1.5/2.5, 2.5/1.5, beta=0.04",
    "GRPOConfig.num_generations": "grpo",
    "GRPOConfig.entropy_coef": R + "the entropy bonus's gradient is not GC * grad log pi of the sampled tokens",
    "GRPOConfig.entropy_coef_delta": R + "the adaptive entropy bonus (entropy_coef's controller)",
    "GRPOConfig.entropy_coef_max": R + "the adaptive entropy bonus (entropy_coef's controller)",
    "GRPOConfig.entropy_coef_min": R + "the adaptive entropy bonus (entropy_coef's controller)",
    "GRPOConfig.entropy_target": R + "the adaptive entropy bonus (entropy_coef's controller)",
    "GRPOConfig.use_adaptive_entropy": R + "the adaptive entropy bonus (entropy_coef's controller)",
    "GRPOConfig.top_entropy_quantile": R + "the mask needs each position's entropy over the vocabulary",
    "GRPOConfig.router_aux_loss_coef": R + "a mixture-of-experts router loss: gcfamily trains none",
    "GRPOConfig.steps_per_generation": R + "num_minibatches splits a generation in order, TRL shuffles first",
    "GRPOConfig.use_vllm": "grpo vllm IS correction token_truncate [0.5, 2]",
    "GRPOConfig.vllm_importance_sampling_correction": "grpo vllm IS correction token_truncate [0.5, 2]",
    "GRPOConfig.vllm_importance_sampling_clip_max": "grpo vllm IS correction token_truncate [0.5, 2]",
    "GRPOConfig.vllm_importance_sampling_clip_min": "grpo vllm IS correction token_truncate [0.5, 2]",
    "GRPOConfig.vllm_importance_sampling_mode": "grpo vllm IS correction sequence_mask [0.5, 2]",
    "GRPOConfig.gradient_accumulation_steps": LOSS_CODE_ONLY + "micro_batch_size (gcfamily's Z counts the whole step)",
    "GRPOConfig.per_device_train_batch_size": LOSS_CODE_ONLY + "batch_size",
    "GRPOConfig.per_device_eval_batch_size": LOSS_CODE_ONLY + "evaluation batches",
    "GRPOConfig.num_generations_eval": LOSS_CODE_ONLY + "evaluation's samples per prompt",
    "GRPOConfig.pad_to_multiple_of": LOSS_CODE_ONLY + "padding",
    "GRPOConfig.chat_template_kwargs": LOSS_CODE_ONLY + "the chat template",
    "GRPOConfig.gradient_checkpointing_kwargs": LOSS_CODE_ONLY + "activation checkpointing",
    "GRPOConfig.log_multimodal": LOSS_CODE_ONLY + "logging",
    # -- GRPOConfig: the values of its choices
    "GRPOConfig.loss_type=grpo": "grpo",
    "GRPOConfig.loss_type=bnpo": "bnpo",
    "GRPOConfig.loss_type=dr_grpo": "dr_grpo (scale_rewards=group, TRL's default)",
    "GRPOConfig.loss_type=dapo": "dapo (TRL default: epsilon_high=epsilon)",
    "GRPOConfig.loss_type=luspo": "luspo, importance_sampling_level=token",
    "GRPOConfig.loss_type=cispo": "cispo epsilon_high=1.1 (TRL caps r at epsilon_high)",
    "GRPOConfig.loss_type=sapo": "sapo",
    "GRPOConfig.loss_type=vespo": "vespo",
    "GRPOConfig.importance_sampling_level=token": "grpo",
    "GRPOConfig.importance_sampling_level=sequence": "grpo importance_sampling_level=sequence (GSPO) [subclass]",
    "GRPOConfig.scale_rewards=group": "grpo",
    "GRPOConfig.scale_rewards=batch": "grpo scale_rewards=batch",
    "GRPOConfig.scale_rewards=none": "grpo scale_rewards=none",
    "GRPOConfig.multi_objective_aggregation=sum_then_normalize": "grpo",
    "GRPOConfig.multi_objective_aggregation=normalize_then_sum": "grpo multi_objective_aggregation=normalize_then_sum (two rewards, weights 1 and 0.5)",
    **{
        f"GRPOConfig.vllm_importance_sampling_mode={m}": f"grpo vllm IS correction {m} [0.5, 2]"
        for m in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    },
    # -- DPOConfig
    "DPOConfig.beta": "dpo sigmoid",
    "DPOConfig.loss_type": "dpo sigmoid",
    "DPOConfig.label_smoothing": "dpo robust eps=0.1",
    "DPOConfig.discopop_tau": "dpo discopop tau=0.5",
    "DPOConfig.f_divergence_type": "dpo f_divergence=forward_kl",
    "DPOConfig.f_alpha_divergence_coef": "dpo f_divergence=alpha_divergence, alpha=0.3 (float32)",
    "DPOConfig.ld_alpha": "dpo ld_alpha=0.5",
    "DPOConfig.precompute_ref_log_probs": "dpo sigmoid",
    "DPOConfig.loss_weights": R
    + "several loss types summed, with the micro-batch token mean of sft: no gcfamily method sums them",
    "DPOConfig.use_weighting": R + "WPO's weights need sum_v pi(v)^2 at each position, over the vocabulary",
    "DPOConfig.router_aux_loss_coef": R + "a mixture-of-experts router loss: gcfamily trains none",
    "DPOConfig.gradient_checkpointing_kwargs": LOSS_CODE_ONLY + "activation checkpointing",
    "DPOConfig.loss_type=sigmoid": "dpo sigmoid",
    "DPOConfig.loss_type=hinge": "dpo hinge",
    "DPOConfig.loss_type=ipo": "dpo ipo (per-token means) as ipo-norm",
    "DPOConfig.loss_type=exo_pair": "dpo exo_pair eps=1e-3",
    "DPOConfig.loss_type=nca_pair": "dpo nca_pair",
    "DPOConfig.loss_type=robust": "dpo robust eps=0.1",
    "DPOConfig.loss_type=bco_pair": "dpo bco_pair",
    "DPOConfig.loss_type=sppo_hard": "dpo sppo_hard",
    "DPOConfig.loss_type=apo_zero": "dpo apo_zero",
    "DPOConfig.loss_type=apo_down": "dpo apo_down",
    "DPOConfig.loss_type=discopop": "dpo discopop tau=0.05",
    "DPOConfig.loss_type=sigmoid_norm": "dpo sigmoid_norm",
    "DPOConfig.loss_type=aot": R
    + "the loss sorts the micro-batch's log-ratios across pairs: a pair's gradient depends on how a step is split",
    "DPOConfig.loss_type=aot_unpaired": R
    + "the loss sorts the micro-batch's log-ratios across pairs: a pair's gradient depends on how a step is split",
    "DPOConfig.loss_type=sft": R
    + "the NLL averaged over the micro-batch's chosen tokens (a token count, not pairs), alone or in loss_weights",
    "DPOConfig.f_divergence_type=reverse_kl": "dpo sigmoid",
    "DPOConfig.f_divergence_type=forward_kl": "dpo f_divergence=forward_kl",
    "DPOConfig.f_divergence_type=js_divergence": "dpo f_divergence=js_divergence",
    "DPOConfig.f_divergence_type=alpha_divergence": "dpo f_divergence=alpha_divergence, alpha=0.3 (float32)",
}
"""Each option TRL's loss code reads: the ROWS row that checks it, "refused: " and why, or what it shapes besides the
loss. `enumerate_options` must find no option this table lacks, and every row named must be a row."""


def enumerate_options() -> list[str]:
    """TRL's loss options, read from its code (LOSS_CODE): "Config.field" and "Config.field=value"."""
    import inspect
    import re

    import trl

    found: set[str] = set()
    pick = re.compile(r"(" + "|".join(CHOICES) + r")\s*(?:==|!=|in)\s*(\[[^\]]*\]|\"[^\"]*\"|\([^)]*\))")
    for cfg_name, (trainer, fns) in LOSS_CODE.items():
        fields = {f.name for f in dataclasses.fields(getattr(trl, cfg_name))}
        src = "".join(inspect.getsource(getattr(getattr(trl, trainer), fn)) for fn in fns)
        names = set(re.findall(r"self\.args\.(\w+)", src)) | set(re.findall(r"self\.(\w+)", src))
        found |= {f"{cfg_name}.{ALIASES.get(n, n)}" for n in names if ALIASES.get(n, n) in fields}
        for field_name, rhs in pick.findall(src):
            found |= {f"{cfg_name}.{field_name}={v}" for v in re.findall(r'"([^"]*)"', rhs)}
    return sorted(found)


def option_counts(results: dict[str, bool]) -> tuple[int, int, int, list[str]]:
    """(checked, refused, loss-free, problems) over the enumerated options: a checked option's row must exist and
    have come out as expected (results: row name -> ok)."""
    checked = refused = free = 0
    problems = []
    for opt in enumerate_options():
        st = OPTION_STATUS.get(opt)
        if st is None:
            problems.append(f"{opt}: UNMAPPED (TRL's loss code reads it; add its row or its reason)")
        elif st.startswith(R):
            refused += 1
        elif st.startswith(LOSS_CODE_ONLY):
            free += 1
        elif st not in results:
            problems.append(f"{opt}: its row '{st}' was not run")
        elif not results[st]:
            problems.append(f"{opt}: its row '{st}' failed")
        else:
            checked += 1
    return checked, refused, free, problems


def mixup_diff(alpha: float) -> float:
    """Max |difference| between gcfamily's mix_reference and TRL's own SyncRefModelCallback._sync_target_model on two
    random float64 modules of one layout."""
    from trl.trainer.callbacks import SyncRefModelCallback

    from gcfamily.methods.grpo import mix_reference

    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3)).double()
    ref = copy.deepcopy(policy)
    for p in ref.parameters():
        p.data.add_(torch.randn_like(p))
    theirs = copy.deepcopy(ref)
    mix_reference(ref, policy, alpha)
    SyncRefModelCallback._sync_target_model(policy, theirs, alpha)
    return max(float((a - b).detach().abs().max()) for a, b in zip(ref.parameters(), theirs.parameters()))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="random cases per row")
    ap.add_argument("--rows", default="", help="comma-separated substrings of row names (default: every row)")
    a = ap.parse_args(argv)
    try:
        import trl
    except ImportError:
        print('TRL is not installed (pip install trl==1.16.0 "torch==2.13.0"); nothing to compare.')
        return 0
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=r".*`gradient_checkpointing` is deprecated", category=FutureWarning)
    rows = [r for r in ROWS if not a.rows or any(s in r.name for s in a.rows.split(","))]
    print(
        f"TRL {trl.__version__}, torch {torch.__version__}, float64; {a.seeds} random case(s) per row; tolerance {TOL:g}"
    )
    print(
        f"{'row':<62} {'expect':<6} {'|loss diff|':>11} {'|grad diff|':>11} {'|adv diff|':>10} {'max|grad|':>9}  status"
    )
    failed = 0
    row_ok: dict[str, bool] = {}
    cov: dict[str, int] = defaultdict(int)
    with tempfile.TemporaryDirectory() as wd:
        for row in rows:
            results = [compare(row, seed, wd) for seed in range(a.seeds)]
            ld, gd = max(r["loss_diff"] for r in results), max(r["grad_diff"] for r in results)
            ad = [r["adv_diff"] for r in results if r["adv_diff"] is not None]
            ok = all(r["ok"] for r in results)
            row_ok[row.name] = ok
            failed += not ok
            for r in results:
                for k, v in r.get("coverage", {}).items():
                    cov[k] += v
            adv = f"{max(ad):10.2e}" if ad else f"{'-':>10}"
            status = ("ok" if ok else "FAIL") + (
                "" if row.expect == "match" else " (differs, as expected)" if ok else " (control matched)"
            )
            print(
                f"{row.name:<62} {row.expect:<6} {ld:11.2e} {gd:11.2e} {adv} {max(r['grad_scale'] for r in results):9.2e}  {status}"
            )
    print(
        "GRPO cases reached (summed over rows and seeds; clips count tokens, or rows for a sequence ratio): "
        + ", ".join(f"{k} {v}" for k, v in cov.items())
    )
    if not a.rows:  # every row ran: the enumerated options against them
        checked, refused, free, problems = option_counts(row_ok)
        print(
            f"TRL's loss options enumerated from its code: {len(enumerate_options())}; checked by a row {checked}, "
            f"refused with a reason {refused}, no loss term {free}"
        )
        for p in problems:
            print("  " + p)
        failed += len(problems)
    mix = mixup_diff(0.6)
    print(
        f"ref_model_mixup_alpha=0.6 (gcfamily's ref_mixup_alpha, mix_reference) vs TRL's SyncRefModelCallback: max |diff| {mix:.2e}"
    )
    failed += mix > 0.0  # the same float64 arithmetic: equal to the bit
    print(f"{len(rows) - failed} of {len(rows)} rows as expected" + ("" if not failed else f"; {failed} FAILED"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
