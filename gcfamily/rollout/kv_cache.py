"""The KV cache of the native sampler: preallocated layers that grow by a view, or HF's DynamicCache where a layer is not
plain full attention (sliding windows, hybrid layers)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class _GrowingLayer(DynamicLayer):
    """A KV-cache layer with preallocated [B, H, capacity, D] buffers.

    Attention gets a view of the filled part, so a new token costs one small copy instead of the
    `torch.cat` of the whole cache that `DynamicLayer` does every step.
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, _ = key_states.shape
        self.device = key_states.device
        self.k_buf = key_states.new_empty(B, H, self.capacity, key_states.shape[-1])  # [B, H, cap, Dk]
        self.v_buf = value_states.new_empty(B, H, self.capacity, value_states.shape[-1])  # [B, H, cap, Dv]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, self.length = self.length, self.length + key_states.shape[-2]
        self.k_buf[:, :, start : self.length] = key_states
        self.v_buf[:, :, start : self.length] = value_states
        self.keys, self.values = self.k_buf[:, :, : self.length], self.v_buf[:, :, : self.length]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.k_buf, self.v_buf = self.k_buf.index_select(0, indices), self.v_buf.index_select(0, indices)
        self.keys, self.values = self.k_buf[:, :, : self.length], self.v_buf[:, :, : self.length]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self.k_buf.shape[0], device=self.device).repeat_interleave(repeats))


def _make_cache(model, capacity: int) -> Cache:
    """Growing preallocated layers when every layer is plain full attention, else HF's DynamicCache."""
    config = model.config.get_text_config(decoder=True)
    sliding = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    layer_types = getattr(config, "layer_types", None) or [sliding] * config.num_hidden_layers
    if all(t == "full_attention" for t in layer_types):
        return Cache(layers=[_GrowingLayer(capacity) for _ in layer_types])
    return DynamicCache(config=model.config)
