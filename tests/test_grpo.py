"""GRPO and its variants: hand-worked coefficients, exactness against autograd, the pipeline, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from gcfamily.cli import main
from gcfamily.config import Config
from gcfamily.core import engine
from gcfamily.core.batch import TOKEN, Batch, concat
from gcfamily.data.batches import split_batch
from gcfamily.methods import get_method
from gcfamily.methods.grpo import GRPO
from gcfamily.methods.grpo_variants import DAPO, RLOO, DrGRPO
from gcfamily.run.trainer import Trainer

VARIANTS = [GRPO, RLOO, DrGRPO, DAPO]
FAST = {"batch_size": 2, "group_size": 4, "max_new_tokens": 8, "micro_batch_size": 8, "progress": False}


def make(cls, **settings):
    cfg = Config(method=cls.name, **settings)
    cls.validate(cfg)
    return cls(cfg)


# ----------------------------------------------------------------------------- hand-worked


def _two_row_batch(log_ratio: list[float], ref_log_rho: list[float]) -> Batch:
    """G = 2 samples of one prompt, each a 1-token prompt and 3 completion tokens."""
    logps = torch.tensor([[0.0, -1.0, -2.0, -0.5]] * 2)  # [2, 4]
    lr = torch.tensor([0.0, *log_ratio])
    return Batch(
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        attention_mask=torch.ones(2, 4, dtype=torch.long),
        loss_mask=torch.tensor([[0, 1, 1, 1]] * 2),
        rewards=torch.tensor([1.0, 0.0]),
        valid=torch.tensor([True, True]),
        old_logps=logps - lr,
        ref_logps=logps + torch.tensor([0.0, *ref_log_rho]),
    ).put("logps", logps, TOKEN)


def test_grpo_coefficient_by_hand():
    m = make(GRPO, group_size=2, std="population", epsilon=0.2, beta=0.1)
    b, _ = m.add_advantages(_two_row_batch([0.0, math.log(1.5), math.log(0.5)], [0.0, math.log(2.0), -math.log(2.0)]))
    # rewards (1, 0): mean 0.5, population std 0.5, so A = (+1, -1)
    assert b.advantages.tolist() == [1.0, -1.0]
    coef = m.coefficient(b, b.own["logps"])
    # ratios (1, 1.5, 0.5) on both rows; eps = 0.2.
    # row A=+1: r=1 -> 1; r=1.5 > 1.2 is clipped -> 0; r=0.5 (A>0, below the band, not clipped) -> 0.5
    # row A=-1: r=1 -> -1; r=1.5 (A<0, above the band, not clipped) -> -1.5; r=0.5 < 0.8 is clipped -> 0
    # KL: rho = (1, 2, 0.5), beta (rho - 1) = (0, +0.1, -0.05) on both rows
    want = torch.tensor([[0.0, 1.0, 0.1, 0.45], [0.0, -1.0, -1.4, -0.05]])
    assert torch.allclose(coef, want, atol=1e-6)


def test_dapo_clip_higher_by_hand():
    # ratio 1.25 with A = +1: GRPO clips it (1.25 > 1 + 0.2), DAPO does not (1.25 < 1 + 0.28)
    b = _two_row_batch([math.log(1.25), 0.0, 0.0], [0.0, 0.0, 0.0])
    for cls, want in [(GRPO, 0.0), (DAPO, 1.25)]:
        m = make(cls, group_size=2, std="population", beta=0.0)
        coef = m.coefficient(m.add_advantages(b.copy())[0], b.own["logps"])
        assert coef[0, 1].item() == pytest.approx(want)
    assert make(DAPO).norm == "token" and make(DAPO, epsilon_high=0.3).clip_range() == (0.2, 0.3)


def test_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.1], [1.0, 0.0, 7.0, 1.0]])
    valid = torch.tensor([[True] * 4, [True] * 4, [True, True, False, True]])  # the 7.0 is a failed reward
    s3 = math.sqrt(3) / 2
    # group 1: mean 0.5, sample std sqrt(1/3): A = +-0.5 / 0.577 = +-0.866. Group 2: all equal -> 0,
    # even though 0.1 is not exact in binary (a naive std would be ~1e-17 and A = +-1).
    # group 3 (3 valid): mean 2/3, sample std sqrt(1/3): A = (1/3, -2/3, 1/3) / 0.577
    grpo = make(GRPO).group_advantages(rewards, valid)
    want = torch.tensor(
        [[s3, -s3, -s3, s3], [0, 0, 0, 0], [1 / 3 / 0.5773503, -2 / 3 / 0.5773503, 0, 1 / 3 / 0.5773503]]
    )
    assert torch.allclose(grpo, want, atol=1e-5)
    assert torch.allclose(
        make(GRPO, std="population").group_advantages(rewards[:1], valid[:1]), torch.tensor([[1.0, -1, -1, 1]])
    )
    # RLOO: 1 - (0 + 0 + 1)/3 = 2/3, 0 - (1 + 0 + 1)/3 = -2/3; group 3: 1 - (0 + 1)/2 = 0.5, 0 - (1 + 1)/2 = -1
    rloo = make(RLOO).group_advantages(rewards, valid)
    assert torch.allclose(
        rloo, torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0, 0, 0, 0], [0.5, -1, 0, 0.5]]), atol=1e-6
    )
    # Dr. GRPO: R - mean, no std: +-0.5; group 3: 1/3, -2/3
    dr = make(DrGRPO).group_advantages(rewards, valid)
    assert torch.allclose(dr[0], torch.tensor([0.5, -0.5, -0.5, 0.5])) and torch.allclose(
        dr[2], torch.tensor([1 / 3, -2 / 3, 0, 1 / 3])
    )


@pytest.mark.parametrize("cls", VARIANTS)
@pytest.mark.parametrize("zero_std", ["keep", "exclude"])
def test_zero_std_groups_get_zero_advantage_and_are_counted(cls, zero_std):
    m = make(cls, group_size=2, zero_std=zero_std)
    b = _two_row_batch([0.0] * 3, [0.0] * 3)
    b = concat([b, b])  # two groups
    b.rewards = torch.tensor([1.0, 0.0, 0.3, 0.3])  # group 2 has std 0
    b, stats = m.add_advantages(b)
    assert b.advantages[2:].tolist() == [0.0, 0.0] and stats["grpo/zero_std_frac"] == 0.5
    assert b.valid.tolist() == ([True] * 4 if zero_std == "keep" else [True, True, False, False])
    assert engine.normaliser([b], "token") == (12.0 if zero_std == "keep" else 6.0)


def test_dr_grpo_and_dapo_defaults():
    cfg = Config(method="dr-grpo", max_new_tokens=48)
    DrGRPO.apply_setting_defaults(cfg)
    assert cfg.norm_constant == 48.0 and DrGRPO(cfg).norm == "constant"  # filled before the settings are saved
    cfg = Config(method="dr-grpo", max_new_tokens=48, norm_constant=100.0, explicit=["norm_constant"])
    DrGRPO.apply_setting_defaults(cfg)
    assert cfg.norm_constant == 100.0  # a value the user set is kept, even one equal to the shared default
    assert make(DAPO).clip_range() == (0.2, 0.28) and make(GRPO).clip_range() == (0.2, 0.2)


# ----------------------------------------------------------------------------- exactness


def _random_batch(n_groups=4, G=4, L=12, seed=0, with_old=True):
    """Random rollouts: a mixed group, a zero-std group, negative and positive advantages, a failed
    reward, and old/ref log-probs far enough from the current ones that both clip sides trigger."""
    g = torch.Generator().manual_seed(seed)
    N = n_groups * G
    start = torch.randint(1, 4, (N, 1), generator=g)
    end = torch.randint(6, L + 1, (N, 1), generator=g)
    pos = torch.arange(L)[None]
    loss_mask = ((pos >= start) & (pos < end)).long()  # [N, L]
    rewards = torch.randn(N, generator=g)
    rewards[G : 2 * G] = 0.5  # a zero-std group
    rewards[:G] = torch.tensor([1.0, 0.0, 0.0, 1.0])[:G]
    valid = torch.ones(N, dtype=torch.bool)
    valid[2 * G + 1] = False  # a failed reward
    logps = -3 * torch.rand(N, L, generator=g) * loss_mask  # [N, L]
    b = Batch(
        input_ids=torch.zeros(N, L, dtype=torch.long),
        attention_mask=(pos < end).long(),
        loss_mask=loss_mask,
        rewards=rewards,
        valid=valid,
        ref_logps=(logps + 0.8 * torch.randn(N, L, generator=g)) * loss_mask,
    )
    if with_old:
        b.old_logps = (logps + 0.4 * torch.randn(N, L, generator=g)) * loss_mask
    return b, logps


def _grads(m, batch, logps):
    Z = engine.normaliser(split_batch(batch, 5), m.norm, m.cfg.norm_constant)  # Z of the whole step
    lp = logps.clone().requires_grad_(True)
    (-m.objective(batch, lp, Z)).backward()  # autograd of the textbook objective
    want = lp.grad
    lp = logps.clone().requires_grad_(True)
    engine.weighted_loss(m.coefficient(batch, lp.detach()), lp, batch, m.norm, Z).backward()  # the engine
    return want, lp.grad


@pytest.mark.parametrize("cls", VARIANTS)
@pytest.mark.parametrize("norm", [None, "token", "sequence", "constant", "sum"])
@pytest.mark.parametrize("zero_std", ["keep", "exclude"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_engine_gradient_equals_autograd_of_objective(cls, norm, zero_std, beta):
    """mu > 1: pi_old != pi, so tokens are clipped on both sides; negative advantages; zero-std groups."""
    m = make(cls, loss_norm=norm, zero_std=zero_std, beta=beta, group_size=4, norm_constant=16.0)
    batch, logps = _random_batch()
    batch, _ = m.add_advantages(batch)
    ratio, adv = torch.exp(logps - batch.old_logps), batch.advantages[:, None].expand_as(logps)
    mask = engine.effective_mask(batch).bool()
    assert (m.clipped(ratio, adv) & mask & (adv > 0)).any() and (m.clipped(ratio, adv) & mask & (adv < 0)).any()
    assert (adv[mask] < 0).any() and (batch.advantages[4:8] == 0).all()
    want, got = _grads(m, batch, logps)
    assert torch.allclose(got, want, atol=1e-7, rtol=1e-5)
    assert want.abs().sum() > 0


@pytest.mark.parametrize("cls", VARIANTS)
def test_one_pass_uses_ratio_one(cls):
    """mu = 1: no old_logps; pi_old is the detached current policy, so r = 1 and nothing is clipped."""
    m = make(cls, beta=0.04, group_size=4)
    batch, logps = _random_batch(with_old=False)
    batch, _ = m.add_advantages(batch)
    want, got = _grads(m, batch, logps)
    assert torch.allclose(got, want, atol=1e-7, rtol=1e-5)
    # with rho = pi_ref/pi: GC = A + beta (rho - 1) exactly
    rho = torch.exp((batch.ref_logps - logps).clamp(-20, 20))
    gc = (batch.advantages[:, None] + 0.04 * (rho - 1)) * batch.loss_mask
    assert torch.allclose(m.coefficient(batch, logps), gc, atol=1e-6)


def test_kl_clamp_is_in_objective_and_coefficient():
    m = make(GRPO, beta=0.5, group_size=4)
    batch, logps = _random_batch(with_old=False)
    batch.ref_logps[0, 4] = logps[0, 4] + 30.0  # positions 4 and 5 are completion tokens in every row
    batch.ref_logps[1, 5] = logps[1, 5] - 30.0
    want, got = _grads(m, m.add_advantages(batch)[0], logps)
    assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-7, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_trainer(tmp_path_factory):
    cfg = Config(
        method="grpo",
        model="tiny",
        task="arithmetic",
        output_dir=str(tmp_path_factory.mktemp("t")),
        mu=2,
        **{**FAST, "micro_batch_size": 3},
    )
    return Trainer(cfg)


def test_model_gradient_equals_autograd_through_the_tiny_model(tiny_trainer):
    """The same identity on a real rollout and the model's parameters, micro-batched by 3."""
    tr = tiny_trainer
    m = tr.method
    batch, _ = m.prepare(m.data(0)[0])
    g = torch.Generator().manual_seed(1)
    batch.old_logps = batch.old_logps + 0.3 * torch.randn(batch.old_logps.shape, generator=g) * batch.loss_mask
    batch.ref_logps = batch.ref_logps + 0.3 * torch.randn(batch.ref_logps.shape, generator=g) * batch.loss_mask
    if not (batch.advantages != 0).any():
        batch.rewards = torch.arange(8.0) % 3  # the random model rarely scores: make the groups differ
        batch, _ = m.add_advantages(batch)
    from conftest import assert_engine_grad_matches_objective

    assert_engine_grad_matches_objective(tr, batch, micro=3)


