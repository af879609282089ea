"""DPO and its variants: exactness against the textbook losses, hand-worked GC, data, and end to end."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from gcfamily.cli import main
from gcfamily.config import Config
from gcfamily.core import engine
from gcfamily.core.batch import Batch
from gcfamily.data.batches import split_batch
from gcfamily.data.formats import normalize
from gcfamily.data.preferences import MALFORMED, preference_rows
from gcfamily.methods import get_method
from gcfamily.tasks import get_task

PREFERENCE_METHODS = ("dpo", "ipo", "cdpo", "simpo")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; two threads on a busy two-core machine can be 10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _method(name, **settings):
    cfg = Config(method=name, **settings)
    get_method(name).validate(cfg)
    return get_method(name)(cfg)


# ---------------------------------------------------------------------------------- textbook losses


def _textbook_loss(name, cfg, logps, batch):
    """Mean loss over pairs, written from each paper with sequence sums, independently of gcfamily."""
    mask = batch.loss_mask.double()
    pi = (logps * mask).sum(-1)  # [B] log pi(o | q)
    ref = (batch.ref_logps * mask).sum(-1)
    pi_w, pi_l, ref_w, ref_l = pi[0::2], pi[1::2], ref[0::2], ref[1::2]
    d = (pi_w - ref_w) - (pi_l - ref_l)  # log-ratio gap
    b = cfg.settings.beta
    if name == "dpo":  # Rafailov et al. 2023, eq. 7
        loss = -F.logsigmoid(b * d)
    elif name == "cdpo":  # Mitchell 2023, eq. 3
        eps = cfg.settings.label_smoothing
        loss = -(1 - eps) * F.logsigmoid(b * d) - eps * F.logsigmoid(-b * d)
    elif name == "ipo":  # Azar et al. 2023, eq. 17
        loss = (d - 1 / (2 * b)) ** 2
    elif name == "simpo":  # Meng et al. 2024, eq. 6
        n = mask.sum(-1)
        loss = -F.logsigmoid(b * pi_w / n[0::2] - b * pi_l / n[1::2] - cfg.settings.simpo_gamma)
    return loss.mean()


def _pair_batch(P=5, L=12, seed=0):
    """P random pairs (rows 2i, 2i+1 share a prompt), random log-probs [B, L] as a leaf with grad."""
    g = torch.Generator().manual_seed(seed)
    B = 2 * P
    prompt_len = torch.randint(1, 4, (P,), generator=g).repeat_interleave(2)  # [B]
    comp_len = torch.randint(1, L - 4, (B,), generator=g)  # [B]
    pos = torch.arange(L)[None]
    attention_mask = (pos < (prompt_len + comp_len)[:, None]).long()  # [B, L]
    loss_mask = attention_mask * (pos >= prompt_len[:, None]).long()  # [B, L]
    ref = -3 * torch.rand(B, L, generator=g, dtype=torch.float64) * loss_mask  # [B, L]
    logps = (ref + torch.randn(B, L, generator=g, dtype=torch.float64)).clamp(max=0) * loss_mask
    batch = Batch(
        input_ids=torch.zeros(B, L, dtype=torch.long),
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        ref_logps=ref,
        example_weight=torch.full((B,), 0.5),
    )
    return batch, logps.requires_grad_()


SETTINGS = {
    "dpo": {"beta": 0.3},
    "ipo": {"beta": 0.3},
    "cdpo": {"beta": 0.3, "label_smoothing": 0.2},
    "simpo": {"beta": 2.0, "simpo_gamma": 0.7},
}


@pytest.mark.parametrize("name", PREFERENCE_METHODS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_gradient_equals_textbook_autograd(name, seed):
    """grad of the engine's loss == grad of the paper's loss (mean over pairs) == grad of -objective."""
    m = _method(name, **SETTINGS[name])
    batch, logps = _pair_batch(seed=seed)
    Z = engine.normaliser([batch], m.norm)
    assert m.norm == "sum" and Z == 5.0  # rows weigh 1/2: Z counts pairs

    coef = m.coefficient(batch, logps.detach())
    (g_engine,) = torch.autograd.grad(engine.weighted_loss(coef, logps, batch, m.norm, Z), logps)
    (g_paper,) = torch.autograd.grad(_textbook_loss(name, m.cfg, logps, batch), logps)
    (g_objective,) = torch.autograd.grad(-m.objective(batch, logps, Z), logps)
    assert torch.allclose(g_engine, g_paper, atol=1e-10, rtol=1e-8)
    assert torch.allclose(g_engine, g_objective, atol=1e-10, rtol=1e-8)
    assert torch.allclose(-m.objective(batch, logps, Z), _textbook_loss(name, m.cfg, logps, batch))
    assert (coef * (1 - batch.loss_mask)).abs().sum() == 0  # no GC off the completions


def _hand_batch(chosen, rejected, ref_chosen=None, ref_rejected=None):
    """One pair, L = 4: the prompt at position 0, chosen on 1..2 (position 3 is padding), rejected on 1..3."""
    logps = torch.tensor([[0.0, *chosen, 0.0], [0.0, *rejected]], dtype=torch.float64)
    ref = torch.tensor([[0.0, *(ref_chosen or chosen), 0.0], [0.0, *(ref_rejected or rejected)]], dtype=torch.float64)
    loss_mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])
    return Batch(
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
        loss_mask=loss_mask,
        ref_logps=ref,
        example_weight=torch.full((2,), 0.5),
    ), logps


L3 = math.log(3)


def test_dpo_and_cdpo_gc_by_hand():
    # chosen: log pi = -1 per token, log pi_ref = -1 - ln3, so Delta_w = 2 ln3; rejected: pi == pi_ref, Delta_l = 0.
    # beta = 1/2: h_w = ln3, h_l = 0, sigmoid(h_l - h_w) = 1/(1 + 3) = 1/4, GC = beta/4 = 1/8 on chosen, -1/8 on rejected.
    batch, logps = _hand_batch([-1, -1], [-2, -2, -2], ref_chosen=[-1 - L3, -1 - L3])
    coef = _method("dpo", beta=0.5).coefficient(batch, logps)
    want = torch.tensor([[0, 1 / 8, 1 / 8, 0], [0, -1 / 8, -1 / 8, -1 / 8]], dtype=torch.float64)
    assert torch.allclose(coef, want)
    # cDPO, eps = 1/4: GC = beta((1-eps) sigmoid(-m) - eps sigmoid(m)) = 1/2 (3/4 * 1/4 - 1/4 * 3/4) = 0:
    # the smoothed label says sigmoid(m) should be 3/4, and here it is.
    coef = _method("cdpo", beta=0.5, label_smoothing=0.25).coefficient(batch, logps)
    assert torch.allclose(coef, torch.zeros_like(coef))


def test_ipo_gc_by_hand():
    # At the reference (pi == pi_ref) the gap d is 0, so GC = 1/beta - 2d = 1/beta = 2 for beta = 1/2:
    # unlike DPO's sigmoid, IPO's square pulls an untrained pair apart with the full force 1/beta.
    batch, logps = _hand_batch([-1, -1], [-2, -2, -2])
    coef = _method("ipo", beta=0.5).coefficient(batch, logps)
    assert torch.allclose(coef, torch.tensor([[0, 2, 2, 0], [0, -2, -2, -2]], dtype=torch.float64))
    # and at d = 1/(2 beta) = 1 the target is met: GC = 2 - 2 * 1 = 0
    batch, logps = _hand_batch([-1, -1], [-2, -2, -2], ref_chosen=[-1.5, -1.5])
    assert torch.allclose(_method("ipo", beta=0.5).coefficient(batch, logps), torch.zeros(2, 4, dtype=torch.float64))


def test_simpo_gc_by_hand():
    # beta = 2, gamma = 1. chosen: 2 tokens of log pi -1/2, h_w = 2 * (-1/2) = -1; rejected: 3 tokens of -1, h_l = -2.
    # m - gamma = (h_w - h_l) - 1 = 0, sigmoid(0) = 1/2. GC = (beta/|o_w|)/2 = 1/2 on chosen, -(beta/|o_l|)/2 = -1/3 on rejected.
    # The reference log-probs are garbage on purpose: SimPO must not read them.
    batch, logps = _hand_batch([-0.5, -0.5], [-1, -1, -1], ref_chosen=[-9, -9], ref_rejected=[5, 5, 5])
    coef = _method("simpo", beta=2.0, simpo_gamma=1.0).coefficient(batch, logps)
    assert torch.allclose(coef, torch.tensor([[0, 1 / 2, 1 / 2, 0], [0, -1 / 3, -1 / 3, -1 / 3]], dtype=torch.float64))


def test_settings_are_checked():
    from gcfamily.errors import GcfError

    with pytest.raises(GcfError, match="beta > 0"):
        _method("dpo", beta=0.0)
    with pytest.raises(GcfError, match="label_smoothing"):
        _method("cdpo", label_smoothing=0.5)
    with pytest.raises(GcfError, match="loss_norm must be sum"):
        _method("ipo", loss_norm="token")


# ---------------------------------------------------------------------------------- data


def test_preference_rows_from_tasks():
    """Correct answer chosen, a wrong or malformed one rejected, as the task's own reward says; deterministic."""
    for name, n in (("arithmetic", None), ("sorting", 30), ("countdown", 30)):
        task = get_task(name)
        rows = preference_rows(task, n, seed=3)
        assert rows == preference_rows(task, n, seed=3)
        assert len(rows) >= 0.9 * len(task.rows("train", n))
        src = {r["prompt"]: r for r in task.rows("train", n)}
        extra = {
            k: [src[r["prompt"]][k] for r in rows] for k in src[rows[0]["prompt"]] if k not in ("prompt", "completion")
        }
        prompts = [r["prompt"] for r in rows]
        assert task.reward(prompts, [r["chosen"] for r in rows], **extra) == [1.0] * len(rows)
        assert task.reward(prompts, [r["rejected"] for r in rows], **extra) == [0.0] * len(rows)
    arith = preference_rows(get_task("arithmetic"), None, seed=0)
    malformed = sum(r["rejected"] in MALFORMED for r in arith) / len(arith)
    assert 0.1 < malformed < 0.5  # mostly wrong numbers, some replies with no answer at all


