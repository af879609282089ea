"""gcfamily.core.cpu_attention: the rollout's CPU attention equals SDPA's, leaves what it cannot take to SDPA, and always undoes its switch."""

import math

import pytest
import torch
from transformers import FalconConfig, FalconForCausalLM, Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

from gcfamily.core import cpu_attention
from gcfamily.core.cpu_attention import attention, rollout_attention


def _oracle(q, k, v, allowed, scale):
    """softmax over the allowed keys of (q . k) * scale, each query head on its own KV head (h // g), one query at a time."""
    B, H, Q, D = q.shape
    g = H // k.shape[1]
    out = torch.zeros(B, Q, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                keys = [j for j in range(k.shape[2]) if allowed[b, h, i, j]]
                if not keys:
                    continue  # nothing to attend: what the output is there is not specified (checked finite apart)
                s = torch.tensor(
                    [float(q[b, h, i].double() @ k[b, h // g, j].double()) * scale for j in keys], dtype=torch.float64
                )
                p = torch.softmax(s, 0)
                out[b, i, h] = sum(p[n] * v[b, h // g, j].double() for n, j in enumerate(keys))
    return out


class _Attn(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.num_key_value_groups = g


@torch.no_grad()
@pytest.mark.parametrize(
    "H,Hk,Q,mask_heads,batch_one",
    [(6, 2, 1, 1, False), (6, 2, 5, 1, False), (4, 4, 5, 1, False), (6, 3, 4, 6, False), (6, 2, 3, 1, True)],
)
def test_equals_sdpa_and_a_loop_oracle(H, Hk, Q, mask_heads, batch_one):
    torch.manual_seed(H * 100 + Hk * 10 + Q)
    B, S, D, Dv = 3, 9, 8, 8
    q, k, v = torch.randn(B, H, Q, D), torch.randn(B, Hk, S, D), torch.randn(B, Hk, S, Dv)
    allowed = torch.rand(1 if batch_one else B, mask_heads, Q, S) > 0.4
    allowed[..., -1] = True  # every query attends something here; a wholly masked query is checked below
    full = allowed.expand(B, H, Q, S)
    module = _Attn(H // Hk)
    for scale in (None, 0.3):
        got, w = attention(module, q, k, v, allowed, scaling=scale)
        assert w is None and got.shape == (B, Q, H, Dv)
        ref, _ = cpu_attention.sdpa_attention_forward(module, q, k, v, allowed, scaling=scale)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        oracle = _oracle(q, k, v, full, scale if scale is not None else 1 / math.sqrt(D))
        torch.testing.assert_close(got.double(), oracle, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_one_query_without_a_mask_attends_every_key():
    # what transformers passes for a decoding step when no row has padding (its mask is skipped)
    torch.manual_seed(2)
    q, k, v = torch.randn(4, 6, 1, 8), torch.randn(4, 2, 7, 8), torch.randn(4, 2, 7, 8)
    got, _ = attention(_Attn(3), q, k, v, None)
    ref, _ = cpu_attention.sdpa_attention_forward(_Attn(3), q, k, v, None)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        got.double(), _oracle(q, k, v, torch.ones(4, 6, 1, 7, dtype=torch.bool), 8**-0.5), rtol=1e-5, atol=1e-5
    )
    assert cpu_attention._plain(q, k, None, 0.0, {})


@torch.no_grad()
def test_a_query_with_nothing_to_attend_is_finite_and_the_others_are_unchanged():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    allowed = torch.ones(2, 1, 3, 5, dtype=torch.bool).tril(2)
    allowed[0, 0, 0] = False  # a left-padding position: its output is never read, but it must not turn into NaN
    got, _ = attention(_Attn(2), q, k, v, allowed)
    ref, _ = cpu_attention.sdpa_attention_forward(_Attn(2), q, k, v, allowed)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[0, 1:], ref[0, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


def test_calls_it_cannot_take_go_to_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", lambda *a, **kw: calls.append(kw) or ("sdpa", None))
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    m = _Attn(1)
    with torch.no_grad():
        assert isinstance(attention(m, q, k, v, mask, sliding_window=2)[0], torch.Tensor)  # the mask holds the window
        assert attention(m, q, k, v, None)[0] == "sdpa"  # no mask over several queries: SDPA's is_causal decides
        assert attention(m, q, k, v, mask.float())[0] == "sdpa"  # an additive mask
        assert attention(m, q, k, v, mask, dropout=0.1)[0] == "sdpa"
        assert attention(m, q, k, v, mask, softcap=30.0)[0] == "sdpa"  # SDPA refuses it, as it should
        assert attention(m, q, k, v, mask, s_aux=torch.zeros(2))[0] == "sdpa"  # attention sinks
        assert attention(m, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)[0] == "sdpa"
        two = torch.randn(2, 2, 3, 4)  # keys of two rows for a query of one: SDPA broadcasts it
        assert attention(m, q, two, two, mask)[0] == "sdpa"
        Q = cpu_attention.MAX_QUERIES + 1  # a long prefill: SDPA's kernel is faster there
        long = torch.ones(1, 1, Q, Q, dtype=torch.bool).tril()
        assert (
            attention(m, torch.randn(1, 2, Q, 4), torch.randn(1, 2, Q, 4), torch.randn(1, 2, Q, 4), long)[0] == "sdpa"
        )
    q.requires_grad_(True)
    assert attention(m, q, k, v, mask)[0] == "sdpa"  # training keeps SDPA's backward
    assert len(calls) == 9


def _qwen2():
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(cfg).eval()


def test_switch_is_scoped_restored_after_an_error_and_only_without_gradients():
    model = _qwen2()
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"):
        with torch.no_grad(), rollout_attention(model) as on:
            assert on and model.config._attn_implementation == cpu_attention.KEY
            raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"
    with rollout_attention(model) as on:  # gradients on
        assert not on and model.config._attn_implementation == "sdpa"
    eager = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            attn_implementation="eager",
        )
    )
    with torch.no_grad(), rollout_attention(eager) as on:  # only SDPA is replaced
        assert not on and eager.config._attn_implementation == "eager"
    falcon = FalconForCausalLM(
        FalconConfig(
            vocab_size=96,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=True,
            num_kv_heads=2,
            alibi=False,
        )
    ).eval()
    assert falcon.config._attn_implementation == "sdpa"
    with (
        torch.no_grad(),
        rollout_attention(falcon) as on,
    ):  # its forward branches on the name "sdpa": a family not checked keeps it
        assert not on and falcon.config._attn_implementation == "sdpa"


@torch.no_grad()
def test_a_model_gives_the_same_logits_through_it():
    model = _qwen2()
    ids = torch.randint(2, 96, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :3] = 0  # left padding: the masked queries' outputs are never read
    mask[2, :1] = 0
    ref = model(input_ids=ids, attention_mask=mask).logits
    calls = []
    real = cpu_attention.attention

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    cpu_attention.AttentionInterface.register(cpu_attention.KEY, counted)
    try:
        with rollout_attention(model):
            got = model(input_ids=ids, attention_mask=mask).logits
    finally:
        cpu_attention.AttentionInterface.register(cpu_attention.KEY, real)
    assert len(calls) == 2  # both layers went through it
    real_rows = mask.bool()
    torch.testing.assert_close(got[real_rows], ref[real_rows], rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("ragged", [True, False])
def test_greedy_rollout_is_the_same_with_and_without(monkeypatch, ragged):
    from gcfamily.rollout import SamplingSettings, generate

    class Tok:  # ids in, ids out: enough for generate
        pad_token_id, eos_token_id = 0, 1

        def batch_decode(self, rows, skip_special_tokens=True):
            return [" ".join(map(str, r)) for r in rows]

    model = _qwen2()
    if ragged:  # left padding: every step has a mask
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [10, 11, 12, 13, 14, 15, 16, 17, 19, 20]]
    else:  # no padding: transformers skips the mask, and the one-token steps get none
        prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    settings = SamplingSettings(greedy=True, max_new_tokens=12)
    taken = []
    real = cpu_attention._plain

    def spy(query, key, mask, *rest):
        ok = real(query, key, mask, *rest)
        if ok:
            taken.append((query.shape[2], mask is None))
        return ok

    monkeypatch.setattr(cpu_attention, "_plain", spy)
    on = generate(model, Tok(), prompts, 2, settings)
    assert (1, not ragged) in taken  # the one-token steps took it, with a mask or without
    assert ragged == any(q > 1 for q, _ in taken)  # so did a masked prefill; an unmasked one (causal) stays on SDPA
    monkeypatch.setattr(cpu_attention, "ENABLED", False)
    off = generate(model, Tok(), prompts, 2, settings)
    assert torch.equal(on.input_ids, off.input_ids)
    torch.testing.assert_close(on.sample_logps, off.sample_logps, rtol=0, atol=1e-5)
