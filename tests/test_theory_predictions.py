"""Checks of gcfamily.theory.predictions against hand-worked values, closed forms and autograd."""

import itertools
import math

import numpy as np
import pytest
import torch

from gcfamily.errors import GcfError
from gcfamily.theory.predictions import (
    binary_identity,
    binary_stationary_finite,
    binary_stationary_g2,
    binary_stationary_inf,
    expected_gradient,
    grpo_stationary,
    log_pooling,
    reward_preference,
)

GROUPS = [2, 3, 4, 5, 6, 7, 8, None]
PI4 = np.array([0.1, 0.2, 0.3, 0.4])
REF4 = np.array([0.4, 0.3, 0.2, 0.1])
R4 = np.array([0.0, 1.0, 2.5, 3.0])  # distinct, unevenly spaced
Q4 = np.array([0.1, 0.3, 0.6, 0.9])


# ---- reward preference -------------------------------------------------------------------


def test_g2_hand_worked():
    # rewards 0, 1, 2 under pi = (.5, .3, .2): P_2(o) = P[r(o) > r(o')] - P[r(o) < r(o')]
    # o=0: 0 - .5 = -.5;  o=1: .5 - .2 = .3;  o=2: .8 - 0 = .8
    P = reward_preference(np.array([0.5, 0.3, 0.2]), np.array([0.0, 1.0, 2.0]), 2)
    np.testing.assert_allclose(P, [-0.5, 0.3, 0.8], atol=1e-15)
    # a tie counts as 0 (zero-std group): rewards 0, 1, 1 -> o=1: .5 - 0 = .5
    P = reward_preference(np.array([0.5, 0.3, 0.2]), np.array([0.0, 1.0, 1.0]), 2)
    np.testing.assert_allclose(P, [-0.5, 0.5, 0.5], atol=1e-15)
    # sample std at G = 2: every advantage times sqrt(1/2)
    P = reward_preference(np.array([0.5, 0.3, 0.2]), np.array([0.0, 1.0, 2.0]), 2, std="sample")
    np.testing.assert_allclose(P, np.array([-0.5, 0.3, 0.8]) / math.sqrt(2), atol=1e-15)
    # Bernoulli q = (.9, .4), pi = (.25, .75): E_pi q = .525, P_2(o) = q(o) - .525
    P = reward_preference(np.array([0.25, 0.75]), np.array([0.9, 0.4]), 2, bernoulli=True)
    np.testing.assert_allclose(P, [0.375, -0.125], atol=1e-15)


def test_g2_is_pairwise_comparison():
    rng = np.random.default_rng(0)
    pi, r = rng.dirichlet(np.ones(5)), np.array([0.3, -1.0, 0.3, 2.0, 0.7])  # one tie
    pairwise = [pi @ (np.sign(ro - r)) for ro in r]
    np.testing.assert_allclose(reward_preference(pi, r, 2), pairwise, atol=1e-14)


def test_g3_binary_hand_worked():
    # p = .5; the 2 others hold m ~ Bin(2, .5) correct answers. m=0 (1/4): group (1,0,0),
    # A = (1 - 1/3) / sqrt(2/9) = sqrt(2); m=1 (1/2): (1,1,0), A = (1/3) / sqrt(2/9) = sqrt(1/2);
    # m=2: all equal, A = 0.  P = sqrt(2)/4 + sqrt(1/2)/2 = 1/sqrt(2)
    P = reward_preference(np.array([0.5, 0.5]), np.array([0.0, 1.0]), 3)
    assert P[1] == pytest.approx(1 / math.sqrt(2), abs=1e-15)
    Ps = reward_preference(np.array([0.5, 0.5]), np.array([0.0, 1.0]), 3, std="sample")
    assert Ps[1] == pytest.approx(1 / math.sqrt(3), abs=1e-15)  # times sqrt(2/3)


