"""The settings cases of gcf check (gcfamily/check/) that reach every branch of a rule: the sampler correction's, the
temperature, simulated ranks, and those of on-policy groups (GRPO and the rules that share its batch)."""

from __future__ import annotations

from gcfamily.check.world import G, make
from gcfamily.errors import GcfError
from gcfamily.methods.base import Method


def accepts(cls: type[Method], settings: dict) -> bool:
    """Whether the method's validation takes these settings (a method may refuse one, in one sentence)."""
    try:
        make(cls, {"group_size": G, **settings})
    except GcfError:
        return False
    return True


TIS = {
    mode: {"tis": mode, "tis_min": 0.5, "tis_max": 2.0}
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
}
"""The sampler correction's cases (setting tis): each mode with both bounds, so that ratios fall past each."""


TAU = 0.7
"""A sampling temperature other than 1: the policy is pi at tau, log softmax(logits / tau), in the engine's chunked
log-probs (whose backward carries the 1/tau), in pi_old and pi_ref, and in the textbook."""


RANKS = "simulated_ranks"
"""A case's key (not a setting; run_case takes it out): the step's rows split over this many simulated ranks, each a
method of its own whose Services.all_sum sums over them (world.Collective); the gradient is one rank's."""


EPISODES = "multi_turn_episodes"
"""A case's key (not a setting; run_case takes it out): the step's rows are multi-turn episodes, an environment's
answer of one or two tokens inside the completion of two rows in three (attended, off the loss mask: context, not
actions). The textbook sums and counts the policy's tokens only, so the check holds that the environment's tokens
carry exactly zero gradient and stay out of every normaliser (tokens and lengths count the policy's tokens only)."""


def group_cases(cls: type[Method]) -> list[tuple[str, dict]]:
    beta = cls.Settings().beta or 0.1  # type: ignore[attr-defined]  # a method without the KL term by default gets one
    # k3-importance-weighted where the method takes it (gspo refuses it: its ratio is per sequence), else plain k3
    iw = accepts(cls, {"beta": beta, "kl_estimator": "k3-importance-weighted"})
    excl = accepts(cls, {"zero_std": "exclude"})  # gpg refuses it: its alpha corrects for those groups already
    batch = {"scale_rewards": "batch", "std": "sample"}  # the step's std is a sum over the ranks
    dual = {"mu": 2, "beta": beta, "dual_clip": 3.0}  # where the method takes it (cispo has no bound to add)
    both = {"mu": 2, "beta": beta, "epsilon": 0.2, "epsilon_high": 0.2}  # a weight clipped below too (cispo, as verl)
    return [case for case in _group_cases(cls, beta, iw, excl, batch, dual, both) if _takes(cls, case[1])]


def _takes(cls: type[Method], settings: dict) -> bool:
    """Whether the method takes a case's settings (opo refuses a std scale, for one): a case it refuses is not its."""
    return accepts(cls, {k: v for k, v in settings.items() if k not in (RANKS, EPISODES)})


def _group_cases(
    cls: type[Method], beta: float, iw: bool, excl: bool, batch: dict, dual: dict, both: dict
) -> list[tuple[str, dict]]:
    return [
        ("defaults", {}),
        ("clip and KL", {"mu": 2, "beta": beta}),
        ("truncated samples masked, clip and KL", {"mask_truncated": True, "mu": 2, "beta": beta}),
        ("truncated samples masked, token", {"mask_truncated": True, "loss_norm": "token"}),
        ("off-policy mask 0, clip and KL", {"off_policy_mask": 0.0, "mu": 2, "beta": beta}),
        ("population std (OpenRLHF's whitening), clip", {"std": "population", "mu": 2}),
        (
            "two rewards standardised apart, then summed",
            {
                "reward_aggregation": "normalize_then_sum",
                "scale_rewards": "batch",
                "std_eps": 1e-4,
                "reward": ["numeric", "numeric"],
                "reward_weights": [1.0, 0.5],
                "mu": 2,
            },
        ),
        ("centred only (whiten false), clip", {"whiten": False, "mu": 2}),
        (f"temperature {TAU}, clip and KL", {"temperature": TAU, "mu": 2, "beta": beta}),
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
        ("batch sample std", {"scale_rewards": "batch", "std": "sample"}),
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
            f"{'k3-iw' if iw else 'k3'} clamp 0.5,{' zero_std exclude,' if excl else ''} token",
            {
                "mu": 2,
                "beta": beta,
                "kl_estimator": "k3-importance-weighted" if iw else "k3",
                "kl_clamp": 0.5,
                **({"zero_std": "exclude"} if excl else {}),
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
        ("two simulated ranks, batch std", {RANKS: 2, **(batch if accepts(cls, batch) else {})}),
        ("multi-turn episodes, clip and KL, token", {EPISODES: True, "mu": 2, "beta": beta, "loss_norm": "token"}),
        *[  # where the rule takes the sampler correction (vespo folds it into its weight in TRL, and refuses it)
            c
            for c in (
                ("sampler correction token_truncate, clip and KL", {**TIS["token_truncate"], "mu": 2, "beta": beta}),
                # per row: its three branches need three rows with an advantage; grpo-passk gives two a gradient
                *(
                    []
                    if getattr(cls, "one_row_per_group", False)
                    else [("sampler correction sequence_mask", TIS["sequence_mask"])]
                ),
            )
            if accepts(cls, TIS["sequence_mask"])
        ],
        *([("dual-clip 3, clip and KL", dual)] if accepts(cls, dual) else []),
        *([("clip both sides (eps 0.2, verl's), KL", both)] if not getattr(cls, "epsilon_below_one", True) else []),
    ]
