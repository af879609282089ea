"""The engine's log-probs and its one weighted backward."""

import pytest
import torch

from gcfamily.core import engine
from gcfamily.core.batch import TOKEN, Batch
from gcfamily.data.batches import split_batch
from gcfamily.models import tiny_model


def _batch(B=8, L=12, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, V, (B, L), generator=g)
    lengths = torch.randint(L // 2, L + 1, (B,), generator=g)
    attention_mask = (torch.arange(L)[None] < lengths[:, None]).long()
    prompt_len = torch.randint(1, L // 2, (B,), generator=g)
    loss_mask = attention_mask * (torch.arange(L)[None] >= prompt_len[:, None]).long()
    return Batch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)


def _naive_logps(model, batch, temperature=1.0):
    logits = (
        model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=engine.position_ids_from_mask(batch.attention_mask),
        ).logits.float()
        / temperature
    )
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)
    return lp * batch.loss_mask


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_naive(chunk, temperature):
    model = tiny_model(50, seed=1)
    batch = _batch()
    got = engine.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask, temperature, chunk).logps
    want = _naive_logps(model, batch, temperature)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("chunk", [3, 1000])
def test_chunked_backward_matches_autograd(chunk):
    """The hand-written backward of the chunked projection equals autograd of the naive path."""
    model = tiny_model(50, seed=2)
    batch = _batch(seed=3)
    w = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(4))  # arbitrary upstream grad
    lp = engine.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask, 0.9, chunk).logps
    (lp * w).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (_naive_logps(model, batch, 0.9) * w).sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, atol=1e-5, rtol=1e-4), n


def test_entropy_matches_naive():
    model = tiny_model(50, seed=1)
    batch = _batch()
    out = engine.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0, 5)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    p = torch.softmax(logits, -1)
    ent = -(p * torch.log_softmax(logits, -1)).sum(-1) * batch.loss_mask[:, 1:]
    assert torch.allclose(out.entropy[:, 1:], ent, atol=1e-5)
    with torch.no_grad():  # forward-only passes (pi_old, the reference) skip the entropy, not the log-probs
        ref = engine.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0, 5)
    assert torch.equal(ref.logps, out.logps.detach()) and not ref.entropy.any()


def test_left_padding_gives_same_logprobs():
    """A left-padded row has the same log-probs as the unpadded row (positions skip the padding)."""
    model = tiny_model(50, seed=1)
    ids = torch.randint(3, 50, (1, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 8, dtype=torch.long)
    lm = torch.zeros(1, 8, dtype=torch.long)
    lm[:, 4:] = 1
    a = engine.token_logprobs(model, ids, mask, lm).logps
    pad_ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    pad_mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), mask], 1)
    pad_lm = torch.cat([torch.zeros(1, 3, dtype=torch.long), lm], 1)
    b = engine.token_logprobs(model, pad_ids, pad_mask, pad_lm).logps[:, 3:]
    assert torch.allclose(a, b, atol=1e-5)


def _grad_of_step(model, batch, coef, mode, micro, norm_constant=1.0):
    model.zero_grad()
    mbs = split_batch(batch.copy().put("coef", coef, TOKEN), micro)
    Z = engine.normaliser(mbs, mode, norm_constant)
    for mb in mbs:
        lp = engine.token_logprobs(model, mb.input_ids, mb.attention_mask, mb.loss_mask).logps
        engine.weighted_loss(mb.own["coef"], lp, mb, mode, Z).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("mode", engine.NORM_MODES)
def test_gradient_accumulation_matches_one_batch(mode):
    """One batch of 8 and 4 micro-batches of 2 give the same gradient in every normalisation mode."""
    model = tiny_model(50, seed=5)
    batch = _batch(seed=6)
    batch.valid = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1]).bool()  # invalid rows count nowhere
    coef = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(7))
    full = _grad_of_step(model, batch, coef, mode, 8, 16.0)
    accum = _grad_of_step(model, batch, coef, mode, 2, 16.0)
    assert torch.allclose(full, accum, atol=1e-6, rtol=1e-4)


