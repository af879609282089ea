"""GSPO, REINFORCE with a running baseline, online DPO, KTO and ORPO: hand-worked coefficients, the engine's
gradient against autograd of each method's objective and of a textbook loss written here from the papers,
two Trainer steps each on the tiny model, and an exact resume of the stateful baseline."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_engine_grad_matches_objective, metrics_rows

from gcfamily.config import Config
from gcfamily.core import engine
from gcfamily.core.batch import TOKEN, Batch, select
from gcfamily.errors import GcfError
from gcfamily.methods.grpo import GRPO
from gcfamily.methods.gspo import GSPO
from gcfamily.methods.kto import KTO
from gcfamily.methods.online_dpo import OnlineDPO
from gcfamily.methods.orpo import ORPO
from gcfamily.methods.reinforce import ReinforceBaseline
from gcfamily.run.trainer import Trainer

FAST = {"batch_size": 2, "group_size": 4, "max_new_tokens": 8, "micro_batch_size": 8, "progress": False}
L3 = math.log(3)


def spec(cls) -> str:
    return f"{cls.__module__}:{cls.__name__}"


def make(cls, **settings):
    cfg = Config(method=spec(cls), **settings)
    cls.validate(cfg)
    return cls(cfg)


def grads(m, batch, logps, micro: int = 4):
    """(autograd of -objective on the whole batch, the engine's gradient summed over micro-batches), one Z."""
    mbs = [slice(s, s + micro) for s in range(0, len(logps), micro)]
    Z = engine.normaliser([select(batch, s) for s in mbs], m.norm, m.cfg.norm_constant)
    lp = logps.detach().clone().requires_grad_(True)
    (-m.objective(batch, lp, Z)).backward()
    want = lp.grad
    lp = logps.detach().clone().requires_grad_(True)
    for s in mbs:
        mb = select(batch, s)
        engine.weighted_loss(m.coefficient(mb, lp[s].detach()), lp[s], mb, m.norm, Z).backward()
    return want, lp.grad, Z


def textbook_grad(loss_fn, logps):
    lp = logps.detach().clone().requires_grad_(True)
    loss_fn(lp).backward()
    return lp.grad


def rollout_batch(G=4, n=4, L=12, seed=0, old_noise=0.4):
    """n groups of G random rollouts: group 1 has equal rewards, one reward failed; old/ref log-probs nearby."""
    g = torch.Generator().manual_seed(seed)
    N = n * G
    pos = torch.arange(L)[None]
    start, end = torch.randint(1, 4, (N, 1), generator=g), torch.randint(6, L + 1, (N, 1), generator=g)
    loss_mask = ((pos >= start) & (pos < end)).long()  # [N, L]
    rewards = torch.randn(N, generator=g)
    rewards[G : 2 * G] = 0.5  # an equal-reward group
    valid = torch.ones(N, dtype=torch.bool)
    valid[2 * G + 1] = False  # a failed reward
    logps = -3 * torch.rand(N, L, generator=g) * loss_mask  # [N, L]
    batch = Batch(
        input_ids=torch.zeros(N, L, dtype=torch.long),
        attention_mask=(pos < end).long(),
        loss_mask=loss_mask,
        rewards=rewards,
        valid=valid,
        ref_logps=(logps + 0.5 * torch.randn(N, L, generator=g)) * loss_mask,
        old_logps=(logps + old_noise * torch.randn(N, L, generator=g)) * loss_mask,
    )
    return batch, logps


def pair_batch(P=6, L=12, seed=0):
    """P random pairs (rows 2i, 2i+1), example weight 1/2, completions of different lengths."""
    g = torch.Generator().manual_seed(seed)
    B, pos = 2 * P, torch.arange(L)[None]
    prompt = torch.randint(1, 4, (P,), generator=g).repeat_interleave(2)[:, None]
    end = prompt + torch.randint(1, L - 4, (B, 1), generator=g)
    loss_mask = ((pos >= prompt) & (pos < end)).long()  # [B, L]
    ref = -3 * torch.rand(B, L, generator=g, dtype=torch.float64) * loss_mask
    logps = (ref + torch.randn(B, L, generator=g, dtype=torch.float64)).clamp(max=-0.05) * loss_mask
    return Batch(
        input_ids=torch.zeros(B, L, dtype=torch.long),
        attention_mask=(pos < end).long(),
        loss_mask=loss_mask,
        ref_logps=ref,
        example_weight=torch.full((B,), 0.5),
    ), logps


def two_steps(tmp_path, cls, **extra):
    cfg = Config(
        method=spec(cls),
        model="tiny",
        task="arithmetic",
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        **{**FAST, **extra},
    )
    Trainer(cfg).run()
    return metrics_rows(tmp_path / "run")


REWARD = "def varied(prompts, completions, **columns):\n    return [float(sum(map(ord, c)) % 7) for c in completions]\n"


@pytest.fixture
def reward(tmp_path):
    (tmp_path / "varied_reward.py").write_text(REWARD)
    return f"{tmp_path / 'varied_reward.py'}:varied"


# ============================================================================= GSPO


def test_gspo_coefficient_by_hand():
    m = make(GSPO, group_size=2, std="population", epsilon=0.2, epsilon_high=0.2)
    lr = torch.tensor(
        [
            [math.log(2), 0.0],
            [math.log(0.9), math.log(0.9)],
            [math.log(0.5), math.log(0.125)],
            [math.log(2), -math.log(2)],
        ]
    )
    logps = torch.full((4, 3), -1.0)
    b = Batch(
        input_ids=torch.zeros(4, 3, dtype=torch.long),
        attention_mask=torch.ones(4, 3, dtype=torch.long),
        loss_mask=torch.tensor([[0, 1, 1]] * 4),
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        valid=torch.ones(4, dtype=torch.bool),
        old_logps=logps - torch.cat([torch.zeros(4, 1), lr], 1),
    )
    b, _ = m.add_advantages(b)
    assert b.advantages.tolist() == [1.0, -1.0, -1.0, 1.0]  # each group (1, 0): mean 1/2, population std 1/2
    # row 0, A=+1: s = exp((ln2 + 0)/2) = 1.414 > 1.2: clipped high -> 0 on both tokens
    # row 1, A=-1: s = exp(ln 0.9) = 0.9 in [0.8, 1.2] -> s A = -0.9 on both tokens
    # row 2, A=-1: s = exp((ln 0.5 + ln 0.125)/2) = 0.25 < 0.8: clipped low -> 0
    # row 3, A=+1: token ratios 2 and 1/2 but s = 1 -> 1 on both (GRPO's token ratio would clip the first token)
    want = torch.tensor([[0, 0, 0], [0, -0.9, -0.9], [0, 0, 0], [0, 1.0, 1.0]])
    assert torch.allclose(m.coefficient(b, logps), want, atol=1e-6)
    grpo = make(GRPO, group_size=2, std="population", epsilon=0.2, beta=0.0)
    assert (
        grpo.coefficient(grpo.add_advantages(b.copy())[0], logps)[3, 1] == 0
    )  # the contrast: token 1 of row 3 clipped
    assert make(GSPO).clip_range() == (3e-4, 4e-4) and make(GSPO).settings.beta == 0.0  # the paper's section 5.1


def gspo_textbook(batch, logps, beta, lo, hi, Z, norm):
    """GSPO's eq. 5 from the paper (A_i given), minus beta * the k3 KL, aggregated as loss_norm says; to minimise."""
    mask, valid = batch.loss_mask.double(), batch.valid.double()
    n = mask.sum(-1)
    s = torch.exp(((logps - batch.old_logps) * mask).sum(-1) / n)  # [B]
    A = batch.advantages.double()
    seq = torch.minimum(s * A, torch.clamp(s, 1 - lo, 1 + hi) * A)  # [B]
    rho = torch.exp(batch.ref_logps - logps)
    k3 = ((rho - torch.log(rho) - 1) * mask).sum(-1)  # [B]
    per_row_weight = valid if norm == "sequence" else valid * n  # sum_t w_t of row i
    kl_weight = valid / n if norm == "sequence" else valid
    return -((seq * per_row_weight).sum() - beta * (k3 * kl_weight).sum()) / Z


@pytest.mark.parametrize("norm", ["sequence", "token"])
def test_gspo_engine_gradient_equals_autograd(norm):
    """At the paper's clip range: sequences clipped low, clipped high and unclipped all occur."""
    m = make(GSPO, loss_norm=norm, beta=0.04, group_size=4, mu=2)
    batch, logps = rollout_batch(old_noise=0.02)
    batch, _ = m.add_advantages(batch)
    s, _ = m.importance_ratio(batch, logps)
    s, A, ok = s[:, 0], batch.advantages, batch.valid
    low, high = ok & (A < 0) & (s < 1 - 3e-4), ok & (A > 0) & (s > 1 + 4e-4)
    free = ok & (A != 0) & ~low & ~high
    assert low.any() and high.any() and free.any(), (low, high, free)
    want, got, Z = grads(m, batch, logps)
    assert torch.allclose(got, want, atol=1e-7, rtol=1e-5) and want.abs().sum() > 0
    paper = textbook_grad(lambda lp: gspo_textbook(batch, lp.double(), 0.04, 3e-4, 4e-4, Z, norm), logps)
    assert torch.allclose(got, paper.float(), atol=1e-6, rtol=1e-4)
    assert (got[low | high] * batch.loss_mask[low | high] != 0).sum() > 0  # the KL term still reaches clipped rows
    metrics = m.metrics(batch, logps, got)
    assert metrics["gspo/seq_clip_frac"] == pytest.approx(float((low | high).sum()) / float(ok.sum()))


def test_gspo_two_steps(tmp_path, reward):
    rows = two_steps(tmp_path, GSPO, reward=reward, num_minibatches=2)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("gspo/seq_clip_frac" in r and math.isfinite(r["loss"]) for r in rows)
    assert any(r["gspo/adv_abs_mean"] > 0 for r in rows)


# ============================================================================= REINFORCE with a baseline


def test_reinforce_advantages_by_hand():
    m = make(ReinforceBaseline, group_size=2, baseline_decay=0.5, beta=0.0)
    m.ref = None  # what setup sets at beta = 0 (no trainer here)
    valid = torch.ones(2, 2, dtype=torch.bool)
    # step 1: no history, b = 0: A = R; the equal-reward group (0.5, 0.5) keeps A = 0.5
    assert m.group_advantages(torch.tensor([[1.0, 0.0], [0.5, 0.5]]), valid).tolist() == [[1.0, 0.0], [0.5, 0.5]]
    m.after_step(1)  # m_1 = 0.5 * 0 + 0.5 * mean 0.5 = 0.25; b_1 = 0.25 / (1 - 0.5) = 0.5, the first mean
    assert m.baseline == 0.5
    # step 2: A = R - 0.5; the failed 9.0 gets 0 and stays out of the mean (1 + 1 + 1) / 3 = 1
    adv = m.group_advantages(torch.tensor([[1.0, 1.0], [1.0, 9.0]]), torch.tensor([[True, True], [True, False]]))
    assert adv.tolist() == [[0.5, 0.5], [0.5, 0.0]]
    m.after_step(2)  # m_2 = 0.5 * 0.25 + 0.5 * 1 = 0.625; b_2 = 0.625 / (1 - 0.25) = 5/6
    assert m.baseline == pytest.approx(5 / 6, abs=1e-15)
    # scale_rewards=batch at b = 0: (1, 0, .5, .5) / sample std sqrt(0.5/3) = 0.40825
    scaled = make(ReinforceBaseline, group_size=2, scale_rewards="batch").group_advantages(
        torch.tensor([[1.0, 0.0], [0.5, 0.5]]), valid
    )
    assert torch.allclose(scaled, torch.tensor([[1.0, 0.0], [0.5, 0.5]]) / math.sqrt(0.5 / 3))
    b, stats = m.add_advantages(
        Batch(rewards=torch.tensor([0.3, 0.3, 0.3, 0.3]), valid=torch.ones(4, dtype=torch.bool))
    )
    assert stats["reinforce/zero_std_frac"] == 0.0 and torch.allclose(b.advantages, torch.full((4,), 0.3 - 5 / 6))
    # the step's mean is the global batch's: another process adds (sum 3, count 4), so (1 + 3) / 8 = 0.5 joins b
    m.pending, m.services = None, SimpleNamespace(all_sum=lambda t: t + torch.tensor([3.0, 4.0], dtype=t.dtype))
    m.add_advantages(Batch(rewards=torch.full((4,), 0.25), valid=torch.ones(4, dtype=torch.bool)))
    m.after_step(3)  # m_3 = 0.5 * 0.625 + 0.5 * 0.5 = 0.5625; b_3 = 0.5625 / (1 - 0.125) = 9/14
    assert m.baseline == pytest.approx(9 / 14, abs=1e-15)
    with pytest.raises(GcfError, match="scale_rewards"):
        make(ReinforceBaseline, scale_rewards="group")
    with pytest.raises(GcfError, match="baseline_decay"):
        make(ReinforceBaseline, baseline_decay=1.0)


def test_reinforce_engine_gradient_equals_autograd():
    """Equal-reward group keeps a nonzero advantage; mu > 1 so both clip sides occur; KL term on."""
    m = make(ReinforceBaseline, group_size=4, beta=0.04, mu=2, baseline_decay=0.8)
    m.baseline_ema, m.baseline_steps = 0.16, 1  # b = 0.16 / (1 - 0.8) = 0.8
    batch, logps = rollout_batch()
    batch, _ = m.add_advantages(batch)
    R, ok = batch.rewards, batch.valid
    assert torch.allclose(batch.advantages, torch.where(ok, R - 0.8, 0.0))  # the oracle: R - b
    assert (batch.advantages[4:8] == 0.5 - 0.8).all()  # the equal-reward group keeps R - b != 0
    ratio, adv = torch.exp(logps - batch.old_logps), batch.advantages[:, None].expand_as(logps)
    clipped, mask = m.clipped(ratio, adv), engine.effective_mask(batch).bool()
    assert (clipped & mask & (adv > 0)).any() and (clipped & mask & (adv < 0)).any()
    want, got, _ = grads(m, batch, logps)
    assert torch.allclose(got, want, atol=1e-7, rtol=1e-5) and got[4:8].abs().sum() > 0


def reinforce_cfg(out, steps, reward):
    return Config(
        method=spec(ReinforceBaseline),
        model="tiny",
        task="arithmetic",
        output_dir=str(out),
        max_steps=steps,
        reward=reward,
        lr=1e-3,
        beta=0.04,
        save_every=2,
        **FAST,
    )


def test_reinforce_two_steps_and_bitwise_resume(tmp_path, reward):
    straight = Trainer(reinforce_cfg(tmp_path / "a", 3, reward))
    straight.run()
    rows = metrics_rows(tmp_path / "a")
    assert [r["step"] for r in rows] == [1, 2, 3] and all("reinforce/baseline" in r for r in rows)
    assert straight.method.baseline_steps == 3 and straight.method.baseline != 0
    Trainer(reinforce_cfg(tmp_path / "b", 2, reward)).run()
    saved = torch.load(tmp_path / "b" / "checkpoints" / "step-2" / "state.pt", weights_only=False)["method"]
    assert saved["baseline_steps"] == 2 and saved["baseline_ema"] == pytest.approx(
        rows[1]["reinforce/baseline"] * (1 - 0.9**2), rel=1e-12
    )
    resumed = Trainer(reinforce_cfg(tmp_path / "b", 3, reward), resume="latest")
    assert (resumed.method.baseline_ema, resumed.method.baseline_steps) == (saved["baseline_ema"], 2)
    resumed.run()
    assert resumed.method.baseline_ema == straight.method.baseline_ema  # bitwise, a float64
    for p, q in zip(straight.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(p, q)
    assert metrics_rows(tmp_path / "b")[-1]["loss"] == rows[-1]["loss"]


# ============================================================================= online DPO


def fake_rollout(G=3):
    """3 prompts x G samples of 1 prompt token + 2 completion tokens, and the reference log-probs prepare will read."""
    N = 3 * G
    logps = torch.full((N, 3), -1.0, dtype=torch.float64) * torch.tensor([0, 1, 1])
    ref = logps.clone()
    ref[1, 1:] = -1 - L3  # prompt 0's best sample (index 1): Delta = 2 ln 3
    return Batch(
        input_ids=torch.arange(N)[:, None].expand(N, 3).clone(),
        attention_mask=torch.ones(N, 3, dtype=torch.long),
        loss_mask=torch.tensor([[0, 1, 1]] * N),
        completions=[f"c{i}" for i in range(N)],
        rewards=torch.tensor([0.2, 0.9, 0.5, 0.3, 0.3, 0.3, 5.0, 1.0, 0.0]),
        valid=torch.tensor([True] * 6 + [False, True, True]),
    ).put("fake_ref", ref, TOKEN), logps


def test_online_dpo_pairs_and_coefficient_by_hand():
    m = make(OnlineDPO, group_size=3, beta=0.5)
    m.services, m.ref = SimpleNamespace(logprobs=lambda model, b, T: b.own["fake_ref"]), None
    rollout, logps = fake_rollout()
    pairs, stats = m.prepare(rollout)
    # prompt 0: rewards (0.2, 0.9, 0.5): best sample 1, worst 0. Prompt 1: all 0.3, skipped.
    # prompt 2: the 5.0 failed (valid False), so best is sample 7 (1.0) and worst sample 8 (0.0)
    assert pairs.completions == ["c1", "c0", "c3", "c3", "c7", "c8"]
    assert pairs.valid.tolist() == [True, True, False, False, True, True] and stats["online_dpo/skipped_prompts"] == 1.0
    assert stats["online_dpo/reward_gap"] == pytest.approx((0.7 + 1.0) / 2)
    lp = logps[torch.tensor([1, 0, 3, 3, 7, 8])]
    # pair 0: h_w = 0.5 * 2 ln 3 = ln 3, h_l = 0: sigmoid(-ln 3) = 1/4, GC = beta / 4 = 1/8 on chosen, -1/8 on rejected
    # pair 2: h_w = h_l = 0: GC = beta * sigmoid(0) = 1/4, -1/4
    coef = m.coefficient(pairs, lp)
    want = torch.tensor(
        [[0, 1 / 8, 1 / 8], [0, -1 / 8, -1 / 8], [0, 1 / 4, 1 / 4], [0, -1 / 4, -1 / 4]], dtype=torch.float64
    )
    assert torch.allclose(coef[[0, 1, 4, 5]], want)
    assert engine.normaliser([pairs], m.norm) == 2.0  # Z counts the two pairs formed, not the skipped one
    want, got, _ = grads(m, pairs, lp, micro=2)
    assert torch.allclose(got, want) and got[2:4].abs().sum() == 0 and got[[0, 1, 4, 5]].abs().sum() > 0


def test_online_dpo_engine_gradient_through_the_tiny_model(tmp_path, reward):
    tr = Trainer(
        Config(
            method=spec(OnlineDPO),
            model="tiny",
            task="arithmetic",
            output_dir=str(tmp_path / "x"),
            reward=reward,
            **{**FAST, "batch_size": 3, "micro_batch_size": 4},
        )
    )
    m = tr.method
    rollout, _ = m.data(0)
    rollout.rewards = torch.tensor(
        [0.0, 2.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 0.5, 0.0, 0.0, 4.0]
    )  # prompt 1's group is all equal
    batch, stats = m.prepare(rollout)
    assert batch.valid.tolist() == [True, True, False, False, True, True] and stats["online_dpo/skipped_prompts"] == 1.0
    assert batch.rewards.tolist() == [2.0, 0.0, 3.0, 3.0, 4.0, 0.0]
    g = torch.Generator().manual_seed(0)
    batch.ref_logps = batch.ref_logps + 0.5 * torch.randn(batch.ref_logps.shape, generator=g) * batch.loss_mask
    assert_engine_grad_matches_objective(tr, batch, micro=2)
    # the textbook: DPO's loss (Rafailov et al. eq. 7) averaged over the pairs formed, here on random log-probs
    lp = (batch.ref_logps + 0.3 * torch.randn(batch.ref_logps.shape, generator=g)) * batch.loss_mask

    def dpo_textbook(x):
        d = ((x - batch.ref_logps) * batch.loss_mask).sum(-1)
        return -F.logsigmoid(0.1 * (d[0::2] - d[1::2]))[[0, 2]].mean()

    want, got, _ = grads(m, batch, lp, micro=2)
    assert torch.allclose(got, textbook_grad(dpo_textbook, lp), atol=1e-7) and torch.allclose(got, want, atol=1e-7)


def test_online_dpo_two_steps(tmp_path, reward):
    rows = two_steps(tmp_path, OnlineDPO, reward=reward)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("online_dpo/skipped_prompts" in r and math.isfinite(r["loss"]) for r in rows)
    assert any("online_dpo/margin" in r for r in rows)  # at least one pair was formed and trained


# ============================================================================= KTO


def test_kto_coefficient_and_z0_by_hand():
    m = make(KTO, beta=1.0, desirable_weight=1.0, undesirable_weight=2.0)
    logps = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]], dtype=torch.float64)
    b = Batch(
        input_ids=torch.zeros(2, 3, dtype=torch.long),
        attention_mask=torch.ones(2, 3, dtype=torch.long),
        loss_mask=torch.tensor([[0, 1, 1]] * 2),
        ref_logps=logps - torch.tensor([0, L3 / 2, L3 / 2]),
        desirable=torch.tensor([True, False]),
        z0=0.0,
    )
    # r = ln 3 on both rows, z0 = 0, beta = 1.
    # desirable: s = sigmoid(ln 3) = 3/4, GC = 1 * 1 * (3/4)(1/4) = 3/16
    # undesirable: s = sigmoid(-ln 3) = 1/4, GC = -2 * 1 * (1/4)(3/4) = -3/8
    assert torch.allclose(
        m.coefficient(b, logps), torch.tensor([[0, 3 / 16, 3 / 16], [0, -3 / 8, -3 / 8]], dtype=torch.float64)
    )
    # z0: prepare's mismatched rows have sum_t log(pi/pi_ref) of 0.6 and -0.2 -> mean 0.2; with -0.6 and 0.2 it is clamped to 0
    for kl, z0 in [((0.6, -0.2), 0.2), ((-0.6, 0.2), 0.0)]:
        kl_batch = (
            Batch(
                input_ids=torch.zeros(2, 3, dtype=torch.long),
                attention_mask=torch.ones(2, 3, dtype=torch.long),
                loss_mask=torch.tensor([[0, 1, 1]] * 2),
            )
            .put("pi", torch.tensor([[0.0, kl[0], 0], [0, 0, kl[1]]]), TOKEN)
            .put("ref", torch.zeros(2, 3), TOKEN)
        )
        m.services, m.ref = (
            SimpleNamespace(logprobs=lambda model, x: x.own[model], policy=lambda: "pi", all_sum=lambda t: t),
            "ref",
        )
        out, stats = m.prepare(b.replaced(kl_pairs=kl_batch).put("ref", b.ref_logps, TOKEN))
        assert out.z0 == pytest.approx(z0) and stats["kto/kl"] == pytest.approx(sum(kl) / 2) and out.kl_pairs is None
    # over every process: another one's two rows sum to 1.0, so z0 = (-0.6 + 0.2 + 1.0) / 4 = 0.15
    m.services.all_sum = lambda t: t + torch.tensor([1.0, 2.0], dtype=t.dtype)
    assert m.prepare(b.replaced(kl_pairs=kl_batch).put("ref", b.ref_logps, TOKEN))[0].z0 == pytest.approx(0.15)


