"""Families the packed path does not cover, trained and sampled exactly: Gemma 3n with eager attention (its SDPA
backward gives NaN gradients on left-padded rows), and state-space / hybrid families sampled by recomputing the whole
forward each token (a KV cache cannot hold their state; `rollout.generate` ended in a raw transformers error on them).

`tiny` builds any causal-LM family of the installed transformers from its config class at tiny sizes (SIZES, where the
config has the field, and OVERRIDES per family); benchmarks/families_table.py runs every family through the same checks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from test_families import PAD, distinct_batch, grpo_batch, tokenizer

from gcfamily.core import engine, families
from gcfamily.core.batch import Batch
from gcfamily.rollout import SamplingSettings, generate, recompute

V = 128
SIZES: dict[str, Any] = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    head_dim=8,
    max_position_embeddings=256,
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=256,
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    n_routed_experts=4,
    shared_expert_intermediate_size=32,
    state_size=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    kv_lora_rank=16,  # multi-head latent attention (DeepSeek-V2 and after): its head sizes are fields of their own
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    index_head_dim=8,
    n_group=1,  # expert groups: a tiny model's 4 experts make one
    topk_group=1,
    unpadded_vocab_size=V,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=8,
    pad_token_id=PAD,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=False,
)
SL, FU = "sliding_attention", "full_attention"
OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma3n_text": dict(
        num_hidden_layers=4,
        layer_types=[SL, FU, SL, FU],
        num_kv_shared_layers=2,  # as shipped, later layers reuse earlier layers' keys and values
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=V,
        laurel_rank=4,
        sliding_window=8,
    ),
    "falcon_h1": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8, mamba_chunk_size=16),
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=1, chunk_size=16),
    "bamba": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16, attn_layer_indices=[1]),
    "granitemoehybrid": dict(
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16, layers_block_type=["mamba", "attention"]
    ),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),  # hybrid, as shipped
    "minimax": dict(layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),  # hybrid
    # rotary width is its own field here (64 by default, past the tiny head_dim of 8)
    "codegen": dict(rotary_dim=4),
    "gptj": dict(rotary_dim=4),
}
RECURRENT = ["mamba", "jamba", "bamba", "lfm2", "granitemoehybrid", "qwen3_next", "falcon_h1", "minimax"]


def tiny(model_type: str) -> Any:
    """A random float32 causal LM of the family (its config class at tiny sizes), through `families.prepare`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg_cls = CONFIG_MAPPING[model_type]
    defaults = cfg_cls()
    sizes = {k: v for k, v in SIZES.items() if hasattr(defaults, k)}
    if hasattr(defaults, "kv_lora_rank"):  # latent attention: one key and value head per query head
        sizes["num_key_value_heads"] = SIZES["num_attention_heads"]
    config = cfg_cls(**{**sizes, **OVERRIDES.get(model_type, {})})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config).eval()
    families.prepare(model)
    return model


def _tiny_or_skip(model_type: str) -> Any:
    try:
        return tiny(model_type)
    except (ImportError, AttributeError, KeyError, ValueError, TypeError) as e:
        pytest.skip(f"transformers {tf.__version__} cannot build a tiny {model_type}: {type(e).__name__}: {e}")


def oracle_logps(model: Any, batch: dict) -> torch.Tensor:
    """log pi(token | its unpadded prefix) from the model's own forward on each row alone (no cache), [B, L]."""
    out = torch.zeros(batch.input_ids.shape)
    for b in range(len(out)):
        cols = batch.attention_mask[b].nonzero()[:, 0]
        seq = batch.input_ids[b, cols]
        logits = model(input_ids=seq[None], use_cache=False).logits[0, :-1].float()
        out[b, cols[1:]] = torch.log_softmax(logits, -1).gather(-1, seq[1:, None])[:, 0]
    return out * batch.loss_mask


def _gradients(model: Any, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lp = engine.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0, 16, True)
    lp.logps.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return lp.logps.detach(), grads