def test_infinity_hand_worked():
    # p = .25: E r = .25, sigma = sqrt(.25 * .75) = sqrt(3)/4; P(a) = .75 / sigma = sqrt(3),
    # P(b) = -.25 / sigma = -1/sqrt(3)
    P = reward_preference(np.array([0.75, 0.25]), np.array([0.0, 1.0]), None)
    np.testing.assert_allclose(P, [-1 / math.sqrt(3), math.sqrt(3)], atol=1e-15)
    # Bernoulli noise enters sigma: q = (.2, .6), pi = (.5, .5): E q = .4, sigma = sqrt(.24)
    P = reward_preference(np.array([0.5, 0.5]), np.array([0.2, 0.6]), None, bernoulli=True)
    np.testing.assert_allclose(P, np.array([-0.2, 0.2]) / math.sqrt(0.24), atol=1e-15)


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("std", ["population", "sample", "none"])
@pytest.mark.parametrize("bernoulli", [False, True])
def test_preference_has_mean_zero(G, std, bernoulli):
    # advantages sum to zero in every group, so E_{o~pi} P_G(o | pi) = 0
    P = reward_preference(PI4, Q4 if bernoulli else R4, G, std=std, bernoulli=bernoulli)
    assert PI4 @ P == pytest.approx(0.0, abs=1e-13)


def test_large_group_approaches_infinity():
    pi, r, q = np.array([0.3, 0.5, 0.2]), np.array([0.0, 0.5, 2.0]), np.array([0.9, 0.4, 0.1])
    err = {G: np.max(np.abs(reward_preference(pi, r, G) - reward_preference(pi, r, None))) for G in (50, 200)}
    assert err[200] < 0.01 and err[200] < err[50] / 3  # the gap shrinks like 1/G
    gap_b = reward_preference(pi, q, 500, bernoulli=True) - reward_preference(pi, q, None, bernoulli=True)
    err_b = np.max(np.abs(gap_b))
    assert err_b < 2e-3


@pytest.mark.parametrize("G", [3, 5, None])
@pytest.mark.parametrize("bernoulli", [False, True])
def test_shift_only_preference(G, bernoulli):
    # A_i = r_i - mean: o is 1/G of its own mean, so P_G = (1 - 1/G)(r(o) - E_pi r)
    r = Q4 if bernoulli else R4
    factor = 1.0 if G is None else 1 - 1 / G
    P = reward_preference(PI4, r, G, std="none", bernoulli=bernoulli)
    np.testing.assert_allclose(P, factor * (r - PI4 @ r), atol=1e-14)


@pytest.mark.parametrize("G", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.93])
def test_binary_identity(G, p):
    lhs, rhs = binary_identity(p, G)
    assert lhs == pytest.approx(rhs, abs=1e-14)
    if (G, p) == (3, 0.5):  # (1/3)(3/8 sqrt(2) + 3/8 sqrt(2)) = sqrt(2)/4, and .5 / sqrt(2) too
        assert rhs == pytest.approx(math.sqrt(2) / 4, abs=1e-15)


# ---- closed forms and the general solver ---------------------------------------------------


def test_closed_forms_hand_worked():
    assert binary_stationary_g2(0.25, 1.0) == pytest.approx(0.5)  # beta = gamma: sqrt(p_ref)
    assert binary_stationary_g2(0.36, 0.4, gamma=0.4) == pytest.approx(0.6)
    # beta = 1, p_ref = .5: (1 + 1 + sqrt(2)) / 4; check: p - sqrt(p(1-p)) = .8536 - .3536 = .5
    assert binary_stationary_inf(0.5, 1.0) == pytest.approx((2 + math.sqrt(2)) / 4)


def _solve_binary(p_ref, beta, G, rewards=(1.0, 0.0), bernoulli=False, std="population"):
    sp = grpo_stationary(np.array([p_ref, 1 - p_ref]), np.array(rewards), G, beta, std=std, bernoulli=bernoulli)
    assert sp.residual < 1e-12
    return sp.pi[0]


BETAS = [0.05, 0.3, 1.0, 5.0]


@pytest.mark.parametrize("p_ref", [0.1, 0.6])
@pytest.mark.parametrize("beta", BETAS)
def test_solver_matches_g2(p_ref, beta):
    assert _solve_binary(p_ref, beta, 2) == pytest.approx(binary_stationary_g2(p_ref, beta), abs=1e-9)
    # Bernoulli q = (.8, .3): gamma = P(a>b) - P(b>a) = .8*.7 - .3*.2 = .5
    got = _solve_binary(p_ref, beta, 2, rewards=(0.8, 0.3), bernoulli=True)
    assert got == pytest.approx(binary_stationary_g2(p_ref, beta, gamma=0.5), abs=1e-9)


def test_solver_beta_equal_gamma_gives_sqrt_p_ref():
    # q = (.9, .4), gamma = .5 = beta, p_ref = .3 -> pi(a) = sqrt(.3)
    got = _solve_binary(0.3, 0.5, 2, rewards=(0.9, 0.4), bernoulli=True)
    assert got == pytest.approx(math.sqrt(0.3), abs=1e-9)


