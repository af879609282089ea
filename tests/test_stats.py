"""gcfamily.core.stats against hand-worked formulas, closed forms, tables and brute force."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from statistics import NormalDist

import pytest

from gcfamily.core.stats import (
    _t_quantile_large_df,
    mean_interval,
    paired_bootstrap,
    pass_at_k,
    seeds_bootstrap,
    t_quantile,
    wilson,
)

Z95 = 1.959964  # two-sided 95% normal quantile, from the table


# ---------------------------------------------------------------- wilson


def test_wilson_8_of_10_by_hand():
    # p = 0.8, z^2/n = 0.384145; centre = (0.8 + 0.192072) / 1.384145 = 0.716740
    # half = z / 1.384145 * sqrt(0.016 + z^2/400) = 0.226584 -> (0.4902, 0.9433)
    k, n, z = 8, 10, Z95
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    lo, hi = wilson(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    assert lo == pytest.approx(centre - half, abs=1e-6)
    assert hi == pytest.approx(centre + half, abs=1e-6)


def test_wilson_edges():
    lo, hi = wilson(0, 10)
    assert lo == 0.0  # exactly: the formula's 3e-17 rounding must not leak through
    # k = 0: hi = (z^2/2n + z sqrt(z^2/4n^2)) / (1 + z^2/n) = (z^2/n) / (1 + z^2/n)
    assert hi == pytest.approx((Z95**2 / 10) / (1 + Z95**2 / 10), abs=1e-6)
    lo, hi = wilson(10, 10)
    assert hi == 1.0 and lo == pytest.approx(1 / (1 + Z95**2 / 10), abs=1e-6)
    assert wilson(0, 0) == (0.0, 1.0)
    # a higher confidence gives a wider interval around the same centre
    (a, b), (c, d) = wilson(8, 10, 0.95), wilson(8, 10, 0.99)
    assert c < a and d > b


@pytest.mark.parametrize("k, n, conf", [(11, 10, 0.95), (-1, 10, 0.95), (1, -1, 0.95), (1, 10, 1.0), (1, 10, 0.0)])
def test_wilson_refuses(k, n, conf):
    with pytest.raises(ValueError):
        wilson(k, n, conf)


# ---------------------------------------------------------------- t_quantile

# 0.975 quantiles to 8 decimals (4-decimal tables: 12.7062, 4.3027, 2.7764, 2.2622, 2.0423)
T975 = {1: 12.70620474, 2: 4.30265273, 4: 2.77644511, 9: 2.26215716, 30: 2.04227246}


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantile_table(df):
    t = t_quantile(0.975, df)
    assert abs(t - T975[df]) < 1e-6
    assert round(t, 4) == round(T975[df], 4)
    assert t_quantile(0.025, df) == pytest.approx(-t, rel=1e-12)


def _t_closed_form(p: float, df: int) -> float:
    """Closed forms of the t quantile for df = 1, 2, 4 (Hill 1970; Shaw 2006)."""
    if df == 1:  # tan(pi (p - 1/2)), written as 1/tan of the small angle to keep its digits at the tails
        return -1 / math.tan(math.pi * p) if p < 0.5 else 1 / math.tan(math.pi * (1 - p))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    alpha = 4 * p * (1 - p)
    q = math.cos(math.acos(math.sqrt(alpha)) / 3) / math.sqrt(alpha)
    return math.copysign(2 * math.sqrt(q - 1), p - 0.5)


@pytest.mark.parametrize("df", [1, 2, 4])
@pytest.mark.parametrize("p", [1e-8, 0.001, 0.05, 0.3, 0.6, 0.9, 0.975, 0.999, 1 - 1e-8])
def test_t_quantile_closed_forms(df, p):
    assert t_quantile(p, df) == pytest.approx(_t_closed_form(p, df), rel=1e-9)


def test_t_quantile_large_df_tends_to_normal():
    z = NormalDist().inv_cdf(0.975)
    assert z == pytest.approx(1.959964, abs=1e-6)
    for df in (10**6, 10**9):
        assert abs(t_quantile(0.975, df) - 1.95996) < 1e-5
    for df in (10**4, 10**5, 10**5 + 1, 10**6, 10**9):
        t = t_quantile(0.975, df)
        # first-order Cornish-Fisher: t = z + (z^3 + z) / (4 df) + O(1/df^2)
        assert t == pytest.approx(z + (z**3 + z) / (4 * df), abs=10 / df**2)
    assert t_quantile(0.5, 7) == 0.0


def _t_quantile_mpmath(p: float, df: int, mpmath) -> float:
    """The t quantile from mpmath's own incomplete beta at 30 digits, by plain bisection."""
    with mpmath.workdps(30):  # local: sympy shares mpmath's global precision
        dfm, tail = mpmath.mpf(df), mpmath.mpf(min(p, 1 - p))

        def upper_tail(t):
            return mpmath.betainc(dfm / 2, 0.5, 0, dfm / (dfm + t * t), regularized=True) / 2

        # |t quantile| >= |normal quantile|; grow the bracket gently
        # (mpmath cannot evaluate tails far below 1e-300)
        lo = mpmath.mpf(abs(NormalDist().inv_cdf(p)))
        hi = lo * 1.25
        while upper_tail(hi) > tail:
            lo, hi = hi, hi * 1.25
        while hi - lo > hi * mpmath.mpf(2) ** -60:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if upper_tail(mid) > tail else (lo, mid)
        return float(lo) if p > 0.5 else -float(lo)