def test_gemma3n_runs_eager_and_its_gradients_are_finite_and_exact_on_left_padded_rows() -> None:
    model = _tiny_or_skip("gemma3n_text")
    assert model.config._attn_implementation == "eager"  # prepare sent it there; SDPA gave NaN in 92 of 102 tensors
    batch = grpo_batch(torch.Generator().manual_seed(1))  # left-padded prompts, as a rollout lays them out
    w = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(2)) * batch.loss_mask
    logps, grads = _gradients(model, batch)
    bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
    assert not bad, f"non-finite gradients in {len(bad)} of {len(grads)} tensors: {bad[:3]}"
    want = oracle_logps(model, batch)  # the model's own forward on each unpadded row
    assert (logps - want.detach()).abs().max() < 1e-5
    (want * w).sum().backward()
    oracle = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    lp = engine.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask, 1.0, 16, True)
    (lp.logps * w).sum().backward()
    assert max(float((p.grad - oracle[n]).abs().max()) for n, p in model.named_parameters() if n in oracle) < 1e-4


@pytest.mark.parametrize("model_type", RECURRENT)
def test_a_state_space_or_hybrid_family_trains_and_samples_exactly(model_type: str) -> None:
    model = _tiny_or_skip(model_type)
    assert families.no_kv_cache(model.config)
    logps, grads = _gradients(model, distinct_batch(torch.Generator().manual_seed(3)))
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert (logps - oracle_logps(model, distinct_batch(torch.Generator().manual_seed(3))).detach()).abs().max() < 1e-5
    tok = tokenizer()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (5, 9)]
    greedy = SamplingSettings(greedy=True, max_new_tokens=6)
    ro = generate(model, tok, prompts, 2, greedy, eos_token_ids=[])
    P = ro.input_ids.shape[1] - 6
    for i, p in enumerate(prompts):  # greedy equals the model's own generate on the unpadded prompt
        own = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=PAD)
        assert ro.input_ids[2 * i, P:].tolist() == own[0, len(p) :].tolist()
    rows = Batch(input_ids=ro.input_ids, attention_mask=ro.attention_mask, loss_mask=ro.completion_mask)
    with torch.no_grad():  # each recorded log-prob is the model's own forward's
        assert (ro.sample_logps - oracle_logps(model, rows)).abs().max() < 1e-5
    sampled = SamplingSettings(temperature=0.7, top_k=20, max_new_tokens=6)
    a, b = (generate(model, tok, prompts, 2, sampled, torch.Generator().manual_seed(5)) for _ in range(2))
    assert torch.equal(a.input_ids, b.input_ids)  # same seed, same tokens


def test_the_recomputing_loop_draws_what_the_kv_cache_loop_draws() -> None:
    """On a family both loops handle (Llama), the same seed gives the same tokens and log-probs."""
    model = tiny("llama")
    assert not families.no_kv_cache(model.config)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (4, 7, 6)]
    settings = SamplingSettings(temperature=0.8, top_p=0.9, max_new_tokens=8)
    free = generate(model, tokenizer(), prompts, 3, settings, torch.Generator().manual_seed(7), eos_token_ids=[])
    eos = int(free.completion_mask.nonzero()[0, 1] + 2)  # row 0's third token: it, and maybe others, end early
    eos = int(free.input_ids[0, eos])
    ro = generate(model, tokenizer(), prompts, 3, settings, torch.Generator().manual_seed(7), eos_token_ids=[eos])
    tokens, logps, lengths, _ = recompute.decode(
        model, prompts, 3, settings, torch.Generator().manual_seed(7), torch.tensor([eos]), PAD
    )
    P, C = ro.input_ids.shape[1] - ro.completion_lengths.max(), int(ro.completion_lengths.max())
    assert torch.equal(lengths, ro.completion_lengths) and len(set(lengths.tolist())) > 1  # some rows ended early
    keep = ro.completion_mask[:, P:].bool()
    assert torch.equal(tokens[:, :C][keep], ro.input_ids[:, P:][keep])
    assert (logps[:, :C][keep] - ro.sample_logps[:, P:][keep]).abs().max() < 1e-5


def test_an_encoder_run_as_a_language_model_is_refused_in_one_sentence() -> None:
    """BERT's LM head without is_decoder=True attends both ways: its log-probs are not a causal LM's (off by 0.4 on
    the families rows), so it is refused."""
    from gcfamily.errors import GcfError

    with pytest.raises(GcfError, match="is_decoder=False") as e:
        tiny("bert")
    assert str(e.value).count(". ") == 0 and "\n" not in str(e.value)
