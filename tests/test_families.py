"""Random tiny models of many transformers families: packed log-probs and gradients, the plain padded pass and
the greedy rollout all equal the model's own computation, at lengths past every sliding window; what cannot be
exact is refused in one sentence."""

import pytest
import torch
import transformers as tf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gcfamily.core import engine, families, packing
from gcfamily.core.batch import Batch
from gcfamily.errors import GcfError
from gcfamily.rollout import SamplingSettings, generate

V, PAD, EOS = 128, 0, 1
W = 8  # every sliding window below; rows run to ~50 tokens
SMALL = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=PAD,
    eos_token_id=EOS,
    bos_token_id=2,
    tie_word_embeddings=False,
)
SL, FU = "sliding_attention", "full_attention"

# name: (causal LM class, config class, config fields, windowed layer kinds the packed masks must have; None: a
# family the packed path is not checked on, which must take the plain padded pass)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(num_hidden_layers=2), set()),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_hidden_layers=2, use_sliding_window=False), set()),
    "qwen2.5-sliding": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=W, max_window_layers=1),
        {SL},
    ),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_hidden_layers=2, head_dim=8), set()),
    "qwen2-moe-sliding": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            use_sliding_window=True,
            sliding_window=W,
            max_window_layers=2,
        ),
        {SL},
    ),
    "qwen3-moe-sliding": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            use_sliding_window=True,
            sliding_window=W,
        ),
        {SL},
    ),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(num_hidden_layers=2, sliding_window=W), {SL}),
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            num_hidden_layers=2, head_dim=8, sliding_window=W, attn_logit_softcapping=5.0, final_logit_softcapping=None
        ),
        {SL},
    ),
    # as shipped, the logits soft-capped too (a cap of 0.5 so that it bends a random tiny model's logits; Gemma 2 uses 30)
    "gemma2-final-softcap": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            num_hidden_layers=2, head_dim=8, sliding_window=W, attn_logit_softcapping=5.0, final_logit_softcapping=0.5
        ),
        {SL},
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(num_hidden_layers=3, head_dim=8, sliding_window=W, layer_types=[SL, SL, FU]),
        {SL},
    ),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(num_hidden_layers=2, sliding_window=W), {SL}),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(num_hidden_layers=2), set()),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", dict(num_hidden_layers=4), set()),  # layer 3 has no RoPE
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256), set()),
    "starcoder2-sliding": (
        "Starcoder2ForCausalLM",
        "Starcoder2Config",
        dict(num_hidden_layers=2, sliding_window=W),
        None,
    ),
}


REFUSED = {  # name: (causal LM class, config class, config fields, what the one sentence names)
    "gemma3-bidirectional": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(num_hidden_layers=2, head_dim=8, use_bidirectional_attention=True),
        "bidirectionally",
    ),
    "cohere-logit-scale": ("CohereForCausalLM", "CohereConfig", dict(num_hidden_layers=2), "logit_scale=0.0625"),
    "llama4-no-decoder": (
        "Llama4ForCausalLM",
        "Llama4TextConfig",
        dict(num_hidden_layers=2, head_dim=8, intermediate_size_mlp=64, num_local_experts=2, attention_chunk_size=W),
        "Llama4ForCausalLM",
    ),
}


def build(name: str, **override):
    """A random float32 model of the family, through `families.prepare` as `models.load_model` does."""
    cls, cfg_cls, fields, _ = FAMILIES[name] if name in FAMILIES else REFUSED[name]
    small = dict(SMALL)
    if name == "gpt2":  # GPT-2 names its sizes differently
        small = {k: v for k, v in small.items() if k in ("vocab_size", "pad_token_id", "eos_token_id", "bos_token_id")}
    config = getattr(tf, cfg_cls)(**{**small, **fields, **override})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(tf, cls)(config).eval()
    families.prepare(model)
    return model


