"""A decode step of fixed shapes for the rollout, compiled once: KV slots, batch buckets, torch.compile.

The eager rollout grows its KV cache by one column a step and shrinks the batch as rows end, so
every step has new shapes, and on a GPU each token pays a full round of kernel launches from Python
(about 30 ms a token for a 135M model at batch 64 on an H200: launch-bound). Here instead:

- each layer's keys and values live in [R, H, S, D] buffers allocated once per (rows, slots) and
  kept across rollouts (S = longest prompt + max_new_tokens, rounded up to a multiple of 64), and
  a step writes one slot;
- attention reads all S slots through a boolean mask [R, 1, 1, S] (True = attend) that the loop
  opens one slot at a time, so nothing in a step's shapes depends on how far decoding has gone;
- the batch runs at a bucket size (R, then the powers of two below it, down to 2); when the rows
  still running fit a smaller bucket they are copied to the front, and rows that ended inside a
  bucket are computed and ignored;
- the one-token step is `torch.compile`d once with a dynamic batch dimension (on CUDA in mode
  "reduce-overhead": one CUDA graph is captured per bucket size and replayed).

It computes the same function as the eager step: the same weights, positions and attended tokens
(masked slots get probability exactly 0), so tokens agree up to float summation order; the tests
check greedy tokens against `model.generate` and sampled ones against the eager rollout, compiled
and not. Taken only where that holds by construction: every layer full attention through SDPA
(which reads the 4D boolean mask as is), plain tensors (no DTensor shards); otherwise the rollout
decodes eagerly. On the CPU compilation does not pay (SmolLM2-135M at batch 64, one thread: 676 ms a
step compiled against 406 eager), so `rollout_compile: auto` compiles on CUDA only.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from gcfamily.core import float32_parts
from gcfamily.errors import GcfError

SLOT_ROUND = 64  # slot counts are rounded up to this, so prompts of similar length share buffers and graphs
_KEEP = 2  # decoders kept per model (training rollouts and evaluation use different row counts)
_DECODERS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, StaticDecoder]] = weakref.WeakKeyDictionary()
MODES = ("auto", "on", "off")
_FAILED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models whose compilation failed under auto
_COMPILED: dict = {}  # torch.compile's mode -> the compiled step (graphs are kept per model and shape by dynamo)


class _SlotLayer(CacheLayerMixin):
    """One layer's KV cache as views of fixed buffers; `update` writes the step's key and value at `slot`."""

    is_compileable = True
    is_sliding = False

    def __init__(self, slot: torch.Tensor, slots: int):
        super().__init__()
        self.slot, self.slots = slot, slots
        self.is_initialized = True

    # buffers come from the decoder
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.keys.index_copy_(2, self.slot, key_states)  # [b, H, S, D] at slot; one query token a step
        self.values.index_copy_(2, self.slot, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slots, 0

    def get_seq_length(self) -> int:
        return self.slots

    def get_max_length(self) -> int:
        return self.slots


def mode_ok(mode: str) -> str:
    if mode not in MODES:
        raise GcfError(f"rollout_compile must be one of {', '.join(MODES)} (got {mode!r}).")
    return mode


def why_not(model: torch.nn.Module) -> str | None:
    """Why this model cannot take the static decode exactly (a phrase), or None when it can."""
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None) or (
        ["sliding_attention"] * config.num_hidden_layers if getattr(config, "sliding_window", None) else None
    )
    if types is not None and any(t != "full_attention" for t in types):
        return "its layers are not all full attention"
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return f"its attention implementation is {getattr(model.config, '_attn_implementation', None)!r}, not sdpa"
    if any(type(p.data) is not torch.Tensor for p in model.parameters()):
        return "its parameters are sharded tensors"
    if any(float32_parts.kept(m) for m in model.modules()):  # their hooks switch autocast inside the step
        return "float32_components keeps some of its modules in float32"
    return None


def wanted(model: torch.nn.Module, mode: str) -> bool:
    """Whether the rollout should decode through the compiled static step: `on`, or `auto` on CUDA; and the model allows it."""
    if mode == "off" or (mode == "auto" and model.device.type != "cuda") or model in _FAILED:
        return False
    return why_not(model) is None


def compile_failed(error: BaseException, model: torch.nn.Module, mode: str) -> bool:
    """Whether `error` is torch.compile's own (then, under auto, this model decodes eagerly from now on, said once)."""
    if not type(error).__module__.startswith(("torch._dynamo", "torch._inductor")):
        return False
    first = (str(error).strip().splitlines() or [""])[0][:200]
    if mode == "on":
        raise GcfError(
            f"rollout_compile=on, but compiling the decode step failed ({type(error).__name__}: {first}); "
            "set rollout_compile=off (or auto, which falls back to eager decoding)."
        ) from error
    _FAILED.add(model)
    print(
        f"[gcf] compiling the decode step failed ({type(error).__name__}: {first}); decoding eagerly (exact, slower).",
        file=sys.stderr,
    )
    return True


def buckets(rows: int) -> list[int]:
    """Batch sizes a rollout of `rows` rows runs at, largest first: rows, then the powers of two below it, down to 2."""
    out, b = [max(rows, 2)], 2
    while b < rows:
        out.append(b)
        b *= 2
    return sorted(set(out), reverse=True)


