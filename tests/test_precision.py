"""Mixed precision: bf16 compute over float32 master weights and AdamW state; pure bf16 only on request."""

import copy
import json
import re

import pytest
import torch
from safetensors.torch import load_file

from gcfamily.config import Config
from gcfamily.core import engine, float32_parts, logprobs, precision
from gcfamily.core.onednn import packed_linears
from gcfamily.errors import GcfError
from gcfamily.models import tiny_model, tiny_tokenizer
from gcfamily.run.trainer import Trainer

SFT = dict(
    method="sft", model="tiny", task="arithmetic", batch_size=4, micro_batch_size=2, progress=False, device="cpu"
)


def _train(out, **kw):
    tr = Trainer(Config(output_dir=str(out), **{**SFT, **kw}))
    before = {n: p.detach().float().clone() for n, p in tr.policy.named_parameters()}
    tr.run()
    return tr, before


def _changed(tr, before):
    """[n] bool over every weight element: did the step move it?"""
    return torch.cat([(p.detach().float() != before[n]).flatten() for n, p in tr.policy.named_parameters()])


def _delta(tr, before):
    return torch.cat([(p.detach().float() - before[n]).flatten() for n, p in tr.policy.named_parameters()])


def test_bf16_compute_step_moves_the_weights_a_float32_step_moves(tmp_path):
    """At lr 1e-6 the float32 masters take bf16-computed updates that pure bf16 weights round away."""
    settings = dict(lr=1e-6, max_steps=3)
    fp32, b0 = _train(tmp_path / "fp32", dtype="float32", **settings)
    mixed, b1 = _train(tmp_path / "mixed", dtype="bfloat16", **settings)
    pure, b2 = _train(tmp_path / "pure", dtype="bfloat16", master_dtype="bfloat16", **settings)
    assert {p.dtype for p in mixed.policy.parameters()} == {torch.float32}  # masters stay float32
    assert {s["exp_avg_sq"].dtype for s in mixed.optimizer.state.values()} == {torch.float32}  # and AdamW's moments
    assert {p.dtype for p in pure.policy.parameters()} == {torch.bfloat16}  # asked for: pure bf16
    c32, cmix, cpure = _changed(fp32, b0), _changed(mixed, b1), _changed(pure, b2)
    assert c32.float().mean() > 0.5
    assert (c32 == cmix).float().mean() > 0.999  # the same weights move
    assert cpure.float().mean() < 0.5 * c32.float().mean()  # the failure this guards against: updates rounded away
    d32, dmix = _delta(fp32, b0), _delta(mixed, b1)
    both = c32 & cmix
    assert (torch.sign(d32[both]) == torch.sign(dmix[both])).float().mean() > 0.95  # in the same direction
    assert not torch.equal(d32, dmix)  # and the compute really was bf16 (else this test proves nothing)


def test_engine_under_autocast_computes_in_bf16_and_accumulates_in_float32():
    """The output layer's products take bf16 operands under autocast; log-probs stay float32 and near float32's."""
    tok = tiny_tokenizer()
    model = tiny_model(len(tok), seed=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, len(tok), (4, 24), generator=g)
    am = torch.ones_like(ids)
    lm = torch.zeros_like(ids)
    lm[:, 8:] = 1
    exact = engine.token_logprobs(model, ids, am, lm, 1.0, 16).logps
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = engine.token_logprobs(model, ids, am, lm, 1.0, 16)
    assert mixed.logps.dtype == torch.float32
    diff = (mixed.logps - exact).abs().max().item()
    assert 1e-6 < diff < 0.1  # bf16 compute: different from float32, within bf16 rounding
    (mixed.logps * lm).sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


