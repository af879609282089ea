"""Loss parity with verl 0.9.1: every option of verl's `core_algos.py` mapped to gcfamily, and each one gcfamily can
express checked against verl's own code on the same tensors.

    /tmp/verl-venv/bin/python benchmarks/verl_parity.py           # enumerate verl's options, check, print the table
    /tmp/verl-venv/bin/python benchmarks/verl_parity.py --seeds 5 --rows vanilla,gspo
    python benchmarks/verl_parity.py --markdown                    # the mapping table of docs/verl-mapping.md (no verl)

The check runs in a venv of its own, never gcfamily's (verl is not a dependency; gcfamily never imports it):

    python3 -m venv /tmp/verl-venv
    /tmp/verl-venv/bin/pip install torch==2.13.0               # the CPU build; an unpinned torch pulls CUDA
    /tmp/verl-venv/bin/pip install --no-deps verl==0.9.1
    /tmp/verl-venv/bin/pip install packaging numpy omegaconf codetiming "tensordict==0.10.0"
    /tmp/verl-venv/bin/pip install einops pyyaml "transformers==5.25.0"   # gcfamily's own imports on this path
    PYTHONPATH=. /tmp/verl-venv/bin/python benchmarks/verl_parity.py

None of these changes torch (pip list shows 2.13.0+cpu after each). verl 0.9.1 asks for transformers < 5.11; its loss
code imports only a type name from it, and gcfamily's modules want the 5.25 they are tested with. `verl/protocol.py`
imports `ray` at module level, which is not installed: `_stub_modules` puts an empty stand-in module on the import
path for it (and for transformers, where that is absent) before verl loads; no function this check calls touches
them, and the header line names what was stubbed. Without verl the script prints the mapping and exits 0.

Every row is one verl option (enumerated from verl's code, so the table cannot miss one: POLICY_LOSS_REGISTRY, the
AdvantageEstimator enum, agg_loss's loss_agg_mode branches, kl_penalty_forward's estimator names and their "+"
straight-through forms, in the loss (actor.use_kl_loss) and in the reward (algorithm.use_kl_in_reward), the KL
controllers, the rollout-correction levels, thresholds and rejection options). MAPPING says, per option, either a
`Check` (gcfamily's --method and --set, and verl's settings) or the one-sentence reason gcfamily cannot express it.
A new gcfamily method makes a row checkable by replacing its reason with a Check, e.g.

    "policy_loss.loss_mode=sapo": Check("sapo", "mu=2 std_eps=1e-6 beta=0 loss_norm=sequence ...",
                                        {"loss_mode": "sapo", "tau_pos": 1.0, "tau_neg": 1.05}),

where the dict holds verl's settings beyond VERL_BASE: any field of verl's ActorConfig or PolicyLossConfig, or a key of
VERL_BASE (the advantage estimator, the KL in the reward, the rollout correction).

A Check runs, on random float64 (then float32) inputs, 4 prompts x 4 samples, right-padded completions of
different lengths, an all-equal reward group and a binary one, pi_old != pi (mu = 2), pi_ref with tokens past
|log rho| = 20 and with k3 > 10, and sampler log-probs for the rollout correction:

- verl: its own functions. The token-level scores (the reward on each completion's last token) minus, with
  use_kl_in_reward, kl_coef * `kl_penalty(old, ref)` (ray_trainer.apply_kl_penalty's two lines, which need
  DataProto); `get_adv_estimator_fn(name)` for the advantages; `compute_rollout_correction_weights` for the IS
  weights; `get_policy_loss_fn(loss_mode)` with a real `ActorConfig`, plus with use_kl_loss kl_loss_coef *
  `agg_loss(kl_penalty(logp, ref))`, as `verl/workers/utils/losses.py::ppo_loss` composes them for one process.
- gcfamily: the real method class built from the row's --set strings as `gcf run` builds it, then `prepare`,
  `engine.normaliser`, `coefficient` and `engine.weighted_loss` (benchmarks/trl_parity.py's `_step`), as
  gcfamily/run/step.py runs one micro-batch.

Compared: the loss (verl's value against minus the method's textbook `objective`), the gradient with respect to
the current log-probs (verl's autograd against the engine's one loss) and the advantages. A row passes with loss
and gradient within 1e-6 in float64 and 1e-4 in float32 (both implementations round differently there), and the
advantages within 1e-5 and 1e-4 (gcfamily computes them from float32 rewards: ADV_TOL). expect="grad" compares the
gradient and advantages only (a straight-through estimator whose value is another's). A control (expect="differ")
is a near-miss a user might take for verl's setting; it fails unless it differs by at least 1e-4.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

ROOT = Path(__file__).resolve().parents[1]
VERL_VERSION = "0.9.1"
N_PROMPTS, G, P, T = 4, 4, 2, 8  # 4 prompts x 4 samples, prompt 2 tokens, completions <= 8 (verl's response width)
TOL = {torch.float64: 1e-6, torch.float32: 1e-4}
# gcfamily computes advantages from float32 rewards (GRPO.add_advantages reads batch.rewards and kl_rewards as float32),
# so in a float64 case its advantages carry float32 rounding divided by the group's std: up to ~1e-6 where a KL in the
# reward makes a group's rewards differ by ~0.01. The loss and gradient still meet TOL.
ADV_TOL = {torch.float64: 1e-5, torch.float32: 1e-4}
CONTROL_MIN = 1e-4

# ----------------------------------------------------------------------------------
# the mapping: verl option -> a Check (how gcfamily says it) or the reason gcfamily cannot


@dataclass(frozen=True)
class Check:
    """A verl option as gcfamily settings: gcfamily's --method and --set, and the verl settings the check runs."""

    method: str
    sets: str
    verl: dict = field(default_factory=dict)  # overrides of VERL_BASE
    expect: str = "match"  # match | grad (gradient and advantages only) | differ (a control)
    case: str = "full"  # full | tame (every |log pi_ref/pi| <= 2, so verl's k3 clamp at 10 is never reached)


