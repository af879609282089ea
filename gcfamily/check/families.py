"""The data families of gcf check (gcfamily/check/), the settings cases each is checked at, and what a class is held to.

A class is held to its family's TEXTBOOK (gcfamily/check/textbook.py) when its rule is the library's: its `coefficient`
and `objective` are those of a gcfamily method, and every hook a variant changes is one the textbook restates. Otherwise
it is checked against what it states itself:

- `coefficient` and `objective` both its own (defined outside gcfamily): a rule of its own, checked against autograd of
  its own objective, and (b) with that objective's GC; the parent's textbook is not its textbook;
- only one of them its own (and no hook of its family): it fails, with a sentence saying the other must change too;
  a coefficient is the gradient of an objective, and the engine trains with the coefficient;
- a hook of its own the textbook does not know (its own `group_advantages`, ...): named, and checked against its own
  objective only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

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
from gcfamily.check.cases import EPISODES, RANKS, TAU, TIS, accepts, group_cases
from gcfamily.check.world import CLIP_, DPO_, GRPO_, PPO_, RB_, M, _definer, _qual
from gcfamily.config import FIELDS
from gcfamily.errors import GcfError
from gcfamily.methods.base import Method

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

    def all_hooks(self) -> list[str]:
        """The functions besides coefficient and objective through which a variant changes the family's rule."""
        return list(self.hooks) + (["importance_ratio"] if self.clipped else [])


def _short(q: str) -> str:
    return q.rsplit(".", 1)[-1]


