"""The statistics `gcf bench` uses to say which method wins.

Standard library and numpy only (no scipy): the Student t quantile is the
inverse of the regularized incomplete beta function, found by bisection, and
past df = 1e5 the Cornish-Fisher series in 1/df; both are exact to ~1e-12
relative (checked against mpmath in tests/test_stats.py), not table lookups.

- `wilson`: interval for a success rate (k correct of n prompts).
- `t_quantile`, `mean_interval`: the t interval of a metric across seeds.
- `paired_bootstrap`: is method A better than the baseline on the same items?
- `seeds_bootstrap`: the same when each method ran several seeds on the same prompts.
- `pass_at_k`: the unbiased pass@k estimator of Chen et al. (2021).
"""

from __future__ import annotations

import math
import operator
from statistics import NormalDist

import numpy as np

_EPS = 1e-16
_TINY = 1e-300


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence!r}.")


def _z(confidence: float) -> float:
    """Two-sided standard normal quantile: 1.959964 for 0.95."""
    return NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0)


def wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials (Wilson 1927).

    centre = (p + z^2/2n) / (1 + z^2/n),
    half   = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/4n^2),  p = k/n.
    n = 0 carries no information and gives (0.0, 1.0).
    """
    k, n = operator.index(k), operator.index(n)
    _check_confidence(confidence)
    if n < 0 or not 0 <= k <= max(n, 0):
        raise ValueError(f"wilson needs 0 <= k <= n, got k={k}, n={n}.")
    if n == 0:
        return 0.0, 1.0
    z = _z(confidence)
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # k = 0 (k = n) makes lo (hi) exactly 0 (1); rounding would leave 3e-17 there
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction for I_x(a, b) (modified Lentz; Numerical Recipes 6.4)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    # iterations grow like sqrt(max(a, b)); df <= 1e5 needs a few hundred at most
    for m in range(1, 100_000):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + aa / c
            c = c if abs(c) > _TINY else _TINY
            h *= d * c
        if abs(d * c - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"incomplete beta did not converge for a={a}, b={b}, x={x}.")


def _stirling_delta(x: float) -> float:
    """lgamma(x) - ((x - 1/2) ln x - x + ln sqrt(2 pi)) for x >= 10 (Stirling series)."""
    x2 = 1.0 / (x * x)
    return (1 / 12 - x2 * (1 / 360 - x2 * (1 / 1260 - x2 * (1 / 1680 - x2 * (1 / 1188 - x2 * 691 / 360360))))) / x


def _lbeta(a: float, b: float) -> float:
    """ln B(a, b) for min(a, b) < 10 (the t tail has b = 1/2), without the cancellation of
    lgamma(a) + lgamma(b) - lgamma(a + b) at large a: Stirling's formula with its correction
    term for the large argument, as in R's lbeta.
    """
    p, q = min(a, b), max(a, b)
    if p >= 10.0:
        raise ValueError(f"_lbeta covers min(a, b) < 10 only, got a={a}, b={b}.")
    if q < 10.0:
        return math.lgamma(p) + math.lgamma(q) - math.lgamma(p + q)
    corr = _stirling_delta(q) - _stirling_delta(p + q)
    return math.lgamma(p) + corr + p - p * math.log(p + q) - (q - 0.5) * math.log1p(p / q)


def _betainc(a: float, b: float, x: float, y: float, log_x: float, log_y: float) -> float:
    """Regularized incomplete beta I_x(a, b), y = 1 - x; logs passed in to keep their digits."""
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    front = math.exp(a * log_x + b * log_y - _lbeta(a, b))  # x^a y^b / B(a, b)
    # the continued fraction converges fast only below the mean; above it, I_x(a,b) = 1 - I_y(b,a)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, y) / b


def _t_upper_tail(t: float, df: int) -> float:
    """P(T > t) for t >= 0: 0.5 * I_x(df/2, 1/2) with x = df / (df + t^2)."""
    t2 = t * t
    if t2 == 0.0:
        return 0.5
    x, y = df / (df + t2), t2 / (df + t2)
    # log1p: x is within t^2/df of 1 at large df, where log(x) would lose its digits
    return 0.5 * _betainc(df / 2.0, 0.5, x, y, -math.log1p(t2 / df), math.log(y))


# Past this df the incomplete beta loses digits to rounding (3e-12 relative at df = 1e6, 3e-9 at
# 1e9), while the Cornish-Fisher series below is exact to float precision: each term is about
# t^2/df of the last, 1e-4 at t = 3.
_LARGE_DF = 10**5


def _t_quantile_large_df(p: float, df: int) -> float:
    """Cornish-Fisher series of the t quantile in 1/df (Abramowitz & Stegun 26.7.5), for df > 1e5.

    The first omitted term is of order x^11 / df^5: below 1e-13 even at p = 1e-300
    (|x| = 37) and below 1e-25 at the usual |x| <= 4.
    """
    x = NormalDist().inv_cdf(p)
    x2 = x * x
    g1 = x * (x2 + 1) / 4
    g2 = x * ((5 * x2 + 16) * x2 + 3) / 96
    g3 = x * (((3 * x2 + 19) * x2 + 17) * x2 - 15) / 384
    g4 = x * ((((79 * x2 + 776) * x2 + 1482) * x2 - 1920) * x2 - 945) / 92160
    return x + (g1 + (g2 + (g3 + g4 / df) / df) / df) / df


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile: the t with P(T <= t) = p for df degrees of freedom.

    Solves the upper tail 0.5 * I_{df/(df+t^2)}(df/2, 1/2) = min(p, 1-p) by
    bisection to float precision; t_quantile(0.975, 9) = 2.2621571628. Past
    df = 1e5 the Cornish-Fisher series in 1/df, exact there to float precision.
    """
    df = operator.index(df)
    if df < 1:
        raise ValueError(f"t_quantile needs df >= 1, got {df}.")
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile needs 0 < p < 1, got {p!r}.")
    if p == 0.5:
        return 0.0
    if df > _LARGE_DF:
        return _t_quantile_large_df(p, df)
    tail = min(p, 1.0 - p)
    lo, hi = 0.0, 2.0
    while _t_upper_tail(hi, df) > tail:  # widen until the root is bracketed
        lo, hi = hi, hi * 2.0
    # the tail falls as t grows; stop when the bracket no longer shrinks (float resolution)
    while True:
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if _t_upper_tail(mid, df) > tail:
            lo = mid
        else:
            hi = mid
    t = 0.5 * (lo + hi)
    return t if p > 0.5 else -t