def kto_textbook(batch, logps, beta, lam_d, lam_u):
    """The paper's eq. 8 with z0 held fixed: mean over examples of lambda_y - v(x, y)."""
    r = ((logps - batch.ref_logps) * batch.loss_mask).sum(-1)
    z0 = batch.z0
    v = torch.where(batch.desirable, lam_d * torch.sigmoid(beta * (r - z0)), lam_u * torch.sigmoid(beta * (z0 - r)))
    lam = torch.where(batch.desirable, lam_d, lam_u)
    return (lam - v).mean()


def test_kto_engine_gradient_equals_autograd():
    m = make(KTO, beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)
    batch, logps = pair_batch()
    del batch.example_weight
    batch.desirable = torch.tensor([True, False, False, True, True, False, True, True, False, False, True, False])
    batch.z0 = 0.7
    r = ((logps - batch.ref_logps) * batch.loss_mask).sum(-1)
    assert (r > 0.7).any() and (r < 0.7).any()  # both sides of the reference point, both labels
    want, got, Z = grads(m, batch, logps)
    assert Z == 12.0 and torch.allclose(got, want)
    assert torch.allclose(got, textbook_grad(lambda x: kto_textbook(batch, x, 0.5, 1.0, 1.5), logps))
    assert (got[batch.desirable].sum(-1) < 0).all() and (got[~batch.desirable].sum(-1) > 0).all()  # d loss: down / up


