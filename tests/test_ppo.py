"""PPO with a critic: GAE and the value loss by hand, the gradient against autograd of the textbook
clipped objective, the critic learning fixed returns, resume, and two-step runs through the CLI."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from click.testing import CliRunner

from gcfamily.cli import main
from gcfamily.config import Config
from gcfamily.core import engine
from gcfamily.core.batch import Batch
from gcfamily.data.batches import split_batch
from gcfamily.methods import get_method
from gcfamily.methods.ppo import PPO, explained_variance, gae, value_loss_terms, whiten
from gcfamily.models import tiny_model, tiny_tokenizer
from gcfamily.run.trainer import Trainer

FAST = {"batch_size": 2, "group_size": 4, "max_new_tokens": 8, "micro_batch_size": 8, "progress": False}


def make(**settings) -> PPO:
    cfg = Config(method="ppo", **settings)
    PPO.validate(cfg)
    return PPO(cfg)


# ----------------------------------------------------------------------------- hand-worked


def test_gae_by_hand():
    """Rows are [left-padded prompt | completion | right pad], as the rollout lays them out."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
    values = torch.tensor(
        [[9.0, 9.0, 0.5, 0.4, 0.8, 9.0], [9.0, 0.2, -0.1, 9.0, 9.0, 9.0]]
    )  # 9 = junk outside the mask
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 0, gamma*lam = 0.45; the state after the last token is terminal (V = 0):
    #   delta_2 = 1 + 0.9*0   - 0.8 =  0.2     A_2 = 0.2
    #   delta_1 = 0 + 0.9*0.8 - 0.4 =  0.32    A_1 = 0.32 + 0.45*0.2  = 0.41
    #   delta_0 = 0 + 0.9*0.4 - 0.5 = -0.14    A_0 = -0.14 + 0.45*0.41 = 0.0445
    #   returns = A + V = (0.5445, 0.81, 1.0)
    # row 1, reward 0:
    #   delta_1 = 0 + 0.9*0 - (-0.1) = 0.1          A_1 = 0.1
    #   delta_0 = 0 + 0.9*(-0.1) - 0.2 = -0.29      A_0 = -0.29 + 0.45*0.1 = -0.245
    #   returns = (-0.045, 0.0)
    want_adv = torch.tensor([[0, 0, 0.0445, 0.41, 0.2, 0], [0, -0.245, 0.1, 0, 0, 0]])
    want_ret = torch.tensor([[0, 0, 0.5445, 0.81, 1.0, 0], [0, -0.045, 0.0, 0, 0, 0]])
    assert torch.allclose(adv, want_adv, atol=1e-6) and torch.allclose(ret, want_ret, atol=1e-6)
    # gamma = lam = 1 is Monte Carlo: A_t = R - V_t on every token
    adv1, ret1 = gae(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(adv1[0, 2:5], torch.tensor([0.5, 0.6, 0.2])) and torch.allclose(ret1[0, 2:5], torch.ones(3))
    # lam = 0 is one-step TD: A_t = delta_t
    adv0, _ = gae(rewards, values, mask, 0.9, 0.0)
    assert torch.allclose(adv0[0, 2:5], torch.tensor([-0.14, 0.32, 0.2]), atol=1e-6)


def test_token_rewards_terminal_and_kl_in_reward_by_hand():
    m = make(beta=0.1, kl_placement="reward")
    batch = Batch(
        loss_mask=torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]),
        rewards=torch.tensor([2.0, 5.0]),
        valid=torch.tensor([True, False]),
        ref_logps=torch.tensor([[0, -1.0, -2.0, -1.0, 0], [0, 0, -1.0, -1.0, -1.0]]),
    )
    old = torch.tensor([[0, -1.5, -1.0, -1.0, 0], [0, 0, -1.0, -1.0, -1.0]])
    r = m.token_rewards(batch, old)
    # row 0: -beta * log(pi_old/pi_ref) = -0.1 * (-0.5, 1.0, 0.0) = (0.05, -0.1, 0), and R = 2 on the last token
    # row 1: its reward failed (valid False), so no terminal reward; pi_old == pi_ref so no KL penalty
    want = torch.tensor([[0, 0.05, -0.1, 2.0, 0], [0, 0, 0, 0, 0]])
    assert torch.allclose(r, want, atol=1e-6)
    assert torch.equal(
        make(beta=0.1).token_rewards(batch, old)[0], torch.tensor([0, 0, 0, 2.0, 0])
    )  # KL in the loss instead