def test_implicit_prompt_is_split():
    row = {
        "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}],
    }
    out = normalize(row, "preference", 0)
    assert out["prompt"] == [{"role": "user", "content": "2+2?"}]
    assert out["chosen"] == [{"role": "assistant", "content": "4"}] and out["rejected"][0]["content"] == "5"
    assert normalize({"prompt": "q", "chosen": "a", "rejected": "b"}, "preference", 0) == {
        "prompt": "q",
        "chosen": "a",
        "rejected": "b",
    }


def _trainer(tmp_path, **settings):
    from gcfamily.run.trainer import Trainer

    cfg = Config(**{"model": "tiny", "output_dir": str(tmp_path / "run"), "progress": False, **settings})
    return Trainer(cfg)


def test_batches_keep_pairs_and_reference(tmp_path):
    """Chosen/rejected alternate, share a prompt, weigh 1/2 each, and stay together in micro-batches."""
    tr = _trainer(tmp_path, method="dpo", max_steps=2, batch_size=3, micro_batch_size=3)
    batch, _ = tr.method.data(1)
    assert batch.input_ids.shape[0] == 6 and batch.example_weight.tolist() == [0.5] * 6
    first = batch.loss_mask.argmax(-1)
    assert torch.equal(first[0::2], first[1::2])  # the same prompt length in each pair
    assert torch.equal(batch.input_ids[0, : first[0]], batch.input_ids[1, : first[0]])
    assert torch.equal(batch.ref_logps != 0, batch.loss_mask.bool())
    mbs = split_batch(batch, tr.cfg.micro_batch_size, tr.method.rows_per_example)
    assert [mb.input_ids.shape[0] for mb in mbs] == [2, 2, 2]
    # before any step the policy is the reference: every margin is zero
    lp = tr.services.logprobs(tr.policy, batch)
    assert torch.allclose(lp, batch.ref_logps, atol=1e-5)
    # SimPO holds no reference at all
    simpo = _trainer(tmp_path, method="simpo", max_steps=2, overwrite=True)
    assert simpo.method.ref == {} and simpo.method.data(0)[0].ref_logps is None