SURROGATES = {M + "cispo.CISPO": "cispo", M + "gpg.GPG": "gpg", M + "gmpo.GMPO": "gmpo", M + "sapo.SAPO": "sapo"}
SURROGATES[M + "vespo.VESPO"] = "vespo"
"""Rules whose own importance_ratio and clipped state a surrogate other than PPO's that the textbook restates."""
CLIP_HOOKS = {
    "clip_range": {CLIP_: ""},
    "clipped": {CLIP_: "", **dict.fromkeys(SURROGATES, "")},
    "kl_in_loss": {CLIP_: ""},
    "kl_reward": {CLIP_: ""},
}
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
PL_ = M + "pair_losses."
MARGIN_LOSSES = {"Hinge": "hinge", "RobustDPO": "robust-dpo", "EXOPair": "exo-pair", "DiscoPOP": "discopop"}
REWARD_LOSSES = {"NCAPair": "nca-pair", "BCOPair": "bco-pair", "SPPOHard": "sppo-hard", "APOZero": "apo-zero"}
REWARD_LOSSES["APODown"] = "apo-down"
PAIR_LOSSES.update({("DPO", c): n for c, n in {**MARGIN_LOSSES, **REWARD_LOSSES}.items()})
PAIR_LOSSES.update({("SigmoidNorm", "DPO"): "sigmoid-norm", ("SigmoidNorm", "IPO"): "ipo-norm"})
PAIR_HOOKS = {
    "rewards": {DPO_: "", M + "dpo.SimPO": "", M + "orpo.ORPO": "", PL_ + "SigmoidNorm": ""},
    "pair_loss": {
        **{d: "" for d in (DPO_, M + "dpo.IPO", M + "dpo.ConservativeDPO", M + "dpo.SimPO", M + "orpo.ORPO")},
        **{PL_ + c: "" for c in MARGIN_LOSSES},
    },
    "pair_terms": {DPO_: "", **{PL_ + c: "" for c in REWARD_LOSSES}},
}
"""A loss of h_w and h_l each (pair_terms) is named by its pair_terms, a loss of the margin by its pair_loss."""
SHAPING = [
    ("forward KL, LD 0.5", {"f_divergence": "forward_kl", "ld_alpha": 0.5}),
    ("Jensen-Shannon", {"f_divergence": "js_divergence"}),
    ("alpha divergence 0.3, LD 0", {"f_divergence": "alpha_divergence", "f_alpha": 0.3, "ld_alpha": 0.0}),
]
SHAPING += [("LD 0.5", {"ld_alpha": 0.5})]
"""DPO's reward shaped by f-DPO's score and LD-DPO's weights, where the method takes them (methods/pair_shaping.py)."""
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
        lambda c: [("defaults", {}), ("beta 0.5", {"beta": 0.5}), ("multi-turn episodes", {EPISODES: True})],
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
                {"beta": 0.5, "label_smoothing": 0.3, "simpo_gamma": 1.0, "orpo_lambda": 0.5, "discopop_tau": 0.5},
            ),
            *[(label, st) for label, st in SHAPING if accepts(c, st)],
        ],
        "the pair loss (DPO -log sigmoid, cDPO, IPO's square, SimPO's margin, ORPO's odds ratio, TRL's other loss types in check/pair_textbook.py) averaged over pairs",
        PAIR_HOOKS,
    ),
    PPO_: Family(
        "on-policy samples with a critic (PPO)",
        build_ppo,
        lambda c: [
            ("defaults", {}),
            ("clip and KL", {"mu": 2}),
            (f"temperature {TAU}, clip and KL", {"temperature": TAU, "mu": 2}),
            ("KL in the reward, GAE 0.9/0.8", {"mu": 2, "kl_placement": "reward", "gamma": 0.9, "lam": 0.8}),
            (
                "minibatches, k2 clamp 0.5, sequence",
                {"num_minibatches": 2, "kl_estimator": "k2", "kl_clamp": 0.5, "loss_norm": "sequence"},
            ),
            ("k3-iw unclamped", {"mu": 2, "kl_estimator": "k3-importance-weighted", "kl_clamp": None}),
            ("two simulated ranks (whitening over both)", {RANKS: 2}),
            ("GAE unwhitened", {"whiten": False, "mu": 2}),
            ("sampler correction token_mask, clip and KL", {**TIS["token_mask"], "mu": 2}),
            ("sampler correction sequence_truncate", TIS["sequence_truncate"]),
            ("dual-clip 3, clip and KL", {"mu": 2, "dual_clip": 3.0}),
            ("off-policy mask 0, clip and KL", {"mu": 2, "off_policy_mask": 0.0}),
            ("multi-turn episodes, GAE over the policy's tokens", {EPISODES: True, "mu": 2, "gamma": 0.9, "lam": 0.8}),
        ],
        SURROGATE + "; A = GAE on the critic's values, whitened unless whiten=false",
        {"prepare": {PPO_: ""}, "token_rewards": {PPO_: ""}, "token_advantages": {PPO_: ""}, **CLIP_HOOKS},
        True,
    ),
    GRPO_: Family(
        "on-policy groups",
        build_groups,
        group_cases,
        SURROGATE + "; A from the rewards",
        {
            "group_advantages": {
                GRPO_: "group-relative",
                M + "grpo_variants.RLOO": "leave-one-out",
                M + "gpg.GPG": "gpg",
                RB_: "running baseline",
                M + "group_estimators.GRPOPassK": "pass@k",
                M + "group_estimators.OPO": "opo",
                M + "group_estimators.ReinforcePP": "rf++",
                M + "group_estimators.ReinforcePPBaseline": "rf++ baseline",
            },
            "equal_reward_groups": {GRPO_: "", RB_: "", M + "group_estimators.ReinforcePP": ""},
            # OPO's and REINFORCE++'s read the completions' lengths first
            "add_advantages": {GRPO_: "", M + "group_estimators.OPO": "", M + "group_estimators.ReinforcePP": ""},
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
            (f"temperature {TAU}, clip and KL", {"temperature": TAU, "mu": 2, "beta": 0.04}),
            (
                "population std, std_eps, zero_std exclude, token",
                {"std": "population", "std_eps": 1e-3, "zero_std": "exclude", "loss_norm": "token"},
            ),
            ("minibatches, k1, sum", {"num_minibatches": 2, "beta": 0.04, "kl_estimator": "k1", "loss_norm": "sum"}),
            ("truncated samples masked, clip and KL", {"mask_truncated": True, "mu": 2, "beta": 0.04}),
            ("off-policy mask 0, clip and KL", {"off_policy_mask": 0.0, "mu": 2, "beta": 0.04}),
            ("sampler correction token_mask, clip", {**TIS["token_mask"], "mu": 2}),
            ("multi-turn episodes, clip and KL", {EPISODES: True, "mu": 2, "beta": 0.04}),
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
        lambda c: [
            ("defaults", {}),
            ("threshold 0.2, sequence", {"reward_threshold": 0.2, "loss_norm": "sequence"}),
            ("multi-turn episodes, token", {EPISODES: True, "loss_norm": "token"}),
            *[(f"sampler correction {m}", TIS[m]) for m in ("token_truncate", "sequence_mask") if accepts(c, TIS[m])],
        ],
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


def _library(qual: str) -> bool:
    return qual.startswith("gcfamily.")


def _parent(cls: type[Method]) -> str:
    """The nearest gcfamily method cls extends (cls itself for a built-in)."""
    return next((c.__name__ for c in cls.__mro__ if _library(_qual(c))), "Method")


def own_rule(cls: type[Method]) -> tuple[str, str]:
    """Which of coefficient and objective are cls's own, defined outside gcfamily, and the sentence that says so:
    ("both", why the textbook does not apply), ("coefficient" or "objective", why the check fails), or ("", "")."""
    fam = family_of(cls)
    assert fam is not None
    if cls.objective is Method.objective:  # no objective at all: the check names that itself
        return "", ""
    own = [f for f in ("coefficient", "objective") if not _library(_definer(cls, f))]
    name = cls.__name__
    if len(own) == 2:
        where = " and ".join(sorted({_short(_definer(cls, f)) for f in own}))
        return "both", (
            f"{name}.coefficient and {name}.objective are its own (defined in {where}), a rule of its own that the "
            f"textbook of the {fam.name} family does not state"
        )
    if not own or any(not _library(_definer(cls, h) or "gcfamily.") for h in fam.all_hooks()):
        return "", ""  # a hook of its own changes what the inherited function computes: the textbook decides
    parent = _parent(cls)
    if own == ["coefficient"]:
        return "coefficient", (
            f"{name}.coefficient is its own but {name}.objective is {parent}'s: a coefficient is the gradient of an "
            f"objective, so the objective must change too; write {name}.objective(batch, logps, Z), J to maximise, "
            "for the rule the coefficient follows"
        )
    return "objective", (
        f"{name}.objective is its own but {name}.coefficient is {parent}'s: the engine trains with the coefficient, so "
        f"it would train {parent}'s rule, not this objective; the coefficient must change too: write "
        f"{name}.coefficient(batch, logps), dJ/dlogp_t divided by the token's weight w_t"
    )


def textbook_for(cls: type[Method]) -> tuple[dict | None, str]:
    """(the textbook's choices, '') or (None, one sentence: a rule of the class's own, or a hook it does not know)."""
    fam = family_of(cls)
    assert fam is not None
    kind, why = own_rule(cls)
    return (None, why) if kind == "both" else textbook_choices(cls)


def textbook_choices(cls: type[Method]) -> tuple[dict | None, str]:
    """What the textbook states for cls's hooks (its advantage, pair loss, ratio), whoever writes coefficient and
    objective; or (None, one sentence naming a hook it does not know)."""
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
        loss_hook = "pair_terms" if _definer(cls, "pair_terms") != DPO_ else "pair_loss"
        combo = (_short(_definer(cls, "rewards")), _short(_definer(cls, loss_hook)))
        if combo not in PAIR_LOSSES:
            return (
                None,
                f"{cls.__name__} pairs {combo[0]}'s rewards with {combo[1]}'s {loss_hook}, a loss the textbook does not state",
            )
        tb["loss"] = PAIR_LOSSES[combo]
    if fam.clipped:
        where = _definer(cls, "importance_ratio")
        if where in SURROGATES:  # a surrogate of its own, placed and counted per token
            tb["ratio"], tb["surrogate"] = "token", SURROGATES[where]
        elif cls.ratio_level == "sequence":  # GSPO's s_i = exp(mean_t log pi/pi_old), whoever writes it
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


def cases(cls: type[Method]) -> list[tuple[str, dict]]:
    """The cases a method is checked at: its defaults, then settings that reach every branch (only the keys it has)."""
    fam = family_of(cls)
    if not cls.trains_policy:
        return [("defaults", {})]
    if fam is None:
        raise GcfError(unsupported(cls))
    own = {f.name for f in fields(cls.Settings)}
    return [
        (label, {k: v for k, v in s.items() if k in own or k in FIELDS or k in (RANKS, EPISODES)})
        for label, s in fam.cases(cls)
    ]


def unsupported(cls: type[Method]) -> str:
    roots = ", ".join(c.rsplit(".", 1)[-1] for c in FAMILIES)
    return (
        f"{cls.__name__} belongs to no data family the check can build a batch for (it subclasses none of {roots}); "
        "subclass the method whose data it uses, or check it with a test of your own."
    )