def test_chunked_head_with_a_compute_dtype_equals_autograd_of_bf16_operands():
    """Oracle: log_softmax of (h.bf16 @ W.bf16.T) in float32, differentiated by autograd."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = (torch.randn(50, 16, generator=g) * 0.3).requires_grad_()
    t = torch.randint(0, 50, (37,), generator=g)
    up = torch.randn(37, generator=g)
    lp, _ = logprobs._ChunkedTokenLogprob.apply(h, w, None, t, 1.0, 8, True, torch.bfloat16)
    (lp * up).sum().backward()
    got_h, got_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logits = (h.bfloat16() @ w.bfloat16().t()).float()
    want = torch.log_softmax(logits, -1).gather(1, t[:, None]).squeeze(1)
    assert torch.allclose(lp, want, atol=1e-5)
    (want * up).sum().backward()
    assert torch.allclose(got_h, h.grad, atol=1e-2, rtol=1e-2)  # both products in bf16
    assert torch.allclose(got_w, w.grad, atol=1e-2, rtol=1e-2)


def test_packed_onednn_linears_are_off_under_autocast():
    model = tiny_model(64, seed=0)
    with torch.no_grad():
        with packed_linears(model, 4) as n:
            assert n > 0
        with torch.autocast("cpu", dtype=torch.bfloat16), packed_linears(model, 4) as n:
            assert n == 0


def test_settings_that_cannot_train_exactly_are_one_sentence():
    cpu = torch.device("cpu")
    assert precision.resolve("auto", "float32", cpu) == precision.Precision(torch.float32, torch.float32, "cpu")
    assert precision.resolve("bfloat16", "float32", cpu).mixed
    assert precision.resolve("auto", "bfloat16", cpu) == precision.Precision(torch.bfloat16, torch.bfloat16, "cpu")
    with pytest.raises(GcfError, match="pure bfloat16"):
        precision.resolve("float32", "bfloat16", cpu)
    with pytest.raises(GcfError, match="loss scaling"):
        precision.resolve("float16", "float32", cpu)
    model = tiny_model(64).to(torch.bfloat16)
    with pytest.raises(GcfError, match="master_dtype is float32"):  # bf16 weights nobody asked for
        precision.check_master(model.parameters(), precision.resolve("bfloat16", "float32", cpu), "The model x")
    precision.check_master(model.parameters(), precision.resolve("auto", "bfloat16", cpu), "The model x")  # asked for


def test_cli_refuses_float16_and_bf16_masters_with_float32_compute(gcf, tmp_path):
    code, _, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "a"),
        "--set",
        "dtype=float16",
    )
    assert code == 2 and err.strip().startswith("error:") and "loss scaling" in err and "Traceback" not in err
    code, _, err = gcf(
        "run",
        "--method",
        "sft",
        "--model",
        "tiny",
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "b"),
        "--set",
        "master_dtype=bfloat16",
        "--set",
        "dtype=float32",
    )
    assert code == 2 and "pure bfloat16" in err


def test_checkpoints_hold_masters_and_save_dtype_shrinks_only_the_final_copy(tmp_path):
    tr, _ = _train(tmp_path / "run", dtype="bfloat16", lr=1e-4, max_steps=2, save_every=1, save_dtype="bfloat16")
    ckpt = load_file(str(tmp_path / "run" / "checkpoints" / "step-2" / "model.safetensors"))
    final = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert {v.dtype for v in ckpt.values()} == {torch.float32}
    assert {v.dtype for v in final.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "run" / "config.json").read_text())["dtype"] == "bfloat16"
    masters = dict(tr.policy.named_parameters())
    assert all(torch.equal(ckpt[k], masters[k].detach()) for k in ckpt if k in masters)  # the masters, exactly
    assert {p.dtype for p in tr.policy.parameters()} == {torch.float32}  # saving a bf16 copy did not touch them


def test_bf16_compute_resume_is_bitwise(tmp_path):
    common = dict(dtype="bfloat16", lr=1e-3, save_every=1)
    straight, _ = _train(tmp_path / "a", max_steps=4, **common)
    _train(tmp_path / "b", max_steps=2, **common)
    resumed = Trainer(Config(output_dir=str(tmp_path / "b"), max_steps=4, **{**SFT, **common}), resume="latest")
    resumed.run()
    for (n, a), b in zip(straight.policy.named_parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b), n


def test_grpo_step_under_bf16_compute(tmp_path):
    tr = Trainer(
        Config(
            method="grpo",
            model="tiny",
            task="arithmetic",
            output_dir=str(tmp_path),
            max_steps=1,
            batch_size=2,
            group_size=4,
            max_new_tokens=8,
            micro_batch_size=4,
            mu=2,
            dtype="bfloat16",
            progress=False,
            device="cpu",
        )
    )
    tr.run()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["skipped_steps"] == 0 and abs(row["grpo/kl"]) < 1e-3  # pi_ref and pi computed alike: KL ~ 0 at step 1


def test_a_mixed_precision_run_says_its_log_prob_gap_to_float32_past_the_bound(tmp_path, capsys):
    """16-bit compute over float32 weights: the probe text's log-probs under bf16 against float32, said on the run's
    first lines when the mean gap passes logprob_error_bound; silent under it and in float32."""
    Trainer(Config(output_dir=str(tmp_path / "a"), **{**SFT, "dtype": "bfloat16", "logprob_error_bound": 1e-7}))
    err = capsys.readouterr().err
    m = re.search(
        r"note: under dtype=bfloat16 this model's log-probs of a probe text differ from float32 by (\S+) nats "
        r"a token on average \(up to (\S+)\), past logprob_error_bound=1e-07; ratios and KL see gaps of this "
        r"size \(docs/precision.md\)\.\n",
        err,
    )
    assert m and 1e-7 < float(m[1]) <= float(m[2]) < 0.01, err  # the tiny random model's gap is small but not zero
    Trainer(Config(output_dir=str(tmp_path / "b"), **{**SFT, "dtype": "bfloat16"}))  # the default bound, 0.01
    Trainer(Config(output_dir=str(tmp_path / "c"), **{**SFT, "dtype": "float32", "logprob_error_bound": 1e-7}))
    assert "note: under dtype" not in capsys.readouterr().err


# --- float32_components: components kept in float32 under bf16 autocast ---------------------------------------------


def _batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (3, 20), generator=g)
    am, lm = torch.ones_like(ids), torch.zeros_like(ids)
    lm[:, 6:] = 1
    am[2, 15:] = 0  # a padded row
    lm[2, 15:] = 0
    return ids, am, lm


def _logps_and_grads(model, batch, bf16: bool):
    """The engine's log-probs [B, L] and the gradient of their mean over the loss tokens, under bf16 autocast or not."""
    ids, am, lm = batch
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        lp = engine.token_logprobs(model, ids, am, lm, 1.0, 7).logps
        loss = -(lp * lm).sum() / lm.sum()
    loss.backward()
    return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_component_kept_in_float32_gives_float32s_log_probs_and_gradient_exactly(family):
    """Oracle: the same model in float32, no autocast. Attention, MLP and head kept leave nothing to bf16 (embeddings,
    norms and the residual stream autocast never lowers): log-probs and gradient are float32's, bit for bit; also in a
    deep copy (the frozen reference is one)."""
    from test_family_sampling import tiny

    model = tiny(family) if family != "llama" else tiny_model(len(tiny_tokenizer()), seed=3)  # eval: no dropout
    batch = _batch(100)
    exact, g_exact = _logps_and_grads(model, batch, bf16=False)
    plain, _ = _logps_and_grads(model, batch, bf16=True)
    assert (plain - exact).abs().max() > 1e-5  # bf16 autocast really computes in bf16 here
    kept = copy.deepcopy(model)
    assert float32_parts.keep_float32(kept, ("attention", "mlp", "head")) >= 3
    for m in (kept, copy.deepcopy(kept)):
        lp, g = _logps_and_grads(m, batch, bf16=True)
        assert torch.equal(lp, exact) and torch.equal(g, g_exact)
    assert not torch.is_autocast_enabled("cpu")  # every hook left autocast as it found it