# verl's settings of every Check unless it overrides one. clip_ratio_c=1e9 turns verl's dual clip off (its default
# 3.0 is dual-clip PPO, which gcfamily does not express: see actor.clip_ratio_c).
VERL_BASE: dict[str, Any] = {
    "adv_estimator": "grpo",
    "norm_adv_by_std_in_grpo": True,
    "loss_mode": "vanilla",
    "loss_agg_mode": "token-mean",
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "clip_ratio_c": 1e9,
    "loss_scale_factor": None,
    "use_kl_loss": False,
    "kl_loss_type": "low_var_kl",
    "kl_loss_coef": 0.04,
    "use_kl_in_reward": False,
    "kl_penalty": "kl",
    "kl_coef": 0.04,
    "rollout_is": None,
    "rollout_is_threshold": 2.0,
    "gamma": 1.0,
    "lam": 1.0,
}
GC = "mu=2 std_eps=1e-6 beta=0 loss_norm=token"  # verl's GRPO epsilon 1e-6 on the sample std; token-mean
KL = "mu=2 std_eps=1e-6 beta=0.04 loss_norm=token"  # with verl's kl_loss_coef / kl_coef 0.04


def _kl_loss(name: str, gc_name: Optional[str], clamp: str = "kl_clamp=none", **kw: Any) -> Check:
    return Check(
        "grpo",
        f"{KL} kl_estimator={gc_name} {clamp}",
        {"use_kl_loss": True, "kl_loss_type": name},
        **kw,
    )


def _kl_reward(name: str, gc_name: str, clamp: str = "kl_clamp=none", **kw: Any) -> Check:
    return Check(
        "grpo",
        f"{KL} kl_placement=reward kl_estimator={gc_name} {clamp}",
        {"use_kl_in_reward": True, "kl_penalty": name},
        **kw,
    )


K3_CLAMP = (
    "verl clamps log(pi_ref/pi) to +-20 and then k3 itself to [-10, 10] (no gradient past 10); gcfamily's kl_clamp=20 "
    "is the first clamp only, so tokens with k3 > 10 differ (the tame row shows the rest is exact)"
)
NO_ABS = "|log pi - log pi_ref| is not among gcfamily's kl_estimator values (k1, k2, k3, k3-importance-weighted)"
NO_FULL = "verl raises NotImplementedError for it (a full-vocabulary KL needs every logit)"
PLUS = (
    "straight-through: k3's value with k2's gradient; kl_estimator=k2 gives the same gradient (checked) but "
    "reports k2's value, and gcfamily has no estimator whose value and gradient come from two formulas"
)
BYPASS = (
    "bypass mode takes the sampler's log-probs as pi_old; gcfamily always recomputes pi_old with the trainer and "
    "corrects the gap with tis"
)
PF_PPO = "policy-filtered PPO resamples the batch by weights of its rewards; gcfamily has no resampling of a batch"
GSPO_SETS = "mu=2 std_eps=1e-6 beta=0 epsilon=0.05 epsilon_high=0.08"
GSPO_VERL = {"loss_mode": "gspo", "clip_ratio_low": 0.05, "clip_ratio_high": 0.08}