def test_kto_two_steps_on_the_task_and_from_a_file(tmp_path):
    rows = two_steps(tmp_path / "task", KTO)
    assert [r["step"] for r in rows] == [1, 2] and all("kto/z0" in r and "kto/loss" in r for r in rows)
    tr = Trainer(Config(method=spec(KTO), model="tiny", task="arithmetic", output_dir=str(tmp_path / "t2"), **FAST))
    b, _ = tr.method.data(0)  # z0's rows: prompt j with the completion of j + 1 (mod the batch)
    ex = [tr.method.examples[i] for i in tr.method.step_indices(len(tr.method.examples), 0)]
    for j, (p, _) in enumerate(ex):
        c = ex[(j + 1) % len(ex)][1]
        assert b.kl_pairs.input_ids[j, : len(p) + len(c)].tolist() == p + c
    data = tmp_path / "kto.jsonl"
    data.write_text(
        '{"prompt": "1+1=", "completion": "2", "label": true}\n{"prompt": "2+2=", "completion": "5", "label": false}\n'
        '{"prompt": "3+3=", "completion": "6", "label": true}\n{"prompt": "1+2=", "completion": "4", "label": false}\n'
    )
    rows = two_steps(tmp_path / "file", KTO, dataset=str(data))
    assert all(r["kto/desirable_frac"] in (0.0, 0.5, 1.0) for r in rows)
    data.write_text('{"prompt": "1+1=", "completion": "2", "label": "yes"}\n')
    with pytest.raises(GcfError, match="boolean 'label'"):
        two_steps(tmp_path / "bad", KTO, dataset=str(data), overwrite=True)