def _rows(lengths_prompt, lengths_comp, g, shared_groups=None):
    """Left-padded prompts, right-padded completions: input_ids, attention_mask, loss_mask [B, L]."""
    B = len(lengths_comp)
    P, C = max(lengths_prompt), max(lengths_comp)
    prompts = [torch.randint(3, V, (n,), generator=g) for n in lengths_prompt]
    ids = torch.full((B, P + C), PAD)
    attn = torch.zeros(B, P + C, dtype=torch.long)
    loss = torch.zeros(B, P + C, dtype=torch.long)
    for b, c in enumerate(lengths_comp):
        p = prompts[shared_groups[b] if shared_groups else b]
        ids[b, P - len(p) : P], ids[b, P : P + c] = p, torch.randint(3, V, (c,), generator=g)
        attn[b, P - len(p) : P + c], loss[b, P : P + c] = 1, 1
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=loss)


def grpo_batch(g):
    """Two prompts (22 and 17 tokens) with G = 3 samples each: a shared prefix per group, longer than the window."""
    return _rows([22, 17], [25, 9, 31, 14, 28, 20], g, shared_groups=[0, 0, 0, 1, 1, 1])


def distinct_batch(g):
    """Four different prompts, left-padded, and completions of different lengths: packed end to end."""
    return _rows([20, 9, 15, 12], [26, 33, 11, 21], g)


def oracle_logps(model, batch):
    """log pi(token | its unpadded prefix) from the model's own forward on each row alone: [B, L], 0 off the loss mask."""
    out = torch.zeros(batch.input_ids.shape)
    for b in range(len(out)):
        cols = batch.attention_mask[b].nonzero()[:, 0]
        seq = batch.input_ids[b, cols]
        lp = torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1].float(), -1).gather(-1, seq[1:, None])[:, 0]
        out[b, cols[1:]] = lp
    return out * batch.loss_mask


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def engine_pass(model, batch, w, monkeypatch, plain=False):
    """The engine's log-probs and parameter gradients of sum(w * logps); records the Packing and the masks the backbone got."""
    seen = {"packings": [], "masks": []}
    real_pack = packing.pack_rows

    def spy(*a, **k):
        p = None if plain else real_pack(*a, **k)
        seen["packings"].append(p)
        return p

    monkeypatch.setattr(packing, "pack_rows", spy)
    hook = model.get_decoder().register_forward_pre_hook(
        lambda m, a, k: seen["masks"].append(k.get("attention_mask")), with_kwargs=True
    )
    try:
        lp = engine.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0, 16, True).logps
    finally:
        hook.remove()
        monkeypatch.setattr(packing, "pack_rows", real_pack)
    (lp * w).sum().backward()
    return lp.detach(), _grads(model), seen


def _as_bool(m):
    return m if m.dtype == torch.bool else m == 0  # eager masks are additive: 0 where allowed


@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_and_padded_logprobs_and_gradients_equal_the_models_own_forward(name, monkeypatch):
    model = build(name)
    kinds = FAMILIES[name][3]
    g = torch.Generator().manual_seed(1)
    for batch, prefix in ((grpo_batch(g), True), (distinct_batch(g), False)):
        w = torch.randn(batch.input_ids.shape, generator=g) * batch.loss_mask  # an arbitrary upstream gradient
        want = oracle_logps(model, batch)
        (want * w).sum().backward()
        want_grads = _grads(model)
        for plain in (False, True):
            got, grads, seen = engine_pass(model, batch, w, monkeypatch, plain)
            assert (got - want).abs().max() < 1e-5, (name, prefix, plain)
            assert grads.keys() == want_grads.keys()
            for n in grads:
                assert torch.allclose(grads[n], want_grads[n], atol=1e-5, rtol=1e-4), (name, n, prefix, plain)
            (mask,) = seen["masks"]
            if plain or kinds is None:  # the padded pass: the model builds its own masks from the 2-D padding mask
                assert seen["packings"] in ([None], []) and mask.dim() == 2
                continue
            (p,) = seen["packings"]
            assert (
                isinstance(p, packing.Packing) and (p.S > W) == prefix
            )  # packed, past a shared prefix longer than the window
            full = p.allowed
            layer = mask if isinstance(mask, dict) else {k: mask for k in kinds or {"full_attention"}}
            assert set(layer) >= kinds
            for kind, m in layer.items():  # a windowed layer really drops keys the full mask keeps
                narrower = bool((_as_bool(m) < full).any())
                assert narrower == (kind in kinds), (name, kind)


