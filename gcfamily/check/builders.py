"""The batches of gcf check (gcfamily/check/), one builder per data family: each makes the method, its stub trainer and a batch
through the method's own `setup`/`prepare`, places ratios, clips, KL values and margins so that every branch of the
rule is reached, and returns the textbook objective of that batch (gcfamily/check/textbook.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gcfamily.check.pair_design import _design_margins
from gcfamily.check.pair_textbook import _pairs_textbook
from gcfamily.check.sampler import design_sampler, sampled
from gcfamily.check.second import critic_check
from gcfamily.check.textbook import (
    Textbook,
    _aggregate,
    _groups_textbook,
    _kept_textbook,
    _ppo_textbook,
    _process_textbook,
)
from gcfamily.check.world import (
    FAILED,
    FAR,
    REWARDS,
    SECOND_REWARD,
    TRUNCATED,
    WARMUP,
    Collective,
    G,
    L,
    N,
    PadOnly,
    StubCritic,
    StubServices,
    TextFormatter,
    World,
    make,
)
from gcfamily.core.batch import select
from gcfamily.methods.base import TOKEN, Batch, Method


@dataclass
class Built:
    method: Method
    batch: Batch
    textbook: Callable[[torch.Tensor], Textbook] | None
    tau: float = 1.0
    """The temperature of the textbook's pi: the sampling temperature (settings' `temperature`) for a family that
    samples, 1 for one that trains on fixed rows."""
    parts: list[tuple[Method, Batch]] = field(default_factory=list)
    """Each simulated rank's method and its prepared share of the step's rows; empty: one rank (method, batch)."""
    second: Callable[[list[Batch]], Any] | None = None
    """The second model's check (PPO's critic) on the step's micro-batches: second.SecondCheck."""

    def ranks(self) -> list[tuple[Method, Batch]]:
        return self.parts or [(self.method, self.batch)]


