"""Rollout: sampling G completions per prompt from the policy, with the log-prob each token had when it was drawn.

    backend.py     the interface every sampling path calls (RolloutBackend: generate, weights_changed, close) and the
                   engines by name (BACKENDS; build_backend)
    native.py      the native sampler: batched, KV-cached, one forward per new token (generate, Rollout)
    kv_cache.py    its KV cache: preallocated layers that grow by a view
    decode.py      its decode step of fixed shapes, compiled once (rollout_compile)
    recompute.py   sampling without a cache, for models whose state a KV cache cannot hold
    sampling.py    drawing one token per row from logits: SamplingSettings, sample_tokens

A run samples through its backend (Services.generate); `generate` is the native sampler itself, for its tests.
"""

from __future__ import annotations

from gcfamily.core.memory import release_free_heap
from gcfamily.rollout.backend import BACKENDS, NativeBackend, RolloutBackend, build_backend
from gcfamily.rollout.native import Rollout, context_length, generate
from gcfamily.rollout.sampling import SamplingSettings, sample_tokens

__all__ = [
    "BACKENDS",
    "NativeBackend",
    "Rollout",
    "RolloutBackend",
    "SamplingSettings",
    "build_backend",
    "context_length",
    "generate",
    "release_free_heap",
    "sample_tokens",
]