@pytest.mark.parametrize("p_ref", [0.1, 0.6])
@pytest.mark.parametrize("beta", BETAS)
def test_solver_matches_infinity(p_ref, beta):
    # any r(a) > r(b) gives the same answer: the standardised preference is scale-free
    assert _solve_binary(p_ref, beta, None, rewards=(3.0, -1.0)) == pytest.approx(
        binary_stationary_inf(p_ref, beta), abs=1e-9
    )


@pytest.mark.parametrize("G", [3, 4, 8])
@pytest.mark.parametrize("beta", BETAS)
def test_solver_matches_finite_root(G, beta):
    p = binary_stationary_finite(0.3, beta, G)
    assert 0.3 < p < 1
    assert _solve_binary(0.3, beta, G) == pytest.approx(p, abs=1e-9)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("p_ref", [0.05, 0.5, 0.9])
def test_lower_bounds(beta, p_ref):
    gamma = 0.5
    p2 = _solve_binary(p_ref, beta, 2, rewards=(0.75, 0.25), bernoulli=True)
    assert p2 >= max(1 - beta / gamma, p_ref) - 1e-12
    assert _solve_binary(p_ref, beta, None) >= max(1 / (1 + beta**2), p_ref) - 1e-12


@pytest.mark.parametrize("G", [2, 4, 7])
def test_sample_std_is_a_larger_beta(G):
    # sample std scales P_G by sqrt((G-1)/G): the population model at beta * sqrt(G/(G-1))
    sample = grpo_stationary(REF4, R4, G, 0.3, std="sample").pi
    population = grpo_stationary(REF4, R4, G, 0.3 * math.sqrt(G / (G - 1))).pi
    np.testing.assert_allclose(sample, population, atol=1e-10)


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("beta", [0.05, 5.0])
@pytest.mark.parametrize("bernoulli", [False, True])
def test_k6_converges_and_is_a_fixed_point(G, beta, bernoulli):
    rng = np.random.default_rng(1)
    ref, r = rng.dirichlet(np.ones(6)), (rng.uniform(size=6) if bernoulli else rng.normal(size=6))
    sp = grpo_stationary(ref, r, G, beta, bernoulli=bernoulli)
    assert sp.residual < 1e-12
    P = reward_preference(sp.pi, r, G, bernoulli=bernoulli)
    np.testing.assert_allclose((1 - P / beta) * sp.pi, ref, atol=1e-11)


def test_k4_distinct_rewards():
    sp = grpo_stationary(REF4, R4, 4, 0.5)
    assert sp.residual < 1e-12
    grad = expected_gradient(np.log(sp.pi), REF4, R4, 4, 0.5)
    assert np.max(np.abs(grad)) < 1e-12
    # pi/pi_ref = 1 / (1 - P_G/beta) grows with P_G, which grows with the reward
    assert np.all(np.diff(sp.pi / REF4) > 0)


def test_zero_reference_mass_stays_zero():
    ref, r = np.array([0.5, 0.0, 0.3, 0.2]), np.array([0.0, 5.0, 1.0, 2.0])  # best output unreachable
    sp = grpo_stationary(ref, r, 3, 0.5)
    assert sp.pi[1] == 0.0 and sp.residual < 1e-12
    with np.errstate(divide="ignore"):  # logit -inf where pi = 0
        grad = expected_gradient(np.log(sp.pi), ref, r, 3, 0.5)
    np.testing.assert_allclose(grad, 0.0, atol=1e-12)


# ---- variants ----------------------------------------------------------------------------


@pytest.mark.parametrize("G", [2, 3, 8])
@pytest.mark.parametrize("bernoulli", [False, True])
def test_shift_only_direct_kl_is_log_pooling(G, bernoulli):
    # the md: pi = pi_ref exp((1 - 1/G) r / beta) / Z, RLHF at beta_eff = beta G / (G - 1)
    r = Q4 if bernoulli else R4
    sp = grpo_stationary(REF4, r, G, 0.4, bernoulli=bernoulli, variant="shift_only_direct_kl")
    np.testing.assert_allclose(sp.pi, log_pooling(REF4, r, 0.4 * G / (G - 1)), atol=1e-9)


def test_rlhf_is_shift_only_direct_kl_at_infinity():
    sp = grpo_stationary(REF4, R4, None, 0.7, variant="shift_only_direct_kl")
    np.testing.assert_allclose(sp.pi, log_pooling(REF4, R4, 0.7), atol=1e-9)


