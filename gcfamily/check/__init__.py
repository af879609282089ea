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
from typing import Callable

import torch
import torch.nn.functional as F

from gcfamily.core import engine

# the stub world (sizes, rewards, stub trainer and critic), the textbook and the batches live in modules of their own
from gcfamily.check.builders import (
    Built,
    build_demonstrations,
    build_groups,
    build_kept,
    build_online_pairs,
    build_pairs,
    build_ppo,
    build_process,
    build_unpaired,
)
from gcfamily.check.world import (
    CLIP_,
    DPO_,
    GRPO_,
    MICRO,
    PPO_,
    RB_,
    TOL_A,
    TOL_B,
    G,
    M,
    N,
    V,
    World,
    _definer,
    _qual,
    make,
)
from gcfamily.config import FIELDS
from gcfamily.data.batches import select
from gcfamily.errors import GcfError
from gcfamily.methods.base import Batch, Method


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
    return [
        ("defaults", {}),
        ("clip and KL", {"mu": 2, "beta": beta}),
        (
            "minibatches, k1, batch std",
            {
                "num_minibatches": 2,
                "beta": beta,
                "kl_estimator": "k1",
                "scale_rewards": "batch",
                "std_eps": 1e-4,
                "std": "population",
            },
        ),
        (
            "k2 unclamped, no std, sum",
            {
                "mu": 2,
                "beta": beta,
                "kl_estimator": "k2",
                "kl_clamp": None,
                "scale_rewards": "none",
                "loss_norm": "sum",
            },
        ),
        (
            "k3-iw clamp 0.5, zero_std exclude, token",
            {
                "mu": 2,
                "beta": beta,
                "kl_estimator": "k3-importance-weighted",
                "kl_clamp": 0.5,
                "zero_std": "exclude",
                "loss_norm": "token",
            },
        ),
        (
            "KL in the reward, constant",
            {
                "mu": 2,
                "beta": 0.02,
                "kl_placement": "reward",
                "kl_estimator": "k1",
                "loss_norm": "constant",
                "norm_constant": 3.0,
            },
        ),
    ]


def _short(q: str) -> str:
    return q.rsplit(".", 1)[-1]