def _on_ranks(
    cls: type[Method],
    settings: dict,
    world: World,
    ranks: int,
    work: Callable[[Method, StubServices, slice], Batch],
) -> list[tuple[Method, Batch]]:
    """work(method, its stub trainer, its rows) for each of `ranks` simulated ranks, each on a thread of its own (a
    method's all_sum waits for the others); rank r takes the r-th contiguous share of the N rows, whole groups."""
    coll = Collective(ranks) if ranks > 1 else None
    ms = [make(cls, {"group_size": G, **settings}) for _ in range(ranks)]
    stubs = [StubServices(m.cfg, world, m.cfg.temperature, r, coll) for r, m in enumerate(ms)]
    share = [slice(r * N // ranks, (r + 1) * N // ranks) for r in range(ranks)]
    jobs = [lambda r=r: work(ms[r], stubs[r], share[r]) for r in range(ranks)]
    batches = coll.run(jobs) if coll is not None else [jobs[0]()]
    return list(zip(ms, batches))


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
    up, down = math.log1p(1.5 * hi), math.log((1 - lo) * (1 - 0.5 * lo)) if lo < 1 else None  # lo >= 1: no lower clip
    band_up = math.log1p(0.5 * (lo + hi)) if lo != hi else None
    band_down = math.log1p(-0.5 * (lo + hi)) if lo != hi and lo + hi < 2 else None
    cycles = {
        1: [up, band_up, math.log1p(0.5 * a), down],
        -1: [down, band_down, math.log1p(-0.5 * a), up],
        0: [math.log1p(0.5 * a), up, band_up, math.log1p(-0.5 * a), down, band_down],
    }
    if getattr(s, "dual_clip", None):  # past dual-clip's c, where A < 0 (a row of either sign for per-token A)
        cycles[-1].insert(1, math.log(1.25 * s.dual_clip))
        cycles[0].insert(2, math.log(1.25 * s.dual_clip))
    cycles = {k: [x for x in c if x is not None] for k, c in cycles.items()}
    count = Counter()
    for i, sign in enumerate(signs):
        cyc, pos = cycles[sign], world.positions(i)
        if sequence:  # token ratios differ, their mean is the row's target
            noise = 0.05 * torch.randn(len(pos), generator=gen, dtype=torch.float64)
            world.log_ratio[i, pos] = cyc[count[sign] % len(cyc)] + noise - noise.mean()
        else:
            world.log_ratio[i, pos] = torch.tensor(
                [cyc[(count[sign] + k) % len(cyc)] for k in range(len(pos))], dtype=torch.float64
            )
        count[sign] += 1


def _scored(world: World, rewards: list[float], stub: StubServices) -> Batch:
    """The step's N sampled rows as the rollout gives them: rewards (one failed), and the sampler's log-probs."""
    valid = torch.ones(N, dtype=torch.bool)
    valid[FAILED] = False
    truncated = torch.zeros(N, dtype=torch.bool)
    truncated[list(TRUNCATED)] = True
    parts = torch.tensor([rewards, SECOND_REWARD[: len(rewards)]]).T  # [N, 2]: the first is the reward itself
    rows = world.rows(range(N)).replaced(
        rewards=torch.tensor(rewards),
        valid=valid,
        prompt_index=torch.arange(N) // G,
        truncated=truncated,
        reward_parts=parts,
    )
    return sampled(rows, stub)


def _onpolicy(cls: type[Method], settings: dict, world: World) -> tuple[Method, StubServices]:
    """The method and its stub trainer, whose pi_old and pi_ref the textbook reads at the sampling temperature (the
    settings', not the method's `logprob_temperature`, which is what the check tests)."""
    m = make(cls, {"group_size": G, **settings})
    design_sampler(world, m.settings)  # where the sampler's log-probs lie against pi_old (check/sampler.py)
    return m, StubServices(m.cfg, world, m.cfg.temperature)


def _place_clip_and_kl(m: Method, world: World, signs: list[int], tb: dict, gen: torch.Generator) -> None:
    if m.inner_epochs() > 1 or m.num_minibatches() > 1:  # pi_old differs from pi: a later inner epoch
        _design_ratios(world, signs, m.settings, tb["ratio"] == "sequence", gen)
    world.ref_offset[FAR, world.positions(FAR)[0]] = -25.0  # |log pi_ref/pi| past any clamp


def build_groups(
    cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int, ranks: int = 1
) -> Built:
    """On-policy groups (GRPO and its variants): the method's setup and prepare on 4 prompts x G scored samples,
    after warm-up steps (prepare, after_step) that carry any running state such as a baseline over several steps;
    on `ranks` simulated ranks, each with its share of the prompts."""
    m, stub = _onpolicy(cls, settings, world)
    _place_clip_and_kl(
        m, world, _signs(REWARDS, [i != FAILED for i in range(N)]), tb or {"ratio": cls.ratio_level}, gen
    )
    warm = [torch.tensor(w) for w in WARMUP]
    raw = _scored(world, REWARDS, stub)

    def work(m: Method, stub: StubServices, rows: slice) -> Batch:
        m.setup(stub)  # type: ignore[arg-type]
        for k, w in enumerate(warm):
            every = world.rows(range(N)).replaced(
                rewards=w, valid=torch.ones(N, dtype=torch.bool), reward_parts=torch.stack([w, w], -1).float()
            )
            m.prepare(select(every.replaced(prompt_index=torch.arange(N) // G), rows))
            m.after_step(k + 1)
        return m.prepare(select(raw.clone(), rows))[0]

    parts = _on_ranks(cls, settings, world, ranks, work)
    tb_stub = StubServices(m.cfg, world, m.cfg.temperature)
    textbook = None if tb is None else (lambda lp: _groups_textbook(lp, raw, warm, tb_stub, m, tb))
    return Built(parts[0][0], parts[0][1], textbook, stub.tau, parts if ranks > 1 else [])


# steps per output (score of each, in order; an empty list: no step scored) for 4 prompts x G = 4: group 0 mixes
# several steps and an output with none, group 1 has one step each (outcome-like) with distinct rewards, group 2
# holds the failed sample, group 3's step rewards are all equal (away from FAR, whose KL must stay in Z)
# fmt: skip
STEPS = [
    [1.0, 0.0, 1.0],
    [],
    [0.5, 1.0],
    [0.0],
    [1.0],
    [0.0],
    [0.25],
    [0.6],
    [1.0, 1.0],
    [0.3],
    [0.0, 0.2, 0.9],
    [0.7],
    [0.5],
    [0.5, 0.5],
    [0.5],
    [0.5, 0.5, 0.5],
]


def build_process(
    cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int
) -> Built:
    """On-policy groups with step rewards (process supervision): STEPS placed on each output's completion tokens,
    the last step on its last token, through the method's own setup and prepare."""
    m, stub = _onpolicy(cls, settings, world)
    _place_clip_and_kl(m, world, [0] * N, tb or {"ratio": cls.ratio_level}, gen)
    m.setup(stub)  # type: ignore[arg-type]
    raw = _scored(world, [sum(x) for x in STEPS], stub)
    R, at = torch.zeros(N, L), torch.zeros(N, L, dtype=torch.bool)
    for i, scores in enumerate(STEPS):
        pos = world.positions(i)
        for j, sc in enumerate(scores):  # steps spread over the completion, the last one on its last token
            t = pos[len(pos) * (j + 1) // len(scores) - 1]
            R[i, t], at[i, t] = sc, True
    raw = raw.replaced(step_rewards=R, step_mask=at)
    batch, _ = m.prepare(raw.clone())
    return Built(m, batch, None if tb is None else (lambda lp: _process_textbook(lp, raw, stub, m, tb)), stub.tau)


def build_ppo(
    cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int, ranks: int = 1
) -> Built:
    """PPO: its prepare (values, token rewards, GAE, whitening) with a stub critic in place of setup's model, on
    `ranks` simulated ranks; on one rank, its critic's loss and step too (second.critic_check)."""
    m, stub = _onpolicy(cls, settings, world)
    _place_clip_and_kl(m, world, [0] * N, tb or {"ratio": cls.ratio_level}, gen)
    raw = _scored(world, REWARDS, stub)

    def work(m: Method, stub: StubServices, rows: slice) -> Batch:
        m.services, m.critic = stub, StubCritic(world)  # type: ignore[assignment]
        m.ref = stub.reference() if m.settings.beta > 0 else None  # type: ignore[attr-defined]
        return m.prepare(select(raw.clone(), rows))[0]

    parts = _on_ranks(cls, settings, world, ranks, work)
    m, batch = parts[0]
    tb_stub = StubServices(m.cfg, world, m.cfg.temperature)
    textbook = None if tb is None else (lambda lp: _ppo_textbook(lp, raw, tb_stub, m, tb))
    second = None if ranks > 1 else (lambda mbs: critic_check(m, mbs, raw, tb_stub, gen))
    return Built(m, batch, textbook, stub.tau, parts if ranks > 1 else [], second)


def build_pairs(
    cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int
) -> Built:
    """Offline preference pairs (DPO and its variants) as the method lays them out: World rows 2k (chosen) and 2k+1
    (rejected) share a prompt and are handed to its own setup as rows of text, its own data() collates the step; the
    textbook knows each pair by the rows' contents, never by where the method put them."""
    m = make(cls, settings)
    pairs = [(2 * k, 2 * k + 1) for k in range(N // 2)]
    for w, l in pairs:
        world.share_prompt(w, l)
    _design_margins(world, pairs, tb, m.settings)
    stub = StubServices(m.cfg, world, 1.0)
    stub.rows = [
        {
            "prompt": world.text(w, "prompt"),
            "chosen": world.text(w, "completion"),
            "rejected": world.text(l, "completion"),
        }
        for w, l in pairs
    ]
    stub.formatter, stub.tokenizer = TextFormatter(), PadOnly()
    object.__setattr__(m.cfg, "batch_size", len(pairs))  # the step holds every pair once
    stub.policy = stub.reference  # type: ignore[method-assign]  # setup runs before any update: its policy is pi_ref
    m.setup(stub)  # type: ignore[arg-type]
    del stub.policy  # the policy again, after the update the check's pi stands for
    batch, _ = m.data(0)
    width = batch.input_ids.shape[1]
    batch = batch.replaced(
        **{k: torch.nn.functional.pad(v, (0, L - width)) for k, v, role in batch.items() if role == TOKEN}
    )
    batch.row_id = world.find(batch)
    ref = stub.logprobs(stub.ref, world.rows(range(N))).double()
    return Built(
        m, batch, None if tb is None else (lambda lp: _pairs_textbook(lp, pairs, ref, world, m, tb, Counter()))
    )


def _online_textbook(lp_all: torch.Tensor, raw: Batch, stub: StubServices, m: Method, tb: dict) -> Textbook:
    """Online DPO (Guo et al. 2024): per prompt, the best and the worst valid sample (the first of equals) as a pair;
    a prompt whose valid rewards are all equal forms none."""
    R, valid, pairs = raw.rewards.tolist(), raw.valid.tolist(), []
    br = Counter({"failed rewards": valid.count(False)})
    for g in range(N // G):
        idx = [i for i in range(g * G, g * G + G) if valid[i]]
        r = [R[i] for i in idx]
        if len(idx) < 2 or max(r) == min(r):
            br["prompts skipped (equal rewards)"] += 1
            continue
        pairs.append((idx[r.index(max(r))], idx[r.index(min(r))]))
    ref = stub.logprobs(stub.ref, stub.world.rows(range(N)), stub.tau).double()
    t = _pairs_textbook(lp_all, pairs, ref, stub.world, m, tb, br)
    return Textbook(t.J, br, t.required | {"failed rewards", "prompts skipped (equal rewards)"})


def build_online_pairs(
    cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int
) -> Built:
    """Online DPO: the method's setup and prepare pair its own scored samples."""
    m, stub = _onpolicy(cls, settings, world)
    _design_margins(world, [(0, 1), (8, 10), (12, 13)], tb, m.settings)  # the pairs REWARDS make
    m.setup(stub)  # type: ignore[arg-type]
    raw = _scored(world, REWARDS, stub)
    batch, _ = m.prepare(raw.clone())
    return Built(m, batch, None if tb is None else (lambda lp: _online_textbook(lp, raw, stub, m, tb)), stub.tau)


def _kto_textbook(lp_all: torch.Tensor, raw: Batch, kl_rows: Batch, stub: StubServices, m: Method) -> Textbook:
    """KTO (Ethayarajh et al. 2024, eq. 8): lambda_y (1 - sigmoid(+-beta (r - z0))), r = sum_t log pi/pi_ref,
    z0 = max(0, mean of r over mismatched prompt/completion rows), held constant."""
    s, mask = m.settings, raw.loss_mask.double()
    kl = (
        (stub.logprobs(stub.policy_model, kl_rows) - stub.logprobs(stub.ref, kl_rows)).double() * kl_rows.loss_mask
    ).sum(-1)
    z0 = float(kl.mean().clamp(min=0.0))  # max(0.0, nan) would be 0.0; clamp keeps a NaN, which then fails by name
    r = ((lp_all[raw.row_id] - stub.logprobs(stub.ref, raw).double()) * mask).sum(-1)  # [B]
    good = raw.desirable
    # [B]: lambda_y (1 - sigmoid(...))
    loss = torch.where(
        good,
        s.desirable_weight * torch.sigmoid(-s.beta * (r - z0)),
        s.undesirable_weight * torch.sigmoid(-s.beta * (z0 - r)),
    )
    br = Counter({"z0 = 0 (mean KL below 0)": int(z0 == 0.0), "z0 > 0": int(z0 > 0.0)})
    for label, sel in (("desirable", good), ("undesirable", ~good)):
        br[f"{label}, r > z0"] += int((sel & (r.detach() > z0)).sum())
        br[f"{label}, r < z0"] += int((sel & (r.detach() < z0)).sum())
    return Textbook(-loss.sum() / len(r), br, set(br))


def build_unpaired(
    cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int
) -> Built:
    """KTO: rows 0..7 labelled alternately, rows 8..15 the mismatched pairs of z0; prepare on the stub trainer."""
    m = make(cls, settings)
    stub = StubServices(m.cfg, world, 1.0)
    m.services, m.ref = stub, stub.reference()  # type: ignore[assignment,attr-defined]
    n = N // 2
    sign = 1.0 if seed % 2 == 0 else -1.0  # the mismatched rows' mean KL: below 0 (z0 clamped) or above
    world.ref_offset[n:] = (0.2 * torch.randn(n, L, generator=gen, dtype=torch.float64) + sign * 0.5) * world.loss_mask[
        n:
    ]
    z0 = float(-(world.ref_offset[n:] * world.loss_mask[n:]).sum(-1).mean().clamp(min=0.0))
    for k in range(n):  # r = z0 +- delta for both labels
        target = z0 + (1 if (k // 2) % 2 == 0 else -1) * (0.5 + 0.25 * k) / m.settings.beta
        world.ref_offset[k, world.positions(k)[0]] -= target + float((world.ref_offset[k] * world.loss_mask[k]).sum())
    raw = world.rows(range(n)).replaced(desirable=torch.tensor([k % 2 == 0 for k in range(n)]))
    kl_rows = world.rows(range(n, N))
    batch, _ = m.prepare(raw.clone().replaced(kl_pairs=kl_rows.copy()))
    return Built(m, batch, None if tb is None else (lambda lp: _kto_textbook(lp, raw, kl_rows, stub, m)))


def build_kept(
    cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int
) -> Built:
    """Rejection sampling: the method's prepare keeps the valid samples whose reward clears the threshold."""
    m, stub = _onpolicy(cls, settings, world)
    m.setup(stub)  # type: ignore[arg-type]
    raw = _scored(world, REWARDS, stub)
    batch, _ = m.prepare(raw.clone())

    textbook = None if tb is None else (lambda lp: _kept_textbook(lp, raw, stub, m))
    return Built(m, batch, textbook, stub.tau)


def build_demonstrations(
    cls: type[Method], settings: dict, world: World, gen: torch.Generator, tb: dict | None, seed: int
) -> Built:
    """SFT: fixed rows of several lengths; J is the log-likelihood under the method's aggregation."""
    m, rows = make(cls, settings), world.rows(range(N // 2))

    def textbook(lp_all: torch.Tensor) -> Textbook:
        every = torch.ones(N // 2, dtype=torch.float64)
        J = _aggregate(lp_all[rows.row_id], rows.loss_mask.double(), every, m.norm, m.cfg.norm_constant)
        return Textbook(J, Counter(), set())

    return Built(m, rows, None if tb is None else textbook)
