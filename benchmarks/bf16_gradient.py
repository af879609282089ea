"""The gradient of the SFT loss under bf16 autocast against float32, on three batches of 16 training answers.

    .venv/bin/python benchmarks/bf16_gradient.py [MODEL]      # SmolLM2-135M-Instruct by default; a run's folder works

Through the engine's own path (engine.token_logprobs, the mean log-likelihood of the answer tokens), float32 weights in
both; printed per batch: the loss in each, the gradient norms, |g_bf16 - g_fp32| / |g_fp32| over all parameters, and
the three tensors with the largest relative error. docs/precision.md quotes it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from gcfamily.core import engine
from gcfamily.models import load_model
from gcfamily.tasks import get_task

model, tok = load_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")
model.train()
rows = get_task("arithmetic").rows("train", 64)


def enc(r):
    p = list(
        tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True)["input_ids"]
    )
    return p, tok(str(r["answer"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


for b0 in (0, 16, 32):
    pairs = [enc(r) for r in rows[b0 : b0 + 16]]
    L = max(len(p) + len(a) for p, a in pairs)
    ids = torch.zeros(16, L, dtype=torch.long)
    am = torch.zeros_like(ids)
    lm = torch.zeros_like(ids)
    for i, (p, a) in enumerate(pairs):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        am[i, : len(p) + len(a)] = 1
        lm[i, len(p) : len(p) + len(a)] = 1
    gs = {}
    for bf in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf):
            lp = engine.token_logprobs(model, ids, am, lm, 1.0, 4096).logps
            loss = -(lp * lm).sum() / lm.sum()
        loss.backward()
        gs[bf] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        print(("bf16" if bf else "fp32"), "loss %.5f" % loss.item(), end="  ")
    a = torch.cat([g.flatten() for g in gs[False].values()])
    b = torch.cat([g.flatten() for g in gs[True].values()])
    print(
        "batch %d: |g| fp32 %.4f bf16 %.4f  |g_bf16 - g_fp32|/|g_fp32| %.4f"
        % (b0 // 16, a.norm(), b.norm(), (b - a).norm() / a.norm())
    )
    worst = sorted(
        ((gs[True][n] - gs[False][n]).norm().item() / max(gs[False][n].norm().item(), 1e-12), n) for n in gs[False]
    )[-3:]
    print("   largest relative errors per tensor:", ", ".join("%s %.3f" % (n, e) for e, n in worst))