def test_normaliser_by_hand():
    # two rows: 3 and 1 loss tokens, the second row invalid
    b = Batch(
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        loss_mask=torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1]]),
        valid=torch.tensor([True, False]),
    )
    assert engine.normaliser([b], "token") == 3.0  # 3 valid tokens
    assert engine.normaliser([b], "sequence") == 1.0  # 1 valid sequence
    assert engine.normaliser([b, b], "sum") == 2.0  # one valid sequence per micro-batch
    assert engine.normaliser([b], "constant", 64.0) == 64.0  # 64 per valid sequence
    w = engine.token_weights(b, "sequence")
    assert torch.allclose(w[0], torch.tensor([0, 1 / 3, 1 / 3, 1 / 3]))  # 1/|o| on each token
    assert w[1].sum() == 0


def test_lr_schedule_shapes():
    f = engine.lr_lambda("cosine", 2, 12, 0.1)
    assert f(0) == pytest.approx(1 / 3) and f(1) == pytest.approx(2 / 3)  # warm-up
    assert f(2) == pytest.approx(1.0) and f(12) == pytest.approx(0.1)  # peak, then down to min_ratio
    assert engine.lr_lambda("linear", 0, 10)(5) == pytest.approx(0.5)


def _grouped_batch(n_prompts=3, G=4, P=12, C=6, V=50, seed=0):
    """n_prompts left-padded prompts (lengths differ), each repeated G times, then right-padded completions."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, V, (n_prompts, P), generator=g)
    pmask = torch.ones(n_prompts, P, dtype=torch.long)
    pmask[0, :3] = 0  # a shorter prompt, left-padded
    prompt = (prompt * pmask).repeat_interleave(G, 0)
    pmask = pmask.repeat_interleave(G, 0)
    comp = torch.randint(3, V, (n_prompts * G, C), generator=g)
    cmask = (torch.arange(C)[None] < torch.randint(1, C + 1, (n_prompts * G,), generator=g)[:, None]).long()
    return Batch(
        input_ids=torch.cat([prompt, comp * cmask], 1),
        attention_mask=torch.cat([pmask, cmask], 1),
        loss_mask=torch.cat([torch.zeros_like(pmask), cmask], 1),
    )


def test_shared_prefix_is_found_in_groups_only():
    batch = _grouped_batch()
    S, first, inverse = engine.shared_prefix(batch.input_ids, batch.attention_mask, batch.loss_mask)
    assert S == 11 and len(first) == 3
    groups = inverse.view(3, 4)
    assert (groups == groups[:, :1]).all() and len(
        set(groups[:, 0].tolist())
    ) == 3  # one prefix per group, groups apart
    assert (first[inverse] // 4 == torch.arange(12) // 4).all()  # each row's representative is from its own group
    distinct = _batch()  # every row its own prompt: no sharing
    assert engine.shared_prefix(distinct.input_ids, distinct.attention_mask, distinct.loss_mask) is None


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_shared_prefix_logprobs_and_gradient_match_naive(temperature):
    """Prompts run once per group through a gathered KV cache: same log-probs, same gradient as the full pass."""
    model = tiny_model(50, seed=8)
    batch = _grouped_batch(seed=9)
    w = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(10))
    grads, logps = {}, {}
    for share in (True, False):
        model.zero_grad()
        out = engine.token_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.loss_mask, temperature, 5, share
        )
        (out.logps * w).sum().backward()
        grads[share] = {n: p.grad.clone() for n, p in model.named_parameters()}
        logps[share] = out.logps.detach()
    model.zero_grad()
    (_naive_logps(model, batch, temperature) * w).sum().backward()
    assert torch.allclose(logps[True], _naive_logps(model, batch, temperature).detach(), atol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(grads[True][n], p.grad, atol=1e-5, rtol=1e-4), n
        assert torch.allclose(grads[True][n], grads[False][n], atol=1e-5, rtol=1e-4), n


def test_packing_runs_each_prompt_once_and_no_padding():
    """One backbone call over U*S prefix tokens plus every row's real suffix tokens, not B*L padded columns."""
    model = tiny_model(50, seed=8)
    batch = _grouped_batch(n_prompts=3, G=4, P=12, C=6)
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape))
    engine.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0, 256, True)
    hook.remove()
    S = 11
    per_group = [S + int(batch.attention_mask[g * 4 : g * 4 + 4, S:].sum()) for g in range(3)]
    assert seen == [torch.Size([3, max(per_group)])]