def test_an_open_budget_scores_the_pairs_as_the_steps_reach_them(tmp_path, monkeypatch):
    """With max_time (or max_tokens, max_flops) the steps are not known ahead: past _UPFRONT_PAIRS pairs, the reference
    log-probs are scored by a kept pi_ref as each step reaches its pairs, not for the whole pool before training; the
    training is the same as with every pair scored up front."""
    import gcfamily.methods.dpo as dpo

    settings = dict(method="dpo", task="sorting", max_steps=3, batch_size=4, micro_batch_size=8, lr=1e-3)
    upfront = _trainer(tmp_path / "a", **settings)
    assert upfront.method.ref_model is None and len(upfront.method.ref) == 2 * 12  # the 12 pairs 3 steps read
    monkeypatch.setattr(dpo, "_UPFRONT_PAIRS", 8)
    lazy = _trainer(tmp_path / "b", **settings, max_time=3600.0)
    assert lazy.method.ref_model is not None and lazy.method.ref == {} and len(lazy.method.pairs) > 1000
    for tr in (upfront, lazy):
        tr.run()
    assert len(lazy.method.ref) == 2 * 12  # scored as reached: the 12 pairs of 3 steps, out of the whole pool
    for k in upfront.method.ref:
        assert torch.allclose(lazy.method.ref[k], upfront.method.ref[k], atol=1e-6)
    for p, q in zip(upfront.policy.parameters(), lazy.policy.parameters()):
        assert torch.allclose(p, q, atol=1e-6)  # pi_ref stayed the initial policy while the policy trained
    changed = any(
        not torch.equal(p, q) for p, q in zip(upfront.policy.parameters(), lazy.method.ref_model.parameters())
    )
    assert changed


