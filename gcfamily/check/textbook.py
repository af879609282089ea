"""The textbook of gcf check (gcfamily/check/): each family's objective restated from its paper, sharing no code with the methods."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from gcfamily.check.advantages import (
    WHITENED,
    _group_advantages,
    _normalized_sum,
    _running_baseline,
    _truncated_off,
)
from gcfamily.check.surrogates import cispo_terms, gmpo_terms, sapo_terms, vespo_terms
from gcfamily.check.world import G, L, N, StubCritic, StubServices
from gcfamily.methods.base import Batch, Method


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, norm: str, C: float) -> torch.Tensor:
    """Over the rows that count: the token mean; the mean of sequence means (1/G sum_i 1/|o_i| sum_t); the mean
    of sequence sums; or the sums over C per sequence (Dr. GRPO)."""
    m = mask * rows[:, None]
    if norm == "token":
        return (per_token * m).sum() / m.sum()
    n = rows.sum()
    if norm == "sequence":  # a row with no token left (a masked truncated one) adds 0 and still counts
        return ((per_token * m).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n
    return (per_token * m).sum() / (n * (C if norm == "constant" else 1.0))


def _kl(name: str, log_rho: torch.Tensor, log_r: torch.Tensor) -> torch.Tensor:
    """Schulman's estimators of KL(pi || pi_ref) at a token, rho = pi_ref / pi: k1 = log(pi/pi_ref), k2 = its
    square / 2, k3 = rho - 1 - log rho, and k3 weighed by r = pi / pi_old."""
    rho = torch.exp(log_rho)
    k3 = rho - 1 - log_rho
    return {"k1": -log_rho, "k2": log_rho * log_rho / 2, "k3": k3, "k3-importance-weighted": torch.exp(log_r) * k3}[
        name
    ]


def _sampler_weight(
    s: Any, old: torch.Tensor, sample: torch.Tensor, mask: torch.Tensor, cells: torch.Tensor, br: Counter
) -> torch.Tensor:
    """TRL 1.16's correction of the sampler's mismatch (vllm_importance_sampling_correction), a constant of the step
    [B, L]: the ratio pi_old/pi_sampler of each completion token (token_*), or of the row, the product of its tokens'
    (sequence_*); kept inside [tis_min, tis_max], outside it moved onto the bound passed (*_truncate) or set to 0
    (*_mask); no tis_min, no lower bound. 1 with tis off. Counts the side each token (or row) of `cells` is on."""
    if s.tis == "off":
        return torch.ones_like(old)
    per_token = torch.where(mask.bool(), torch.exp(old - sample), 1.0)  # [B, L]
    seq = s.tis.startswith("sequence")
    rho = torch.prod(per_token, -1, keepdim=True).expand_as(old) if seq else per_token
    top, bottom = s.tis_max, -math.inf if s.tis_min is None else s.tis_min
    above, below = rho > top, rho < bottom
    masking = s.tis.endswith("mask")
    w = torch.where(above, 0.0 if masking else top, torch.where(below, 0.0 if masking else bottom, rho))
    level, how = ("sequences" if seq else "tokens"), ("masked" if masking else "truncated")
    pick = (lambda x: x[:, 0]) if seq else (lambda x: x)
    c = cells.any(-1) if seq else cells
    br[f"{level} with the sampler ratio above tis_max ({how})"] += int((pick(above) & c).sum())
    br[f"{level} with the sampler ratio below tis_min ({how})"] += int((pick(below) & c).sum())
    inside = ~above & ~below & ((rho - 1).abs() > 1e-6)
    br[f"{level} with the sampler ratio inside [tis_min, tis_max], != 1"] += int((pick(inside) & c).sum())
    return w.detach()


def _sampler_required(s: Any) -> set[str]:
    """The branches of the sampler correction its settings make reachable (below tis_min only with a tis_min > 0)."""
    if s.tis == "off":
        return set()
    level = "sequences" if s.tis.startswith("sequence") else "tokens"
    how = "masked" if s.tis.endswith("mask") else "truncated"
    req = {
        f"{level} with the sampler ratio above tis_max ({how})",
        f"{level} with the sampler ratio inside [tis_min, tis_max], != 1",
    }
    return req | ({f"{level} with the sampler ratio below tis_min ({how})"} if (s.tis_min or 0) > 0 else set())


def _clip_terms(
    tb: dict,
    s: Any,
    lp: torch.Tensor,
    old: torch.Tensor,
    ref: torch.Tensor | None,
    A: torch.Tensor,
    mask: torch.Tensor,
    on: torch.Tensor,
    br: Counter,
    sample: torch.Tensor,
) -> torch.Tensor:
    """c_t min(r A, clip(r, 1 - eps, 1 + eps_high) A) - beta KL_t per token [B, L] (PPO, eq. 7), r per token or per
    sequence (GSPO, eq. 5), c_t the sampler correction (TRL weighs its per-token loss, then adds beta KL); counts
    which side of the clip each token (or row) is on."""
    lo, hi = s.epsilon, s.epsilon if s.epsilon_high is None else s.epsilon_high
    log_r = lp - old  # [B, L]
    if tb["ratio"] == "sequence":
        r = torch.exp((log_r * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(lp)
    else:
        r = torch.exp(log_r)
    if tb.get("surrogate") == "cispo":
        per = cispo_terms(r, A, lp, lo, hi, on, br)
    elif tb.get("surrogate") == "gmpo":
        per = gmpo_terms(lp, old, A, mask, lo, hi, on, br)
    elif tb.get("surrogate") == "sapo":
        per = sapo_terms(r, A, s, on, br)
    elif tb.get("surrogate") == "vespo":
        per = vespo_terms(lp, old, A, mask, s, on, br)
    elif tb.get("surrogate") == "gpg":  # GPG (Chu et al. 2025): A log pi, no ratio, no clip
        per = A * lp
    else:
        per = torch.minimum(r * A, torch.clamp(r, 1 - lo, 1 + hi) * A)
        dc = getattr(s, "dual_clip", None)
        if dc is not None:  # dual-clip (Ye et al. 2020): for A < 0 the term is max(min(r A, clip(r) A), c A)
            per = torch.where(A < 0, torch.maximum(per, dc * A), per)
        _count_clip(tb, r, A, on, lo, hi, dc, br)
    per = per * _off_policy_keep(s, lp, sample, A, mask, on, br)
    per = per * _sampler_weight(s, old, sample, mask, on & (A.expand_as(r) != 0), br)
    if ref is not None and s.beta > 0 and s.kl_placement == "loss":
        c = math.inf if s.kl_clamp is None else s.kl_clamp
        d = ref - lp
        name = "k3" if s.kl_estimator == "auto" else s.kl_estimator
        per = per - s.beta * _kl(name, torch.clamp(d, -c, c), log_r)
        br["KL past the clamp"] += int(((d.detach().abs() > c) & on).sum())
        br["KL within the clamp" if c < math.inf else "KL, no clamp"] += int(((d.detach().abs() <= c) & on).sum())
    return per


def _off_policy_keep(
    s: Any, lp: torch.Tensor, sample: torch.Tensor, A: torch.Tensor, mask: torch.Tensor, on: torch.Tensor, br: Counter
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's get_off_policy_mask): a row's policy term is dropped where
    A < 0 and (1/|o|) sum_t (log pi_sampler - log pi) > delta, pi held constant; 1 with the setting off."""
    delta = getattr(s, "off_policy_mask", None)
    if delta is None:
        return torch.ones_like(lp)
    n = mask.sum(-1, keepdim=True).clamp(min=1)
    kl = ((sample - lp.detach()) * mask).sum(-1, keepdim=True) / n  # [B, 1]
    drop = (A < 0) & (kl > delta)  # [B, 1] or [B, L]
    rows = on.any(-1, keepdim=True)
    br["rows with A < 0 dropped off-policy (mean KL > threshold)"] += int((drop & rows).any(-1).sum())
    br["rows with A < 0 kept (mean KL <= threshold)"] += int(((A < 0) & ~drop & rows).any(-1).sum())
    return (~drop).double().expand_as(lp)


