"""Exactness checks of a method's gradient: `gcf check SPEC` and tests/test_exactness.py run these.

For a method class and a settings case, on a batch built for its data family (on-policy groups, PPO's
GAE, preference pairs, online pairs, unpaired labels, kept samples, demonstrations) by the method's own
`setup`/`prepare` on a stub trainer, with a policy whose logits are a leaf table LOGITS[row, t, :]:

(a) the engine's gradient (micro-batched `coefficient` + `engine.weighted_loss`, Z from `engine.normaliser`)
    equals autograd of the TEXTBOOK objective below, and autograd of the method's own `objective`;
(b) d loss / d logits through the engine's chunked log-prob backward equals GC * w / Z * (onehot - softmax)
    on every token, GC = (dJ/dlogp) / (w / Z) from the textbook, not from the method's coefficient.

The textbook shares no code with the methods or the engine: advantages (from the rewards), ratios, clips,
KL estimators, GAE, pair losses and the aggregation are restated from the papers here; only data the
trainer would supply (pi_old and pi_ref log-probs, a critic's values, rewards) is shared. It is picked by the
class that defines each hook a variant changes; a hook of the user's own that it does not know is named,
and that case is checked against the method's own objective only.

Each check counts the branches its batch reached (clipped low and high, the clip-higher band, KL past the
clamp, an equal-reward group, a failed reward, several micro-batches, ...) and fails when a branch its
settings make reachable did not occur: a pass is never a pass on a batch that could not tell.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from gcfamily import engine
from gcfamily.config import FIELDS, Config
from gcfamily.data import select
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch, Method

L, V, G, N = 8, 5, 4, 16  # sequence length, vocabulary, samples per prompt, rows (4 prompts x G, or 8 pairs)
MICRO = 4  # rows per micro-batch: every batch is split into several
TOL_A, TOL_B = 2e-6, 1e-5  # relative to the gradient's largest entry: float64 log-probs; the engine's float32 path
# a group's rewards: mixed with ties, all equal, one failed (valid=False, with a high reward so that using it
# unmasked changes every result), distinct; the warm-up step's mean 0.45 is the running baseline's b
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.9, 1.0, 0.2, 0.6, 0.8, 0.1, 0.3, 0.65]
FAILED, FAR = 9, 4  # the failed sample; the row with a token 25 nats from pi_ref (past any KL clamp)
WARMUP = [0.2, 0.7] * 8

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
    pi_ref = pi * exp(ref_offset), and a critic V(token, position)."""

    def __init__(self, n: int, gen: torch.Generator) -> None:
        pos = torch.arange(L)[None]
        start = torch.randint(1, 3, (n, 1), generator=gen)  # a prompt of 1-2 tokens
        end = start + torch.randint(4, L - 1, (n, 1), generator=gen)  # a completion of 4-6, right padding
        self.tokens = torch.randint(0, V, (n, L), generator=gen)  # [n, L]
        self.attention_mask = (pos < end).long()  # [n, L]
        self.loss_mask = ((pos >= start) & (pos < end)).long()  # [n, L]
        self.logits = 1.5 * torch.randn(n, L, V, generator=gen, dtype=torch.float64)  # [n, L, V]
        self.log_ratio = torch.zeros(n, L, dtype=torch.float64)  # log pi - log pi_old, set by a builder
        self.ref_offset = 0.5 * torch.randn(n, L, generator=gen, dtype=torch.float64)  # log pi_ref - log pi
        self.value_table = torch.randn(V, L, generator=gen)  # [V, L]

    def logps(self, logits: torch.Tensor | None = None, tau: float = 1.0) -> torch.Tensor:
        """log pi(token) per row [n, L], 0 off the loss mask."""
        x = self.logits if logits is None else logits
        return torch.log_softmax(x / tau, -1).gather(-1, self.tokens[..., None]).squeeze(-1) * self.loss_mask

    def rows(self, ids: Any) -> Batch:
        ids = torch.as_tensor(list(ids))
        return {"input_ids": self.tokens[ids], "attention_mask": self.attention_mask[ids], "loss_mask": self.loss_mask[ids], "row_id": ids}

    def positions(self, i: int) -> list[int]:
        return self.loss_mask[i].nonzero().flatten().tolist()


class _StubTask:
    name = "stub"

    def rows(self, split: str) -> list[dict]:
        return [{"prompt": "p"}]

    def reward(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        return [0.0] * len(prompts)


class StubTrainer:
    """What a method's setup and prepare read from the Trainer; log-probs are the World's, by row id."""

    def __init__(self, cfg: Config, world: World, tau: float) -> None:
        self.cfg, self.world, self.tau = cfg, world, tau
        self.task, self.tokenizer, self.device = _StubTask(), None, torch.device("cpu")
        self.policy, self.ref = nn.Linear(1, 1), nn.Linear(1, 1)

    def unwrapped_policy(self) -> nn.Module:
        return self.policy

    def reference(self) -> nn.Module:
        return self.ref

    def logprobs(self, model: nn.Module, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        w, ids = self.world, batch["row_id"]
        shift = -w.log_ratio[ids] if model is self.policy else w.ref_offset[ids]
        return ((w.logps(tau=self.tau)[ids] + shift) * batch["loss_mask"]).float()  # [B, L], float32 as the trainer's


class StubCritic(nn.Module):
    """PPO's value model: V(token, position) from a table."""

    def __init__(self, world: World) -> None:
        super().__init__()
        self.table = world.value_table

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: Any = None) -> torch.Tensor:
        return self.table[input_ids, torch.arange(input_ids.shape[1])]  # [B, L]


def make(cls: type[Method], settings: dict[str, Any]) -> Method:
    """The method at its own defaults plus `settings` (marked explicit, so its setting_defaults fill the rest)."""
    cfg = Config(method=cls.name or cls.__name__, **settings)
    object.__setattr__(cfg, "explicit", sorted(settings))
    cls.apply_setting_defaults(cfg)
    cls.validate(cfg)
    return cls(cfg)


# ----------------------------------------------------------------------------- the textbook, from the papers


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, norm: str, C: float) -> torch.Tensor:
    """Over the rows that count: the token mean; the mean of sequence means (1/G sum_i 1/|o_i| sum_t); the mean
    of sequence sums; or the sums over C per sequence (Dr. GRPO)."""
    m = mask * rows[:, None]
    if norm == "token":
        return (per_token * m).sum() / m.sum()
    n = rows.sum()
    if norm == "sequence":
        return ((per_token * m).sum(-1) / mask.sum(-1)).sum() / n
    return (per_token * m).sum() / (n * (C if norm == "constant" else 1.0))