def test_conversational_dataset(tmp_path):
    """Chat-message rows (with an explicit or an implicit prompt) from a local JSONL file."""
    path = tmp_path / "prefs.jsonl"
    rows = [
        {
            "prompt": [{"role": "user", "content": "1+1?"}],
            "chosen": [{"role": "assistant", "content": "2"}],
            "rejected": [{"role": "assistant", "content": "3"}],
        },
        {
            "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
            "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}],
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tr = _trainer(tmp_path, method="dpo", dataset=str(path), max_steps=1, batch_size=2)
    assert len(tr.method.pairs) == 2
    text = tr.tokenizer.decode(tr.method.pairs[1][0] + tr.method.pairs[1][1])
    assert "2+2?" in text and text.endswith("4<eos>")


def test_reward_accuracy_rises(tmp_path):
    """Thirty DPO steps on the tiny model separate most training pairs (it starts near 0: margins are 0)."""
    tr = _trainer(
        tmp_path,
        method="dpo",
        task_options={"level": "1d-add"},
        max_steps=30,
        batch_size=8,
        micro_batch_size=16,
        lr=1e-3,
        beta=0.1,
    )
    n_steps = math.ceil(len(tr.method.pairs) / 8)  # the first epoch: every training pair once

    def accuracy():
        hits = []
        for s in range(n_steps):
            b, _ = tr.method.data(s)
            h, _ = tr.method.rewards(b, tr.services.logprobs(tr.policy, b))
            hits.append((h[0::2] > h[1::2]).float())
        return float(torch.cat(hits).mean())

    before = accuracy()
    tr.run()
    after = accuracy()
    assert before < 0.3 and after > 0.7, (before, after)
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["dpo/reward_accuracy"] for r in logged[-5:]) / 5 > 0.7


# ---------------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("name", PREFERENCE_METHODS)
def test_cli_runs(name, tmp_path):
    out = tmp_path / name
    res = CliRunner().invoke(
        main,
        [
            "run",
            "--method",
            name,
            "--model",
            "tiny",
            "--max-steps",
            "3",
            "--output-dir",
            str(out),
            "--set",
            "progress=false",
        ],
    )
    assert res.exit_code == 0, res.output
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert all(math.isfinite(r["dpo/loss"]) and math.isfinite(r["grad_norm"]) for r in logged)
    if name != "simpo":  # the reference is the untouched policy: the first margin is 0 up to float rounding
        beta = json.loads((out / "run_config.json").read_text())["beta"]  # the method's own default (0.1)
        # (the reference pass groups rows by length, the step by pair, so shared prompts split differently)
        assert beta == 0.1 and logged[0]["dpo/margin"] == pytest.approx(0.0, abs=1e-6)
        want = (1 / (2 * beta)) ** 2 if name == "ipo" else math.log(2)
        assert logged[0]["dpo/loss"] == pytest.approx(want, rel=1e-5)


def _bad_rows(tmp_path, chosen_of_row_1):
    path = tmp_path / "bad.jsonl"
    second = {"prompt": "What is 2 + 2?", "rejected": "5"}
    if chosen_of_row_1 is not None:
        second["chosen"] = chosen_of_row_1
    path.write_text(
        json.dumps({"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}) + "\n" + json.dumps(second) + "\n"
    )
    return path


def test_missing_chosen_is_one_clear_error(tmp_path):
    """A real process: one 'error:' line naming the row and the column, a non-zero exit, no traceback."""
    path = _bad_rows(tmp_path, None)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gcfamily",
            "run",
            "--method",
            "dpo",
            "--model",
            "tiny",
            "--dataset",
            str(path),
            "--max-steps",
            "1",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "Row 1" in lines[0] and "'chosen'" in lines[0] and "Traceback" not in proc.stderr


def test_empty_chosen_is_one_clear_error(tmp_path):
    path = _bad_rows(tmp_path, "  ")
    res = CliRunner().invoke(
        main,
        [
            "run",
            "--method",
            "ipo",
            "--model",
            "tiny",
            "--dataset",
            str(path),
            "--max-steps",
            "1",
            "--output-dir",
            str(tmp_path / "run"),
        ],
    )
    assert res.exit_code != 0 and isinstance(res.exception, SystemExit)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Row 1" in lines[0] and "'chosen'" in lines[0]