def _assert_packed_matches_naive(model, batch, g):
    """The engine's (packed) log-probs and parameter gradients equal the padded naive pass."""
    w = torch.randn(batch.input_ids.shape, generator=g)  # an arbitrary upstream gradient
    out = engine.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0, 8)
    (out.logps * w).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = _naive_logps(model, batch)
    (want * w).sum().backward()
    assert torch.allclose(out.logps, want.detach(), atol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, atol=1e-5, rtol=1e-4), n


def test_packing_without_a_shared_prefix_matches_naive():
    """Right-padded rows of very different lengths (SFT's layout) are packed end to end: same log-probs and gradient."""
    from gcfamily.data.batches import collate

    model = tiny_model(50, seed=13)
    g = torch.Generator().manual_seed(14)
    rows = [
        (torch.randint(3, 50, (p,), generator=g).tolist(), torch.randint(3, 50, (c,), generator=g).tolist())
        for p, c in [(3, 2), (4, 40), (2, 3), (5, 38)]
    ]
    batch = collate(rows, 0)
    assert engine.shared_prefix(batch.input_ids, batch.attention_mask, batch.loss_mask) is None
    packing = engine.pack_rows(batch.input_ids, batch.attention_mask, batch.loss_mask)
    assert packing.input_ids.shape == (1, 5 + 44 + 5 + 43)  # end to end in one row, no padding
    _assert_packed_matches_naive(model, batch, g)


def test_packed_rows_are_balanced_under_the_cap(monkeypatch):
    """Rows that need more than one packed row are spread evenly (GRPO's 8 samples of 64 tokens behind a 40-token prompt:
    2 x 296 columns, not 488 + 104 padded to 2 x 488), with the same log-probs and gradient as the padded pass."""
    from gcfamily.core import packing as packing_mod

    G, P, C = 8, 5, 8
    ids = torch.cat(
        [torch.arange(3, 3 + P).repeat(G, 1), torch.randint(3, 50, (G, C), generator=torch.Generator().manual_seed(1))],
        1,
    )
    ones = torch.ones_like(ids)
    loss = torch.cat([torch.zeros(G, P, dtype=torch.long), torch.ones(G, C, dtype=torch.long)], 1)
    monkeypatch.setattr(packing_mod, "PACK_LENGTH", P + 7 * C)  # first fit: 7 rows, then 1
    packed = engine.pack_rows(ids, ones, loss)
    assert packed.input_ids.shape == (2, P - 1 + 4 * (C + 1))  # the prefix once per packed row, then 4 rows each
    batch = _grouped_batch(n_prompts=2, G=6, P=12, C=9, seed=3)  # ragged completions, two prompts: balanced per prompt
    monkeypatch.setattr(packing_mod, "PACK_LENGTH", 11 + 30)
    packed = engine.pack_rows(batch.input_ids, batch.attention_mask, batch.loss_mask)
    real = batch.attention_mask[:, 11:].sum(1).tolist()
    assert packed.input_ids.shape[0] == 4 and packed.input_ids.shape[1] < 11 + max(30, max(real)) - 1
    _assert_packed_matches_naive(tiny_model(50, seed=4), batch, torch.Generator().manual_seed(5))