MAPPING: dict[str, Union[Check, str]] = {
    # -- policy losses: POLICY_LOSS_REGISTRY
    "policy_loss.loss_mode=vanilla": Check("grpo", GC),
    "policy_loss.loss_mode=gspo": Check(
        "gspo", f"{GSPO_SETS} loss_norm=sequence", {**GSPO_VERL, "loss_agg_mode": "seq-mean-token-mean"}
    ),
    "policy_loss.loss_mode=gspo, loss_agg_mode=token-mean": Check("gspo", f"{GSPO_SETS} loss_norm=token", GSPO_VERL),
    "policy_loss.loss_mode=cispo": Check(
        "cispo",
        "mu=2 std_eps=1e-6 beta=0 epsilon=0.2 epsilon_high=0.28 loss_norm=token",
        {"loss_mode": "cispo", "clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
    ),
    "policy_loss.loss_mode=gpg": (
        "gcfamily's gpg scales A = R - mean R by the paper's alpha = B / (samples with a gradient), verl's by B / (samples with a non-zero reward): checked against verl with --method gpg, its advantages differ by up to 0.37 on the check's case, so the row is the reason, not a match"
    ),
    "policy_loss.loss_mode=geo_mean": Check(
        "gmpo",
        "mu=2 std_eps=1e-6 beta=0 epsilon=0.2 epsilon_high=0.2 loss_norm=sequence",
        {"loss_mode": "geo_mean", "loss_agg_mode": "seq-mean-token-mean"},
    ),
    "policy_loss.loss_mode=sapo": Check(
        "sapo",
        "mu=2 std_eps=1e-6 beta=0 loss_norm=sequence",
        {"loss_mode": "sapo", "tau_pos": 1.0, "tau_neg": 1.05, "loss_agg_mode": "seq-mean-token-mean"},
    ),
    "policy_loss.loss_mode=clip_cov": "Clip-Cov detaches a random share of high-covariance tokens chosen per batch; gcfamily has no such rule",
    "policy_loss.loss_mode=kl_cov": "KL-Cov adds a KL penalty on a top-k share of high-covariance tokens; gcfamily has no such rule",
    "policy_loss.loss_mode=dppo_tv": "DPPO's binary total-variation trust region (a mask on |pi - pi_old|) is no gcfamily rule",
    "policy_loss.loss_mode=dppo_kl": "DPPO's binary KL trust region (a mask on the per-token KL to pi_old) is no gcfamily rule",
    "policy_loss.loss_mode=dro": "DRO's -A log pi + beta/2 (log pi/pi_old)^2 with no ratio is no gcfamily method",
    "policy_loss.loss_mode=bypass_mode": BYPASS,
    "actor.clip_ratio_c (dual clip, default 3.0)": Check("grpo", f"{GC} dual_clip=3", {"clip_ratio_c": 3.0}),
    # -- advantage estimators: AdvantageEstimator
    "algorithm.adv_estimator=grpo": Check("grpo", GC),
    "algorithm.adv_estimator=grpo, norm_adv_by_std_in_grpo=False": Check(
        "grpo", f"{GC} scale_rewards=none", {"norm_adv_by_std_in_grpo": False}
    ),
    "algorithm.adv_estimator=grpo_vectorized": Check("grpo", GC, {"adv_estimator": "grpo_vectorized"}),
    "algorithm.adv_estimator=rloo": Check("rloo", GC, {"adv_estimator": "rloo"}),
    "algorithm.adv_estimator=rloo_vectorized": Check("rloo", GC, {"adv_estimator": "rloo_vectorized"}),
    "algorithm.adv_estimator=gae": Check("ppo", "mu=2 beta=0 lam=1.0", {"adv_estimator": "gae"}),
    "algorithm.adv_estimator=gae, gamma=0.99 lam=0.95": Check(
        "ppo", "mu=2 beta=0 gamma=0.99 lam=0.95", {"adv_estimator": "gae", "gamma": 0.99, "lam": 0.95}
    ),
    "algorithm.adv_estimator=gae, use_kl_in_reward, kl_penalty=kl": Check(
        "ppo",
        "mu=2 beta=0.04 lam=1.0 kl_placement=reward kl_estimator=k1 kl_clamp=none",
        {"adv_estimator": "gae", "use_kl_in_reward": True},
    ),
    "algorithm.adv_estimator=reinforce_plus_plus": Check(
        "reinforce-pp", "mu=2 beta=0 loss_norm=token", {"adv_estimator": "reinforce_plus_plus"}
    ),
    "algorithm.adv_estimator=reinforce_plus_plus_baseline": Check(
        "reinforce-pp-baseline", "mu=2 beta=0 loss_norm=token", {"adv_estimator": "reinforce_plus_plus_baseline"}
    ),
    "algorithm.adv_estimator=remax": "ReMax subtracts the reward of a greedy rollout; gcfamily samples no greedy baseline",
    "algorithm.adv_estimator=opo": Check("opo", "mu=2 beta=0 loss_norm=token", {"adv_estimator": "opo"}),
    "algorithm.adv_estimator=grpo_passk": Check("grpo-passk", GC, {"adv_estimator": "grpo_passk"}),
    "algorithm.adv_estimator=grpo_passk, norm_adv_by_std_in_grpo=False": Check(
        "grpo-passk", f"{GC} scale_rewards=none", {"adv_estimator": "grpo_passk", "norm_adv_by_std_in_grpo": False}
    ),
    "algorithm.adv_estimator=gpg": (
        "gcfamily's gpg scales A = R - mean R by the paper's alpha = B / (samples with a gradient), verl's by B / (samples with a non-zero reward): checked against verl with --method gpg, its advantages differ by up to 0.37 on the check's case, so the row is the reason, not a match"
    ),
    "algorithm.adv_estimator=optimal_token_baseline": "a per-token baseline weighted by the policy's gradient norms needs statistics gcfamily does not compute",
    "algorithm.adv_estimator=tir_optimal_token_baseline": "the multi-turn optimal token baseline needs statistics gcfamily does not compute",
    "algorithm.adv_estimator=gdpo": "GDPO normalises each reward function separately before summing; gcfamily normalises the weighted sum",
    # -- loss aggregation: agg_loss
    "actor.loss_agg_mode=token-mean": Check("grpo", GC),
    "actor.loss_agg_mode=seq-mean-token-mean": Check(
        "grpo", "mu=2 std_eps=1e-6 beta=0 loss_norm=sequence", {"loss_agg_mode": "seq-mean-token-mean"}
    ),
    "actor.loss_agg_mode=seq-mean-token-sum": Check(
        "grpo", "mu=2 std_eps=1e-6 beta=0 loss_norm=sum", {"loss_agg_mode": "seq-mean-token-sum"}
    ),
    "actor.loss_agg_mode=seq-mean-token-sum-norm": Check(
        "grpo",
        f"mu=2 std_eps=1e-6 beta=0 loss_norm=constant norm_constant={T}",
        {"loss_agg_mode": "seq-mean-token-sum-norm"},
    ),
    "actor.loss_agg_mode=seq-mean-token-sum-norm, loss_scale_factor=5": Check(
        "grpo",
        "mu=2 std_eps=1e-6 beta=0 loss_norm=constant norm_constant=5",
        {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 5},
    ),
    "actor.loss_agg_mode=token-sum": "a sum with no division: gcfamily's normalisers all divide by a count of the step (norm_constant=1/B gives it for one fixed B only)",
    # -- KL in the loss: actor.use_kl_loss, actor.kl_loss_type (kl_penalty's names)
    "actor.kl_loss_type=kl": _kl_loss("kl", "k1"),
    "actor.kl_loss_type=k1": _kl_loss("k1", "k1"),
    "actor.kl_loss_type=mse": _kl_loss("mse", "k2"),
    "actor.kl_loss_type=k2": _kl_loss("k2", "k2"),
    "actor.kl_loss_type=low_var_kl": K3_CLAMP,
    "actor.kl_loss_type=k3": K3_CLAMP,
    "actor.kl_loss_type=low_var_kl, every |log rho| <= 2": _kl_loss("low_var_kl", "k3", "kl_clamp=20", case="tame"),
    "actor.kl_loss_type=k3, every |log rho| <= 2": _kl_loss("k3", "k3", "kl_clamp=20", case="tame"),
    "actor.kl_loss_type=abs": NO_ABS,
    "actor.kl_loss_type=full": NO_FULL,
    "actor.kl_loss_type=kl+": _kl_loss("kl+", "k2", expect="grad"),
    "actor.kl_loss_type=k1+": _kl_loss("k1+", "k2", expect="grad"),
    "actor.kl_loss_type=mse+": _kl_loss("mse+", "k2"),
    "actor.kl_loss_type=k2+": _kl_loss("k2+", "k2"),
    "actor.kl_loss_type=low_var_kl+": PLUS,
    "actor.kl_loss_type=k3+": PLUS,
    "actor.kl_loss_type=low_var_kl+, gradient only": _kl_loss("low_var_kl+", "k2", expect="grad"),
    "actor.kl_loss_type=abs+": "abs+ is |log rho|'s value with k2's gradient; gcfamily has no estimator whose value and gradient come from two formulas",
    # -- KL in the reward: algorithm.use_kl_in_reward, algorithm.kl_penalty
    "algorithm.kl_penalty=kl": _kl_reward("kl", "k1"),
    "algorithm.kl_penalty=k1": _kl_reward("k1", "k1"),
    "algorithm.kl_penalty=mse": _kl_reward("mse", "k2"),
    "algorithm.kl_penalty=k2": _kl_reward("k2", "k2"),
    "algorithm.kl_penalty=low_var_kl": K3_CLAMP,
    "algorithm.kl_penalty=k3": K3_CLAMP,
    "algorithm.kl_penalty=low_var_kl, every |log rho| <= 2": _kl_reward("low_var_kl", "k3", "kl_clamp=20", case="tame"),
    "algorithm.kl_penalty=k3, every |log rho| <= 2": _kl_reward("k3", "k3", "kl_clamp=20", case="tame"),
    "algorithm.kl_penalty=abs": NO_ABS,
    "algorithm.kl_penalty=full": NO_FULL,
    "algorithm.kl_ctrl.type=fixed": _kl_reward("kl", "k1"),
    "algorithm.kl_ctrl.type=adaptive": "the adaptive KL controller changes beta each step toward a target KL; gcfamily's beta is fixed",
    # -- rollout correction: algorithm.rollout_correction
    "rollout_correction.rollout_is=token, threshold=2.0": Check(
        "grpo", f"{GC} tis=token_truncate tis_max=2.0", {"rollout_is": "token", "rollout_is_threshold": 2.0}
    ),
    "rollout_correction.rollout_is=token, threshold=0.5_2.0 (IcePop)": Check(
        "grpo",
        f"{GC} tis=token_mask tis_min=0.5 tis_max=2.0",
        {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"},
    ),
    "rollout_correction.rollout_is=sequence, threshold=2.0": Check(
        "grpo", f"{GC} tis=sequence_truncate tis_max=2.0", {"rollout_is": "sequence", "rollout_is_threshold": 2.0}
    ),
    "rollout_correction.rollout_is=sequence, threshold=0.5_2.0": Check(
        "grpo",
        f"{GC} tis=sequence_mask tis_min=0.5 tis_max=2.0",
        {"rollout_is": "sequence", "rollout_is_threshold": "0.5_2.0"},
    ),
    "rollout_correction.rollout_is=sequence on policy_loss.loss_mode=gspo": Check(
        "gspo",
        f"{GSPO_SETS} loss_norm=token tis=sequence_truncate tis_max=2.0",
        {**GSPO_VERL, "rollout_is": "sequence", "rollout_is_threshold": 2.0},
    ),
    "rollout_correction.rollout_is_batch_normalize=True": "dividing the IS weights by their batch mean is no gcfamily setting (tis weights are truncated or masked only)",
    "rollout_correction.bypass_mode=True, loss_type=ppo_clip": BYPASS,
    "rollout_correction.bypass_mode=True, loss_type=reinforce": BYPASS,
    # -- the rest of the actor's and the algorithm's loss settings
    "actor.entropy_coeff > 0": "an entropy bonus needs each position's entropy over the whole vocabulary; gcfamily's coefficient multiplies the sampled tokens' log-probs only",
    "algorithm.use_pf_ppo, reweight_method=pow": PF_PPO,
    "algorithm.use_pf_ppo, reweight_method=max_min": PF_PPO,
    "algorithm.use_pf_ppo, reweight_method=max_random": PF_PPO,
    "algorithm.filter_groups (DAPO dynamic sampling)": "over-sampling and dropping equal-reward groups until the batch is full is no gcfamily setting (zero_std=exclude drops them without refilling)",
}
for _opt in ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
             "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"):  # fmt: skip
    MAPPING[f"rollout_correction.rollout_rs={_opt}"] = (
        "rejection sampling on a divergence between pi_old and the sampler is no gcfamily setting (tis masks by "
        "the ratio itself: token_mask / sequence_mask)"
    )

# controls: near-misses that must differ from verl's setting
CONTROLS: dict[str, Check] = {
    "control: vanilla with verl's default clip_ratio_c=3.0 (dual clip) as grpo": Check(
        "grpo", GC, {"clip_ratio_c": 3.0}, "differ"
    ),
    "control: opo as rloo (a plain leave-one-out baseline)": Check(
        "rloo", "mu=2 beta=0 loss_norm=token", {"adv_estimator": "opo"}, "differ"
    ),
    "control: grpo_passk as grpo": Check("grpo", GC, {"adv_estimator": "grpo_passk"}, "differ"),
    "control: reinforce_plus_plus_baseline as reinforce-pp (no group baseline)": Check(
        "reinforce-pp", "mu=2 beta=0 loss_norm=token", {"adv_estimator": "reinforce_plus_plus_baseline"}, "differ"
    ),
    "control: gae with gcfamily ppo's default lam=0.95": Check(
        "ppo", "mu=2 beta=0", {"adv_estimator": "gae"}, "differ"
    ),
    "control: grpo with std=population (verl's torch.std is the sample std)": Check(
        "grpo", f"{GC} std=population", expect="differ"
    ),
    "control: kl_loss_type=k1+ with its value checked too": _kl_loss("k1+", "k2", expect="differ"),
    "control: token-mean as gcfamily's default loss_norm=sequence": Check(
        "grpo", "mu=2 std_eps=1e-6 beta=0", expect="differ"
    ),
    "control: low_var_kl (full case) as k3 kl_clamp=20": _kl_loss("low_var_kl", "k3", "kl_clamp=20", expect="differ"),
    "control: kl in the loss as kl_placement=reward": Check(
        "grpo",
        f"{KL} kl_placement=reward kl_estimator=k1 kl_clamp=none",
        {"use_kl_loss": True, "kl_loss_type": "kl"},
        "differ",
    ),
    "control: seq-mean-token-sum-norm with gcfamily's norm_constant=1": Check(
        "grpo", "mu=2 std_eps=1e-6 beta=0 loss_norm=constant", {"loss_agg_mode": "seq-mean-token-sum-norm"}, "differ"
    ),
    "control: rollout_is=token 2.0 with gcfamily's default tis_max=3": Check(
        "grpo", f"{GC} tis=token_truncate", {"rollout_is": "token", "rollout_is_threshold": 2.0}, "differ"
    ),
    "control: rollout_is=token on verl's gspo (verl weighs each token, gcfamily the row's mean)": Check(
        "gspo",
        f"{GSPO_SETS} loss_norm=token tis=token_truncate tis_max=2.0",
        {**GSPO_VERL, "rollout_is": "token", "rollout_is_threshold": 2.0},
        "differ",
    ),
}


def spelling(entry: Union[Check, str]) -> str:
    return f"`--method {entry.method} --set {entry.sets}`" if isinstance(entry, Check) else "not expressible"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bar inside a markdown table cell


def markdown_table() -> str:
    """docs/verl-mapping.md's table, from MAPPING and CONTROLS alone (no verl needed)."""
    lines = ["| verl option | gcfamily | status |", "|---|---|---|"]
    for opt, entry in MAPPING.items():
        if isinstance(entry, Check):
            status = "checked" + (
                " (gradient and advantages; the value is another estimator's)" if entry.expect == "grad" else ""
            )
            lines.append(f"| {_cell(opt)} | {spelling(entry)} | {status} |")
        else:
            lines.append(f"| {_cell(opt)} | not expressible | {_cell(entry)} |")
    for name, c in CONTROLS.items():
        lines.append(f"| {_cell(name)} | {spelling(c)} | control: must differ |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------
# verl, loaded with stand-ins for the heavy modules it imports but this check never calls


class _Stub(types.ModuleType):
    """A module any attribute of which is another stub; calling one returns a stub (a decorator returns its function)."""

    __path__: list = []

    def __getattr__(self, k: str) -> Any:
        if k.startswith("__"):
            raise AttributeError(k)
        return _Stub(f"{self.__name__}.{k}")

    def __call__(self, *a: Any, **kw: Any) -> Any:
        return a[0] if len(a) == 1 and callable(a[0]) and not kw else _Stub("call")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        return importlib.machinery.ModuleSpec(name, self) if name.split(".")[0] in self.roots else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Stub(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _stub_modules(roots: set[str]) -> set[str]:
    """Stand-ins for those of `roots` that are not installed; returns their names."""
    missing = {r for r in roots if importlib.util.find_spec(r) is None}
    if missing:
        sys.meta_path.insert(0, _StubFinder(missing))
    return missing


def load_verl() -> Optional[types.SimpleNamespace]:
    """verl's core_algos, its rollout-correction helper and ActorConfig; None where verl is not installed."""
    if importlib.util.find_spec("verl") is None:
        return None
    stubbed = _stub_modules({"ray", "transformers"})
    import verl
    import verl.trainer.ppo.core_algos as ca
    import verl.trainer.ppo.rollout_corr_helper as rc
    from verl.trainer.config import AlgoConfig
    from verl.workers.config import ActorConfig, PolicyLossConfig

    return types.SimpleNamespace(
        version=verl.__version__,
        stubbed=sorted(stubbed),
        ca=ca,
        rc=rc,
        ActorConfig=ActorConfig,
        AlgoConfig=AlgoConfig,
        PolicyLossConfig=PolicyLossConfig,
    )


def _strings(src: str, pattern: str) -> list[str]:
    """Quoted names in the parts of `src` that `pattern` matches (an == "x" or an in ("x", "y"))."""
    out: list[str] = []
    for m in re.finditer(pattern, src):
        out += [s for s in re.findall(r'"([^"]+)"', m.group(1)) if s not in out]
    return out


def enumerate_verl(v: types.SimpleNamespace) -> list[str]:
    """Every option of verl's loss code, read from the code itself, as MAPPING's keys spell them."""
    ca, rc = v.ca, v.rc
    opts = [f"policy_loss.loss_mode={n}" for n in ca.POLICY_LOSS_REGISTRY]
    opts += (
        ["actor.clip_ratio_c (dual clip, default 3.0)"]
        if "clip_ratio_c" in inspect.getsource(ca.compute_policy_loss_vanilla)
        else []
    )
    opts += [f"algorithm.adv_estimator={e.value}" for e in ca.AdvantageEstimator]
    opts += [
        f"actor.loss_agg_mode={n}"
        for n in _strings(inspect.getsource(ca.agg_loss), r"loss_agg_mode (?:==|in) (\[[^\]]*\]|\"[^\"]*\")")
    ]
    kls = [
        n for n in _strings(inspect.getsource(ca.kl_penalty_forward), r"kl_penalty (?:==|in) (\([^)]*\)|\"[^\"]*\")")
    ]
    opts += [f"actor.kl_loss_type={n}" for n in kls]
    opts += [f"actor.kl_loss_type={n}+" for n in kls if n != "full"]  # kl_penalty strips a trailing "+"
    opts += [f"algorithm.kl_penalty={n}" for n in kls]
    opts += [
        f"algorithm.kl_ctrl.type={n}"
        for n in _strings(inspect.getsource(ca.get_kl_controller), r"type == (\"[^\"]*\")")
    ]
    levels = _strings(inspect.getsource(rc.compute_rollout_correction_weights), r"rollout_is == (\"[^\"]*\")")
    for level in levels:
        opts += [f"rollout_correction.rollout_is={level}, threshold=2.0"]
        opts += [
            f"rollout_correction.rollout_is={level}, threshold=0.5_2.0" + (" (IcePop)" if level == "token" else "")
        ]
    opts += ["rollout_correction.rollout_is_batch_normalize=True"]
    bypass = inspect.getsource(ca.compute_policy_loss_bypass_mode)
    opts += [
        f"rollout_correction.bypass_mode=True, loss_type={n}" for n in _strings(bypass, r"loss_type == (\"[^\"]*\")")
    ]
    actor, algo = (
        {f.name for f in dataclasses.fields(v.ActorConfig)},
        {f.name for f in dataclasses.fields(v.AlgoConfig)},
    )
    opts += ["actor.entropy_coeff > 0"] if "entropy_coeff" in actor else []
    pf = inspect.getsource(ca.compute_pf_ppo_reweight_data)
    opts += [f"algorithm.use_pf_ppo, reweight_method={n}" for n in _strings(pf, r"reweight_method == (\"[^\"]*\")")]
    opts += ["algorithm.filter_groups (DAPO dynamic sampling)"] if "filter_groups" in algo else []
    opts += [f"rollout_correction.rollout_rs={n}" for n in sorted(rc.SUPPORTED_ROLLOUT_RS_OPTIONS)]
    return opts


# ----------------------------------------------------------------------------------
# one random case


def make_case(seed: int, kind: str = "full") -> dict[str, torch.Tensor]:
    """Rewards [B], completion lengths [B], and log-probs [B, P + T] of pi, pi_old, pi_ref and the sampler (float64)."""
    gen = torch.Generator().manual_seed(seed)
    B = N_PROMPTS * G
    rewards = torch.randn(N_PROMPTS, G, generator=gen, dtype=torch.float64)  # [n, G]
    rewards[0] = 0.75  # an all-equal group: advantage 0
    rewards[1] = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=torch.float64)  # a binary reward
    rewards = rewards.flatten().float().double()  # float32-exact: gcfamily reads rewards as float32
    lengths = torch.randint(1, T + 1, (B,), generator=gen)  # [B]
    lengths[torch.randint(0, B, (1,), generator=gen)] = T  # one full row; the others are padded
    logps = -(0.1 + 2.9 * torch.rand(B, P + T, generator=gen, dtype=torch.float64))  # [B, P+T]
    old = logps + 0.35 * torch.randn(B, P + T, generator=gen, dtype=torch.float64)  # r = e^(+-0.35): both clip sides
    old[2 * G : 3 * G, P] = logps[2 * G : 3 * G, P] - 1.6  # r = e^1.6 > 3 on a group: dual clip where A < 0
    values = torch.randn(B, P + T, generator=gen).double()  # [B, P+T] a critic's V (float32-exact, as gcfamily's)
    sample = old + 0.5 * torch.randn(
        B, P + T, generator=gen, dtype=torch.float64
    )  # the sampler's: IS weights past 2, 0.5
    if kind == "tame":
        ref = logps + (2 * torch.rand(B, P + T, generator=gen, dtype=torch.float64) - 1)  # |log rho| <= 1: k3 < 10
    else:
        ref = logps + 0.5 * torch.randn(B, P + T, generator=gen, dtype=torch.float64)  # [B, P+T]
        ref[:2, P] = logps[:2, P] - 25.0  # past the clamp at 20
        ref[4:6, P] = logps[4:6, P] - 14.0  # k3 = 13 > 10, inside the clamp at 20
        ref[8:10, P] = logps[8:10, P] + 3.0  # k3 = e^3 - 4 = 16 > 10
    return {
        "rewards": rewards,
        "lengths": lengths,
        "logps": logps,
        "old": old,
        "ref": ref,
        "sample": sample,
        "values": values,
    }


def _cast(case: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in case.items()}


# ----------------------------------------------------------------------------------
# the two sides


def run_verl(v: types.SimpleNamespace, check: Check, case: dict) -> dict[str, Any]:
    """verl's loss, gradient [B, P+T] and advantages [B, T] on the case."""
    import numpy as np

    ca, s = v.ca, {**VERL_BASE, **check.verl}
    B, lengths = N_PROMPTS * G, case["lengths"]
    mask = torch.arange(T)[None] < lengths[:, None]  # [B, T] response_mask
    fmask = mask.to(case["logps"].dtype)
    leaf = case["logps"].clone().requires_grad_(True)  # [B, P+T]
    logp, old, ref, sample = leaf[:, P:], case["old"][:, P:], case["ref"][:, P:], case["sample"][:, P:]
    scores = torch.zeros(B, T, dtype=logp.dtype)
    scores[torch.arange(B), lengths - 1] = case["rewards"].to(logp.dtype)  # the reward on the last response token
    if s["use_kl_in_reward"]:  # ray_trainer.apply_kl_penalty: token_level_scores - beta * kld
        scores = scores - s["kl_coef"] * ca.kl_penalty(old, ref, kl_penalty=s["kl_penalty"]) * fmask
    index = np.array([f"prompt {b // G}" for b in range(B)], dtype=object)
    if s["adv_estimator"] == "gae":  # on the case's values, as the critic would give them
        kw: dict[str, Any] = {"values": case["values"][:, P:], "gamma": s["gamma"], "lam": s["lam"]}
    else:
        kw = {"index": index, "config": None}
        kw.update({"norm_adv_by_std_in_grpo": s["norm_adv_by_std_in_grpo"]} if "grpo" in s["adv_estimator"] else {})
        if s["adv_estimator"] == "grpo_passk":  # it reads the switch from its config (an AlgoConfig; a dict's get here)
            kw["config"] = {"norm_adv_by_std_in_grpo": s["norm_adv_by_std_in_grpo"]}
        if s["adv_estimator"] == "reinforce_plus_plus":  # it reads gamma from its config (verl's default 1.0)
            kw["config"] = types.SimpleNamespace(gamma=s["gamma"])
    adv, _ = ca.get_adv_estimator_fn(s["adv_estimator"])(token_level_rewards=scores, response_mask=fmask, **kw)
    weights = None
    if s["rollout_is"] is not None:
        weights, _ = v.rc.compute_rollout_correction_weights(
            log_ratio=old - sample,
            response_mask=fmask,
            rollout_is=s["rollout_is"],
            rollout_is_threshold=s["rollout_is_threshold"],
        )
    # every setting that is a field of ActorConfig or of its PolicyLossConfig goes there (a Check may name any, e.g.
    # SAPO's tau_pos, DRO's dro_beta); the rest are the algorithm's, read above
    actor = {f.name for f in dataclasses.fields(v.ActorConfig)} - {"policy_loss"}
    policy = {f.name for f in dataclasses.fields(v.PolicyLossConfig)}
    unknown = set(check.verl) - set(VERL_BASE) - actor - policy
    if unknown:
        raise ValueError(f"{sorted(unknown)} are not settings of verl's ActorConfig, PolicyLossConfig or VERL_BASE")
    cfg = v.ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=G,
        policy_loss=v.PolicyLossConfig(**{k: s[k] for k in s if k in policy}),
        **{k: s[k] for k in s if k in actor},
    )
    # as workers/utils/losses.py::ppo_loss sets it for one process and one micro-batch
    cfg.global_batch_info.update(
        dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=cfg.loss_scale_factor
    )
    loss, _ = ca.get_policy_loss_fn(s["loss_mode"])(
        old_log_prob=old,
        log_prob=logp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=s["loss_agg_mode"],
        config=cfg,
        rollout_is_weights=weights,
    )
    if s["use_kl_loss"]:
        kld = ca.kl_penalty(logprob=logp, ref_logprob=ref, kl_penalty=s["kl_loss_type"])
        loss = loss + s["kl_loss_coef"] * ca.agg_loss(
            loss_mat=kld, loss_mask=mask, loss_agg_mode=s["loss_agg_mode"], **cfg.global_batch_info
        )
    loss.backward()
    return {"loss": float(loss.detach()), "grad": leaf.grad, "adv": adv.detach()}


@functools.cache
def _parity() -> types.ModuleType:
    """benchmarks/trl_parity.py (its gcfamily half needs no TRL): _Services (pi_old and pi_ref for prepare) and _step."""
    spec = importlib.util.spec_from_file_location("trl_parity", ROOT / "benchmarks" / "trl_parity.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("trl_parity", mod)
    spec.loader.exec_module(mod)
    return mod


def build_method(spec: str, sets: str, values: Optional[torch.Tensor] = None) -> Any:
    """gcfamily's registered method of `--method spec --set sets`, typed, defaulted and validated as `gcf run` builds it
    (trl_parity.build_method would take its own user-extension GSPO for "gspo"; this takes gcfamily's built-in one).
    With `values` (ppo): a subclass whose one override, critic_values, returns them in place of a critic network's."""
    from gcfamily.config import Config, apply, parse_sets, resolve_settings, validate
    from gcfamily.methods import get_method

    cls = get_method(spec)
    if values is not None:
        cls = type(cls.__name__, (cls,), {"critic_values": lambda self, batch: values})
    given = {"group_size": G, **parse_sets(tuple(sets.split()))}
    cfg = apply(Config(), {"method": cls.name, **given}, "verl_parity")
    object.__setattr__(cfg, "explicit", sorted(given))
    resolve_settings(cfg, cls)
    validate(cfg)
    cls.apply_setting_defaults(cfg)
    cls.validate(cfg)
    return cls(cfg)


def run_gcfamily(check: Check, case: dict) -> dict[str, Any]:
    """gcfamily's -objective, the engine's gradient [B, P+T] and the advantages ([B, 1] or [B, T])."""
    from gcfamily.methods.base import Batch

    tp = _parity()
    B, lengths = N_PROMPTS * G, case["lengths"]
    values = case["values"].float() * (torch.arange(P + T)[None] >= P) if check.method == "ppo" else None  # [B, P+T]
    method = build_method(check.method, check.sets, values)
    pos = torch.arange(P + T)[None]
    method.services = tp._Services(case["old"], case["ref"])
    method.ref = "reference" if method.settings.beta > 0 else None
    batch = Batch(
        input_ids=torch.full((B, P + T), 5),
        attention_mask=torch.ones(B, P + T, dtype=torch.long),
        loss_mask=((pos >= P) & (pos < P + lengths[:, None])).long(),  # [B, P+T]
        sample_logps=case["sample"].clone(),
        rewards=case["rewards"].clone(),
        valid=torch.ones(B, dtype=torch.bool),
    )
    batch, _ = method.prepare(batch)
    out = tp._step(method, batch, case["logps"])
    # [B] per row, or [B, T] per token (ppo's GAE)
    out["adv"] = batch.advantages[:, None] if batch.advantages is not None else batch.token_advantages[:, P:]
    return out


def compare(v: types.SimpleNamespace, check: Check, seed: int, dtype: torch.dtype) -> dict[str, Any]:
    """|loss diff|, max |grad diff|, max |advantage diff| between verl and gcfamily on one case, and whether the row
    is as expected (within tolerance, or for a control past CONTROL_MIN)."""
    case = _cast(make_case(seed, check.case), dtype)
    a, b = run_verl(v, check, case), run_gcfamily(check, case)
    mask = torch.arange(T)[None] < case["lengths"][:, None]  # [B, T]
    adv = (a["adv"].double() - b["adv"].double()).abs()[mask].max()
    res: dict[str, Any] = {
        "loss": abs(a["loss"] - b["loss"]),
        "grad": float((a["grad"] - b["grad"]).abs().max()),
        "adv": float(adv),
        "grad_scale": float(a["grad"].abs().max()),
    }
    worst = max(res["grad"], res["adv"]) if check.expect == "grad" else max(res["loss"], res["grad"], res["adv"])
    within = res["grad"] <= TOL[dtype] and res["adv"] <= ADV_TOL[dtype]
    within = within and (check.expect == "grad" or res["loss"] <= TOL[dtype])
    res["ok"] = worst >= CONTROL_MIN if check.expect == "differ" else within
    res["worst"] = worst
    return res


def coverage(seed: int) -> dict[str, int]:
    """Branches a full case reaches, computed here from the case alone (GRPO's advantage by hand): tokens clipped on
    each side at eps 0.2, dual-clip tokens (A < 0, r > 3), tokens past |log rho| = 20 and with k3 > 10 inside it,
    sampler ratios past 2 and below 0.5, equal-reward groups, padded rows."""
    c = make_case(seed)
    mask = torch.arange(T)[None] < c["lengths"][:, None]  # [B, T]
    groups = c["rewards"].view(N_PROMPTS, G)
    A = ((groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)).flatten()[:, None]
    r = torch.exp(c["logps"] - c["old"])[:, P:]
    log_rho = (c["ref"] - c["logps"])[:, P:]
    k3 = torch.expm1(log_rho) - log_rho
    w = torch.exp(c["old"] - c["sample"])[:, P:]
    return {
        "clip_low": int(((A < 0) & (r < 0.8) & mask).sum()),
        "clip_high": int(((A > 0) & (r > 1.2) & mask).sum()),
        "dual_clip": int(((A < 0) & (r > 3) & mask).sum()),
        "past_kl_clamp": int(((log_rho.abs() > 20) & mask).sum()),
        "k3_over_10": int(((k3 > 10) & (log_rho.abs() <= 20) & mask).sum()),
        "is_over_2": int(((w > 2) & mask).sum()),
        "is_under_half": int(((w < 0.5) & mask).sum()),
        "equal_groups": int((groups.amax(-1) == groups.amin(-1)).sum()),
        "padded_rows": int((c["lengths"] < T).sum()),
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="random cases per row and dtype")
    ap.add_argument("--rows", default="", help="comma-separated substrings of row names (default: every row)")
    ap.add_argument("--markdown", action="store_true", help="print docs/verl-mapping.md's table (no verl needed)")
    a = ap.parse_args(argv)
    if a.markdown:
        print(markdown_table())
        return 0
    v = load_verl()
    if v is None:
        print(f"verl is not installed (see this file's docstring for its venv); the mapping:\n{markdown_table()}")
        return 0
    torch.set_num_threads(1)
    found = enumerate_verl(v)
    unmapped = [o for o in found if o not in MAPPING]
    print(f"verl {v.version} (stand-ins for {', '.join(v.stubbed) or 'nothing'}), torch {torch.__version__}; {len(found)} options enumerated from verl's code, "
          f"{len(unmapped)} without a mapping; {a.seeds} case(s) per row and dtype; tolerance "
          f"{TOL[torch.float64]:g} in float64 (advantages {ADV_TOL[torch.float64]:g}), {TOL[torch.float32]:g} in float32")  # fmt: skip
    rows: list[tuple[str, Union[Check, str]]] = [(o, MAPPING.get(o, "UNMAPPED: add it to MAPPING")) for o in found]
    rows += [(o, e) for o, e in MAPPING.items() if o not in found] + list(CONTROLS.items())
    rows = [r for r in rows if not a.rows or any(s in r[0] for s in a.rows.split(","))]
    head = f"{'verl option':<64} {'loss64':>8} {'grad64':>8} {'adv64':>8} {'worst32':>8} {'max|grad|':>9}"
    print(f"{head}  status | gcfamily spelling or reason")
    counts = {"exact": 0, "differs": 0, "not expressible": 0, "FAIL": 0}
    largest = {"loss/grad": 0.0, "adv": 0.0}  # over the exact rows, float64
    for opt, entry in rows:
        if not isinstance(entry, Check):
            counts["FAIL" if entry.startswith("UNMAPPED") else "not expressible"] += 1
            print(f"{opt:<64} {'-':>8} {'-':>8} {'-':>8} {'-':>8} {'-':>9}  not expressible | {entry}")
            continue
        r64 = [compare(v, entry, s, torch.float64) for s in range(a.seeds)]
        r32 = [compare(v, entry, s, torch.float32) for s in range(a.seeds)]
        ld, gd, ad = (max(r[k] for r in r64) for k in ("loss", "grad", "adv"))
        w32, scale = max(r["worst"] for r in r32), max(r["grad_scale"] for r in r64)
        ok = all(r["ok"] for r in r64 + r32)
        if entry.expect == "differ":
            status = "differs (control, as expected)" if ok else "FAIL (control matched)"
            counts["differs" if ok else "FAIL"] += 1
        else:
            status = ("exact" + (" (gradient, advantages)" if entry.expect == "grad" else "")) if ok else "FAIL"
            counts["exact" if ok else "FAIL"] += 1
            if ok:
                lg = gd if entry.expect == "grad" else max(ld, gd)
                largest = {"loss/grad": max(largest["loss/grad"], lg), "adv": max(largest["adv"], ad)}
        nums = f"{ld:8.1e} {gd:8.1e} {ad:8.1e} {w32:8.1e} {scale:9.2e}"
        print(f"{opt:<64} {nums}  {status} | --method {entry.method} --set {entry.sets}")
    cov: dict[str, int] = {}
    for seed in range(a.seeds):
        for k, n in coverage(seed).items():
            cov[k] = cov.get(k, 0) + n
    print("full cases reached (summed over seeds): " + ", ".join(f"{k} {n}" for k, n in cov.items()))
    print(
        ", ".join(f"{k} {n}" for k, n in counts.items())
        + f"; largest float64 difference of an exact row: loss or gradient {largest['loss/grad']:.2e}, "
        + f"advantage {largest['adv']:.2e}"
    )
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