def test_t_quantile_against_mpmath():
    mpmath = pytest.importorskip("mpmath")
    # both paths: the incomplete beta (df <= 1e5) and the Cornish-Fisher series (df > 1e5)
    for df in (3, 17, 250, 10**5, 10**5 + 1, 10**7):
        for p in (1e-12, 0.01, 0.8):  # p > 1/2 and tails beyond the tables
            assert t_quantile(p, df) == pytest.approx(_t_quantile_mpmath(p, df, mpmath), rel=1e-12), (df, p)
    # past df = 1e5 the series' 1/df^4 term is below float resolution, so check every term
    # at df = 200, where that term is ~1e-9 and the first omitted one ~1e-11
    for p in (0.975, 0.005):
        assert _t_quantile_large_df(p, 200) == pytest.approx(_t_quantile_mpmath(p, 200, mpmath), rel=1e-10)


@pytest.mark.parametrize("p, df", [(0.0, 5), (1.0, 5), (0.975, 0), (float("nan"), 5)])
def test_t_quantile_refuses(p, df):
    with pytest.raises(ValueError):
        t_quantile(p, df)


# ---------------------------------------------------------------- mean_interval


def test_mean_interval_by_hand():
    # mean 2, sample sd 1, t_{0.975, 2} = 4.3026527: 2 -+ 4.3026527 / sqrt(3)
    mean, lo, hi = mean_interval([1, 2, 3])
    assert mean == 2
    assert lo == pytest.approx(2 - 4.3026527 / math.sqrt(3), abs=1e-6)
    assert hi == pytest.approx(2 + 4.3026527 / math.sqrt(3), abs=1e-6)
    # 90%: t_{0.95, 2} = 2.9199856
    _, lo90, _ = mean_interval([1.0, 2.0, 3.0], confidence=0.90)
    assert lo90 == pytest.approx(2 - 2.9199856 / math.sqrt(3), abs=1e-6)


def test_mean_interval_one_value_has_no_interval():
    mean, lo, hi = mean_interval([0.7])
    assert mean == 0.7 and math.isnan(lo) and math.isnan(hi)


@pytest.mark.parametrize("bad", [[1.0, float("nan")], [1.0, None], [float("inf"), 2.0]])
def test_mean_interval_refuses_missing_values(bad):
    with pytest.raises(ValueError, match="None, NaN or infinite values at positions"):
        mean_interval(bad)
    with pytest.raises(ValueError, match="no values"):
        mean_interval([])


# ---------------------------------------------------------------- paired_bootstrap