def test_each_kept_component_is_float32_and_only_it():
    """One component kept: the log-probs differ from float32 (the rest is bf16) and from all-bf16 (it was kept); the
    head kept makes the engine's chunked head take float32 operands (its own path, not the module's forward)."""
    model = tiny_model(len(tiny_tokenizer()), seed=3)
    batch = _batch(100)
    exact, _ = _logps_and_grads(model, batch, bf16=False)
    plain, _ = _logps_and_grads(model, batch, bf16=True)
    for c in float32_parts.COMPONENTS:
        m = copy.deepcopy(model)
        float32_parts.keep_float32(m, (c,))
        lp, _ = _logps_and_grads(m, batch, bf16=True)
        assert not torch.equal(lp, exact) and not torch.equal(lp, plain), c


def test_a_planted_bf16_product_inside_a_kept_component_breaks_float32_equality():
    """The check above can fail: one projection inside a kept MLP computed in bf16 (as a component the path forgot
    would be) moves the log-probs off float32's."""
    model = tiny_model(len(tiny_tokenizer()), seed=3)
    batch = _batch(100)
    exact, _ = _logps_and_grads(model, batch, bf16=False)
    float32_parts.keep_float32(model, ("attention", "mlp", "head"))
    down = float32_parts.modules_of(model, "mlp")[0].down_proj
    w = down.weight
    down.forward = lambda x: torch.nn.functional.linear(x.bfloat16(), w.bfloat16()).float()  # the planted component
    lp, _ = _logps_and_grads(model, batch, bf16=True)
    assert not torch.equal(lp, exact)