CLIP_HOOKS = {"clip_range": {CLIP_: ""}, "clipped": {CLIP_: ""}, "kl_in_loss": {CLIP_: ""}, "kl_reward": {CLIP_: ""}}
SURROGATE = (
    "min(r A, clip(r, 1 - eps, 1 + eps_high) A) - beta KL_t (k1, k2, k3, k3-iw by definition, clamped as set), "
    "r per token or sequence"
)
PAIR_LOSSES = {
    ("DPO", "DPO"): "dpo",
    ("DPO", "IPO"): "ipo",
    ("DPO", "ConservativeDPO"): "cdpo",
    ("SimPO", "SimPO"): "simpo",
    ("ORPO", "ORPO"): "orpo",
}
PAIR_HOOKS = {
    "rewards": {DPO_: "", M + "dpo.SimPO": "", M + "orpo.ORPO": ""},
    "pair_loss": {DPO_: "", M + "dpo.IPO": "", M + "dpo.ConservativeDPO": "", M + "dpo.SimPO": "", M + "orpo.ORPO": ""},
}
FAMILIES: dict[str, Family] = {
    M + "kto.KTO": Family(
        "unpaired labels (KTO)",
        build_unpaired,
        lambda c: [
            ("defaults", {}),
            ("weights and beta", {"beta": 0.5, "desirable_weight": 1.33, "undesirable_weight": 0.7}),
        ],
        "lambda_y (1 - sigmoid(+-beta (r - z0))), z0 = max(0, mean KL of mismatched rows), held constant",
        {"prepare": {M + "kto.KTO": ""}},
    ),
    M + "online_dpo.OnlineDPO": Family(
        "online pairs",
        build_online_pairs,
        lambda c: [("defaults", {}), ("beta 0.5", {"beta": 0.5})],
        "the pair loss on each prompt's best and worst valid sample; equal prompts form none",
        {"prepare": {M + "online_dpo.OnlineDPO": ""}, **PAIR_HOOKS},
    ),
    DPO_: Family(
        "preference pairs",
        build_pairs,
        lambda c: [
            ("defaults", {}),
            (
                "other beta and loss settings",
                {"beta": 0.5, "label_smoothing": 0.3, "simpo_gamma": 1.0, "orpo_lambda": 0.5},
            ),
        ],
        "the pair loss (DPO -log sigmoid, cDPO, IPO's square, SimPO's margin, ORPO's odds ratio) averaged over pairs",
        PAIR_HOOKS,
    ),
    PPO_: Family(
        "on-policy samples with a critic (PPO)",
        build_ppo,
        lambda c: [
            ("defaults", {}),
            ("clip and KL", {"mu": 2}),
            ("KL in the reward, GAE 0.9/0.8", {"mu": 2, "kl_placement": "reward", "gamma": 0.9, "lam": 0.8}),
            (
                "minibatches, k2 clamp 0.5, sequence",
                {"num_minibatches": 2, "kl_estimator": "k2", "kl_clamp": 0.5, "loss_norm": "sequence"},
            ),
            ("k3-iw unclamped", {"mu": 2, "kl_estimator": "k3-importance-weighted", "kl_clamp": None}),
        ],
        SURROGATE + "; A = whitened GAE on the critic's values",
        {"prepare": {PPO_: ""}, "token_rewards": {PPO_: ""}, "token_advantages": {PPO_: ""}, **CLIP_HOOKS},
        True,
    ),
    GRPO_: Family(
        "on-policy groups",
        build_groups,
        _group_cases,
        SURROGATE + "; A from the rewards",
        {
            "group_advantages": {
                GRPO_: "group-relative",
                M + "grpo_variants.RLOO": "leave-one-out",
                RB_: "running baseline",
            },
            "equal_reward_groups": {GRPO_: "", RB_: ""},
            "add_advantages": {GRPO_: ""},
            "token_advantages": {GRPO_: ""},
            "prepare": {GRPO_: ""},
            "after_step": {GRPO_: "", RB_: ""},
            **CLIP_HOOKS,
        },
        True,
    ),
    M + "grpo_ps.GRPOProcess": Family(
        "on-policy groups with step rewards (process supervision)",
        build_process,
        lambda c: [
            ("defaults", {}),
            ("clip and KL", {"mu": 2, "beta": 0.04}),
            (
                "population std, std_eps, zero_std exclude, token",
                {"std": "population", "std_eps": 1e-3, "zero_std": "exclude", "loss_norm": "token"},
            ),
            ("minibatches, k1, sum", {"num_minibatches": 2, "beta": 0.04, "kl_estimator": "k1", "loss_norm": "sum"}),
        ],
        SURROGATE + "; A_t = sum of the group-normalised step rewards ending at or after t",
        {
            "add_advantages": {M + "grpo_ps.GRPOProcess": ""},
            "token_advantages": {M + "grpo_ps.GRPOProcess": ""},
            "prepare": {GRPO_: ""},
            "after_step": {GRPO_: ""},
            **CLIP_HOOKS,
        },
        True,
    ),
    M + "rft.RFT": Family(
        "kept samples (rejection sampling)",
        build_kept,
        lambda c: [("defaults", {}), ("threshold 0.2, sequence", {"reward_threshold": 0.2, "loss_norm": "sequence"})],
        "the log-likelihood of the valid samples whose reward clears the threshold",
        {"prepare": {M + "rft.RFT": ""}},
    ),
    M + "sft.SFT": Family(
        "demonstrations",
        build_demonstrations,
        lambda c: [("defaults", {}), ("sequence", {"loss_norm": "sequence"}), ("sum", {"loss_norm": "sum"})],
        "the log-likelihood under the method's aggregation",
    ),
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
            return None, (
                f"{cls.__name__}.{hook} is its own (defined in {where}); the textbook of the {fam.name} family "
                f"restates only {', '.join(_short(k) for k in known)}'s {hook}"
            )
        if known[where]:
            tb["advantage"] = known[where]
    if "pair_loss" in fam.hooks:
        combo = (_short(_definer(cls, "rewards")), _short(_definer(cls, "pair_loss")))
        if combo not in PAIR_LOSSES:
            return (
                None,
                f"{cls.__name__} pairs {combo[0]}'s rewards with {combo[1]}'s pair_loss, a loss the textbook does not state",
            )
        tb["loss"] = PAIR_LOSSES[combo]
    if fam.clipped:
        where = _definer(cls, "importance_ratio")
        if cls.ratio_level == "sequence":  # GSPO's s_i = exp(mean_t log pi/pi_old), whoever writes it
            tb["ratio"] = "sequence"
        elif where == CLIP_:
            tb["ratio"] = "token"
        else:
            return None, (
                f"{cls.__name__}.importance_ratio is its own (defined in {where}) at ratio_level={cls.ratio_level}; "
                "the textbook knows the token ratio pi/pi_old and GSPO's sequence ratio exp(mean_t log pi/pi_old) "
                "(ratio_level=sequence)"
            )
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
    lp, _ = engine._ChunkedTokenLogprob.apply(
        h, torch.eye(V, dtype=X.dtype), None, mb["input_ids"][mask], float(tau), 5, False, None, None
    )
    return torch.zeros(mask.shape, dtype=lp.dtype).masked_scatter(mask, lp)  # [b, L]


def _worse(a: float, b: float) -> float:
    """The larger of two differences, NaN when either is: a running max(0.0, nan) keeps 0.0 and hides the NaN."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _nonfinite(what: str, x: torch.Tensor | float, out: Outcome, seed: int) -> bool:
    """Whether x holds a NaN or an inf; if so a failure naming `what` and how many entries (once per quantity)."""
    x = torch.as_tensor(x).detach()
    if bool(torch.isfinite(x).all()):
        return False
    if x.numel() == 1:
        v = float(x)
        msg = f"{what} is {'NaN' if math.isnan(v) else ('+inf' if v > 0 else '-inf')} (seed {seed})"
    else:
        counts = [
            (int(torch.isnan(x).sum()), "NaN"),
            (int((x == math.inf).sum()), "+inf"),
            (int((x == -math.inf).sum()), "-inf"),
        ]
        msg = f"{what} has {' and '.join(f'{kind} in {n}' for n, kind in counts if n)} of {x.numel()} entries (seed {seed})"
    out.failed.setdefault(what, (math.inf, msg))
    return True


def _diff(name: str, got: torch.Tensor, want: torch.Tensor, tol: float, out: Outcome, seed: int) -> None:
    """Record a check's largest difference; a failure once per check (its worst seed). A NaN or inf difference
    fails: `d <= tol` is False for NaN, and its relative size counts as inf."""
    d, scale = float((got - want).abs().max()), float(want.abs().max())
    old = out.diffs.get(name, (0.0, 0.0))
    out.diffs[name] = (_worse(old[0], d), _worse(old[1], scale))
    if d <= tol * scale + 1e-12:
        return
    if not math.isfinite(d):  # a NaN or an inf on either side (a non-finite scale makes d non-finite too)
        out.failed.setdefault(
            name, (math.inf, f"{name}: max |diff| is {d:.3g}, which no tolerance passes (seed {seed})")
        )
    elif d / max(scale, 1e-300) > out.failed.get(name, (0.0, ""))[0]:
        out.failed[name] = (
            d / max(scale, 1e-300),
            f"{name}: max |diff| {d:.3g} against a largest entry of {scale:.3g} (seed {seed})",
        )


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
    # every quantity below is first tested for NaN and inf: a tolerance test is False for NaN, and one NaN
    # coefficient poisons the whole loss even on padding (NaN * 0 is NaN), so a non-finite value fails by name
    _nonfinite("the engine's normaliser Z", Z, out, seed)

    lp = base.clone().requires_grad_(True)  # (a) the engine, micro-batch by micro-batch
    coefs = []
    for mb in mbs:
        coefs.append(m.coefficient(mb, lp[mb["row_id"]].detach()))
        engine.weighted_loss(coefs[-1], lp[mb["row_id"]], mb, m.norm, Z).backward()
    _nonfinite("the method's coefficient", torch.cat([c.detach().flatten() for c in coefs]), out, seed)
    got = lp.grad if lp.grad is not None else torch.zeros_like(base)
    _nonfinite("the engine's gradient", got, out, seed)
    lp = base.clone().requires_grad_(True)
    try:
        J = m.objective(batch, lp[ids], Z)
    except NotImplementedError:
        out.errors.append(
            f"{cls.__name__} has no objective: write {cls.__name__}.objective(batch, logps, Z), J to maximise"
        )
        return
    _nonfinite("the method's objective", J, out, seed)
    own = torch.autograd.grad(-J, lp, allow_unused=True)[0]
    own = torch.zeros_like(base) if own is None else own
    _nonfinite("the gradient of the method's own objective", own, out, seed)
    _diff("(a) engine vs own objective", got, own, TOL_A, out, seed)
    want = own
    if built.textbook is not None:
        lp = base.clone().requires_grad_(True)
        t = built.textbook(lp)
        _nonfinite("the textbook's objective", t.J, out, seed)
        want = torch.autograd.grad(-t.J, lp, allow_unused=True)[0]
        want = torch.zeros_like(base) if want is None else want
        _nonfinite("the textbook's gradient", want, out, seed)
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
    _nonfinite(
        "the method's coefficient", torch.cat([c.detach().flatten() for c in coefs]), out, seed
    )  # on float32 log-probs
    _nonfinite("the engine's gradient d loss/d logits", X.grad, out, seed)
    w = engine.token_weights(batch, m.norm)  # [B, L]
    dJ = -want[ids]  # [B, L] the textbook's dJ/dlogp
    on = w > 0
    gc = torch.zeros_like(dJ)
    gc[on] = dJ[on] * Z / w[on]  # GC = (dJ/dlogp) / (w / Z)
    stray = float(dJ[~on].abs().max()) if (~on).any() else 0.0
    if math.isfinite(stray) and stray > 1e-12:  # a NaN or inf there is named above, with the gradient it is in
        out.errors.append(
            f"(b) the textbook's gradient is {stray:.3g} on a token the engine weighs 0 (a masked row or padding)"
        )
    onehot = F.one_hot(batch["input_ids"], V).double()
    soft = torch.softmax(world.logits[ids] / tau, -1)
    closed = torch.zeros_like(world.logits).index_add_(0, ids, -(gc * w / Z)[..., None] * (onehot - soft) / tau)
    source = "textbook" if built.textbook is not None else "own objective"
    _diff(f"(b) d loss/d logits vs {source} GC * w/Z * (onehot - softmax)", X.grad.double(), closed, TOL_B, out, seed)
    coef = torch.cat([c.double() * mb["loss_mask"] for c, mb in zip(coefs, mbs)])
    scale = float(gc[on].abs().max()) if on.any() else 0.0
    d = float((coef - gc)[on].abs().max()) if on.any() else 0.0
    name = f"    GC: the method's vs the {source}'s (float32 log-probs)"
    old = out.diffs.get(name, (0.0, 0.0))
    out.diffs[name] = (_worse(old[0], d), _worse(old[1], scale))  # shown only: float32 log-probs; a NaN failed above


def check_no_policy(cls: type[Method], out: Outcome) -> None:
    """A method that trains only a model of its own: GC = 0 and an objective constant in the policy."""
    m, world = make(cls, {}), World(N, torch.Generator().manual_seed(0))
    batch = world.rows(range(N))
    lp = world.logps().requires_grad_(True)
    coef = m.coefficient(batch, lp.detach())
    J = m.objective(batch, lp, 1.0)
    g = torch.autograd.grad(J, lp, allow_unused=True)[0]
    out.diffs["GC (trains no policy)"] = (float(coef.abs().max()), 0.0)
    out.diffs["d objective / d logp (trains no policy)"] = (0.0 if g is None else float(g.abs().max()), 0.0)
    bad = [
        _nonfinite("the method's coefficient", coef, out, 0),
        _nonfinite("the method's objective", J, out, 0),
        g is not None and _nonfinite("the gradient of the method's own objective", g, out, 0),
    ]
    if not any(bad) and ((coef != 0).any() or (g is not None and (g != 0).any())):
        out.errors.append(
            f"{cls.__name__} trains no policy but gives it a coefficient or an objective that depends on it"
        )


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
    return (
        f"{cls.__name__} belongs to no data family the check can build a batch for (it subclasses none of {roots}); "
        "subclass the method whose data it uses, or check it with a test of your own."
    )


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
        lines.append(
            f"textbook: none: {why}; checked against its own objective only"
            if why
            else f"textbook: {fam.textbook}" + (f" [{', '.join(f'{k}: {v}' for k, v in tb.items())}]" if tb else "")
        )
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
        k.startswith("(a) engine vs own") for o in outcomes for k in o.failed
    ):
        lines.append(
            "hint: the engine agrees with the class's own objective but not with the textbook: both share a mistake, "
            "or the rule changes the objective itself, which the textbook of its family does not state"
        )
    lines.append(
        ("passed" if ok else "failed")
        + f": {sum(o.ok for o in outcomes)} of {len(outcomes)} cases"
        + (" (against the method's own objective only)" if why else "")
    )
    return "\n".join(lines), ok