# ============================================================================= ORPO


def test_orpo_coefficient_by_hand():
    m = make(ORPO, orpo_lambda=0.5)
    logps = torch.tensor([[0.0, math.log(0.5), math.log(0.5)], [0.0, math.log(0.2), 0.0]], dtype=torch.float64)
    b = Batch(
        input_ids=torch.zeros(2, 3, dtype=torch.long),
        attention_mask=torch.ones(2, 3, dtype=torch.long),
        loss_mask=torch.tensor([[0, 1, 1], [0, 1, 0]]),
        example_weight=torch.full((2,), 0.5),
    )
    # chosen: mean log-prob ln 0.5, P = 1/2, odds 1, log odds 0; rejected (1 token): P = 0.2, odds 1/4, log odds -ln 4
    # z = ln 4, sigmoid(-z) = 1/5. chosen GC = (1 + 0.5 * (1/5) / (1/2)) / 2 = 0.6; rejected GC = -0.5 * (1/5) / (0.8 * 1) = -0.125
    assert torch.allclose(m.coefficient(b, logps), torch.tensor([[0, 0.6, 0.6], [0, -0.125, 0]], dtype=torch.float64))
    # J = -(NLL + lambda * -log sigmoid(z)) = -(ln 2 + 0.5 * ln(5/4)) per pair
    assert float(m.objective(b, logps, 1.0)) == pytest.approx(-(math.log(2) + 0.5 * math.log(1.25)))
    assert m.uses_reference is False


