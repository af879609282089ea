"""The bandit language model trained with the real method classes against the exact predictions.

What is checked is the production path (method.setup/prepare/coefficient, engine.token_logprobs,
engine.weighted_loss) on a model whose stationary policies are known in closed form.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import metrics_rows

from gcfamily.core import engine
from gcfamily.methods.theory_variants import PREDICTED
from gcfamily.theory import predictions
from gcfamily.theory.bandit import BanditLM, BanditProblem, GroupEnumeration, sample_groups
from gcfamily.theory.train import (
    bandit_config,
    build_method,
    exact_gradient,
    one_thread,
    predicted_gradient,
    predicted_policy,
    step_normaliser,
    train_bandit,
)

K4 = BanditProblem(np.array([[0.4, 0.3, 0.2, 0.1]]), np.array([[0.0, 1.0, 2.5, 3.0]]))  # distinct, uneven rewards
K4_BERNOULLI = BanditProblem(np.array([[0.4, 0.3, 0.2, 0.1]]), np.array([[0.1, 0.3, 0.6, 0.9]]), bernoulli=True)
BINARY = BanditProblem.binary([0.2, 0.5, 0.8])  # three questions, one per p_ref, trained together


# ----------------------------------------------------------------------------- the model and its batches


def test_engine_logprob_is_the_softmax_of_the_prompts_logits():
    logits = torch.randn(3, 5, dtype=torch.float64)
    lm = BanditLM(logits)
    q, o = torch.tensor([0, 2, 1, 2]), torch.tensor([4, 0, 3, 3])
    ids = torch.stack([q, o], 1)
    out = engine.token_logprobs(lm, ids, torch.ones_like(ids), torch.tensor([[0, 1]] * 4))
    want = torch.log_softmax(logits, -1)[q, o]
    assert torch.allclose(out.logps[:, 1].double(), want, atol=1e-6)
    assert (out.logps[:, 0] == 0).all()


@pytest.mark.parametrize("problem", [K4, K4_BERNOULLI, BINARY], ids=["k4", "k4-bernoulli", "binary"])
def test_group_probabilities_sum_to_one_per_prompt(problem):
    G = 3
    enum = GroupEnumeration(problem, G)
    lm = BanditLM(np.random.default_rng(0).normal(size=(problem.P, problem.K)))
    w = enum.weights(lm)[::G]  # one row per group
    q = enum.prompts[::G]
    assert torch.allclose(
        torch.zeros(problem.P, dtype=w.dtype).index_add_(0, q, w), torch.ones(problem.P, dtype=w.dtype)
    )
    # the groups' mean reward is the policy's expected reward (Bernoulli: the success probability)
    mean_r = torch.zeros(problem.P, dtype=w.dtype).index_add_(0, enum.prompts, enum.weights(lm) * enum.rewards) / G
    assert np.allclose(mean_r.numpy(), (lm.probs().numpy() * problem.rewards).sum(1))


def test_sampled_groups_follow_the_policy():
    problem = BanditProblem.binary([0.3])
    batch = sample_groups(problem, problem.policy(), 2000, 4, torch.Generator().manual_seed(0))
    assert batch.input_ids.shape == (8000, 2) and (batch.loss_mask[:, 1] == 1).all()
    assert abs(float((batch.input_ids[:, 1] == 0).float().mean()) - 0.3) < 0.02
    assert torch.equal(batch.rewards, (batch.input_ids[:, 1] == 0).float())


# ----------------------------------------------------------------------------- production GC == theory


@pytest.mark.parametrize("method", list(PREDICTED))
@pytest.mark.parametrize("problem", [K4, K4_BERNOULLI], ids=["deterministic", "bernoulli"])
def test_exact_expected_gradient_equals_the_prediction(method, problem):
    """sum over every group of (group probability x the engine's gradient) == predictions.expected_gradient."""
    rng = np.random.default_rng(1)
    for G, std in ((2, "population"), (3, "sample"), (5, "population")):
        cfg = bandit_config(method, G, beta=0.3, std=std)
        m, runner = build_method(cfg, problem, np.log(problem.pi_ref) + rng.normal(size=problem.pi_ref.shape))
        with one_thread():
            grad = exact_gradient(m, runner, GroupEnumeration(problem, G), step_normaliser(m, problem))
        # the loss averages over prompts and descends: its gradient is -(1/P) times the ascent direction
        want = predicted_gradient(problem, method, runner.bandit.logits.detach().numpy(), G, 0.3, std)
        # the engine works in float32 (log-probs and the weighted sum over ~2600 rows)
        np.testing.assert_allclose(-grad.numpy() * problem.P, want, atol=1e-5 * np.abs(want).max())
        assert np.abs(want).max() > 1e-2


# ----------------------------------------------------------------------------- training reaches the predictions


@pytest.mark.parametrize("G", [2, 4, 8])
@pytest.mark.parametrize("beta", [0.2, 0.5, 1.0])
def test_binary_questions_reach_the_predicted_stationary_policy(G, beta):
    cfg = bandit_config("grpo", G, beta, "population")
    res = train_bandit(BINARY, cfg, exact=True, steps=2000)
    assert res.residual < 1e-5, f"not converged: residual {res.residual:.2g} after {res.steps} steps"
    # the binary closed forms of the paper, independently of the general solver
    closed = {2: predictions.binary_stationary_g2, 4: None, 8: None}[G]
    for q, p_ref in enumerate(BINARY.pi_ref[:, 0]):
        want = closed(p_ref, beta) if closed else predictions.binary_stationary_finite(p_ref, beta, G)
        assert abs(res.pi[q, 0] - want) < 1e-3, (q, res.pi[q, 0], want)
    assert np.abs(res.pi - predicted_policy(BINARY, "grpo", G, beta, "population")).max() < 1e-3


def test_sample_std_is_the_population_model_with_a_larger_beta():
    G, beta = 4, 0.3
    res = train_bandit(BINARY, bandit_config("grpo", G, beta, "sample"), exact=True)
    want = predicted_policy(BINARY, "grpo", G, beta * np.sqrt(G / (G - 1)), "population")
    assert np.abs(res.pi - want).max() < 1e-3


@pytest.mark.parametrize("problem", [K4, K4_BERNOULLI], ids=["deterministic", "bernoulli"])
def test_four_outputs_reach_the_predicted_stationary_policy(problem):
    res = train_bandit(problem, bandit_config("grpo", 4, 0.5, "population"), exact=True)
    want = predicted_policy(problem, "grpo", 4, 0.5, "population")
    assert np.abs(res.pi - want).max() < 1e-3
    assert np.abs(want - problem.pi_ref).max() > 0.1  # the case is not trivial


@pytest.mark.parametrize(
    "method, G, beta",
    [("grpo-shift", 4, 0.5), ("grpo-direct-kl", 2, 1.0), ("rloo", 4, 0.5), ("dr-grpo", 2, 1.0), ("dapo", 8, 0.3)],
)
def test_variants_reach_their_predictions(method, G, beta):
    for problem in (K4, BINARY):
        res = train_bandit(problem, bandit_config(method, G, beta), exact=True)
        assert np.abs(res.pi - predicted_policy(problem, method, G, beta)).max() < 1e-3


@pytest.mark.parametrize("problem", [K4, BINARY], ids=["k4", "binary"])
def test_grpo_is_not_log_pooling_but_shift_only_direct_kl_is(problem):
    G, beta = 4, 0.5
    beta_eff = beta * G / (G - 1)  # shift-only advantages carry a factor (1 - 1/G)

    def pool(b):
        return np.stack([predictions.log_pooling(problem.pi_ref[q], problem.rewards[q], b) for q in range(problem.P)])

    grpo = train_bandit(problem, bandit_config("grpo", G, beta), exact=True).pi
    assert np.abs(grpo - pool(beta)).max() > 0.05 and np.abs(grpo - pool(beta_eff)).max() > 0.05
    both = train_bandit(problem, bandit_config("grpo-shift-direct-kl", G, beta), exact=True).pi
    assert np.abs(both - pool(beta_eff)).max() < 1e-3


def test_sampled_groups_reach_the_prediction():
    """Many steps of sampled groups, the policy averaged over the second half (Polyak)."""
    problem = BanditProblem.binary([0.3, 0.7])
    res = train_bandit(problem, bandit_config("grpo", 4, 0.5), exact=False, steps=400, groups_per_prompt=32, seed=0)
    assert np.abs(res.pi - predicted_policy(problem, "grpo", 4, 0.5)).max() < 0.01


# ----------------------------------------------------------------------------- the command


def test_gcf_theory_prints_the_table_and_writes_the_plot(gcf, tmp_path):
    code, out, err = gcf("theory", "--method", "grpo", "--group-size", "4", "--beta", "0.2", "--out", str(tmp_path))
    assert code == 0, err
    lines = out.splitlines()
    assert sum(line.startswith("q") for line in lines) == 10  # 5 questions x 2 outputs
    largest = next(line for line in lines if line.startswith("largest difference:"))
    assert float(largest.split()[2]) < 1e-3
    assert (tmp_path / "theory-grpo-G4-beta0.2-sample.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "args, message",
    [
        (["--group-size", "1"], "G=1"),
        (["--beta", "-1"], "beta"),
        (["--method", "sft"], "No stationary-policy prediction"),
        (["--p-ref", "0.5,1.2"], "p_ref"),
        (["--method", "grpo", "--variant", "direct_kl"], "drop one"),
    ],
)
def test_gcf_theory_bad_input_is_one_clear_error(gcf, tmp_path, args, message):
    code, out, err = gcf("theory", "--out", str(tmp_path), *args)
    assert code == 2 and "error:" in err and message in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["grpo-shift", "grpo-direct-kl", "grpo-shift-direct-kl"])
def test_registered_variants_train_a_language_model_for_two_steps(gcf, tmp_path, name):
    sets = {"batch_size": 2, "group_size": 4, "max_new_tokens": 8, "micro_batch_size": 8, "progress": False, "mu": 2}
    code, out, err = gcf(
        "run",
        "--method",
        name,
        "--model",
        "tiny",
        "--task",
        "arithmetic",
        "--max-steps",
        "2",
        "--output-dir",
        str(tmp_path),
        *[f"--set={k}={v}" for k, v in sets.items()],
    )
    assert code == 0, err
    rows = metrics_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