def test_whitening_and_explained_variance_by_hand():
    x = torch.tensor([[9.0, 1.0, 2.0, 3.0], [4.0, 5.0, 9.0, 9.0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    # valid entries 1..5: mean 3, sample std sqrt(2.5) = 1.5811
    w = whiten(x, mask)
    assert torch.allclose(w, torch.tensor([[0, -2, -1, 0], [1, 2, 0, 0]]) / math.sqrt(2.5), atol=1e-6)
    # returns (1, 2, 3), values (1, 2, 2): residuals (0, 0, 1) have var 1/3, returns var 1: EV = 2/3
    ret, val = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1.0, 2.0, 2.0]])
    assert explained_variance(val, ret, torch.ones(1, 3)) == pytest.approx(2 / 3)
    assert math.isnan(explained_variance(val, torch.ones(1, 3), torch.ones(1, 3)))  # constant returns: undefined


def test_clipped_value_loss_by_hand():
    V = torch.tensor([1.5, 0.5, 1.1], requires_grad=True)
    V_old, R = torch.tensor([1.0, 1.0, 1.0]), torch.tensor([2.0, 2.0, 0.0])
    loss, clipped = value_loss_terms(V, V_old, R, clip=0.2)
    # token 0: (1.5-2)^2 = 0.25; clipped V = 1.2: (1.2-2)^2 = 0.64 is larger -> 0.64, and its gradient is 0
    # token 1: (0.5-2)^2 = 2.25; clipped V = 0.8: (0.8-2)^2 = 1.44 -> 2.25, gradient 2*(0.5-2) = -3
    # token 2: inside the band, both terms (1.1-0)^2 = 1.21, gradient 2.2
    assert torch.allclose(loss, torch.tensor([0.64, 2.25, 1.21]), atol=1e-6)
    assert clipped.tolist() == [True, False, False]
    loss.sum().backward()
    assert torch.allclose(V.grad, torch.tensor([0.0, -3.0, 2.2]), atol=1e-6)
    assert torch.equal(value_loss_terms(V, V_old, R, clip=0.0)[0], (V - R) ** 2)  # value_clip = 0: no clip


# ----------------------------------------------------------------------------- exactness