def _count_clip(
    tb: dict, r: torch.Tensor, A: torch.Tensor, on: torch.Tensor, lo: float, hi: float, dc: Any, br: Counter
) -> None:
    """Which side of the clip (and of dual-clip's c) each token, or row for a sequence ratio, is on."""
    rd, Ad = r.detach(), A.expand_as(r)
    level = "sequences" if tb["ratio"] == "sequence" else "tokens"
    cells = on.any(-1) if level == "sequences" else on
    pick = (lambda x: x[:, 0]) if level == "sequences" else (lambda x: x)
    rd, Ad = pick(rd), pick(Ad)
    low, high = (Ad < 0) & (rd < 1 - lo), (Ad > 0) & (rd > 1 + hi)
    br[f"{level} clipped low"] += int((low & cells).sum())
    br[f"{level} clipped high"] += int((high & cells).sum())
    br[f"{level} past dual-clip's bound (A < 0, r > c)"] += int(((Ad < 0) & (rd > dc) & cells).sum()) if dc else 0
    br[f"{level} unclipped, r != 1"] += int((~low & ~high & (Ad != 0) & ((rd - 1).abs() > 1e-6) & cells).sum())
    a, b = min(lo, hi), max(lo, hi)
    band = ((Ad > 0) & (rd > 1 + a) & (rd <= 1 + b)) | ((Ad < 0) & (rd < 1 - a) & (rd >= 1 - b))
    br[f"{level} in the band between eps and eps_high"] += int((band & cells).sum()) if lo != hi else 0