def test_float32_components_train_as_float32_and_refuse_what_they_cannot_keep(tmp_path):
    """SFT steps with everything kept move the weights exactly as float32 steps; a GRPO step samples through the kept
    attention (its KV cache float32) and its sampler's log-probs match the trainer's; a bad name, pure bf16 and an
    unknown component are one sentence each; in a float32 run the setting changes nothing."""
    from gcfamily.rollout import decode

    fp32, _ = _train(tmp_path / "fp32", dtype="float32", max_steps=2)
    kept, _ = _train(tmp_path / "kept", dtype="bfloat16", float32_components="attention,mlp,head", max_steps=2)
    for (n, a), b in zip(fp32.policy.named_parameters(), kept.policy.parameters()):
        assert torch.equal(a, b), n
    tr = Trainer(
        Config(
            **{**SFT, "method": "grpo", "batch_size": 2, "micro_batch_size": 4},
            group_size=4,
            max_new_tokens=6,
            max_steps=1,
            beta=0.04,
            dtype="bfloat16",
            float32_components=["attention"],
            rollout_compile="on",  # the compiled decode step cannot hold the hooks: it decodes eagerly, exactly
            output_dir=str(tmp_path / "grpo"),
        )
    )
    assert decode.why_not(tr.policy) == "float32_components keeps some of its modules in float32"
    tr.run()
    row = json.loads((tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["rollout/logp_diff_max"] < 0.05 and abs(row["grpo/kl"]) < 1e-3
    for bad, said in (
        (
            dict(float32_components="lm_head"),
            "float32_components must be none or a comma-separated list of attention, mlp, head (got 'lm_head')",
        ),
        (
            dict(float32_components="mlp", dtype="bfloat16", master_dtype="bfloat16"),
            "master_dtype=bfloat16 has no float32 weights",
        ),
    ):
        with pytest.raises(GcfError, match=re.escape(said)):
            Trainer(Config(output_dir=str(tmp_path / "bad"), **{**SFT, **bad}))
    Trainer(Config(output_dir=str(tmp_path / "f32"), **{**SFT, "dtype": "float32", "float32_components": "head"}))


def test_dtype_auto_says_what_it_chose(tmp_path, capsys):
    """auto on the CPU: float32, said on the first lines with the reason; an explicit dtype says nothing of it."""
    Trainer(Config(output_dir=str(tmp_path / "a"), **{**SFT, "progress": True}))
    assert "dtype=auto: float32 on the CPU, log-probs exact; bf16 compute" in capsys.readouterr().err
    Trainer(Config(output_dir=str(tmp_path / "b"), **{**SFT, "progress": True, "dtype": "float32"}))
    assert "dtype=auto" not in capsys.readouterr().err
    assert "dtype=auto: bfloat16 compute on cuda" in precision.auto_choice(torch.bfloat16, "cuda")
