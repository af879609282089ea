"""Drawing one token per row from logits: the settings (temperature, top-k, top-p, greedy) and the draw itself.

gcfamily/rollout/native.py calls `sample_tokens` once per decoding step; both are re-exported by gcfamily.rollout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingSettings:
    """How completions are drawn."""

    temperature: float = 1.0
    """Logits are divided by this before softmax; also the temperature of the recorded `sample_logps`."""
    top_p: float = 1.0
    """Nucleus: sample from the smallest set of tokens whose probability sums to at least top_p (1 = off)."""
    top_k: int = 0
    """Sample from the k most likely tokens only (0 = off)."""
    max_new_tokens: int = 64
    """Completions that reach this length without EOS or a stop string are marked truncated."""
    greedy: bool = False
    """Take the argmax; temperature, top_p and top_k are ignored and logps are at temperature 1."""
    compile: str = "auto"
    """auto | on | off: decode through the compiled fixed-shape step (gcfamily.rollout.decode); auto compiles on CUDA only."""
    stop_strings: tuple[str, ...] = ()
    """A completion ends at the token that completes one of these in its decoded text; the text is cut just
    after it (the stop string is kept, as its tokens are in completion_mask)."""


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Index [B, 1] drawn from each row of non-negative `weights` [B, K] by the uniforms `u` [B, 1].

    Two levels, chunk sums then one chunk: a full-row cumsum is a slow sequential scan on CPU (about
    10x this whole function at a 50k vocabulary). Targets are kept strictly inside the chosen
    range, so a token of zero weight (filtered, or padding) is never returned.
    """
    B, K = weights.shape
    padded = weights if K % chunk == 0 else torch.nn.functional.pad(weights, (0, -K % chunk))
    blocks = padded.view(B, -1, chunk)  # [B, K/chunk, chunk]
    sums = blocks.sum(-1)  # [B, K/chunk]
    cdf = sums.cumsum(-1)  # [B, K/chunk]
    target = u * cdf[:, -1:] * (1 - 1e-6)  # [B, 1], below the total despite rounding
    block = torch.searchsorted(cdf, target, right=True)  # [B, 1], a block of positive sum
    inner = blocks.gather(1, block[:, :, None].expand(-1, -1, chunk))[:, 0].cumsum(-1)  # [B, chunk]
    rest = (target - cdf.gather(-1, block) + sums.gather(-1, block)).clamp(min=0)
    rest = torch.minimum(rest, inner[:, -1:] * (1 - 1e-6))
    return block * chunk + torch.searchsorted(inner, rest, right=True)


def sample_tokens(
    logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator | None, u: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [B, V]; return (tokens [B], their log-probs [B]).

    The log-prob is log_softmax(logits / temperature) of the full distribution, before top-k /
    top-p filtering: the number a later forward pass at the same temperature gives for the token,
    which is what importance ratios against pi_old need. Greedy uses temperature 1. `u` [B, 1], if
    given, are the uniforms to draw with (else one per row is drawn from `generator`).
    """
    logits = logits.float()  # [B, V]; bf16 logits are sampled and scored in float32
    if settings.greedy:
        tokens = logits.argmax(-1)  # [B]
        return tokens, logits.gather(-1, tokens[:, None])[:, 0] - logits.logsumexp(-1)
    probs = torch.softmax(logits if settings.temperature == 1 else logits / settings.temperature, -1)  # [B, V]
    weights, ids = probs, None
    if settings.top_k > 0:
        weights, ids = probs.topk(min(settings.top_k, probs.shape[-1]), dim=-1)  # [B, K], sorted
    elif settings.top_p < 1.0:
        weights, ids = probs.sort(dim=-1, descending=True)  # [B, V]
    if settings.top_p < 1.0:
        # Keep a token iff the mass ranked above it is still short of top_p (of the top-k mass, if any).
        above = weights.cumsum(-1) - weights  # [B, K]
        weights = weights.masked_fill(above >= settings.top_p * (above[:, -1:] + weights[:, -1:]), 0.0)
    # One uniform per row, drawn where the generator lives: a CPU generator can drive a CUDA model.
    if u is None:
        u = torch.rand(len(weights), 1, generator=generator, device=generator.device if generator else weights.device)
    idx = _inverse_cdf(weights, u.to(weights.device))  # [B, 1]
    tokens = idx if ids is None else ids.gather(-1, idx)  # [B, 1]
    # A sampled token's probability is far above float32's smallest normal, so its log is exact enough.
    return tokens[:, 0], probs.gather(-1, tokens)[:, 0].log()
