"""GPU path: bf16 log-probs and rollouts on CUDA (skipped without a GPU)."""

import pytest
import torch

from gcfamily import engine
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