@pytest.mark.parametrize("G", [2, 4, None])
def test_grpo_is_not_log_pooling(G):
    # log pooling makes log(pi/pi_ref) affine in r; with r = 0, .5, 1 the second difference is 0
    ref, r = np.array([0.5, 0.3, 0.2]), np.array([0.0, 0.5, 1.0])

    def second(pi):
        return np.diff(np.log(pi / ref), 2)[0]

    assert abs(second(grpo_stationary(ref, r, G, 0.5).pi)) > 1e-3
    assert abs(second(grpo_stationary(ref, r, G, 0.5, variant="shift_only_direct_kl").pi)) < 1e-9


@pytest.mark.parametrize("G", [2, 5])
def test_other_variant_fixed_points(G):
    sp = grpo_stationary(REF4, R4, G, 0.6, variant="direct_kl")  # pi ∝ pi_ref exp(P_G(. | pi)/beta)
    P = reward_preference(sp.pi, R4, G)
    np.testing.assert_allclose(sp.pi, log_pooling(REF4, P, 0.6), atol=1e-10)
    sp = grpo_stationary(REF4, R4, G, 0.6, variant="shift_only")  # k3 with P = (1-1/G)(r - E r)
    P = (1 - 1 / G) * (R4 - sp.pi @ R4)
    np.testing.assert_allclose(sp.pi, REF4 / (1 - P / 0.6), atol=1e-10)


def test_direct_kl_at_infinity_can_run_to_a_vertex():
    # binary, G = inf, beta = .2: x - x_ref = 2 cosh(x/2)/beta has no root, so no finite logits
    with pytest.raises(RuntimeError, match="vertex"):
        grpo_stationary(np.array([0.4, 0.6]), np.array([1.0, 0.0]), None, 0.2, variant="direct_kl", max_steps=60)


def test_unknown_variant_is_a_user_error():
    with pytest.raises(GcfError, match="variant"):
        expected_gradient(np.zeros(2), np.array([0.5, 0.5]), np.array([0.0, 1.0]), 2, 0.1, variant="ppo")


# ---- expected gradient against autograd of the sampled objective ---------------------------


def _autograd(logits, ref, rewards, G, beta, std, bernoulli, variant):
    """Autograd of DeepSeekMath's objective, summed exactly over ordered groups (and reward draws)."""
    theta = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(theta, 0)
    old, log_ref = logp.detach(), torch.log(torch.tensor(ref))
    J = torch.zeros((), dtype=torch.float64)
    for seq in itertools.product(range(len(ref)), repeat=G):
        idx = list(seq)
        w_seq = torch.exp(old[idx].sum())
        draws = itertools.product([0.0, 1.0], repeat=G) if bernoulli else [tuple(rewards[idx])]
        for draw in draws:
            r = torch.tensor(draw, dtype=torch.float64)
            q = torch.tensor(rewards[idx])
            w = w_seq * (torch.prod(torch.where(r > 0, q, 1 - q)) if bernoulli else 1.0)
            if variant.startswith("shift"):
                A = r - r.mean()
            elif torch.all(r == r[0]):
                A = torch.zeros(G, dtype=torch.float64)
            else:
                A = (r - r.mean()) / r.std(correction=1 if std == "sample" else 0)
            ratio = torch.exp(logp[idx] - old[idx])
            log_rho = log_ref[idx] - logp[idx]
            D = torch.exp(log_rho) - log_rho - 1  # k3
            if variant.endswith("direct_kl"):
                D = ratio * D
            J = J + w * torch.mean(ratio * A - beta * D)
    J.backward()
    return theta.grad.numpy()


@pytest.mark.parametrize("variant", ["grpo", "direct_kl", "shift_only", "shift_only_direct_kl"])
@pytest.mark.parametrize("std", ["population", "sample"])
@pytest.mark.parametrize("bernoulli", [False, True])
def test_expected_gradient_matches_autograd(variant, std, bernoulli):
    logits, ref = np.array([0.3, -0.5, 0.1]), np.array([0.2, 0.5, 0.3])
    rewards = np.array([0.8, 0.1, 0.5]) if bernoulli else np.array([0.0, 1.0, 1.0])  # a tie
    want = _autograd(logits, ref, rewards, 3, 0.4, std, bernoulli, variant)
    got = expected_gradient(logits, ref, rewards, 3, 0.4, std=std, bernoulli=bernoulli, variant=variant)
    np.testing.assert_allclose(got, want, atol=1e-13)
