"""The compiled fixed-shape decode step (gcfamily.rollout.decode) against the eager rollout and `model.generate`.

Compiled with the real inductor backend on the CPU (`rollout_compile: on`); on CUDA `auto` takes the same path
with CUDA graphs (tests marked gpu).
"""

import pytest
import torch
from test_rollout import EOS, PAD, assert_greedy_equals_hf, tokenizer  # noqa: F401  (tokenizer: a fixture)
from transformers import LlamaConfig, LlamaForCausalLM

from gcfamily.errors import GcfError
from gcfamily.rollout import Rollout, SamplingSettings, decode, generate


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
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in ["what is 2+3?", "hi", "12*4=", "say abc then stop."]]


def run(model, tokenizer, prompts, compile, G=4, seed=0, eos=(EOS,), **kw) -> Rollout:
    settings = SamplingSettings(**{"max_new_tokens": 24, "compile": compile, **kw})
    return generate(model, tokenizer, prompts, G, settings, torch.Generator().manual_seed(seed), list(eos))


def test_buckets_and_refusals(model):
    assert decode.buckets(64) == [64, 32, 16, 8, 4, 2]
    assert decode.buckets(48) == [48, 32, 16, 8, 4, 2] and decode.buckets(1) == [2] and decode.buckets(3) == [3, 2]
    assert decode.wanted(model, "on") and not decode.wanted(model, "off") and not decode.wanted(model, "auto")  # CPU
    with pytest.raises(GcfError, match="rollout_compile must be one of auto, on, off"):
        decode.mode_ok("yes")
    eager = LlamaForCausalLM(model.config.__class__(**{**model.config.to_dict(), "attn_implementation": "eager"}))
    assert "not sdpa" in decode.why_not(eager)


def test_greedy_compiled_equals_hf_generate(model, tokenizer, prompts):
    # Several EOS ids, so rows end at different steps and the batch moves down through buckets 8 -> 4 -> 2.
    eos = [EOS, 5, 9, 12, 20, 38]
    ro = run(model, tokenizer, prompts, "on", G=2, eos=eos, greedy=True)
    assert_greedy_equals_hf(ro, model, tokenizer, prompts, eos)
    assert sorted(set(ro.completion_lengths.tolist())) == [3, 7, 15, 23]  # 8 rows, then 4, then 2: three buckets


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)])
def test_sampled_compiled_equals_eager_for_the_same_seed(model, tokenizer, prompts, kw):
    # One uniform per result row at every step: the tokens depend on the seed, not on which rows share a step.
    eos = (EOS, 5, 9)
    a = run(model, tokenizer, prompts, "off", G=8, eos=eos, **kw)
    b = run(model, tokenizer, prompts, "on", G=8, eos=eos, **kw)
    assert a.truncated.any() and (~a.truncated).any()
    assert torch.equal(a.input_ids, b.input_ids) and a.completions == b.completions
    m = a.completion_mask.bool()
    assert (a.sample_logps[m] - b.sample_logps[m]).abs().max() < 1e-5


def test_compiled_sampling_draws_from_the_models_distribution(tokenizer):
    # A one-token vocabulary of 6 after a fixed prompt: the first sampled token's frequencies against softmax.
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=6,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
    )
    cfg._attn_implementation = "sdpa"
    small = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        small.lm_head.weight.mul_(8)  # a peaked distribution, but no token rarer than 1e-3
    prompt = [[2, 3, 4]]
    n = 2048
    ro = generate(
        small,
        tokenizer,
        prompt,
        n,
        SamplingSettings(max_new_tokens=2, compile="on"),
        torch.Generator().manual_seed(0),
        [EOS],
    )
    P = 3
    with torch.no_grad():
        p = torch.softmax(small(input_ids=torch.tensor(prompt)).logits[0, -1], -1)
    freq = torch.bincount(ro.input_ids[:, P], minlength=6).float() / n
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-3).all()


def test_decoder_is_compiled_once_and_reused(model, tokenizer, prompts):
    from torch._dynamo.utils import counters

    run(model, tokenizer, prompts, "on", G=4, eos=(EOS, 5, 9))
    before = counters["stats"]["unique_graphs"]
    for seed in (1, 2):  # other bucket sequences, same buffers and graph
        run(model, tokenizer, prompts, "on", G=4, seed=seed, eos=(EOS, 5, 9))
    assert counters["stats"]["unique_graphs"] == before
    kept = decode._DECODERS[model]
    assert len(kept) <= decode._KEEP and all(d.slots % decode.SLOT_ROUND == 0 for d in kept.values())


