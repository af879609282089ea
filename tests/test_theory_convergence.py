"""`gcf theory` at its defaults reaches the predicted stationary policy on every case of the paper's figure.

The oracle is the paper's binary closed form (G = 2) and its bisection root for finite G, both with the
population std; GRPO's default sample std is that model at beta * sqrt(G / (G - 1)) (the reference
note). Neither is the general solver `gcf theory` prints, nor the training it checks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gcfamily.theory import predictions
from gcfamily.theory.bandit import BanditProblem
from gcfamily.theory.train import bandit_config, predicted_policy, train_bandit

P_REFS = (0.05, 0.2, 0.5, 0.8, 0.95)
TOL = 2e-5  # |trained - predicted| in pi(a); the stopping residual 1e-5 bounds it near 1e-5 (measured worst 4.8e-6)


def closed_form(p_ref: float, beta: float, G: int) -> float:
    """pi(a) at the fixed point with GRPO's sample std: the population-std form at beta * sqrt(G/(G-1))."""
    beta_pop = beta * math.sqrt(G / (G - 1))
    if G == 2:
        return predictions.binary_stationary_g2(p_ref, beta_pop)
    return predictions.binary_stationary_finite(p_ref, beta_pop, G)


@pytest.mark.parametrize("beta", [0.04, 0.1, 0.3, 1.0])
@pytest.mark.parametrize("G", [2, 4, 8, 16])
def test_defaults_converge_to_the_prediction_over_the_figure(G, beta):
    """Default settings (std, step rule, steps) of train_bandit, all five questions trained together."""
    res = train_bandit(BanditProblem.binary(P_REFS), bandit_config("grpo", G, beta))
    assert res.residual < 1e-5 and res.steps < 1000, (
        f"not converged: residual {res.residual:.2g} after {res.steps} steps"
    )
    want = np.array([closed_form(p, beta, G) for p in P_REFS])
    np.testing.assert_allclose(res.pi[:, 0], want, rtol=0, atol=TOL)


def test_the_reported_case_converges_through_the_command(gcf, tmp_path):
    """Issue 16: p_ref 0.5 used to train to 1.000000 at G=16, beta=0.04 ("NOT converged")."""
    code, out, err = gcf(
        "theory",
        "--method",
        "grpo",
        "-G",
        "16",
        "--beta",
        "0.04",
        "--p-ref",
        "0.2,0.5",
        "--plot-betas",
        "0.04",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    assert "std sample" in out.splitlines()[0] and "converged" in out and "NOT converged" not in out, out
    trained = {
        line.split()[0]: float(line.split()[3])
        for line in out.splitlines()
        if line.startswith("q") and line.split()[1] == "a"
    }
    assert (
        abs(trained["q1"] - closed_form(0.5, 0.04, 16)) < TOL and abs(trained["q0"] - closed_form(0.2, 0.04, 16)) < TOL
    )
    assert closed_form(0.5, 0.04, 16) < 0.9999  # the fixed point is interior: 1.000000 would fail


def test_no_step_lands_past_the_kl_clamp():
    """Shift-only advantages carry the reward's scale: at rewards 300/0 the first step (0.1 x a residual of 202)
    would move a logit 20 nats, to where GRPO's clamp of |log(pi_ref/pi)| at 20 zeroes the KL coefficient and
    every group is all one answer: a false fixed point with residual 0, 0.53 from the prediction. The step cap
    (1 nat) keeps training on its way to the prediction."""
    problem = BanditProblem.binary([0.1, 0.5, 0.9], (300.0, 0.0))
    res = train_bandit(problem, bandit_config("grpo-shift", 4, 150.0), steps=100)
    want = predicted_policy(problem, "grpo-shift", 4, 150.0)
    assert res.history[0] > 200  # the case is one where an uncapped first step is 20 nats
    assert np.abs(res.pi - want).max() < 1e-6
