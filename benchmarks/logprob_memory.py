"""Peak memory of the log-prob path: the engine's chunked projection against the naive one.

Naive: model(...).logits -> log_softmax -> gather, which holds [B, T, V] float32 logits (and
their log-softmax) for the forward and the backward. Engine: hidden states of the loss tokens
only, projected chunk by chunk with a hand-written backward.

Each path runs in a fresh subprocess; the figure is the growth of peak resident memory over
the process's memory after the model and inputs exist (on CPU), or torch's peak allocation
(on CUDA). Usage: python benchmarks/logprob_memory.py [--tokens 1024] [--vocab 49152]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def child(path: str, tokens: int, vocab: int, chunk: int, device: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gcfamily.core import engine

    torch.manual_seed(0)
    # SmolLM2-135M's widths (hidden 576, vocab 49,152), two layers: the projection is what is measured
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(device)
    # the output layer and the embedding are frozen in both paths: their [V, H] weight gradients
    # are the same for both, so what differs, and is measured, is the memory for the logits
    model.lm_head.weight.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(False)
    prompt = 32
    L = prompt + tokens
    ids = torch.randint(0, vocab, (1, L), device=device)
    am = torch.ones(1, L, dtype=torch.long, device=device)
    lm = am.clone()
    lm[:, : prompt + 1] = 0  # `tokens` completion tokens in the loss
    lm[:, prompt + 1 :] = 1
    # a short warm-up pass first, so one-time allocations (thread pools, kernels) are not counted
    model.model(input_ids=ids[:, :16], attention_mask=am[:, :16]).last_hidden_state.sum().backward()
    model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if path == "backbone":  # the floor both paths share: the decoder's forward and backward
        h = model.model(input_ids=ids, attention_mask=am).last_hidden_state
        lp = h[:, :-1].float().sum(-1) * 0.0
    elif path == "engine":
        lp = engine.token_logprobs(model, ids, am, lm, 1.0, chunk).logps
    else:
        logits = model(input_ids=ids, attention_mask=am).logits.float()  # [1, L, V]
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], 1) * lm
    (-lp.sum()).backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"path": path, "peak_mb": peak / 2**20, "logps_sum": float(lp.sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.tokens, a.vocab, a.chunk, a.device)))
        return
    res = {}
    for path in ("backbone", "naive", "engine"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                path,
                "--tokens",
                str(a.tokens),
                "--vocab",
                str(a.vocab),
                "--chunk",
                str(a.chunk),
                "--device",
                a.device,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        res[path] = json.loads(out.stdout.strip().splitlines()[-1])
    full_mb = a.tokens * a.vocab * 4 / 2**20
    print(f"log-prob path, vocab {a.vocab}, {a.tokens} completion tokens, chunk {a.chunk}, {a.device}")
    print(f"  one [T, V] float32 logits tensor: {full_mb:8.1f} MB")
    floor = res["backbone"]["peak_mb"]
    naive, eng = res["naive"]["peak_mb"] - floor, res["engine"]["peak_mb"] - floor
    print(f"  decoder alone, fwd+bwd (floor):   {floor:8.1f} MB")
    print(f"  naive  log-prob path above floor: {naive:8.1f} MB   (total {res['naive']['peak_mb']:.1f})")
    print(f"  engine log-prob path above floor: {eng:8.1f} MB   (total {res['engine']['peak_mb']:.1f})")
    print(f"  ratio naive/engine:               {naive / max(eng, 1.0):8.1f}x")
    same = abs(res["naive"]["logps_sum"] - res["engine"]["logps_sum"]) < 1e-4 * abs(res["naive"]["logps_sum"])
    print(f"  same log-probs: {same}")


if __name__ == "__main__":
    main()
