"""Sampling without a cache, for models whose state a KV cache cannot hold (state-space, recurrent and linear-attention
layers, or a cache of their own: `core.families.no_kv_cache`): every token is drawn from a full forward over the prompt and the tokens so far.

Slow (a forward over the whole row per token) but exact: no padding and no cache enters the forward, so each logit is
the model's own for that unpadded row. A prompt's G samples share its length at every step, so they go through one
forward together; rows that end leave it. The draws are the KV-cache loop's (one uniform per row of the result at
every step, from the same generator), so both loops give the same tokens for the same seed where both apply.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gcfamily.rollout.sampling import SamplingSettings, sample_tokens


@torch.no_grad()
def decode(
    model,
    prompt_ids: list[list[int]],
    G: int,
    settings: SamplingSettings,
    generator: torch.Generator | None,
    eos: torch.Tensor,
    pad_id: int,
    stopped: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [N, C], their log-probs [N, C], lengths [N], ended [N]) for G samples of each prompt, N = n * G.

    `stopped(tokens, rows, t)`: which of `rows` hold a stop string in their first t + 1 tokens (checked each step).
    """
    device, C = model.device, settings.max_new_tokens
    N = len(prompt_ids) * G
    tokens = torch.full((N, C), pad_id, dtype=torch.long, device=device)  # [N, C]
    logps = torch.zeros(N, C, dtype=torch.float32, device=device)  # [N, C]
    lengths = torch.full((N,), C, dtype=torch.long, device=device)  # [N]
    ended = torch.zeros(N, dtype=torch.bool, device=device)  # [N]
    draw = generator.device if generator is not None else device
    prompts = [torch.tensor(p, dtype=torch.long, device=device) for p in prompt_ids]
    for t in range(C):
        u = None if settings.greedy else torch.rand(N, 1, generator=generator, device=draw).to(device)  # [N, 1]
        for i, p in enumerate(prompts):
            rows = torch.arange(i * G, (i + 1) * G, device=device)[~ended[i * G : (i + 1) * G]]  # [g] still going
            if not len(rows):
                continue
            ids = torch.cat([p.expand(len(rows), -1), tokens[rows, :t]], 1)  # [g, P_i + t], no padding
            logits = model(input_ids=ids, use_cache=False).logits[:, -1]  # [g, V]
            tok, lp = sample_tokens(logits, settings, generator, None if u is None else u[rows])
            tokens[rows, t], logps[rows, t] = tok, lp
            hit = torch.isin(tok, eos)
            if stopped is not None:
                hit |= stopped(tokens, rows, t)
            lengths[rows[hit]], ended[rows[hit]] = t + 1, True
        if bool(ended.all()):
            break
    return tokens, logps, lengths, ended