# ----------------------------------------------------------------------------- the pipeline


def test_prepare_computes_only_what_is_needed(tiny_trainer, tmp_path):
    tr = tiny_trainer
    batch, _ = tr.method.prepare(tr.method.data(0)[0])
    m = batch.loss_mask.bool()
    # mu = 2: pi_old comes from a forward pass, which agrees with the sampler's log-probs
    assert (batch.old_logps[m] - batch.sample_logps[m]).abs().max() < 1e-4
    assert torch.allclose(batch.ref_logps, batch.old_logps, atol=1e-5)  # before any step, ref == policy
    one = Trainer(Config(method="grpo", model="tiny", task="arithmetic", output_dir=str(tmp_path), beta=0.0, **FAST))
    assert one.method.ref is None  # no reference model at all when beta = 0
    b, _ = one.method.prepare(one.method.data(0)[0])
    assert b.old_logps is None and b.ref_logps is None


def test_reference_refresh_and_exact_resume(tmp_path):
    """ref_refresh_every = 2: the reference copied after step 2 is in the checkpoint, so 2 + 1 steps == 3 steps."""

    def cfg(out, steps):
        return Config(
            method="grpo",
            model="tiny",
            task="arithmetic",
            output_dir=str(out),
            max_steps=steps,
            ref_refresh_every=2,
            lr=1e-3,
            **FAST,
        )

    straight = Trainer(cfg(tmp_path / "a", 3))
    straight.run()
    assert straight.method.ref_refreshes == 1
    Trainer(cfg(tmp_path / "b", 2)).run()
    resumed = Trainer(cfg(tmp_path / "b", 3), resume="latest")
    assert resumed.method.ref_refreshes == 1
    for k, v in resumed.method.ref.state_dict().items():
        assert torch.equal(v, straight.method.ref.state_dict()[k])
    resumed.run()
    a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()][-1]
    b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()][-1]
    for key in ("loss", "grpo/kl", "reward/mean", "gc/mean", "completion/length_mean"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-9), key
    for p, q in zip(straight.policy.parameters(), resumed.policy.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


FLAKY = """
calls = 0
def flaky(prompts, completions, **columns):
    global calls
    if len(completions) > 1:
        raise RuntimeError("batch call refused")  # score() then retries one sample at a time
    calls += 1
    if calls % 5 == 0:
        raise ValueError("every fifth sample fails")
    return [float(len(completions[0]) % 2)]

def broken(prompts, completions, **columns):
    raise ValueError("always")
"""


def test_raising_reward_masks_the_sample_and_is_counted(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(FLAKY)
    tr = Trainer(
        Config(
            method="grpo",
            model="tiny",
            task="arithmetic",
            output_dir=str(tmp_path / "run"),
            reward=f"{path}:flaky",
            **FAST,
        )
    )
    batch, stats = tr.method.data(0)
    batch, more = tr.method.prepare(batch)
    stats = {**stats, **more}
    failed = ~batch.valid
    assert failed.tolist() == [i % 5 == 4 for i in range(8)]  # the 5th sample of 8
    assert stats["reward/failed"] == 1.0
    assert (batch.advantages[failed] == 0).all()
    assert engine.effective_mask(batch)[failed].sum() == 0  # no gradient, not in Z
    assert engine.normaliser([batch], "sequence") == 7.0


def _run_cli(args):
    return CliRunner().invoke(
        main,
        [
            "run",
            "--model",
            "tiny",
            "--task",
            "arithmetic",
            "--max-steps",
            "2",
            *args,
            *[f"--set={k}={v}" for k, v in FAST.items()],
        ],
    )


def test_reward_failing_everywhere_is_one_clear_error(tmp_path):
    (tmp_path / "my_rewards.py").write_text(FLAKY)
    res = _run_cli(
        ["--method", "grpo", "--output-dir", str(tmp_path / "run"), "--reward", f"{tmp_path / 'my_rewards.py'}:broken"]
    )
    assert res.exit_code == 2 and "reward function 'broken' failed on all 8 samples" in res.output
    assert "Traceback" not in res.output


GRPO_METRICS = [
    "reward/mean",
    "reward/std",
    "reward/failed",
    "grpo/zero_std_frac",
    "grpo/clip_frac",
    "grpo/kl",
    "completion/length_mean",
    "completion/truncated_frac",
    "entropy",
    "gc/mean",
    "gc/std",
    "gc/abs_mean",
    "gc/zero_frac",
    "loss",
    "grad_norm",
]


@pytest.mark.parametrize("name", ["grpo", "rloo", "dr-grpo", "dapo"])
def test_cli_two_steps_log_the_metrics(tmp_path, name):
    (tmp_path / "my_rewards.py").write_text(FLAKY)
    res = _run_cli(
        ["--method", name, "--output-dir", str(tmp_path / "run"), "--reward", f"{tmp_path / 'my_rewards.py'}:flaky"]
    )
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        missing = [k for k in GRPO_METRICS if r.get(k) is None]
        assert not missing, missing
        assert r["reward/failed"] >= 1  # the flaky reward fails every fifth sample, counted each step
    saved = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert saved["method"] == name and (saved["norm_constant"] == 8.0) == (name == "dr-grpo")


def test_methods_are_registered():
    for name, cls in [("grpo", GRPO), ("rloo", RLOO), ("dr-grpo", DrGRPO), ("dapo", DAPO)]:
        assert get_method(name) is cls and cls.name == name
    assert Path(__file__).parent.parent.joinpath("docs", "adding-a-method.md").is_file()


SEVENS = """
def sevens(prompts, completions, **columns):
    return [c.count("7") / max(len(c), 1) for c in completions]
"""


@pytest.mark.slow
def test_grpo_learns_a_simple_reward(tmp_path):
    """End to end, signs included: the fraction of '7's the tiny model writes rises from ~1%."""
    (tmp_path / "r.py").write_text(SEVENS)
    cfg = Config(
        method="grpo",
        model="tiny",
        task="arithmetic",
        output_dir=str(tmp_path / "run"),
        reward=f"{tmp_path / 'r.py'}:sevens",
        max_steps=12,
        lr=5e-3,
        beta=0.0,
        **{**FAST, "batch_size": 4, "group_size": 8, "micro_batch_size": 32},
    )
    Trainer(cfg).run()
    rewards = [json.loads(x)["reward/mean"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rewards[0] < 0.05 and sum(rewards[-2:]) / 2 > 0.2, rewards


def test_a_mixed_reference_is_alpha_policy_plus_the_rest_of_the_old_reference(tmp_path):
    """ref_mixup_alpha (TRL's ref_model_mixup_alpha): at a refresh step, every parameter of pi_ref becomes alpha * the
    policy's + (1 - alpha) * its own, worked here from the two models' parameters (the policy moved by hand first: a
    tiny random model's first GRPO steps have all-equal rewards and do not move it)."""
    tr = Trainer(
        Config(
            method="grpo",
            model="tiny",
            task="arithmetic",
            output_dir=str(tmp_path),
            ref_refresh_every=2,
            ref_mixup_alpha=0.25,
            **FAST,
        )
    )
    before = {k: v.detach().clone() for k, v in tr.method.ref.named_parameters()}
    with torch.no_grad():
        for p in tr.policy.parameters():
            p.add_(torch.randn_like(p))
    assert tr.method.after_step(1) == {"grpo/ref_refreshes": 0.0}  # not a refresh step: nothing moves
    assert all(torch.equal(v, before[k]) for k, v in tr.method.ref.named_parameters())
    assert tr.method.after_step(2) == {"grpo/ref_refreshes": 1.0}
    policy = dict(tr.policy.named_parameters())
    for k, v in tr.method.ref.named_parameters():
        assert torch.allclose(v, 0.25 * policy[k].detach() + 0.75 * before[k], atol=1e-6, rtol=0), k
        assert not torch.equal(v, before[k]) and not torch.equal(v, policy[k]), k