def _random_batch(N=12, L=10, seed=0, with_old=True):
    """Random per-token advantages of both signs and old/ref log-probs far enough from the current
    ones that both sides of the clip trigger; a failed reward; left-padded prompts, right padding."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(L)[None]
    start = torch.randint(1, 4, (N, 1), generator=g)
    end = torch.randint(5, L + 1, (N, 1), generator=g)
    loss_mask = ((pos >= start) & (pos < end)).long()  # [N, L]
    logps = -3 * torch.rand(N, L, generator=g, dtype=torch.float64) * loss_mask  # [N, L]
    valid = torch.ones(N, dtype=torch.bool)
    valid[3] = False
    b = Batch(
        input_ids=torch.zeros(N, L, dtype=torch.long),
        attention_mask=(pos < end).long(),
        loss_mask=loss_mask,
        valid=valid,
        token_advantages=torch.randn(N, L, generator=g, dtype=torch.float64) * loss_mask,
        ref_logps=(logps + 0.8 * torch.randn(N, L, generator=g, dtype=torch.float64)) * loss_mask,
    )
    if with_old:
        b.old_logps = (logps + 0.4 * torch.randn(N, L, generator=g, dtype=torch.float64)) * loss_mask
    return b, logps


def textbook_ppo(batch, logps, eps, beta, norm, Z):
    """J = aggregate_t[min(r A, clip(r, 1-eps, 1+eps) A) - beta * (rho - log rho - 1)], written out independently."""
    r = torch.exp(logps - batch.old_logps)
    A = batch.token_advantages
    surrogate = torch.minimum(r * A, torch.clamp(r, 1 - eps, 1 + eps) * A)
    log_rho = batch.ref_logps - logps
    k3 = torch.exp(log_rho) - log_rho - 1
    mask = batch.loss_mask * batch.valid[:, None]
    w = mask / batch.loss_mask.sum(-1, keepdim=True) if norm == "sequence" else mask
    return ((surrogate - beta * k3) * w).sum() / Z


@pytest.mark.parametrize("norm", [None, "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_gradient_equals_autograd_of_the_textbook_clipped_objective(norm, beta):
    m = make(loss_norm=norm, beta=beta, epsilon=0.2, mu=2)
    batch, logps = _random_batch()
    r = torch.exp(logps - batch.old_logps)
    A, mask = batch.token_advantages, engine.effective_mask(batch).bool()
    assert (m.clipped(r, A) & mask & (A > 0)).any() and (m.clipped(r, A) & mask & (A < 0)).any()  # both clip sides
    Z = engine.normaliser(split_batch(batch, 5), m.norm)  # the step's Z over micro-batches of 5
    lp = logps.clone().requires_grad_(True)
    (-textbook_ppo(batch, lp, 0.2, beta, m.norm, Z)).backward()
    want = lp.grad
    lp = logps.clone().requires_grad_(True)
    assert torch.allclose(m.objective(batch, lp, Z), textbook_ppo(batch, lp, 0.2, beta, m.norm, Z))
    engine.weighted_loss(m.coefficient(batch, lp.detach()), lp, batch, m.norm, Z).backward()
    assert torch.allclose(lp.grad, want, atol=1e-12, rtol=1e-9) and want.abs().sum() > 0


def test_one_pass_has_ratio_one_and_kl_in_reward_has_no_loss_term():
    batch, logps = _random_batch(with_old=False)
    # mu = 1: pi_old is the detached current policy, GC = A_t + beta * (rho - 1) exactly
    m = make(beta=0.05)
    rho = torch.exp(batch.ref_logps - logps)
    assert torch.allclose(m.coefficient(batch, logps), (batch.token_advantages + 0.05 * (rho - 1)) * batch.loss_mask)
    # kl_in_reward: the KL went into the rewards, so GC = A_t alone
    m = make(beta=0.05, kl_placement="reward")
    assert torch.allclose(m.coefficient(batch, logps), batch.token_advantages * batch.loss_mask)


# ----------------------------------------------------------------------------- the critic on a tiny model


@pytest.fixture(scope="module")
def tiny_trainer(tmp_path_factory):
    cfg = Config(
        method="ppo",
        model="tiny",
        task="arithmetic",
        output_dir=str(tmp_path_factory.mktemp("ppo")),
        beta=0.0,
        device="cpu",
        gamma=1.0,
        lam=1.0,
        critic_lr=3e-3,
        **{**FAST, "micro_batch_size": 3},
    )
    return Trainer(cfg)


def test_prepare_at_the_start(tiny_trainer):
    """Zero value head: V = 0, so with gamma = lam = 1 every token's return is the sequence reward."""
    m = tiny_trainer.method
    assert m.ref is None  # beta = 0: no reference model at all
    batch, _ = m.prepare(m.data(0)[0])
    assert batch.old_logps is None and batch.ref_logps is None  # one pass: ratio 1, no pi_old forward
    mask = batch.loss_mask.bool()
    assert (batch.values == 0).all()
    R = torch.where(batch.valid, batch.rewards, 0.0)[:, None].expand_as(mask)
    assert torch.allclose(batch.returns[mask], R[mask])
    valid = engine.effective_mask(batch).bool()
    a = batch.token_advantages[valid]
    if a.std() > 0:
        assert a.mean().abs() < 1e-5 and (a.std() - 1).abs() < 1e-4  # whitened


def test_critic_step_is_one_per_optimizer_step_and_independent_of_micro_batching(tiny_trainer):
    m = tiny_trainer.method
    batch, _ = m.prepare(m.data(1)[0])
    batch.returns = torch.rand(batch.returns.shape, generator=torch.Generator().manual_seed(0)) * batch.loss_mask
    seen = []
    handle = m.critic_optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append([p.grad.clone() for p in m.critic.parameters()])
    )
    state = copy.deepcopy(m.state_dict())
    try:
        for size in (3, 8):
            m.load_state_dict(state)
            for mb in split_batch(batch, size):
                m.auxiliary_step(mb)
            out = m.auxiliary_step_end()
    finally:
        handle.remove()
        m.load_state_dict(state)
    assert len(seen) == 2  # one critic step for each grouping, whatever the number of micro-batches
    for a, b in zip(*seen):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)
    assert out["ppo/critic_param_mb"] > 0 and out["ppo/critic_optimizer_mb"] == pytest.approx(
        2 * out["ppo/critic_param_mb"], rel=1e-3
    )  # Adam: m and v