def _clean(values: object, name: str) -> np.ndarray:
    """Values as a float array; None, NaN and infinities refused by position."""
    values = list(values)  # type: ignore[call-overload]
    bad = [i for i, v in enumerate(values) if v is None or not math.isfinite(float(v))]
    if bad:
        raise ValueError(
            f"{name} holds None, NaN or infinite values at positions {bad[:10]}; "
            "drop or fix those runs before computing an interval."
        )
    return np.asarray(values, dtype=np.float64)


def mean_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi): the Student t interval of the mean across seeds.

    mean +- t_{(1+confidence)/2, n-1} * s / sqrt(n), s the sample standard
    deviation (n - 1 in the denominator). A single value has no spread to
    estimate, so one value v gives (v, nan, nan), not a zero-width interval.
    None, NaN or infinite values raise ValueError, as does an empty list.
    """
    _check_confidence(confidence)
    x = _clean(values, "mean_interval's values")
    n = len(x)
    if n == 0:
        raise ValueError("mean_interval got no values; give one value per seed.")
    mean = float(x.mean())
    if n == 1:
        return mean, math.nan, math.nan
    half = t_quantile(1.0 - (1.0 - confidence) / 2.0, n - 1) * float(x.std(ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half


def paired_bootstrap(
    a: list[float], b: list[float], n_boot: int = 10000, seed: int = 0, confidence: float = 0.95
) -> dict:
    """Paired bootstrap of mean(a) - mean(b) over items scored by both methods.

    a[i] and b[i] are the scores of method A and of the baseline on the same
    item (same prompt, same seed; flatten prompts x seeds the same way for
    both). Item indices are resampled with replacement n_boot times with
    numpy.random.default_rng(seed), so the result is a function of the inputs.

    Returns {"diff": mean(a) - mean(b), "lo", "hi": the percentile interval of
    the resampled differences at `confidence`, "p_value", "significant":
    0 lies outside [lo, hi], "n": number of items, "se": the standard deviation
    of the resampled differences, "mdd": the minimum detectable difference at
    80% power of this design, `mdd(se, confidence)`}.

    p_value is two-sided: the share of resampled differences on the other side
    of 0 from diff (<= 0 when diff > 0, >= 0 when diff < 0), doubled and capped
    at 1; diff == 0 gives 1. Its resolution is 1 / n_boot, so 0.0 means
    "below 1 / n_boot", not impossible.
    """
    _check_confidence(confidence)
    n_boot = operator.index(n_boot)
    if n_boot < 1:
        raise ValueError(f"paired_bootstrap needs n_boot >= 1, got {n_boot}.")
    xa, xb = _clean(a, "paired_bootstrap's a"), _clean(b, "paired_bootstrap's b")
    if len(xa) != len(xb):
        raise ValueError(
            f"paired_bootstrap needs a and b scored on the same items, got {len(xa)} and {len(xb)} scores."
        )
    n = len(xa)
    if n == 0:
        raise ValueError("paired_bootstrap got no items; score both methods on at least one prompt.")
    d = xa - xb  # [n] per-item difference
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)  # [n_boot] resampled mean differences
    rows = max(1, 2_000_000 // n)  # bounds the index block to ~16 MB whatever n is
    for start in range(0, n_boot, rows):
        stop = min(n_boot, start + rows)
        idx = rng.integers(0, n, size=(stop - start, n))  # [rows, n]
        means[start:stop] = d[idx].mean(axis=1)
    return _percentile_result(means, float(xa.mean() - xb.mean()), confidence, n)


def mdd(se: float, confidence: float = 0.95, power: float = 0.8) -> float:
    """The minimum detectable difference of an estimate with standard error `se`: the true difference that a two-sided
    test at 1 - `confidence` finds significant with probability `power`, (z_{(1+confidence)/2} + z_power) * se
    (2.80 standard errors at 0.95 and 80%)."""
    _check_confidence(confidence)
    _check_confidence(power)
    return (_z(confidence) + NormalDist().inv_cdf(power)) * se


def detectable(d: dict) -> str:
    """What a difference that is not significant says, from its interval and its MDD (`stats.mdd`): its 95% interval
    inside (-MDD, +MDD) rules out a difference as large as the MDD; otherwise the design could not have seen one below it."""
    if d["lo"] > 0.0 or d["hi"] < 0.0:
        return "significant"
    m = d["mdd"]
    if -m < d["lo"] and d["hi"] < m:
        return f"no difference as large as the MDD {m:.3f}"
    return f"inconclusive: could not have detected less than {m:.3f}"


def _percentile_result(means: np.ndarray, diff: float, confidence: float, n: int) -> dict:
    """The percentile interval of resampled mean differences, the two-sided p-value, the significance mark, the
    bootstrap standard error and the minimum detectable difference at 80% power (`mdd`)."""
    alpha = 1.0 - confidence
    lo, hi = (float(q) for q in np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0]))
    if diff > 0:
        p_value = min(1.0, 2.0 * float(np.mean(means <= 0.0)))
    elif diff < 0:
        p_value = min(1.0, 2.0 * float(np.mean(means >= 0.0)))
    else:
        p_value = 1.0
    se = float(np.std(means, ddof=1)) if len(means) > 1 else 0.0
    significant = bool(lo > 0.0 or hi < 0.0)
    return {
        "diff": diff,
        "lo": lo,
        "hi": hi,
        "p_value": p_value,
        "significant": significant,
        "n": n,
        "se": se,
        "mdd": mdd(se, confidence),
    }


def seeds_bootstrap(
    a: list[list[float]], b: list[list[float]], n_boot: int = 10000, seed: int = 0, confidence: float = 0.95
) -> dict:
    """Two-level bootstrap of mean(a) - mean(b) when each method ran several seeds on the same prompts.

    a[s][i] is method A's score on prompt i in its seed s (a is seeds x prompts), b[s][i] the
    baseline's; both score the same prompts in the same order, and may have different numbers of
    seeds. Each resample draws the prompts with replacement (the same draw for both methods: the
    comparison is paired by prompt) and, independently, each method's seeds with replacement (a
    method's seed k and the baseline's seed k are separate trainings, not a pair). So the interval
    holds both the prompts' sampling and the training runs' spread; treating the seeds x prompts
    answers as independent items would hold only the first and call a difference significant that a
    new set of seeds could reverse. With one seed each it is `paired_bootstrap` over prompts. With
    few seeds the seed level's spread is underestimated by the factor (S - 1) / S of any bootstrap.

    Returns what `paired_bootstrap` returns, with "n" the number of prompts and "seeds" (len(a), len(b)).
    """
    _check_confidence(confidence)
    n_boot = operator.index(n_boot)
    if n_boot < 1:
        raise ValueError(f"seeds_bootstrap needs n_boot >= 1, got {n_boot}.")
    xa = np.stack([_clean(r, "seeds_bootstrap's a") for r in a]) if len(a) else np.empty((0, 0))  # [Sa, P]
    xb = np.stack([_clean(r, "seeds_bootstrap's b") for r in b]) if len(b) else np.empty((0, 0))  # [Sb, P]
    if not xa.size or not xb.size:
        raise ValueError(
            "seeds_bootstrap got no scores; give each method at least one seed scored on at least one prompt."
        )
    if xa.shape[1] != xb.shape[1]:
        raise ValueError(
            f"seeds_bootstrap needs both methods scored on the same prompts, got {xa.shape[1]} and {xb.shape[1]} per seed."
        )
    (sa, n), sb = xa.shape, xb.shape[0]
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)  # [n_boot] resampled mean differences
    rows = max(1, 2_000_000 // (n * max(sa, sb)))  # bounds each block to ~16 MB whatever the sizes
    for start in range(0, n_boot, rows):
        m = min(n_boot, start + rows) - start
        da = xa[rng.integers(0, sa, size=(m, sa))].mean(axis=1)  # [m, P]: each prompt's mean over A's resampled seeds
        db = xb[rng.integers(0, sb, size=(m, sb))].mean(axis=1)  # [m, P]
        idx = rng.integers(0, n, size=(m, n))  # [m, P]: the prompts drawn, shared by both methods
        means[start : start + m] = np.take_along_axis(da - db, idx, axis=1).mean(axis=1)
    out = _percentile_result(means, float(xa.mean() - xb.mean()), confidence, n)
    out["seeds"] = (sa, sb)
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021).

    1 - C(n-c, k) / C(n, k), written as 1 - prod_{i=n-c+1}^{n} (1 - k/i) so no
    large binomial is formed. Needs 0 <= c <= n and 1 <= k <= n.
    """
    n, c, k = operator.index(n), operator.index(c), operator.index(k)
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got c={c}, n={n}.")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n (k samples drawn from n), got k={k}, n={n}.")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