def orpo_textbook(batch, logps, lam):
    """Hong et al. eqs. 6-8: chosen NLL (token mean) + lambda * -log sigmoid(log(odds_w / odds_l)), mean over pairs."""
    mask = batch.loss_mask.double()
    p = torch.exp((logps * mask).sum(-1) / mask.sum(-1))  # [B] P(o) = exp(mean log-prob)
    odds = p / (1 - p)
    l_or = -torch.log(torch.sigmoid(torch.log(odds[0::2] / odds[1::2])))
    return (-torch.log(p[0::2]) + lam * l_or).mean()


@pytest.mark.parametrize("seed", [0, 1])
def test_orpo_engine_gradient_equals_autograd(seed):
    m = make(ORPO, orpo_lambda=0.3)
    batch, logps = pair_batch(seed=seed)
    want, got, Z = grads(m, batch, logps)
    assert Z == 6.0 and torch.allclose(got, want)
    assert torch.allclose(got, textbook_grad(lambda x: orpo_textbook(batch, x, 0.3), logps))
    assert (got[1::2] * batch.loss_mask[1::2] >= 0).all() and (
        got[0::2].sum(-1) < 0
    ).all()  # rejected pushed down, chosen up


def test_orpo_two_steps(tmp_path):
    rows = two_steps(tmp_path, ORPO)
    assert [r["step"] for r in rows] == [1, 2] and all("orpo/nll" in r and "orpo/log_odds_ratio" in r for r in rows)


def test_kto_and_online_dpo_refuse_bad_settings():
    with pytest.raises(GcfError, match="beta"):
        make(KTO, beta=0.0)
    with pytest.raises(GcfError, match="batch_size"):
        make(KTO, batch_size=1)
    with pytest.raises(GcfError, match="group_size"):
        make(OnlineDPO, group_size=1)
    with pytest.raises(GcfError, match="orpo_lambda"):
        make(ORPO, orpo_lambda=-1.0)