def _clip_required(s: Any, several: bool, br_kl_reward: bool, tb: dict | None = None) -> set[str]:
    lo, hi = s.epsilon, s.epsilon if s.epsilon_high is None else s.epsilon_high
    req = set()
    if several and (tb or {}).get("surrogate") == "cispo":
        req |= {f"IS weight capped at 1 + eps_high, A {x} 0" for x in "<>"} | {"IS weight r inside the clip, != 1"}
        req |= {"IS weight raised to 1 - eps"} if lo < 1 else set()
    elif several and (tb or {}).get("surrogate") == "gmpo":
        req |= {f"log r {x}" for x in ("past eps_high, A > 0 (clipped)", "below -eps_low, A < 0 (clipped)")}
        req |= {"log r outside the clip on the side A keeps", "log r inside the clip, != 0"}
    elif several and (tb or {}).get("surrogate") == "sapo":
        req |= {"A > 0, r != 1 (gate at tau_pos)", "A < 0, r != 1 (gate at tau_neg)"}
    elif several and (tb or {}).get("surrogate") == "vespo":
        req |= {f"rows with A {x} 0 weighed phi != 1" for x in "<>"}
    elif several and (tb or {}).get("surrogate") != "gpg":
        req |= {"clipped low", "clipped high", "unclipped, r != 1"} | (
            {"in the band between eps and eps_high"} if lo != hi else set()
        )
        req |= {"past dual-clip's bound (A < 0, r > c)"} if getattr(s, "dual_clip", None) else set()
    if getattr(s, "off_policy_mask", None) is not None:
        req |= {
            "rows with A < 0 dropped off-policy (mean KL > threshold)",
            "rows with A < 0 kept (mean KL <= threshold)",
        }
    if s.beta > 0 and s.kl_placement == "loss":
        req |= {"KL within the clamp", "KL past the clamp"} if s.kl_clamp is not None else {"KL, no clamp"}
    if br_kl_reward:
        req |= {"KL in the reward"}
    if (tb or {}).get("advantage") == "pass@k":  # no advantage is ever < 0: nothing can clip low or meet A < 0's bounds
        req = {x for x in req if "A < 0" not in x and x != "clipped low" and "dual-clip" not in x}
    return req | _sampler_required(s)


@dataclass
class Textbook:
    J: torch.Tensor
    branches: Counter
    required: set[str]


def _groups_textbook(
    lp_all: torch.Tensor, raw: Batch, warm: list[torch.Tensor], stub: StubServices, m: Method, tb: dict
) -> Textbook:
    s, ids, mask = m.settings, raw.row_id, raw.loss_mask.double()
    lp, R, valid = lp_all[ids], raw.rewards.double(), raw.valid.bool()
    old, ref = (
        stub.logprobs(stub.policy_model, raw, stub.tau).double(),
        stub.logprobs(stub.ref, raw, stub.tau).double() if s.beta > 0 else None,
    )
    br = Counter({"failed rewards": int((~valid).sum())})
    cut = _truncated_off(s, raw, valid, br)
    mask = mask * ~cut[:, None]  # TRL's mask_truncated_completions: no token trains, the reward stays
    if getattr(s, "reward_aggregation", "") == "normalize_then_sum":
        R = _normalized_sum(raw.reward_parts.double(), valid, s, m.cfg.reward_weights, br)
    shifts = torch.zeros(N, dtype=torch.float64)  # what joins each warm-up sample's reward (the KL below)
    in_reward = ref is not None and s.kl_placement == "reward"
    if in_reward:  # -beta * sum_t KL_t at pi_old joins each sample's reward (k1 unless set)
        c = math.inf if s.kl_clamp is None else s.kl_clamp
        name = "k1" if s.kl_estimator == "auto" else s.kl_estimator
        kl = (_kl(name, torch.clamp(ref - old, -c, c), torch.zeros_like(old)) * mask).sum(-1)  # [N]
        R, shifts = R - s.beta * kl, -s.beta * kl
        br["KL in the reward"] += int(valid.sum())
    means = [float((w.double() + shifts).mean()) for w in warm]
    b = _running_baseline(means, s.baseline_decay) if tb["advantage"] == "running baseline" else 0.0
    A, equal = _group_advantages(R, valid, tb, s, b, mask.sum(-1))
    kept = tb["advantage"] in ("running baseline", *WHITENED)  # an equal group keeps an advantage
    rows = valid & ~(equal if s.zero_std == "exclude" and not kept else torch.zeros_like(valid))
    on = mask.bool() & rows[:, None]
    br["equal-reward groups" + (" (A = R - b kept)" if kept else "")] += int(equal[::G].sum())
    br["equal-reward groups out of Z"] += int((equal & ~rows & valid).any()) if s.zero_std == "exclude" else 0
    br["rows with A > 0"], br["rows with A < 0"] = int(((A > 0) & rows).sum()), int(((A < 0) & rows).sum())
    per = _clip_terms(tb, s, lp, old, ref, A[:, None], mask, on, br, raw.sample_logps.double())
    several = m.inner_epochs() > 1 or m.num_minibatches() > 1
    neg = set() if tb["advantage"] == "pass@k" else {"rows with A < 0"}  # pass@k's advantages are >= 0
    req = {"failed rewards", "rows with A > 0"} | neg | _clip_required(s, several, in_reward, tb)
    req |= set() if in_reward else {"equal-reward groups" + (" (A = R - b kept)" if kept else "")}
    req |= {"equal-reward groups out of Z"} if s.zero_std == "exclude" and not kept else set()
    req |= {"truncated samples masked, their rewards kept"} if cut.any() else set()
    req |= {"rewards standardised apart, then summed"} if "rewards standardised apart, then summed" in br else set()
    return Textbook(_aggregate(per, mask, rows.double(), m.norm, m.cfg.norm_constant), br, req)