def test_value_loss_falls_on_fixed_returns(tiny_trainer):
    m = tiny_trainer.method
    state = copy.deepcopy(m.state_dict())
    batch, _ = m.prepare(m.data(2)[0])
    g = torch.Generator().manual_seed(1)
    batch.returns = (torch.randn(batch.returns.shape[0], 1, generator=g) * batch.loss_mask).float()  # fixed targets
    losses = []
    for _ in range(40):
        batch.values = m.critic_values(batch) * batch.loss_mask  # V_old of each new "rollout"
        stats = [m.auxiliary_step(mb) for mb in split_batch(batch, 3)]
        m.auxiliary_step_end()
        losses.append(sum(s["ppo/value_loss"] for s in stats) / len(stats))
    m.load_state_dict(state)
    assert losses[-1] < 0.25 * losses[0], losses[::8]  # measured: 0.54 -> 0.05 in 40 steps


def test_model_gradient_equals_autograd_through_the_tiny_model(tiny_trainer):
    """The identity on a real rollout and the policy's parameters, with pi_old != pi (clipping active)."""
    tr = tiny_trainer
    m = tr.method
    batch, _ = m.prepare(m.data(0)[0])
    g = torch.Generator().manual_seed(2)
    batch.old_logps = (
        tr.services.logprobs(tr.policy, batch, 1.0)
        + 0.3 * torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
    )
    batch.token_advantages = torch.randn(batch.loss_mask.shape, generator=g) * engine.effective_mask(batch)
    from conftest import assert_engine_grad_matches_objective

    assert_engine_grad_matches_objective(tr, batch, micro=3)


# ----------------------------------------------------------------------------- runs


def test_exact_resume_restores_the_critic(tmp_path):
    """2 steps, then 1 more from the checkpoint == 3 steps straight: the critic and its Adam state are in it."""

    def cfg(out, steps):
        return Config(
            method="ppo",
            model="tiny",
            task="arithmetic",
            output_dir=str(out),
            max_steps=steps,
            lr=1e-3,
            critic_lr=1e-3,
            mu=2,
            device="cpu",
            **FAST,
        )

    straight = Trainer(cfg(tmp_path / "a", 3))
    straight.run()
    Trainer(cfg(tmp_path / "b", 2)).run()
    resumed = Trainer(cfg(tmp_path / "b", 3), resume="latest")
    resumed.run()
    for p, q in zip(straight.method.critic.parameters(), resumed.method.critic.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    a = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[-1])
    b = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("loss", "ppo/value_loss", "reward/mean", "gc/mean"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-9), key


def _run_cli(tmp_path, *args):
    return CliRunner().invoke(
        main,
        [
            "run",
            "--method",
            "ppo",
            "--model",
            "tiny",
            "--task",
            "arithmetic",
            "--max-steps",
            "2",
            "--output-dir",
            str(tmp_path / "run"),
            *args,
            *[f"--set={k}={v}" for k, v in FAST.items()],
        ],
    )


PPO_METRICS = [
    "loss",
    "grad_norm",
    "reward/mean",
    "ppo/clip_frac",
    "ppo/value_loss",
    "ppo/vf_clip_frac",
    "ppo/explained_variance",
    "ppo/critic_memory_mb",
    "ppo/critic_param_mb",
    "ppo/critic_optimizer_mb",
    "ppo/kl",
    "gc/mean",
    "entropy",
]


@pytest.mark.parametrize(
    "extra", [[], ["--set=mu=2", "--set=num_minibatches=2", "--set=kl_placement=reward", "--set=gamma=0.99"]]
)
def test_cli_two_steps_log_the_metrics(tmp_path, extra):
    res = _run_cli(tmp_path, *extra)
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert not [k for k in PPO_METRICS if k not in r], r
    assert rows[-1]["ppo/critic_optimizer_mb"] > 0
    assert (tmp_path / "run" / "model.safetensors").is_file()  # the policy is the run's output; the critic is dropped


def test_smaller_critic_and_bad_settings(tmp_path):
    tok = tiny_tokenizer()
    small = tiny_model(len(tok), hidden=32, layers=1)
    small.save_pretrained(tmp_path / "small")
    tok.save_pretrained(tmp_path / "small")
    res = _run_cli(tmp_path, f"--set=critic_model={tmp_path / 'small'}")
    assert res.exit_code == 0, res.output
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["ppo/critic_param_mb"] < 0.2  # hidden 32, one layer, vs 0.31 MB for the policy's backbone
    res = _run_cli(tmp_path, "--overwrite", "--set=lam=1.5")
    assert res.exit_code == 2 and "lam must be in [0, 1]" in res.output and "Traceback" not in res.output


def test_registered():
    assert get_method("ppo") is PPO and "critic" in PPO.gc_formula + PPO.data_source
