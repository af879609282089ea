"""Attention for forwards without gradients on CPU (sampling, evaluation): two batched matmuls instead of SDPA's kernel.

For a rollout's shapes torch's CPU SDPA kernel is slow: with a boolean mask at one query token it
takes 1.6 ms a layer at batch 64 (SmolLM2-135M: 9 query heads on 3 KV heads, 105 keys), and in a
left-padded prefill transformers first repeats the keys and values for every query head (22 ms a
layer for 128 prompts of 28 tokens on 60 keys). Here the query heads that share a KV head are
stacked into one matrix, so softmax(q k^T * scale, masked) v is two matmuls on the KV heads as
they are: 0.6 ms and 11 ms on those shapes (2 threads).

It computes the same function as transformers' SDPA path: the same mask (transformers builds it
for this implementation with its SDPA mask function) and scale; masked keys get exactly zero
weight. A query with nothing to attend (a padding position, whose output nothing reads) gets the
mean of the values where SDPA gives 0: finite either way (with -inf it would be NaN, and 0 x NaN
would reach the real rows). Every query that attends something equals SDPA's result to float32
rounding (another summation order), as tested.

The switch is the model's attention implementation name, and some modeling code branches on that
name being "sdpa" (Falcon's forward takes its eager branch for any other name and would add the
boolean mask; DeepSeek-V3.2's sparse indexer skips its top-k mask), so only the families the
tests check the rollout on (`families.PACKED_FAMILIES`: greedy tokens equal `generate` and
log-probs equal the model's own forward) are switched; the others keep SDPA.

Taken only for plain float32 CPU tensors without gradients, dropout or any extra term (softcap,
sinks, position bias), and for at most MAX_QUERIES queries (decoding, short prefills); a
one-token step without a mask (no row is padded, so transformers skips it) attends every key, as
SDPA does. Every other call, a maskless prefill among them (causal by SDPA's flag), goes to
transformers' SDPA function unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from gcfamily.core.families import PACKED_FAMILIES

ENABLED = True
"""Switch for tests and benchmarks."""

KEY = "gcfamily_cpu"
# Past this many queries SDPA's kernel is faster: 128 prompts of Q queries on Q + 32 keys, 2 threads, SDPA / here:
# Q = 1: 2.9 / 1.3 ms, 8: 9.2 / 3.3, 28: 18.9 / 11.6, 64: 60 / 34, 128: 168 / 176, 256: 420 / 722 (it holds all the scores)
MAX_QUERIES = 64
# keyword arguments that do not change what SDPA computes from the mask (the mask already holds a sliding window)
_HARMLESS = frozenset(
    {"sliding_window", "position_ids", "cache_position", "use_cache", "output_attentions", "layer_idx", "is_causal"}
)


def _mask_ok(mask: Any, B: int, H: int, Q: int, S: int) -> bool:
    return (
        isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and mask.ndim == 4
        and mask.shape[0] in (1, B)
        and mask.shape[1] in (1, H)
        and tuple(mask.shape[2:]) == (Q, S)
    )


def _plain(query: torch.Tensor, key: torch.Tensor, mask: Any, dropout: float, kwargs: dict[str, Any]) -> bool:
    B, H, Q, _ = query.shape
    # no mask, one query: every key (SDPA's is_causal is off)
    return (
        query.device.type == "cpu"
        and query.dtype == key.dtype == torch.float32
        and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
        and not dropout
        and Q <= MAX_QUERIES
        and (_mask_ok(mask, B, H, Q, key.shape[2]) or (mask is None and Q == 1))
        and key.shape[0] == B  # SDPA broadcasts a batch-1 query (learned queries); this path does not
        and H % key.shape[1] == 0
        and all(k in _HARMLESS or v is None or v is False for k, v in kwargs.items())
    )


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, H, Q, D], key [B, Hk, S, D], value [B, Hk, S, Dv] -> [B, Q, H, Dv]."""
    if not _plain(query, key, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    B, H, Q, D = query.shape
    Hk, S = key.shape[1], key.shape[2]
    g = H // Hk
    scale = scaling if scaling is not None else D**-0.5
    # query head h reads KV head h // g (transformers' repeat_kv): stack each KV head's g query heads
    s = torch.matmul(query.reshape(B, Hk, g * Q, D), key.transpose(-1, -2)).mul_(scale)  # [B, Hk, g*Q, S]
    if attention_mask is not None:
        per_head = attention_mask.shape[1] != 1
        m = attention_mask.view(-1, Hk, g, Q, S) if per_head else attention_mask.view(-1, 1, 1, Q, S)
        s.view(B, Hk, g, Q, S).masked_fill_(~m, torch.finfo(s.dtype).min)
    out = torch.matmul(s.softmax(-1), value)  # [B, Hk, g*Q, Dv]
    return out.view(B, H, Q, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(KEY, attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(KEY, sdpa_mask)  # the same masks as SDPA


def _configs(config: Any) -> Iterator[Any]:
    yield config
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation_internal"):
            yield from _configs(sub)


@contextlib.contextmanager
def rollout_attention(model: torch.nn.Module) -> Iterator[bool]:
    """Inside the block, `model`'s SDPA attention runs through `attention` (CPU, gradients off, a family the tests check);
    yields whether it was switched.

    The switch is the config's attention implementation, restored as it was, config by config, when
    the block ends. Calls `attention` cannot take exactly still go to SDPA.
    """
    checked = getattr(model.config, "model_type", None) in PACKED_FAMILIES
    on = ENABLED and checked and not torch.is_grad_enabled() and model.device.type == "cpu"
    switched = (
        [c for c in _configs(model.config) if getattr(c, "_attn_implementation_internal", None) == "sdpa"] if on else []
    )
    try:
        for c in switched:
            c._attn_implementation_internal = KEY
        yield bool(switched)
    finally:
        for c in switched:
            c._attn_implementation_internal = "sdpa"