def _kl(name: str, log_rho: torch.Tensor, log_r: torch.Tensor) -> torch.Tensor:
    """Schulman's estimators of KL(pi || pi_ref) at a token, rho = pi_ref / pi: k1 = log(pi/pi_ref), k2 = its
    square / 2, k3 = rho - 1 - log rho, and k3 weighed by r = pi / pi_old."""
    rho = torch.exp(log_rho)
    k3 = rho - 1 - log_rho
    return {"k1": -log_rho, "k2": log_rho * log_rho / 2, "k3": k3, "k3-importance-weighted": torch.exp(log_r) * k3}[name]


def _clip_terms(tb: dict, s: Any, lp: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None, A: torch.Tensor,
                mask: torch.Tensor, on: torch.Tensor, br: Counter) -> torch.Tensor:
    """min(r A, clip(r, 1 - eps, 1 + eps_high) A) - beta KL_t per token [B, L] (PPO, eq. 7), r per token or per
    sequence (GSPO, eq. 5); counts which side of the clip each token (or row) is on."""
    lo, hi = s.epsilon, s.epsilon if s.epsilon_high is None else s.epsilon_high
    log_r = lp - old  # [B, L]
    if tb["ratio"] == "sequence":
        r = torch.exp((log_r * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).expand_as(lp)
    else:
        r = torch.exp(log_r)
    per = torch.minimum(r * A, torch.clamp(r, 1 - lo, 1 + hi) * A)
    rd, Ad = r.detach(), A.expand_as(r)
    level = "sequences" if tb["ratio"] == "sequence" else "tokens"
    cells = on.any(-1) if level == "sequences" else on
    pick = (lambda x: x[:, 0]) if level == "sequences" else (lambda x: x)
    rd, Ad = pick(rd), pick(Ad)
    low, high = (Ad < 0) & (rd < 1 - lo), (Ad > 0) & (rd > 1 + hi)
    br[f"{level} clipped low"] += int((low & cells).sum())
    br[f"{level} clipped high"] += int((high & cells).sum())
    br[f"{level} unclipped, r != 1"] += int((~low & ~high & (Ad != 0) & ((rd - 1).abs() > 1e-6) & cells).sum())
    a, b = min(lo, hi), max(lo, hi)
    band = ((Ad > 0) & (rd > 1 + a) & (rd <= 1 + b)) | ((Ad < 0) & (rd < 1 - a) & (rd >= 1 - b))
    br[f"{level} in the band between eps and eps_high"] += int((band & cells).sum()) if lo != hi else 0
    if ref is not None and s.beta > 0 and s.kl_placement == "loss":
        c = math.inf if s.kl_clamp is None else s.kl_clamp
        d = ref - lp
        name = "k3" if s.kl_estimator == "auto" else s.kl_estimator
        per = per - s.beta * _kl(name, torch.clamp(d, -c, c), log_r)
        br["KL past the clamp"] += int(((d.detach().abs() > c) & on).sum())
        br["KL within the clamp" if c < math.inf else "KL, no clamp"] += int(((d.detach().abs() <= c) & on).sum())
    return per


def _clip_required(s: Any, several: bool, br_kl_reward: bool) -> set[str]:
    lo, hi = s.epsilon, s.epsilon if s.epsilon_high is None else s.epsilon_high
    req = set()
    if several:
        req |= {"clipped low", "clipped high", "unclipped, r != 1"} | ({"in the band between eps and eps_high"} if lo != hi else set())
    if s.beta > 0 and s.kl_placement == "loss":
        req |= {"KL within the clamp", "KL past the clamp"} if s.kl_clamp is not None else {"KL, no clamp"}
    if br_kl_reward:
        req |= {"KL in the reward"}
    return req


def _group_advantages(R: torch.Tensor, valid: torch.Tensor, tb: dict, s: Any, b: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N] and the rows of groups whose valid rewards are all equal. group: (R - mean) / (std + std_eps) over the
    group (DeepSeekMath 4.1.2; std of the whole step with scale_rewards=batch, none: R - mean), 0 for an equal
    group; leave-one-out: R - mean of the others (RLOO); running baseline: R - b (Williams 1992)."""
    A, equal = torch.zeros(len(R), dtype=torch.float64), torch.zeros(len(R), dtype=torch.bool)
    sample = getattr(s, "std", "sample") == "sample"
    allv = R[valid]
    step_std = float(allv.std(unbiased=sample)) if len(allv) > int(sample) else 0.0
    for g in range(len(R) // G):
        idx = [i for i in range(g * G, (g + 1) * G) if valid[i]]
        r = R[idx]
        equal[g * G : (g + 1) * G] = len(r) < 2 or bool((r == r[0]).all())
        if tb["advantage"] == "running baseline":
            a = r - b
            scale = step_std + s.std_eps if s.scale_rewards == "batch" else 1.0
            A[idx] = a / scale if scale > 0 else a
            continue
        if equal[g * G]:
            continue
        if tb["advantage"] == "leave-one-out":
            A[idx] = r - (r.sum() - r) / (len(r) - 1)
            continue
        c = r - r.mean()
        if s.scale_rewards == "none":
            A[idx] = c
        else:
            scale = (float(r.std(unbiased=sample)) if s.scale_rewards == "group" else step_std) + s.std_eps
            A[idx] = c / scale if scale > 0 else 0.0
    return A, equal


@dataclass
class Textbook:
    J: torch.Tensor
    branches: Counter
    required: set[str]


def _groups_textbook(lp_all: torch.Tensor, raw: Batch, warm: torch.Tensor, stub: StubTrainer, m: Method, tb: dict) -> Textbook:
    s, ids, mask = m.settings, raw["row_id"], raw["loss_mask"].double()
    lp, R, valid = lp_all[ids], raw["rewards"].double(), raw["valid"].bool()
    old, ref = stub.logprobs(stub.policy, raw).double(), stub.logprobs(stub.ref, raw).double() if s.beta > 0 else None
    br = Counter({"failed rewards": int((~valid).sum())})
    b = float(warm.double().mean())
    in_reward = ref is not None and s.kl_placement == "reward"
    if in_reward:  # -beta * sum_t KL_t at pi_old joins each sample's reward (k1 unless set)
        c = math.inf if s.kl_clamp is None else s.kl_clamp
        name = "k1" if s.kl_estimator == "auto" else s.kl_estimator
        kl = (_kl(name, torch.clamp(ref - old, -c, c), torch.zeros_like(old)) * mask).sum(-1)  # [N]
        R, b = R - s.beta * kl, float((warm.double() - s.beta * kl).mean())
        br["KL in the reward"] += int(valid.sum())
    A, equal = _group_advantages(R, valid, tb, s, b)
    kept = tb["advantage"] == "running baseline"
    rows = valid & ~(equal if s.zero_std == "exclude" and not kept else torch.zeros_like(valid))
    on = mask.bool() & rows[:, None]
    br["equal-reward groups" + (" (A = R - b kept)" if kept else "")] += int(equal[::G].sum())
    br["equal-reward groups out of Z"] += int((equal & ~rows & valid).any()) if s.zero_std == "exclude" else 0
    br["rows with A > 0"], br["rows with A < 0"] = int(((A > 0) & rows).sum()), int(((A < 0) & rows).sum())
    per = _clip_terms(tb, s, lp, old, ref, A[:, None], mask, on, br)
    several = m.inner_epochs() > 1 or m.num_minibatches() > 1
    req = {"failed rewards", "rows with A > 0", "rows with A < 0"} | _clip_required(s, several, in_reward)
    req |= set() if in_reward else {"equal-reward groups" + (" (A = R - b kept)" if kept else "")}
    req |= {"equal-reward groups out of Z"} if s.zero_std == "exclude" and not kept else set()
    return Textbook(_aggregate(per, mask, rows.double(), m.norm, m.cfg.norm_constant), br, req)


def _ppo_textbook(lp_all: torch.Tensor, raw: Batch, stub: StubTrainer, m: Method, tb: dict) -> Textbook:
    """GAE (Schulman et al. 2016) on the reward at the last token minus beta * KL_t at pi_old (kl_placement=reward),
    whitened over the step's valid tokens, in the clipped surrogate."""
    s, cfg, ids, mask = m.settings, m.cfg, raw["row_id"], raw["loss_mask"].double()
    lp, valid = lp_all[ids], raw["valid"].bool()
    old, ref = stub.logprobs(stub.policy, raw).double(), stub.logprobs(stub.ref, raw).double() if s.beta > 0 else None
    values = (StubCritic(stub.world)(raw["input_ids"], raw["attention_mask"]).double() * mask).tolist()
    rwd = torch.zeros(N, L, dtype=torch.float64)
    br = Counter({"failed rewards": int((~valid).sum())})
    for i in range(N):
        rwd[i, stub.world.positions(int(ids[i]))[-1]] = float(raw["rewards"][i]) if valid[i] else 0.0
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
            next_a = float(rwd[i, t]) + cfg.gamma * next_v - values[i][t] + cfg.gamma * cfg.lam * next_a
            A[i, t], next_v = next_a, values[i][t]
    on = mask.bool() & valid[:, None]
    if type(m).whiten_advantages:
        x = A[on]
        A = torch.where(on, (A - x.mean()) / (x.std() + 1e-8), 0.0)
    br["tokens with A > 0"], br["tokens with A < 0"] = int(((A > 0) & on).sum()), int(((A < 0) & on).sum())
    per = _clip_terms(tb, s, lp, old, ref, A, mask, on, br)
    several = m.inner_epochs() > 1 or m.num_minibatches() > 1
    req = {"failed rewards", "tokens with A > 0", "tokens with A < 0"} | _clip_required(s, several, in_reward)
    return Textbook(_aggregate(per, mask, valid.double(), m.norm, cfg.norm_constant), br, req)


def _pair_loss(name: str, s: Any, lp: torch.Tensor, ref: torch.Tensor | None, mask: torch.Tensor, w: list[int],
               l: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss per pair [P] and its branch variable minus the loss's pivot (its sign is the branch):
    DPO -log sigmoid(beta d) (Rafailov et al. 2023), cDPO (Mitchell 2023), IPO (d - 1/(2 beta))^2 (Azar et al. 2023,
    eq. 17), SimPO -log sigmoid(beta (mean_w - mean_l) - gamma) (Meng et al. 2024), ORPO -mean_w - lambda log
    sigmoid(log odds_w - log odds_l) (Hong et al. 2024); d = sum_t log(pi/pi_ref), chosen minus rejected."""
    mean = (lp * mask).sum(-1) / mask.sum(-1)  # [B]
    if name in ("dpo", "cdpo", "ipo"):
        tot = ((lp - ref) * mask).sum(-1)  # [B]
        d = tot[w] - tot[l]  # [P]
        beta = s.beta
        if name == "ipo":
            return (d - 1 / (2 * beta)) ** 2, beta * d - 0.5
        m = beta * d
        if name == "dpo":
            return F.softplus(-m), m
        eps = s.label_smoothing
        return (1 - eps) * F.softplus(-m) + eps * F.softplus(m), m - math.log((1 - eps) / eps) if eps > 0 else m
    if name == "simpo":
        u = s.beta * (mean[w] - mean[l]) - s.simpo_gamma
        return F.softplus(-u), u
    odds = mean - torch.log(-torch.expm1(mean))  # log(P / (1 - P)), P = exp(mean)
    z = odds[w] - odds[l]
    return -mean[w] + s.orpo_lambda * F.softplus(-z), z


# the margin m = beta * d where each loss turns: DPO's sign, IPO's target 1/2, where cDPO's GC changes sign
PIVOT = {"dpo": lambda s: 0.0, "ipo": lambda s: 0.5,
         "cdpo": lambda s: math.log((1 - s.label_smoothing) / s.label_smoothing) if s.label_smoothing > 0 else 0.0}


def _pairs_textbook(lp_all: torch.Tensor, pairs: list[tuple[int, int]], ref_all: torch.Tensor | None, world: World, m: Method,
                    tb: dict, br: Counter) -> Textbook:
    w, l = [p[0] for p in pairs], [p[1] for p in pairs]
    loss, u = _pair_loss(tb["loss"], m.settings, lp_all, ref_all, world.loss_mask.double(), w, l)
    br["pairs above the loss's pivot"] += int((u.detach() > 0).sum())
    br["pairs below the loss's pivot"] += int((u.detach() < 0).sum())
    return Textbook(-loss.sum() / len(pairs), br, {"pairs above the loss's pivot", "pairs below the loss's pivot"})


# ----------------------------------------------------------------------------- builders, one per data family


@dataclass
class Built:
    method: Method
    batch: Batch
    textbook: Callable[[torch.Tensor], Textbook] | None


def _signs(R: list[float], valid: list[bool]) -> list[int]:
    """The sign of R - mean over the valid rewards of each group (0 for a failed sample or an equal group)."""
    out = []
    for i, r in enumerate(R):
        grp = [R[j] for j in range(i // G * G, i // G * G + G) if valid[j]]
        c = r - sum(grp) / len(grp)
        out.append(0 if not valid[i] or abs(c) < 1e-12 else (1 if c > 0 else -1))
    return out


def _design_ratios(world: World, signs: list[int], s: Any, sequence: bool, gen: torch.Generator) -> None:
    """pi_old such that r = pi / pi_old puts tokens (or, for a sequence ratio, rows) on every side of the clip:
    past 1 + eps_high where A > 0, below 1 - eps where A < 0, inside, and in the band between eps and eps_high."""
    lo, hi = s.epsilon, s.epsilon if s.epsilon_high is None else s.epsilon_high
    a = min(lo, hi)
    up, down = math.log1p(1.5 * hi), math.log((1 - lo) * (1 - 0.5 * lo))
    band_up = math.log1p(0.5 * (lo + hi)) if lo != hi else None
    band_down = math.log1p(-0.5 * (lo + hi)) if lo != hi and lo + hi < 2 else None
    cycles = {1: [up, band_up, math.log1p(0.5 * a), down], -1: [down, band_down, math.log1p(-0.5 * a), up],
              0: [math.log1p(0.5 * a), up, band_up, math.log1p(-0.5 * a), down, band_down]}
    cycles = {k: [x for x in c if x is not None] for k, c in cycles.items()}
    count = Counter()
    for i, sign in enumerate(signs):
        cyc, pos = cycles[sign], world.positions(i)
        if sequence:  # token ratios differ, their mean is the row's target
            noise = 0.05 * torch.randn(len(pos), generator=gen, dtype=torch.float64)
            world.log_ratio[i, pos] = cyc[count[sign] % len(cyc)] + noise - noise.mean()
        else:
            world.log_ratio[i, pos] = torch.tensor([cyc[(count[sign] + k) % len(cyc)] for k in range(len(pos))], dtype=torch.float64)
        count[sign] += 1


def _scored(world: World, rewards: list[float]) -> Batch:
    valid = torch.ones(N, dtype=torch.bool)
    valid[FAILED] = False
    return {**world.rows(range(N)), "rewards": torch.tensor(rewards), "valid": valid, "prompt_index": torch.arange(N) // G}


def _onpolicy(cls: type[Method], settings: dict, world: World) -> tuple[Method, StubTrainer]:
    m = make(cls, {"group_size": G, **settings})
    return m, StubTrainer(m.cfg, world, m.logprob_temperature())


def _place_clip_and_kl(m: Method, world: World, signs: list[int], tb: dict, gen: torch.Generator) -> None:
    if m.inner_epochs() > 1 or m.num_minibatches() > 1:  # pi_old differs from pi: a later inner epoch
        _design_ratios(world, signs, m.settings, tb["ratio"] == "sequence", gen)
    world.ref_offset[FAR, world.positions(FAR)[0]] = -25.0  # |log pi_ref/pi| past any clamp


def build_groups(cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int) -> Built:
    """On-policy groups (GRPO and its variants): the method's setup and prepare on 4 prompts x G scored samples,
    after one warm-up step (prepare, after_step) that sets any running state such as a baseline."""
    m, stub = _onpolicy(cls, settings, world)
    _place_clip_and_kl(m, world, _signs(REWARDS, [i != FAILED for i in range(N)]), tb or {"ratio": cls.ratio_level}, gen)
    m.setup(stub)  # type: ignore[arg-type]
    warm = torch.tensor(WARMUP)
    m.prepare({**world.rows(range(N)), "rewards": warm, "valid": torch.ones(N, dtype=torch.bool), "prompt_index": torch.arange(N) // G})
    m.after_step(1)
    raw = _scored(world, REWARDS)
    batch = m.prepare({k: v.clone() for k, v in raw.items()})
    return Built(m, batch, None if tb is None else (lambda lp: _groups_textbook(lp, raw, warm, stub, m, tb)))


def build_ppo(cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int) -> Built:
    """PPO: its prepare (values, token rewards, GAE, whitening) with a stub critic in place of setup's model."""
    m, stub = _onpolicy(cls, settings, world)
    _place_clip_and_kl(m, world, [0] * N, tb or {"ratio": cls.ratio_level}, gen)
    m.trainer, m.critic = stub, StubCritic(world)  # type: ignore[assignment]
    m.ref = stub.reference() if m.settings.beta > 0 else None  # type: ignore[attr-defined]
    raw = _scored(world, REWARDS)
    batch = m.prepare({k: v.clone() for k, v in raw.items()})
    return Built(m, batch, None if tb is None else (lambda lp: _ppo_textbook(lp, raw, stub, m, tb)))


def _design_margins(world: World, pairs: list[tuple[int, int]], tb: dict | None, s: Any) -> None:
    """pi_ref such that the pairs' margins lie on both sides of the loss's pivot (losses with a reference)."""
    if not tb or tb["loss"] not in PIVOT:
        return
    for k, (w, l) in enumerate(pairs):
        d = float(-(world.ref_offset[w] * world.loss_mask[w]).sum() + (world.ref_offset[l] * world.loss_mask[l]).sum())
        target = (PIVOT[tb["loss"]](s) + (1 if k % 2 == 0 else -1) * (0.4 + 0.2 * k)) / s.beta  # d at the wanted margin
        world.ref_offset[w, world.positions(w)[0]] += d - target


def build_pairs(cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int) -> Built:
    """Offline preference pairs (DPO and its variants): chosen at 2i, rejected at 2i+1, example weight 1/2."""
    m = make(cls, settings)
    pairs = [(2 * k, 2 * k + 1) for k in range(N // 2)]
    _design_margins(world, pairs, tb, m.settings)
    batch = {**world.rows(range(N)), "example_weight": torch.full((N,), 0.5)}
    stub = StubTrainer(m.cfg, world, 1.0)
    ref = stub.logprobs(stub.ref, world.rows(range(N))).double()
    if getattr(cls, "uses_reference", True):
        batch["ref_logps"] = ref.float()
    return Built(m, batch, None if tb is None else (lambda lp: _pairs_textbook(lp, pairs, ref, world, m, tb, Counter())))


def _online_textbook(lp_all: torch.Tensor, raw: Batch, stub: StubTrainer, m: Method, tb: dict) -> Textbook:
    """Online DPO (Guo et al. 2024): per prompt, the best and the worst valid sample (the first of equals) as a pair;
    a prompt whose valid rewards are all equal forms none."""
    R, valid, pairs = raw["rewards"].tolist(), raw["valid"].tolist(), []
    br = Counter({"failed rewards": valid.count(False)})
    for g in range(N // G):
        idx = [i for i in range(g * G, g * G + G) if valid[i]]
        r = [R[i] for i in idx]
        if len(idx) < 2 or max(r) == min(r):
            br["prompts skipped (equal rewards)"] += 1
            continue
        pairs.append((idx[r.index(max(r))], idx[r.index(min(r))]))
    ref = stub.logprobs(stub.ref, stub.world.rows(range(N))).double()
    t = _pairs_textbook(lp_all, pairs, ref, stub.world, m, tb, br)
    return Textbook(t.J, br, t.required | {"failed rewards", "prompts skipped (equal rewards)"})


def build_online_pairs(cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int) -> Built:
    """Online DPO: the method's setup and prepare pair its own scored samples."""
    m, stub = _onpolicy(cls, settings, world)
    _design_margins(world, [(0, 1), (8, 10), (12, 13)], tb, m.settings)  # the pairs REWARDS make
    m.setup(stub)  # type: ignore[arg-type]
    raw = _scored(world, REWARDS)
    batch = m.prepare({k: v.clone() for k, v in raw.items()})
    return Built(m, batch, None if tb is None else (lambda lp: _online_textbook(lp, raw, stub, m, tb)))


def _kto_textbook(lp_all: torch.Tensor, raw: Batch, kl_rows: Batch, stub: StubTrainer, m: Method) -> Textbook:
    """KTO (Ethayarajh et al. 2024, eq. 8): lambda_y (1 - sigmoid(+-beta (r - z0))), r = sum_t log pi/pi_ref,
    z0 = max(0, mean of r over mismatched prompt/completion rows), held constant."""
    s, mask = m.settings, raw["loss_mask"].double()
    kl = ((stub.logprobs(stub.policy, kl_rows) - stub.logprobs(stub.ref, kl_rows)).double() * kl_rows["loss_mask"]).sum(-1)
    z0 = max(0.0, float(kl.mean()))
    r = ((lp_all[raw["row_id"]] - stub.logprobs(stub.ref, raw).double()) * mask).sum(-1)  # [B]
    good = raw["desirable"]
    loss = torch.where(good, s.desirable_weight * torch.sigmoid(-s.beta * (r - z0)),
                       s.undesirable_weight * torch.sigmoid(-s.beta * (z0 - r)))  # [B]: lambda_y (1 - sigmoid(...))
    br = Counter({"z0 = 0 (mean KL below 0)": int(z0 == 0.0), "z0 > 0": int(z0 > 0.0)})
    for label, sel in (("desirable", good), ("undesirable", ~good)):
        br[f"{label}, r > z0"] += int((sel & (r.detach() > z0)).sum())
        br[f"{label}, r < z0"] += int((sel & (r.detach() < z0)).sum())
    return Textbook(-loss.sum() / len(r), br, set(br))


def build_unpaired(cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int) -> Built:
    """KTO: rows 0..7 labelled alternately, rows 8..15 the mismatched pairs of z0; prepare on the stub trainer."""
    m = make(cls, settings)
    stub = StubTrainer(m.cfg, world, 1.0)
    m.trainer, m.ref = stub, stub.reference()  # type: ignore[assignment,attr-defined]
    n = N // 2
    sign = 1.0 if seed % 2 == 0 else -1.0  # the mismatched rows' mean KL: below 0 (z0 clamped) or above
    world.ref_offset[n:] = (0.2 * torch.randn(n, L, generator=gen, dtype=torch.float64) + sign * 0.5) * world.loss_mask[n:]
    z0 = max(0.0, float(-(world.ref_offset[n:] * world.loss_mask[n:]).sum(-1).mean()))
    for k in range(n):  # r = z0 +- delta for both labels
        target = z0 + (1 if (k // 2) % 2 == 0 else -1) * (0.5 + 0.25 * k) / m.settings.beta
        world.ref_offset[k, world.positions(k)[0]] -= target + float((world.ref_offset[k] * world.loss_mask[k]).sum())
    raw = {**world.rows(range(n)), "desirable": torch.tensor([k % 2 == 0 for k in range(n)])}
    kl_rows = world.rows(range(n, N))
    batch = m.prepare({**{k: v.clone() for k, v in raw.items()}, "kl_batch": dict(kl_rows)})
    return Built(m, batch, None if tb is None else (lambda lp: _kto_textbook(lp, raw, kl_rows, stub, m)))


def build_kept(cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int) -> Built:
    """Rejection sampling: the method's prepare keeps the valid samples whose reward clears the threshold."""
    m, stub = _onpolicy(cls, settings, world)
    m.setup(stub)  # type: ignore[arg-type]
    raw = _scored(world, REWARDS)
    batch = m.prepare({k: v.clone() for k, v in raw.items()})

    def textbook(lp_all: torch.Tensor) -> Textbook:  # DeepSeekMath 5.2.1: the SFT objective on the kept samples
        kept = raw["valid"] & (raw["rewards"] >= m.settings.reward_threshold)
        br = Counter({"kept": int(kept.sum()), "rejected": int((raw["valid"] & ~kept).sum()),
                      "failed rewards": int((~raw["valid"]).sum())})
        J = _aggregate(lp_all[raw["row_id"]], raw["loss_mask"].double(), kept.double(), m.norm, m.cfg.norm_constant)
        return Textbook(J, br, set(br))

    return Built(m, batch, None if tb is None else textbook)


def build_demonstrations(cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int) -> Built:
    """SFT: fixed rows of several lengths; J is the log-likelihood under the method's aggregation."""
    m, rows = make(cls, settings), world.rows(range(N // 2))

    def textbook(lp_all: torch.Tensor) -> Textbook:
        every = torch.ones(N // 2, dtype=torch.float64)
        J = _aggregate(lp_all[rows["row_id"]], rows["loss_mask"].double(), every, m.norm, m.cfg.norm_constant)
        return Textbook(J, Counter(), set())

    return Built(m, rows, None if tb is None else textbook)


# ----------------------------------------------------------------------------- families and the textbook each knows


@dataclass
class Family:
    name: str
    build: Callable[..., Built]
    cases: Callable[[type[Method]], list[tuple[str, dict]]]
    textbook: str
    """What the textbook states, in a line (`gcf check` prints it)."""
    hooks: dict[str, dict[str, str]] = field(default_factory=dict)
    """hook -> {class that defines it: its textbook name}; a hook defined elsewhere is the user's own."""
    clipped: bool = False
    """Whether the ratio is GRPO/PPO's: per token, or per sequence with ratio_level=sequence (GSPO)."""


def _group_cases(cls: type[Method]) -> list[tuple[str, dict]]:
    beta = cls.Settings().beta or 0.1  # type: ignore[attr-defined]  # a method without the KL term by default gets one
    return [("defaults", {}), ("clip and KL", {"mu": 2, "beta": beta}),
            ("minibatches, k1, batch std", {"num_minibatches": 2, "beta": beta, "kl_estimator": "k1", "scale_rewards": "batch",
                                            "std_eps": 1e-4, "std": "population"}),
            ("k2 unclamped, no std, sum", {"mu": 2, "beta": beta, "kl_estimator": "k2", "kl_clamp": None, "scale_rewards": "none",
                                           "loss_norm": "sum"}),
            ("k3-iw clamp 0.5, zero_std exclude, token", {"mu": 2, "beta": beta, "kl_estimator": "k3-importance-weighted", "kl_clamp": 0.5,
                                                          "zero_std": "exclude", "loss_norm": "token"}),
            ("KL in the reward, constant", {"mu": 2, "beta": 0.02, "kl_placement": "reward", "kl_estimator": "k1", "loss_norm": "constant",
                                            "norm_constant": 3.0})]


def _short(q: str) -> str:
    return q.rsplit(".", 1)[-1]


CLIP_HOOKS = {"clip_range": {CLIP_: ""}, "clipped": {CLIP_: ""}, "kl_in_loss": {CLIP_: ""}, "kl_reward": {CLIP_: ""}}
SURROGATE = ("min(r A, clip(r, 1 - eps, 1 + eps_high) A) - beta KL_t (k1, k2, k3, k3-iw by definition, clamped as set), "
             "r per token or sequence")
PAIR_LOSSES = {("DPO", "DPO"): "dpo", ("DPO", "IPO"): "ipo", ("DPO", "ConservativeDPO"): "cdpo", ("SimPO", "SimPO"): "simpo",
               ("ORPO", "ORPO"): "orpo"}
PAIR_HOOKS = {"rewards": {DPO_: "", M + "dpo.SimPO": "", M + "orpo.ORPO": ""},
              "pair_loss": {DPO_: "", M + "dpo.IPO": "", M + "dpo.ConservativeDPO": "", M + "dpo.SimPO": "", M + "orpo.ORPO": ""}}
FAMILIES: dict[str, Family] = {
    M + "kto.KTO": Family("unpaired labels (KTO)", build_unpaired,
                          lambda c: [("defaults", {}),
                                     ("weights and beta", {"beta": 0.5, "desirable_weight": 1.33, "undesirable_weight": 0.7})],
                          "lambda_y (1 - sigmoid(+-beta (r - z0))), z0 = max(0, mean KL of mismatched rows), held constant",
                          {"prepare": {M + "kto.KTO": ""}}),
    M + "online_dpo.OnlineDPO": Family("online pairs", build_online_pairs, lambda c: [("defaults", {}), ("beta 0.5", {"beta": 0.5})],
                                       "the pair loss on each prompt's best and worst valid sample; equal prompts form none",
                                       {"prepare": {M + "online_dpo.OnlineDPO": ""}, **PAIR_HOOKS}),
    DPO_: Family("preference pairs", build_pairs,
                 lambda c: [("defaults", {}),
                            ("other beta and loss settings",
                             {"beta": 0.5, "label_smoothing": 0.3, "simpo_gamma": 1.0, "orpo_lambda": 0.5})],
                 "the pair loss (DPO -log sigmoid, cDPO, IPO's square, SimPO's margin, ORPO's odds ratio) averaged over pairs",
                 PAIR_HOOKS),
    PPO_: Family("on-policy samples with a critic (PPO)", build_ppo,
                 lambda c: [("defaults", {}), ("clip and KL", {"mu": 2}),
                            ("KL in the reward, GAE 0.9/0.8", {"mu": 2, "kl_placement": "reward", "gamma": 0.9, "lam": 0.8}),
                            ("minibatches, k2 clamp 0.5, sequence",
                             {"num_minibatches": 2, "kl_estimator": "k2", "kl_clamp": 0.5, "loss_norm": "sequence"}),
                            ("k3-iw unclamped", {"mu": 2, "kl_estimator": "k3-importance-weighted", "kl_clamp": None})],
                 SURROGATE + "; A = whitened GAE on the critic's values",
                 {"prepare": {PPO_: ""}, "token_rewards": {PPO_: ""}, "token_advantages": {PPO_: ""}, **CLIP_HOOKS}, True),
    GRPO_: Family("on-policy groups", build_groups, _group_cases, SURROGATE + "; A from the rewards",
                  {"group_advantages": {GRPO_: "group-relative", M + "grpo_variants.RLOO": "leave-one-out",
                                        RB_: "running baseline"},
                   "equal_reward_groups": {GRPO_: "", RB_: ""}, "add_advantages": {GRPO_: ""}, "token_advantages": {GRPO_: ""},
                   "prepare": {GRPO_: ""}, "after_step": {GRPO_: "", RB_: ""}, **CLIP_HOOKS}, True),
    M + "rft.RFT": Family("kept samples (rejection sampling)", build_kept,
                          lambda c: [("defaults", {}), ("threshold 0.2, sequence", {"reward_threshold": 0.2, "loss_norm": "sequence"})],
                          "the log-likelihood of the valid samples whose reward clears the threshold",
                          {"prepare": {M + "rft.RFT": ""}}),
    M + "sft.SFT": Family("demonstrations", build_demonstrations,
                          lambda c: [("defaults", {}), ("sequence", {"loss_norm": "sequence"}), ("sum", {"loss_norm": "sum"})],
                          "the log-likelihood under the method's aggregation"),
}


def family_of(cls: type[Method]) -> Family | None:
    """The family of the nearest class in cls's MRO that has one."""
    return next((FAMILIES[_qual(c)] for c in cls.__mro__ if _qual(c) in FAMILIES), None)


def textbook_for(cls: type[Method]) -> tuple[dict | None, str]:
    """(the textbook's choices, '') or (None, one sentence naming the hook it does not know)."""
    fam = family_of(cls)
    assert fam is not None
    tb: dict[str, str] = {}
    for hook, known in fam.hooks.items():
        where = _definer(cls, hook)
        if where not in known:
            return None, (f"{cls.__name__}.{hook} is its own (defined in {where}); the textbook of the {fam.name} family "
                          f"restates only {', '.join(_short(k) for k in known)}'s {hook}")
        if known[where]:
            tb["advantage"] = known[where]
    if "pair_loss" in fam.hooks:
        combo = (_short(_definer(cls, "rewards")), _short(_definer(cls, "pair_loss")))
        if combo not in PAIR_LOSSES:
            return None, f"{cls.__name__} pairs {combo[0]}'s rewards with {combo[1]}'s pair_loss, a loss the textbook does not state"
        tb["loss"] = PAIR_LOSSES[combo]
    if fam.clipped:
        where = _definer(cls, "importance_ratio")
        if cls.ratio_level == "sequence":  # GSPO's s_i = exp(mean_t log pi/pi_old), whoever writes it
            tb["ratio"] = "sequence"
        elif where == CLIP_:
            tb["ratio"] = "token"
        else:
            return None, (f"{cls.__name__}.importance_ratio is its own (defined in {where}) at ratio_level={cls.ratio_level}; "
                          "the textbook knows the token ratio pi/pi_old and GSPO's sequence ratio exp(mean_t log pi/pi_old) "
                          "(ratio_level=sequence)")
    return tb, ""


# ----------------------------------------------------------------------------- running the checks


@dataclass
class Outcome:
    label: str
    settings: dict
    diffs: dict[str, tuple[float, float]] = field(default_factory=dict)
    """check -> (largest |difference|, largest |entry| of the expected side), worst over the seeds."""
    branches: Counter = field(default_factory=Counter)
    required: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    failed: dict[str, tuple[float, str]] = field(default_factory=dict)
    """check -> (worst relative difference, its message), for checks past their tolerance."""
    refused: str = ""
    textbook: bool = True

    @property
    def failures(self) -> list[str]:
        return [msg for _, msg in self.failed.values()] + self.errors

    @property
    def missing(self) -> list[str]:
        return sorted(b for b in self.required if not any(k.endswith(b) and n > 0 for k, n in self.branches.items()))

    @property
    def ok(self) -> bool:
        return not self.failures and not self.missing and not self.refused


def _engine_logps(X: torch.Tensor, mb: Batch, tau: float) -> torch.Tensor:
    """The micro-batch's log-probs through the engine's chunked output layer; the hidden states are the logits
    (identity weight), so d loss / d X is d loss / d logits."""
    mask = mb["loss_mask"].bool()
    h = X[mb["row_id"]][mask]  # [tokens, V]
    lp, _ = engine._ChunkedTokenLogprob.apply(h, torch.eye(V, dtype=X.dtype), None, mb["input_ids"][mask], float(tau), 5, False, None, None)
    return torch.zeros(mask.shape, dtype=lp.dtype).masked_scatter(mask, lp)  # [b, L]


def _diff(name: str, got: torch.Tensor, want: torch.Tensor, tol: float, out: Outcome, seed: int) -> None:
    """Record a check's largest difference; a failure once per check (its worst seed)."""
    d, scale = float((got - want).abs().max()), float(want.abs().max())
    old = out.diffs.get(name, (0.0, 0.0))
    out.diffs[name] = (max(old[0], d), max(old[1], scale))
    if not d <= tol * scale + 1e-12 and d / max(scale, 1e-300) > out.failed.get(name, (0.0, ""))[0]:
        out.failed[name] = (d / max(scale, 1e-300), f"{name}: max |diff| {d:.3g} against a largest entry of {scale:.3g} (seed {seed})")


def check_once(cls: type[Method], settings: dict, seed: int, out: Outcome, tb: dict | None) -> None:
    fam = family_of(cls)
    assert fam is not None
    gen = torch.Generator().manual_seed(seed)
    world = World(N, gen)
    built = fam.build(cls, settings, world, gen, tb, seed)
    m, batch = built.method, built.batch
    tau = m.logprob_temperature()
    ids, B = batch["row_id"], batch["input_ids"].shape[0]
    size = max(m.rows_per_example, MICRO - MICRO % m.rows_per_example)
    mbs = [select(batch, slice(s, s + size)) for s in range(0, B, size)]
    out.branches["micro-batches"] += len(mbs)
    out.required.add("micro-batches")
    Z = engine.normaliser(mbs, m.norm, m.cfg.norm_constant)
    base = world.logps(tau=tau)  # [n, L] the current policy

    lp = base.clone().requires_grad_(True)  # (a) the engine, micro-batch by micro-batch
    for mb in mbs:
        engine.weighted_loss(m.coefficient(mb, lp[mb["row_id"]].detach()), lp[mb["row_id"]], mb, m.norm, Z).backward()
    got = lp.grad if lp.grad is not None else torch.zeros_like(base)
    lp = base.clone().requires_grad_(True)
    try:
        own = torch.autograd.grad(-m.objective(batch, lp[ids], Z), lp, allow_unused=True)[0]
    except NotImplementedError:
        out.errors.append(f"{cls.__name__} has no objective: write {cls.__name__}.objective(batch, logps, Z), J to maximise")
        return
    own = torch.zeros_like(base) if own is None else own
    _diff("(a) engine vs own objective", got, own, TOL_A, out, seed)
    want = own
    if built.textbook is not None:
        lp = base.clone().requires_grad_(True)
        t = built.textbook(lp)
        want = torch.autograd.grad(-t.J, lp, allow_unused=True)[0]
        want = torch.zeros_like(base) if want is None else want
        _diff("(a) engine vs textbook", got, want, TOL_A, out, seed)
        _diff("(a) own objective vs textbook", own, want, TOL_A, out, seed)
        out.branches.update(t.branches)
        out.required |= t.required

    X = world.logits.float().requires_grad_(True)  # (b) the real log-prob backward
    coefs = []
    for mb in mbs:
        lp_mb = _engine_logps(X, mb, tau)
        coefs.append(m.coefficient(mb, lp_mb.detach()))
        engine.weighted_loss(coefs[-1], lp_mb, mb, m.norm, Z).backward()
    w = engine.token_weights(batch, m.norm)  # [B, L]
    dJ = -want[ids]  # [B, L] the textbook's dJ/dlogp
    on = w > 0
    gc = torch.zeros_like(dJ)
    gc[on] = dJ[on] * Z / w[on]  # GC = (dJ/dlogp) / (w / Z)
    stray = float(dJ[~on].abs().max()) if (~on).any() else 0.0
    if stray > 1e-12:
        out.errors.append(f"(b) the textbook's gradient is {stray:.3g} on a token the engine weighs 0 (a masked row or padding)")
    onehot = F.one_hot(batch["input_ids"], V).double()
    soft = torch.softmax(world.logits[ids] / tau, -1)
    closed = torch.zeros_like(world.logits).index_add_(0, ids, -(gc * w / Z)[..., None] * (onehot - soft) / tau)
    source = "textbook" if built.textbook is not None else "own objective"
    _diff(f"(b) d loss/d logits vs {source} GC * w/Z * (onehot - softmax)", X.grad.double(), closed, TOL_B, out, seed)
    coef = torch.cat([c.double() * mb["loss_mask"] for c, mb in zip(coefs, mbs)])
    scale = float(gc[on].abs().max()) if on.any() else 0.0
    d = float((coef - gc)[on].abs().max()) if on.any() else 0.0
    name = f"    GC: the method's vs the {source}'s (float32 log-probs)"
    out.diffs[name] = (max(out.diffs.get(name, (0.0, 0.0))[0], d), scale)


def check_no_policy(cls: type[Method], out: Outcome) -> None:
    """A method that trains only a model of its own: GC = 0 and an objective constant in the policy."""
    m, world = make(cls, {}), World(N, torch.Generator().manual_seed(0))
    batch = world.rows(range(N))
    lp = world.logps().requires_grad_(True)
    coef = m.coefficient(batch, lp.detach())
    g = torch.autograd.grad(m.objective(batch, lp, 1.0), lp, allow_unused=True)[0]
    out.diffs["GC (trains no policy)"] = (float(coef.abs().max()), 0.0)
    out.diffs["d objective / d logp (trains no policy)"] = (0.0 if g is None else float(g.abs().max()), 0.0)
    if (coef != 0).any() or (g is not None and (g != 0).any()):
        out.errors.append(f"{cls.__name__} trains no policy but gives it a coefficient or an objective that depends on it")


def cases(cls: type[Method]) -> list[tuple[str, dict]]:
    """The cases a method is checked at: its defaults, then settings that reach every branch (only the keys it has)."""
    fam = family_of(cls)
    if not getattr(cls, "trains_policy", True):
        return [("defaults", {})]
    if fam is None:
        raise GcfError(unsupported(cls))
    own = {f.name for f in fields(cls.Settings)}
    return [(label, {k: v for k, v in s.items() if k in own or k in FIELDS}) for label, s in fam.cases(cls)]


def unsupported(cls: type[Method]) -> str:
    roots = ", ".join(c.rsplit(".", 1)[-1] for c in FAMILIES)
    return (f"{cls.__name__} belongs to no data family the check can build a batch for (it subclasses none of {roots}); "
            "subclass the method whose data it uses, or check it with a test of your own.")


def run_case(cls: type[Method], label: str, settings: dict, seeds: tuple[int, ...] = (0, 1)) -> Outcome:
    """Checks (a) and (b) of one settings case on each seed's batch; branches are counted over the seeds."""
    out = Outcome(label, settings)
    if not getattr(cls, "trains_policy", True):
        check_no_policy(cls, out)
        return out
    if family_of(cls) is None:
        raise GcfError(unsupported(cls))
    tb, why = textbook_for(cls)
    out.textbook = tb is not None
    try:
        make(cls, {"group_size": G, **settings})
    except GcfError as e:
        out.refused = str(e)
        return out
    for seed in seeds:
        try:
            check_once(cls, settings, seed, out, tb)
        except GcfError:
            raise
        except Exception as e:  # the method's own code raised on the check's batch
            out.errors.append(f"seed {seed}: {type(e).__name__}: {e}")
            break
    return out


def _source(cls: type) -> str:
    """The module of a library class, or the file of a user's (relative to the working folder where it can be)."""
    if cls.__module__.startswith("gcfamily."):
        return cls.__module__
    try:
        path = Path(inspect.getfile(cls)).resolve()
    except (TypeError, OSError):
        return cls.__module__
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def report(spec: str, cls: type[Method], outcomes: list[Outcome]) -> tuple[str, bool]:
    """The text `gcf check` prints, and whether every case passed."""
    fam = family_of(cls)
    lines = [f"gcf check {spec}: {cls.__qualname__} from {_source(cls)}"]
    why = ""
    if fam is None or not getattr(cls, "trains_policy", True):
        lines.append("trains no policy: its coefficient must be 0 and its objective constant in the policy")
    else:
        tb, why = textbook_for(cls)
        lines.append(f"family: {fam.name}; batches from its own setup and prepare on a stub trainer")
        lines.append(f"textbook: none: {why}; checked against its own objective only" if why else
                     f"textbook: {fam.textbook}" + (f" [{', '.join(f'{k}: {v}' for k, v in tb.items())}]" if tb else ""))
    for o in outcomes:
        status = "ok" if o.ok else ("refused" if o.refused else "FAILED")
        lines.append(f"case {o.label} {o.settings or '(its defaults)'}: {status}")
        if o.refused:
            lines.append(f"  the method refuses these settings: {o.refused}")
        for name, (d, scale) in o.diffs.items():
            lines.append(f"  {name:<62} max |diff| {d:.2e}  (largest entry {scale:.2e})")
        if o.branches:
            lines.append("  branches: " + ", ".join(f"{k} {n}" for k, n in sorted(o.branches.items()) if n))
        lines += [f"  FAILED {f}" for f in o.failures]
        if o.missing:
            lines.append(f"  FAILED branches that did not occur on the check's batch: {', '.join(o.missing)}")
    ok = all(o.ok for o in outcomes)
    if any(k.startswith("(a) engine vs textbook") for o in outcomes for k in o.failed) and not any(
            k.startswith("(a) engine vs own") for o in outcomes for k in o.failed):
        lines.append("hint: the engine agrees with the class's own objective but not with the textbook: both share a mistake, "
                     "or the rule changes the objective itself, which the textbook of its family does not state")
    lines.append(("passed" if ok else "failed") + f": {sum(o.ok for o in outcomes)} of {len(outcomes)} cases"
                 + (" (against the method's own objective only)" if why else ""))
    return "\n".join(lines), ok