def test_packing_is_skipped_when_rows_fill_the_batch():
    batch = Batch(
        input_ids=torch.ones(3, 5, dtype=torch.long),
        attention_mask=torch.ones(3, 5, dtype=torch.long),
        loss_mask=torch.ones(3, 5, dtype=torch.long),
    )
    assert engine.pack_rows(batch.input_ids, batch.attention_mask, batch.loss_mask) is None


def test_common_prefix_of_different_prompts_is_shared():
    """Rows that start with the same tokens (a system prompt) before different questions share those."""
    from gcfamily.data.batches import collate

    model = tiny_model(50, seed=15)
    g = torch.Generator().manual_seed(16)
    system = torch.randint(3, 50, (9,), generator=g).tolist()
    rows = [
        (system + torch.randint(3, 50, (q,), generator=g).tolist(), torch.randint(3, 50, (c,), generator=g).tolist())
        for q, c in [(4, 3), (6, 2), (5, 7)]
    ]
    batch = collate(rows, 0)
    S, first, inverse = engine.shared_prefix(batch.input_ids, batch.attention_mask, batch.loss_mask)
    assert S == 9 and inverse.tolist() == [0, 0, 0] and first.tolist() == [0]
    _assert_packed_matches_naive(model, batch, g)


def test_shared_prefix_of_right_padded_pairs():
    """DPO's layout: a pair's two rows share the prompt at the start; rows of other prompts stay apart."""
    model = tiny_model(50, seed=11)
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 50, (n,), generator=g).tolist() for n in (10, 13)]
    rows = [(p, torch.randint(3, 50, (k,), generator=g).tolist()) for p in prompts for k in (3, 5)]
    from gcfamily.data.batches import collate

    batch = collate(rows, 0)
    S, first, inverse = engine.shared_prefix(batch.input_ids, batch.attention_mask, batch.loss_mask)
    assert S == 9 and inverse[0] == inverse[1] and inverse[2] == inverse[3] and inverse[0] != inverse[2]
    a = engine.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0, 4, True).logps
    assert torch.allclose(a, _naive_logps(model, batch), atol=1e-5)


def test_host_copies_give_the_same_logprobs_and_gradient():
    """The trainer hands CPU copies of ids and masks (so a GPU is never read back mid-micro-batch): bitwise the same result."""
    model = tiny_model(50, seed=8)
    batch = _grouped_batch(seed=11)
    ids, am, lm = batch.input_ids, batch.attention_mask, batch.loss_mask
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(12))
    got = {}
    for host in (None, (ids.clone(), am.clone(), lm.clone())):
        model.zero_grad()
        out = engine.token_logprobs(model, ids, am, lm, 1.0, 5, True, host)
        (out.logps * w).sum().backward()
        got[host is None] = (out.logps.detach(), out.entropy, [p.grad.clone() for p in model.parameters()])
    (a, ea, ga), (b, eb, gb) = got[True], got[False]
    assert torch.equal(a, b) and torch.equal(ea, eb) and all(torch.equal(x, y) for x, y in zip(ga, gb))
    assert (a[lm.bool()[:, :]] != 0).any() and (a[~lm.bool()] == 0).all()


def test_rows_without_loss_tokens_that_end_inside_the_shared_prefix():
    """Two identical short rows with no loss token beside rows whose loss starts later: the short rows add nothing after
    the prefix (before, a negative span raised inside the packing), and every log-prob equals the padded pass."""
    ids = torch.tensor(
        [
            [5, 6, 0, 0, 0, 0, 0, 0],
            [5, 6, 0, 0, 0, 0, 0, 0],
            [7, 8, 9, 10, 11, 12, 13, 0],
            [7, 8, 9, 10, 11, 14, 15, 16],
        ]
    )
    am = (ids > 0).long()
    lm = torch.zeros_like(ids)
    lm[2, 5:7], lm[3, 5:8] = 1, 1
    batch = Batch(input_ids=ids, attention_mask=am, loss_mask=lm)
    assert engine.pack_rows(ids, am, lm) is not None
    _assert_packed_matches_naive(tiny_model(50, seed=1), batch, torch.Generator().manual_seed(2))