def tokenizer() -> PreTrainedTokenizerFast:
    """One character per id, for all V ids, so any generated token decodes."""
    vocab = {"<pad>": PAD, "<eos>": EOS, **{chr(0x100 + i): i for i in range(2, V)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern=Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", padding_side="left")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_rollout_equals_generate_past_the_window(name):
    model = build(name)
    tok = tokenizer()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (5, 13, 9)]
    settings = SamplingSettings(greedy=True, max_new_tokens=30)
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
    P = enc["input_ids"].shape[1]
    # EOS: a token no row takes in its first W steps and some row first takes later, so that row ends past the
    # window and others go on without it (the rollout drops it from the batch and compacts the cache)
    free = generate(model, tok, prompts, 2, settings, eos_token_ids=[]).input_ids[:, P:].tolist()
    early = {x for row in free for x in row[:W]}
    eos = next(row[t] for t in range(W, 30) for row in free if row[t] not in early and row[t] not in row[:t])
    ro = generate(model, tok, prompts, 2, settings, eos_token_ids=[eos])
    ref = model.generate(**enc, do_sample=False, max_new_tokens=30, eos_token_id=eos, pad_token_id=PAD)
    ref = ref[:, P:].repeat_interleave(2, 0)  # [N, 30]
    C = ro.input_ids.shape[1] - P
    assert torch.equal(ro.input_ids[:, P:], ref[:, :C]) and (ref[:, C:] == PAD).all()
    assert len(set(ro.completion_lengths.tolist())) > 1 and int(ro.completion_lengths.min()) > W
    # and each token's recorded log-prob is the one the model's own forward on the unpadded row gives
    rows = Batch(input_ids=ro.input_ids, attention_mask=ro.attention_mask, loss_mask=ro.completion_mask)
    with torch.no_grad():
        assert (ro.sample_logps - oracle_logps(model, rows)).abs().max() < 1e-5


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_model_no_pass_can_make_exact_is_refused_in_one_sentence(name):
    with pytest.raises(GcfError) as e:
        build(name)
    msg = str(e.value)
    assert REFUSED[name][3] in msg and msg.count(". ") == 0 and msg.endswith(".") and "\n" not in msg


def test_the_engine_refuses_a_model_that_skipped_prepare():
    """A model built by hand reaches the engine without `prepare`: the log-prob path refuses it itself."""
    cls, cfg_cls, fields, _ = REFUSED["cohere-logit-scale"]
    model = getattr(tf, cls)(getattr(tf, cfg_cls)(**{**SMALL, **fields}))
    batch = distinct_batch(torch.Generator().manual_seed(3))
    with pytest.raises(GcfError, match="logit_scale=0.0625"):
        engine.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)


def test_attention_softcapping_runs_eager():
    """Gemma 2 soft-caps its attention logits, which sdpa does not: `prepare` sets eager attention, in which the packed
    path and the rollout apply it, whatever implementation was chosen before (transformers makes Gemma 2 eager itself)."""
    model = build("gemma2")
    assert model.config._attn_implementation == "eager"
    model.set_attn_implementation("flex_attention")
    families.prepare(model)
    assert model.config._attn_implementation == "eager" and model.get_decoder().config._attn_implementation == "eager"


def test_load_model_prepares_and_refuses(tmp_path):
    """`models.load_model` runs `families.prepare` on a checkpoint folder: a family that cannot be exact (Cohere's
    logit scale) is refused in one sentence; Gemma 2 as shipped (final soft-cap 30) loads, with eager attention."""
    from gcfamily.models import load_model

    for name in ("cohere-logit-scale", "gemma2-shipped"):
        cls, cfg_cls, fields, _ = (
            REFUSED[name]
            if name in REFUSED
            else ("Gemma2ForCausalLM", "Gemma2Config", dict(num_hidden_layers=2, head_dim=8), None)
        )
        getattr(tf, cls)(getattr(tf, cfg_cls)(**{**SMALL, **fields})).save_pretrained(tmp_path / name)
        tokenizer().save_pretrained(tmp_path / name)
    with pytest.raises(GcfError, match="logit_scale=0.0625"):
        load_model(str(tmp_path / "cohere-logit-scale"))
    model, _ = load_model(str(tmp_path / "gemma2-shipped"))
    assert type(model).__name__ == "Gemma2ForCausalLM" and model.config._attn_implementation == "eager"
    assert model.config.final_logit_softcapping == 30.0