def test_paired_bootstrap_is_deterministic_given_seed():
    a = [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    b = [0, 0, 1, 0, 0, 1, 0, 0, 1, 1]
    r1, r2 = (
        paired_bootstrap(a, b, n_boot=2000, seed=3),
        paired_bootstrap(a, b, n_boot=2000, seed=3),
    )
    assert r1 == r2
    assert r1["diff"] == pytest.approx(0.3) and r1["n"] == 10
    assert paired_bootstrap(a, b, n_boot=2000, seed=4) != r1  # the seed is actually used
    # swapping the methods mirrors everything: the diff < 0 branch of the p-value
    r3 = paired_bootstrap(b, a, n_boot=2000, seed=3)
    assert r3["diff"] == pytest.approx(-0.3)
    assert r3["lo"] == pytest.approx(-r1["hi"]) and r3["hi"] == pytest.approx(-r1["lo"])
    assert r3["p_value"] == r1["p_value"] and r3["significant"] == r1["significant"]


def test_paired_bootstrap_identical_is_not_significant():
    a = [0.3, 0.9, 0.1, 0.5, 0.5]
    r = paired_bootstrap(a, list(a))
    assert r["diff"] == 0.0 and r["lo"] == 0.0 and r["hi"] == 0.0
    assert r["significant"] is False and r["p_value"] == 1.0


def test_paired_bootstrap_clear_winner_is_significant():
    r = paired_bootstrap([1] * 50, [0] * 50)
    assert r["diff"] == 1.0 and r["lo"] == 1.0 and r["hi"] == 1.0
    assert r["significant"] is True and r["p_value"] == 0.0 and r["n"] == 50


def test_paired_bootstrap_matches_exact_enumeration():
    # d = [0, 1]: a resample's mean is 0, 1/2, 1 with probability 1/4, 1/2, 1/4
    # so P(mean <= 0) = 1/4 -> p = 1/2; the 2.5% and 97.5% quantiles are 0 and 1
    r = paired_bootstrap([0, 1], [0, 0], n_boot=20000, seed=1)
    assert r["diff"] == 0.5
    assert r["p_value"] == pytest.approx(0.5, abs=0.03)
    assert (r["lo"], r["hi"]) == (0.0, 1.0) and r["significant"] is False


def test_paired_bootstrap_agrees_with_normal_theory():
    # 400 items: 0/1 scores, A right on 60%, B on 50%, paired differences d in {-1, 0, 1}.
    # With n = 400 the bootstrap draws its indices in two blocks of 5000 rows (the chunked path).
    n = 400
    a = [1 if i % 10 < 6 else 0 for i in range(n)]
    b = [1 if (i * 7) % 10 < 5 else 0 for i in range(n)]
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / n) / math.sqrt(n)  # plug-in standard error
    r = paired_bootstrap(a, b, n_boot=10000, seed=0)
    assert r["diff"] == pytest.approx(mean) and mean > 0
    assert r["lo"] == pytest.approx(mean - Z95 * se, abs=0.15 * se)
    assert r["hi"] == pytest.approx(mean + Z95 * se, abs=0.15 * se)
    normal_p = 2 * (1 - NormalDist().cdf(mean / se))
    assert r["p_value"] == pytest.approx(normal_p, abs=0.01)
    assert r["significant"] is True


def test_paired_bootstrap_refuses():
    with pytest.raises(ValueError, match="same items"):
        paired_bootstrap([1, 0, 1], [1, 0])
    with pytest.raises(ValueError, match="NaN"):
        paired_bootstrap([1, float("nan")], [1, 0])
    with pytest.raises(ValueError, match="no items"):
        paired_bootstrap([], [])


# ---------------------------------------------------------------- seeds_bootstrap