BLOCK = """
import runpy, sys
class Block:  # the GPU machine has neither package: the script must not import them
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('datasets', 'gguf'):
            raise ImportError(f'{name} is not installed on the GPU machine')
sys.meta_path.insert(0, Block())
sys.argv = ['gpu_step.py'] + sys.argv[1:]
runpy.run_path('benchmarks/gpu_step.py', run_name='__main__')
"""


def test_gpu_step_script_runs_on_the_cpu_without_datasets_or_gguf(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gpu_step.json"
    args = [
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--new-tokens",
        "8",
        "--steps",
        "2",
        "--reps",
        "1",
        "--json",
        str(out),
        "--lora",
        "4",
        "--lora-models",
        "tiny",
    ]
    r = subprocess.run(
        [sys.executable, "-c", BLOCK, *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(x["mode"], x["lora_r"]) for x in data["results"]] == [
        ("off", 0),
        ("on", 0),
        ("on", 4),
    ]  # the last: LoRA against full
    for x in data["results"]:
        assert x["decode_generated_tokens_per_s"] > 0 and x["step_s"] > 0 and x["train_tokens_per_s"] > 0
    assert "compiled / eager" in r.stdout and "LoRA r=4" in r.stdout
    full, lora = data["results"][1], data["results"][2]
    assert (
        full["trained_params"] == full["params"] and 0 < lora["trained_params"] < lora["params"] / 10
    )  # LoRA's rate counts no frozen weight gradients


def test_a_model_is_freed_after_compiled_rollouts(tokenizer, prompts):
    # Decoders are kept per model between rollouts, but must not keep a dropped model (and its weights) alive.
    import gc
    import weakref

    torch.manual_seed(3)
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
    cfg._attn_implementation = "sdpa"
    m = LlamaForCausalLM(cfg).eval()
    run(m, tokenizer, prompts, "on", G=2)
    assert m in decode._DECODERS
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


def test_a_compile_failure_is_one_sentence_under_on_and_eager_decoding_under_auto(
    model, tokenizer, prompts, monkeypatch, capsys
):
    def broken(self, *a, **k):
        raise torch._dynamo.exc.TorchDynamoException("no C++ compiler found")

    monkeypatch.setattr(decode.StaticDecoder, "step", broken)
    with pytest.raises(
        GcfError,
        match="rollout_compile=on, but compiling the decode step failed .*no C.. compiler found.*rollout_compile=off",
    ):
        run(model, tokenizer, prompts, "on", G=2)
    with pytest.raises(ValueError):  # any other error is not swallowed
        monkeypatch.setattr(decode.StaticDecoder, "step", lambda *a, **k: (_ for _ in ()).throw(ValueError("a bug")))
        run(model, tokenizer, prompts, "on", G=2)
    other = LlamaForCausalLM(model.config)
    assert decode.compile_failed(torch._dynamo.exc.TorchDynamoException("x"), other, "auto")
    assert "decoding eagerly" in capsys.readouterr().err
    assert not decode.wanted(other, "on")  # this model decodes eagerly from now on
    assert not decode.compile_failed(ValueError("x"), other, "auto")


def test_compiled_decoding_after_a_shared_prefix_prefill(model, tokenizer):
    # The slots hold the prefix once-computed then each prompt's rest left-padded: same tokens as the eager rollout.
    shared = [
        tokenizer(p)["input_ids"]
        for p in ["you are terse. q: what is 2+3?", "you are terse. q: hi", "you are terse. q: 12*4="]
    ]
    a = run(model, tokenizer, shared, "off", G=4, eos=(EOS, 5, 9), temperature=0.8)
    b = run(model, tokenizer, shared, "on", G=4, eos=(EOS, 5, 9), temperature=0.8)
    assert torch.equal(a.input_ids, b.input_ids)
    m = a.completion_mask.bool()
    assert (a.sample_logps[m] - b.sample_logps[m]).abs().max() < 1e-5


def test_decoders_are_kept_per_compute_dtype(model):
    # Under autocast the KV cache is bf16: a float32 decoder's buffers must not be reused for it (nor the other way).
    plain = decode.decoder(model, 8, 40)
    with torch.autocast("cpu", torch.bfloat16):
        mixed = decode.decoder(model, 8, 40)
    assert mixed is not plain and decode.decoder(model, 8, 40) is plain
    assert {k[2] for k in decode._DECODERS[model]} == {torch.bfloat16, torch.float32}
