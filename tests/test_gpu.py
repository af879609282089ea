"""GPU path: bf16 log-probs and rollouts on CUDA (skipped without a GPU)."""

import pytest
import torch

from gcfamily.core import engine
from gcfamily.models import tiny_model, tiny_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_chunked_logprobs_track_float32_naive():
    model = tiny_model(120, seed=0, hidden=128).cuda()
    ids = torch.randint(3, 120, (4, 64), device="cuda")
    am = torch.ones_like(ids)
    lm = am.clone()
    lm[:, :16] = 0
    want = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    got = engine.token_logprobs(model.to(torch.bfloat16), ids, am, lm, 1.0, 32).logps[:, 1:]
    m = lm[:, 1:].bool()
    assert (got[m] - want[m]).abs().mean() < 0.05  # bf16 weights and activations, float32 softmax


def test_rollout_logps_match_engine_on_cuda():
    from gcfamily.rollout import SamplingSettings, generate

    tok = tiny_tokenizer()
    model = tiny_model(len(tok), seed=1).cuda().eval()
    ids = [tok("<|user|>1+2\n<|assistant|>")["input_ids"], tok("<|user|>33+4\n<|assistant|>")["input_ids"]]
    ro = generate(model, tok, ids, 4, SamplingSettings(max_new_tokens=12), torch.Generator().manual_seed(0))
    lp = engine.token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_mask).logps  # all on the GPU
    m = ro.completion_mask.bool()
    assert ro.input_ids.is_cuda and (lp[m] - ro.sample_logps[m]).abs().mean() < 1e-4


def test_cuda_bf16_gradients_track_the_cpu_float32_path():
    # The same weighted log-likelihood on the CPU in float32 and on CUDA in bf16 compute over float32 weights (autocast).
    cpu = tiny_model(120, seed=2, hidden=128)
    gpu = tiny_model(120, seed=2, hidden=128).cuda()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (4, 48), generator=g)
    am = torch.ones_like(ids)
    lm = am.clone()
    lm[:, :12] = 0
    w = torch.randn(4, 48, generator=g)

    def grads(model, device, autocast):
        model.zero_grad()
        with torch.autocast(device, torch.bfloat16, enabled=autocast):
            lp = engine.token_logprobs(model, ids.to(device), am.to(device), lm.to(device), 1.0, 32).logps
        (lp * w.to(device) * lm.to(device)).sum().backward()
        return torch.cat([p.grad.float().flatten().cpu() for p in model.parameters()])

    want, got = grads(cpu, "cpu", False), grads(gpu, "cuda", True)
    assert (got - want).norm() / want.norm() < 0.05  # bf16 matmuls, float32 accumulation of the log-softmax


def test_compiled_cuda_rollout_equals_eager_and_is_reused():
    from gcfamily.rollout import SamplingSettings, decode, generate

    tok = tiny_tokenizer()
    model = tiny_model(len(tok), seed=1).cuda().eval()
    model.config._attn_implementation = "sdpa"
    ids = [
        tok(p)["input_ids"]
        for p in ["<|user|>1+2\n<|assistant|>", "<|user|>33+4\n<|assistant|>", "<|user|>9\n<|assistant|>"]
    ]
    assert decode.wanted(model, "auto")
    outs = {}
    for mode in ("off", "on", "on"):  # the second compiled call replays the captured graphs
        for greedy in (True, False):
            s = SamplingSettings(max_new_tokens=20, greedy=greedy, compile=mode)
            outs.setdefault((mode, greedy), []).append(
                generate(model, tok, ids, 8, s, torch.Generator().manual_seed(0), [1, 40, 41])
            )
    for greedy in (True, False):
        a, b, c = outs[("off", greedy)][0], *outs[("on", greedy)]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(b.input_ids, c.input_ids)
        m = a.completion_mask.bool()
        assert (a.sample_logps[m] - b.sample_logps[m]).abs().max() < 1e-4
