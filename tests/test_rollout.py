"""Properties of gcfamily.rollout on a tiny random Llama and a character-level tokenizer."""

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from gcfamily.errors import GcfError
from gcfamily.rollout import Rollout, SamplingSettings, generate, sample_tokens

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,+-=?!:;()[]<>/*#$%&@^_~"  # 62 chars + 2 specials = 64 ids
PAD, EOS = 0, 1


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": PAD, "<eos>": EOS, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern=Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()  # characters join without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    # Different lengths so left padding matters.
    return [tokenizer(p)["input_ids"] for p in ["what is 2+3?", "hi", "12*4=", "say abc then stop."]]


def run(model, tokenizer, prompts, G=4, seed=0, eos=(EOS,), **kw) -> Rollout:
    settings = SamplingSettings(**{"max_new_tokens": 24, **kw})
    return generate(model, tokenizer, prompts, G, settings, torch.Generator().manual_seed(seed), list(eos))


def forward_logps(model, ro: Rollout, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of a fresh full forward pass, at each position's own token: [N, T]."""
    pos = (ro.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask, position_ids=pos).logits
    logps = torch.log_softmax(logits[:, :-1].float() / temperature, -1).gather(-1, ro.input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(logps[:, :1]), logps], 1)


@pytest.mark.parametrize(
    "kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=0.7, top_k=5)]
)
def test_sample_logps_match_a_later_forward_pass(model, tokenizer, prompts, kw):
    # Filtering changes what can be drawn, not the recorded log-prob: that is of the full distribution.
    ro = run(model, tokenizer, prompts, eos=(EOS, 5), **kw)
    m = ro.completion_mask.bool()
    ref = forward_logps(model, ro, kw["temperature"])
    assert (ref[m] - ro.sample_logps[m]).abs().mean() < 1e-5
    assert (ro.sample_logps[~m] == 0).all()


def test_same_seed_same_rollout_other_seed_differs(model, tokenizer, prompts):
    a, b, c = (run(model, tokenizer, prompts, seed=s) for s in (0, 0, 1))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.sample_logps, b.sample_logps)
    assert a.completions == b.completions
    assert a.input_ids.shape != c.input_ids.shape or not torch.equal(a.input_ids, c.input_ids)


def hf_greedy(model, tokenizer, prompts, eos, G=2, max_new_tokens=24) -> tuple[torch.Tensor, torch.Tensor]:
    """HF generate's greedy completions [N, max_new_tokens] for the prompts, each repeated G times, and the left-padded prompts."""
    tokenizer.padding_side = "left"
    enc = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    ref = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=PAD)
    P = enc["input_ids"].shape[1]
    return ref[:, P:].repeat_interleave(G, 0), enc["input_ids"].repeat_interleave(G, 0)


def assert_greedy_equals_hf(ro: Rollout, model, tokenizer, prompts, eos, G=2) -> None:
    ref, prompt = hf_greedy(model, tokenizer, prompts, eos, G)
    P = prompt.shape[1]
    C = ro.input_ids.shape[1] - P
    assert torch.equal(ro.input_ids[:, :P], prompt)  # prompts left-padded, as HF lays them out
    assert torch.equal(ro.input_ids[:, P:], ref[:, :C]) and (ref[:, C:] == PAD).all()


def test_greedy_matches_hf_generate(model, tokenizer, prompts):
    # Several EOS ids so rows end at different steps and get dropped from the batch, which HF never does.
    eos = [EOS, 5, 9, 12]
    ro = run(model, tokenizer, prompts, G=2, eos=eos, greedy=True)
    assert_greedy_equals_hf(ro, model, tokenizer, prompts, eos)
    assert len(set(ro.completion_lengths.tolist())) > 1
    # Greedy log-probs are at temperature 1.
    m = ro.completion_mask.bool()
    assert (forward_logps(model, ro, 1.0)[m] - ro.sample_logps[m]).abs().mean() < 1e-5


def test_top_k_one_is_greedy(model, tokenizer, prompts):
    greedy = run(model, tokenizer, prompts, greedy=True)
    top1 = run(model, tokenizer, prompts, top_k=1, temperature=1.0, seed=3)
    assert torch.equal(greedy.input_ids, top1.input_ids)


def test_masks_lengths_and_truncation(model, tokenizer, prompts):
    # Three EOS ids make some rows end and others run to max_new_tokens.
    eos = (EOS, 5, 9)
    ro = run(model, tokenizer, prompts, G=8, eos=eos, max_new_tokens=20)
    P = len(max(prompts, key=len))
    comp = ro.input_ids[:, P:]
    cm = ro.completion_mask[:, P:]
    assert ro.truncated.any() and (~ro.truncated).any()
    assert (ro.completion_mask[:, :P] == 0).all() and torch.equal(cm.sum(1), ro.completion_lengths)
    assert torch.equal(ro.attention_mask[:, P:], cm)
    assert ro.input_ids.shape[1] == P + int(ro.completion_lengths.max())  # trimmed to the longest completion
    for row, L, trunc in zip(comp, ro.completion_lengths.tolist(), ro.truncated.tolist()):
        ended = row[L - 1].item() in eos
        assert ended != trunc  # truncated iff it did not end with an EOS
        assert not trunc or L == 20
        assert not any(t in eos for t in row[: L - 1].tolist())  # the first EOS ends it and is kept
        assert (row[L:] == PAD).all()
    assert torch.equal(ro.prompt_index, torch.arange(len(prompts)).repeat_interleave(8))
    for n, i in enumerate(ro.prompt_index.tolist()):  # prompts left-padded, G rows each
        p = prompts[i]
        assert ro.input_ids[n, P - len(p) : P].tolist() == p and ro.attention_mask[n, :P].sum() == len(p)
    assert len({tuple(r) for r in comp[:8].tolist()}) > 1  # one shared prefill, yet G different samples


def test_stop_string_ends_completion(model, tokenizer):
    prompt = [tokenizer("hello")["input_ids"]]
    free = run(model, tokenizer, prompt, G=1, eos=(), max_new_tokens=30)
    text = free.completions[0]
    stop = text[9:11]  # a 2-char string first completed by token 11 or earlier
    end = text.find(stop) + len(stop)
    ro = run(model, tokenizer, prompt, G=1, eos=(), max_new_tokens=30, stop_strings=(stop, "never!!"))
    assert ro.completions[0] == text[:end] and ro.completions[0].endswith(stop)
    assert ro.completion_lengths.tolist() == [end] and not ro.truncated.item()
    assert torch.equal(ro.input_ids[0], free.input_ids[0, : ro.input_ids.shape[1]])


def test_stop_strings_in_a_batch(model, tokenizer, prompts):
    # An EOS may come before the loop's next stop check; the lengths must not depend on when checks ran.
    eos = (EOS, 5)
    ro = run(model, tokenizer, prompts, G=8, eos=eos, max_new_tokens=30, stop_strings=("e",))
    P = len(max(prompts, key=len))
    e_id = tokenizer.convert_tokens_to_ids("e")
    assert (ro.completion_lengths < 30).any()
    for text, ids, L, trunc in zip(
        ro.completions, ro.input_ids[:, P:].tolist(), ro.completion_lengths.tolist(), ro.truncated.tolist()
    ):
        assert text == tokenizer.decode(ids[:L], skip_special_tokens=True)
        # Character tokens: a completion stops exactly at its first "e", which is kept; else at an EOS or the limit.
        assert "e" not in text[:-1]
        assert trunc == (ids[L - 1] != e_id and ids[L - 1] not in eos)
        assert not trunc or L == 30


def test_bad_settings_say_what_to_change(model, tokenizer, prompts):
    with pytest.raises(GcfError, match="greedy"):
        run(model, tokenizer, prompts, temperature=0.0)
    with pytest.raises(GcfError, match="top_p"):
        run(model, tokenizer, prompts, top_p=0.0)


def test_top_p_never_samples_outside_the_nucleus():
    # probs 0.5, 0.3, 0.15, 0.05: the smallest set reaching 0.7 is {0, 1}.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().repeat(4000, 1)
    tokens, logps = sample_tokens(logits, SamplingSettings(top_p=0.7), torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}
    assert abs((tokens == 0).float().mean().item() - 0.625) < 0.03  # renormalised 0.5 / 0.8
    assert torch.allclose(logps, logits[0].log_softmax(-1)[tokens])  # recorded logps are unfiltered
    top2, _ = sample_tokens(logits, SamplingSettings(top_k=2, top_p=0.99), torch.Generator().manual_seed(0))
    assert set(top2.tolist()) == {0, 1}


@pytest.mark.parametrize("V", [300, 512])  # padded to the sampler's chunk, and not
def test_sampler_draws_from_the_softmax(V):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g) * 2
    logits[::7] = float("-inf")  # tokens of probability zero must never come out
    n = 40000
    tokens, _ = sample_tokens(logits.repeat(n, 1), SamplingSettings(temperature=0.8), g)
    freq = torch.bincount(tokens, minlength=V).float() / n
    p = torch.softmax(logits / 0.8, -1)
    assert freq[::7].sum() == 0
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-4).all()  # within 5 sigma everywhere


def test_top_p_in_generate_stays_in_the_models_nucleus(model, tokenizer, prompts):
    ro = run(model, tokenizer, prompts, G=8, temperature=0.8, top_p=0.3)
    pos = (ro.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask, position_ids=pos).logits[:, :-1]
    probs, order = torch.softmax(logits / 0.8, -1).sort(-1, descending=True)
    keep_sorted = probs.cumsum(-1) - probs < 0.3 + 1e-4  # mass ranked above is still short of top_p
    in_nucleus = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    taken = in_nucleus.gather(-1, ro.input_ids[:, 1:, None])[..., 0]
    assert taken[ro.completion_mask[:, 1:].bool()].all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rollout_matches_forward_and_is_seeded(model, tokenizer, prompts, dtype):
    cuda = LlamaForCausalLM(model.config).to("cuda", dtype).eval()
    cuda.load_state_dict(model.state_dict())
    settings = SamplingSettings(max_new_tokens=24, temperature=0.7, top_p=0.95)
    # A CPU generator drives a CUDA model (one uniform per row crosses over), and so does a CUDA one.
    for gen in (lambda: torch.Generator().manual_seed(0), lambda: torch.Generator("cuda").manual_seed(0)):
        a, b = (generate(cuda, tokenizer, prompts, 4, settings, gen(), [EOS, 5]) for _ in range(2))
        assert a.input_ids.is_cuda and torch.equal(a.input_ids, b.input_ids)
        m = a.completion_mask.bool()
        # bf16: the cached step and the full forward round differently; float32 agrees to float error.
        tol = 1e-4 if dtype == torch.float32 else 0.05
        assert (forward_logps(cuda, a, 0.7)[m] - a.sample_logps[m]).abs().mean() < tol


SHARED = [
    "you are terse. q: what is 2+3?",
    "you are terse. q: hi",
    "you are terse. q: 12*4=",
    "you are terse. q: say abc then stop.",
]


def test_shared_prefix_length():
    from gcfamily.rollout.native import _SHARE_MIN, _shared_prefix

    assert _shared_prefix([[1, 2, 3] * 5, [1, 2, 3] * 5 + [9]]) == 14  # each prompt keeps at least one token of its own
    assert _shared_prefix([[5] * 20]) == 0 and _shared_prefix([[1] * 20, [2] * 20]) == 0
    assert (
        _shared_prefix([[7] * (_SHARE_MIN - 1) + [1, 1], [7] * (_SHARE_MIN - 1) + [2, 2]]) == 0
    )  # too short to bother


def test_prompts_with_a_common_prefix_prefill_it_once_and_decode_the_same(model, tokenizer):
    # "you are terse. q: " (18 tokens) is computed once; greedy tokens must still equal HF's, and logps a fresh forward's.
    import gcfamily.rollout.native as rollout

    prompts = [tokenizer(p)["input_ids"] for p in SHARED]
    assert rollout._shared_prefix(prompts) == 18
    eos = [EOS, 5, 9, 12]
    ro = run(model, tokenizer, prompts, G=2, eos=eos, greedy=True)
    assert_greedy_equals_hf(ro, model, tokenizer, prompts, eos)  # the Rollout's layout is unchanged too
    sampled = run(model, tokenizer, prompts, G=4, eos=eos, temperature=0.8)
    m = sampled.completion_mask.bool()
    assert (forward_logps(model, sampled, 0.8)[m] - sampled.sample_logps[m]).abs().max() < 1e-5
