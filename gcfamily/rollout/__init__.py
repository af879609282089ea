"""Rollout: sampling G completions per prompt from the policy, with the log-prob each token had when it was drawn.

    native.py      the native sampler: batched, KV-cached, one forward per new token (generate, Rollout)
    kv_cache.py    its KV cache: preallocated layers that grow by a view
    decode.py      its decode step of fixed shapes, compiled once (rollout_compile)
    recompute.py   sampling without a cache, for models whose state a KV cache cannot hold
    sampling.py    drawing one token per row from logits: SamplingSettings, sample_tokens

A code path that samples imports `generate` and `SamplingSettings` from here.
"""

from __future__ import annotations

from gcfamily.core.memory import release_free_heap
from gcfamily.rollout.native import Rollout, context_length, generate
from gcfamily.rollout.sampling import SamplingSettings, sample_tokens

__all__ = ["Rollout", "SamplingSettings", "context_length", "generate", "release_free_heap", "sample_tokens"]
