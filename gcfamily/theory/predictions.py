"""Exact predictions of Vojnovic & Yun (2025), "What is the Alignment Objective of GRPO?",
for a finite-output ("bandit") policy: one prompt, K whole outputs, pi and pi_ref over them.

Rewards are per output: deterministic values r(o), or (bernoulli=True) success
probabilities q(o) of a 0/1 reward. Everything is float64 numpy and exact: group
expectations are sums over multisets (deterministic) or binomial counts (Bernoulli),
never Monte Carlo. Symbols follow the paper: G group size, beta KL weight, P_G(o | pi)
the reward preference, p_ref = pi_ref(a) and gamma the margin of a binary question.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

from gcfamily.errors import GcfError

Array = np.ndarray
STDS = ("population", "sample", "none")  # "none" = shift-only advantages A_i = r_i - mean(r)
# variant -> (std override, KL form). "k3": DeepSeekMath's k3 at ratio 1, per-sample
# coefficient beta (pi_ref/pi - 1); "direct": importance-weighted k3 = KL(pi || pi_ref),
# coefficient -beta log(pi/pi_ref). RLHF with KL is "shift_only_direct_kl" with G=None.
VARIANTS: dict[str, tuple[str | None, str]] = {
    "grpo": (None, "k3"),
    "direct_kl": (None, "direct"),
    "shift_only": ("none", "k3"),
    "shift_only_direct_kl": ("none", "direct"),
}


def _check(G: int | float | None, std: str) -> int | None:
    if std not in STDS:
        raise GcfError(f"std={std!r} is unknown; use one of {STDS}.")
    if G is None or G == math.inf:
        return None
    if int(G) != G or G < 2:
        raise GcfError(f"group size G={G} must be an integer >= 2, or None for G -> infinity.")
    return int(G)


def _advantage(dev: Array, var: Array, tie: Array, std: str, G: int | None) -> Array:
    """A_1 from o's deviation from its group mean and the group's population variance."""
    if std == "none":
        return dev  # equal rewards give dev = 0 on their own: no special case
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(tie, 0.0, dev / np.sqrt(np.where(tie, 1.0, var)))
    if std == "sample" and G is not None:
        a = a * math.sqrt((G - 1) / G)  # torch.std's 1/(G-1) shrinks every advantage alike
    return a


@lru_cache(maxsize=None)
def _multisets(K: int, n: int) -> tuple[Array, Array]:
    """Count vectors of all multisets of n outputs out of K, and their multinomial coefficients."""
    # [M, K]
    counts = np.array(
        [np.bincount(c, minlength=K) for c in itertools.combinations_with_replacement(range(K), n)], dtype=float
    )
    log_fact = np.array([math.lgamma(c + 1) for c in range(n + 1)])  # log c!
    log_coef = log_fact[n] - log_fact[counts.astype(int)].sum(axis=1)
    return counts, np.exp(log_coef)  # [M, K], [M]


def _binomial_pmf(n: int, p: float) -> Array:
    m = np.arange(n + 1)
    log_coef = math.lgamma(n + 1) - np.array([math.lgamma(k + 1) + math.lgamma(n - k + 1) for k in m])
    with np.errstate(divide="ignore"):  # 0 * log 0 = 0: p in {0, 1} gives a point mass
        log_p = np.where(m > 0, m * np.log(p), 0.0) + np.where(m < n, (n - m) * np.log1p(-p), 0.0)
    return np.exp(log_coef + log_p)  # [n + 1]


def _preference_fn(rewards: Array, G: int | None, std: str, bernoulli: bool) -> Callable[[Array], Array]:
    """pi -> P_G(. | pi). The tables of advantages depend only on rewards and G, so are built once."""
    r = np.asarray(rewards, dtype=float)
    if bernoulli and not np.all((r >= 0) & (r <= 1)):
        raise GcfError("with bernoulli=True, rewards are success probabilities and must lie in [0, 1].")
    if G is None:  # G -> infinity: the group mean and std become E_pi r and sigma(pi)

        def p_inf(pi: Array) -> Array:
            mean = pi @ r
            var = mean * (1 - mean) if bernoulli else pi @ (r - mean) ** 2  # Bernoulli noise counts
            if std == "none" or var > 0:
                return (r - mean) / (1.0 if std == "none" else math.sqrt(var))
            # sigma = 0 (pi on equal rewards): an outsider's advantage grows like sqrt(G-1)
            return np.where(r == mean, 0.0, np.where(r > mean, np.inf, -np.inf))

        return p_inf
    if bernoulli:  # only the number k of 1s in the group matters; the others' k ~ Bin(G-1, E_pi q)
        tables = []
        for r1 in (0.0, 1.0):
            k = np.arange(G) + r1  # [G] ones in the group, over m = 0..G-1 ones among the others
            var = k / G * (1 - k / G)
            tables.append(_advantage(r1 - k / G, var, var == 0, std, G))
        a0, a1 = tables

        def p_bern(pi: Array) -> Array:
            pmf = _binomial_pmf(G - 1, float(np.clip(pi @ r, 0.0, 1.0)))
            return r * (a1 @ pmf) + (1 - r) * (a0 @ pmf)

        return p_bern
    counts, coef = _multisets(len(r), G - 1)  # the other G-1 outputs, as a multiset
    mean = (r[:, None] + counts @ r) / G  # [K, M]: o's group mean for each multiset
    dev_others = (r[None, None, :] - mean[:, :, None]) ** 2  # [K, M, K]
    sq = (r[:, None] - mean) ** 2 + np.einsum("mk,omk->om", counts, dev_others)  # [K, M] group sum of squares
    tie = ~np.any((counts[None] > 0) & (r[None, None, :] != r[:, None, None]), axis=2)  # [K, M]
    adv = _advantage(r[:, None] - mean, sq / G, tie, std, G)  # [K, M]

    def p_det(pi: Array) -> Array:
        return adv @ (coef * np.prod(pi[None, :] ** counts, axis=1))

    return p_det


def reward_preference(
    pi: Array, rewards: Array, G: int | None, std: str = "population", bernoulli: bool = False
) -> Array:
    """P_G(o | pi) = E[A_1 | o_1 = o, o_2..o_G iid ~ pi] for every o, exactly; shape [K].

    std: "population" (the paper), "sample" (torch default, A scaled by sqrt((G-1)/G)) or
    "none" (shift-only A_i = r_i - mean). A_i = 0 when all rewards in the group are equal.
    G=None is the limit (r(o) - E_pi r) / sigma(pi), sigma including Bernoulli noise.
    """
    G = _check(G, std)
    return _preference_fn(rewards, G, std, bernoulli)(np.asarray(pi, dtype=float))


def _coefficient_fn(
    pi_ref: Array, rewards: Array, G: int | None, beta: float, std: str, bernoulli: bool, variant: str
) -> Callable[[Array], Array]:
    """log pi -> c(o) = E[GC_1 | o_1 = o], the expected per-sample gradient coefficient of o.

    The expected gradient on logits is then pi (c - E_pi c). Working with c rather than the
    gradient keeps the solver well scaled where some pi(o) is tiny (direct KL, small beta).
    """
    if variant not in VARIANTS:
        raise GcfError(f"variant={variant!r} is unknown; use one of {tuple(VARIANTS)}.")
    if not beta > 0:
        raise GcfError(f"beta={beta} must be > 0.")
    std_override, kl = VARIANTS[variant]
    std = std_override or std
    pref = _preference_fn(rewards, _check(G, std), std, bernoulli)
    with np.errstate(divide="ignore"):
        log_ref = np.log(np.asarray(pi_ref, dtype=float))

    def coefficient(log_pi: Array) -> Array:
        live = log_pi > -np.inf  # outputs pi never samples carry no coefficient
        with np.errstate(invalid="ignore", over="ignore"):
            kl_c = np.exp(log_ref - log_pi) - 1 if kl == "k3" else -(log_pi - log_ref)
        return np.where(live, pref(np.exp(log_pi)) + beta * np.where(live, kl_c, 0.0), 0.0)

    return coefficient


def _log_softmax(logits: Array) -> Array:
    z = logits - np.max(logits)
    return z - np.log(np.sum(np.exp(z)))


def _softmax(logits: Array) -> Array:
    return np.exp(_log_softmax(logits))


def expected_gradient(
    logits: Array,
    pi_ref: Array,
    rewards: Array,
    G: int | None,
    beta: float,
    std: str = "population",
    bernoulli: bool = False,
    variant: str = "grpo",
) -> Array:
    """Exact expected on-policy gradient on softmax logits (ascent direction; a loss has minus it).

    It is d/d logits, at pi = pi_old = softmax(logits), of the DeepSeekMath GRPO objective with
    one token per output:  J = E_{o_1..o_G iid ~ pi_old} (1/G) sum_i [ pi(o_i)/pi_old(o_i) A_i
    - beta D_i ],  A_i the group-normalised advantage held constant (std as given; shift-only
    variants use A_i = r_i - mean), D_i = pi_ref/pi - log(pi_ref/pi) - 1 (k3) for "grpo" and
    "shift_only", or the importance-weighted pi(o_i)/pi_old(o_i) * D_i for the direct-KL
    variants; the group expectation is exact. Per sample GC_i = A_i + beta (pi_ref/pi - 1)
    (k3) or A_i - beta log(pi/pi_ref) (direct), so the result is pi (c - E_pi c), c(o) =
    E[GC_1 | o_1 = o]: "grpo" gives pi P_G - beta (pi - pi_ref). Logits may be -inf only
    where pi_ref = 0. With G=None and a shift-only variant this is the exact RLHF gradient.
    """
    log_pi = _log_softmax(np.asarray(logits, dtype=float))
    pi = np.exp(log_pi)
    c = _coefficient_fn(pi_ref, rewards, G, beta, std, bernoulli, variant)(log_pi)
    return pi * (c - pi @ c)


@dataclass(frozen=True)
class StationaryPoint:
    """A stationary policy and how well it solves the fixed point."""

    pi: Array  # [K], exactly 0 where pi_ref = 0
    residual: float  # max_o |expected gradient| / beta = max_o |(1 - P_G/beta) pi - pi_ref| for grpo
    steps: int  # pseudo-transient continuation steps taken


def grpo_stationary(
    pi_ref: Array,
    rewards: Array,
    G: int | None,
    beta: float,
    std: str = "population",
    bernoulli: bool = False,
    variant: str = "grpo",
    tol: float = 1e-12,
    max_steps: int = 500,
) -> StationaryPoint:
    """The stationary policy reached from pi = pi_ref: a zero of expected_gradient.

    For "grpo" it solves (1 - P_G(o | pi)/beta) pi(o) = pi_ref(o). Solved on the logits of the
    support of pi_ref by pseudo-transient continuation on c - E_pi c (backward-Euler steps of
    a flow with a growing step, which become Newton steps). Where a variant has several
    stationary points (direct KL) it returns the one that flow from pi_ref goes to. Raises
    RuntimeError if the residual is not below tol within max_steps.
    """
    pi_ref = np.asarray(pi_ref, dtype=float)
    coefficient = _coefficient_fn(pi_ref, rewards, G, beta, std, bernoulli, variant)
    S = pi_ref > 0  # outputs outside the support keep logit -inf, so pi stays 0 there

    def H(theta: Array) -> tuple[Array, float]:
        log_pi = np.full(pi_ref.shape, -np.inf)
        log_pi[S] = _log_softmax(theta)
        pi = np.exp(log_pi[S])
        c = coefficient(log_pi)[S]
        with np.errstate(invalid="ignore"):  # an infinite c (sigma = 0 at G = inf) is rejected below
            h = c - pi @ c
        return h, float(np.max(np.abs(pi * h))) / beta  # the gradient is pi * h

    theta = np.log(pi_ref[S])
    n, eps, dt = len(theta), 1e-6, 1.0
    h, res = H(theta)
    for step in range(max_steps):
        if res < tol:
            return StationaryPoint(_embed(theta, S), res, step)
        J = np.stack([(H(theta + eps * e)[0] - H(theta - eps * e)[0]) / (2 * eps) for e in np.eye(n)], axis=1)
        # h ignores shifts of theta, so J is singular along 1; the rank-one term fixes that
        # direction (the step's component along it is dropped anyway).
        d = np.linalg.solve(np.eye(n) / dt - J + np.ones((n, n)) / n, h)
        h_new, res_new = H(theta + d)
        # judge steps by h, not by the gradient pi * h: the gradient also vanishes at every vertex
        if not np.all(np.isfinite(h_new)) or np.max(np.abs(h_new)) > 2 * np.max(np.abs(h)):
            dt /= 4  # too bold: fall back towards the flow
            continue
        theta, dt = theta + d - np.mean(d), dt * 2 if res_new < res else dt
        h, res = h_new, res_new
    if res < tol:
        return StationaryPoint(_embed(theta, S), res, max_steps)
    raise RuntimeError(
        f"grpo_stationary did not converge: residual {res:.3g} after {max_steps} steps "
        "(with direct KL the flow from pi_ref can run to a vertex, which has no finite "
        "logits)."
    )


def _embed(theta: Array, S: Array) -> Array:
    pi = np.zeros(S.shape)
    pi[S] = _softmax(theta)
    return pi


def log_pooling(pi_ref: Array, rewards: Array, beta: float) -> Array:
    """RLHF with KL: pi(o) = pi_ref(o) exp(r(o)/beta) / Z (r the expected reward)."""
    pi_ref, r = np.asarray(pi_ref, dtype=float), np.asarray(rewards, dtype=float)
    with np.errstate(divide="ignore"):
        return _softmax(np.log(pi_ref) + r / beta)


def binary_stationary_g2(p_ref: float, beta: float, gamma: float = 1.0) -> float:
    """G = 2: pi(a) = [1 - beta/gamma + sqrt((1 - beta/gamma)^2 + 4 (beta/gamma) p_ref)] / 2."""
    c = beta / gamma
    return 0.5 * (1 - c + math.sqrt((1 - c) ** 2 + 4 * c * p_ref))


def binary_stationary_inf(p_ref: float, beta: float) -> float:
    """G -> infinity, deterministic rewards r(a) > r(b) (any scale)."""
    b2 = beta * beta
    return (2 * b2 * p_ref + 1 + math.sqrt(1 + 4 * b2 * p_ref * (1 - p_ref))) / (2 * (1 + b2))


def _sqrt_term(p: float, G: int) -> float:
    """(1/G) E_{k ~ Bin(G, p)} sqrt(k (G - k))."""
    k = np.arange(G + 1)
    return float(_binomial_pmf(G, p) @ np.sqrt(k * (G - k))) / G


def binary_identity(p: float, G: int) -> tuple[float, float]:
    """(p * P_G(correct | p) by enumeration, (1/G) E_{k~Bin(G,p)} sqrt(k (G-k))): equal."""
    return p * float(reward_preference(np.array([1 - p, p]), np.array([0.0, 1.0]), G)[1]), _sqrt_term(p, G)


def binary_stationary_finite(p_ref: float, beta: float, G: int) -> float:
    """Finite G, 0/1 rewards: the root in (p_ref, 1) of p - p_ref = (1/(beta G)) E sqrt(k (G-k)).

    By bisection, k ~ Bin(G, p); the right side is p P_G(correct | p) / beta (binary_identity).
    """
    lo, hi = p_ref, 1.0  # f(p_ref) < 0 < f(1) = 1 - p_ref
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid - p_ref - _sqrt_term(mid, G) / beta < 0:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-16:
            break
    return 0.5 * (lo + hi)