def decoder(model: torch.nn.Module, rows: int, slots: int) -> StaticDecoder:
    """The model's decoder for `rows` rows and at least `slots` slots (kept between rollouts: graphs and buffers are reused)."""
    slots = -(-slots // SLOT_ROUND) * SLOT_ROUND
    kept = _DECODERS.setdefault(model, {})
    dev = model.device.type
    compute = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else model.dtype  # the KV cache's dtype
    key = (rows, slots, compute, model.device)
    if key not in kept:
        while len(kept) >= _KEEP:
            kept.pop(next(iter(kept)))
        kept[key] = StaticDecoder(model, rows, slots)
    else:
        kept[key] = kept.pop(key)  # most recently used last
    return kept[key]


def _one_token(
    model: torch.nn.Module, cache: Cache, cache_kw: str, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The compiled step: logits [b, V] of the next token after ids [b, 1] at positions pos [b, 1], attending where mask [b, 1, 1, S]."""
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **{cache_kw: cache}
    )
    return out.logits[:, -1]


class StaticDecoder:
    """Fixed KV buffers for `rows` rows and `slots` positions, and the compiled one-token step over them."""

    def __init__(self, model: torch.nn.Module, rows: int, slots: int):
        # The model is not held here (a decoder is kept per model in a WeakKeyDictionary; holding it would keep it alive)
        self.rows, self.slots = max(rows, 2), slots
        self.sizes = buckets(rows)
        self.device = model.device
        self.cuda = self.device.type == "cuda"
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)  # the slot this step writes
        self.mask = torch.zeros(self.rows, 1, 1, slots, dtype=torch.bool, device=self.device)  # True = attend
        self.ids = torch.zeros(self.rows, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(self.rows, 1, dtype=torch.long, device=self.device)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.cache: Cache | None = None
        self.size = self.rows
        import inspect

        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        mode = "reduce-overhead" if self.cuda else None
        if mode not in _COMPILED:
            _COMPILED[mode] = torch.compile(_one_token, mode=mode)
        self.compiled = _COMPILED[mode]

    def load(self, prefill: Cache, G: int, prompt_mask: torch.Tensor) -> None:
        """Take the prefilled KV cache of n prompts (each row repeated G times) into slots [0, P); every later slot is closed."""
        n, P = prompt_mask.shape
        N = n * G
        if N > self.rows or P > self.slots:  # pragma: no cover - decoder() sizes the buffers
            raise GcfError(
                f"the static decoder holds {self.rows} rows of {self.slots} slots; got {N} rows of a {P}-token prompt."
            )
        layers = prefill.layers
        if not self.keys:
            for layer in layers:
                k, v = layer.keys, layer.values  # [n, H, P, D]
                self.keys.append(k.new_zeros(self.rows, k.shape[1], self.slots, k.shape[3]))
                self.values.append(v.new_zeros(self.rows, v.shape[1], self.slots, v.shape[3]))
            if self.cuda:  # the buffers keep their addresses for good, so captured graphs read them in place
                for t in [*self.keys, *self.values, self.slot, self.mask, self.ids, self.pos]:
                    torch._dynamo.mark_static_address(t, guard=False)
            self.cache = Cache(layers=[_SlotLayer(self.slot, self.slots) for _ in layers])
        for kb, vb, layer in zip(self.keys, self.values, layers):
            kb.zero_(), vb.zero_()  # stale slots are masked; zeros keep a masked product exactly 0
            # [n, G, H, P, D] <- [n, 1, H, P, D]
            kb[:N].view(n, G, *kb.shape[1:])[:, :, :, :P].copy_(layer.keys[:, None])
            vb[:N].view(n, G, *vb.shape[1:])[:, :, :, :P].copy_(layer.values[:, None])
        self.mask.zero_()
        self.mask[:N, 0, 0, :P] = prompt_mask.bool().repeat_interleave(G, 0)
        self.mask[N:] = self.mask[:1]  # spare rows copy row 0, so no row is wholly masked
        self.size = self.bucket(N)
        self._views()

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds n rows."""
        return min(b for b in self.sizes if b >= n)

    def _views(self) -> None:
        b = self.size
        assert self.cache is not None
        for i, layer in enumerate(self.cache.layers):
            layer.keys, layer.values = self.keys[i][:b], self.values[i][:b]
            self._mark(layer.keys, layer.values)

    def _mark(self, *views: torch.Tensor) -> None:
        """Batch dimension dynamic (one trace for every bucket); on CUDA, fixed addresses, so a captured graph reads and
        writes the buffers in place (a slice does not inherit its base's mark; unmarked, it would be copied in each replay)."""
        for t in views:
            torch._dynamo.mark_dynamic(t, 0)
            if self.cuda:
                torch._dynamo.mark_static_address(t, guard=False)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the current bucket, in order) at the front, and run at the smallest bucket holding them."""
        n = len(rows)
        for kb, vb in zip(self.keys, self.values):
            kb[:n] = kb[rows]
            vb[:n] = vb[rows]
        self.mask[:n] = self.mask[rows]
        self.size = self.bucket(n)
        self._views()

    def step(self, model: torch.nn.Module, tok: torch.Tensor, pos: torch.Tensor, slot: int) -> torch.Tensor:
        """Logits [len(tok), V] for the next token of the first len(tok) rows, which feed `tok` at positions `pos` into `slot`."""
        A, b = len(tok), self.size
        self.ids[:A, 0], self.pos[:A, 0] = tok, pos
        self.slot.fill_(slot)
        self.mask[:, 0, 0, slot] = True
        ids, position, mask = self.ids[:b], self.pos[:b], self.mask[:b]
        self._mark(ids, position, mask)
        logits = self.compiled(model, self.cache, self.cache_kw, ids, position, mask)
        return logits[:A].clone() if self.cuda else logits[:A]  # a graph's output is overwritten by its next replay