def test_seeds_bootstrap_matches_exact_enumeration_of_both_levels():
    # A: seed 0 right on prompt 0 only, seed 1 on none; baseline (one seed) on none. A resample draws A's two seeds
    # (c of them seed 0: 0, 1, 2 with probability 1/4, 1/2, 1/4) and the two prompts (j of them prompt 0, the same
    # law); its difference is j * c / 4, so P(diff <= 0) = 1 - 3/4 * 3/4 = 7/16 -> p = 7/8, and P(diff = 1) = 1/16 > 2.5%.
    r = seeds_bootstrap([[1, 0], [0, 0]], [[0, 0]], n_boot=40000, seed=1)
    assert r["diff"] == 0.25 and r["n"] == 2 and r["seeds"] == (2, 1)
    assert r["p_value"] == pytest.approx(7 / 8, abs=0.02)
    assert (r["lo"], r["hi"]) == (0.0, 1.0) and r["significant"] is False
    # The same answers as four independent items: P(mean <= 0) = (3/4)^4 -> p = 0.63, a different law
    assert paired_bootstrap([1, 0, 0, 0], [0, 0, 0, 0], n_boot=40000, seed=1)["p_value"] == pytest.approx(
        2 * 0.75**4, abs=0.02
    )


def test_seeds_bootstrap_with_one_seed_each_is_the_paired_bootstrap_over_prompts():
    a, b = [1, 0, 1, 1, 0, 1, 1, 0, 1, 1], [0, 0, 1, 0, 0, 1, 0, 0, 1, 1]
    r, q = seeds_bootstrap([a], [b], n_boot=20000, seed=2), paired_bootstrap(a, b, n_boot=20000, seed=2)
    assert r["diff"] == q["diff"] == pytest.approx(0.3)
    assert r["lo"] == pytest.approx(q["lo"], abs=0.051) and r["hi"] == pytest.approx(q["hi"], abs=0.051)
    assert r["p_value"] == pytest.approx(q["p_value"], abs=0.02)


def test_seeds_bootstrap_holds_the_spread_between_seeds():
    # 300 prompts, three seeds each. The baseline is right on 60% in every seed; the method on 90%, 50%, 70%: its mean is
    # 0.1 higher, but one seed is below the baseline. Over the 900 (seed, prompt) pairs as independent items the
    # difference looks certain; with the seeds resampled it is not.
    n = 300
    base = [[1.0 if i % 10 < 6 else 0.0 for i in range(n)] for _ in range(3)]
    meth = [[1.0 if (i * 7 + s) % 10 < k else 0.0 for i in range(n)] for s, k in enumerate((9, 5, 7))]
    flat = paired_bootstrap([x for row in meth for x in row], [x for row in base for x in row], n_boot=5000)
    two = seeds_bootstrap(meth, base, n_boot=5000)
    assert flat["diff"] == pytest.approx(0.1) and two["diff"] == pytest.approx(0.1)
    assert flat["significant"] is True and two["significant"] is False
    assert two["lo"] < 0.0 < two["hi"] and two["hi"] - two["lo"] > 3 * (flat["hi"] - flat["lo"])
    assert seeds_bootstrap(meth, base, n_boot=5000) == two  # a function of its inputs and seed


def test_seeds_bootstrap_refuses():
    with pytest.raises(ValueError, match="same prompts"):
        seeds_bootstrap([[1, 0, 1]], [[1, 0]])
    with pytest.raises(ValueError, match="NaN"):
        seeds_bootstrap([[1, float("nan")]], [[1, 0]])
    with pytest.raises(ValueError, match="no scores"):
        seeds_bootstrap([], [[1]])


# ---------------------------------------------------------------- pass_at_k


def _pass_at_k_brute(n: int, c: int, k: int) -> Fraction:
    """Share of the k-subsets of n samples (c correct) that hold a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


def test_pass_at_k_brute_force():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_pass_at_k_brute(n, c, k)), abs=1e-12)


def test_pass_at_k_large_n_is_stable():
    # binomials of 1000 choose 100 overflow a float; the product form does not
    exact = 1 - Fraction(math.comb(990, 100), math.comb(1000, 100))
    assert pass_at_k(1000, 10, 100) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(200, 1, 1) == pytest.approx(1 / 200)
    assert pass_at_k(5, 3, 3) == 1.0  # n - c < k: every draw holds a correct sample


@pytest.mark.parametrize("n, c, k", [(5, 2, 6), (5, 6, 1), (5, 2, 0), (5, -1, 1)])
def test_pass_at_k_refuses(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)