def _process_textbook(lp_all: torch.Tensor, raw: Batch, stub: StubServices, m: Method, tb: dict) -> Textbook:
    """Process supervision (DeepSeekMath 4.1.3): every step reward of a group's valid outputs normalised together,
    r~ = (r - mean) / (std + std_eps), and a token's advantage the sum of r~ over its output's steps that end at or
    after it; a group whose step rewards are all equal (or fewer than two) gets none; then the clipped surrogate."""
    s, ids, mask = m.settings, raw.row_id, raw.loss_mask.double()
    lp, valid = lp_all[ids], raw.valid.bool()
    old = stub.logprobs(stub.policy_model, raw, stub.tau).double()
    ref = stub.logprobs(stub.ref, raw, stub.tau).double() if s.beta > 0 else None
    R, at = raw.step_rewards.double(), raw.step_mask.bool()
    A, equal = torch.zeros(R.shape, dtype=torch.float64), torch.zeros(len(R), dtype=torch.bool)
    br = Counter({"failed rewards": int((~valid).sum())})
    cut = _truncated_off(s, raw, valid, br)
    mask = mask * ~cut[:, None]  # tokens out, step rewards kept in the group's statistics
    sample = s.std == "sample"
    for g in range(len(R) // G):
        steps = [(i, t) for i in range(g * G, (g + 1) * G) if valid[i] for t in range(R.shape[1]) if at[i, t]]
        r = torch.stack([R[i, t] for i, t in steps]) if steps else torch.zeros(0, dtype=torch.float64)
        if len(r) < 2 or bool((r == r[0]).all()):
            equal[g * G : (g + 1) * G] = True
            br["equal-reward groups"] += 1
            continue
        scale = float(r.std(unbiased=sample)) + s.std_eps
        for (i, t), v in zip(steps, r):
            A[i, : t + 1] += (v - r.mean()) / scale  # every token at or before the step's last one
    per_row = (at & valid[:, None]).sum(-1)
    br["outputs with several steps"] = int(((per_row > 1) & valid).sum())
    br["valid outputs with no step"] = int(((per_row == 0) & valid).sum())
    rows = valid & ~(equal if s.zero_std == "exclude" else torch.zeros_like(valid))
    br["equal-reward groups out of Z"] += int((equal & ~rows & valid).any()) if s.zero_std == "exclude" else 0
    on = mask.bool() & rows[:, None]
    br["tokens with A > 0"], br["tokens with A < 0"] = int(((A > 0) & on).sum()), int(((A < 0) & on).sum())
    per = _clip_terms(tb, s, lp, old, ref, A, mask, on, br, raw.sample_logps.double())
    several = m.inner_epochs() > 1 or m.num_minibatches() > 1
    req = {"failed rewards", "tokens with A > 0", "tokens with A < 0", "equal-reward groups"}
    req |= {"outputs with several steps", "valid outputs with no step"} | _clip_required(s, several, False)
    req |= {"equal-reward groups out of Z"} if s.zero_std == "exclude" else set()
    req |= {"truncated samples masked, their rewards kept"} if cut.any() else set()
    return Textbook(_aggregate(per, mask, rows.double(), m.norm, m.cfg.norm_constant), br, req)


def _gae(raw: Batch, stub: StubServices, m: Method, br: Counter) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """GAE (Schulman et al. 2016) on the reward at the last token minus beta * KL_t at pi_old (kl_placement=reward):
    the advantages A [N, L] before whitening, the critic's values V [N, L] they were computed on, and whether the KL
    joined the reward. returns = A + V."""
    s, ids, mask = m.settings, raw.row_id, raw.loss_mask.double()
    valid = raw.valid.bool()
    old = stub.logprobs(stub.policy_model, raw, stub.tau).double()
    ref = stub.logprobs(stub.ref, raw, stub.tau).double() if s.beta > 0 else None
    values = StubCritic(stub.world)(raw.input_ids, raw.attention_mask).double() * mask  # [N, L]
    rwd = torch.zeros(N, L, dtype=torch.float64)
    for i in range(N):
        rwd[i, stub.world.positions(int(ids[i]))[-1]] = float(raw.rewards[i]) if valid[i] else 0.0
    in_reward = ref is not None and s.kl_placement == "reward"
    if in_reward:
        c = math.inf if s.kl_clamp is None else s.kl_clamp
        name = "k1" if s.kl_estimator == "auto" else s.kl_estimator
        rwd = rwd - s.beta * _kl(name, torch.clamp(ref - old, -c, c), torch.zeros_like(old)) * mask
        br["KL in the reward"] += int(valid.sum())
    A = torch.zeros(N, L, dtype=torch.float64)
    for i in range(N):
        next_v = next_a = 0.0  # the state after the last token is terminal
        for t in reversed(stub.world.positions(int(ids[i]))):
            next_a = float(rwd[i, t]) + s.gamma * next_v - float(values[i, t]) + s.gamma * s.lam * next_a
            A[i, t], next_v = next_a, float(values[i, t])
    return A, values, in_reward


def _ppo_textbook(lp_all: torch.Tensor, raw: Batch, stub: StubServices, m: Method, tb: dict) -> Textbook:
    """GAE advantages (_gae), whitened over the step's valid tokens, in the clipped surrogate."""
    s, cfg, ids, mask = m.settings, m.cfg, raw.row_id, raw.loss_mask.double()
    lp, valid = lp_all[ids], raw.valid.bool()
    old, ref = (
        stub.logprobs(stub.policy_model, raw, stub.tau).double(),
        stub.logprobs(stub.ref, raw, stub.tau).double() if s.beta > 0 else None,
    )
    br = Counter({"failed rewards": int((~valid).sum())})
    A, _, in_reward = _gae(raw, stub, m, br)
    on = mask.bool() & valid[:, None]
    if s.whiten:  # the setting, as the user gave it
        x = A[on]
        A = torch.where(on, (A - x.mean()) / (x.std() + 1e-8), 0.0)
    br["tokens with A > 0"], br["tokens with A < 0"] = int(((A > 0) & on).sum()), int(((A < 0) & on).sum())
    per = _clip_terms(tb, s, lp, old, ref, A, mask, on, br, raw.sample_logps.double())
    several = m.inner_epochs() > 1 or m.num_minibatches() > 1
    req = {"failed rewards", "tokens with A > 0", "tokens with A < 0"} | _clip_required(s, several, in_reward)
    return Textbook(_aggregate(per, mask, valid.double(), m.norm, cfg.norm_constant), br, req)


def _kept_textbook(lp_all: torch.Tensor, raw: Batch, stub: StubServices, m: Method) -> Textbook:
    """Rejection sampling (DeepSeekMath 5.2.1): the SFT objective on the valid samples whose reward clears the
    threshold, each token's log-likelihood weighed by the sampler correction (pi_old = pi: one pass)."""
    s, mask = m.settings, raw.loss_mask.double()
    kept = raw.valid & (raw.rewards >= s.reward_threshold)
    br = Counter(
        {"kept": int(kept.sum()), "rejected": int((raw.valid & ~kept).sum()), "failed rewards": int((~raw.valid).sum())}
    )
    old = lp_all[raw.row_id].detach()  # pi_old: the policy at the step
    c = _sampler_weight(s, old, raw.sample_logps.double(), mask, mask.bool() & kept[:, None], br)
    J = _aggregate(lp_all[raw.row_id] * c, mask, kept.double(), m.norm, m.cfg.norm_constant)
    return Textbook(J, br, {"kept", "rejected", "failed rewards"} | _sampler_required(s))
